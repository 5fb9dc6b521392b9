"""TorchRL's own collectors, fed by weightsync schemes (``weight_sync_schemes={"policy": scheme}``).

Every test builds a real collector with worker processes and reads what the workers did from the batches they
collected: the policy's weight is zero, so each action equals the bias the worker held (tests/_torchrl_env.py).
For each collector and scheme: before ``update_policy_weights_()`` a trainer step is invisible to the workers;
after it every worker acts with the trainer's weights; collection goes on; a killed worker is a named error;
``collector.shutdown()`` shuts the scheme down and leaves no process, thread or segment behind (the autouse leak
check of conftest.py).
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket

import pytest
import torch

pytest.importorskip("torchrl")

from tensordict import TensorDict  # noqa: E402
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector  # noqa: E402
from torchrl.collectors.distributed import DistributedCollector  # noqa: E402

import weightsync as ws  # noqa: E402
from tests._torchrl_env import (  # noqa: E402
    action_of,
    actions,
    factory_policy,
    make_env,
    make_policy,
    make_recurrent_policy,
)

pytestmark = pytest.mark.timeout(180)

#: On the collectors' processes' PYTHONPATH: TorchRL imports vLLM when installed, 5 s a process (the module says why).
WITHOUT_VLLM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_without_vllm")


@pytest.fixture(scope="module", autouse=True)
def _collectors_without_vllm():
    """The processes the collectors start (spawned: each imports TorchRL anew) do not import vLLM."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [WITHOUT_VLLM, os.environ.get("PYTHONPATH")])))
        yield


MULTI = {"MultiSyncCollector": MultiSyncCollector, "MultiAsyncCollector": MultiAsyncCollector}


def trainer_step(policy, bias: float) -> None:
    """What an optimizer step does to the trainer's policy, in place."""
    with torch.no_grad():
        policy.module.bias.fill_(bias)


def rows(batch) -> list[set[float]]:
    """The actions of each worker of a ``MultiSyncCollector`` batch (dimension 0 is the worker)."""
    return [actions(batch[i]) for i in range(batch.shape[0])]


def multi(cls_name: str, scheme, **kwargs):
    policy = kwargs.pop("policy", None)
    return MULTI[cls_name](
        [make_env, make_env],
        policy=policy,
        frames_per_batch=8,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme},
        **kwargs,
    )


@pytest.mark.parametrize("backend", ["multiprocess", "shared_mem"])
@pytest.mark.parametrize("cls_name", sorted(MULTI))
def test_multi_collector_isolates_updates_and_names_a_dead_worker(cls_name, backend):
    policy = make_policy(0.0)
    scheme = ws.WeightSyncScheme.from_backend(backend, timeout=30)
    collector = multi(cls_name, scheme, policy=policy)
    try:
        assert isinstance(scheme, __import__("torchrl.weight_update").weight_update.WeightSyncScheme)
        assert scheme.num_workers == 2
        batches = iter(collector)
        assert actions(next(batches)) == {0.0}
        trainer_step(policy, 1.0)
        # Invisible until sent: the workers hold their own copy (TorchRL's schemes share the trainer's tensors).
        assert [actions(next(batches)) for _ in range(4)] == [{0.0}] * 4
        collector.update_policy_weights_()
        assert scheme.version == 1
        seen = [actions(next(batches)) for _ in range(8)]
        # A sync collector's next batch is collected after the update; an async one may hand over up to one batch
        # per worker begun before it (and a batch it was in the middle of).
        fresh = seen if cls_name == "MultiSyncCollector" else seen[4:]
        assert fresh == [{1.0}] * len(fresh), seen
        if cls_name == "MultiSyncCollector":
            trainer_step(policy, 2.0)
            collector.update_policy_weights_(worker_ids=[0])
            assert rows(next(batches)) == [{2.0}, {1.0}]
            collector.update_policy_weights_()
            assert rows(next(batches)) == [{2.0}, {2.0}]
        # A killed worker is an error naming it, not a hang; the survivor still takes updates.
        collector.procs[1].kill()
        collector.procs[1].join(30)
        trainer_step(policy, 3.0)
        with pytest.raises(ws.WorkerDiedError, match="worker 1") as err:
            collector.update_policy_weights_()
        assert err.value.worker_idx == 1
        collector.update_policy_weights_(worker_ids=[0])
    finally:
        collector.shutdown()
    assert scheme.state == "shut down"
    assert not any(p.is_alive() for p in collector.procs)


def test_a_recurrent_policy_sent_without_its_weights_takes_each_version():
    """TorchRL hands each worker the policy with its weights on the meta device. An LSTM's could not be given memory
    in place (it keeps weak references to them): the collector failed at its start ("Cannot swap t1 because it
    has weakref associated with it") where TorchRL's own schemes run. Its non-persistent buffer comes too."""
    torch.manual_seed(0)
    policy = make_recurrent_policy(offset=5.0)
    collector = multi("MultiSyncCollector", ws.SharedMemWeightSyncScheme(timeout=30), policy=policy)
    try:
        batches = iter(collector)
        assert actions(next(batches)) == {action_of(policy)}
        with torch.no_grad():
            for p in policy.parameters():
                p.mul_(-2.0)
        collector.update_policy_weights_()
        assert actions(next(batches)) == {action_of(policy)}
    finally:
        collector.shutdown()


def test_a_collector_that_forks_its_workers_is_refused_at_once_by_name(monkeypatch):
    """TorchRL's messages advise ``mp.set_start_method("fork")``. A forked worker refused the scheme (it held the
    trainer's copy, not one pickled for it) and exited; the trainer waited for it until ``connect_timeout`` (120 s)
    and said only that workers did not connect. The collector's start method is refused at init, by name."""
    import multiprocessing

    import torchrl.collectors._multi_base as multi_base

    monkeypatch.setattr(multi_base, "_get_mp_ctx", lambda: multiprocessing.get_context("fork"))
    monkeypatch.setattr(multi_base, "_set_mp_start_method_if_unset", lambda method: None)  # (this process's stays)
    scheme = ws.SharedMemWeightSyncScheme(timeout=30)
    with pytest.raises(ws.ConfigurationError, match="'fork'.*'spawn' or 'forkserver'"):
        multi("MultiSyncCollector", scheme, policy=make_policy(0.0))
    assert scheme.state == "new"


def test_a_worker_that_fails_at_its_start_is_named_with_its_error():
    """A collector's worker whose environment cannot be built sends its error on its pipe and exits (code 0). The
    collector reads the pipe only once the scheme connected, which it never did: the trainer heard "exited with
    code 0 before it connected", and the error was lost."""
    from tests._torchrl_env import make_env_that_fails_in_a_worker

    scheme = ws.SharedMemWeightSyncScheme(timeout=30)
    collector = None
    with pytest.raises(ws.WorkerDiedError, match=r"worker 0 said: RuntimeError: .*missing ROM"):
        collector = MultiSyncCollector(
            [make_env_that_fails_in_a_worker, make_env],
            policy=make_policy(0.0),
            frames_per_batch=8,
            total_frames=-1,
            weight_sync_schemes={"policy": scheme},
        )
    assert collector is None


@pytest.mark.parametrize("backend", ["multiprocess", "shared_mem"])
def test_single_collector_applies_weights_it_is_sent(backend):
    """``Collector`` runs its policy in the trainer's process. Given the trainer's own module it runs those very
    tensors (as with TorchRL's schemes: nothing to isolate); given a copy, the copy changes only when sent."""
    trainer = make_policy(0.0)
    scheme = ws.WeightSyncScheme.from_backend(backend, timeout=30)
    collector = Collector(
        make_env,
        policy=copy.deepcopy(trainer),
        frames_per_batch=8,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme},
    )
    try:
        batches = iter(collector)
        assert actions(next(batches)) == {0.0}
        trainer_step(trainer, 1.0)
        assert actions(next(batches)) == {0.0}
        collector.update_policy_weights_(TensorDict.from_module(trainer))
        assert actions(next(batches)) == {1.0}
        assert scheme.version == 1
        wrong = TensorDict.from_module(torch.nn.Linear(3, 1))
        with pytest.raises(ws.WeightSyncError):
            collector.update_policy_weights_(wrong)
        assert actions(next(batches)) == {1.0}, "a refused update must leave the policy as it was"
    finally:
        collector.shutdown()
    assert scheme.state == "shut down"


def test_single_collector_with_no_sync_keeps_its_policy():
    collector = Collector(
        make_env,
        policy=make_policy(0.0),
        frames_per_batch=8,
        total_frames=-1,
        weight_sync_schemes={"policy": ws.NoWeightSyncScheme()},
    )
    try:
        batches = iter(collector)
        collector.update_policy_weights_(TensorDict.from_module(make_policy(1.0)))
        assert actions(next(batches)) == {0.0}
    finally:
        collector.shutdown()


@pytest.mark.parametrize(
    ("make_scheme", "after"),
    [(ws.NoWeightSyncScheme, 9.0), (lambda: ws.SharedMemWeightSyncScheme(timeout=30), 1.0)],
    ids=["no_sync", "shared_mem"],
)
def test_a_multi_collector_given_only_a_policy_factory_acts_with_its_weights_then_with_those_sent(make_scheme, after):
    """As docs/torchrl.md says to: the scheme uninitialized, a ``policy_factory``, weights sent explicitly. Its
    start failed with a scheme that moves weights ("init_on_sender needs model= or weights="): the collector's
    ``policy``, None, was taken for the model. Its workers act with the factory's weights, then with the ones sent
    (``no_sync``: the factory's still)."""
    collector = MultiSyncCollector(
        [make_env, make_env],
        policy_factory=factory_policy,
        frames_per_batch=8,
        total_frames=-1,
        weight_sync_schemes={"policy": make_scheme()},
    )
    try:
        batches = iter(collector)
        assert rows(next(batches)) == [{9.0}, {9.0}]
        collector.update_policy_weights_(TensorDict.from_module(make_policy(1.0)))
        assert rows(next(batches)) == [{after}, {after}]
    finally:
        collector.shutdown()


DROPPED_COLLECTOR = """
import gc, sys
sys.path[:0] = {paths!r}
import psutil, torch
import weightsync as ws
from tests._torchrl_env import make_env, make_policy
from torchrl.collectors import MultiSyncCollector


def train():
    scheme = ws.WeightSyncScheme.from_backend({backend!r}, timeout=10)
    collector = MultiSyncCollector([make_env] * 2, policy=make_policy(0.0), frames_per_batch=8, total_frames=16,
                                   weight_sync_schemes={{"policy": scheme}})
    if {cycle}:  # (a program's own cycle through it: it is freed by a garbage collection, which finalizes it)
        collector.itself = collector
    for _ in collector:
        collector.update_policy_weights_()
    workers = [p.pid for p in psutil.Process().children() if "resource_tracker" not in " ".join(p.cmdline())]
    return workers  # (no collector.shutdown(): the collector goes out of scope)


if __name__ == "__main__":
    started = train()
    gc.collect()
    print("alive:", [pid for pid in started if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"])
"""


@pytest.mark.parametrize(("backend", "cycle"), [("shared_mem", False), ("distributed", False), ("shared_mem", True)])
def test_a_collector_dropped_without_its_shutdown_ends_its_workers_and_its_process_exits(tmp_path, backend, cycle):
    """A ``train()`` that returns without ``collector.shutdown()``: the collector's ``__del__`` ends its workers
    (with TorchRL's own schemes too). The scheme held the collector alive (its context, and the wrapper of its
    ``shutdown``), a thread of the scheme's held the scheme: the workers lived on and the process hung at its exit
    joining them (a user's audit). In a cycle of the program's, the collector is finalized by a garbage collection,
    which clears weak references first: a wrapper holding it weakly ended the scheme and not its workers."""
    import subprocess
    import sys

    paths = [WITHOUT_VLLM, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    script = tmp_path / "train.py"
    script.write_text(DROPPED_COLLECTOR.format(paths=paths, backend=backend, cycle=cycle))
    ran = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert ran.returncode == 0 and "alive: []" in ran.stdout, (ran.stdout, ran.stderr[-3000:])


def test_no_sync_refuses_a_policy_it_cannot_fill():
    """TorchRL hands workers a policy with its weights on the meta device; no_sync would never give them any."""
    with pytest.raises(Exception, match="no_sync|NoWeightSyncScheme") as err:
        multi("MultiSyncCollector", ws.NoWeightSyncScheme(), policy=make_policy(0.0)).shutdown()
    assert "policy_factory" in str(err.value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def master_environment_put_back():
    """TorchRL's distributed collector sets ``MASTER_ADDR`` and ``MASTER_PORT`` in this process and leaves them set:
    put back once the test ended (a later test's two distributed trainers were given one port, and the first's
    shutdown took the store the second had joined). (``monkeypatch.delenv`` of a variable not set restores nothing.)"""
    saved = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_distributed_collector(sync, master_environment_put_back):
    policy = make_policy(0.0)
    scheme = ws.DistributedWeightSyncScheme(timeout=30, connect_timeout=90)
    collector = DistributedCollector(
        [make_env] * 2,
        policy,
        frames_per_batch=8,
        total_frames=10**6,
        launcher="mp",
        backend="gloo",
        tcp_port=_free_port(),
        sync=sync,
        weight_sync_schemes={"policy": scheme},
    )
    try:
        batches = iter(collector)
        assert actions(next(batches)) == {0.0}
        trainer_step(policy, 1.0)
        assert [actions(next(batches)) for _ in range(3)] == [{0.0}] * 3
        collector.update_policy_weights_()
        seen = [actions(next(batches)) for _ in range(6)]
        if sync:
            assert seen[3:] == [{1.0}] * 3, seen
        else:
            # Each node may hand over one batch it began before the update, however late: TorchRL takes the
            # first node it finds done, in rank order, and a node's "done" outlives its next "continue" for a
            # moment (TorchRL's generic.py), so the first node can be taken again and again while the other's
            # batch waits (a run beside other tests saw it after four fresh ones). Every other batch acts with the
            # new weights.
            assert all(s <= {0.0, 1.0} for s in seen) and sum(s != {1.0} for s in seen) <= 2, seen
        if sync:  # a killed node is an error naming its worker
            collector.jobs[1].kill()
            collector.jobs[1].join(30)
            with pytest.raises(ws.WorkerDiedError, match="worker 1") as err:
                collector.update_policy_weights_()
            assert err.value.worker_idx == 1
    finally:
        try:
            collector.shutdown()
        except RuntimeError:
            # TorchRL's own shutdown waits 10 s for each node's answer in its store: after a node was killed, or
            # a busy async node on a loaded machine, it says so (DistStoreError) and stops there, leaving the
            # other nodes and the process group to us. (weightsync's scheme is shut down all the same.)
            _end_torchrl_nodes(collector.jobs)
    assert scheme.state == "shut down"


def _end_torchrl_nodes(jobs) -> None:
    import psutil

    procs = []
    for job in jobs:
        with contextlib.suppress(psutil.Error):
            node = psutil.Process(job.pid)
            procs += [node, *node.children(recursive=True)]
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=30)
    for job in jobs:
        job.join(30)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_ray_collector():
    pytest.importorskip("ray")
    from torchrl.collectors.distributed import RayCollector

    from tests.conftest import kill_actor, local_ray_cluster

    tests_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with local_ray_cluster(runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([tests_root, WITHOUT_VLLM])}}):
        policy = make_policy(0.0)
        scheme = ws.RayWeightSyncScheme(timeout=60)
        collector = RayCollector(
            [make_env] * 2,
            policy,
            frames_per_batch=8,
            total_frames=10**6,
            sync=True,
            remote_configs={"num_cpus": 1, "memory": 512 * 1024**2},
            weight_sync_schemes={"policy": scheme},
        )
        try:
            collector.update_policy_weights_()  # RayCollector connects its scheme at the first update
            batches = iter(collector)
            assert actions(next(batches)) == {0.0}
            trainer_step(policy, 1.0)
            assert actions(next(batches)) == {0.0}
            collector.update_policy_weights_()
            assert [actions(next(batches)) for _ in range(2)] == [{1.0}] * 2
            kill_actor(collector.remote_collectors[1])  # (its process ended: the next update cannot reach it)
            trainer_step(policy, 2.0)
            with pytest.raises(ws.WorkerDiedError, match="worker 1") as err:
                collector.update_policy_weights_()
            assert err.value.worker_idx == 1
        finally:
            collector.shutdown()
        assert scheme.state == "shut down"


def _shut_down_in_actor(actor) -> None:
    import multiprocessing.util

    actor.shutdown()
    multiprocessing.util._run_finalizers(0)  # (what the actor's exit would run: unlinks its semaphores)


def test_a_ray_collectors_actor_with_workers_of_its_own_passes_each_update_on_to_them():
    """``RayCollector(collector_class="sync", num_workers_per_collector=2)``: its actor runs a MultiSyncCollector
    whose worker processes run the policy. The update reached the actor's collector, was acked, and its workers
    went on acting with version 0's weights. Now it goes on to them before it is acked, as TorchRL's own schemes
    pass it on."""
    ray = pytest.importorskip("ray")
    from torchrl.collectors.distributed import RayCollector

    from tests.conftest import local_ray_cluster

    tests_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with local_ray_cluster(runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([tests_root, WITHOUT_VLLM])}}):
        policy = make_policy(0.0)
        scheme = ws.RayWeightSyncScheme(timeout=60)
        collector = RayCollector(
            [make_env],
            policy,
            frames_per_batch=8,
            total_frames=10**6,
            sync=True,
            collector_class="sync",
            num_workers_per_collector=2,
            num_collectors=1,
            remote_configs={"num_cpus": 1, "memory": 512 * 1024**2},
            weight_sync_schemes={"policy": scheme},
        )
        try:
            collector.update_policy_weights_()
            batches = iter(collector)
            assert actions(next(batches)) == {0.0}
            for bias in (1.0, 2.0):
                trainer_step(policy, bias)
                collector.update_policy_weights_()
                assert [actions(next(batches)) for _ in range(2)] == [{bias}] * 2
        finally:
            # (the actor's collector first, and the semaphores its queues named: RayCollector's shutdown kills the
            # actor, whose finalizers would not run, and TorchRL's semaphores would be left in /dev/shm)
            with contextlib.suppress(Exception):
                ray.get(collector.remote_collectors[0].__ray_call__.remote(_shut_down_in_actor), timeout=60)
            collector.shutdown()
        assert scheme.state == "shut down"


def test_one_override_switches_a_torchrl_hydra_app_to_weightsync():
    """A TorchRL app picks its scheme from TorchRL's group ``weight_sync_scheme``; ``weightsync_<name>`` there
    is weightsync's, so one override on the command line switches it."""
    from hydra import compose, initialize
    from hydra.core.config_store import ConfigStore
    from hydra.utils import instantiate

    pytest.importorskip("torchrl.trainers.algorithms.configs")  # registers TorchRL's groups
    import weightsync.config  # noqa: F401 - registers weightsync's

    where = "weight_sync_scheme@collector.weight_sync_schemes.policy"
    app = {"defaults": [{where: "multiprocess"}, "_self_"], "collector": {"frames_per_batch": 8}}
    ConfigStore.instance().store(name="torchrl_app", node=app)
    with initialize(version_base=None):
        theirs = compose("torchrl_app")
        ours = compose("torchrl_app", overrides=[f"{where}=weightsync_shared_mem", f"{where.split('@')[1]}.timeout=30"])
    assert theirs.collector.weight_sync_schemes.policy._target_.startswith("torchrl.")
    schemes = instantiate(ours.collector.weight_sync_schemes, _convert_="all")
    assert type(schemes["policy"]) is ws.SharedMemWeightSyncScheme
    assert schemes["policy"].timeout == 30
    policy = make_policy(0.0)
    collector = multi("MultiSyncCollector", schemes["policy"], policy=policy)
    try:
        batches = iter(collector)
        trainer_step(policy, 1.0)
        assert rows(next(batches)) == [{0.0}, {0.0}]
        collector.update_policy_weights_()
        assert rows(next(batches)) == [{1.0}, {1.0}]
    finally:
        collector.shutdown()
