"""The public surface is what ``weightsync/__init__.py`` exports."""

from __future__ import annotations

import inspect

import weightsync as ws


def test_all_is_sorted_and_complete():
    assert ws.__all__ == sorted(ws.__all__)
    assert all(hasattr(ws, name) for name in ws.__all__)
    public_classes = {n for n, v in vars(ws).items() if inspect.isclass(v) and not n.startswith("_")}
    assert public_classes <= set(ws.__all__)


def test_one_error_tree():
    errors = [getattr(ws, n) for n in ws.__all__ if n.endswith("Error")]
    assert all(issubclass(e, ws.WeightSyncError) for e in errors)
    assert issubclass(ws.SyncTimeoutError, TimeoutError)
    assert issubclass(ws.ConfigurationError, ValueError)
    err = ws.WorkerDiedError("gone", model_id="policy", worker_idx=3, version=7)
    assert str(err) == "[model 'policy', worker 3, version 7] gone" and err.worker_idx == 3


def test_older_facade_names_exist():
    for name in (
        "init_on_sender",
        "init_on_receiver",
        "init_on_worker",
        "connect",
        "send",
        "send_async",
        "wait_async",
        "receive",
        "apply_weights",
        "shutdown",
        "get_sender",
        "get_receiver",
        "create_sender",
        "create_receiver",
        "create_transport",
        "prepare_weights",
        "from_backend",
    ):
        assert callable(getattr(ws.WeightSyncScheme, name)), name
    for name in (
        "model",
        "model_id",
        "worker_idx",
        "weights",
        "context",
        "sender_transports",
        "receiver_transport",
        "shared_transport",
    ):
        assert isinstance(getattr(ws.WeightSyncScheme, name), property), name
    for name in ("send_weights", "send_weights_async", "wait_ack", "receive_weights", "send_ack", "check_connection"):
        assert callable(getattr(ws.MPTransport, name)), name
    assert issubclass(ws.SharedMemTransport, ws.TransportBackend)


def test_errors_survive_pickling_with_their_fields():
    import pickle

    err = ws.WeightMismatchError(missing=["a"], mismatched={"b": ("[2] float32", "[3] float32")}, worker_idx=1)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ws.WeightMismatchError and str(back) == str(err)
    assert (back.missing, back.mismatched, back.worker_idx) == (["a"], err.mismatched, 1)
    remote = pickle.loads(pickle.dumps(ws.ReceiverError("ValueError", "bad", worker_idx=2, version=3)))
    assert (remote.remote_type, remote.worker_idx, remote.version) == ("ValueError", 2, 3)


def test_api_reference_is_current():
    """``docs/api.md`` is what ``python -m weightsync._apidoc`` writes, in a fresh process: the engines are listed in
    the order a fresh process registers them (rendered in this one, the order was the one earlier tests left)."""
    import difflib
    import subprocess
    import sys
    from pathlib import Path

    page = Path(__file__).resolve().parents[1] / "docs" / "api.md"
    made = subprocess.run(
        [sys.executable, "-m", "weightsync._apidoc"], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    held = page.read_text()
    diff = "\n".join(list(difflib.unified_diff(held.splitlines(), made.splitlines(), lineterm=""))[:40])
    assert held == made, f"docs/api.md is stale: run python -m weightsync._apidoc docs/api.md\n{diff}"


def test_import_weightsync_loads_no_engine_and_registers_nothing():
    """``import weightsync`` loads the error tree only; a scheme class loads no engine; an engine loads on first
    use, and only its own."""
    import subprocess
    import sys

    probe = """
import sys, json
from torch.distributed.rendezvous import _rendezvous_handlers
loaded = lambda: sorted(m for m in sys.modules if m.split(".")[0] in ("weightsync", "tensordict", "ray", "hydra"))
import weightsync
first = loaded()
weightsync.MultiProcessWeightSyncScheme, weightsync.RPCWeightSyncScheme, weightsync.RayWeightSyncScheme
classes = loaded()
import torch
scheme = weightsync.MultiProcessWeightSyncScheme()
scheme.init_on_sender(model=torch.nn.Linear(2, 2), num_workers=1)
used = loaded()
scheme.shutdown()
print(json.dumps([first, classes, used, "weightsync" in _rendezvous_handlers]))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    import json

    first, classes, used, handler = json.loads(out.stdout.splitlines()[-1])
    assert first == ["weightsync", "weightsync._lazy", "weightsync.errors"]
    # A scheme class knows its transports' settings (each engine's `settings` module), and loads no engine.
    packages = {
        "weightsync.transports",
        *(f"weightsync.transports.{e}" for e in ("local", "distributed", "rpc", "ray")),
    }

    def engine_code(modules):
        return [
            m
            for m in modules
            if m.startswith("weightsync.transports") and not m.endswith(".settings") and m not in packages
        ]

    assert not engine_code(classes)
    assert not [m for m in classes if m.startswith(("tensordict", "ray", "hydra"))]
    engines = {m.split(".")[2] for m in engine_code(used)}
    assert engines <= {"local", "base", "processes", "keyfiles", "plainjson", "descriptors", "network"}, engines
    assert not handler, "an RPC rendezvous handler was registered by importing weightsync"
