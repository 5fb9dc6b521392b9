"""Adding an engine needs no edit to weightsync (docs/design.md, "Adding an engine").

``tests/_engine_pkg/wsfile`` is an engine of its own package: a scheme moving each version through files in a
private directory. Here it is installed the way pip would leave it, a package beside its ``.dist-info`` with
an entry point in ``weightsync.backends``, on the path of a fresh Python process only (this process's registry
stays as it is). That process asks weightsync what it offers for the new engine, :func:`facts` below, and
each test checks one part of the answer: the backend, its lazy public name, its signature, a working exchange
of versions with two worker processes, its Hydra groups, receiver configs and its rows in the API reference;
and that no file under weightsync/ changed.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

import weightsync

ENGINE = Path(__file__).resolve().parent / "_engine_pkg" / "wsfile"
TESTS_ROOT = Path(__file__).resolve().parent.parent
WEIGHTSYNC_ROOT = Path(weightsync.__file__).resolve().parent.parent
SCHEME, SETTINGS = "WsFileWeightSyncScheme", "WsFileSettings"
VERSIONS = 3  # sent after the initial one
WAIT_S = 60.0  # the longest any wait of the exchange may last

pytestmark = pytest.mark.timeout(300)  # the first test to ask for the fresh process's facts waits for them


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


# ------------------------------------------------------------ in the fresh process
def _worker(handed: Any, worker_idx: int, out: Any) -> None:
    """A worker process: its side from the pickled sender (``handed`` a scheme) or a receiver config (a dict);
    applies versions until the last, reports its weights, then runs until the sender shuts down."""
    scheme = weightsync.from_config(handed) if isinstance(handed, dict) else handed
    model = _model(100 + worker_idx)  # weights of its own until the sender's arrive
    scheme.init_on_receiver(model=model, worker_idx=worker_idx)
    scheme.connect()
    deadline = time.monotonic() + WAIT_S
    while scheme.version != VERSIONS and time.monotonic() < deadline:
        scheme.receive(timeout=1.0)
    out.put((worker_idx, scheme.version, {k: v.tolist() for k, v in model.state_dict().items()}))
    try:
        while time.monotonic() < deadline:
            scheme.receive(timeout=1.0)
    except weightsync.ConnectionClosedError:
        pass
    scheme.shutdown()


def _quitter(config: dict[str, Any]) -> None:
    """A worker process that connects, then exits without a word (as a crash would)."""
    scheme = weightsync.from_config(config)
    scheme.init_on_receiver(model=_model(1))
    scheme.connect()
    os._exit(3)


def _exchange(cls: type) -> dict[str, Any]:
    """A sender and two worker processes (spawned: one gets the pickled scheme, one a receiver config) exchange
    the initial version and three more, each ``send()`` returning once both acked."""
    ctx = mp.get_context("spawn")
    trainer = _model(0)
    scheme = cls(poll_ms=1.0, checksum=True, timeout=WAIT_S, connect_timeout=WAIT_S)
    scheme.init_on_sender(model=trainer, num_workers=2)
    config = scheme.receiver_config
    directory = Path(config(0)["connection"]["directory"])
    out = ctx.Queue()
    # Worker 1 gets plain data: what a worker started by hand would read.
    procs = [ctx.Process(target=_worker, args=(handed, i, out)) for i, handed in enumerate([scheme, config(1)])]
    for p in procs:
        p.start()
    acked = []
    try:
        scheme.connect(processes=procs[1:])
        for _ in range(VERSIONS):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.mul_(-1.5).add_(0.25)
            scheme.send()
            acked.append(dict(scheme.acked_versions))  # send() blocked until both acked
        reports = {w: (version, weights) for w, version, weights in (out.get(timeout=WAIT_S) for _ in procs)}
    finally:
        scheme.shutdown()
        for p in procs:
            p.join(WAIT_S)
    expected = trainer.state_dict()
    return {
        "acked": [{str(w): v for w, v in a.items()} for a in acked],
        "versions": {str(w): version for w, (version, _) in reports.items()},
        "equal": {
            str(w): all(torch.equal(torch.tensor(weights[k]), expected[k]) for k in expected)
            for w, (_, weights) in reports.items()
        },
        "exit_codes": [p.exitcode for p in procs],
        "directory_left": directory.exists(),
    }


def _receiver_in_thread(cls: type, model: torch.nn.Module, **options: Any) -> tuple[Any, Any, list]:
    """A sender of one worker, whose receiver (from its receiver config) connects in a thread; the connect
    error of either side, if any."""
    sender = cls(poll_ms=1.0, connect_timeout=WAIT_S, **options)
    sender.init_on_sender(model=_model(0), num_workers=1)
    receiver = weightsync.from_config(sender.receiver_config(0))
    receiver.init_on_receiver(model=model)
    errors: list[BaseException] = []

    def connect() -> None:
        try:
            receiver.connect()
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            errors.append(exc)

    thread = threading.Thread(target=connect)
    thread.start()
    try:
        sender.connect()
    except Exception as exc:  # noqa: BLE001 - reported to the caller
        errors.append(exc)
    thread.join(WAIT_S)
    return sender, receiver, errors


def _failures(cls: type) -> dict[str, Any]:
    """The core's deadlines and error acks hold for the new engine: a worker that stops receiving costs a send
    its ``timeout``; a worker whose model does not fit refuses version 0, and the sender names it; a worker
    whose process exited is named at the next send."""
    sender, receiver, _ = _receiver_in_thread(cls, _model(1), timeout=1.0)
    began = time.monotonic()
    try:
        sender.send()
        late: Any = None
    except weightsync.WeightSyncError as exc:
        late = {"type": type(exc).__name__, "worker": exc.worker_idx, "version": exc.version}
    took = time.monotonic() - began
    receiver.shutdown()
    sender.shutdown()
    sender, receiver, errors = _receiver_in_thread(cls, torch.nn.Linear(3, 3), timeout=10.0)
    receiver.shutdown()
    sender.shutdown()
    sender = cls(poll_ms=1.0, timeout=WAIT_S, connect_timeout=WAIT_S)
    sender.init_on_sender(model=_model(0), num_workers=1)
    quitter = mp.get_context("spawn").Process(target=_quitter, args=(sender.receiver_config(0),))
    quitter.start()
    sender.connect(processes=[quitter])
    quitter.join(WAIT_S)
    try:
        sender.send()
        gone: Any = None
    except weightsync.WeightSyncError as exc:
        gone = {
            "type": type(exc).__name__,
            "worker": exc.worker_idx,
            "exited": f"process {quitter.pid} exited" in str(exc),
        }
    sender.shutdown()
    return {
        "late": late,
        "late_took": took,
        "gone": gone,
        "misfit": sorted(f"{type(e).__name__}: worker {e.worker_idx}" for e in errors),
        "misfit_remote": [getattr(e, "remote_type", None) for e in errors if hasattr(e, "remote_type")],
    }


def _hydra() -> dict[str, Any]:
    from hydra import compose, initialize
    from hydra.utils import instantiate

    with initialize(version_base="1.3"):
        cfg = compose(overrides=["+weightsync/scheme=wsfile", "weightsync.scheme.transport.poll_ms=7.5"])
        alone = compose(overrides=["+weightsync/transport=wsfile", "weightsync.transport.fsync=true"])
        torchrl = compose(overrides=["+weight_sync_scheme=weightsync_wsfile"])  # TorchRL's group of schemes
    scheme = instantiate(cfg.weightsync.scheme)
    settings = instantiate(alone.weightsync.transport)
    return {
        "target": cfg.weightsync.scheme._target_,
        "transport_target": cfg.weightsync.scheme.transport._target_,
        "built": type(scheme).__name__,
        "poll_ms": scheme.poll_ms,
        "settings": repr(scheme.settings),
        "alone": repr(settings),
        "torchrl": type(instantiate(torchrl.weight_sync_scheme)).__name__,
    }


def _main_job_help() -> str:
    """The groups of ``python -m weightsync --help``, as its Hydra config renders them."""
    from hydra import compose, initialize_config_module

    import weightsync.app.main  # noqa: F401 - its groups, and the resolver its help reads them with

    with initialize_config_module("weightsync.conf", version_base="1.3"):
        cfg = compose("config", return_hydra_config=True)
    return cfg.hydra.help.template.split("== Configuration groups ==")[1].split("== Config ==")[0]


def _receiver_config(cls: type) -> dict[str, Any]:
    scheme = cls(poll_ms=3.0, timeout=9.0)
    scheme.init_on_sender(model=_model(0), num_workers=2)
    cfg = scheme.receiver_config(1)
    receiver = weightsync.from_config(json.loads(json.dumps(cfg)))  # as plain data, from any process
    elsewhere = {**cfg, "connection": {"directory": "/etc"}}
    try:
        weightsync.from_config(elsewhere)
        refused = None
    except weightsync.ConfigurationError as exc:
        refused = str(exc)
    scheme.shutdown()
    return {
        "target": cfg["scheme"]["_target_"],
        "built": type(receiver).__name__,
        "worker_idx": receiver.worker_idx,
        "options": [receiver.poll_ms, receiver.timeout],
        "refused": refused,
    }


def _apidoc() -> dict[str, Any]:
    """The reference as its documented command writes it (the command wrote weightsync's own only: an audit)."""
    from weightsync import _apidoc

    _apidoc.main(["--installed", "api.md"])  # (in the scratch directory)
    text = Path("api.md").read_text()
    return {
        "scheme_heading": f"### `weightsync.{SCHEME}`" in text,
        "option_row": "| `poll_ms` | `2.0` |" in text,
        "settings_heading": f"### `weightsync.{SETTINGS}`" in text,
        "own_only": f"weightsync.{SCHEME}" not in _apidoc.render(own=True),
    }


def facts() -> dict[str, Any]:
    """What weightsync offers for the engine an entry point added: each fact its value, or the error it raised."""
    out: dict[str, Any] = {}

    def fact(name: str, compute: Any) -> None:
        try:
            out[name] = compute()
        except BaseException:  # noqa: BLE001 - a fact that failed is reported, and the others still computed
            out[name] = {"error": traceback.format_exc(limit=-4)}

    fact("backends", weightsync.available_backends)
    cls = weightsync.get_backend("wsfile")
    fact(
        "lazy",
        lambda: [getattr(weightsync, name) is getattr(sys.modules["wsfile"], name) for name in (SCHEME, SETTINGS)],
    )
    fact("all", lambda: [name in weightsync.__all__ for name in (SCHEME, SETTINGS)])
    fact("signature", lambda: list(inspect.signature(cls.__init__).parameters))
    fact("exchange", lambda: _exchange(cls))
    fact("failures", lambda: _failures(cls))
    fact("hydra", _hydra)
    fact("receiver_config", lambda: _receiver_config(cls))
    fact("apidoc", _apidoc)
    fact("main_job_help", _main_job_help)  # (last: it adds the main job's groups to Hydra's store)
    return out


def main() -> None:
    print(json.dumps(facts()))


# ---------------------------------------------------------------- in pytest
def _installed(site: Path, *, entry_point: bool) -> Path:
    """``wsfile`` on ``site``, as an installer leaves it: the package and, with ``entry_point``, its dist-info."""
    shutil.copytree(ENGINE, site / "wsfile", ignore=shutil.ignore_patterns("__pycache__"))
    if entry_point:
        info = site / "wsfile-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: wsfile\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text("[weightsync.backends]\nwsfile = wsfile\n")
    return site


def _python(code: str, site: Path, scratch: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python with ``site`` on its path, in ``scratch`` (also its temporary directory)."""
    path = os.pathsep.join(dict.fromkeys(map(str, (site, WEIGHTSYNC_ROOT, TESTS_ROOT))))
    env = {**os.environ, "PYTHONPATH": path, "TMPDIR": str(scratch), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout
    )


def _package_files() -> dict[str, str]:
    """Every file under weightsync/ (bytecode caches left out) and the SHA-256 of its bytes."""
    package = WEIGHTSYNC_ROOT / "weightsync"
    return {
        str(p.relative_to(package)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(package.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Any]:
    site = _installed(tmp_path_factory.mktemp("site"), entry_point=True)
    scratch = tmp_path_factory.mktemp("scratch")
    before = _package_files()
    done = _python("from tests.test_adding_an_engine import main; main()", site, scratch, timeout=200)
    assert done.returncode == 0, done.stderr[-6000:]
    return {
        "facts": json.loads(done.stdout.strip().splitlines()[-1]),
        "package": (before, _package_files()),
        "directories_left": sorted(p.name for p in scratch.glob("weightsync-wsfile-*")),
    }


def _fact(run: dict[str, Any], name: str) -> Any:
    value = run["facts"][name]
    if isinstance(value, dict) and "error" in value:
        pytest.fail(f"{name} failed in the fresh process:\n{value['error']}")
    return value


def test_the_entry_point_adds_the_backend_and_nothing_else_does(run, tmp_path):
    assert "wsfile" in _fact(run, "backends")
    site = _installed(tmp_path / "site", entry_point=False)
    (tmp_path / "scratch").mkdir()
    bare = _python("import weightsync; print(weightsync.available_backends())", site, tmp_path / "scratch", 60)
    assert bare.returncode == 0 and "wsfile" not in bare.stdout, bare.stdout + bare.stderr


def test_the_main_jobs_help_lists_it_with_the_others(run):
    """The help's groups were written out in conf/config.yaml: an installed engine ran (``scheme=wsfile``) but was
    missing from them (a user's audit)."""
    groups = dict(re.findall(r"^([\w/]+): (.+)$", _fact(run, "main_job_help"), re.M))
    assert "wsfile" in groups["scheme"].split(", ") and "shared_mem" in groups["scheme"].split(", "), groups
    assert "wsfile" in groups["scheme/transport"].split(", "), groups


def test_its_classes_are_lazy_public_names_of_weightsync(run):
    assert _fact(run, "lazy") == [True, True]
    assert _fact(run, "all") == [True, True]


def test_its_constructor_lists_its_options(run):
    names = _fact(run, "signature")
    assert names[:5] == ["self", "strategy", "sync", "timeout", "connect_timeout"]
    assert {"checksum", "poll_ms", "fsync", "transport"} <= set(names)


def test_a_sender_and_two_worker_processes_exchange_versions_through_the_core(run):
    exchange = _fact(run, "exchange")
    assert exchange["acked"] == [{"0": v, "1": v} for v in range(1, VERSIONS + 1)]
    assert exchange["versions"] == {"0": VERSIONS, "1": VERSIONS}
    assert exchange["equal"] == {"0": True, "1": True}
    assert exchange["exit_codes"] == [0, 0] and not exchange["directory_left"]
    assert run["directories_left"] == []  # every directory the engine made, it removed


def test_the_core_keeps_its_deadlines_and_names_a_worker_that_refused_or_died(run):
    failures = _fact(run, "failures")
    assert failures["late"] == {"type": "SyncTimeoutError", "worker": 0, "version": 1}
    assert 1.0 <= failures["late_took"] < 10.0
    assert "ReceiverError: worker 0" in failures["misfit"] and failures["misfit_remote"] == ["WeightMismatchError"]
    assert failures["gone"] == {"type": "WorkerDiedError", "worker": 0, "exited": True}


def test_its_hydra_groups_compose_and_build_it_with_its_settings(run):
    hydra = _fact(run, "hydra")
    assert hydra["target"] == "wsfile.scheme.WsFileWeightSyncScheme"
    assert hydra["transport_target"] == "wsfile.settings.WsFileSettings"
    assert hydra["built"] == SCHEME and hydra["poll_ms"] == 7.5
    assert hydra["settings"] == "WsFileSettings(poll_ms=7.5, fsync=False)"
    assert hydra["alone"] == "WsFileSettings(poll_ms=2.0, fsync=True)"
    assert hydra["torchrl"] == SCHEME


def test_its_receiver_configs_build_receivers_without_an_allowlist(run):
    config = _fact(run, "receiver_config")
    assert config["target"] == "wsfile.scheme.WsFileWeightSyncScheme" and config["built"] == SCHEME
    assert config["worker_idx"] == 1 and config["options"] == [3.0, 9.0]
    assert config["refused"] is not None and "connection.directory" in config["refused"]


def test_the_api_reference_lists_it(run):
    assert _fact(run, "apidoc") == {
        "scheme_heading": True,
        "option_row": True,
        "settings_heading": True,
        "own_only": True,
    }


def test_nothing_under_weightsync_changed(run):
    before, after = run["package"]
    assert before and after == before
