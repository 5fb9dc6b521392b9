"""Every documented bound holds: a wait given ``T`` seconds ends between 0.9 ``T`` and 1.1 ``T`` + 1 s, with an
error that says what it waited for (docs/reliability.md)."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from torch import nn

import weightsync as ws
from tests._bodies import within_its_timeout
from tests._workers import connect_pair

T = 2.0
LOCAL_AND_GLOO = ["multiprocess", "shared_mem", "distributed"]


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (30.0, "30s"),
        (2, "2s"),
        (0.5, "0.5s"),
        (0.04, "0.04s"),
        (1.25, "1.25s"),
        (3600, "3600s"),
        (3599, "3599s"),
        (1234.5, "1234.5s"),
        (0, "0s"),
    ],  # fmt: skip
)
def test_a_bound_is_named_as_given_not_rounded_away(seconds, shown):
    from weightsync.core.timing import shown_seconds

    assert shown_seconds(seconds) == shown


def test_a_back_off_doubles_up_to_its_longest_however_many_tries_came_to_nothing():
    """Asks of a worker stopped for hours count a thousand misses and more: the doubling overflowed a float there
    (``OverflowError`` from every send), where it should have stayed at its longest."""
    from weightsync.core.timing import backed_off

    assert [backed_off(0.25, n, 5.0) for n in range(6)] == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0]
    assert backed_off(0.25, 1100, 5.0) == backed_off(2.0, 10**9, 30.0) / 6 == 5.0


def timed(call) -> tuple[float, ws.WeightSyncError | None]:
    began = time.monotonic()
    try:
        call()
    except ws.WeightSyncError as exc:
        return time.monotonic() - began, exc
    return time.monotonic() - began, None


@pytest.mark.parametrize("backend", LOCAL_AND_GLOO)
def test_a_sender_waits_its_connect_timeout_for_absent_workers(backend, caplog):
    scheme = ws.WeightSyncScheme.from_backend(backend, connect_timeout=T)
    scheme.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=2)
    with caplog.at_level(logging.INFO, logger="weightsync"):
        took, error = timed(scheme.connect)
    scheme.shutdown()
    assert isinstance(error, ws.SyncTimeoutError) and "workers [0, 1] did not" in str(error), error
    assert within_its_timeout(took, T), took
    # meanwhile it said what it waits for
    assert "[model 'policy'] waiting for 2 workers to connect: 0 of 2 connected, missing [0, 1]" in caplog.text


@pytest.mark.parametrize("backend", LOCAL_AND_GLOO)
def test_a_worker_waits_its_connect_timeout_for_a_sender_that_does_not_connect(backend, caplog):
    sender = ws.WeightSyncScheme.from_backend(backend, connect_timeout=60)
    sender.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=1)
    cfg = sender.receiver_config(0)
    cfg["scheme"]["connect_timeout"] = T
    worker = ws.from_config(cfg)
    worker.init_on_receiver(model=nn.Linear(2, 2))
    with caplog.at_level(logging.INFO, logger="weightsync"):
        took, error = timed(worker.connect)
    worker.shutdown()
    sender.shutdown()
    assert isinstance(error, ws.SyncTimeoutError), error
    assert within_its_timeout(took, T), (took, error)
    said = {
        "distributed": "waiting for the sender's rendez-vous with every worker: not yet",
        "multiprocess": "it listens, but its connect() has not taken this worker in yet",
        "shared_mem": "it listens, but its connect() has not taken this worker in yet",
    }
    assert said[backend] in caplog.text, caplog.text


@pytest.mark.parametrize("backend", LOCAL_AND_GLOO)
def test_receive_waits_its_timeout_when_nothing_comes(backend):
    sender = ws.WeightSyncScheme.from_backend(backend, connect_timeout=30)
    sender.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=1)
    worker = ws.from_config(sender.receiver_config(0))
    worker.init_on_receiver(model=nn.Linear(2, 2))
    connect_pair(sender, worker)
    began = time.monotonic()
    assert worker.receive(timeout=T) is None
    took = time.monotonic() - began
    worker.shutdown()
    sender.shutdown()
    assert within_its_timeout(took, T), took


@pytest.mark.parametrize("backend", ["multiprocess", "no_sync"])
def test_a_calls_own_timeout_is_checked_as_every_bound_is(backend):
    """``receive``, ``take`` and ``wait_async`` take a bound of their own: one that is not a number of seconds from
    0 to an hour is refused by name. Unchecked, ``receive(float("inf"))`` and ``receive(1e12)`` never returned,
    ``-1`` and NaN were taken for 0 (a ``wait_async(-1)`` under ``on_failure="drop"`` dropped a live worker), and
    others failed inside Python's clock (``OverflowError``); ``take()`` on ``no_sync`` raised a bare
    ``AssertionError``."""
    sender = ws.WeightSyncScheme.from_backend(backend, timeout=2, connect_timeout=30, on_failure="drop")
    sender.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=1)
    worker = ws.from_config(sender.receiver_config(0))
    worker.init_on_receiver(model=nn.Linear(2, 2))
    connect_pair(sender, worker)
    try:
        sender.send_async()
        for call in (worker.receive, worker.take, sender.wait_async):
            for bad in (float("inf"), 1e12, 3601, -1, float("nan"), "1", True):
                with pytest.raises(ws.ConfigurationError, match=rf"{call.__name__}\(timeout\) must be None or a"):
                    call(bad)
        pending = worker.take(None)  # (within the scheme's timeout: version 1, or nothing under no_sync)
        assert (pending is None) if backend == "no_sync" else (pending.version == 1 and pending.apply() == 1)
        sender.wait_async(None)
        assert not sender.stats().get("dropped_workers")
    finally:
        worker.shutdown()
        sender.shutdown()


def test_a_worker_whose_trainer_was_killed_waits_its_connect_timeout_quietly(tmp_path: Path):
    """A receiver config left by a trainer that was SIGKILLed: the store it names is gone. The worker fails
    within its connect_timeout (torch's client would try twice as long, and print C++ stacks), saying so."""
    backends = ["distributed", "rpc"]
    trainer = subprocess.Popen(
        [sys.executable, "-m", "tests._stale_trainer", str(tmp_path), *backends],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    try:
        assert trainer.stdout.readline().strip() == "written"
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
        trainer.stdin.close()
        trainer.stdout.close()
    for backend in backends:
        cfg = OmegaConf.to_container(OmegaConf.load(tmp_path / f"{backend}.yaml"))
        cfg["scheme"]["connect_timeout"] = T
        worker = ws.from_config(cfg, allow_store_peers_to_run_code=True)
        worker.init_on_receiver(model=nn.Linear(2, 2))
        took, error = timed(worker.connect)
        worker.shutdown()
        assert isinstance(error, ws.SyncTimeoutError) and "no TCP store answered" in str(error), (backend, error)
        assert f"within {T:.0f}s (Connection refused)" in str(error), error
        assert within_its_timeout(took, T), (backend, took)


@pytest.mark.parametrize("backend", ["multiprocess", "shared_mem"])
def test_a_worker_that_stops_reading_its_welcome_is_named_within_the_send_bound(backend):
    """The welcome carries the layout (about 100 bytes a tensor): 10,000 tensors fill a Unix socket's buffer, and a
    worker that proved the key and then stopped reading (a stopped process) used to hold the trainer's connect()
    in that write for good. The write fails within its bound, and connect() waits on for a worker 0 that reads
    until its own timeout, naming the one that did not."""
    import json
    import os
    import threading

    from tests._attack_local import key_holder
    from weightsync.transports.keyfiles import read_key_file
    from weightsync.transports.local.channel import SEND_TIMEOUT

    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(5000)])
    scheme = ws.WeightSyncScheme.from_backend(backend, timeout=T, connect_timeout=T)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    connection = scheme.receiver_config(0)["connection"]
    key = bytes.fromhex(read_key_file(connection["authkey_file"]))
    said = {"op": "hello", "worker_idx": 0, "pid": os.getpid(), "model_id": "policy", "nonce": "00" * 32}
    outcome: list = []
    connecting = threading.Thread(target=lambda: outcome.append(timed(scheme.connect)), daemon=True)
    connecting.start()
    sock = None
    try:
        sock = key_holder(connection["address"], key, json.dumps(said).encode())  # ... and never reads
        connecting.join(SEND_TIMEOUT + T + 5)
        assert not connecting.is_alive(), "connect() is still writing to a worker that does not read"
        took, error = outcome[0]
        assert isinstance(error, ws.SyncTimeoutError), error
        assert "worker 0: it said hello and was not welcomed" in str(error) and "did not take a message" in str(error)
        assert took < SEND_TIMEOUT + T + 1
    finally:
        if sock is not None:
            sock.close()
        connecting.join(10)
        scheme.shutdown()


def test_a_ray_address_where_no_cluster_answers_fails_within_connect_timeout(monkeypatch):
    """Ray's own connect to a cluster's address retries for minutes (614 s seen, then killed), past every bound the
    scheme has: the address is tried first, within ``connect_timeout``."""
    import socket

    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # (a cluster another test left up is not this one)
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    scheme = ws.RayWeightSyncScheme(address=f"127.0.0.1:{port}", connect_timeout=2)
    began = time.monotonic()
    with pytest.raises(ws.SyncTimeoutError, match=f"no Ray cluster answered at 127.0.0.1:{port} within 2s"):
        scheme.join_ray()
    assert within_its_timeout(time.monotonic() - began, 2.0)
