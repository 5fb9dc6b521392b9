"""The main job: build models, start workers from receiver configs, run update rounds, verify, time.

Each round makes an optimizer-like in-place change to every model, then
``send()``s it. Every worker reports a checksum of the weights it holds after
each version it applies; the trainer compares it with its own for that
version. Workers are processes the job starts, or for the Ray schemes Ray
actors (:mod:`weightsync.app.ray_workers`). They never see the sender object: they get
``scheme.receiver_config(i)``, plain data, and build their side with
:func:`weightsync.config.from_config`.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import re
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from .. import checks
from ..config import SCHEMES, from_config
from ..config.receiver import check_available
from ..core.scheme import WeightSyncScheme
from ..core.timing import deadline_after, remaining, shown_seconds
from ..errors import ConfigurationError, ConnectionClosedError, WeightSyncError
from ..schemes.no_sync import NoWeightSyncScheme
from ..schemes.ray import RayWeightSyncScheme
from ..tensors.layout import wire_dtype_from_name
from .early import PRELOAD
from .models import build_model, checksum, model_specs

__all__ = ["JobConfig", "resolve_schemes", "run_job"]

log = logging.getLogger("weightsync.app")

#: The largest model the job builds, in MB (a terabyte).
MAX_SIZE_MB = 1e6
#: Seconds a worker's loop waits for an update before it looks whether it must stop.
RECEIVE_WAIT_S = 0.05
#: Seconds the trainer waits for a worker's report at a time, between looks at whether its process exited.
REPORT_SLICE_S = 0.2


@dataclass
class JobConfig:
    """Schema of the main job's config (``conf/config.yaml`` fills it in)."""

    num_workers: int = 2
    rounds: int = 20
    seed: int = 0
    progress: bool = True
    # How workers start; None: forkserver where the platform has it, else spawn.
    start_method: Optional[str] = None  # noqa: UP045 - omegaconf 2.3 reads typing.Optional
    worker_timeout: float = 120.0
    # The fraction of each model's values a round changes, in (0, 1]: under 1, the rest keep their bits, as most do
    # between two steps of fine-tuning (docs/delta.md), and a scheme with delta=auto sends the changes.
    changed: float = 1.0
    # Each model's size_mb and tensors (weightsync.app.models.ModelSpec), checked by model_specs: untyped here, so
    # that `'+models.critic={size_mb:1}'` adds one (omegaconf 2.3 assigns no mapping to a dataclass-typed value).
    models: dict[str, Any] = field(default_factory=dict)
    schemes: dict[str, Any] = field(default_factory=dict)
    scheme: Any = None


def resolve_schemes(cfg: DictConfig) -> dict[str, DictConfig]:
    """Each model's scheme config; a plain name (``schemes.value=shared_mem``) picks that scheme's defaults.

    Raises:
        ConfigurationError: an unknown scheme name, or models and schemes that do not pair up.
    """
    models, out = set(cfg.models), {}
    for model_id in cfg.schemes:
        node = cfg.schemes[model_id]
        if isinstance(node, str):
            if node not in SCHEMES:
                raise ConfigurationError(f"schemes.{model_id}={node!r}: unknown scheme; known: {sorted(SCHEMES)}")
            node = OmegaConf.structured(SCHEMES[node])
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigurationError(f"schemes.{model_id} must be a scheme config or a scheme name, got {node!r}")
        out[model_id] = node
    if set(out) != models:
        raise ConfigurationError(
            f"every model needs a scheme and every scheme a model: models {sorted(models)}, schemes {sorted(out)}"
        )
    return out


def _scheme_keys(cfg: DictConfig) -> dict[str, str]:
    """The override that sets each model's scheme, which an error about it names: ``scheme`` where it follows the
    default scheme (``${scheme}``, or another model's that does: ``${schemes.value}``), else ``schemes.<model>``,
    followed by ``=`` where it is given by name (``schemes.value=rpc``: ``schemes.value.<option>`` cannot follow a
    name)."""
    raw = OmegaConf.to_container(cfg.schemes, resolve=False)
    assert isinstance(raw, dict)
    keys = {}
    for m in raw:
        key, node, seen = f"schemes.{m!s}", raw[m], {m}
        while isinstance(node, str):
            if node == "${scheme}":
                key = "scheme"
                break
            other = re.fullmatch(r"\$\{schemes\.(\w+)\}", node)
            if other is None or other.group(1) not in raw or other.group(1) in seen:
                key += "" if node.startswith("${") else "="  # (another interpolation: no name, no hint)
                break
            key, node = f"schemes.{other.group(1)}", raw[other.group(1)]
            seen.add(other.group(1))
        keys[str(m)] = key
    return keys


def _worker(idx: int, configs: dict, specs: dict, reports, stop) -> None:
    """A worker process: build each model, join each scheme from its receiver config, report every version."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C reaches the trainer too, whose shutdown ends this one)
    torch.set_num_threads(1)
    schemes, models = {}, {}
    threads: list[threading.Thread] = []
    leaving = threading.Event()  # this process leaves (a failure here): its receive threads end too
    try:
        for model_id, cfg in configs.items():
            models[model_id] = build_model(specs[model_id])
            # This process's parent, the trainer, wrote these configs (an rpc one only after its own opt-in passed:
            # _check_opt_ins): it is trusted with what the engines unpickle.
            schemes[model_id] = from_config(cfg, allow_pickle=True, allow_store_peers_to_run_code=True)
            schemes[model_id].init_on_receiver(model=models[model_id])
        for model_id, scheme in schemes.items():
            scheme.connect()
            reports.put(("applied", idx, model_id, scheme.version, checksum(models[model_id])))
        # Local schemes wake this loop when the trainer writes; each other model has a thread blocked in its own
        # receive(), which its engine wakes (polled from this loop, each update waited for the poll: up to 10 ms).
        channels = {m: s.receiver_transport.channel.connection for m, s in schemes.items() if _has_channel(s)}
        open_models = {m for m, s in schemes.items() if not isinstance(s, NoWeightSyncScheme)}
        for model_id in sorted(open_models - set(channels)):
            args = (idx, model_id, schemes[model_id], models[model_id], reports, (stop, leaving))
            threads.append(threading.Thread(target=_receive_loop, args=args, name=f"receive-{model_id}"))
            threads[-1].start()
        open_models &= set(channels)
        while not stop.is_set() and (open_models or any(t.is_alive() for t in threads)):
            if not open_models:
                stop.wait(RECEIVE_WAIT_S)
                continue
            wait([channels[m] for m in open_models], timeout=RECEIVE_WAIT_S)
            for model_id in sorted(open_models):
                scheme = schemes[model_id]
                try:
                    if scheme.receive(0.0) is not None:
                        reports.put(("applied", idx, model_id, scheme.version, checksum(models[model_id])))
                except ConnectionClosedError:
                    open_models.discard(model_id)  # the trainer is done with this model
    except Exception as exc:  # noqa: BLE001 - reported to the trainer, which names the worker
        reports.put(("failed", idx, f"{type(exc).__name__}: {exc}"))
    finally:
        leaving.set()
        for thread in threads:  # each ends within one receive once stop is set or its sender said goodbye
            thread.join(2 * RECEIVE_WAIT_S + 1.0)
        for scheme in schemes.values():
            scheme.shutdown()


def _receive_loop(idx: int, model_id: str, scheme: WeightSyncScheme, model: nn.Module, reports, stops: tuple) -> None:
    """Worker ``idx``'s loop for one model of a network scheme: receive (woken by its engine when an update comes)
    and report every version, until one of ``stops`` is set or the trainer is done with the model."""
    try:
        while not any(event.is_set() for event in stops):
            if scheme.receive(RECEIVE_WAIT_S) is not None:
                reports.put(("applied", idx, model_id, scheme.version, checksum(model)))
    except ConnectionClosedError:
        return  # the trainer is done with this model
    except Exception as exc:  # noqa: BLE001 - reported to the trainer, which names the worker
        reports.put(("failed", idx, f"{type(exc).__name__}: {exc}"))


def _has_channel(scheme: WeightSyncScheme) -> bool:
    return hasattr(scheme.receiver_transport, "channel")


def _perturb(model: nn.Module, gen: torch.Generator, changed: float = 1.0) -> None:
    """An optimizer-like in-place change of about ``changed`` of the values (the others keep their bits)."""
    with torch.no_grad():
        for p in model.parameters():
            step = torch.randn(p.shape, generator=gen) * 1e-3
            if changed < 1:
                p.copy_(torch.where(torch.rand(p.shape, generator=gen) < changed, p + step, p))
            else:
                p.add_(step)


def _process_context(
    start_method: str | None,
) -> mp.context.ForkServerContext | mp.context.SpawnContext | mp.context.ForkContext:
    """How the job starts its worker processes. ``None``: forkserver where the platform has it (each worker is
    forked from a server that imported torch and weightsync once: a worker starts in a fraction of a second,
    against seconds spawned), else spawn.

    Raises:
        ConfigurationError: a start method this platform does not have (named, with those it has).
    """
    methods = mp.get_all_start_methods()
    if start_method is None:
        start_method = "forkserver" if "forkserver" in methods else "spawn"
    if start_method not in methods:
        raise ConfigurationError(f"start_method must be one of {methods} on this platform, got {start_method!r}")
    if start_method == "forkserver":
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # (started already by `python -m weightsync`, with the same list)
        return ctx
    # The start methods are these three: what is left of those this platform has is fork.
    return mp.get_context("spawn") if start_method == "spawn" else mp.get_context("fork")


def run_job(cfg: DictConfig, progress: Any = None) -> list[dict[str, Any]]:
    """Run the job described by ``cfg``; return one result row per model.

    Every error is raised before a worker process starts when it can be
    (unknown scheme, bad sizes, invalid scheme arguments).
    """
    from hydra.utils import instantiate

    scheme_cfgs = resolve_schemes(cfg)
    specs = model_specs(cfg.models)
    for m, spec in specs.items():  # (a size that is no number, or beyond any host, fails here and by name)
        if not math.isfinite(spec["size_mb"]) or not 0 < spec["size_mb"] <= MAX_SIZE_MB:
            raise ConfigurationError(f"models.{m}.size_mb must be in (0, {MAX_SIZE_MB:g}], got {spec['size_mb']}")
    n = int(cfg.num_workers)
    if n < 1 or int(cfg.rounds) < 1:
        raise ConfigurationError(f"num_workers and rounds must be >= 1, got {n} and {cfg.rounds}")
    checks.seconds(cfg.worker_timeout, "worker_timeout")
    changed = float(cfg.get("changed", 1.0))  # (a config made before the option holds none)
    if not 0 < changed <= 1:  # (NaN too)
        raise ConfigurationError(f"changed (the fraction of values a round changes) must be in (0, 1], got {changed}")
    if not 0 <= int(cfg.seed) < 2**63:  # (torch's generator takes a 64-bit seed)
        raise ConfigurationError(f"seed must be in [0, 2**63), got {cfg.seed}")
    torch.manual_seed(int(cfg.seed))
    models = {m: build_model(spec) for m, spec in specs.items()}
    for model in models.values():
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    schemes: dict[str, WeightSyncScheme] = {}
    keys = _scheme_keys(cfg)
    for model_id, scheme_cfg in scheme_cfgs.items():
        schemes[model_id] = _instantiate_scheme(instantiate, scheme_cfg, keys[model_id].rstrip("="))
        log.info(
            "model %r (%g MB in %d tensors): %s to %d workers, %d rounds, options %s", model_id,
            specs[model_id]["size_mb"], specs[model_id]["tensors"], type(schemes[model_id]).__name__, n,
            int(cfg.rounds), {"transport": schemes[model_id].transport_name, **schemes[model_id].option_values()},
        )  # fmt: skip
    _check_before_start(schemes, keys, n)
    # Ray schemes' workers are Ray actors the job starts; every other scheme's are processes.
    on_ray = {m for m, s in schemes.items() if isinstance(s, RayWeightSyncScheme)}
    in_procs = {m: s for m, s in schemes.items() if m not in on_ray}
    ctx = _process_context(cfg.start_method)
    procs: list = []
    actors = stop = None
    try:
        if on_ray:
            from .ray_workers import RayWorkers

            actors = RayWorkers({m: schemes[m] for m in on_ray}, specs, n, float(cfg.worker_timeout))
        for model_id, scheme in schemes.items():
            extra = actors.sender_kwargs(scheme) if actors is not None and model_id in on_ray else {}
            try:
                scheme.init_on_sender(model_id=model_id, model=models[model_id], num_workers=n, **extra)
            except ConfigurationError as exc:  # (what this process cannot run: nccl without CUDA, say)
                raise ConfigurationError(f"{keys[model_id].rstrip('=')}: {exc.detail}") from None
        reports, stop = ctx.Queue(), ctx.Event()
        for i in range(n if in_procs else 0):
            configs = {m: s.receiver_config(i) for m, s in in_procs.items()}
            proc = ctx.Process(target=_worker, args=(i, configs, specs, reports, stop), daemon=True)
            proc.start()
            procs.append(proc)  # (once started: a start interrupted, by a SIGTERM, has no process to join)
        if actors is not None:
            actors.join({m: schemes[m] for m in on_ray})
        times: dict[str, list[float]] = {m: [] for m in schemes}
        collector = _Collector(reports, procs, float(cfg.worker_timeout), schemes)
        for model_id, scheme in schemes.items():
            scheme.connect(processes=procs if model_id in in_procs else None)  # a worker that dies is named at once
            collector.promise(model_id, models[model_id])
        moving = {m for m, s in schemes.items() if not isinstance(s, NoWeightSyncScheme)}
        if actors is not None:  # an actor's update is applied when the send returns: ask for its state
            for report in actors.reports():
                collector.record(report)
        collector.expect(moving, n)
        log.info("every worker holds the initial versions: %d rounds begin", int(cfg.rounds))
        gen = torch.Generator().manual_seed(int(cfg.seed) + 1)
        rounds = range(1, int(cfg.rounds) + 1)
        for _ in progress(rounds) if progress else rounds:
            for model_id, scheme in schemes.items():
                _perturb(models[model_id], gen, changed)
                times[model_id].append(_timed_send(scheme))
                collector.promise(model_id, models[model_id])
                if model_id in moving:  # workers check this version before the next send is timed
                    for report in actors.reports(model_id) if actors is not None and model_id in on_ray else []:
                        collector.record(report)
                    collector.expect({model_id}, n)
    finally:
        for scheme in schemes.values():
            scheme.shutdown()
        if stop is not None:
            stop.set()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        if actors is not None:
            actors.close()
    return [
        _row(
            model_id,
            schemes[model_id],
            sum(p.numel() * p.element_size() for p in models[model_id].parameters()),
            n,
            times[model_id],
            collector.verified(model_id) if model_id in moving else "n/a (no_sync)",
        )
        for model_id in schemes
    ]


def _check_before_start(schemes: dict[str, WeightSyncScheme], keys: dict[str, str], num_workers: int) -> None:
    """Refuse, before any process or actor starts, an rpc scheme the command line did not opt in to what it allows,
    and a ``ray_module_transform`` scheme with more than one worker (it hosts the module in one actor).

    Raises:
        ConfigurationError: one line, naming the override that set the scheme (``keys``, :func:`_scheme_keys`)
            and the one that opts in, or the worker count.
    """
    from ..schemes.ray import RayModuleTransformScheme
    from ..schemes.rpc import RPCWeightSyncScheme

    for model_id, scheme in schemes.items():
        if isinstance(scheme, RayModuleTransformScheme) and num_workers != 1:
            raise ConfigurationError(
                f"{keys[model_id].rstrip('=')}: ray_module_transform hosts the module in ONE actor; run it with "
                f"num_workers=1 (got {num_workers})"
            )
        if isinstance(scheme, RPCWeightSyncScheme) and not scheme.allow_store_peers_to_run_code:
            key = keys[model_id]
            if key.endswith("="):  # (picked by name: options come only with the scheme given whole)
                key = key[:-1]
                opt_in = f"'{key}={{_target_:weightsync.RPCWeightSyncScheme,allow_store_peers_to_run_code:true}}'"
            elif key == "scheme":
                opt_in = "scheme.allow_store_peers_to_run_code=true"
            else:  # (given whole: the field is added to it)
                opt_in = f"++{key}.allow_store_peers_to_run_code=true"
            raise ConfigurationError(
                f"{key}: the rpc scheme lets every process that can reach its TCP store (every local user on "
                f"loopback) run any code in this process and its workers; give {opt_in} only if every such process "
                f"is yours, or use {key}=distributed"
            )


def _instantiate_scheme(instantiate: Any, scheme_cfg: DictConfig, key: str) -> WeightSyncScheme:
    """The scheme ``scheme_cfg`` builds; an error names ``key``, the override that set it."""
    check_available(scheme_cfg._target_)
    try:
        built = instantiate(scheme_cfg)
    except Exception as exc:  # Hydra wraps the target's error; surface ours as it is, name the model otherwise
        cause = exc.__cause__ or exc
        if type(cause) is ConfigurationError:  # a scheme's own check: say which model's scheme (and node) it was
            # Hydra's message says which node's target failed: the scheme's own, or its transport or strategy.
            node = re.search(r"^full_key: \S*?\b(transport|strategy)$", str(exc), re.MULTILINE)
            where = key + (f".{node.group(1)}" if node else "")
            raise ConfigurationError(f"{where}: {cause.detail}", model_id=cause.model_id) from None
        if isinstance(cause, WeightSyncError):
            raise cause from None
        raise ConfigurationError(f"{key}: cannot build {scheme_cfg._target_}: {cause}") from exc
    if not isinstance(built, WeightSyncScheme):  # (a strategy or settings class given whole: a traceback later)
        raise ConfigurationError(
            f"{key}: {scheme_cfg._target_} builds a {type(built).__name__}, not a weight-sync scheme; name a scheme "
            f"({key}=shared_mem, say)"
        )
    return built


def _timed_send(scheme: WeightSyncScheme) -> float:
    start = time.perf_counter()
    scheme.send()
    if not scheme.sync:
        scheme.wait_async()
    return time.perf_counter() - start


class _Collector:
    """Reads workers' reports and checks each against the trainer's checksum for that version.

    ``expected`` (model -> version -> checksum) is the trainer's live record, filled in by :meth:`promise` as it
    sends.
    """

    def __init__(self, reports: Any, procs: list, timeout: float, schemes: dict[str, WeightSyncScheme]) -> None:
        self.reports, self.procs, self.timeout, self.schemes = reports, procs, timeout, schemes
        self.expected: dict[str, dict[int, str]] = {m: {} for m in schemes}
        self.seen: dict[tuple[int, str], dict[int, str]] = {}
        self.mismatches: dict[str, list] = {}
        self.checked: dict[str, int] = {}

    def promise(self, model_id: str, model: nn.Module) -> None:
        """Record the checksum every worker must report for the version its scheme just published of ``model``."""
        scheme = self.schemes[model_id]
        version = scheme.version
        assert version is not None, "connect() and send() each publish a version"
        self.expected[model_id][version] = checksum(model, wire_dtype_from_name(scheme.wire_dtype))

    def expect(self, model_ids: set[str], n: int) -> None:
        """Wait until every worker reported the latest version of each of ``model_ids`` (bounded by the timeout)."""
        import queue

        latest = {m: max(self.expected[m]) for m in model_ids}
        deadline = deadline_after(self.timeout)
        while True:
            missing = [(w, m) for w in range(n) for m in latest if latest[m] not in self.seen.get((w, m), {})]
            if not missing:
                return
            try:  # (in slices: a worker process found gone is named at once, once it has nothing left to say)
                report = self.reports.get(timeout=max(0.0, min(REPORT_SLICE_S, remaining(deadline))))
            except queue.Empty:
                gone = {w: p.exitcode for w, p in enumerate(self.procs) if not p.is_alive()}
                late = sorted({w for w, _ in missing})
                exited = [w for w in late if w in gone]
                if exited:
                    raise WeightSyncError(
                        f"worker processes {exited} exited (codes {[gone[w] for w in exited]}) before reporting "
                        f"{', '.join(f'{m} version {v}' for m, v in sorted(latest.items()))}"
                    ) from None
                if remaining(deadline) > 0:
                    continue
                raise WeightSyncError(
                    f"no report from workers {late} within {shown_seconds(self.timeout)} (dead: {sorted(gone)})"
                ) from None
            self.record(report)

    def record(self, report: tuple) -> None:
        """One worker report: ``("applied", worker, model, version, checksum)`` or ``("failed", worker, why)``."""
        kind, w, *rest = report
        if kind == "failed":
            raise WeightSyncError(f"worker {w} failed: {rest[0]}", worker_idx=w)
        model_id, version, digest = rest
        self.seen.setdefault((w, model_id), {})[version] = digest
        self.checked[model_id] = self.checked.get(model_id, 0) + 1
        if self.expected[model_id].get(version) != digest:
            self.mismatches.setdefault(model_id, []).append((w, version))

    def verified(self, model_id: str) -> str:
        if self.mismatches.get(model_id):
            return f"NO {self.mismatches[model_id][:3]}"
        return "yes" if self.checked.get(model_id) else "no reports"


def _row(model_id: str, scheme: WeightSyncScheme, nbytes: int, n: int, times: list[float], verified: str) -> dict:
    ordered = sorted(times)
    median = statistics.median(ordered)
    p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
    return {
        "scheme": type(scheme).backend_name or type(scheme).__name__,
        "model": model_id,
        "transport": scheme.transport_name or "",
        "model_mb": round(nbytes / 1e6, 3),
        "workers": n,
        "rounds": len(times),
        "sync": scheme.sync,
        "median_ms": round(median * 1e3, 3),
        "p95_ms": round(p95 * 1e3, 3),
        "gb_s": round(nbytes / median / 1e9, 3) if median > 0 else float("inf"),
        "verified": verified,
    }
