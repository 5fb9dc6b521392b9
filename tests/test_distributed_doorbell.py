"""A ``distributed`` worker waiting for the next version wakes at its doorbell (a ring in the store the sender
pushes with each announcement, carrying a copy of it), not on a polling back-off; what a ring carries is taken only
once it opens with the run key under the key the worker expects.

A worker reaches its sender through its doorbell where it has no line to it (``distributed/line.py``: one that did
not come up, or a worker that rejoined): here, none comes up. In-process receivers on a real TCP store and gloo
group on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

import weightsync as ws
from tests._bodies import optimizer_step
from tests._workers import build, checksum, in_process_receiver, stop_process, store_in_a_child
from weightsync.core.timing import deadline_after, wait_until
from weightsync.transports import store as store_module
from weightsync.transports import storeclient
from weightsync.transports.distributed import doorbell, worker_side
from weightsync.transports.distributed import receiver as receiver_module
from weightsync.transports.distributed import transport as transport_module
from weightsync.transports.storeclient import StoreCalls


@pytest.fixture(autouse=True)
def _no_line(monkeypatch):
    monkeypatch.setattr(receiver_module.DistributedReceiver, "_dial", lambda self, store, deadline: None)


def _pair():
    model = build("tiny")
    scheme = ws.DistributedWeightSyncScheme(timeout=20, connect_timeout=60, sync=False)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    replica = build("tiny")
    return model, scheme, replica, in_process_receiver(scheme, replica)


def _transport(receiver):
    return receiver._runtime.receiving.engine.transport


def _stranger_store(scheme) -> dist.Store:
    """A client of the sender's store under the run's prefix, holding no key (anyone on the host can be one)."""
    engine = scheme._sending.engine
    host, port = engine.address
    return dist.PrefixStore(engine.prefix, dist.TCPStore(host, port, is_master=False))


def _doorbell_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if "doorbell" in t.name]


def _receive_in_thread(receiver, timeout: float) -> tuple[threading.Thread, list]:
    got: list = []

    def run() -> None:
        try:
            got.append(receiver.receive(timeout=timeout))
        except BaseException as exc:  # noqa: BLE001 - looked at by the test
            got.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, got


def _send_while_receiving(model, scheme, replica, receiver, step: int) -> None:
    """Send version ``step`` while the worker waits in ``receive``; it must get it whole."""
    optimizer_step(model, step)
    thread, got = _receive_in_thread(receiver, 60)
    scheme.send_async()
    thread.join(90)
    scheme.wait_async()
    assert got and got[0] is not None, got
    assert receiver.version == step and checksum(replica) == checksum(model)


def _when_waiting(monkeypatch, woken_by_ring: list | None = None) -> threading.Event:
    """An event set once a worker waits on its doorbell; ``woken_by_ring`` gets, for each wait, whether a ring
    ended it."""
    waiting = threading.Event()
    real_wait = doorbell.Doorbell.wait

    def wait(self, seen, timeout):
        waiting.set()
        real_wait(self, seen, timeout)
        if woken_by_ring is not None:
            woken_by_ring.append(self.rings != seen)

    monkeypatch.setattr(doorbell.Doorbell, "wait", wait)
    return waiting


def _send_once_waiting(model, scheme, replica, receiver, waiting: threading.Event, step: int) -> None:
    """Send version ``step`` once the worker waits on its doorbell; it must get it whole."""
    waiting.clear()
    thread, got = _receive_in_thread(receiver, 30)
    assert waiting.wait(60), "the worker never waited on its doorbell"
    optimizer_step(model, step)
    scheme.send_async()
    thread.join(90)
    scheme.wait_async()
    assert got and got[0] is not None, got
    assert receiver.version == step and checksum(replica) == checksum(model)


def test_a_waiting_worker_wakes_at_the_doorbell(monkeypatch):
    # No periodic look within the receive's timeout: the worker looks again only when a ring ends its wait.
    monkeypatch.setattr(worker_side, "LOOK_AGAIN_S", 3600.0)
    woken_by_ring: list[bool] = []
    waiting = _when_waiting(monkeypatch, woken_by_ring)
    model, scheme, replica, receiver = _pair()
    try:
        for step in (1, 2):
            _send_once_waiting(model, scheme, replica, receiver, waiting, step)
            assert woken_by_ring[-1], "the wait before the version was not ended by the sender's ring"
        assert _transport(receiver).bell.rings >= 2
    finally:
        receiver.shutdown()
        scheme.shutdown()


def test_a_lost_ring_only_delays_the_worker_to_its_next_look(monkeypatch):
    model, scheme, replica, receiver = _pair()
    monkeypatch.setattr(transport_module, "ring", lambda *args, **kwargs: None)  # the sender's rings never come
    try:
        _send_while_receiving(model, scheme, replica, receiver, 1)
        assert _transport(receiver).bell.rings == 0
    finally:
        receiver.shutdown()
        scheme.shutdown()


class _CountingStore:
    """A worker's store, counting its looks for an announcement (every other call passes through)."""

    def __init__(self, store: dist.Store) -> None:
        self._store, self.looks = store, 0

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:  # (how a key is read without waiting)
        self.looks += key.startswith("msg/")
        return self._store.compare_set(key, expected, desired)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def test_a_polling_worker_looks_for_a_newer_version_only_after_a_ring_or_a_while(monkeypatch):
    """``receive(timeout=0)`` looks in the store for the next announcement only if the doorbell rang since the last
    look, or ``LOOK_AGAIN_S`` went by: a ring a stranger took away delays a polling worker that long, no longer."""
    monkeypatch.setattr(worker_side, "LOOK_AGAIN_S", 3600.0)
    model, scheme, replica, receiver = _pair()
    try:
        _send_while_receiving(model, scheme, replica, receiver, 1)
        transport = _transport(receiver)
        counting = transport.link.store = _CountingStore(transport.link.store)
        for _ in range(5):
            assert receiver.receive(timeout=0) is None
        assert counting.looks == 0
        monkeypatch.setattr(transport_module, "ring", lambda *args, **kwargs: None)  # a stranger took the ring
        optimizer_step(model, 2)
        scheme.send_async()
        assert receiver.receive(timeout=0) is None and counting.looks == 0
        monkeypatch.setattr(worker_side, "LOOK_AGAIN_S", 0.0)  # ... until LOOK_AGAIN_S went by
        assert receiver.receive(timeout=0) is not None and counting.looks >= 1
        scheme.wait_async()
        assert receiver.version == 2 and checksum(replica) == checksum(model)
    finally:
        receiver.shutdown()
        scheme.shutdown()


@pytest.mark.parametrize("what", [b"", b"garbage \xff" * 100, doorbell.LAST], ids=["empty", "garbage", "last"])
def test_a_strangers_rings_make_the_worker_apply_nothing(what, monkeypatch):
    """Rings from a client without the key wake the worker; it looks, finds no sealed announcement and applies
    nothing; the sender's next version still arrives (a stranger's ``LAST`` only ends the bell: periodic looks)."""
    waiting = _when_waiting(monkeypatch)
    model, scheme, replica, receiver = _pair()
    stranger = _stranger_store(scheme)
    try:
        before = checksum(replica)
        thread, got = _receive_in_thread(receiver, 2)
        assert waiting.wait(60)
        for _ in range(20):
            stranger.queue_push("bell/0", what)
        thread.join(30)
        assert got == [None], got
        assert receiver.version == 0 and checksum(replica) == before
        _send_while_receiving(model, scheme, replica, receiver, 1)
    finally:
        receiver.shutdown()
        scheme.shutdown()


def test_the_ring_carries_the_announcement_so_the_worker_reads_no_store_key_for_it(monkeypatch):
    """Each ring carries the sealed announcement the sender wrote to the store: the worker takes it from the ring
    (checked as the store's copy is), and reads the store for it only when no ring carried it."""
    carried: list[bytes | None] = []
    real = doorbell.Doorbell.take

    def take(self, check):
        carried.append(real(self, check))
        return carried[-1]

    monkeypatch.setattr(doorbell.Doorbell, "take", take)
    # The worker looks only when a ring ends its wait (no periodic look), and the sender sends only once the
    # worker waits: its look before waiting cannot find the store's copy before the ring comes.
    monkeypatch.setattr(worker_side, "LOOK_AGAIN_S", 3600.0)
    waiting = _when_waiting(monkeypatch)
    model, scheme, replica, receiver = _pair()
    try:
        for step in (1, 2, 3):
            _send_once_waiting(model, scheme, replica, receiver, waiting, step)
        assert sum(raw is not None for raw in carried) == 3, carried  # each version's announcement, from its ring
    finally:
        receiver.shutdown()
        scheme.shutdown()


def test_a_strangers_ring_carrying_a_forged_or_moved_announcement_is_not_taken(monkeypatch):
    """A ring carrying something that looks sealed (a made-up MAC, or a value the sender sealed for another key)
    is not taken for the next announcement: the worker applies nothing, then takes the sender's next version."""
    waiting = _when_waiting(monkeypatch)
    model, scheme, replica, receiver = _pair()
    stranger = _stranger_store(scheme)
    try:
        before = checksum(replica)
        forged = b"f" * 64 + b':{"version": 9, "nonce": "aa", "mac": "aes-gmac"}'
        moved = stranger.get("layout")  # sealed by the sender, for the key "layout"
        thread, got = _receive_in_thread(receiver, 2)
        assert waiting.wait(60)
        for what in (forged, moved):
            stranger.queue_push("bell/0", what)
        thread.join(30)
        assert got == [None], got
        assert receiver.version == 0 and checksum(replica) == before
        _send_while_receiving(model, scheme, replica, receiver, 1)
    finally:
        receiver.shutdown()
        scheme.shutdown()


def test_a_ring_with_an_unsealed_announcement_is_refused():
    model, scheme, replica, receiver = _pair()
    stranger = _stranger_store(scheme)
    try:
        before = checksum(replica)
        stranger.set("msg/0/1", '{"version": 9, "nonce": "aa", "mac": "aes-gmac"}')
        doorbell.ring(stranger, "bell/0")
        with pytest.raises(ws.AuthenticationError, match="msg/0/1"):
            receiver.receive(timeout=10)
        assert receiver.version == 0 and checksum(replica) == before
    finally:
        receiver.shutdown()
        scheme.shutdown()


@pytest.mark.parametrize("first", ["worker", "sender"])
def test_closing_ends_the_doorbell_thread_whoever_closes_first(first, monkeypatch):
    waiting = _when_waiting(monkeypatch)
    model, scheme, replica, receiver = _pair()
    try:
        assert len(_doorbell_threads()) == 1
        thread, got = _receive_in_thread(receiver, 60 if first == "sender" else 1)
        assert waiting.wait(60)
        if first == "sender":  # its goodbye is the last ring: the worker wakes, hears it, and the bell ends
            scheme.shutdown()
            thread.join(90)
            assert len(got) == 1 and isinstance(got[0], ws.ConnectionClosedError), got
        else:  # the bell's thread still blocks on the store, the sender alive: the worker rings it itself
            thread.join(30)
            assert got == [None]
        receiver.shutdown()
        assert _doorbell_threads() == []
    finally:
        receiver.shutdown()
        scheme.shutdown()


@pytest.mark.parametrize("mode", ["left", "rung", "silent"])
def test_a_process_whose_doorbell_store_fails_as_it_exits_does_not_abort(mode):
    """A bell's thread blocked on its store when the interpreter is torn down would see its call fail there (the
    store's host vanished moments before the worker gave up on it: their timeouts are the same), and CPython 3.11
    aborts the process for it. Here the store is killed in the teardown, of a bell never closed (closed at exit:
    hung up where it has no ringer, ``left``, and rung where it has, ``rung``) and of one closed while its store
    was silent, which no ring wakes (``silent``: it hangs up)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests._doorbell_exit", mode],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "exiting" in done.stdout, (done.stdout, done.stderr[-3000:])
    if mode == "silent":
        assert "listening: False" in done.stdout, done.stdout
    if mode == "rung":  # woken by its ring: no call of the bell's failed (torch would have logged it)
        assert "TCPStore.cpp" not in done.stderr, done.stderr[-3000:]


def _serve(host: str, port: int = 0) -> dist.Store:
    """A TCP store listening on ``host`` alone (torch's own listens on every address)."""
    store, _, owned = store_module.open_store(host, port, 10)
    assert owned
    return store


@pytest.mark.parametrize("other", ["another store on the same port", "the same store"])
def test_a_hangup_shuts_only_its_own_connection_down(other, monkeypatch):
    """A connection another thread opens while a worker dials its store (to another host's store on the same port,
    or to the same store) is not taken for the worker's: hanging up leaves it working."""
    another = other.startswith("another")
    served = [_serve("127.0.0.1")]
    port = served[0].port
    if another:
        served.append(_serve("127.0.0.2", port))
    opened: list[dist.TCPStore] = []
    real_store = dist.TCPStore

    def store_opening_another(*args, **kwargs):
        host = "127.0.0.2" if another else "127.0.0.1"
        opened.append(real_store(host, port, is_master=False, timeout=timedelta(seconds=10)))
        return real_store(*args, **kwargs)

    monkeypatch.setattr(storeclient.dist, "TCPStore", store_opening_another)
    client, hangup = storeclient.dial_store("127.0.0.1", port, 10)
    monkeypatch.undo()
    assert len(opened) == 1
    shut = hangup()
    opened[0].set("k", "still there")
    assert opened[0].get("k") == b"still there"
    if another:  # its own connection was found, and shut down
        assert shut
        with pytest.raises(dist.DistError):
            client.get("k")
    else:  # two new connections to the store: which is the client's is not known, and neither is shut
        assert not shut
        assert client.get("k") == b"still there"


def test_a_doorbell_made_after_the_exit_callback_is_closed_as_it_is_made(monkeypatch):
    """A daemon thread that makes a bell while the process exits, after the callback closed the others: its bell
    is closed at once (rung awake), not left blocked on its store through the interpreter's teardown."""
    store = _serve("127.0.0.1")
    port = store.port
    client, hangup = storeclient.dial_store("127.0.0.1", port, 10)
    ringer = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    monkeypatch.setattr(doorbell, "_exiting", True)
    bell = doorbell.Doorbell(
        dist.PrefixStore("run", client), "bell/0", "test-doorbell", hangup, ringer=dist.PrefixStore("run", ringer)
    )
    assert bell.ended == "closed" and not bell._thread.is_alive()
    assert bell not in doorbell._listening
    client.set("k", "v")  # woken by its ring, not hung up
    assert store.get("k") == b"v"


def test_a_dial_waiting_behind_another_to_the_same_store_gives_up_within_its_timeout():
    store = _serve("127.0.0.1")
    dialing = storeclient._dialing(store.port)
    with dialing, pytest.raises(ws.SyncTimeoutError, match="another dial to it did not end"):  # (one that hangs)
        storeclient.dial_store("127.0.0.1", store.port, 1)
    storeclient.dial_store("127.0.0.1", store.port, 10)  # its turn came once the other ended


@contextlib.contextmanager
def _stopped_store():
    """A TCP store served by a child process (listening on every address), stopped (``SIGSTOP``) for the block: it
    takes connections (the kernel does) and answers nothing. Yields its port, and a call that resumes it."""
    server, port = store_in_a_child()
    try:
        stop_process(server.pid)
        yield port, lambda: os.kill(server.pid, signal.SIGCONT)
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait(10)


def _dial_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("weightsync-store-dial") and t.is_alive()]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "0.0.0.0"])
def test_a_dial_of_a_stopped_store_gives_up_within_its_timeout_however_its_host_is_named(host):
    """torch's client waits for a stopped store's first answer with no bound, whatever timeout it is given. A dial
    gives up within its own, however the store's host is named (a wildcard address reaches the loopback one: its
    connection is found all the same), leaves no thread behind, and the next dial, once the store answers, is
    made."""
    with _stopped_store() as (port, resume):
        began = time.monotonic()
        with pytest.raises(ws.SyncTimeoutError, match="no TCP store answered"):
            storeclient.dial_store(host, port, 1.0)
        assert time.monotonic() - began < 2.5
        assert wait_until(lambda: not _dial_threads(), deadline_after(5), 0.02), _dial_threads()
        resume()
        client, _ = storeclient.dial_store(host, port, 10)
        client.set("k", "v")
        assert client.get("k") == b"v"


def test_a_dial_of_something_that_is_no_store_gives_up_within_its_bound():
    """A dial of a port where another service answers (here it echoes what it is sent) fails within its timeout and
    a second (torch's client retries with a back-off that overshoots its own timeout by up to 1.6 s here), with
    torch's reason as the cause where it gave one in time."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    stop = threading.Event()

    def echo() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(0.5)
                with contextlib.suppress(OSError):
                    while data := conn.recv(4096):
                        conn.sendall(data)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    try:
        began = time.monotonic()
        with pytest.raises(ws.SyncTimeoutError, match="no TCP store answered at 127.0.0.1") as caught:
            storeclient.dial_store("127.0.0.1", port, 1.5)
        assert time.monotonic() - began < 1.5 + 1.0 + 0.4
        assert caught.value.__cause__ is None or isinstance(caught.value.__cause__, dist.DistError)
        # The dial's thread, left to torch's client (in a retry's back-off, it has no connection to shut down),
        # ends on its own once the client's own timeout is spent: looked for with a bound, not taken for a leak.
        dials = [t for t in threading.enumerate() if t.name == f"weightsync-store-dial-{port}"]
        for dial in dials:
            dial.join(10)
        assert not any(dial.is_alive() for dial in dials), "the dial's thread did not end"
    finally:
        stop.set()
        thread.join(5)
        server.close()


def test_a_block_hung_up_at_its_deadline_raises_a_timeout_and_only_then():
    """``hung_up_at``: a block that ends in time is left alone; one that outlasts its deadline (and the grace) has
    its client hung up and raises ``SyncTimeoutError``, even where the block itself then returned, and chains what
    the block raised; an interrupt goes on as it is."""
    calls: list[str] = []
    hung = threading.Event()

    def hangup() -> bool:
        calls.append("hung up")
        hung.set()
        return True

    def outlasted() -> None:  # the block runs on until its client is hung up
        assert hung.wait(5)
        hung.clear()

    with storeclient.hung_up_at(hangup, deadline_after(5), "a test"):  # type: ignore[arg-type]
        pass
    with pytest.raises(ws.SyncTimeoutError, match="a test: the store did not answer in time"):
        with storeclient.hung_up_at(hangup, deadline_after(0.0), "a test"):  # type: ignore[arg-type]
            outlasted()
    with pytest.raises(ws.SyncTimeoutError) as caught:
        with storeclient.hung_up_at(hangup, deadline_after(0.0), "a test"):  # type: ignore[arg-type]
            outlasted()
            raise dist.DistError("the call failed")
    assert isinstance(caught.value.__cause__, dist.DistError)
    with pytest.raises(KeyboardInterrupt):
        with storeclient.hung_up_at(hangup, deadline_after(0.0), "a test"):  # type: ignore[arg-type]
            outlasted()
            raise KeyboardInterrupt
    assert calls == ["hung up"] * 3


@pytest.mark.parametrize("fails", ["interrupted", "no thread", "interrupted in its start"])
def test_a_dial_that_fails_before_its_thread_runs_leaves_the_port_to_the_next_dial(fails, monkeypatch):
    """A dial interrupted before its thread ran (a Ctrl-C in its address look-up), or whose thread could not start,
    gives back the lock its port's dials take in turn: the next dial to the port is made. One interrupted in
    ``Thread.start()`` once its thread ran (which gave the lock back) raises the interrupt, and gives nothing back
    twice (the lock is another dial's by then, or free)."""
    store = _serve("127.0.0.1")
    if fails == "interrupted":

        def addresses(*args):
            raise KeyboardInterrupt

        monkeypatch.setattr(storeclient, "addresses_of", addresses)
        raised: type[BaseException] = KeyboardInterrupt
    elif fails == "no thread":
        real_start = threading.Thread.start

        def start(self):
            if self.name.startswith("weightsync-store-dial"):
                raise RuntimeError("can't start new thread")
            return real_start(self)

        monkeypatch.setattr(threading.Thread, "start", start)
        raised = RuntimeError
    else:  # a Ctrl-C in ``Thread.start()`` once the thread ran (it released the lock): not released twice
        real_start, port = threading.Thread.start, store.port

        def start(self):
            real_start(self)
            if self.name.startswith("weightsync-store-dial"):
                self.join(10)
                assert not storeclient._dialing(port).locked()
                raise KeyboardInterrupt

        monkeypatch.setattr(threading.Thread, "start", start)
        raised = KeyboardInterrupt
    with pytest.raises(raised):
        storeclient.dial_store("127.0.0.1", store.port, 5)
    monkeypatch.undo()
    assert not storeclient._dialing(store.port).locked()
    client, _ = storeclient.dial_store("127.0.0.1", store.port, 5)
    client.set("k", "v")


def _a_taken_value_also_discarded() -> bool:
    """One race of :func:`test_a_keyed_calls_value_..._by_another_callers_call`: whether the value taken was also
    discarded."""
    calls = StoreCalls(None, "weightsync-test-calls")
    go = threading.Event()
    value, got, discarded = object(), [], []

    def keyed() -> None:
        ask = (lambda: go.wait(5) and value, deadline_after(5), "a rejoin")
        got.append(calls.ask(*ask, key="rejoin", discard=discarded.append))

    waiter = threading.Thread(target=keyed)
    waiter.start()
    assert wait_until(lambda: "rejoin" in calls._keyed, deadline_after(5), 0.0005)
    job = calls._keyed["rejoin"]

    def other() -> None:  # asks something else as soon as the keyed call ended
        assert wait_until(lambda: job.ended, deadline_after(5), 0.0)
        calls.ask(lambda: None, deadline_after(5), "a look")

    asker = threading.Thread(target=other)
    asker.start()
    go.set()
    waiter.join(5)
    asker.join(5)
    calls.close(1)
    assert got == [value]
    return bool(discarded)


def test_a_keyed_calls_value_its_caller_waits_for_is_never_discarded_by_another_callers_call():
    """A keyed call whose caller is waiting for it ends just as another caller asks something else: the waiting
    caller takes the value, and it is not discarded as untaken (it was, in about 4 runs in 10: a rejoin's doorbell
    closed under the receive that took it)."""
    both = sum(_a_taken_value_also_discarded() for _ in range(100))
    assert both == 0, f"{both} of 100 values taken were discarded too"
