"""``held_interrupts``: a SIGINT that comes inside a held block is handled as the block ends, once; the handler is
always put back. Each test installs a handler of its own (a real ``KeyboardInterrupt`` would end the test run)."""

from __future__ import annotations

import signal
import threading

import pytest
import torch

from weightsync.core.interrupts import held_interrupts


class Interrupted(Exception):
    pass


@pytest.fixture
def handler():
    """A SIGINT handler that counts its calls and raises ``Interrupted``; the test run's own is put back after."""
    calls: list[int] = []

    def interrupted(signum, frame):
        calls.append(signum)
        raise Interrupted

    before = signal.signal(signal.SIGINT, interrupted)
    yield interrupted, calls
    signal.signal(signal.SIGINT, before)


def test_a_sigint_in_a_held_block_is_handled_once_as_the_block_ends(handler):
    interrupted, calls = handler
    ran = []
    with pytest.raises(Interrupted):
        with held_interrupts():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            ran.append("after")
            with held_interrupts():  # (a block within joins the hold)
                ran.append("inner")
            ran.append("end")
    assert ran == ["after", "inner", "end"] and calls == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is interrupted


def test_a_block_with_nothing_to_hold_runs_as_it_is(handler):
    interrupted, calls = handler
    seen = []

    def other_thread():
        with held_interrupts():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(10)
    assert seen == [interrupted]  # (no KeyboardInterrupt in another thread: nothing swapped)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with held_interrupts():
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_a_hold_whose_end_another_signals_handler_cut_short_lets_the_next_sigint_through(handler):
    """Another signal's handler (a watchdog's alarm) may raise at the first step of a block's end, which then never
    puts the SIGINT handler back: the next SIGINT outside any block is handled at once (and the handler put back),
    where it was swallowed for good."""
    interrupted, calls = handler

    class Alarm(Exception):
        pass

    def alarm(signum, frame):
        raise Alarm

    before = signal.signal(signal.SIGALRM, alarm)
    try:

        def cut_short():
            hold = held_interrupts()
            hold.__enter__()
            with pytest.raises(Alarm):
                signal.raise_signal(signal.SIGALRM)  # (its end never runs)

        cut_short()
        assert signal.getsignal(signal.SIGINT) is not interrupted
        with pytest.raises(Interrupted):
            signal.raise_signal(signal.SIGINT)
        assert calls == [signal.SIGINT] and signal.getsignal(signal.SIGINT) is interrupted
        with pytest.raises(Interrupted), held_interrupts():  # (and holds work again)
            signal.raise_signal(signal.SIGINT)
        assert calls == [signal.SIGINT] * 2
    finally:
        signal.signal(signal.SIGALRM, before)


@pytest.mark.parametrize("name", ["multiprocess", "shared_mem", "distributed-gloo", "distributed-gloo+delta"])
@pytest.mark.parametrize("where", ["take", "apply"])
def test_a_worker_whose_update_a_ctrl_c_cut_short_acks_it_and_is_sent_the_next(name, where, monkeypatch):
    """A Ctrl-C in a worker's receive() (a program that goes on after it: a notebook, a handler) as it took or
    applied a version: the version is acked as not applied, the send names the worker at once, and the next
    version reaches it. Unacked, the worker was late on it for good: every later send passed it by."""
    import weightsync as ws
    import weightsync.core.receiver as receiver_module
    from tests._bodies import optimizer_step
    from tests._workers import build, checksum, in_process_receiver
    from tests.conftest import SCHEMES

    model = build("tiny")
    name, _, delta = name.partition("+")
    scheme = SCHEMES[name](**({"delta": True} if delta else {}))
    scheme.timeout = 5.0
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    replica = build("tiny")
    receiver = in_process_receiver(scheme, replica)
    held = checksum(replica)
    real = receiver_module.check_digest if where == "apply" else receiver_module.Receiver._resolve
    cut: list[bool] = []

    def once(*args, **kwargs):
        if not cut:
            cut.append(True)
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    if where == "apply":
        monkeypatch.setattr(receiver_module, "check_digest", once)
    else:
        monkeypatch.setattr(receiver_module.Receiver, "_resolve", once)
    try:
        optimizer_step(model, 1)
        scheme.send_async()
        with pytest.raises(KeyboardInterrupt):
            receiver.receive(timeout=10)
        assert cut and (receiver.version, checksum(replica)) == (0, held)
        with pytest.raises(ws.WeightSyncError, match="cut short before it was applied \\(KeyboardInterrupt\\)"):
            scheme.wait_async(timeout=5)
        optimizer_step(model, 2)
        scheme.send_async()
        assert receiver.receive(timeout=10) is not None
        assert (receiver.version, checksum(replica)) == (2, checksum(model))
        scheme.wait_async(timeout=5)
    finally:
        receiver.shutdown()
        scheme.shutdown()


@pytest.mark.parametrize("name", ["multiprocess", "shared_mem"])
def test_a_ctrl_c_as_a_local_worker_reads_a_slots_share_leaves_its_channel_in_step_and_loses_no_update(
    name, monkeypatch, handler
):
    """A Ctrl-C as a local worker read the message that shares a new slot, before the descriptor behind it: the
    message and the descriptor are read in one step, the interrupt raised once it ended, and the update read with
    them is kept for the next receive(). (Before, the descriptor was left on the channel: the next read took it for
    a frame's length, and the channel closed, the worker lost.)"""
    import os

    from tests._bodies import optimizer_step
    from tests._workers import build, checksum, in_process_receiver
    from tests.conftest import SCHEMES
    from weightsync.transports.local.mp import MPTransport

    model = build("tiny")
    scheme = SCHEMES[name]()
    scheme.timeout = 5.0
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    replica = build("tiny")
    receiver = in_process_receiver(scheme, replica)
    real = MPTransport._map_slot
    cut: list[bool] = []

    def interrupted(self, msg):
        if not cut:
            cut.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # (its handler runs at the next step Python may: raises Interrupted)
        return real(self, msg)

    monkeypatch.setattr(MPTransport, "_map_slot", interrupted)
    try:
        for version in (1, 2):  # (version 2 goes to a slot not shared yet: its share comes first)
            optimizer_step(model, version)
            scheme.send_async()
        with pytest.raises(Interrupted):
            receiver.receive(timeout=10)
        assert cut and handler[1] == [signal.SIGINT]
        assert receiver.receive(timeout=10) is not None
        assert (receiver.version, checksum(replica)) == (2, checksum(model))
        scheme.wait_async(timeout=5)
        for version in (3, 4):
            optimizer_step(model, version)
            scheme.send_async()
            assert receiver.receive(timeout=10) is not None
            assert (receiver.version, checksum(replica)) == (version, checksum(model))
            scheme.wait_async(timeout=5)
    finally:
        receiver.shutdown()
        scheme.shutdown()


@pytest.mark.parametrize("where", ["gpu_wait", "passing_on"])
def test_a_ctrl_c_after_the_write_settles_the_gpu_work_and_acks_a_failure(where, monkeypatch):
    """A Ctrl-C after the update was written: in the wait for the GPU copies (its likeliest place: the wait polls),
    or as a driving program passes the version on. The copies are waited for before the ack frees their slot, and
    the ack says the apply was cut short, with the version the model holds. (It was acked as applied at once: the
    sender could rewrite the slot under copies still reading it, and heard that a version the program never got
    was passed on; found by a review. On the CPU: the model is said to be on a GPU, whose waits are recorded.)"""
    import weightsync as ws
    import weightsync.core.receiver as receiver_module
    from tests._bodies import optimizer_step
    from tests._workers import build, in_process_receiver
    from weightsync.tensors import cuda

    model = build("tiny")
    scheme = ws.MultiProcessWeightSyncScheme()
    scheme.timeout = 5.0
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    receiver = in_process_receiver(scheme, build("tiny"))
    runtime = receiver._runtime.receiving
    settled: list[int | None] = []

    def settle(devices, deadline, whole_device=False):
        settled.append(runtime.version)
        if where == "gpu_wait" and len(settled) == 1:
            raise KeyboardInterrupt

    def passing_on():
        raise KeyboardInterrupt

    monkeypatch.setattr(receiver_module.Receiver, "_gpus", lambda self, dst, held: {torch.device("cuda", 0)})
    monkeypatch.setattr(cuda, "settle_before_write", lambda *args: False)
    monkeypatch.setattr(cuda, "settle", settle)
    if where == "passing_on":
        runtime.on_applied = passing_on
    try:
        optimizer_step(model, 1)
        scheme.send_async()
        with pytest.raises(KeyboardInterrupt):
            receiver.receive(timeout=10)
        assert runtime.version == 1 and settled == [1, 1]  # (written whole; its copies waited for once more)
        with pytest.raises(ws.WeightSyncError, match="cut short after it was written \\(KeyboardInterrupt\\)"):
            scheme.wait_async(timeout=5)
    finally:
        runtime.on_applied = None
        receiver.shutdown()
        scheme.shutdown()
