"""A ``distributed`` worker of the run's group has a line to its sender (one TCP connection): the announcements,
the bytes of a small version and the acks travel there, not through the store, the doorbell and the group. The
line port takes only connections that prove the run key for one worker; whatever a line carries is checked as
it is elsewhere.

In-process receivers on a real TCP store and gloo group on 127.0.0.1, and lines on loopback sockets.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import socket
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

import weightsync as ws
from tests._as_stranger import needs_stranger, start_stranger
from tests._attack_distributed import heard_back
from tests._bodies import optimizer_step
from tests._workers import build, checksum, in_process_receiver, stop_process
from weightsync.core.timing import deadline_after
from weightsync.errors import ConnectionClosedError, SyncTimeoutError, TransportError
from weightsync.transports.distributed import sender as sender_module
from weightsync.transports.distributed.auth import Sealer, line_proof
from weightsync.transports.distributed.line import (
    ANSWERED_WAIT_S,
    FRAME,
    MAX_UNPROVEN,
    NONCE_BYTES,
    Dialing,
    Line,
    Listener,
    _done,
)
from weightsync.transports.network import crowded_out

KEY, PREFIX = b"k" * 32, "weightsync/policy/0123456789abcdef"


def _pair(kind: str = "tiny"):
    model = build(kind)
    scheme = ws.DistributedWeightSyncScheme(timeout=20, connect_timeout=60, sync=False)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    replica = build(kind)
    return model, scheme, replica


def _transport(receiver):
    return receiver._runtime.receiving.engine.transport


def _send_while_receiving(model, scheme, replica, receiver, step: int) -> None:
    optimizer_step(model, step)
    got: list = []
    thread = threading.Thread(target=lambda: got.append(receiver.receive(timeout=60)))
    thread.start()
    scheme.send_async()
    thread.join(90)
    scheme.wait_async()
    assert got and got[0] is not None, got
    assert receiver.version == step and checksum(replica) == checksum(model)


def _stored_keys(scheme) -> list[str]:
    engine = scheme._sending.engine
    host, port = engine.address
    return dist.TCPStore(host, port, is_master=False).list_keys()


def _connected() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
    return client, peer


@pytest.mark.parametrize("inline", [True, False])
def test_a_workers_versions_come_on_its_line_and_its_announcements_never_touch_the_store(monkeypatch, inline):
    """Small versions travel on the line with their announcement; larger ones over the group, announced on the
    line. Either way the worker rings no doorbell, and the store holds no announcement."""
    if not inline:
        monkeypatch.setattr(sender_module, "INLINE_DIGEST_BYTES", -1)
    model, scheme, replica = _pair()
    receiver = in_process_receiver(scheme, replica)
    sends: list[bool] = []
    real_send_part = type(scheme._sending.engine.transports[0]).send_part

    def send_part(self, part):
        sends.append(True)
        return real_send_part(self, part)

    monkeypatch.setattr(type(scheme._sending.engine.transports[0]), "send_part", send_part)
    try:
        transport = _transport(receiver)
        assert transport.line is not None and transport.bell is None
        assert not [t for t in threading.enumerate() if "doorbell" in t.name]
        for step in (1, 2, 3):
            _send_while_receiving(model, scheme, replica, receiver, step)
        assert bool(sends) is not inline  # the group carried the bytes only where they were not inline
        assert not [k for k in _stored_keys(scheme) if "/msg/" in k or "bell/" in k]
    finally:
        receiver.shutdown()
        scheme.shutdown()


@pytest.mark.parametrize("inline", [True, False])
def test_a_worker_that_cannot_compute_the_senders_mac_refuses_that_version_and_reads_the_next_in_step(
    monkeypatch, inline
):
    """A worker whose libraries lack the MAC the sender picked cannot check a version: it reads its bytes all the
    same (off the line, or the group's receives) and refuses it by name; the next version, which it can check,
    is read in step."""
    if not inline:
        monkeypatch.setattr(sender_module, "INLINE_DIGEST_BYTES", -1)
    model, scheme, replica = _pair()
    receiver = in_process_receiver(scheme, replica)
    lacking = threading.Event()
    made = Sealer.payload_mac

    def payload_mac(self, *args):
        if lacking.is_set() and threading.current_thread().name == "worker":
            raise ws.ConfigurationError("the sender authenticates updates with aes-gmac, which this process lacks")
        return made(self, *args)

    monkeypatch.setattr(Sealer, "payload_mac", payload_mac)
    try:
        before = checksum(replica)
        lacking.set()
        optimizer_step(model, 1)
        failed: list[BaseException] = []

        def receive() -> None:
            try:
                receiver.receive(timeout=30)
            except ws.WeightSyncError as exc:
                failed.append(exc)

        worker = threading.Thread(target=receive, name="worker")
        worker.start()
        scheme.send_async()
        worker.join(60)
        with pytest.raises(ws.ReceiverError, match="ConfigurationError.*lacks"):
            scheme.wait_async(30)
        assert receiver.version == 0 and checksum(replica) == before
        lacking.clear()
        _send_while_receiving(model, scheme, replica, receiver, 2)
    finally:
        receiver.shutdown()
        scheme.shutdown()


def test_strangers_on_the_line_port_get_no_line_and_the_worker_gets_its_own():
    """One connects and claims worker 0 without the key, one connects and says nothing: the sender closes the
    first, and takes the worker's line when it comes."""
    model, scheme, replica = _pair()
    address = scheme._sending.engine.listener.address  # (anyone on the host finds the port: /proc/net/tcp)
    liar, silent = socket.create_connection(address, timeout=30), socket.create_connection(address, timeout=30)
    heard: list = []

    def lie() -> None:
        nonce = liar.recv(NONCE_BYTES)  # the challenge, once the sender's rendez-vous takes lines
        liar.sendall((0).to_bytes(8, "big") + line_proof(b"x" * 32, PREFIX, 0, nonce))
        heard.append(heard_back(liar))

    lying = threading.Thread(target=lie)
    lying.start()
    try:
        receiver = in_process_receiver(scheme, replica)
        try:
            lying.join(30)
            assert heard == [b""]  # closed without a word
            assert _transport(receiver).line is not None
            _send_while_receiving(model, scheme, replica, receiver, 1)
        finally:
            receiver.shutdown()
    finally:
        liar.close()
        silent.close()
        scheme.shutdown()


def test_the_listener_takes_only_a_proof_for_its_own_challenge_once_per_worker():
    listener = Listener("127.0.0.1")
    taken: dict = {}
    accepting = threading.Thread(
        target=lambda: taken.update(
            listener.accept(KEY, PREFIX, {0, 1}, deadline_after(3.0), lambda w, sock: Line(sock, f"l{w}", 5.0))
        )
    )
    accepting.start()
    answers = {
        "another challenge": lambda nonce: (1, line_proof(KEY, PREFIX, 1, bytes(NONCE_BYTES))),
        "another key": lambda nonce: (1, line_proof(b"x" * 32, PREFIX, 1, nonce)),
        "another run": lambda nonce: (1, line_proof(KEY, PREFIX + "0", 1, nonce)),
        "another worker's proof": lambda nonce: (1, line_proof(KEY, PREFIX, 0, nonce)),
        "a worker it does not have": lambda nonce: (7, line_proof(KEY, PREFIX, 7, nonce)),
        "worker 1": lambda nonce: (1, line_proof(KEY, PREFIX, 1, nonce)),
        "worker 1 again": lambda nonce: (1, line_proof(KEY, PREFIX, 1, nonce)),
    }
    closed = {}
    try:
        for what, answer in answers.items():
            with socket.create_connection(listener.address, timeout=10) as sock:
                nonce = sock.recv(NONCE_BYTES)
                worker, proof = answer(nonce)
                sock.sendall(worker.to_bytes(8, "big", signed=True) + proof)
                sock.settimeout(0.5)
                try:
                    closed[what] = sock.recv(1) == b""
                except TimeoutError:
                    closed[what] = False
        accepting.join(10)
        assert list(taken) == [1]  # worker 0 never came: the wait ended at its deadline
        assert closed == {what: what != "worker 1" for what in answers}
    finally:
        listener.close()
        for line in taken.values():
            line.close(0.0)


def test_a_stranger_who_gets_the_oldest_unproven_connection_closed_does_not_end_the_listeners_wait():
    # The listener keeps MAX_UNPROVEN connections that have not answered; the one past them closes the oldest.
    # Where that oldest one had something to read in the same wait, it was looked up after it was gone (KeyError,
    # out of the rendez-vous). Played from here, over and over, for a bounded time.
    listener = Listener("127.0.0.1")
    outcome: dict = {}

    def accept() -> None:
        try:
            outcome["lines"] = listener.accept(KEY, PREFIX, {0}, deadline_after(4.0), lambda w, s: Line(s, "l", 5.0))
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            outcome["error"] = exc

    accepting = threading.Thread(target=accept)
    accepting.start()
    conns: list[socket.socket] = []
    try:
        for _ in range(MAX_UNPROVEN):
            sock = socket.create_connection(listener.address, timeout=5)
            sock.recv(NONCE_BYTES)
            conns.append(sock)
        end = time.monotonic() + 3.0
        while accepting.is_alive() and time.monotonic() < end:
            oldest = conns.pop(0)
            with contextlib.suppress(OSError):
                oldest.send(b"x")  # the oldest becomes readable ...
            sock = socket.create_connection(listener.address, timeout=5)  # ... as one more comes
            conns.append(sock)
            oldest.close()
            with contextlib.suppress(OSError):
                sock.recv(NONCE_BYTES)
        accepting.join(10)
        assert not accepting.is_alive()
        assert "error" not in outcome, repr(outcome.get("error"))
        assert outcome["lines"] == {}  # (no worker came: the wait ended at its deadline)
    finally:
        for sock in conns:
            sock.close()
        listener.close()


@needs_stranger
def test_a_strangers_flood_of_the_line_port_pushes_out_only_its_own_never_a_workers_connection():
    """Past MAX_UNPROVEN, the line port closes the oldest unproven connection of the user who holds the most (the
    peer's uid from /proc/net/tcp: loopback TCP has no SO_PEERCRED): another user's connections, made after the
    worker's, push out their own, and the worker's proof is taken. (Closing the oldest of all, the worker's went
    first, and the worker fell back to its doorbell.)"""
    listener = Listener("127.0.0.1")
    outcome: dict = {}

    def accept() -> None:
        outcome["lines"] = listener.accept(KEY, PREFIX, {0}, deadline_after(30.0), lambda w, s: Line(s, "l", 5.0))

    accepting = threading.Thread(target=accept)
    accepting.start()
    worker, stranger = socket.create_connection(listener.address, timeout=10), None
    try:
        nonce = worker.recv(NONCE_BYTES)  # the listener took it in: its challenge came
        code = (
            "import socket, sys\n"
            f"socks = [socket.create_connection({listener.address!r}, timeout=10) for _ in range({2 * MAX_UNPROVEN})]\n"
            f"for s in socks: s.recv({NONCE_BYTES})\n"  # each one taken in: its challenge came (or it was closed)
            "print('holding', flush=True)\n"
            "sys.stdin.readline()\n"
        )
        stranger = start_stranger(["-c", code], stdin=subprocess.PIPE)
        ready, _, _ = select.select([stranger.stdout], [], [], 60)
        assert ready and stranger.stdout.readline().strip() == "holding"
        worker.sendall((0).to_bytes(8, "big") + line_proof(KEY, PREFIX, 0, nonce))
        accepting.join(30)
        assert not accepting.is_alive() and list(outcome["lines"]) == [0]
    finally:
        if stranger is not None:
            stranger.kill()
            stranger.wait(10)
        worker.close()
        accepting.join(30)
        for line in outcome.get("lines", {}).values():
            line.close(0.0)
        listener.close()


def test_a_full_queue_drops_the_oldest_connection_of_the_user_who_holds_the_most():
    assert crowded_out([1000, 65534, 65534], 65534) == 1  # the flooder's oldest
    assert crowded_out([1000, 65534], 1000) == 0  # a tie: the newcomer's user
    assert crowded_out([None, None, 0], 7) == 0  # connections from elsewhere count as one user


def test_lines_wait_on_descriptors_numbered_past_1024():
    # select() refuses a descriptor numbered 1024 or more; a trainer with many open files has such numbers.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(
            f"this host's hard limit on open files ({hard}) is below the 1200 the test needs to number one past 1024"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    writer = reader = None
    listener = Listener("127.0.0.1")
    try:
        a, b = _connected()
        writer, reader = Line(a, "w", 5.0), Line(b, "r", 5.0)
        assert min(reader.fileno(), writer.fileno(), listener._sock.fileno()) >= 1024  # type: ignore[union-attr]
        assert not reader.readable(0.05)
        with pytest.raises(SyncTimeoutError):
            reader.read(4, deadline_after(0.1))
        writer.write([b"abcd"]).result(5)
        assert reader.readable(5.0) and reader.read(4, deadline_after(5)) == b"abcd"
        assert listener.accept(KEY, PREFIX, {0}, deadline_after(0.2), lambda w, s: Line(s, "l", 5.0)) == {}
    finally:
        for line in (writer, reader):
            if line is not None:
                line.close(0.0)
        listener.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_frame_over_the_bound_closes_the_line():
    a, b = _connected()
    writer, reader = Line(a, "w", 5.0), Line(b, "r", 5.0)
    try:
        writer.write([FRAME.pack((1 << 20) + 1)]).result(5)
        with pytest.raises(TransportError, match="over its"):
            reader.frame(deadline_after(5), 1 << 20)
        assert reader.fileno() == -1
    finally:
        writer.close(0.0)
        reader.close(0.0)


def test_a_worker_whose_line_was_taken_closes_it_when_the_group_does_not_form(monkeypatch):
    import pickle

    from weightsync.transports.distributed import receiver as receiver_module

    lines: list[Line] = []
    taking = Dialing.line

    def line(self, taken: bool):
        lines.append(taking(self, taken))
        return lines[-1]

    def no_group(*args, **kwargs):
        raise dist.DistError("the group did not form")

    monkeypatch.setattr(Dialing, "line", line)
    monkeypatch.setattr(receiver_module, "new_group_within", no_group)
    model = build("tiny")
    scheme = ws.DistributedWeightSyncScheme(timeout=5, connect_timeout=8)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    worker = pickle.loads(pickle.dumps(scheme))
    worker.init_on_receiver(model_id="policy", model=build("tiny"), worker_idx=0)
    failed: list[BaseException] = []

    def join() -> None:
        try:
            worker.connect()
        except BaseException as exc:  # noqa: BLE001 - judged below
            failed.append(exc)

    joining = threading.Thread(target=join)
    joining.start()
    try:
        with pytest.raises(ws.WeightSyncError):  # (the sender waited for the group in vain)
            scheme.connect()
        joining.join(30)
    finally:
        scheme.shutdown()
        worker.shutdown()
    assert [str(e) for e in failed if "could not join the sender's group" in str(e)] == [str(failed[0])], failed
    assert len(lines) == 1 and lines[0] is not None and lines[0].fileno() == -1


def test_a_line_closed_by_its_writing_thread_while_a_write_checks_it_fails_that_write_as_closed():
    # The writing thread closes the line when a write it carries fails (the peer went away), while the sender's
    # thread may be in write() between its check of the line and its hand-off to that thread: the write is a
    # ConnectionClosedError, as any write to a closed line, or it went out first; never a plain RuntimeError
    # ("cannot schedule new futures after shutdown"), which got past every handler of the sender's.
    a, b = _connected()
    line = Line(a, "w", 5.0)
    line._tail = pending = Future()  # (a write still with the thread: the next is handed to it)
    line._writer = ThreadPoolExecutor(1)
    check = line._socket

    def checked_then_closed(writing=False):
        sock = check(writing)
        line._socket = check  # type: ignore[method-assign]
        closing.start()
        closing.join(0.3)  # (it waits for the write's hand-off to end: this write is not refused, but failed)
        return sock

    closing = threading.Thread(target=line.close, args=(0.0,))  # (as the thread does when its write fails)

    line._socket = checked_then_closed  # type: ignore[method-assign]
    try:
        with contextlib.suppress(ConnectionClosedError):  # (or it went out before the close: handed over first)
            line.write([b"an announcement"]).result(5)
        closing.join(5)
        assert line.fileno() == -1
    finally:
        pending.set_result(None)
        line.close(0.0)
        b.close()


def test_a_peer_that_reads_nothing_fails_the_write_in_time_and_the_line_is_done_but_ends_only_when_closed():
    # The sender closes a stalled worker's line once it said in the store that it dropped it (drop()): a worker
    # that finds the end of its line before that word would take the sender for gone, and never rejoin.
    a, b = _connected()
    writer = Line(a, "w", 0.5)
    try:
        start = time.monotonic()
        future = writer.write([bytes(64 << 20)])  # more than the kernel holds for a peer that reads nothing
        with pytest.raises(SyncTimeoutError):
            future.result(30)
        assert time.monotonic() - start < 20 and writer.fileno() == -1
        with pytest.raises(ConnectionClosedError):
            writer.write([b"more"])
        b.setblocking(False)
        with pytest.raises(BlockingIOError):  # what was sent, then nothing: no end of the line yet
            while b.recv(1 << 20):
                pass
        writer.close(0.0)
        b.settimeout(5)
        while chunk := b.recv(1 << 20):  # (what was left in flight, then the end)
            assert chunk
    finally:
        writer.close(0.0)
        b.close()


def test_a_worker_that_stops_reading_its_line_is_dropped_in_time_and_rejoins_with_the_newest_version():
    """Under real sends: a worker that reads nothing while versions pile up on its line (1 MB each, inline) holds
    the sender's buffers; its line fails within 4 x ``timeout``, the sender drops it and goes on, and the worker,
    reading again, finds itself dropped and rejoins with the newest version (not taking the sender for gone)."""
    model, replica = build("flat4"), build("flat4")
    scheme = ws.DistributedWeightSyncScheme(timeout=1.0, connect_timeout=30, sync=False, on_failure="drop")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    receiver = in_process_receiver(scheme, replica)
    try:
        started, step = time.monotonic(), 0
        while not scheme._sending.metrics.dropped and time.monotonic() - started < 30:
            step += 1
            optimizer_step(model, step)
            with contextlib.suppress(ws.SyncTimeoutError):  # (its buffers are all on the line: nothing sent)
                scheme.send()
        assert scheme._sending.metrics.dropped, "the worker was never dropped"
        assert time.monotonic() - started < 4 * 1.0 + 10
        optimizer_step(model, step + 1)
        scheme.send()  # (to no one: the worker asks to rejoin when it reads again, and is sent this version)
        deadline = time.monotonic() + 30
        while receiver.version != scheme.version and time.monotonic() < deadline:
            receiver.receive(timeout=1.0)
        assert receiver.version == scheme.version and checksum(replica) == checksum(model)
        assert scheme.stats()["rejoins"] == {0: 1}
    finally:
        receiver.shutdown()
        scheme.shutdown()


def test_a_worker_whose_line_the_sender_did_not_take_is_reached_through_its_doorbell(monkeypatch):
    monkeypatch.setattr(sender_module.Listener, "accept", lambda self, *args: {})
    model, scheme, replica = _pair()
    receiver = in_process_receiver(scheme, replica)
    try:
        transport = _transport(receiver)
        assert transport.line is None and transport.bell is not None
        _send_while_receiving(model, scheme, replica, receiver, 1)
    finally:
        receiver.shutdown()
        scheme.shutdown()


def _cut_midway(scheme):
    """The link under worker 0's line goes down in the middle of the next message on it: the announcement and half
    its bytes went out, and nothing the sender writes after reaches the worker, not even the end of the line.
    Returns what closes the line for real."""
    line = scheme._sending.engine.transports[0].line
    real_write, real_close = line.write, line.close

    def cut(chunks):
        line.write = lambda chunks: _done()
        body = memoryview(chunks[-1]).cast("B")
        return real_write([*chunks[:-1], body[: len(body) // 2]])

    line.write, line.close = cut, lambda timeout: None
    return real_close


@pytest.mark.parametrize("on_failure", ["drop", "raise"])
def test_a_worker_whose_line_stops_midway_learns_it_was_dropped_or_that_the_sender_shut_down(on_failure):
    """The link goes down in the middle of a small version on the line: the worker gives the update up after its
    timeout and hangs up, and the sender, with no ack, drops it (or raises). Nothing is announced to a worker
    without a line, on it or in the store: what it waits for is the sender's word, in the store, that it dropped
    it (it then rejoins and holds the newest version), or that it shut down (its ``receive`` raises)."""
    model = build("tiny")
    scheme = ws.DistributedWeightSyncScheme(timeout=2, connect_timeout=60, on_failure=on_failure)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    replica = build("tiny")
    receiver = in_process_receiver(scheme, replica)
    close_line = None
    seen: list = []
    gave_up = threading.Event()  # the worker gave the version cut off midway up

    def receive() -> None:
        deadline = time.monotonic() + 60
        while receiver.version != 2 and time.monotonic() < deadline:
            try:
                receiver.receive(timeout=1)
            except (SyncTimeoutError, ConnectionClosedError) as exc:  # (cut off midway: nothing applied)
                seen.append((exc, receiver.version))
                gave_up.set()
                if isinstance(exc, ConnectionClosedError):
                    return

    try:
        _send_while_receiving(model, scheme, replica, receiver, 1)
        close_line = _cut_midway(scheme)
        optimizer_step(model, 2)
        thread = threading.Thread(target=receive)
        if on_failure == "raise":  # (the worker reads what came only now: its hanging up is not seen by the send)
            with pytest.raises(ws.WeightSyncError, match="worker 0"):
                scheme.send()
            thread.start()
            gave_up.wait(30)
            store = scheme._sending.engine.store  # held: the store outlives the scheme, as a training job's does
            scheme.shutdown()
            thread.join(30)
            del store
            assert [type(exc) for exc, _ in seen] == [SyncTimeoutError, ConnectionClosedError], seen
            assert "shut down" in str(seen[-1][0]) and receiver.version == 1
            return
        thread.start()
        scheme.send()  # worker 0 is dropped: no ack came, or its line closed once it gave the update up
        thread.join(90)
        assert [(type(exc), version) for exc, version in seen] == [(SyncTimeoutError, 1)], seen
        assert receiver.version == 2 and checksum(replica) == checksum(model)
        assert scheme.stats()["rejoins"] == {0: 1} and scheme.stats()["dropped_workers"] == {}
        _send_while_receiving(model, scheme, replica, receiver, 3)  # reached as before
    finally:
        if close_line is not None:
            close_line(0.0)
        receiver.shutdown()
        scheme.shutdown()


def test_a_sender_on_a_job_store_that_stopped_drops_a_worker_within_its_bound():
    """The job's store stops (a debugger) before the sender drops a worker that did not ack: the sender writes its
    word that it dropped the worker there (torch's set waits for no answer) and makes no call that would wait for
    the store, so ``wait_async`` ends at the timeout, not once the store resumes."""
    import signal

    from tests._workers import store_in_a_child

    server, port = store_in_a_child()
    model = build("tiny")
    scheme = ws.DistributedWeightSyncScheme(
        master_addr="127.0.0.1", master_port=port, timeout=1.0, connect_timeout=30, sync=False, on_failure="drop"
    )
    receiver = None
    try:
        scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
        replica = build("tiny")
        receiver = in_process_receiver(scheme, replica)
        _send_while_receiving(model, scheme, replica, receiver, 1)
        optimizer_step(model, 2)
        scheme.send_async()  # not received: no ack, the worker is dropped after the timeout
        stop_process(server.pid)
        began = time.monotonic()
        scheme.wait_async()
        took = time.monotonic() - began
        os.kill(server.pid, signal.SIGCONT)
        assert list(scheme.stats()["dropped_workers"]) == [0]
        assert took < 10.0, f"wait_async took {took:.1f}s"  # (the timeout is 1 s; held by the store, until it resumed)
    finally:
        os.kill(server.pid, signal.SIGCONT)
        if receiver is not None:
            receiver.shutdown()
        scheme.shutdown()
        server.kill()
        server.wait(10)


@pytest.mark.parametrize("latest_wins", [True, False])
def test_versions_read_whole_before_a_line_end_the_store_leaves_unanswered_are_applied(monkeypatch, latest_wins):
    """Two versions wait whole on the line, then it ends with no last word on it, and the store does not answer
    whether the sender dropped the worker (a sender stopped): the versions read whole are applied (the newest of
    them, or each in turn), and the receives after wait for the sender's word, with nothing worse than a
    ``SyncTimeoutError`` (never a sender taken for gone)."""
    from weightsync.transports.storeclient import Unanswered

    def silent_store(self):  # (what StoreCalls.ask raises when the store does not answer)
        raise Unanswered("the store did not answer (a stand-in for a stopped sender's)")

    model = build("tiny")
    scheme = ws.DistributedWeightSyncScheme(timeout=20, connect_timeout=60, sync=False, latest_wins=latest_wins)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    replica = build("tiny")
    receiver = in_process_receiver(scheme, replica)
    try:
        _send_while_receiving(model, scheme, replica, receiver, 1)
        for step in (2, 3):
            optimizer_step(model, step)
            scheme.send_async()
        scheme._sending.engine.transports[0].line.close(0.0)  # (the line's end, no last word on it)
        monkeypatch.setattr(type(_transport(receiver)), "_said_dropped", silent_store)
        applied, errors = [], []
        for _ in range(4):
            try:
                if receiver.receive(timeout=1) is not None:
                    applied.append(receiver.version)
            except SyncTimeoutError as exc:
                errors.append(exc)
        assert applied == ([3] if latest_wins else [2, 3]) and checksum(replica) == checksum(model)
        assert all("did not answer" in str(e) for e in errors), errors
    finally:
        monkeypatch.undo()
        receiver.shutdown()
        scheme.shutdown()


def test_a_worker_whose_line_was_ended_while_its_store_was_silent_hears_its_sender_went_away_once_it_answers(
    monkeypatch,
):
    """The sender's end of a worker's line is read with no word on it (a sender killed, its store the job's),
    and the store does not answer at that moment: the worker waits (a sender stopped). Once the store answers
    without the sender's word that it dropped the worker or shut down (which a sender alive writes before it
    ends a line), the worker hears its sender went away (``ConnectionClosedError``, which ends its loop), rather
    than returning nothing for good."""
    from weightsync.transports.distributed.worker_side import WorkerSide
    from weightsync.transports.storeclient import Unanswered

    model, scheme, replica = _pair()
    receiver = in_process_receiver(scheme, replica)
    silent = [True]
    said_dropped = WorkerSide._said_dropped

    def slow_once(self):  # (the store does not answer the first look: what StoreCalls.ask raises then)
        if silent and silent.pop():
            raise Unanswered("the store did not answer (a stand-in for a slow one)")
        return said_dropped(self)

    try:
        _send_while_receiving(model, scheme, replica, receiver, 1)
        scheme._sending.engine.transports[0].line.close(0.0)  # (the line's end, no word on it or in the store)
        monkeypatch.setattr(type(_transport(receiver)), "_said_dropped", slow_once)
        with pytest.raises(SyncTimeoutError, match="did not answer"):
            receiver.receive(timeout=1)
        began = time.monotonic()
        with pytest.raises(ConnectionClosedError, match="went away"):
            while time.monotonic() - began < 10:
                assert receiver.receive(timeout=0.5) is None
        assert time.monotonic() - began < 5.0 and receiver.version == 1
    finally:
        monkeypatch.undo()
        receiver.shutdown()
        scheme.shutdown()


def test_only_bytes_in_host_memory_travel_on_a_line():
    # (staging buffers are on the GPU under NCCL: their bytes go over the group, announced on the line)
    assert sender_module.on_a_line(torch.device("cpu"))
    assert not sender_module.on_a_line(torch.device("cuda", 0))
    assert not sender_module.on_a_line(torch.device("meta"))


def _dialing(server: socket.socket, deadline_s: float = 10.0) -> Dialing:
    return Dialing(server.getsockname(), KEY, PREFIX, 1, deadline_after(deadline_s), lambda s: Line(s, "d", 5.0))


def test_a_dialling_worker_answers_the_challenge_and_keeps_the_line_only_if_the_sender_took_it():
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(10)
        for taken in (True, False):
            dialing = _dialing(server)
            peer, _ = server.accept()
            with peer:
                peer.settimeout(10)
                nonce = b"n" * NONCE_BYTES
                peer.sendall(nonce)
                answer = b""
                while len(answer) < 40:
                    answer += peer.recv(40 - len(answer))
                assert answer == (1).to_bytes(8, "big") + line_proof(KEY, PREFIX, 1, nonce)
                line = dialing.line(taken)
                assert (line is not None) is taken
                if line is not None:  # the line carries what comes next
                    peer.sendall(b"hi")
                    assert line.read(2, deadline_after(5)) == b"hi"
                    line.close(0.0)
                assert peer.recv(1) == b""  # closed, either way, once done with


def test_a_dialling_worker_gives_up_at_once_when_no_challenge_comes():
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(10)
        dialing = _dialing(server, deadline_s=60)
        peer, _ = server.accept()
        with peer:
            peer.settimeout(10)
            start = time.monotonic()
            assert dialing.line(True) is None  # the verdict named it, but it never answered a challenge
            assert time.monotonic() - start < 2 * ANSWERED_WAIT_S + 1  # (for the answer, then the thread's end)
            assert peer.recv(1) == b""
            start = time.monotonic()
            dialing = _dialing(server, deadline_s=60)
            other, _ = server.accept()
            with other:
                dialing.cancel()  # the rendez-vous failed: the thread waiting for a challenge ends now
                assert time.monotonic() - start < 2.0
                other.settimeout(10)
                assert other.recv(1) == b""


@pytest.mark.parametrize("how", ["end", "reset"])
def test_a_line_ended_by_its_peer_says_so_apart_from_one_that_went_silent(how):
    """A line whose peer ended it (its end, or a reset) raises ``PeerClosed``: its peer's host was there to end it,
    which a worker tells apart from a silence (a host that vanished)."""
    import struct

    from weightsync.transports.distributed.line import PeerClosed

    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname(), timeout=5)
        b, _ = server.accept()
    reader = Line(b, "r", 5.0)
    if how == "reset":
        a.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # (a close sends a reset)
    a.close()
    try:
        assert reader.readable(5.0)
        with pytest.raises(PeerClosed):
            reader.frame(deadline_after(5.0), 1024)
    finally:
        reader.close(0.0)


def test_a_write_that_meets_its_peers_end_leaves_what_the_peer_sent_before_to_be_read():
    """A peer that wrote a frame and closed its end (a sender's last word, then its close): the first write after
    is answered with a reset, the next fails (``PeerClosed``), and so does every write after it, at once; the
    frame is still read whole, then the end (``PeerClosed``), which closes the line."""
    from weightsync.transports.distributed.line import FRAME, PeerClosed

    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname(), timeout=5)
        b, _ = server.accept()
    line = Line(b, "w", 5.0)
    a.sendall(FRAME.pack(9) + b"last word")
    a.close()
    try:
        line.send(b"an ack", 5.0)  # (it goes out: the reset comes back after it)
        reset = select.poll()
        reset.register(b, 0)  # (only an error or a hang-up wakes it: the reset)
        assert reset.poll(5000), "no reset came back"
        with pytest.raises(PeerClosed):
            line.send(b"an ack", 5.0)
        with pytest.raises(PeerClosed):
            line.send(b"another", 5.0)
        assert line.frame(deadline_after(5.0), 1024) == b"last word"
        with pytest.raises(PeerClosed):
            line.frame(deadline_after(5.0), 1024)
        assert line.fileno() == -1
    finally:
        line.close(0.0)


@pytest.mark.parametrize("latest_wins", [True, False])
def test_a_worker_that_applies_versions_its_sender_dropped_it_over_loses_only_their_acks(latest_wins):
    """Two versions waited on a worker's line when the sender dropped it (no ack in time) and closed the line.
    The worker applies them (the newest of both, acking each message; or each in turn, ``latest_wins=False``):
    the sender's kernel answers the first ack with a reset, and the second ack's write fails. What was applied
    stays applied (the acks are lost: the sender dropped the worker), the worker's loop is not ended by a sender
    taken for gone, and the worker learns it was dropped and rejoins with the newest version."""
    model = build("tiny")
    scheme = ws.DistributedWeightSyncScheme(
        timeout=1.0, connect_timeout=60, sync=False, on_failure="drop", latest_wins=latest_wins
    )
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    replica = build("tiny")
    receiver = in_process_receiver(scheme, replica)
    try:
        _send_while_receiving(model, scheme, replica, receiver, 1)
        for step in (2, 3):  # on the line, not read
            optimizer_step(model, step)
            scheme.send_async()
        with contextlib.suppress(ws.WeightSyncError):
            scheme.wait_async()
        assert list(scheme.stats()["dropped_workers"]) == [0]
        applied = []
        deadline = time.monotonic() + 30
        while scheme.stats()["rejoins"] != {0: 1} or receiver.version != 3:
            assert time.monotonic() < deadline, (applied, receiver.version, scheme.stats()["rejoins"])
            with contextlib.suppress(SyncTimeoutError):
                if receiver.receive(timeout=0.5) is not None:
                    applied.append(receiver.version)
        assert applied[: 1 if latest_wins else 2] == ([3] if latest_wins else [2, 3])
        assert checksum(replica) == checksum(model)
        optimizer_step(model, 4)
        _send_while_receiving(model, scheme, replica, receiver, 4)
    finally:
        receiver.shutdown()
        scheme.shutdown()


def test_a_line_its_peer_ends_in_the_middle_of_a_versions_bytes_asks_the_store_as_a_sender_stopped(monkeypatch):
    """The sender ends a worker's line in the middle of a version's bytes (it dropped the worker while versions
    piled up on the line): its host was there to end it, so a store that then does not answer whether it dropped
    the worker is a sender stopped (``SyncTimeoutError``, which the worker's loop retries), not a sender gone
    (``ConnectionClosedError``, which ends it). Nothing of the version is applied."""
    from weightsync.transports.storeclient import Unanswered

    model, scheme, replica = _pair()
    receiver = in_process_receiver(scheme, replica)
    asked: list[str] = []

    def silent_store(self):  # (what StoreCalls.ask raises when the store does not answer)
        asked.append("dropped?")
        raise Unanswered("the store did not answer (a stand-in for a stopped sender's)")

    try:
        _send_while_receiving(model, scheme, replica, receiver, 1)
        close_line = _cut_midway(scheme)
        optimizer_step(model, 2)
        scheme.send_async()
        close_line(0.0)  # after the announcement and half the bytes: the line's end
        monkeypatch.setattr(type(_transport(receiver)), "_said_dropped", silent_store)
        with pytest.raises(SyncTimeoutError, match="did not answer"):
            receiver.receive(timeout=10)
        assert asked == ["dropped?"] and receiver.version == 1
    finally:
        monkeypatch.undo()
        receiver.shutdown()
        scheme.shutdown()


def _word_held(monkeypatch, release_after: float | None = None, answer_s: float = 0.0):
    """The sender's word that it dropped a worker (``dropped/<w>``, which it sets in the store before it ends the
    line) lands only ``release_after`` s after the worker's first look past its line's end (``None``: never); the
    worker's looks at it take ``answer_s`` each, after the store answered. Returns the words held and the looks made
    past the end: (seconds after the end, what the store said)."""
    from weightsync.transports.distributed import transport as transport_module
    from weightsync.transports.distributed.worker_side import WorkerSide

    held: list = []
    looks: list[tuple[float, bool]] = []
    store_set, said_dropped = transport_module.store_set, WorkerSide._said_dropped

    def set_late(store, key, value):
        if key.startswith("dropped/"):
            held.append((store, key, value))
        else:
            store_set(store, key, value)

    def release():
        while held:
            store_set(*held.pop())

    def look(self):
        said = said_dropped(self)
        if self.line is None and self.line_ended is not None:  # (past its line's end)
            if not looks and release_after is not None:
                threading.Timer(release_after, release).start()
            looks.append((time.monotonic() - self.line_ended, said))
            time.sleep(answer_s)
        return said

    monkeypatch.setattr(transport_module, "store_set", set_late)
    monkeypatch.setattr(WorkerSide, "_said_dropped", look)
    return held, looks


def _dropped_with_its_line_ended(model, scheme, monkeypatch, ended: str):
    """Send versions the worker does not read until the sender drops it, its line ended ``ended``: after version 2
    whole, with no word on it (what a line cannot carry is discarded); in the middle of version 2's bytes; or in
    the middle of version 3's, after version 2 whole (``latest_wins=True`` reads both into one buffer)."""
    close_line = None
    if ended == "between versions":
        monkeypatch.setattr(scheme._sending.engine.transports[0], "_last_word", lambda msg: None)
    for step in (2, 3) if ended == "in a later version's bytes" else (2,):
        if step == 3 or ended == "in a version's bytes":
            close_line = _cut_midway(scheme)
        optimizer_step(model, step)
        scheme.send_async()
    with contextlib.suppress(ws.WeightSyncError):
        scheme.wait_async()
    assert list(scheme.stats()["dropped_workers"]) == [0], "the sender did not drop the worker"
    if close_line is not None:
        close_line(0.0)


@pytest.mark.parametrize("ended", ["between versions", "in a version's bytes", "in a later version's bytes"])
def test_a_worker_whose_senders_word_that_it_dropped_it_lands_after_the_lines_end_rejoins(monkeypatch, ended):
    """The sender drops a worker (no ack in time) and ends its line without its word on it, and its word in the
    store (set first, but torch's set waits for no answer) lands 0.6 s after the worker's first look past the
    line's end, as from a store on another host. The worker, its line ended between two versions or in the middle
    of one's bytes (what it read whole before into the same buffer, ``latest_wins=True``, is lost with them), looks
    on for ``WORD_LATE_S``, each ``receive(timeout=0.1)`` within its bound, finds the word and rejoins with the
    newest version, rather than taking a live sender for gone (``ConnectionClosedError``: its loop would end)."""
    from weightsync.transports.distributed.worker_side import ANSWER_S

    model = build("tiny")
    options = {"timeout": 1.0, "connect_timeout": 60, "sync": False, "on_failure": "drop"}
    scheme = ws.DistributedWeightSyncScheme(**options, latest_wins=ended == "in a later version's bytes")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    replica = build("tiny")
    receiver = in_process_receiver(scheme, replica)
    try:
        _send_while_receiving(model, scheme, replica, receiver, 1)
        held, looks = _word_held(monkeypatch, release_after=0.6, answer_s=0.2)  # (each look 0.2 s: another host)
        _dropped_with_its_line_ended(model, scheme, monkeypatch, ended)
        assert held, "the sender wrote no word"
        took, deadline = [], time.monotonic() + 30
        while scheme.stats()["rejoins"] != {0: 1} or receiver.version != scheme.version:
            assert time.monotonic() < deadline, (receiver.version, scheme.stats()["rejoins"], looks)
            began = time.monotonic()
            receiver.receive(timeout=0.1)
            if not scheme.stats()["rejoins"]:
                took.append(time.monotonic() - began)
        assert looks[0][1] is False and looks[-1][1] is True and looks[-1][0] > 0.5, looks
        assert len(took) >= 3 and max(took) < 0.1 + ANSWER_S + 0.2, took  # (each receive within its bound)
        assert checksum(replica) == checksum(model)
        monkeypatch.undo()
        _send_while_receiving(model, scheme, replica, receiver, scheme.version + 1)  # reached as before
    finally:
        monkeypatch.undo()
        receiver.shutdown()
        scheme.shutdown()


def test_a_look_for_the_senders_word_made_in_its_grace_decides_nothing_however_late_its_answer():
    """The worker's first look for its sender's word past its line's end is made at once, when the store holds no
    word yet; the word lands 0.3 s later, and that look's answer comes 1.7 s after it (past ``WORD_LATE_S``). The
    worker does not take its sender for gone on that answer: it looks again, finds the word and rejoins."""
    model = build("tiny")
    scheme = ws.DistributedWeightSyncScheme(timeout=1.0, connect_timeout=60, sync=False, on_failure="drop")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    replica = build("tiny")
    receiver = in_process_receiver(scheme, replica)
    with pytest.MonkeyPatch.context() as monkeypatch:
        try:
            _send_while_receiving(model, scheme, replica, receiver, 1)
            _, looks = _word_held(monkeypatch, release_after=0.3)
            _dropped_with_its_line_ended(model, scheme, monkeypatch, "between versions")
            from weightsync.transports.distributed.worker_side import WorkerSide

            said_dropped = WorkerSide._said_dropped

            def slow_second(self):  # (the first look is was_dropped's; the second, the last word's, answers late)
                said = said_dropped(self)
                if len(looks) == 2:
                    time.sleep(1.7)
                return said

            monkeypatch.setattr(WorkerSide, "_said_dropped", slow_second)
            deadline = time.monotonic() + 30
            while scheme.stats()["rejoins"] != {0: 1} or receiver.version != 2:
                assert time.monotonic() < deadline, (receiver.version, looks)
                receiver.receive(timeout=0.5)
            assert [said for _, said in looks[:2]] == [False, False] and looks[-1][1] is True, looks
        finally:
            monkeypatch.undo()
            receiver.shutdown()
            scheme.shutdown()


@pytest.mark.parametrize("answer_s", [0.2, 0.6])
def test_a_receive_that_meets_its_lines_end_stays_within_its_bound_on_a_slow_store(monkeypatch, answer_s):
    """A line ended with no word (a sender killed, its store the job's), the store answering each look in 0.2 s,
    or 0.6 s (past ``ANSWER_S``: a receive then says it did not answer, ``SyncTimeoutError``): each
    ``receive(timeout=0.05)`` returns within its bound plus one look (``ANSWER_S``), none asking twice past its
    own timeout, and the worker hears its sender went away once ``WORD_LATE_S`` passed."""
    from weightsync.transports.distributed.worker_side import ANSWER_S, WORD_LATE_S

    model, scheme, replica = _pair()
    receiver = in_process_receiver(scheme, replica)
    try:
        _send_while_receiving(model, scheme, replica, receiver, 1)
        scheme._sending.engine.transports[0].line.close(0.0)  # (the line's end, no word on it or in the store)
        _word_held(monkeypatch, answer_s=answer_s)
        took, began = [], time.monotonic()
        with pytest.raises(ConnectionClosedError, match="went away"):
            while time.monotonic() - began < 20:
                start = time.monotonic()
                try:
                    assert receiver.receive(timeout=0.05) is None
                except SyncTimeoutError:
                    assert answer_s > ANSWER_S  # (a look unanswered in its bound)
                finally:
                    took.append(time.monotonic() - start)
        assert max(took) < 0.05 + ANSWER_S + 0.1, took
        assert WORD_LATE_S <= time.monotonic() - began < WORD_LATE_S + 5, took
    finally:
        monkeypatch.undo()
        receiver.shutdown()
        scheme.shutdown()


@pytest.mark.parametrize("end", ["killed", "shut down"])
@pytest.mark.parametrize("latest_wins", [False, True])
def test_a_worker_whose_acks_its_ended_senders_line_cannot_carry_keeps_its_versions_and_hears_how_it_ended(
    ctx, latest_wins, end
):
    """A sender killed (``SIGKILL``), or shut down, while two versions wait on its worker's line, its store served
    by the job (it outlives the sender, and answers): the worker applies them (each in turn, or the newest of both,
    ``latest_wins=True``, whose look for a third meets the line's end), the acks' writes fail, and the store does
    not say the worker was dropped. The worker holds the last version sent, and hears that its sender went away
    (its word ``WORD_LATE_S`` late), or shut down (``ConnectionClosedError``, which ends its loop), rather than
    waiting for good for a word that no one will write."""
    import signal

    from tests._workers import ask, commanded_trainer, worker_of

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cmd, child = ctx.Pipe()
    options = {"master_addr": "127.0.0.1", "master_port": store.port, "timeout": 2.0, "sync": False}
    sender = ctx.Process(
        target=commanded_trainer, args=(child,), kwargs={**options, "latest_wins": latest_wins}, daemon=True
    )
    sender.start()
    worker = None
    try:
        worker = worker_of(cmd, build("tiny"))
        assert ask(cmd, ("leave", 2))[:2] == (3, [])  # (two versions wait on the line, unread)
        if end == "killed":
            os.kill(sender.pid, signal.SIGKILL)
        else:
            cmd.send("shut down")
            assert cmd.poll(60) and cmd.recv() == "down", "the sender did not shut down"
        sender.join(10)
        began, applied = time.monotonic(), []
        with pytest.raises(ConnectionClosedError, match="the sender went away" if end == "killed" else "shut down"):
            while time.monotonic() - began < 15:
                if worker.receive(timeout=0.5) is not None:
                    applied.append(worker.version)
        assert time.monotonic() - began < 5.0
        assert applied == ([3] if latest_wins else [2, 3]) and worker.version == 3
    finally:
        if sender.is_alive():
            sender.kill()
            sender.join(5)
        if worker is not None:
            worker.shutdown()
        cmd.close()
        child.close()
