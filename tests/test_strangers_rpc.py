"""``rpc`` and another user of the host (issue 31, finding 1; SPEC section 11).

torch.distributed.rpc authenticates no peer and runs the calls it unpickles before weightsync sees them, so
the ``rpc`` scheme cannot keep a stranger who reaches its store from running code in the trainer. It refuses to
start unless the user says, by the option's name, that they accept exactly that: these tests pin down both
halves, (a) every way of starting rpc is refused without ``allow_store_peers_to_run_code`` and starts nothing,
and (b) with it, a stranger (uid 65534) does what the documentation says it can.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
import torch
from hydra import compose, initialize
from hydra.utils import instantiate

import weightsync as ws
from tests._as_stranger import STRANGER_GID, STRANGER_UID, needs_stranger, start_stranger
from tests.conftest import _CTX

OPT_IN = "allow_store_peers_to_run_code"
ROOT = Path(__file__).resolve().parent.parent


def _started() -> tuple[set, set]:
    """This process's listening sockets and child processes (a forkserver an earlier test started among them)."""
    me = psutil.Process()
    listening = {c.laddr for c in me.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    return listening, {child.pid for child in me.children(recursive=True)}


def _nothing_started(before: tuple[set, set]) -> None:
    """No RPC agent, no listener, no child process appeared since ``before``."""
    from weightsync.transports.rpc.session import agent_running, session

    assert session() is None and not agent_running()
    listening, children = _started()  # an earlier test's listener or child may end meanwhile: only new ones count
    assert (listening - before[0], children - before[1]) == (set(), set())


def _refused(call, *args, **kwargs) -> ws.ConfigurationError:
    before = _started()
    with pytest.raises(ws.ConfigurationError, match=OPT_IN) as info:
        call(*args, **kwargs)
    _nothing_started(before)
    return info.value


# --------------------------------------------------------------- (a) refused
@pytest.mark.parametrize("master_addr", [None, "127.0.0.1", "10.255.255.1"])
def test_a_sender_without_the_opt_in_is_refused_before_anything_starts(master_addr):
    scheme = ws.RPCWeightSyncScheme(master_addr=master_addr)  # the constructor starts nothing either way
    error = _refused(scheme.init_on_sender, model_id="policy", model=torch.nn.Linear(2, 2), num_workers=1)
    assert "every local user on loopback" in str(error) and "distributed" in str(error)
    assert error.model_id == "policy" and scheme.state == "new"


def test_a_receiver_without_the_opt_in_is_refused_at_init_on_receiver():
    worker = ws.RPCWeightSyncScheme(connect_timeout=5)
    handoff = {"token": "0" * 16, "master_addr": "127.0.0.1", "master_port": 1, "world_size": 2, "counter": 0}
    worker._prepare_receiver(model_id="policy", worker_idx=0, connection=handoff)  # as from_config does
    error = _refused(worker.init_on_receiver, model_id="policy", model=torch.nn.Linear(2, 2), worker_idx=0)
    assert error.worker_idx == 0 and worker.state == "new"


def test_a_receiver_config_needs_the_callers_opt_in_by_its_name():
    cfg = {
        "_target_": "weightsync.config.make_receiver",
        "scheme": {"_target_": "weightsync.schemes.rpc.RPCWeightSyncScheme", OPT_IN: True},  # never taken
        "model_id": "policy",
        "worker_idx": 0,
        "connection": {"token": "0" * 16, "master_addr": "127.0.0.1", "master_port": 1, "world_size": 2, "counter": 0},
    }
    for opt_ins in ({}, {"allow_pickle": True}):
        error = _refused(ws.from_config, cfg, **opt_ins)
        assert f"from_config(cfg, {OPT_IN}=True)" in str(error)
    assert getattr(ws.from_config(cfg, **{OPT_IN: True}), OPT_IN) is True


def test_a_hydra_config_without_the_opt_in_is_refused_and_the_override_opts_in():
    with initialize(version_base="1.3"):
        cfg = compose(overrides=["+weightsync/scheme=rpc"])
        opted = compose(overrides=["+weightsync/scheme=rpc", f"weightsync.scheme.{OPT_IN}=true"])
    scheme = instantiate(cfg.weightsync.scheme)
    assert getattr(scheme, OPT_IN) is False and "allow_pickle" not in cfg.weightsync.scheme
    _refused(scheme.init_on_sender, model_id="policy", model=torch.nn.Linear(2, 2), num_workers=1)
    assert getattr(instantiate(opted.weightsync.scheme), OPT_IN) is True


def test_an_agent_of_the_users_own_needs_no_opt_in():
    """``worker_names=``: the user's ``rpc.init_rpc`` opened that world; the scheme opens nothing (here, with no
    agent running, it says to start one: the opt-in is not what it asks for)."""
    with pytest.raises(ws.ConfigurationError, match="rpc.init_rpc first") as info:
        ws.RPCWeightSyncScheme().init_on_sender(model=torch.nn.Linear(2, 2), worker_names=["a"])
    assert OPT_IN not in str(info.value)


def test_the_main_job_without_the_opt_in_fails_with_one_line_before_any_process_starts(monkeypatch, tmp_path):
    from omegaconf import OmegaConf

    import weightsync.app.job as job

    def no_processes(start_method):
        raise AssertionError("the job reached the point where it starts processes")

    monkeypatch.setattr(job, "_process_context", no_processes)
    monkeypatch.setattr("weightsync.app.ray_workers.RayWorkers", no_processes, raising=False)
    cfg = OmegaConf.create(
        {
            "num_workers": 1, "rounds": 1, "seed": 0, "start_method": None, "worker_timeout": 10.0,
            "models": {"policy": {"size_mb": 0.01, "tensors": 1}}, "schemes": {"policy": "rpc"},
        }
    )  # fmt: skip
    before = _started()
    whole = f"'schemes.policy={{_target_:weightsync.RPCWeightSyncScheme,{OPT_IN}:true}}'"  # (picked by name)
    with pytest.raises(ws.ConfigurationError, match=whole):
        job.run_job(cfg)
    _nothing_started(before)
    # From the command line: one clear line, exit status 2.
    out = subprocess.run(
        [sys.executable, "-m", "weightsync", "scheme=rpc", "num_workers=1", "rounds=1", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    errors = [line for line in out.stderr.splitlines() if line.startswith("weightsync: error:")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-2000:]
    assert f"give scheme.{OPT_IN}=true" in errors[0] and "every local user on loopback" in errors[0]


# ------------------------------------------------- (b) opted in: what it allows
def _opted_in_trainer(conn) -> None:
    """An opted-in trainer on loopback with one worker to come: say the store's port, then wait in connect()."""
    from weightsync.transports.rpc.session import session

    scheme = ws.RPCWeightSyncScheme(**{OPT_IN: True}, timeout=5, connect_timeout=40)
    try:
        scheme.init_on_sender(model_id="policy", model=torch.nn.Linear(2, 2), num_workers=1)
        conn.send(("port", session().port, os.getuid()))
        try:
            scheme.connect()
            conn.send(("connected", None, None))
        except ws.WeightSyncError as exc:
            conn.send(("refused", f"{type(exc).__name__}: {exc}", None))
    finally:
        scheme.shutdown()


@needs_stranger
def test_opted_in_a_stranger_who_reaches_the_store_runs_code_in_the_trainer_as_documented():
    """What ``allow_store_peers_to_run_code`` says it allows, done by uid 65534 with torch's own API: find the
    store among the loopback listeners, confirm it by its keys, take worker 0's rank, join, call os.system in
    the trainer. The command runs there, as the trainer's user."""
    parent, child = _CTX.Pipe()
    trainer = _CTX.Process(target=_opted_in_trainer, args=(child,))
    trainer.start()
    child.close()
    workdir = tempfile.mkdtemp(prefix="weightsync-stranger-rpc-")
    os.chown(workdir, STRANGER_UID, STRANGER_GID)  # the stranger's own directory
    marker = os.path.join(workdir, "marker")
    stranger = None
    try:
        assert parent.poll(60), "the trainer did not open its store"
        what, port, trainer_uid = parent.recv()
        assert what == "port"
        stranger = start_stranger(["-m", "tests._attack_rpc", str(port), marker], cwd=workdir)
        out, _ = stranger.communicate(timeout=90)
        assert "uid: 65534" in out and "the trainer's among them: True" in out, out
        assert "weightsync-joined/0" in out and "rank of worker 0 taken: True" in out, out
        assert "called: 0" in out, out
        # The command ran in the trainer, as the trainer's user, not the stranger's.
        assert os.stat(marker).st_uid == trainer_uid != STRANGER_UID
        assert f"uid={trainer_uid}(" in Path(marker).read_text()
        assert parent.poll(60), "the trainer's connect() did not end within its bound"
        parent.recv()  # the trainer's connect() ends (how, torch decides: the stranger left the world)
    finally:
        if stranger is not None and stranger.poll() is None:
            os.killpg(stranger.pid, 9)
            stranger.communicate(timeout=10)
        trainer.join(30)
        if trainer.is_alive():
            trainer.kill()
            trainer.join(5)
        shutil.rmtree(workdir, ignore_errors=True)
