"""RPCWeightSyncScheme with real TensorPipe agents on loopback.

torch.distributed.rpc can start only once per process (pytorch/pytorch#46491), so each test runs its
trainer in a process of its own, forked from the tests' forkserver (which never starts RPC). That trainer
starts its own workers and reports back.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import weightsync as ws
from tests import _rpc_trainer
from tests.conftest import _CTX


def _in_trainer_process(scenario: str, timeout: float = 240.0, host_address: str | None = None) -> None:
    parent, child = _CTX.Pipe()
    proc = _CTX.Process(target=_rpc_trainer.run, args=(scenario, child, host_address))
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            pytest.fail(f"the RPC trainer did not finish {scenario} within {timeout:.0f}s")
        status, detail = parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert status == "ok", f"{scenario} failed in the trainer process:\n{detail}"


@pytest.mark.parametrize(
    "scenario",
    [
        "every_send_reaches_every_targeted_worker:state_dict",
        "every_send_reaches_every_targeted_worker:tensordict",
        "trainer_changes_are_invisible_until_send",
        "worker_storage_switches_unless_kept",
        "worker_storage_switches_unless_kept::keep_storage=true",
        "shared_memory_worker_is_written_into",
        "flatten_sender_copies_one_buffer::flatten_sender=true",
        "bad_weights_fail_in_the_caller_and_send_nothing:tensordict",
        "killed_worker_is_named_and_the_others_are_served",
        "mismatching_worker_is_refused_by_name",
        "wire_dtype_halves_the_bytes_and_workers_hold_the_rounded_weights::wire_dtype=bfloat16",
        "corrupted_payload_is_refused_and_the_model_kept::checksum=true",
        "dropped_worker_is_named_and_the_others_go_on::on_failure=drop",
        "restarted_worker_is_refused_with_the_reason",
        "hung_worker_costs_one_timeout::on_failure=raise",
        "hung_worker_costs_one_timeout::on_failure=drop",
        "a_late_worker_is_passed_by_until_it_acks",
        "sends_that_do_not_wait_go_on_past_a_stopped_worker",
        "sends_that_do_not_wait_go_on_past_a_stopped_worker::on_failure=drop",
        "a_stopped_worker_in_a_world_the_caller_runs_is_passed_by_until_it_answers",
        "a_worker_whose_receiver_shut_down_in_a_world_the_caller_runs_is_named_gone",
        "a_scheme_built_anew_after_the_workers_old_receiver_shut_down_takes_only_its_senders_calls",
        "a_scheme_built_anew_whose_sender_reaches_the_worker_first_takes_only_its_senders_calls",
        "a_worker_dropped_alive_hears_it_was_dropped::on_failure=drop",
        "connect_waits_its_timeout_for_absent_workers::connect_timeout=2",
        "a_worker_that_joins_then_dies_costs_connect_its_timeout::connect_timeout=4",
        "an_agent_whose_world_did_not_form_is_stopped::connect_timeout=10",
        "rpc_shutdown_waits_a_bounded_time_for_workers_that_stay",
        "rpc_shutdown_is_bounded_with_a_versions_call_still_out",
        "agents_sit_idle_between_sends",
        "agent_environment_holds_until_the_agent_stopped",
        # Only what changed (delta=true: even where every value changed): the same guarantees (the first also
        # reading only the pages written since the last version).
        "every_send_reaches_every_targeted_worker:state_dict:delta=true,track_writes=true",
        "killed_worker_is_named_and_the_others_are_served::delta=true",
        "dropped_worker_is_named_and_the_others_go_on::on_failure=drop,delta=true",
        "hung_worker_costs_one_timeout::on_failure=drop,delta=true",
        # A Ctrl-C in the trainer: as an answer is taken (the next wait timed out), as a call goes out.
        "a_ctrl_c_as_the_trainer_takes_an_ack_loses_no_ack",
        "a_ctrl_c_as_an_rpc_goes_out_leaves_it_waited_for",
        "the_goodbye_says_whether_the_world_leaves_whole::on_failure=drop",
    ],
)
def test_rpc_scheme(scenario):
    _in_trainer_process(scenario)


def test_agents_stay_on_loopback_where_the_host_name_resolves_to_a_network_address():
    """TensorPipe listens where the host's name resolves; the scheme names the interface that reaches the
    sender instead. Without that, this trainer listened on the machine's network address too."""
    import os
    import socket

    import psutil

    addresses = [
        a.address
        for name, addrs in psutil.net_if_addrs().items()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    if not addresses or os.geteuid() != 0:
        pytest.skip("needs a non-loopback IPv4 address and root (a private mount namespace for /etc/hosts)")
    _in_trainer_process("agents_listen_on_loopback_only", host_address=addresses[0])


def test_bad_arguments_fail_before_anything_starts():
    with pytest.raises(ws.ConfigurationError, match="num_workers"):
        ws.RPCWeightSyncScheme().init_on_sender(model_id="policy", model=ws.WeightStrategy)
    with pytest.raises(ws.ConfigurationError, match="master_port"):
        ws.RPCWeightSyncScheme(master_port=70000)
    with pytest.raises(ws.ConfigurationError, match="rpc.init_rpc first"):
        import torch

        ws.RPCWeightSyncScheme().init_on_sender(model=torch.nn.Linear(2, 2), worker_names=["a"])
    sender = ws.RPCWeightSyncScheme(allow_store_peers_to_run_code=True)
    sender.init_on_sender(model_id="policy", model=torch.nn.Linear(2, 2), num_workers=1)
    try:
        worker = ws.from_config({**sender.receiver_config(0), "worker_idx": 1}, allow_store_peers_to_run_code=True)
        with pytest.raises(ws.ConfigurationError, match=r"worker_idx 1 is not a worker of this RPC world \(0..0\)"):
            worker.init_on_receiver(model=torch.nn.Linear(2, 2))
    finally:
        sender.shutdown()


def test_the_opt_in_covers_a_network_address_and_allow_pickle_is_not_it():
    """One switch: ``allow_store_peers_to_run_code`` says every host that can route to the store can run code in
    the world, so a network address needs nothing more (the refusals without it: tests/test_strangers_rpc.py)."""
    import torch

    with pytest.raises(ws.ConfigurationError, match="takes allow_store_peers_to_run_code, not allow_pickle"):
        ws.RPCWeightSyncScheme(allow_pickle=True)
    # Opted in, it goes on, and fails only because 10.255.255.1 is not this machine's.
    with pytest.raises(ws.ConfigurationError, match="cannot serve a TCP store on 10.255.255.1"):
        ws.RPCWeightSyncScheme(master_addr="10.255.255.1", allow_store_peers_to_run_code=True).init_on_sender(
            model_id="policy", model=torch.nn.Linear(2, 2), num_workers=1
        )


class _Sink:
    model_id = "policy"
    timeout = connect_timeout = 1.0

    def __init__(self) -> None:
        self.failures: list[tuple[int, ws.WeightSyncError]] = []
        self.late: list[tuple[int, ws.WeightSyncError]] = []  # calls that gave up waiting for the answer
        self.acks: list[tuple[int, int]] = []
        self.deaths: list[tuple[int, str]] = []

    def acked(self, worker, held) -> None:
        self.acks.append((worker, held))

    def failed(self, worker, error) -> None:
        self.failures.append((worker, error))

    def unanswered(self, worker, error) -> None:
        self.late.append((worker, error))

    def died(self, worker, error) -> None:
        self.deaths.append((worker, error))

    def is_dead(self, worker) -> bool:
        return any(w == worker for w, _ in self.deaths)


def test_the_initial_versions_rpc_waits_connect_timeout_and_later_ones_have_no_bound_of_their_own():
    """The initial version is part of ``connect()``, bound by ``connect_timeout`` (a worker's first apply may compile
    the delta's loops: seconds on a loaded host). Its RPC was given ``timeout``: the trainer's ``connect()`` named
    the worker late and dropped it, while the worker's own ``connect()`` succeeded. In a world weightsync runs, a
    later version's RPC has no bound of its own (0): the send's wait has one, and a worker late on the call is
    passed by until it answers (given ``timeout``, the call to a stopped worker ended, each send made another, and
    TensorPipe kept each one's bytes: 64 MiB a send, measured). In a world the caller runs, ``timeout``: the
    caller's own graceful ``rpc.shutdown()`` waits for every call still out."""
    import torch

    from weightsync.core.engine import Outgoing
    from weightsync.tensors.layout import FlatLayout
    from weightsync.transports.rpc.sender import RPCSender
    from weightsync.transports.rpc.settings import RPCSettings

    sink = _Sink()
    sink.timeout, sink.connect_timeout = 2.0, 60.0
    weights = {"w": torch.zeros(8)}
    sender = RPCSender(sink, FlatLayout.from_weights(weights), 1, RPCSettings(), names=["a"], master=None)
    transport = sender.transports[0]
    bounds: list[float] = []

    def submit(version, buffer, layout, timeout, digest=None, delta=None):
        bounds.append(timeout)
        transport.in_flight[version] = torch.futures.Future()
        return transport.in_flight[version]

    transport.submit = submit
    transport.ask_last_answer = lambda timeout: torch.futures.Future()  # (never answered: the worker is stopped)
    # (a version 0 that is not the initial one: the send after a connect() whose weights did not fit)
    for version, initial in ((0, True), (1, False), (0, False)):
        out = Outgoing(version, {"w": torch.full((8,), float(version))}, None, [0], initial=initial)
        sender.submit(out, sender.stage(out, deadline=float("inf")))
        transport.in_flight[version].set_exception(RuntimeError("RPC ran for more than set timeout (1 ms)"))
        sender.poll([0])
    assert bounds == [60.0, 2.0, 2.0]  # (the caller runs this world: names given)
    assert [str(e.detail) for _, e in sink.late] == [
        "no ack for version 0 within 60s",
        "no ack for version 1 within 2s",
        "no ack for version 0 within 2s",
    ]
    sender.session = object()  # type: ignore[assignment]  # (as in a world the engine runs)
    try:
        assert (sender._bound(initial=True), sender._bound(initial=False)) == (60.0, 0.0)
    finally:
        sender.session = None
    sender.close(0.0)


def test_a_buffer_an_rpc_may_still_write_is_never_reused():
    """TensorPipe cannot cancel a send: an RPC that timed out (or whose worker was dropped) is still written to
    the wire if the link comes back, from the staging buffer itself. Reusing that buffer for a later version
    would put the later version's bytes under the earlier one's number; the buffer is retired instead."""
    import torch

    from weightsync.core.engine import Outgoing
    from weightsync.tensors.layout import FlatLayout
    from weightsync.transports.rpc.sender import RPCSender
    from weightsync.transports.rpc.settings import RPCSettings

    weights = {"w": torch.zeros(8)}
    sink = _Sink()
    layout = FlatLayout.from_weights(weights)
    sender = RPCSender(sink, layout, 2, RPCSettings(max_buffers=1), names=["a", "b"], master=None)
    futures: list[torch.futures.Future] = []

    def submitter(transport):
        def submit(version, buffer, layout, timeout, digest=None, delta=None):
            futures.append(torch.futures.Future())
            transport.in_flight[version] = futures[-1]
            return futures[-1]

        return submit

    for transport in sender.transports.values():
        transport.submit = submitter(transport)
        transport.ask_last_answer = lambda timeout: torch.futures.Future()  # (whether it answered since: not yet)

    def send(version: int, workers: list[int]) -> torch.Tensor:
        out = Outgoing(version, {"w": torch.full((8,), float(version))}, None, workers)
        staged = sender.stage(out, deadline=float("inf"))
        sender.submit(out, staged)
        return staged[0].tensor

    first = send(1, [0])
    futures[0].set_exception(
        RuntimeError("RPC ran for more than set timeout (1000 ms) and will now be marked with an error")
    )
    sender.poll([0])
    assert [(w, type(e).__name__) for w, e in sink.late] == [(0, "SyncTimeoutError")]
    second = send(2, [1])
    assert second.data_ptr() != first.data_ptr()
    assert first.view(torch.float32)[:8].tolist() == [1.0] * 8  # what the late write sends is still version 1

    sender.lost(1, "dropped")  # worker 1's RPC is still in flight
    third = send(3, [0])
    assert third.data_ptr() not in (first.data_ptr(), second.data_ptr())
    assert second.view(torch.float32)[:8].tolist() == [2.0] * 8

    futures[-1].set_result({"held": 3})  # an answered RPC releases its buffer: the next send reuses it
    sender.poll([0])
    assert send(4, [0]).data_ptr() == third.data_ptr()
    sender.close(0.0)


def test_a_worker_whose_call_gave_up_is_asked_for_the_answer_until_it_has_given_it():
    """A version's call that gave up waiting (a world the caller runs bounds it by ``timeout``) leaves its worker
    late (the core passes it by, sending it nothing). The engine asks the worker, one small call at a time, for the
    newest version it answered; asks that time out wait longer before the next; an answer to an older version is
    not the one awaited; once the worker answered that version (or a later one), its answer is the call's: the ack,
    and the worker's failure where it failed. An ask that finds the worker gone says so."""
    import torch

    from weightsync.core.engine import Outgoing
    from weightsync.tensors.layout import FlatLayout
    from weightsync.transports.rpc.sender import RPCSender
    from weightsync.transports.rpc.settings import RPCSettings

    sink = _Sink()
    sender = RPCSender(
        sink, FlatLayout.from_weights({"w": torch.zeros(8)}), 2, RPCSettings(), names=["a", "b"], master=None
    )
    asks: list[torch.futures.Future] = []
    for transport in sender.transports.values():
        transport.submit = lambda version, *args, t=transport, **kw: t.in_flight.setdefault(
            version, torch.futures.Future()
        )
        transport.ask_last_answer = lambda timeout: asks.append(torch.futures.Future()) or asks[-1]

    def gave_up(worker: int, version: int) -> None:
        out = Outgoing(version, {"w": torch.full((8,), float(version))}, None, [worker])
        sender.submit(out, sender.stage(out, deadline=float("inf")))
        sender.transports[worker].in_flight[version].set_exception(RuntimeError("RPC ran for more than set timeout"))

    gave_up(0, 3)
    sender.poll([0])
    assert [(w, e.version) for w, e in sink.late] == [(0, 3)] and sink.failures == []
    assert len(asks) == 1  # (asked at once)
    sender.poll([0])
    assert len(asks) == 1  # (one ask out at a time)
    asks[0].set_exception(RuntimeError("RPC ran for more than set timeout (1000 ms)"))
    sender.poll([0])
    assert len(asks) == 1  # (an ask that timed out: the next waits)
    sender._asking[0].due = 0.0
    sender.poll([0])
    assert len(asks) == 2
    asks[1].set_result((2, True, {"held": 2}))  # (alive, but its answer to version 3 not given yet)
    sender.poll([0])
    assert sink.acks == [] and 0 in sender._asking
    sender._asking[0].due = 0.0
    sender.poll([0])
    refused = {"held": 2, "error": {"type": "ChecksumError", "message": "version 3 did not match its digest"}}
    asks[2].set_result((3, True, refused))
    sender.poll([0])
    assert sink.acks == [(0, 2)] and 0 not in sender._asking
    assert [(w, e.version, type(e).__name__) for w, e in sink.failures] == [(0, 3, "ReceiverError")]
    assert "did not match" in str(sink.failures[0][1])
    sender.poll([0])
    assert len(asks) == 3  # (heard: no more asks)

    gave_up(1, 4)
    sender.poll([1])
    asks[3].set_exception(RuntimeError("connection reset by peer"))
    sender.poll([1])
    assert [w for w, _ in sink.deaths] == [1] and "went away" in sink.deaths[0][1]
    sender.close(0.0)


class _World:
    """The sender core over an RPC engine of a world the caller runs, one worker, with no RPC: each call's future
    is answered by ``reply(version, changes)`` (``None``: left out, as to a stopped worker), each ask's by ``ask()``."""

    TIMED_OUT = "RPC ran for more than set timeout (300 ms) and will now be marked with an error"

    def __init__(self, timeout: float = 0.3, **options) -> None:
        import types

        import torch

        from weightsync.core.sender import Sender
        from weightsync.tensors.layout import FlatLayout
        from weightsync.transports.rpc.sender import RPCSender
        from weightsync.transports.rpc.settings import RPCSettings

        defaults = dict(sync=True, flatten_sender=False, check_finite=False, max_staleness=None, on_failure="raise")
        options = types.SimpleNamespace(
            timeout=timeout, connect_timeout=5.0, strategy_str="state_dict", **{**defaults, **options}
        )
        self.layout = FlatLayout.from_weights({"w": torch.zeros(1024)})
        self.core = Sender(
            options, model_id="policy", num_workers=1, layout=self.layout, flat_weights=lambda w: w,
            lock=threading.RLock(),
        )  # fmt: skip
        self.engine = self.core.engine = RPCSender(self.core, self.layout, 1, RPCSettings(), names=["a"], master=None)
        self.calls: list[tuple[int, str]] = []
        self.asks: list[torch.futures.Future] = []
        self.reply = lambda version, changes: {"held": version}
        self.ask = lambda: None
        self.transport = self.engine.transports[0]
        self.transport.submit, self.transport.ask_last_answer = self._submit, self._ask

    def _submit(self, version, buffer, layout, timeout, digest=None, delta=None):
        import torch

        future = self.transport.in_flight[version] = torch.futures.Future()
        self.calls.append((version, "changes" if delta is not None else "whole"))
        answer = self.reply(version, delta is not None)
        if answer is not None:
            future.set_result(answer)
        return future

    def _ask(self, timeout):
        import torch

        self.asks.append(torch.futures.Future())
        if (answer := self.ask()) is not None:
            self.asks[-1].set_result(answer)
        return self.asks[-1]

    def send(self, version: int, wait: bool = True) -> str:
        """Publish ``version`` (every value ``version``): ``"ok"``, or what it raised."""
        import torch

        try:
            self.core.publish({"w": torch.full((1024,), float(version))}, [0], wait)
        except ws.WeightSyncError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    def gives_up(self, version: int) -> None:
        self.transport.in_flight[version].set_exception(RuntimeError(self.TIMED_OUT))


def test_the_answer_asked_for_is_the_calls_own_not_a_refusal_of_the_same_versions_changes():
    """A worker refuses version 1's changes and is sent version 1 whole in the same send, which gives up: the answer
    its worker gave last is its refusal of the changes, not the answer to the whole version, which it has not read
    yet. Taken for it, the worker was no longer late and was sent version 3 whole, one more model-sized call while
    version 1 was still unread."""
    world = _World(delta=True, checksum=False, track_writes=False)
    assert world.send(0) == "ok"
    refusal = {"held": 0, "error": {"type": "DeltaBaseError", "message": "it does not hold the base"}}
    world.reply = lambda version, changes: refusal if changes else None  # (refuses the changes, then stops)
    assert "no ack for version 1" in world.send(1)
    assert world.calls[-2:] == [(1, "changes"), (1, "whole")]
    world.gives_up(1)
    world.ask = lambda: (1, False, refusal)  # (its last answer: to the changes)
    assert "passed by: still no ack for version 1" in world.send(2)
    assert "passed by: still no ack for version 1" in world.send(3)
    assert world.calls[-1] == (1, "whole")  # (no call since)
    world.ask = lambda: (1, True, {"held": 1})  # (it read the whole version 1, and applied it)
    world.engine._asking[0].due = 0.0
    world.reply = lambda version, changes: {"held": version}
    assert "passed by" in world.send(4)  # (the ask goes out with this send's look)
    assert world.send(5) == "ok" and world.calls[-1][0] == 5


def test_a_worker_whose_receiver_shut_down_while_its_call_was_out_is_named_gone_not_asked_for_good():
    """A worker's call gives up, then its receiver shuts down (its agent stays in the world you run): an ask finds
    no receiver there, and the worker is named gone. Before, each ask found nothing new, and it was asked four
    times a second for as long as sends ran, passed by."""
    from weightsync.transports.rpc.mailbox import NO_RECEIVER

    world = _World()
    assert world.send(0) == "ok"
    world.reply = lambda version, changes: None
    assert "no ack for version 1" in world.send(1)
    world.gives_up(1)
    world.ask = lambda: NO_RECEIVER
    assert "passed by: still no ack for version 1" in world.send(2)  # (the ask goes out with this send's look)
    said = world.send(3)
    assert "WorkerDiedError" in said and "its receiver shut down" in said, said
    assert world.engine._asking == {} and len(world.asks) == 1
    assert "WorkerDiedError" in world.send(4) and len(world.asks) == 1


def test_a_receiver_takes_only_its_own_senders_calls_and_those_of_a_sender_whose_receiver_shut_down_are_refused():
    """A sender's call names a process and a model, not a receiver. Two receivers of one model in a process shared
    one mailbox, and the first one's close dropped the mailbox the second read: a second is now refused by name.
    Calls carry their sender's id: those of a sender whose receiver is not open yet wait for it (a new scheme
    connecting while the old receiver is still open); once a sender's receiver shut down, its calls are answered at
    once that it did (the sender names the worker gone), and its goodbye says nothing to the next receiver. Before,
    a receiver opened later took the old sender's calls and goodbye, and the old receiver took the new sender's."""
    from weightsync.transports.rpc.mailbox import NO_RECEIVER, close_mailbox, deliver, last_answer
    from weightsync.transports.rpc.receiver import RPCReceiver

    model, old, new, third, fourth = "policy-of-the-mailbox-test", "0" * 16, "1" * 16, "2" * 16, "3" * 16
    where = {"model_id": model, "worker_idx": 0}

    def receiver(sender=None):
        handoff = {"external": True, **({"sender": sender} if sender else {})}
        return RPCReceiver(handoff, take=False, where=where)

    def call(version, sender):
        return deliver(model, version, torch.zeros(4), {"layout": sender}, None, None, sender)

    first = receiver(old)
    with pytest.raises(ws.ConfigurationError, match=f"another receiver of model '{model}' is open"):
        receiver(new)
    early = call(0, new)  # (the new scheme connects while the old receiver is still open: it waits)
    assert last_answer(model, old) is None and last_answer(model, new) is None
    assert list(first.mailbox.queue) == [] and not early.done()
    first.close()
    first.close()  # (idempotent)
    stale = call(3, old)
    assert stale.wait()["gone"] == "its receiver shut down" and last_answer(model, old) == NO_RECEIVER
    assert close_mailbox(model, True, old)  # (the old sender's goodbye)
    later = receiver(new)
    try:
        assert [a.version for a in later.mailbox.queue] == [0] and not later.mailbox.closed and not early.done()
        assert last_answer(model, new) is None and last_answer(model, old) == NO_RECEIVER
        assert call(4, old).wait()["gone"] and close_mailbox(model, True, old) and not later.mailbox.closed
        first.close()
        assert [a.version for a in later.mailbox.queue] == [0]
        gone_before_its_receiver = call(0, third)  # (a sender that says goodbye before its receiver opens)
        assert close_mailbox(model, True, third) and gone_before_its_receiver.wait()["gone"]
        pending = call(0, fourth)
    finally:
        later.close()
    assert early.wait()["gone"] and not pending.done()
    unnamed = receiver()  # (a config that does not name its sender: the one heard from last that is still there)
    try:
        assert unnamed.mailbox.sender == fourth and [a.version for a in unnamed.mailbox.queue] == [0]
    finally:
        unnamed.close()
    assert pending.wait()["gone"]


def test_a_receiver_that_does_not_name_its_sender_or_is_dropped_unclosed_still_ends_its_senders_calls():
    """A receiver config without the sender's id (written before it existed, or by hand) takes the first sender it
    hears from as its own, so that once it shut down, that sender's calls are answered so (they waited for a
    receiver for good: the sender asked four times a second). A receiver dropped without a close ends its sender's
    calls too (the next call waited, holding its buffer, for good). A call that comes after its sender's goodbye
    is answered at once. And a thread waiting in the receiver's take hears that it was closed meanwhile (it slept
    its whole timeout)."""
    import gc
    import threading

    from weightsync.errors import ConnectionClosedError
    from weightsync.transports.rpc.mailbox import NO_RECEIVER, close_mailbox, deliver, last_answer
    from weightsync.transports.rpc.receiver import RPCReceiver

    model, one, two, three = "policy-of-the-unnamed-test", "a" * 16, "b" * 16, "c" * 16
    where = {"model_id": model, "worker_idx": 0}

    def call(sender):
        return deliver(model, 1, torch.zeros(4), None, None, None, sender)

    unnamed = RPCReceiver({"external": True}, take=False, where=where)
    first = call(one)
    assert unnamed.mailbox.sender == one and not first.done()
    unnamed.close()
    assert first.wait()["gone"] and call(one).wait()["gone"] and last_answer(model, one) == NO_RECEIVER
    dropped = RPCReceiver({"external": True, "sender": two}, take=False, where=where)
    del dropped
    gc.collect()
    assert call(two).wait()["gone"] and last_answer(model, two) == NO_RECEIVER
    assert close_mailbox(model, True, three)  # (a sender whose receiver never opened here says goodbye)
    assert call(three).wait()["gone"]
    waiting = RPCReceiver({"external": True, "sender": one}, take=False, where=where)
    raised = []

    def takes():
        try:
            waiting.take(10, True)
        except ConnectionClosedError as exc:
            raised.append(exc)

    entered = threading.Event()

    class Marked(threading.Condition):  # (the thread is in the mailbox's wait once this is set)
        def wait(self, timeout=None):
            entered.set()
            return super().wait(timeout)

    waiting.mailbox.cond = Marked()
    taker = threading.Thread(target=takes)
    taker.start()
    assert entered.wait(10)
    waiting.close()
    taker.join(5)
    assert not taker.is_alive() and "this receiver shut down" in str(raised[0])


def test_a_worker_stopped_for_hours_is_still_asked_at_the_longest_interval():
    """Asks that time out back off, doubling up to 5 s. About 1,100 in a row (a worker stopped for hours) made the
    doubling overflow a float, and every send raised ``OverflowError``."""
    world = _World()
    assert world.send(0) == "ok"
    world.reply = lambda version, changes: None
    assert "no ack for version 1" in world.send(1)
    world.gives_up(1)
    assert "passed by: still no ack for version 1" in world.send(2)  # (the ask goes out, unanswered)
    asking = world.engine._asking[0]
    asking.misses = 1100
    world.asks[-1].set_exception(RuntimeError(world.TIMED_OUT))
    assert "passed by: still no ack for version 1" in world.send(3)
    assert asking.misses == 1101 and 4.0 < asking.due - time.monotonic() <= 5.0


def test_an_answer_that_comes_by_its_own_call_ends_the_asks_and_is_taken_once():
    """Two versions out to a worker (``send_async``); the first's call gives up, the second's is answered, with a
    failure. The asks for the first end there: the ask's own answer, the same failure, was taken again, and the
    next send raised it once more."""
    world = _World()
    assert world.send(0) == "ok"
    world.reply = lambda version, changes: None
    assert world.send(1, wait=False) == "ok" and world.send(2, wait=False) == "ok"
    failure = {"held": 1, "error": {"type": "ChecksumError", "message": "version 2 did not match its digest"}}
    world.gives_up(1)
    world.transport.in_flight[2].set_result(failure)
    world.reply = lambda version, changes: {"held": version}
    assert "ChecksumError" in world.send(3)  # (the failure of version 2, reported by the next send)
    assert world.engine._asking == {}
    assert world.send(4) == "ok"


def test_a_ctrl_c_as_an_asks_answer_is_taken_leaves_it_taken():
    """A Ctrl-C as the answer an ask brought is taken is handled once it is taken whole: cut in two, the answer was
    read and not taken, and the worker was late for good (asked no more), or taken and asked for again."""
    import os
    import signal

    world = _World()
    assert world.send(0) == "ok"
    world.reply = lambda version, changes: None
    assert "no ack for version 1" in world.send(1)
    world.gives_up(1)
    world.ask = lambda: (1, True, {"held": 1})
    world.engine.poll([0])  # (the ask goes out, and is answered)
    acked, acks = world.core.acked, []

    def ctrl_c_as_it_is_taken(worker, held):
        os.kill(os.getpid(), signal.SIGINT)  # (handled at once, between two steps, where nothing holds it)
        acks.append(held)
        acked(worker, held)

    world.core.acked = ctrl_c_as_it_is_taken
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a run in the background ignores it)
    try:
        with pytest.raises(KeyboardInterrupt):
            world.engine.poll([0])  # (its answer is read and taken)
    finally:
        signal.signal(signal.SIGINT, before)
    world.core.acked = acked
    assert acks == [1] and world.engine._asking == {}
    world.reply = lambda version, changes: {"held": version}
    assert world.send(2) == "ok"


def test_a_staleness_bound_does_not_wait_for_a_worker_whose_call_gave_up():
    """``max_staleness``: a worker whose call gave up is late, passed by at once. The bound, which looked for the
    late before hearing what came back, waited its whole ``timeout`` for it."""
    world = _World(timeout=5.0, max_staleness=1)
    assert world.send(0) == "ok"
    world.reply = lambda version, changes: None
    assert world.send(1, wait=False) == "ok"
    world.gives_up(1)
    started = time.monotonic()
    assert "passed by: still no ack for version 1" in world.send(2, wait=False)
    assert time.monotonic() - started < 5.0  # (not waited for)


def test_a_worker_whose_check_of_its_sender_is_out_as_it_leaves_waits_for_it_and_leaves_with_the_world():
    """A worker leaving its RPC world while its probe of the sender's store is out (it looks every half second
    when idle) gives the check a bounded moment to come back: one that does leaves the world by its barrier.
    Taken as a stopped sender at once, such a check left the world unclean: the sender waited for this worker at
    its barrier for 5 s, and TensorPipe logged errors at both ends (a CI run of the main job failed on them)."""
    import threading
    import time

    from weightsync.transports.rpc import session as rpc_session
    from weightsync.transports.storeclient import Hangup, Probe

    class SlowStore(Probe):
        def __init__(self, answer_after: float) -> None:
            super().__init__(None, Hangup([]), "test-slow-probe")  # type: ignore[arg-type]
            self.answer_after, self.released = answer_after, threading.Event()

        def _ask(self) -> None:
            self.released.wait(self.answer_after)

    def leave(probe: SlowStore) -> tuple[bool, float]:
        sess = rpc_session.Session("t", "127.0.0.1", 1, 2, 0, users=1, probe=probe)
        assert probe() is None and probe.out  # a check goes out just before the worker leaves
        began = time.monotonic()
        rpc_session.leave_session(sess, clean=True)
        return sess.clean, time.monotonic() - began

    answering = SlowStore(answer_after=0.3)
    assert leave(answering)[0] and not answering.out
    stopped = SlowStore(answer_after=60)
    stopped.hangup = stopped.released.set  # type: ignore[assignment]  # (ending a check shuts its connection)
    clean, took = leave(stopped)
    assert not clean and rpc_session.PROBE_SETTLE_S <= took < rpc_session.PROBE_SETTLE_S + rpc_session.GRACEFUL_S
    assert not [t for t in threading.enumerate() if t.name == "test-slow-probe"]
