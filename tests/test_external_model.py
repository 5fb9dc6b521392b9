"""A worker whose model a program loads itself (``ExternalModel``, what an inference engine is to weightsync): each
update is checked against what the program loads, handed over as the sender's tensors, and acked only after the
program's load returned; a misfit is refused before the program sees a byte; a failed load is a refusal the
trainer is told of, with the version unchanged."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import weightsync as ws
from tests._workers import build, connect_pair
from weightsync.tensors.strategy import flatten_weights
from weightsync.transports.local.channel import Channel
from weightsync.transports.local.mp import MPTransport

SCHEMES = {
    "multiprocess": lambda: ws.MultiProcessWeightSyncScheme(timeout=20, connect_timeout=30),
    "shared_mem": lambda: ws.SharedMemWeightSyncScheme(timeout=20, connect_timeout=30),
    "distributed": lambda: ws.DistributedWeightSyncScheme(timeout=20, connect_timeout=60),
}


class Program:
    """What an engine is to weightsync: its own copy of the weights, loaded by its own code (copied, renamed)."""

    def __init__(self, spec: dict, fail_at: int | None = None) -> None:
        self.held: dict[str, torch.Tensor] = {}
        self.loads = 0
        self.fail_at = fail_at
        self.model = ws.ExternalModel(spec, self.load)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        self.loads += 1
        if self.loads == self.fail_at:
            raise RuntimeError("the engine could not load these weights")
        self.held = {f"engine.{k}": v.clone() for k, v in tensors.items()}


class Preparing(Program):
    """A program that prepares each version when it is taken (its own copy, made while it goes on), and makes it
    current when the version is applied; ``prepare_with``: what its preparation does instead (returns ``None``,
    raises), ``commit_fails``: its commits raise."""

    def __init__(self, spec: dict, prepare_with=None) -> None:
        super().__init__(spec)
        self.prepared: list[tuple[str, threading.Thread]] = []  # (what, the thread that prepared it)
        self.commits = 0
        self.prepare_with, self.commit_fails = prepare_with, False
        self.model = ws.ExternalModel(spec, self.load, prepare=self.prepare)

    def prepare(self, tensors: dict[str, torch.Tensor]):
        self.prepared.append((next(iter(tensors)), threading.current_thread()))
        if self.prepare_with is not None:
            return self.prepare_with()
        staged = {f"engine.{k}": v.clone() for k, v in tensors.items()}

        def commit() -> None:
            self.commits += 1
            if self.commit_fails:
                raise RuntimeError("the engine could not make the prepared weights current")
            self.held = staged

        return commit


def _bump(model: torch.nn.Module, by: float) -> None:
    """A new version of the trainer's weights: every one moved by ``by``."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return flatten_weights(model, "tensordict")  # what the default strategy sends, by the sender's names


def _spec(model: torch.nn.Module) -> dict:
    return {k: (tuple(v.shape), v.dtype) for k, v in _weights(model).items()}


def _send(sender, receiver) -> None:
    """``sender.send()`` while the worker receives in a thread of its own, as an engine's worker does."""
    wanted = (sender.version or 0) + 1
    got: list = []

    def receive() -> None:  # (receive() may return before the update is there: it says so with None)
        deadline = time.monotonic() + 20
        while receiver.version != wanted and time.monotonic() < deadline:
            got.append(receiver.receive(timeout=1))

    worker = threading.Thread(target=receive)
    worker.start()
    try:
        sender.send()
    finally:
        worker.join(30)
    assert receiver.version == wanted and got[-1] is receiver.model  # (an ExternalModel's receive() returns it)


def _cancelled(tensors):
    """A load an async engine cancelled: it raises what is not an ``Exception``."""
    raise asyncio.CancelledError


def _connected_and_one_taken(model, sender, receiver):
    """Connect the pair, send version 1 without waiting, and take it (not applied): return it."""
    connect_pair(sender, receiver, timeout=60)
    _bump(model, 1)
    sender.send_async()
    first = receiver.take(timeout=20)
    assert first is not None and first.version == 1
    return first


def _second_published_and_taken(model, sender, receiver):
    """Version 2, published without waiting, and taken (not applied): return it."""
    _bump(model, 1)
    sender.send_async()
    second = receiver.take(timeout=20)
    assert second is not None and second.version == 2
    return second


def _the_next_is_taken_and_applied(model, sender, receiver, program) -> None:
    """Version 2, published, is taken and applied; the sender hears it, and the program holds the trainer's model."""
    second = receiver.take(timeout=20)
    assert second is not None and second.version == 2 and second.apply() == 2
    sender.wait_async(20)
    expected = {f"engine.{k}": v for k, v in _weights(model).items()}
    assert all(torch.equal(program.held[k], expected[k]) for k in expected)


def _pair(name: str, program_of):
    model = build("tiny")
    sender = SCHEMES[name]()
    sender.init_on_sender(model_id="policy", model=model, num_workers=1)
    receiver = ws.from_config(sender.receiver_config(0))
    program = program_of(model)
    receiver.init_on_receiver(model_id="policy", model=program.model)
    return model, sender, receiver, program


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_each_version_reaches_the_program_by_the_senders_names_and_is_acked_after_its_load(name):
    model, sender, receiver, program = _pair(name, lambda m: Program(_spec(m)))
    try:
        connect_pair(sender, receiver, timeout=60)
        assert program.loads == 1 and receiver.version == 0
        for step in range(1, 4):
            _bump(model, step)
            _send(sender, receiver)
            assert receiver.version == step and sender.acked_versions == {0: step}
            expected = {f"engine.{k}": v for k, v in _weights(model).items()}
            assert program.held.keys() == expected.keys()
            assert all(torch.equal(program.held[k], expected[k]) for k in expected)
        assert program.loads == 4
    finally:
        receiver.shutdown()
        sender.shutdown()


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_a_program_whose_model_does_not_fit_is_refused_before_it_loads_anything(name):
    def misfit(model):
        spec = _spec(model)
        first = next(iter(spec))
        spec[first] = ((*spec[first][0], 2), spec[first][1])  # one shape the sender's does not have
        return Preparing(spec)

    model, sender, receiver, program = _pair(name, misfit)
    try:
        with pytest.raises(ws.WeightSyncError, match="shape|mismatch"):
            connect_pair(sender, receiver, timeout=60)
        assert program.loads == 0 and program.held == {} and program.prepared == []
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_names_the_program_does_not_load_may_come_in_another_dtype_or_not_at_all():
    """An engine computes some buffers itself (rotary frequencies): a trainer's copy in the engine's dtype
    (``model.to(torch.bfloat16)``) sends them in that dtype, a copy made of its checkpoint does not send them. Both
    fit a program that names them ``ignored``, which still gets them as they came; a name it loads still has to
    fit. (Both copies were refused before.)"""
    model = build("tiny")
    spec = _spec(model)
    loaded, other = sorted(spec)[:-1], sorted(spec)[-1]
    program = Program(spec)
    program.model = ws.ExternalModel(spec, program.load, ignored={other})
    sent = {**spec, other: (spec[other][0], torch.bfloat16)}
    assert program.model.spec_for(sent) == sent
    assert program.model.spec_for({k: spec[k] for k in loaded}) == {k: spec[k] for k in loaded}
    with pytest.raises(ws.WeightMismatchError, match=loaded[0]):
        ws.tensors.strategy.check_spec(
            {**sent, loaded[0]: (spec[loaded[0]][0], torch.bfloat16)}, program.model.spec_for(sent)
        )
    sender = SCHEMES["multiprocess"]()
    copy = {k: (v.to(torch.bfloat16) if k == other else v) for k, v in _weights(model).items()}
    sender.init_on_sender(model_id="policy", weights=copy, num_workers=1)
    receiver = ws.from_config(sender.receiver_config(0))
    receiver.init_on_receiver(model_id="policy", model=program.model)
    try:
        connect_pair(sender, receiver, timeout=60)
        assert program.held[f"engine.{other}"].dtype == torch.bfloat16 and receiver.version == 0
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_a_load_that_fails_is_a_refusal_the_trainer_is_told_of_and_the_version_stays():
    model, sender, receiver, program = _pair("multiprocess", lambda m: Program(_spec(m), fail_at=2))
    try:
        connect_pair(sender, receiver, timeout=60)
        before = dict(program.held)
        errors: list[BaseException] = []

        def receive() -> None:
            deadline = time.monotonic() + 20
            while not errors and time.monotonic() < deadline:  # (until the refused update arrives)
                try:
                    receiver.receive(timeout=1)
                except BaseException as exc:  # noqa: BLE001 - checked below
                    errors.append(exc)

        worker = threading.Thread(target=receive)
        worker.start()
        with pytest.raises(ws.WeightSyncError, match="could not load"):
            sender.send()
        worker.join(30)
        assert errors and "could not load" in str(errors[0])
        assert receiver.version == 0 and program.held is not None
        assert all(torch.equal(before[k], program.held[k]) for k in before)
        _send(sender, receiver)  # the next version loads
        assert receiver.version == 2 and program.loads == 3
    finally:
        receiver.shutdown()
        sender.shutdown()


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_take_brings_a_version_in_now_and_apply_loads_it_later(name):
    """``take()``: the bytes come into the worker while its program goes on (an engine generating); the program
    loads nothing until ``apply()``, which checks, loads and acks as ``receive()`` would. The sender's ``send()``
    returns only after that ack; no next version is handed out before it."""
    model, sender, receiver, program = _pair(name, lambda m: Program(_spec(m)))
    try:
        connect_pair(sender, receiver, timeout=60)
        assert receiver.take() is None  # nothing published: only checks
        _bump(model, 1)
        sent = threading.Thread(target=sender.send)
        sent.start()
        pending = receiver.take(timeout=20)
        assert pending is not None and pending.version == 1
        assert program.loads == 1 and receiver.version == 0  # taken, not loaded: the program computes with v0
        assert sent.is_alive()  # no ack yet: send() waits for the load
        assert pending.apply() == 1
        sent.join(30)
        assert not sent.is_alive() and sender.acked_versions == {0: 1} and program.loads == 2
        expected = {f"engine.{k}": v for k, v in _weights(model).items()}
        assert all(torch.equal(program.held[k], expected[k]) for k in expected)
        with pytest.raises(ws.LifecycleError, match="applied or discarded already"):
            pending.apply()
    finally:
        receiver.shutdown()
        sender.shutdown()


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_a_version_taken_and_not_applied_holds_back_the_next_take_and_receive(name):
    """A second ``take()`` before the first version's ``apply()`` handed out the next version; applying the first
    after it then rolled the model back to the older version (under ``shared_mem``, from a slot the sender may have
    given to a later version meanwhile). Now ``take()`` and ``receive()`` are refused, naming the version taken,
    until it is applied; then the next version comes."""
    model, sender, receiver, program = _pair(name, lambda m: Program(_spec(m)))
    try:
        first = _connected_and_one_taken(model, sender, receiver)
        _bump(model, 1)
        sender.send_async()
        for call in (receiver.take, receiver.receive):
            with pytest.raises(ws.LifecycleError, match="version 1 was taken .* not applied yet"):
                call(timeout=1)
        loading, go_on, load = threading.Event(), threading.Event(), program.load

        def slow_load(tensors):  # (and while it applies, too)
            loading.set()
            assert go_on.wait(20)
            load(tensors)

        program.model.__dict__["load"] = slow_load  # (the frozen ExternalModel's field, for this one apply)
        applying = threading.Thread(target=first.apply)
        applying.start()
        try:
            assert loading.wait(20)
            with pytest.raises(ws.LifecycleError, match="version 1 was taken .* not applied yet"):
                receiver.take(timeout=1)
        finally:
            go_on.set()
            applying.join(30)
        program.model.__dict__["load"] = load
        assert receiver.version == 1
        _the_next_is_taken_and_applied(model, sender, receiver, program)
        assert receiver.version == 2 and sender.acked_versions == {0: 2}
    finally:
        receiver.shutdown()
        sender.shutdown()


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_a_version_taken_can_be_discarded_the_sender_is_told_and_the_next_one_comes(name):
    """A program that will not load a version it took discards it (without a way to, a lost ``PendingUpdate`` held
    the worker back for good): the sender hears the worker did not apply it, the model keeps its weights, and the
    next version is taken and applied."""
    model, sender, receiver, program = _pair(name, lambda m: Program(_spec(m)))
    try:
        first = _connected_and_one_taken(model, sender, receiver)
        first.discard()
        with pytest.raises(ws.WeightSyncError, match="discarded it"):
            sender.wait_async(20)
        assert receiver.version == 0 and program.loads == 1
        with pytest.raises(ws.LifecycleError, match="applied or discarded already"):
            first.apply()
        _bump(model, 1)
        sender.send_async()
        _the_next_is_taken_and_applied(model, sender, receiver, program)
    finally:
        receiver.shutdown()
        sender.shutdown()


@pytest.mark.parametrize("name", ["multiprocess", "shared_mem"])
def test_versions_a_program_keeps_hold_no_memory_of_the_engine_once_applied_or_shut_down(name):
    # A program that keeps the last PendingUpdate it handled (a variable, a list of them) kept the engine's slot
    # mapped, or its segment's descriptor open, past the worker's shutdown().
    def mapped() -> list[str]:
        with open("/proc/self/maps") as maps:
            return [line for line in maps if "weightsync" in line]

    before = len(mapped())
    model, sender, receiver, program = _pair(name, lambda m: Program(_spec(m)))
    try:
        first = _connected_and_one_taken(model, sender, receiver)
        assert first.apply() == 1
        second = _second_published_and_taken(model, sender, receiver)
    finally:
        receiver.shutdown()
        sender.shutdown()
    assert len(mapped()) == before, mapped()  # (first and second are still held here)
    assert first.version == 1 and second.version == 2


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_an_interrupted_load_or_a_shut_down_scheme_leaves_no_version_taken_for_good(name):
    """A load that raises what is not an ``Exception`` (an async engine's cancelled load, an interrupt) lets the
    version taken go, acked as not applied: the next one is taken (it was refused for good, the pending marked
    done; then, unacked, its worker was passed by for good under ``raise``). After the
    worker's scheme shut down, a pending version's ``apply()`` says so, and ``discard()`` does nothing (both
    raised a bare ``AssertionError`` inside the closed engine)."""
    model, sender, receiver, program = _pair(name, lambda m: Program(_spec(m)))
    try:
        first = _connected_and_one_taken(model, sender, receiver)
        load = program.model.load
        program.model.__dict__["load"] = _cancelled  # (the frozen ExternalModel's field, for this one apply)
        with pytest.raises(asyncio.CancelledError):
            first.apply()
        program.model.__dict__["load"] = load
        with pytest.raises(ws.ReceiverError, match="cut short before it was applied \\(CancelledError\\)"):
            sender.wait_async(20)  # (acked as not applied: its sender waits for nothing in vain)
        second = _second_published_and_taken(model, sender, receiver)
    finally:
        receiver.shutdown()
        sender.shutdown()
    with pytest.raises(ws.LifecycleError, match="shut down"):
        second.apply()
    second.discard()


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_a_background_thread_ended_by_what_is_not_an_exception_says_so_at_every_receive(name):
    """A load in the background thread that raises what is not an ``Exception`` (an engine's cancelled load, a
    ``SystemExit``) ends the thread, and every later ``receive()`` raises it: the thread died silently before, and
    each ``receive()`` returned nothing, for good. The version was not applied, and is acked so."""
    model, sender, receiver, program = _pair(name, lambda m: Program(_spec(m)))
    try:
        receiver.background_thread = True
        connect_pair(sender, receiver, timeout=60)
        program.model.__dict__["load"] = _cancelled  # (the frozen ExternalModel's field)
        _bump(model, 1)
        sender.send_async()
        for _ in range(2):
            with pytest.raises(asyncio.CancelledError):
                receiver.receive(timeout=20)
        assert receiver.version == 0 and program.loads == 1
    finally:
        receiver.shutdown()
        sender.shutdown()


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_a_take_interrupted_as_it_says_it_took_a_version_leaves_no_version_taken(name):
    """An interrupt (or an engine's own error) while the worker says it took a version hands nothing out and holds
    nothing back: the next version is taken and applied (it left the version taken for good, and every later take
    and receive refused)."""
    model, sender, receiver, program = _pair(name, lambda m: Program(_spec(m)))
    try:
        connect_pair(sender, receiver, timeout=60)
        engine = receiver._runtime.receiving.engine

        def interrupted(taken):
            raise KeyboardInterrupt

        engine.ready = interrupted
        _bump(model, 1)
        sender.send_async()
        with pytest.raises(KeyboardInterrupt):
            receiver.take(timeout=20)
        del engine.ready
        with pytest.raises(ws.ReceiverError, match="cut short before it was applied \\(KeyboardInterrupt\\)"):
            sender.wait_async(20)  # (acked as not applied)
        _bump(model, 1)
        sender.send_async()
        pending = receiver.take(timeout=20)
        assert pending is not None and pending.version == 2 and pending.apply() == 2
    finally:
        receiver.shutdown()
        sender.shutdown()


@pytest.mark.parametrize("driven", [False, True], ids=["undriven", "driven"])
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_a_version_taken_whole_as_its_sender_shuts_down_is_applied_and_the_next_take_says_it_went(name, driven):
    """A version whose bytes are here when the sender shuts down is applied (its ack is lost, no more), as any
    version read before the sender's end; the next take says the sender went. Where a driver waits to hear the
    worker took it (``driven``), the word that could not go lost the version with it: ``take`` raised, and
    without a driver, ``apply`` raised ``ConnectionClosedError`` with the version applied."""
    model, sender, receiver, program = _pair(name, lambda m: Preparing(_spec(m)))
    try:
        connect_pair(sender, receiver, timeout=60)
        sender._runtime.sending.engine.reports_taken = driven  # (what the vLLM driver sets when it wraps the engine)
        _bump(model, 1)
        sender.send_async()
        sender.shutdown()  # (the version's bytes are on their way, or here: nothing is taken yet)
        pending = receiver.take(timeout=20)
        assert pending is not None and pending.version == 1 and pending.apply() == 1
        expected = {f"engine.{k}": v for k, v in _weights(model).items()}
        assert receiver.version == 1 and all(torch.equal(program.held[k], expected[k]) for k in expected)
        with pytest.raises(ws.ConnectionClosedError):
            receiver.take(timeout=20)
    finally:
        receiver.shutdown()
        sender.shutdown()


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_a_program_prepares_a_version_as_it_is_taken_and_the_apply_makes_it_current(name):
    """``ExternalModel.prepare``: the taking thread hands the program the version's checked tensors while it goes on
    (an engine processes them while it generates); the program's model is unchanged until ``apply()``, which makes
    the prepared version current instead of loading it, and acks it."""
    model, sender, receiver, program = _pair(name, lambda m: Preparing(_spec(m)))
    try:
        connect_pair(sender, receiver, timeout=60)
        assert receiver.version == 0 and program.commits + program.loads == 1  # (connect's version, applied at once)
        held, loads = dict(program.held), program.loads
        for step in range(1, 4):
            _bump(model, 1)
            expected = {f"engine.{k}": v.clone() for k, v in _weights(model).items()}
            sent = threading.Thread(target=sender.send)
            sent.start()
            taken: list = []
            taker = threading.Thread(target=lambda out=taken: out.append(receiver.take(timeout=20)))
            prepared_before = len(program.prepared)
            taker.start()
            taker.join(30)
            pending = taken[0]
            assert pending is not None and pending.version == step
            assert len(program.prepared) == prepared_before + 1 and program.prepared[-1][1] is taker
            assert receiver.version == step - 1 and sent.is_alive()  # prepared, not current, not acked
            assert all(torch.equal(program.held[k], held[k]) for k in expected)
            assert pending.apply() == step
            sent.join(30)
            assert not sent.is_alive() and sender.acked_versions == {0: step}
            assert all(torch.equal(program.held[k], expected[k]) for k in expected)
            held = expected
        assert program.loads == loads and program.commits == 4 - loads  # each version taken: prepared, committed
    finally:
        receiver.shutdown()
        sender.shutdown()


@pytest.mark.parametrize("how", ["declines", "raises"])
def test_a_version_the_program_does_not_prepare_is_loaded_at_apply(how):
    """A preparation that returns ``None`` (the program cannot prepare this version) or raises leaves the version
    to ``load`` at apply: nothing is lost, and the trainer is not told of a failure."""

    def fails():
        raise RuntimeError("no memory for a second copy")

    model, sender, receiver, program = _pair(
        "multiprocess", lambda m: Preparing(_spec(m), prepare_with=(lambda: None) if how == "declines" else fails)
    )
    try:
        connect_pair(sender, receiver, timeout=60)
        loads = program.loads
        _bump(model, 1)
        sent = threading.Thread(target=sender.send)
        sent.start()
        pending = receiver.take(timeout=20)
        assert pending is not None and program.prepared and program.loads == loads
        assert pending.apply() == 1
        sent.join(30)
        assert not sent.is_alive() and sender.acked_versions == {0: 1}
        assert program.loads == loads + 1 and program.commits == 0
        expected = {f"engine.{k}": v for k, v in _weights(model).items()}
        assert all(torch.equal(program.held[k], expected[k]) for k in expected)
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_a_prepared_version_that_fails_to_become_current_is_a_refusal_and_the_version_stays():
    model, sender, receiver, program = _pair("multiprocess", lambda m: Preparing(_spec(m)))
    try:
        connect_pair(sender, receiver, timeout=60)
        program.commit_fails = True
        before = dict(program.held)
        _bump(model, 1)
        errors: list[BaseException] = []
        sent = threading.Thread(target=lambda: _raised(sender.send, errors))
        sent.start()
        pending = receiver.take(timeout=20)
        assert pending is not None
        with pytest.raises(RuntimeError, match="could not make the prepared"):
            pending.apply()
        sent.join(30)
        assert receiver.version == 0 and errors and "could not make the prepared" in str(errors[0])
        assert all(torch.equal(before[k], program.held[k]) for k in before)
    finally:
        receiver.shutdown()
        sender.shutdown()


def _raised(call, errors: list) -> None:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        errors.append(exc)


def test_take_waits_past_a_slots_share_for_the_update_that_names_it(monkeypatch):
    """A local sender shares a new slot in a message of its own, then announces the update in it: a ``take()`` that
    reads the share before the update is written goes on waiting for the update (it once returned ``None`` there,
    long before its timeout)."""
    model, sender, receiver, program = _pair("shared_mem", lambda m: Program(_spec(m)))  # (its first send: a new slot)
    send, map_slot = Channel.send, MPTransport._map_slot
    mapped = threading.Event()

    def mapping(transport, msg):
        map_slot(transport, msg)
        mapped.set()

    def late_update(channel, msg):
        if msg.get("op") == "update":
            assert mapped.wait(20), "the worker never read the slot's share"  # the update comes after it was read
        send(channel, msg)

    try:
        connect_pair(sender, receiver, timeout=60)
        monkeypatch.setattr(Channel, "send", late_update)
        monkeypatch.setattr(MPTransport, "_map_slot", mapping)
        sent = threading.Thread(target=sender.send)
        sent.start()
        pending = receiver.take(timeout=20)
        assert pending is not None and pending.version == 1 and pending.apply() == 1
        sent.join(30)
        assert not sent.is_alive() and sender.acked_versions == {0: 1}
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_take_is_refused_where_updates_are_applied_as_they_arrive():
    model, sender, receiver, program = _pair("multiprocess", lambda m: Program(_spec(m)))
    try:
        with pytest.raises(ws.LifecycleError, match="take"):
            receiver.take()  # not connected yet
        receiver.background_thread = True
        connect_pair(sender, receiver, timeout=60)
        assert not receiver.applied_on_arrival
        with pytest.raises(ws.LifecycleError, match="background thread"):
            receiver.take()
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_a_distributed_sender_knows_when_the_worker_took_a_version_before_it_applies_it():
    """``wait_sent`` (what the vLLM driver waits on before it pauses an engine): it returns once the worker took the
    newest version off the wire and checked it (the worker says so in the store, sealed with the run key), not
    when gloo's sends returned; a worker that has not taken it is waited for until the deadline, no longer. The
    workers say so only where a driver asked for it (``reports_taken``, set before the first send), and not
    otherwise: a store write each that nobody would read."""
    model, sender, receiver, program = _pair("distributed", lambda m: Program(_spec(m)))
    try:
        connect_pair(sender, receiver, timeout=60)
        engine = sender._runtime.sending.engine
        store = engine.transports[0].store
        _send(sender, receiver)  # no driver: the worker does not say it took the version
        assert not store.check(["taken/0"])
        engine.reports_taken = True  # (what the vLLM driver sets when it wraps the engine)
        _bump(model, 1)
        sender.send_async()
        started = time.monotonic()
        engine.wait_sent(0, started + 0.5)  # nothing taken yet: the whole 0.5 s
        assert 0.45 <= time.monotonic() - started < 5
        pending = receiver.take(timeout=20)
        assert pending is not None and pending.version == 2 and program.loads == 2
        started = time.monotonic()
        engine.wait_sent(0, started + 20)  # taken: at once
        assert time.monotonic() - started < 2
        pending.apply()
        sender.wait_async(20)
        assert sender.acked_versions == {0: 2}
    finally:
        receiver.shutdown()
        sender.shutdown()


@pytest.mark.parametrize("name", ["multiprocess", "shared_mem"])
def test_a_local_sender_knows_when_the_worker_took_a_version_before_it_applies_it(name):
    """``wait_sent`` on the local schemes: the bytes are in shared memory when ``send`` returns, but the worker's
    program takes (and prepares) each version in a thread of its own while it goes on; where a driver asked
    (``reports_taken``), the worker says when it took it, and ``wait_sent`` returns then, or at its deadline. It
    returns at once too where the worker holds a version taken and not applied (it takes the next only after)."""
    model, sender, receiver, program = _pair(name, lambda m: Preparing(_spec(m)))
    try:
        connect_pair(sender, receiver, timeout=60)
        engine = sender._runtime.sending.engine
        started = time.monotonic()
        engine.wait_sent(0, started + 5)  # no driver: at once
        assert time.monotonic() - started < 2
        prepared = len(program.prepared)  # (connect's version's)
        engine.reports_taken = True  # (what the vLLM driver sets when it wraps the engine)
        for step in (1, 2):
            _bump(model, 1)
            sender.send_async()  # (nobody reads the worker's channel meanwhile but wait_sent)
            started = time.monotonic()
            engine.wait_sent(0, started + 0.5)  # nothing taken yet: the whole 0.5 s
            assert 0.45 <= time.monotonic() - started < 5
            pending = receiver.take(timeout=20)
            assert pending is not None and pending.version == step and len(program.prepared) == prepared + step
            started = time.monotonic()
            engine.wait_sent(0, started + 20)  # taken: at once
            assert time.monotonic() - started < 2
            pending.apply()
            sender.wait_async(20)  # (the acks wait_sent read off the channel are handed on)
            assert sender.acked_versions == {0: step}
        _bump(model, 1)
        sender.send_async()
        pending = receiver.take(timeout=20)  # version 3 taken, not applied ...
        sender.send_async()  # ... when version 4 is sent: the worker takes it only once 3 is applied
        started = time.monotonic()
        engine.wait_sent(0, started + 20)
        assert time.monotonic() - started < 2
        pending.apply()
        receiver.take(timeout=20).apply()
        sender.wait_async(20)
        assert sender.acked_versions == {0: 4}
    finally:
        receiver.shutdown()
        sender.shutdown()
