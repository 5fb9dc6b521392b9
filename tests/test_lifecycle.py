"""The state machine: every call out of order is refused with a clear error; pickling; the registry."""

from __future__ import annotations

import os
import pickle
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import weightsync as ws
from tests._workers import in_process_receiver

SCHEMES = [ws.MultiProcessWeightSyncScheme, ws.SharedMemWeightSyncScheme]


@pytest.mark.parametrize("cls", SCHEMES)
def test_calls_out_of_order(cls):
    scheme = cls(timeout=1, connect_timeout=1)
    with pytest.raises(ws.LifecycleError, match="cannot send: scheme is new"):
        scheme.send()
    with pytest.raises(ws.LifecycleError, match="cannot connect"):
        scheme.connect()
    with pytest.raises(ws.LifecycleError, match="cannot receive"):
        scheme.receive()
    with pytest.raises(ws.LifecycleError, match="init_on_sender"):
        scheme.get_sender()
    with pytest.raises(ws.LifecycleError, match="init_on_receiver"):
        scheme.get_receiver()

    scheme.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=1)
    with pytest.raises(ws.LifecycleError, match="cannot init_on_sender"):
        scheme.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=1)
    with pytest.raises(ws.LifecycleError, match="cannot init_on_receiver"):
        scheme.init_on_receiver(model_id="policy", model=nn.Linear(2, 2), worker_idx=0)
    with pytest.raises(ws.LifecycleError, match="cannot send: scheme is initialized as sender"):
        scheme.send()
    with pytest.raises(ws.LifecycleError, match="cannot receive"):
        scheme.receive()
    with pytest.raises(ws.LifecycleError, match="receiver's call"):
        scheme.connect(worker_idx=0)
    with pytest.raises(ws.SyncTimeoutError, match="workers \\[0\\] did not connect within 1s"):
        scheme.connect()
    scheme.shutdown()
    with pytest.raises(ws.LifecycleError, match="shut down"):
        scheme.send()
    scheme.shutdown()


def test_connect_twice_and_receive_on_a_sender_and_the_senders_reads_on_a_worker():

    scheme = ws.MultiProcessWeightSyncScheme(timeout=5, connect_timeout=10)
    scheme.init_on_sender(model_id="policy", context=SimpleNamespace(policy=nn.Linear(2, 2)), num_workers=1)
    receiver = in_process_receiver(scheme, nn.Linear(2, 2))
    # What a second program handed the same scheme (a second TorchRL collector) meets: it says why
    with pytest.raises(ws.LifecycleError, match="cannot connect: scheme is connected sender.*serves a SimpleNamespace"):
        scheme.connect()
    with pytest.raises(ws.LifecycleError, match="cannot init_on_sender: .*serves a SimpleNamespace already"):
        scheme.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=1)
    with pytest.raises(ws.LifecycleError, match="cannot connect: scheme is connected receiver") as refused:
        receiver.connect(worker_idx=0)
    assert "serves" not in str(refused.value)
    with pytest.raises(ws.LifecycleError, match="cannot receive: scheme is connected sender") as refused:
        scheme.receive()
    assert "serves" not in str(refused.value)
    with pytest.raises(ws.LifecycleError, match="cannot send: scheme is connected receiver"):
        receiver.send()
    assert receiver.receive() is None  # nothing pending: returns at once
    # What the sends did is the sender's to tell: a worker's scheme refuses, where an empty answer would say "no
    # worker acked anything".
    for read in ("acked_versions", "failed_workers", "last_send", "stats"):
        with pytest.raises(ws.LifecycleError, match=f"{read}.*ask the sender's scheme"):
            receiver.stats() if read == "stats" else getattr(receiver, read)
    assert receiver.version == 0 and scheme.acked_versions == {0: 0} and scheme.stats()["acked_versions"] == {0: 0}
    scheme.shutdown()
    with pytest.raises(ws.ConnectionClosedError):
        receiver.receive(timeout=5)
    receiver.shutdown()


def test_bad_arguments():
    with pytest.raises(ws.ConfigurationError, match="timeout"):
        ws.MultiProcessWeightSyncScheme(timeout=0)
    with pytest.raises(ws.ConfigurationError, match="max_slots"):
        ws.SharedMemWeightSyncScheme(max_slots=0)
    # (a shared_mem worker reads the slot of its version while the next is written: with one, every send waited
    # its whole timeout, then failed; a multiprocess worker copies out of it, and one slot serves)
    with pytest.raises(ws.ConfigurationError, match="max_slots must be an int of at least 2 or None, got 1"):
        ws.SharedMemWeightSyncScheme(max_slots=1)
    assert ws.MultiProcessWeightSyncScheme(max_slots=1).max_slots == 1
    # (an option of the network schemes: Python's own message named neither the class nor what it takes)
    with pytest.raises(
        TypeError, match=r"MultiProcessWeightSyncScheme: got an unexpected keyword argument 'delta'; it"
    ):
        ws.MultiProcessWeightSyncScheme(delta=True)
    scheme = ws.MultiProcessWeightSyncScheme()
    with pytest.raises(ws.ConfigurationError, match="num_workers"):
        scheme.init_on_sender(model_id="policy", model=nn.Linear(2, 2))
    with pytest.raises(ws.ConfigurationError, match="num_workers must be a positive int"):
        scheme.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=0)
    for many in (65537, 10**9, 2**63):  # (10**9 ran for a minute, then ended in a bare MemoryError)
        with pytest.raises(ws.ConfigurationError, match="num_workers must be a positive int of at most 65536"):
            scheme.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=many)
    with pytest.raises(ws.ConfigurationError, match="unexpected arguments: \\['pipes'\\]"):
        scheme.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=1, pipes=[])
    with pytest.raises(ws.ConfigurationError, match="model path"):
        scheme.init_on_sender(model_id="policy.net", context=object(), num_workers=1)
    with pytest.raises(ws.ConfigurationError, match="model= or weights=, not both"):  # (weights= was ignored)
        scheme.init_on_sender(model_id="policy", model=nn.Linear(2, 2), weights={"x": torch.zeros(1)}, num_workers=1)
    assert scheme.state == "new"  # a refused init leaves the scheme usable
    receiver = ws.MultiProcessWeightSyncScheme()
    with pytest.raises(ws.LifecycleError, match="does not know where its sender is"):
        receiver.init_on_receiver(model_id="policy", model=nn.Linear(2, 2), worker_idx=0)


@pytest.mark.parametrize("backend", ["multiprocess", "distributed"])
def test_weights_that_do_not_fit_fail_connect_before_its_wait_and_it_connects_again(backend):
    """``connect(weights=...)`` that do not fit the model were refused only after the rendez-vous: with no worker
    there it waited its whole ``connect_timeout``; with one, the scheme was left connected with no version sent
    (a worker waited in vain, ``connect()`` could not be made again, a ``distributed`` send then timed out)."""
    import time

    from tests._workers import connect_pair

    model = nn.Linear(2, 2)
    sender = ws.WeightSyncScheme.from_backend(backend, timeout=10, connect_timeout=20)
    sender.init_on_sender(model_id="policy", model=model, num_workers=1)
    receiver = pickle.loads(pickle.dumps(sender))
    receiver.init_on_receiver(model_id="policy", model=nn.Linear(2, 2), worker_idx=0)
    try:
        began = time.monotonic()
        with pytest.raises(ws.WeightMismatchError, match=r"missing keys \['bias', 'weight'\]; extra keys \['x'\]"):
            sender.connect(weights={"x": torch.zeros(1)})
        assert time.monotonic() - began < 5 and sender.state == "initialized as sender"
        connect_pair(sender, receiver)
        assert receiver.version == 0 and torch.equal(receiver.model.weight, model.weight)
        with torch.no_grad():
            model.weight.add_(1.0)
        sender.send_async()
        assert receiver.receive(timeout=10) is not None
        sender.wait_async()
        assert receiver.version == 1 and torch.equal(receiver.model.weight, model.weight)
    finally:
        receiver.shutdown()
        sender.shutdown()


@pytest.mark.parametrize("backend", ["multiprocess", "distributed"])
def test_a_receiver_shut_down_while_another_thread_waits_in_receive_says_so_there(backend):
    """The waiting thread got what the closed engine then raised: ``distributed``, a bare ``AttributeError``
    ('NoneType' object has no attribute 'frame'); ``multiprocess``, that the sender closed the channel."""
    import threading

    from tests._workers import connect_pair

    sender = ws.WeightSyncScheme.from_backend(backend, timeout=20, connect_timeout=20)
    sender.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=1)
    receiver = pickle.loads(pickle.dumps(sender))
    receiver.init_on_receiver(model_id="policy", model=nn.Linear(2, 2), worker_idx=0)
    raised = []

    def waits():
        try:
            receiver.receive(timeout=15)
        except BaseException as exc:  # noqa: BLE001 - what the test reads
            raised.append(exc)

    try:
        connect_pair(sender, receiver)
        engine, entered = receiver._runtime.receiving.engine, threading.Event()
        take = engine.take

        def marked(*args):  # (the thread is in the engine's wait for an update once this is set)
            entered.set()
            return take(*args)

        engine.take = marked
        waiting = threading.Thread(target=waits)
        waiting.start()
        assert entered.wait(10)
        receiver.shutdown()
        waiting.join(15)
        assert not waiting.is_alive() and len(raised) == 1
        assert isinstance(raised[0], ws.LifecycleError), repr(raised[0])
        assert "shut down while it waited for an update" in str(raised[0])
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_a_sender_whose_worker_was_refused_says_why_when_its_connect_gives_up():
    """A worker refused at its hello (here its model_id is another model's) was only logged: ``connect()`` said
    "workers [0] did not connect" after its whole wait. (It waits on: another process may yet take the index.)"""
    import threading

    sender = ws.MultiProcessWeightSyncScheme(connect_timeout=3)
    sender.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=1)
    worker = pickle.loads(pickle.dumps(sender))
    worker.init_on_receiver(model_id="value", model=nn.Linear(2, 2), worker_idx=0)
    raised = []
    joining = threading.Thread(target=lambda: raised.append(pytest.raises(ws.ConfigurationError, worker.connect)))
    try:
        joining.start()
        with pytest.raises(ws.SyncTimeoutError, match=r"\[0\] did not connect within 3s; worker 0: it was refused: "):
            sender.connect()
        joining.join(10)
        assert "the sender refused this worker" in str(raised[0].value)
    finally:
        worker.shutdown()
        sender.shutdown()


def test_worker_ids_take_numpys_ints_and_refuse_what_names_no_worker_by_name():
    import numpy as np

    from weightsync.core.workers import check_worker_idx, targets

    # (numpy's ints were refused, a list of them as "not workers of this scheme (valid: 0..1)", as num_workers took
    # them; a dict was taken as its keys)
    assert targets(np.int64(1), 2, "policy") == [1] and targets([np.int32(1), 0], 2, "policy") == [0, 1]
    assert check_worker_idx(np.int64(1), 2, "policy") == 1 and type(targets([np.int64(1)], 2, None)[0]) is int
    assert targets([], 2, "policy") == []  # (published for workers that rejoin: test_ray.py)
    refused = [
        ({0: 1}, "must be None, an int or a list"),
        (np.array(1), "must be None, an int or a list"),
        (torch.tensor(1), "must be None, an int or a list"),
        ("01", "must be None"),
        ([True], r"\[True\]"),
        ([1.0], r"\[1.0\]"),
        ([-1, np.int64(2)], r"\[-1, np.int64\(2\)\]"),
        ([0, np.int64(0)], "duplicates"),
    ]
    for bad, named in refused:
        with pytest.raises(ws.ConfigurationError, match=named):
            targets(bad, 2, "policy")


#: (Python 3.12 warns where a process with threads forks: these tests do so on purpose)
_FORK_WITH_THREADS = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")


def _in_fork(target, *args):
    """What ``target(*args, conn)`` sends on ``conn`` from a process ``fork`` made of this one (at most 60 s)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=target, args=(*args, theirs))
    child.start()
    try:
        assert ours.poll(60), "the forked process said nothing"
        return ours.recv()
    finally:
        child.join(30)
        if child.exitcode is None:
            child.kill()
            child.join(30)


def _init_says(scheme, models, as_sender_first: bool = False) -> str:
    """What ``init_on_receiver`` (after ``init_on_sender``, if asked) says in a forked child."""
    # (the models come made from the parent: a fork child drawing random numbers hung for good where another thread
    # of the parent held torch's generator at the fork, as happened in CI)
    try:
        if as_sender_first:  # (a scheme forked new, made a sender here: a misuse here is not the fork's)
            scheme.init_on_sender(model_id="policy", model=models[0], num_workers=1)
        scheme.init_on_receiver(model_id="policy", model=models[-1], worker_idx=0)
        return "initialized"
    except ws.WeightSyncError as exc:
        return f"{type(exc).__name__}: {exc}"


def _init_in_fork(scheme, models, as_sender_first, conn) -> None:
    try:
        conn.send(_init_says(scheme, models, as_sender_first))
    finally:
        scheme.shutdown()  # (a worker's own, or a copy of its parent's: that lets go of nothing of the parent's)


@_FORK_WITH_THREADS
def test_a_sender_that_reached_a_worker_by_fork_is_refused_there_by_name():
    # ('fork', Linux's default start method before Python 3.14, hands the child the trainer's object, not a pickled
    # one: it said "scheme is initialized as sender; init_on_receiver needs it new", naming no cause)
    def forked(scheme, as_sender_first: bool = False) -> str:
        return _in_fork(_init_in_fork, scheme, (nn.Linear(2, 2), nn.Linear(2, 2)), as_sender_first)

    scheme = ws.MultiProcessWeightSyncScheme(timeout=20)
    said = forked(scheme, as_sender_first=True)  # (forked new: the fork is not the cause)
    assert said.startswith("LifecycleError") and "fork" not in said and "initialized as sender" in said, said
    scheme.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=1)
    try:
        key_file = scheme.receiver_config(0)["connection"]["authkey_file"]
        said = forked(scheme)
        assert said.startswith("LifecycleError") and "by fork, not pickled" in said and "receiver_config" in said, said
        assert "in use by another thread" not in said
        assert os.path.exists(key_file)  # (the child's shutdown removed it: workers from configs could not join)
    finally:
        scheme.shutdown()


def _use_in_fork(scheme, model, conn) -> None:
    # (what a forked worker does with its copy: init_on_receiver, a forward pass of a held model, shutdown)
    said = _init_says(scheme, (model,))
    free = scheme._runtime.weights_lock.acquire(timeout=20)  # (what a held model's forward pass takes)
    scheme.shutdown()
    conn.send((said, free))


@_FORK_WITH_THREADS
@pytest.mark.parametrize(
    "held, initialized",
    [("lock", True), ("weights_lock", True), ("lock", False)],
    ids=["a send under way", "an update being written", "an init_on_sender under way"],
)
def test_a_scheme_forked_while_another_thread_holds_it_is_refused_in_the_child_not_waited_on_for_good(
    held, initialized
):
    """Another thread of the parent holds one of the scheme's locks (a send, an update's write, a set-up call);
    ``fork`` copied the lock held, and in the child, where that thread does not exist, ``init_on_receiver`` and the
    ``shutdown`` after it waited on it forever. A copy made in the middle of ``init_on_sender`` is new, yet holds
    the trainer's half-made sender: refused too, its shutdown letting go of nothing of the trainer's."""
    scheme = ws.MultiProcessWeightSyncScheme(timeout=20)
    if initialized:
        scheme.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=1)
    taken, done = threading.Event(), threading.Event()

    def holding() -> None:  # (as such a call holds it, for as long as the test needs)
        with getattr(scheme._runtime, held):
            taken.set()
            done.wait(120)

    thread = threading.Thread(target=holding, name="test-holding")
    thread.start()
    try:
        assert taken.wait(30)
        said, free = _in_fork(_use_in_fork, scheme, nn.Linear(2, 2))
        assert said.startswith("LifecycleError") and "in use by another thread there" in said, said
        assert "by fork, not pickled" in said and free
    finally:
        done.set()
        thread.join(30)
        scheme.shutdown()


def _release_in_fork(scheme, conn) -> None:
    try:
        scheme._runtime.lock.release()  # (the forking thread's hold, which goes on in the child)
        conn.send(("released", scheme._runtime.forked_in_use))
    except RuntimeError as exc:
        conn.send((str(exc), scheme._runtime.forked_in_use))


@_FORK_WITH_THREADS
def test_a_lock_the_forking_thread_holds_stays_its_own_in_the_child():
    scheme = ws.MultiProcessWeightSyncScheme(timeout=20)
    try:
        with scheme._runtime.lock:
            said = _in_fork(_release_in_fork, scheme)
        assert said == ("released", False)  # (its own: the copy is the child's to use)
    finally:
        scheme.shutdown()


def test_pickle_keeps_configuration_only():
    scheme = ws.SharedMemWeightSyncScheme(strategy="state_dict", sync=False, timeout=7, per_worker_weights=True)
    clone = pickle.loads(pickle.dumps(scheme))
    assert (clone.strategy.extract_as, clone.sync, clone.timeout, clone.per_worker_weights) == (
        "state_dict",
        False,
        7.0,
        True,
    )
    scheme.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=1)
    ready = pickle.loads(pickle.dumps(scheme))
    assert ready.state == "new" and ready.model is None and ready.model_id == "policy"
    with pytest.raises(ws.LifecycleError, match="only be initialized as a receiver"):
        ready.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=1)
    assert b"Linear" not in pickle.dumps(scheme)  # no model, no runtime state travels
    scheme.shutdown()


def test_registry_and_from_backend():
    assert {"multiprocess", "shared_mem", "no_sync"} <= set(ws.available_backends())
    assert isinstance(ws.WeightSyncScheme.from_backend("shared_mem", timeout=3), ws.SharedMemWeightSyncScheme)
    assert ws.get_backend("mp") is ws.MultiProcessWeightSyncScheme
    with pytest.raises(ws.ConfigurationError, match="unknown weight-sync backend 'carrier-pigeon'; known: \\["):
        ws.WeightSyncScheme.from_backend("carrier-pigeon")

    class Custom(ws.NoWeightSyncScheme):
        backend = "custom-test"

    ws.register_backend("custom-test", Custom)
    try:
        assert isinstance(ws.WeightSyncScheme.from_backend("custom-test"), Custom)
        with pytest.raises(ws.ConfigurationError, match="already registered"):
            ws.register_backend("custom-test", Custom)
        ws.register_backend("lazy-test", "weightsync.schemes.no_sync:NoWeightSyncScheme")
        assert ws.get_backend("lazy-test") is ws.NoWeightSyncScheme
        ws.register_backend("broken-test", "weightsync.nowhere:Nothing")
        with pytest.raises(ws.ConfigurationError, match="not available"):
            ws.get_backend("broken-test")
    finally:
        from weightsync import registry

        for name in ("custom-test", "lazy-test", "broken-test"):
            registry._schemes.pop(name, None)


def test_no_sync_receiver_needs_nothing():
    scheme = ws.NoWeightSyncScheme()
    scheme.init_on_receiver(model_id="policy", model=nn.Linear(1, 1))
    scheme.connect()
    assert scheme.receive() is None and scheme.get_receiver().receive() is False
    scheme.shutdown()


def test_a_no_sync_trainers_receiver_config_makes_a_worker_that_moves_nothing():
    """A trainer on ``no_sync`` hands its workers configs as any scheme does (the main job's
    ``scheme=no_sync`` failed there on a bare AssertionError: no engine to say where it is)."""
    sender = ws.NoWeightSyncScheme()
    sender.init_on_sender(model_id="policy", model=nn.Linear(1, 1), num_workers=2)
    config = sender.receiver_config(1)
    assert config["connection"] == {} and config["worker_idx"] == 1
    worker = ws.from_config(config)
    worker.init_on_receiver(model_id="policy", model=nn.Linear(1, 1))
    worker.connect()
    assert worker.receive() is None and worker.worker_idx == 1
    worker.shutdown()
    sender.shutdown()


def test_wrong_auth_key_is_refused():
    import threading

    scheme = ws.MultiProcessWeightSyncScheme(timeout=5, connect_timeout=3)
    scheme.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=1)
    address = scheme.sender_transports or pickle.loads(pickle.dumps(scheme))._handoff["address"]
    intruder = ws.MultiProcessWeightSyncScheme(timeout=5, connect_timeout=3)
    intruder.init_on_receiver(
        model_id="policy", model=nn.Linear(2, 2), worker_idx=0, address=address, authkey=b"0" * 32
    )
    errors = []

    def join():
        try:
            intruder.connect()
        except ws.WeightSyncError as exc:
            errors.append(exc)

    joiner = threading.Thread(target=join)
    joiner.start()
    with pytest.raises(ws.SyncTimeoutError, match="workers \\[0\\] did not connect"):
        scheme.connect()
    joiner.join(10)
    assert len(errors) == 1 and isinstance(errors[0], ws.AuthenticationError)
    scheme.shutdown()
    intruder.shutdown()


def test_prepare_weights_resolves_models_and_paths():
    from tests._workers import Holder, TinyNet

    model = TinyNet()
    scheme = ws.SharedMemWeightSyncScheme()
    scheme.init_on_sender(model_id="env.transform[0].module", context=Holder(model), num_workers=1)
    assert scheme.model is model
    td = scheme.prepare_weights(None)
    assert td["body", "0", "weight"].data_ptr() == model.body[0].weight.data_ptr()
    sd = scheme.prepare_weights(None, strategy=ws.WeightStrategy("state_dict"))
    assert "body.0.weight" in sd and "scale" not in sd
    other = TinyNet()
    assert scheme.prepare_weights("env.transform[0].module", context=Holder(other))["scale"].data_ptr() == (
        other.scale.data_ptr()
    )
    with pytest.raises(ws.InvalidWeightsError, match="not a tensor|non-tensor"):
        scheme.prepare_weights({"w": 1})
    scheme.shutdown()


@pytest.mark.parametrize("backend", ["multiprocess", "shared_mem", "distributed"])
@pytest.mark.parametrize("handed", ["scheme", "receiver_config"])
def test_connect_names_a_worker_process_that_exited_before_it_connected_at_once(backend, handed):
    """A worker process started with the scheme (pickled for it), or handed to connect(processes=...) (started
    with a receiver config), that exits before it connects is named by connect() at once, not after
    connect_timeout."""
    import multiprocessing as mp
    import time

    from tests._workers import fails_at_start

    scheme = ws.WeightSyncScheme.from_backend(backend, connect_timeout=60)
    scheme.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=2)
    arg = scheme if handed == "scheme" else {"policy": scheme.receiver_config(1)}
    proc = mp.get_context("spawn").Process(target=fails_at_start, args=(arg, 1), name="doomed")
    proc.start()
    began = time.monotonic()
    with pytest.raises(ws.WorkerDiedError) as caught:
        scheme.connect(processes=[proc] if handed == "receiver_config" else None)
    took = time.monotonic() - began
    proc.join(10)
    # Said once: a connect() made again (a restart on its way) is not ended by it again, at once.
    scheme.connect_timeout = 1.0
    with pytest.raises(ws.SyncTimeoutError, match=r"did not (connect|join|form) within 1s"):
        scheme.connect()
    scheme.shutdown()
    assert f"worker process doomed (pid {proc.pid}) exited with code 3 before it connected" in str(caught.value)
    assert "workers [0, 1] have not connected" in str(caught.value)
    assert took < 30  # spawning takes seconds; the timeout is 60 s


def test_a_worker_pays_for_its_strategys_format_at_connect_not_at_its_first_receive():
    # (tensordict costs seconds to import: the first receive() imported it after its ack, and the worker's next
    # ack came that much later; a sender with a short timeout dropped a healthy worker)
    import subprocess
    import sys
    from pathlib import Path

    script = """
import sys, torch, weightsync as ws
from tests._workers import in_process_receiver
sender = ws.MultiProcessWeightSyncScheme(timeout=20)
sender.init_on_sender(model_id="policy", model=torch.nn.Linear(2, 2), num_workers=1)
before = "tensordict" in sys.modules
receiver = in_process_receiver(sender, torch.nn.Linear(2, 2))
print(before, "tensordict" in sys.modules)
receiver.shutdown()
sender.shutdown()
"""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "True"], done.stdout + done.stderr[-2000:]


TRAINER_THAT_RAISES = """
import multiprocessing as mp, torch, weightsync as ws

def worker(scheme, idx):
    policy = torch.nn.Linear(4, 2)
    scheme.init_on_receiver(model_id="policy", model=policy, worker_idx=idx)
    scheme.connect()
    while True:
        try:
            scheme.receive(timeout=1.0)
        except ws.ConnectionClosedError:
            break

def train():
    policy = torch.nn.Linear(4, 2)
    scheme = ws.{cls}(timeout=30)
    scheme.init_on_sender(model_id="policy", model=policy, num_workers=1)
    procs = [mp.get_context("forkserver").Process(target=worker, args=(scheme, 0))]  # (not daemons)
    for p in procs:
        p.start()
    scheme.connect()
    scheme.send()
    raise RuntimeError("loss is NaN")

if __name__ == "__main__":
    if {as_process}:  # (a trainer that is itself a process: a DDP rank; its exit runs no atexit hook)
        trainer = mp.get_context("forkserver").Process(target=train)
        trainer.start()
        trainer.join()
        raise SystemExit(trainer.exitcode)
    train()
"""


@pytest.mark.parametrize(
    "cls,as_process",
    [("SharedMemWeightSyncScheme", False), ("DistributedWeightSyncScheme", True)],
    ids=["shared_mem", "distributed-in-a-process"],
)
def test_a_trainer_that_raises_with_its_workers_alive_ends_and_so_do_they(tmp_path, cls, as_process):
    """The README's program shape, its loop raising: multiprocessing joins the process's children at its exit, and
    a worker waiting for its sender's next version never ended: the trainer hung for good (a user's audit). Its
    senders still open are shut down first, and the workers hear it."""
    import subprocess
    import sys

    script = tmp_path / "trainer.py"
    script.write_text(TRAINER_THAT_RAISES.replace("{cls}", cls).replace("{as_process}", str(as_process)))
    ran = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert ran.returncode == 1 and "RuntimeError: loss is NaN" in ran.stderr, ran.stderr[-3000:]


def test_the_senders_open_at_exit_are_shut_down_side_by_side(monkeypatch):
    """Shut down in turn, two senders whose workers hung took the sum of their timeouts to exit: here, each one's
    shutdown ends only once the other's began."""
    import threading
    import weakref

    from weightsync.core import leaving

    both = threading.Barrier(2, timeout=10)
    ended = []

    class Sender:
        model_id, timeout, _runtime = "policy", 10.0, SimpleNamespace(holds_nothing=False)

        def shutdown(self) -> None:
            both.wait()
            ended.append(self)

    senders = [Sender(), Sender()]
    monkeypatch.setattr(leaving, "_open", weakref.WeakSet(senders))
    leaving._shut_down_open()
    assert len(ended) == 2


def test_the_senders_open_at_exit_are_shut_down_in_turn_where_no_thread_can_start(monkeypatch):
    """Python 3.12 starts no thread in an ``atexit`` hook, where the main process's exit shuts its senders down (a
    review): each is shut down in turn then, not left open."""
    import threading
    import weakref

    from weightsync.core import leaving

    ended = []

    class Sender:
        model_id, timeout, _runtime = "policy", 10.0, SimpleNamespace(holds_nothing=False)

        def shutdown(self) -> None:
            ended.append(self)

    def refused(self) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    senders = [Sender(), Sender()]
    monkeypatch.setattr(leaving, "_open", weakref.WeakSet(senders))
    monkeypatch.setattr(threading.Thread, "start", refused)
    leaving._shut_down_open()
    assert sorted(map(id, ended)) == sorted(map(id, senders))


def test_no_sync_refuses_what_every_scheme_refuses_in_the_caller():
    """Switched to no_sync, a run lost its NaN guard and its check of worker_ids and weights (a user's audit)."""
    model = nn.Linear(2, 2)
    scheme = ws.NoWeightSyncScheme(check_finite=True)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    scheme.connect()
    scheme.send(worker_ids=[1])
    with pytest.raises(ws.ConfigurationError, match=r"worker_ids \[7\] are not workers of this scheme"):
        scheme.send(worker_ids=[0, 7])
    with pytest.raises(ws.InvalidWeightsError, match="weights must be an nn.Module"):
        scheme.send(weights=42)
    with pytest.raises(ws.WeightMismatchError, match=r"mismatched \{'weight': got \[3, 2\]"):
        scheme.send(weights={"weight": torch.zeros(3, 2), "bias": torch.zeros(2)})
    with pytest.raises(ws.WeightMismatchError, match=r"missing keys \['bias'\]"):
        scheme.send(weights={"weight": torch.zeros(2, 2)})
    scheme.send(weights={k: v.clone() for k, v in model.state_dict().items()})
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(ws.InvalidWeightsError, match="NaN or Inf"):
        scheme.send()
    assert scheme.version == 2
    scheme.shutdown()
