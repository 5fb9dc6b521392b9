"""The local schemes in real worker processes: one body over every scheme, then isolation, torn reads, failures."""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest
import torch

import weightsync as ws
from tests import _bodies as bodies
from tests._bodies import optimizer_step
from tests._bodies import start as start_workers
from tests._workers import build, checksum, in_process_receiver, serve
from weightsync.core.timing import deadline_after, wait_until


@pytest.mark.parametrize("strategy", ["tensordict", "state_dict"])
def test_every_send_reaches_every_targeted_worker(make_scheme, workers, strategy):
    bodies.every_send_reaches_every_targeted_worker(make_scheme(strategy=strategy), workers, strategy)


def test_two_models_with_two_schemes(workers):
    policy, value = build("tiny"), build("value")
    schemes = {
        "policy": ws.MultiProcessWeightSyncScheme(timeout=20),
        "value": ws.SharedMemWeightSyncScheme(strategy="state_dict", timeout=20),
    }
    schemes["policy"].init_on_sender(model_id="policy", model=policy, num_workers=2)
    schemes["value"].init_on_sender(model_id="value", weights=value.state_dict(), num_workers=2)
    group, ready = start_workers(workers, schemes, {"policy": "tiny", "value": "value"})
    for _, log, _ in ready:
        assert sorted(log) == sorted([("policy", 0, checksum(policy)), ("value", 0, checksum(value, "state_dict"))])
    for step in range(1, 4):
        optimizer_step(policy, step)
        optimizer_step(value, 100 + step)
        schemes["policy"].send()
        schemes["value"].send(weights=value)
        for w in range(2):
            state = group.ask(w, "state")
            assert state["policy"] == (step, checksum(policy))
            assert state["value"] == (step, checksum(value, "state_dict"))
    group.stop()
    for scheme in schemes.values():
        scheme.shutdown()


def test_pickled_scheme_older_facade_and_model_path_with_spawn(workers):
    """A scheme pickled into spawned processes; the older facade on both sides; a TorchRL-style model path."""
    import multiprocessing as mp

    from tests._workers import Holder

    model = build("tiny")
    scheme = ws.MultiProcessWeightSyncScheme(timeout=30, connect_timeout=120)
    scheme.init_on_sender(model_id="env.transform[0].module", context=Holder(model), num_workers=2)
    with pytest.raises(ws.LifecycleError):
        scheme.get_receiver()
    sender = scheme.get_sender()
    path = "env.transform[0].module"
    kinds = {path: "tiny"}
    ctx = mp.get_context("spawn")
    procs, cmds = [], []
    for i in range(2):
        parent, child = ctx.Pipe()
        procs.append(ctx.Process(target=serve, args=({path: scheme}, i, kinds, child, True, True), daemon=True))
        procs[-1].start()
        child.close()
        cmds.append(parent)
    try:
        scheme.connect()
        for cmd in cmds:
            assert cmd.poll(60)
            _, log, errors = cmd.recv()
            assert errors == {} and log[0][1:] == (0, checksum(model))
        optimizer_step(model, 1)
        sender.send()
        optimizer_step(model, 2)
        sender.update_weights()
        for cmd in cmds:
            cmd.send(("state",))
            assert cmd.poll(30)
            assert cmd.recv()[path] == (2, checksum(model))
    finally:
        for cmd in cmds:
            cmd.send(("stop",))
        for proc in procs:
            proc.join(30)
        scheme.shutdown()
    assert [p.exitcode for p in procs] == [0, 0]


def test_corrupted_payload_is_refused_and_the_model_kept(make_scheme, workers):
    bodies.corrupted_payload_is_refused_and_the_model_kept(make_scheme(checksum=True), workers)


def test_trainer_changes_are_invisible_until_send(make_scheme, workers):
    bodies.trainer_changes_are_invisible_until_send(make_scheme(), workers)


@pytest.mark.parametrize("kind", ["multiprocess", "shared_mem", "shared_mem-thread"])
def test_no_torn_reads_while_sending_alternating_weights(workers, kind):
    background = kind.endswith("thread")
    cls = ws.SharedMemWeightSyncScheme if kind.startswith("shared_mem") else ws.MultiProcessWeightSyncScheme
    scheme = cls(sync=False, timeout=20, background_thread=background)
    bodies.no_torn_reads_under_alternating_sends(scheme, workers, 150, background)


def test_a_ctrl_c_as_the_trainer_takes_an_ack_loses_no_ack(make_scheme, workers):
    bodies.a_ctrl_c_as_the_trainer_takes_an_ack_loses_no_ack(make_scheme(), workers)


def _two_connected(cls, workers):
    model = build("tiny")
    scheme = cls(timeout=5)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, ready = start_workers(workers, {"policy": scheme}, {"policy": "tiny"})
    assert all(errors == {} for _, _, errors in ready)
    return model, scheme, group


def _every_worker_holds_the_next_version(model, scheme, group) -> None:
    """The next send reaches both workers whole, within the scheme's bound, naming no one."""
    optimizer_step(model, 7)
    scheme.send()
    assert [group.ask(i, "state")["policy"] for i in range(2)] == [(scheme.version, checksum(model))] * 2


@pytest.mark.parametrize("cls", [ws.MultiProcessWeightSyncScheme, ws.SharedMemWeightSyncScheme])
def test_a_ctrl_c_as_the_trainer_reads_an_ack_leaves_the_channel_in_step(cls, workers):
    """A Ctrl-C right after bytes of an ack's frame were read off the channel, before they were taken: they were
    lost, the next read began in the middle of the frame ("announced a frame of 2065854320 bytes"), and the live
    worker was named dead at every later send (found by a review's sweep of interrupts)."""
    from weightsync.transports.local.frames import FrameReader

    model, scheme, group = _two_connected(cls, workers)
    try:
        optimizer_step(model, 1)
        with bodies.sigint_at_first_call(FrameReader, "feed") as hits, pytest.raises(KeyboardInterrupt):
            scheme.send()
        assert hits == ["feed"]
        _every_worker_holds_the_next_version(model, scheme, group)
    finally:
        scheme.shutdown()


@pytest.mark.parametrize("cls", [ws.MultiProcessWeightSyncScheme, ws.SharedMemWeightSyncScheme])
def test_a_ctrl_c_in_the_trainers_shutdown_is_raised_once_everything_is_released(cls, workers):
    """A Ctrl-C as shutdown() stopped its rejoin thread cut it short: the key file, the slots, the listener and the
    channels stayed held for the rest of the process, its workers were never told, and a second shutdown() did
    nothing: the scheme said it was closed (a local schemes user's audit)."""
    from weightsync.core.rejoin import Admitter

    model, scheme, group = _two_connected(cls, workers)
    key_file = scheme.receiver_config(0)["connection"]["authkey_file"]
    with bodies.sigint_at_first_call(Admitter, "stop") as hits, pytest.raises(KeyboardInterrupt):
        scheme.shutdown()
    assert hits == ["stop"] and not os.path.exists(key_file)
    for i in range(2):  # (each hears it at its next look)
        assert wait_until(lambda i=i: group.ask(i, "closed"), deadline_after(30), 0.05), i


class _ChannelSocket:
    """A channel's socket, whose ``sendmsg`` (the byte that carries a frame's descriptors) the test can watch."""

    def __init__(self, sock) -> None:
        self._sock = sock

    def sendmsg(self, *args):
        return self._sock.sendmsg(*args)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_a_ctrl_c_between_a_slots_announcement_and_its_descriptor_leaves_the_channel_in_step(workers):
    """The frame that announces a new slot, then the byte that carries its descriptor: a Ctrl-C between the two
    left the worker waiting for a descriptor that never came ("expected 1 file descriptors, got 0"), its channel
    out of step, and every later send named it dead."""
    model, scheme, group = _two_connected(ws.SharedMemWeightSyncScheme, workers)
    try:
        channel = scheme.sender_transports[0].channel
        channel._sock = _ChannelSocket(channel._sock)
        optimizer_step(model, 1)
        with bodies.sigint_at_first_call(_ChannelSocket, "sendmsg") as hits, pytest.raises(KeyboardInterrupt):
            scheme.send()
        assert hits == ["sendmsg"]
        channel._sock = channel._sock._sock
        scheme.wait_async()
        _every_worker_holds_the_next_version(model, scheme, group)
    finally:
        scheme.shutdown()


@pytest.mark.parametrize("cls", [ws.MultiProcessWeightSyncScheme, ws.SharedMemWeightSyncScheme])
def test_what_ended_a_background_thread_is_raised_at_every_receive_as_an_error_of_its_own(cls):
    """The sender shut down: every later ``receive()`` of a worker whose background thread saw it raises
    ``ConnectionClosedError``, each a copy: the one error raised again grew its traceback by every receive's frames
    (a worker polling ``receive(0)`` kept more at each)."""
    import pickle
    import traceback

    from tests._workers import connect_pair

    sender = cls(timeout=20)
    sender.init_on_sender(model_id="policy", model=build("tiny"), num_workers=1)
    receiver = pickle.loads(pickle.dumps(sender))
    receiver.background_thread = True
    receiver.init_on_receiver(model_id="policy", model=build("tiny"), worker_idx=0)
    try:
        connect_pair(sender, receiver)
        sender.shutdown()
        raised = []
        for _ in range(3):
            with pytest.raises(ws.ConnectionClosedError) as info:
                receiver.receive(timeout=20)
            raised.append(info.value)
    finally:
        receiver.shutdown()
        sender.shutdown()
    assert len({id(e) for e in raised}) == 3
    assert len({len(traceback.extract_tb(e.__traceback__)) for e in raised}) == 1, [e.__traceback__ for e in raised]


def test_receiver_that_cannot_apply_reports_to_the_sender(workers):
    model = build("tiny")
    scheme = ws.SharedMemWeightSyncScheme(timeout=20)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group = workers(
        serve, 2, lambda i, conn: ({"policy": scheme}, i, {"policy": "tiny" if i == 0 else "tiny_wrong"}, conn)
    )
    with pytest.raises(ws.ReceiverError) as info:
        scheme.connect()
    err = info.value
    assert err.worker_idx == 1 and err.model_id == "policy" and err.remote_type == "WeightMismatchError"
    assert "body.3.weight" in str(err) and "body.3.bias" in str(err) and "scale" in str(err)
    _, log0, errors0 = group.recv(0)
    _, log1, errors1 = group.recv(1)
    assert errors0 == {} and log0 == [("policy", 0, checksum(model))]
    assert "WeightMismatchError" in errors1["policy"]
    scrambled = build("tiny_wrong")
    from tests._workers import _scramble

    _scramble(scrambled)
    assert group.ask(1, "state")["policy"] == (None, checksum(scrambled)), "the failing worker's model was touched"

    optimizer_step(model, 3)
    with pytest.raises(ws.ReceiverError, match="body.3.weight") as info:
        scheme.send()  # the worker that failed at connect is named again, with its cause
    assert info.value.worker_idx == 1
    assert group.ask(0, "state")["policy"] == (1, checksum(model)), "the healthy worker was not updated"
    assert group.ask(1, "state")["policy"] == (None, checksum(scrambled))
    group.stop()
    scheme.shutdown()


@pytest.mark.parametrize("scheme_name", ["multiprocess", "shared_mem"])
def test_apply_failure_after_connect_is_acked_with_its_cause(workers, scheme_name):
    model = build("tiny")
    scheme = ws.WeightSyncScheme.from_backend(scheme_name, timeout=20)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, _ = start_workers(workers, {"policy": scheme}, {"policy": "tiny"})
    assert group.ask(1, "break_model", "policy") == "broken"
    held = group.ask(1, "state")["policy"]
    optimizer_step(model, 1)
    with pytest.raises(ws.ReceiverError) as info:
        scheme.send()
    err = info.value
    assert (err.worker_idx, err.version, err.remote_type) == (1, 1, "WeightMismatchError")
    assert "body.3.weight" in err.remote_message and "[3, 8] float32" in err.remote_message
    assert group.ask(0, "state")["policy"] == (1, checksum(model))
    assert group.ask(1, "state")["policy"] == held, "a refused update changed the worker's model"
    assert any(entry[1] == "error" for entry in group.ask(1, "log")), "the worker was not told either"
    optimizer_step(model, 2)
    scheme.send(worker_ids=0)  # the failing worker stays connected; the others go on
    assert group.ask(0, "state")["policy"] == (2, checksum(model))
    group.stop()
    scheme.shutdown()


@pytest.mark.parametrize("scheme_name", ["multiprocess", "shared_mem"])
def test_worker_killed_during_a_send(workers, scheme_name):
    timeout = 10.0
    model = build("tiny")
    scheme = ws.WeightSyncScheme.from_backend(scheme_name, timeout=timeout)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, _ = start_workers(workers, {"policy": scheme}, {"policy": "tiny"})
    assert group.ask(1, "die_on_next_update", "policy") == "armed"
    optimizer_step(model, 1)
    start = time.monotonic()
    with pytest.raises(ws.WorkerDiedError) as info:
        scheme.send()
    assert time.monotonic() - start < timeout
    assert info.value.worker_idx == 1 and info.value.model_id == "policy" and info.value.version == 1
    group.procs[1].join(10)
    assert group.procs[1].exitcode == -signal.SIGKILL
    assert group.ask(0, "state")["policy"] == (1, checksum(model))
    assert not scheme.sender_transports[1].check_connection()
    assert 1 in scheme.failed_workers

    optimizer_step(model, 2)
    with pytest.raises(ws.WorkerDiedError):
        scheme.send()  # the dead worker is named again; the live one is still served
    assert group.ask(0, "state")["policy"] == (2, checksum(model))
    optimizer_step(model, 3)
    scheme.send(worker_ids=[0])
    assert group.ask(0, "state")["policy"] == (3, checksum(model))
    group.stop()
    scheme.shutdown()


def test_stopped_worker_times_out_with_its_name(workers):
    model = build("tiny")
    scheme = ws.MultiProcessWeightSyncScheme(timeout=1.0)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group, _ = start_workers(workers, {"policy": scheme}, {"policy": "tiny"})
    os.kill(group.procs[1].pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(ws.SyncTimeoutError) as info:
            scheme.send()
        assert 1.0 <= time.monotonic() - start < 5.0
        assert info.value.worker_idx == 1 and "version 1" in str(info.value)
        assert group.ask(0, "state")["policy"][0] == 1
    finally:
        os.kill(group.procs[1].pid, signal.SIGCONT)
    scheme.wait_async(timeout=20)  # once resumed, the worker catches up and acks
    assert scheme.acked_versions == {0: 1, 1: 1}
    group.stop()
    scheme.shutdown()


def test_bad_weights_fail_in_the_caller_and_send_nothing(make_scheme, workers):
    bodies.bad_weights_fail_in_the_caller_and_send_nothing(make_scheme(), workers)


@pytest.mark.parametrize("latest_wins", [True, False])
def test_async_sends_coalesce_to_the_latest_version(latest_wins):
    """A worker that fell behind applies only the newest pending version (or every one, in order)."""

    model = build("tiny")
    scheme = ws.MultiProcessWeightSyncScheme(sync=False, latest_wins=latest_wins, timeout=20, max_slots=8)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    replica = build("tiny")
    receiver = in_process_receiver(scheme, replica)
    sums = {}
    for step in range(1, 6):
        optimizer_step(model, step)
        sums[step] = checksum(model)
        scheme.send_async()
    applied = []
    while receiver.version != 5:
        if receiver.receive(timeout=5) is not None:
            applied.append(receiver.version)
    assert applied == ([5] if latest_wins else [1, 2, 3, 4, 5])
    assert checksum(replica) == sums[5]
    scheme.wait_async()
    assert scheme.acked_versions == {0: 5}
    receiver.shutdown()
    scheme.shutdown()


def test_no_sync_scheme_moves_nothing(workers):
    model = build("tiny")
    scheme = ws.NoWeightSyncScheme()
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2, pipes=["ignored"])
    group = workers(serve, 2, lambda i, conn: ({"policy": scheme}, i, {"policy": "tiny"}, conn))
    scheme.connect()
    before = [group.recv(w) for w in range(2)]
    assert [errors for _, _, errors in before] == [{}, {}]
    optimizer_step(model, 1)
    scheme.send()
    scheme.send_async(worker_ids=[1])
    scheme.wait_async()
    assert scheme.version == 2
    for w in range(2):
        version, digest = group.ask(w, "state")["policy"]
        assert digest == before[w][1][0][2] and digest != checksum(model)
    group.stop()
    scheme.shutdown()


@pytest.mark.parametrize("per_worker_weights", [False, True])
def test_send_waits_for_a_free_slot_then_passes_the_worker_holding_them_by(per_worker_weights):
    """With two slots, a shared-memory worker pins the one it reads and the other holds the version it did not take
    yet: the next send waits its whole timeout for a slot, then finds the worker late and passes it by, naming it
    (its slots leave the pool, never written again); the worker reads the version on its way intact, and the next
    send reaches it. (One slot is refused: every send failed so. Before, each send failed until the worker read.)"""
    model = build("tiny")
    scheme = ws.SharedMemWeightSyncScheme(timeout=0.5, max_slots=2, sync=False, per_worker_weights=per_worker_weights)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    replica = build("tiny")
    receiver = in_process_receiver(scheme, replica)
    optimizer_step(model, 1)
    scheme.send()
    held = checksum(model)
    optimizer_step(model, 2)
    start = time.monotonic()
    with pytest.raises(ws.SyncTimeoutError, match="worker 0, version 2\\] passed by: still no ack for version 1"):
        scheme.send()
    assert 0.5 <= time.monotonic() - start < 3.0
    assert receiver.receive(timeout=5) is not None and (receiver.version, checksum(replica)) == (1, held)
    assert receiver.receive() is None and receiver.version == 1
    optimizer_step(model, 3)
    scheme.send()
    assert receiver.receive(timeout=5) is not None and (receiver.version, checksum(replica)) == (3, checksum(model))
    receiver.shutdown()
    scheme.shutdown()


@pytest.mark.parametrize("scheme_name", ["multiprocess", "shared_mem"])
def test_worker_that_acked_then_left_does_not_fail_the_send(scheme_name):
    """The ack and the closed channel arrive together: the send is complete, the next one names the worker."""
    model = build("tiny")
    scheme = ws.WeightSyncScheme.from_backend(scheme_name, timeout=10)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    receiver = in_process_receiver(scheme, build("tiny"))
    optimizer_step(model, 1)
    scheme.send_async()
    assert receiver.receive(timeout=5) is not None and receiver.version == 1
    receiver.shutdown()  # acked version 1, then left: both are queued for the sender now
    scheme.wait_async()
    assert scheme.acked_versions == {0: 1}
    with pytest.raises(ws.WorkerDiedError):
        scheme.send()
    scheme.shutdown()


@pytest.mark.parametrize("scheme_name", ["multiprocess", "shared_mem"])
@pytest.mark.parametrize("extract_as", ["tensordict", "state_dict"])
def test_receive_returns_the_weights_the_model_now_holds(scheme_name, extract_as):
    """receive() hands back the model's keys (a state_dict in the model's order; two dtypes, so not the slot's),
    its new values in its own memory (no copy), and plain tensors: no Parameter, nothing that requires grad."""
    model = build("tiny")
    scheme = ws.WeightSyncScheme.from_backend(scheme_name, strategy=extract_as, sync=False, timeout=10)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    replica = build("tiny")
    receiver = in_process_receiver(scheme, replica)
    for step in (1, 2):  # the second update lands in another slot
        optimizer_step(model, step)
        scheme.send_async()
        got = receiver.receive(timeout=5)
        assert got is not None and receiver.version == step
        flat = ws.WeightStrategy(extract_as).flat(got)
        mine = ws.WeightStrategy(extract_as).flat(replica)
        if extract_as == "state_dict":
            assert list(got) == list(model.state_dict())
        assert flat.keys() == mine.keys() == ws.WeightStrategy(extract_as).flat(model).keys()
        for key, tensor in flat.items():
            assert type(tensor) is torch.Tensor and not tensor.requires_grad, key
            assert tensor.data_ptr() == mine[key].data_ptr(), key
            assert torch.equal(tensor, ws.WeightStrategy(extract_as).flat(model)[key]), key
    scheme.wait_async()
    receiver.shutdown()
    scheme.shutdown()


@pytest.mark.parametrize("can_swap", [True, False])
def test_apply_weights_on_a_shared_mem_worker_changes_its_model_alone_and_the_next_version_maps_its_slot(
    monkeypatch, can_swap
):
    """A ``shared_mem`` worker's model maps the slot of its version, which the other workers read too: its own
    ``apply_weights`` wrote into the slot, and the other worker held weights nobody sent it under the same
    version. It now gives the model memory of its own first; the next version maps its slot again."""
    from tests._workers import connect_all

    monkeypatch.setattr(ws.tensors.bound.BoundModel, "can_swap", can_swap)
    model = torch.nn.Linear(64, 64)
    scheme = ws.SharedMemWeightSyncScheme(sync=False, timeout=10)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    receivers = [pickle.loads(pickle.dumps(scheme)) for _ in range(2)]
    for w, receiver in enumerate(receivers):
        receiver.init_on_receiver(model_id="policy", model=torch.nn.Linear(64, 64), worker_idx=w)
    try:
        connect_all(scheme, receivers)
        own = {"weight": torch.full((64, 64), -99.0), "bias": torch.full((64,), -99.0)}
        receivers[0].apply_weights(own)
        assert bool((receivers[0].model.weight == -99).all()) and bool((receivers[0].model.bias == -99).all())
        assert torch.equal(receivers[1].model.weight, model.weight)  # (was -99)
        with torch.no_grad():
            model.weight.add_(1.0)
        scheme.send_async()
        for receiver in receivers:
            assert receiver.receive(timeout=5) is not None
        scheme.wait_async()
        for r in receivers:
            assert torch.equal(r.model.weight, model.weight) and torch.equal(r.model.bias, model.bias)
        assert receivers[0]._runtime.receiving.bound.storage is not None  # (it maps the new version's slot)
    finally:
        for receiver in receivers:
            receiver.shutdown()
        scheme.shutdown()


@pytest.mark.parametrize(
    ("scheme_name", "can_swap"), [("multiprocess", True), ("shared_mem", True), ("shared_mem", False)]
)
def test_worker_model_bound_once_then_updated_whole(monkeypatch, scheme_name, can_swap):
    """A CPU worker binds its model to one storage laid out like the slot at the first update; each later
    update is one copy into it (multiprocess: the memory stays) or one swap of the memory behind it
    (shared_mem: the model reads the new slot), no tensor re-pointed. A tensor the user replaced is bound
    anew, and shutdown leaves the model the weights it held, in private memory. A torch that cannot swap
    (older than 2.12) binds the model to each new slot instead, with the same result."""
    import weightsync.tensors.bound

    if not can_swap:  # as with a torch older than 2.12; a torch that cannot swap runs this test so anyway
        monkeypatch.setattr(weightsync.tensors.bound.BoundModel, "can_swap", False)
    can_swap = weightsync.tensors.bound.BoundModel.can_swap

    binds = []
    real_point_at = weightsync.tensors.bound.point_at
    monkeypatch.setattr(
        weightsync.tensors.bound, "point_at", lambda dst, src: binds.append(len(dst)) or real_point_at(dst, src)
    )
    model = build("tiny")
    scheme = ws.WeightSyncScheme.from_backend(scheme_name, sync=False, timeout=10)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    replica = build("tiny")
    params = dict(replica.named_parameters())
    receiver = in_process_receiver(scheme, replica)
    strategy, layout = scheme.strategy, scheme.layout
    assert layout is not None and binds == [len(layout.slots)]  # version 0 bound the model

    def send(step: int) -> None:
        optimizer_step(model, step)
        scheme.send_async()
        assert receiver.receive(timeout=5) is not None
        scheme.wait_async()

    def base_holding(step: int) -> int:
        """The model's storage address, after checking that it holds ``step`` with every tensor in its place."""
        assert receiver.version == step and checksum(replica) == checksum(model), step
        assert dict(replica.named_parameters()) == params  # the same Parameter objects
        flat = strategy.flat(replica)
        base = min(t.data_ptr() for t in flat.values())  # the first tensor sits at offset 0
        assert {s.key: flat[s.key].data_ptr() - base for s in layout.slots} == {s.key: s.offset for s in layout.slots}
        assert all(t.is_shared() == (scheme_name == "shared_mem") for t in flat.values())
        return base

    rebinds = 0 if can_swap or scheme_name == "multiprocess" else 1  # binds per update after the first (copies: none)
    bases = {base_holding(0)}
    for step in range(1, 7):  # 3 slots in the pool: the sender moves between them
        send(step)
        bases.add(base_holding(step))
    assert binds == [len(layout.slots)] * (1 + 6 * rebinds), binds  # never re-pointed where it can swap
    assert len(bases) == (1 if scheme_name == "multiprocess" else 2), bases  # shared_mem reads 2 slots in turn

    replaced = replica.body[0].weight
    replaced.data = torch.zeros_like(replaced)  # the user moves one tensor off the storage: bound anew
    send(7)
    base_holding(7)
    assert len(binds) == 2 + 6 * rebinds
    weight = replica.body[-1].weight
    with torch.no_grad():  # same shape, same first byte, read column-major: no longer the view bound
        weight.as_strided_(weight.shape, (1, weight.shape[0]))
    send(8)
    base_holding(8)
    assert len(binds) == 3 + 6 * rebinds

    expected = {k: v.clone() for k, v in strategy.flat(model).items()}
    receiver.shutdown()  # the slots are unmapped (the no_leaks fixture checks) and the model keeps its weights
    flat = strategy.flat(replica)
    assert all(torch.equal(flat[k], expected[k]) and not flat[k].is_shared() for k in expected)
    assert dict(replica.named_parameters()) == params
    scheme.shutdown()


@pytest.mark.parametrize("kind", ["keep_storage", "shared_model"])
def test_multiprocess_worker_keeps_its_storage_when_asked_or_shared(kind):
    """keep_storage, or a model in shared memory at its first update, is written into tensor by tensor."""
    model = build("tiny")
    scheme = ws.MultiProcessWeightSyncScheme(sync=False, timeout=10, keep_storage=kind == "keep_storage")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    replica = build("tiny_shared" if kind == "shared_model" else "tiny")
    before = {k: t.data_ptr() for k, t in scheme.strategy.flat(replica).items()}
    receiver = in_process_receiver(scheme, replica)
    for step in (1, 2):
        optimizer_step(model, step)
        scheme.send_async()
        assert receiver.receive(timeout=5) is not None
        scheme.wait_async()
        assert checksum(replica) == checksum(model)
        assert {k: t.data_ptr() for k, t in scheme.strategy.flat(replica).items()} == before
    receiver.shutdown()
    scheme.shutdown()


@pytest.mark.parametrize("scheme_name", ["multiprocess", "shared_mem"])
def test_flatten_sender_publishes_the_trainer_model_with_one_copy(monkeypatch, scheme_name):
    """flatten_sender moves the trainer's tensors into one buffer in the slot layout, values and Parameter
    objects kept; each send is then one copy (no tensor-by-tensor write on either side). A trainer tensor
    replaced since is bound anew at the next send; weights passed explicitly are copied tensor by tensor."""
    import weightsync.core.engine
    from weightsync.tensors.bound import BoundModel

    writes, adopted = [], []  # tensor-by-tensor writes of a send (the engine's, through Outgoing.write); bindings
    real_write_into, real_adopt = weightsync.core.engine.write_into, BoundModel.adopt
    monkeypatch.setattr(
        weightsync.core.engine,
        "write_into",
        lambda dst, src, **kw: writes.append(len(dst)) or real_write_into(dst, src, **kw),
    )
    monkeypatch.setattr(BoundModel, "adopt", lambda self, *a, **kw: adopted.append(1) or real_adopt(self, *a, **kw))
    model = build("tiny")
    params = dict(model.named_parameters())
    before = {k: v.clone() for k, v in ws.WeightStrategy().flat(model).items()}
    scheme = ws.WeightSyncScheme.from_backend(scheme_name, sync=False, timeout=10, flatten_sender=True)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    layout = scheme.layout
    flat = scheme.strategy.flat(model)
    assert layout is not None and dict(model.named_parameters()) == params
    assert all(torch.equal(flat[k], before[k]) for k in before)
    base = flat[layout.slots[0].key].data_ptr()
    assert {s.key: flat[s.key].data_ptr() - base for s in layout.slots} == {s.key: s.offset for s in layout.slots}
    replica = build("tiny")
    receiver = in_process_receiver(scheme, replica)

    def send(step: int, weights=None) -> None:
        if weights is None:
            optimizer_step(model, step)
        scheme.send_async(weights)
        assert receiver.receive(timeout=5) is not None and receiver.version == step
        scheme.wait_async()

    assert adopted == [1]
    for step in (1, 2, 3):
        send(step)
        assert checksum(replica) == checksum(model)
    assert writes == [] and adopted == [1]  # one copy per send: no tensor-by-tensor write, sender or worker

    model.body[0].weight.data = torch.ones_like(model.body[0].weight)  # the trainer moves a tensor off the buffer
    send(4)
    assert checksum(replica) == checksum(model) and len(adopted) == 2  # bound anew (one copy into the new buffer)
    send(5)
    assert checksum(replica) == checksum(model) and len(adopted) == 2
    weight = model.body[-1].weight
    with torch.no_grad():  # same shape, same first byte, read column-major: what the trainer reads is sent
        weight.as_strided_(weight.shape, (1, weight.shape[0]))
    send(6)
    assert checksum(replica) == checksum(model) and len(adopted) == 3 and writes == []

    explicit = {k: v + 1 for k, v in scheme.strategy.flat(model).items()}
    send(7, explicit)
    assert checksum(replica) == checksum(explicit) and len(writes) == 1 and len(adopted) == 3  # tensor by tensor
    assert dict(model.named_parameters()) == params
    receiver.shutdown()
    scheme.shutdown()


def test_flatten_sender_refuses_weights_on_several_devices():
    model = torch.nn.ParameterDict(
        {"here": torch.nn.Parameter(torch.zeros(3)), "there": torch.nn.Parameter(torch.zeros(3, device="meta"))}
    )
    scheme = ws.SharedMemWeightSyncScheme(flatten_sender=True)
    with pytest.raises(
        ws.ConfigurationError, match=r"flatten_sender needs every weight on one device; they are on \['cpu', 'meta'\]"
    ):
        scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    assert model["here"].is_cpu and model["there"].is_meta  # nothing moved
    scheme.shutdown()


@pytest.mark.parametrize(("name", "own"), [("multiprocess", False), ("shared_mem", False), ("shared_mem", True)])
def test_the_shared_transport_is_the_pool_every_worker_reads(workers, name, own):
    # (The GPU tests read a pool's slots through it; on the CPU nothing else would notice it gone.)
    extra = {"per_worker_weights": True} if own else {}
    scheme = ws.WeightSyncScheme.from_backend(name, timeout=20, **extra)
    assert scheme.shared_transport is None  # before init_on_sender
    model = build("tiny")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    group, ready = start_workers(workers, {"policy": scheme}, {"policy": "tiny"}, n=1)
    assert ready[0][2] == {}
    scheme.send()
    if own:  # a pool per worker: none that every worker reads
        assert scheme.shared_transport is None
    else:
        slots = scheme.shared_transport.slots
        assert slots and all(not slot.buffer.is_cuda for slot in slots)
    group.stop()
    scheme.shutdown()


@pytest.mark.parametrize("pinning", [False, True], ids=["copying", "mapping"])
def test_slots_read_only_by_a_late_worker_leave_the_pool_and_are_let_go_once_it_acked_past_them(pinning):
    """A late worker (``set_aside``: sends pass it by) holds no slot up: a slot only it reads leaves the pool at the
    next acquire, is never written again, and a new one takes its place; a slot another worker reads too stays. The
    late worker is told to let a slot that left go only once it acked past it (a ``shared_mem`` model lives on the
    slot of the version it holds); an ack makes it a worker like the others until a send sets it aside again."""
    from weightsync.tensors.layout import FlatLayout
    from weightsync.transports.local.slots import SlotPool

    pool = SlotPool(FlatLayout.from_weights({"w": torch.zeros(1024)}), 3, pinning=pinning, tag="t")
    try:
        first = pool.acquire()
        pool.publish(first, 1, [0, 1])
        pool.on_ack(0, 1, 1)
        second = pool.acquire()
        pool.publish(second, 2, [0, 1])  # worker 1 stopped: it never acked version 1 or 2
        pool.on_ack(0, 2, 2)  # (a shared_mem worker 0 holds version 2: its model is that slot)
        third = pool.acquire()
        pool.publish(third, 3, [0, 1])
        assert pool.acquire() is None and pool.busy_workers() == {0, 1}
        pool.set_aside(1)
        assert pool.busy_workers() == {0}
        fourth = pool.acquire()  # the slots worker 1 alone reads left the pool; the others stay
        gone = [first] if pinning else [first, second]
        assert fourth is not None and pool.left == gone == pool.retired
        assert [slot.id for slot in pool.slots] == ([1, 2, 3] if pinning else [2, 3])
        assert (first.version, second.version) == (1, 2)  # (never written again)
        for slot in pool.retired:  # (the sender closes them: a worker's mapping keeps their memory)
            slot.close()
        pool.retired.clear()
        pool.publish(fourth, 4, [0])
        # It runs again: each ack returns the slots that left which it is done with (told to let them go then).
        assert pool.on_ack(1, 1, 1 if pinning else None) == ([] if pinning else [first])
        assert pool.aside == set()
        assert pool.on_ack(1, 2, 2) == ([first] if pinning else [second])
        assert pool.left == [] and 1 not in first.readers and (1 in second.readers) == pinning  # (it holds 2)
        assert 1 in third.readers  # (in the pool: version 3 is on its way to it)
        pool.set_aside(1)
        pool.drop_worker(1)  # a worker given up on is set aside no more: its process's rule takes over
        assert pool.aside == set() and 1 not in third.readers
    finally:
        pool.close()


def test_the_newest_versions_slot_stays_in_the_pool_though_only_a_late_worker_reads_it():
    """A worker that rejoins is handed the newest version's slot: it stays in the pool while only a late worker
    reads it (the others copied it out), and leaves once a newer version is in the pool. (It left at once, and a
    send whose staging then failed left no slot of the newest version: a rejoin was refused, found by a review.)"""
    from weightsync.tensors.layout import FlatLayout
    from weightsync.transports.local.slots import SlotPool

    pool = SlotPool(FlatLayout.from_weights({"w": torch.zeros(1024)}), 3, pinning=False, tag="t")
    try:
        first = pool.acquire()
        pool.publish(first, 1, [0, 1])
        pool.on_ack(0, 1, 1)  # (copied out: worker 0 no longer reads it; worker 1 stopped)
        pool.set_aside(1)
        second = pool.acquire()
        assert second is not first and pool.slots == [first, second] and pool.left == []
        pool.publish(second, 2, [0])
        pool.on_ack(0, 2, 2)
        third = pool.acquire()  # (version 2 is the newest now: version 1's slot leaves)
        assert third is not first and pool.left == [first] == pool.retired and first.version == 1
        for slot in pool.retired:
            slot.close()
        pool.retired.clear()
    finally:
        pool.close()


def test_slots_that_left_the_pool_are_closed_where_a_new_slot_cannot_be_made(monkeypatch):
    """A late worker's slots leave the pool before a new slot is made: where making it fails (memory), the send
    raises and the slots that left are closed all the same, and the next send makes it. (They stayed in the
    sender's hands, found by a review: with a pool sized to the memory there is, every later send failed.)"""
    import pickle

    from tests._workers import connect_all
    from weightsync.transports.local import slots

    model = build("tiny")
    scheme = ws.MultiProcessWeightSyncScheme(timeout=0.5, sync=False)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    receivers = [pickle.loads(pickle.dumps(scheme)) for _ in range(2)]
    for w, receiver in enumerate(receivers):
        receiver.init_on_receiver(model_id="policy", model=build("tiny"), worker_idx=w)
    connect_all(scheme, receivers)
    pool = scheme._runtime.sending.engine.shared
    try:
        real = slots.SharedSlot.__init__

        def no_memory(self, *args, **kwargs):  # (once slots left the pool, none more fits)
            if pool.left:
                raise OSError(12, "Cannot allocate memory")
            real(self, *args, **kwargs)

        monkeypatch.setattr(slots.SharedSlot, "__init__", no_memory)
        failed = None
        while failed is None:  # (worker 1 is stopped, it receives nothing: versions on their way to it fill the pool)
            optimizer_step(model, scheme.version + 1)
            try:
                scheme.send_async()
            except ws.SyncTimeoutError as exc:
                assert exc.worker_idx == 1, exc
            except OSError as exc:
                failed = exc
            assert failed is not None or receivers[0].receive(timeout=5) is not None
            assert scheme.version < 10
        assert "Cannot allocate memory" in str(failed) and pool.aside == {1}
        assert pool.left and pool.retired == [] and all(slot.fd == -1 for slot in pool.left)
        monkeypatch.setattr(slots.SharedSlot, "__init__", real)
        with pytest.raises(ws.SyncTimeoutError, match="passed by"):
            scheme.send_async()
        assert receivers[0].receive(timeout=5) is not None
        assert (receivers[0].version, checksum(receivers[0].model)) == (scheme.version, checksum(model))
        while receivers[1].receive(timeout=0.5) is not None:  # (it runs again: it reads what was on its way)
            pass
        scheme.wait_async(timeout=5)
        optimizer_step(model, scheme.version + 1)
        scheme.send_async()
        assert receivers[1].receive(timeout=5) is not None and receivers[1].version == scheme.version
    finally:
        for receiver in receivers:
            receiver.shutdown()
        scheme.shutdown()


@pytest.mark.parametrize("closes", ["before", "after the proof"])
def test_a_sender_that_closes_before_its_handshake_is_named_gone_and_one_that_closes_after_a_key_refused(closes):
    """A worker whose sender shut down or exited before its connect() took it was told "closed the handshake
    (wrong auth key?)", the key right (a user's audit): no key had been shown yet."""
    import secrets
    import socket
    import struct
    import threading

    from weightsync.transports.local.channel import connect_channel

    address = f"\0weightsync-test-{secrets.token_hex(8)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(1)

    def sender() -> None:
        conn, _ = listener.accept()
        with conn:
            if closes != "before":
                conn.sendall(struct.pack("!i", 32) + b"n" * 32)  # a challenge (a frame as multiprocessing's)
                conn.recv(1024)  # the worker's proof: then the sender closes (it refused the key, or ended)

    serving = threading.Thread(target=sender)
    serving.start()
    wanted = (ws.ConnectionClosedError, "closed the connection before its handshake began: it shut down or exited")
    if closes != "before":
        wanted = (ws.AuthenticationError, "closed the handshake")
    try:
        with pytest.raises(wanted[0], match=wanted[1]):
            connect_channel(address.replace("\0", "@"), b"k" * 32, {"worker": 0}, 10)
    finally:
        serving.join(10)
        listener.close()


@pytest.mark.parametrize("cls", [ws.MultiProcessWeightSyncScheme, ws.SharedMemWeightSyncScheme])
def test_an_update_into_a_buffer_made_under_inference_mode_is_refused_before_anything_is_written(cls):
    """A rollout loop replaced a buffer under ``torch.inference_mode`` (an inference tensor, which only that mode
    may write): the next update's copy stopped at it, the tensors before it already written, the version left at
    0 (a user's audit, ``keep_storage=True``). It is refused whole, naming the buffer; the model keeps its
    weights."""
    import threading

    class Policy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(3, 3)
            self.register_buffer("obs_mean", torch.zeros(3))

    trainer = Policy()
    options = {"keep_storage": True} if cls is ws.MultiProcessWeightSyncScheme else {}
    scheme = cls(timeout=10, **options)
    scheme.init_on_sender(model_id="policy", model=trainer, num_workers=1)
    worker = Policy()
    receiver = in_process_receiver(scheme, worker)
    with torch.inference_mode():  # (the rollout loop's normalizer statistics)
        worker.obs_mean = worker.obs_mean * 0 + 1
    before = {k: v.clone() for k, v in worker.state_dict().items()}
    with torch.no_grad():
        for t in trainer.state_dict().values():
            t.fill_(2.0)
    refused: list[BaseException] = []
    applying = threading.Thread(target=lambda: _receive_into(receiver, refused))
    applying.start()
    with pytest.raises(ws.ReceiverError, match=r"\['obs_mean'\] of this worker's model are inference tensors"):
        scheme.send()
    applying.join(30)
    assert len(refused) == 1 and isinstance(refused[0], ws.ConfigurationError), refused
    assert receiver.version == 0 and all(torch.equal(v, before[k]) for k, v in worker.state_dict().items())
    receiver.shutdown()
    scheme.shutdown()


def _receive_into(receiver, refused: list[BaseException]) -> None:
    try:
        receiver.receive(timeout=20)
    except BaseException as exc:  # noqa: BLE001 - looked at by the test
        refused.append(exc)
