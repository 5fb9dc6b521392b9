"""``held_interrupts``: a SIGINT that comes inside a held block is handled as the block ends, once; the handler is
always put back. Each test installs a handler of its own (a real ``KeyboardInterrupt`` would end the test run)."""

from __future__ import annotations

import signal
import threading

import pytest

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
