"""Issue 31, findings 4 and 5 on the local channel: nothing a peer sends holds the trainer or kills its threads.

A stranger (another user of the host, run through ``tests/_as_stranger.py``) finds the trainer's abstract
socket in /proc/net/unix and keeps opening connections that send half a frame and hold on: the trainer's
``connect()`` and a restarted worker's rejoin go on at their own pace meanwhile, each stranger is dropped at
its handshake deadline, and ``shutdown()`` ends the rejoin thread within its bound. A key holder's garbage
(in this process: holding the key is not a stranger's position) ends in a weightsync error for that peer
alone, and the trainer serves the next.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import threading
import time

import pytest
import torch

import weightsync as ws
from tests._as_stranger import needs_stranger, start_stranger
from tests._attack_local import closed_by_peer, key_holder
from tests._bodies import optimizer_step
from tests._workers import build, checksum, serve
from weightsync.core.timing import deadline_after, wait_until
from weightsync.transports.keyfiles import read_key_file
from weightsync.transports.local.channel import HANDSHAKE_TIMEOUT, MAX_MESSAGE
from weightsync.transports.local.sender import REJOIN_POLL_S

SCHEMES = {
    "multiprocess": ws.MultiProcessWeightSyncScheme,
    "shared_mem": ws.SharedMemWeightSyncScheme,
}
#: How late past its deadline a stalled peer may be dropped (the machine is shared and busy).
SLACK_S = 2.0
#: How long shutdown() may take to end the rejoin thread: one poll of the listener, one look at the lock.
SHUTDOWN_BOUND_S = REJOIN_POLL_S + 0.1 + 1.0


def _admitters(others: set[threading.Thread] = frozenset()) -> list[threading.Thread]:
    """The live rejoin threads of model 'policy', but ``others`` (those that were there before this test's scheme:
    another test's, judged by that test's own leak check)."""
    return [
        t for t in threading.enumerate() if t.name == "weightsync-policy-admitter" and t.is_alive() and t not in others
    ]


def _stranger_holding(every: float = 0.5):
    """The stranger, opening a half-frame connection every ``every`` s until told to stop (at most a minute);
    returns once one holds."""
    argv = ["-m", "tests._attack_local", "hold", str(os.getpid()), "60", str(every)]
    proc = start_stranger(argv, stdin=subprocess.PIPE)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    if line.strip() != "holding":
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
        pytest.fail(f"the stranger did not get to hold a connection: {line}{out}")
    return proc


def _end(proc) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)


def _report(proc, timeout: float = HANDSHAKE_TIMEOUT + 30) -> list[dict]:
    """Tell the stranger to stop opening connections; once the trainer dropped them all, its account of each:
    the monotonic times it was opened, taken by the trainer, dropped."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def _held_across(report: list[dict], moment: float) -> list[dict]:
    """The stranger's connections the trainer had taken, and still held half-read, at ``moment``."""
    return [c for c in report if c["taken"] < moment < c["dropped"]]


def _dropped_in_time(report: list[dict], shutdown: float) -> list[dict]:
    """Check that the trainer dropped every connection it took: at its handshake deadline, or at ``shutdown``;
    returns those dropped at their deadline."""
    assert report and all(c["dropped"] is not None for c in report), report
    at_deadline = []
    for c in report:
        held = c["dropped"] - c["taken"]
        assert held <= HANDSHAKE_TIMEOUT + SLACK_S, (held, c)
        if c["dropped"] < shutdown:
            assert held >= HANDSHAKE_TIMEOUT - 0.05, (held, c)
            at_deadline.append(c)
    return at_deadline


def _rejoin(workers, scheme, w):
    group = workers(serve, 1, lambda i, conn: ({"policy": scheme}, w, {"policy": "tiny"}, conn))
    return group, group.recv(0)


@needs_stranger
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_a_strangers_half_frames_do_not_hold_connect(workers, name):
    """Finding 4: the stranger holds half frames open while the real workers connect. connect() returns in its
    own time, while those are still held, and each is dropped at its handshake deadline."""
    model = build("tiny")
    scheme = SCHEMES[name](timeout=20, connect_timeout=30)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group = workers(serve, 2, lambda i, conn: ({"policy": scheme}, i, {"policy": "tiny"}, conn))
    # The stranger comes once the workers started: what it opens waits in the backlog until connect() takes it.
    # Starting them can take long (the first in a test process starts the forkserver, 17 s on a loaded host, seen):
    # the backlog then grew past MAX_PENDING, and connect() dropped the oldest at once, not at their deadlines.
    stranger = _stranger_holding()
    try:
        started = time.monotonic()
        scheme.connect()
        connected = time.monotonic()
        ready = [group.recv(i) for i in range(2)]
        assert [errors for _, _, errors in ready] == [{}, {}]
        assert [log for _, log, _ in ready] == [[("policy", 0, checksum(model))]] * 2
        optimizer_step(model, 1)
        scheme.send()  # served while the stranger keeps opening and holding connections
        assert [group.ask(i, "state")["policy"] for i in range(2)] == [(1, checksum(model))] * 2
        report = _report(stranger)  # the trainer drops what it still holds at the deadlines, and serves on
        closing = time.monotonic()
    finally:
        _end(stranger)
        scheme.shutdown()
    at_deadline = _dropped_in_time(report, closing)
    held = _held_across(report, connected)
    print(f"connect() took {connected - started:.2f}s while the stranger held {len(held)} half frames")
    assert connected - started < HANDSHAKE_TIMEOUT
    assert held, report  # connect() returned while the stranger still held what it had sent
    assert {c["mode"] for c in at_deadline} == {"header_byte", "partial_body"}, report
    group.stop()


@needs_stranger
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_a_strangers_half_frames_do_not_hold_the_rejoin_thread(workers, name):
    """Finding 4 after the rendez-vous: while the stranger holds half frames open against the rejoin thread, a
    restarted worker rejoins and gets the newest version; shutdown() ends the thread within its bound and
    drops what the stranger still holds."""
    model = build("tiny")
    others = set(_admitters())
    scheme = SCHEMES[name](timeout=20, connect_timeout=30, on_failure="drop")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group = workers(serve, 2, lambda i, conn: ({"policy": scheme}, i, {"policy": "tiny"}, conn))
    stranger = None
    try:
        scheme.connect()
        assert all(errors == {} for _, _, errors in (group.recv(i) for i in range(2)))
        stranger = _stranger_holding()
        # The rejoin thread takes a connection within REJOIN_POLL_S: wait (bounded) until it took the first.
        took = wait_until(lambda: scheme._sending.engine.listener.pending > 0, deadline_after(10), 0.01)
        assert took, "the rejoin thread took no connection"
        os.kill(group.procs[1].pid, signal.SIGKILL)
        group.procs[1].join(10)
        optimizer_step(model, 1)
        scheme.send()  # worker 1 is found dead and dropped
        assert list(scheme.stats()["dropped_workers"]) == [1]
        started = time.monotonic()
        again, (_, log, errors) = _rejoin(workers, scheme, 1)
        rejoined = time.monotonic()
        assert errors == {} and log == [("policy", 1, checksum(model))]
        assert scheme.stats()["rejoins"] == {1: 1}
        stranger.stdin.write("stop\n")  # no more connections: the trainer is about to go
        stranger.stdin.flush()
        closing = time.monotonic()
        scheme.shutdown()
        shut = time.monotonic()
        assert not _admitters(others)
        report = _report(stranger)
    finally:
        _end(stranger)
        scheme.shutdown()
    _dropped_in_time(report, closing)
    held = _held_across(report, rejoined)
    print(f"rejoin took {rejoined - started:.2f}s while the stranger held {len(held)} half frames; shutdown() "
          f"took {shut - closing:.2f}s")  # fmt: skip
    assert [c for c in held if c["taken"] < started], report  # the rejoin did not wait for them
    assert shut - closing < SHUTDOWN_BOUND_S
    again.stop()
    group.stop()


def _hello(**fields) -> bytes:
    hello = {"op": "hello", "worker_idx": 1, "pid": 1, "model_id": "policy", "device": None, "nonce": "ab" * 32}
    return json.dumps({**hello, **fields}).encode()


GARBAGE_HELLOS = {
    "nonce_int": _hello(nonce=123),
    "nonce_not_hex": _hello(nonce="zz" * 32),
    "deep": b'{"op":"hello","x":' + b"[" * 2000 + b"]" * 2000 + b"}",
    "long_int": b'{"op":"hello","pid":' + b"9" * 3000 + b"}",
    "too_long": _hello(pad="x" * 5000),
    "not_an_object": b"[1, 2]",
    "not_json": b"\xff\xfe",
    "pid_str": _hello(pid="1"),
    "worker_idx_str": _hello(worker_idx="1"),
    "worker_idx_bool": _hello(worker_idx=True),
    "device_int": _hello(device=5),
    "model_id_list": _hello(model_id=["policy"]),
}


def _framed(msg: dict) -> bytes:
    data = json.dumps(msg).encode()
    return struct.pack("!i", len(data)) + data


_DEEP = b'{"op":"ack","version":' + b"[" * 5000 + b"]" * 5000 + b"}"
GARBAGE_AFTER_HANDSHAKE = {
    "huge_length": struct.pack("!i", -1) + struct.pack("!Q", 2**62),  # -1, then a 2**62-byte length
    "deep_ack": struct.pack("!i", len(_DEEP)) + _DEEP,
    "ack_version_str": _framed({"op": "ack", "version": "x"}),
    "ack_error_list": _framed({"op": "ack", "version": 0, "held": 0, "error": [1]}),
    "ack_held_float": _framed({"op": "ack", "version": 0, "held": 0.5}),
    "unknown_op": _framed({"op": "nope"}),
}
EXPECTED_AFTER_HANDSHAKE = {
    "huge_length": f"{2**62} bytes (at most {MAX_MESSAGE})",
    "deep_ack": "nests deeper than",
    "ack_version_str": "sent a malformed message",
    "ack_error_list": "sent a malformed message",
    "ack_held_float": "sent a malformed message",
    "unknown_op": "sent a malformed message",
}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_a_key_holders_garbage_is_refused_and_the_trainer_serves_on(workers, name):
    """Finding 5, local channel: a hello whose fields have the wrong types, deep or long JSON; after the
    handshake a length header of -1 then 2**62, deep JSON, or acks of the wrong types: each ends in a weightsync
    error for that peer alone: the rejoin thread lives on, the trainer's send() drops the liar, and a real
    restarted worker rejoins."""
    model = build("tiny")
    others = set(_admitters())
    scheme = SCHEMES[name](timeout=20, connect_timeout=30, on_failure="drop")
    scheme.init_on_sender(model_id="policy", model=model, num_workers=2)
    group = workers(serve, 2, lambda i, conn: ({"policy": scheme}, i, {"policy": "tiny"}, conn))
    scheme.connect()
    assert all(errors == {} for _, _, errors in (group.recv(i) for i in range(2)))
    connection = scheme.receiver_config(1)["connection"]
    address, key = connection["address"], bytes.fromhex(read_key_file(connection["authkey_file"]))
    os.kill(group.procs[1].pid, signal.SIGKILL)
    group.procs[1].join(10)
    optimizer_step(model, 1)
    scheme.send()  # worker 1 is dropped: its index is free to rejoin
    for what, hello in GARBAGE_HELLOS.items():
        with key_holder(address, key, hello) as sock:
            assert closed_by_peer(sock), what
        assert _admitters(others), f"the rejoin thread died of {what}"
    assert scheme.stats()["rejoins"] == {}

    # A key holder that passes the handshake as worker 1 (and is welcomed as it), then sends garbage.
    for step, (what, garbage) in enumerate(GARBAGE_AFTER_HANDSHAKE.items(), start=2):
        with key_holder(address, key, _hello(pid=os.getpid())) as liar:
            welcomed = wait_until(
                lambda expected={1: step - 1}: scheme.stats()["rejoins"] == expected, deadline_after(10), 0.01
            )
            assert welcomed, scheme.stats()
            liar.sendall(garbage)
            optimizer_step(model, step)
            scheme.send()  # reads the liar's frame: refused, the liar dropped, worker 0 served
            dropped = scheme.stats()["dropped_workers"]
            assert list(dropped) == [1] and EXPECTED_AFTER_HANDSHAKE[what] in dropped[1], dropped
            assert closed_by_peer(liar)
        assert group.ask(0, "state")["policy"] == (step, checksum(model))
        assert _admitters(others)

    again, (_, log, errors) = _rejoin(workers, scheme, 1)
    assert errors == {} and log == [("policy", step, checksum(model))]
    scheme.shutdown()
    again.stop()
    group.stop()


def test_a_silent_peer_in_process_is_dropped_at_its_deadline_without_delaying_others():
    """The listener alone (no stranger needed to show the state machine): one peer sends a byte and holds, a
    second does the whole handshake: the second is accepted at once, the first dropped at its deadline."""
    from weightsync.transports.local.channel import ChannelListener, connect_channel

    key = os.urandom(32)
    listener = ChannelListener(key)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect("\0" + listener.address[1:])
    silent.sendall(b"\x00")
    try:
        assert listener.accept(0.2) is None and listener.pending == 1
        result: list = []
        worker = threading.Thread(target=lambda: result.append(connect_channel(listener.address, key, {}, 10)))
        worker.start()
        started = time.monotonic()
        accepted = listener.accept(10)
        assert accepted is not None and time.monotonic() - started < 2.0
        worker.join(10)
        assert result and listener.pending == 1
        accepted[0].close()
        result[0].close()
        silent.settimeout(HANDSHAKE_TIMEOUT + SLACK_S)
        while listener.pending:
            assert listener.accept(0.1) is None
            assert time.monotonic() - started < HANDSHAKE_TIMEOUT + SLACK_S
        assert closed_by_peer(silent)
    finally:
        silent.close()
        listener.close()


def test_a_worker_is_not_held_by_a_listener_that_sends_half_a_challenge():
    """The worker's side of the handshake is bounded as a whole too: a listener (a stranger that bound the
    address first, say) that sends half a frame and holds costs connect_channel its timeout, not more."""
    from weightsync.transports.local.channel import connect_channel

    address = f"@weightsync-test-{os.getpid()}-{os.urandom(4).hex()}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind("\0" + address[1:])
    server.listen(1)
    taken: list[socket.socket] = []

    def half_challenge():
        conn, _ = server.accept()
        conn.sendall(struct.pack("!i", 32) + b"x" * 5)
        taken.append(conn)

    helper = threading.Thread(target=half_challenge)
    helper.start()
    try:
        started = time.monotonic()
        with pytest.raises(ws.SyncTimeoutError, match="did not send a whole frame"):
            connect_channel(address, os.urandom(32), {}, 1.0)
        assert time.monotonic() - started < 1.0 + SLACK_S
    finally:
        helper.join(10)
        for conn in taken:
            conn.close()
        server.close()


def test_the_rejoin_thread_outlives_what_a_peer_makes_poll_and_admit_raise():
    """Threads that parse outside input never die of it: whatever poll() or admit() raise for one peer, the
    admitter logs it and serves the next; stop() ends it within its bound."""
    from weightsync.core.rejoin import LOCK_POLL_S, Admitter

    script = iter([ValueError("a peer's bytes"), "first", RecursionError("deep"), "second"])
    admitted: list[str] = []
    done = threading.Event()

    def poll():
        step = next(script, None)
        if step is None:
            done.wait(REJOIN_POLL_S)
            return None
        if isinstance(step, Exception):
            raise step
        return step

    def admit(candidate):
        admitted.append(candidate)
        if candidate == "first":
            raise TypeError("a field of the wrong type")
        done.set()

    admitter = Admitter("weightsync-test-admitter", threading.RLock(), poll, admit, lambda candidate: None)
    assert done.wait(10), admitted
    assert admitted == ["first", "second"]
    started = time.monotonic()
    admitter.stop(5)
    assert time.monotonic() - started < REJOIN_POLL_S + LOCK_POLL_S + SLACK_S
    assert not [t for t in threading.enumerate() if t.name == "weightsync-test-admitter"]


def test_the_listener_holds_at_most_max_pending_handshakes():
    """A flood of silent peers costs a bounded number of descriptors: past MAX_PENDING the oldest is dropped."""
    from weightsync.transports.local.channel import MAX_PENDING, ChannelListener

    listener = ChannelListener(os.urandom(32))
    peers = []
    try:
        for _ in range(MAX_PENDING + 1):
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peer.connect("\0" + listener.address[1:])
            peers.append(peer)
        deadline = time.monotonic() + 10
        while not _has_data(peers[-1]):  # until the listener took the last one in (its challenge came)
            assert listener.accept(0.05) is None and time.monotonic() < deadline
        assert listener.pending == MAX_PENDING
        peers[0].settimeout(5)
        assert closed_by_peer(peers[0])  # the oldest, dropped
    finally:
        for peer in peers:
            peer.close()
        listener.close()


def test_a_flood_of_refused_connections_is_logged_once_a_period_not_once_each(caplog):
    """Anyone on the host can connect: a review's flood, as uid 65534, of connections that fail the handshake
    wrote a warning for each into the trainer's log (100,000 lines, 11 MB, in 12 s)."""
    from weightsync.transports.local.channel import ChannelListener

    listener = ChannelListener(os.urandom(32))
    last = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with caplog.at_level(logging.WARNING, logger="weightsync"):
            for _ in range(30):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
                    peer.connect("\0" + listener.address[1:])
            last.connect("\0" + listener.address[1:])
            deadline = time.monotonic() + 10
            while not _has_data(last) or listener.pending > 1:  # every one before it taken in, and refused
                assert listener.accept(0.05) is None and time.monotonic() < deadline
    finally:
        last.close()
        listener.close()
    said = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(said) == 1 and "it closed the connection" in said[0], said
    left = [r.getMessage() for r in caplog.records if "connections refused on" in r.getMessage()]
    assert left == [f"29 more connections refused on {listener.address} of user {os.getuid()}, unsaid"], left


@needs_stranger
def test_a_strangers_flood_of_connections_pushes_out_only_its_own_never_a_workers_handshake():
    """Past MAX_PENDING, the listener drops the oldest handshake of the user who holds the most: the stranger's
    connections, made after the worker's, push out the stranger's own. (Dropping the oldest of all, the worker's
    went first.)"""
    from weightsync.transports.local.channel import MAX_PENDING, ChannelListener

    listener = ChannelListener(os.urandom(32))
    worker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stranger = None
    try:
        worker.connect("\0" + listener.address[1:])
        deadline = time.monotonic() + 10
        while not _has_data(worker):  # the listener took it in: its challenge came
            assert listener.accept(0.05) is None and time.monotonic() < deadline
        code = (
            "import socket, sys\n"
            f"socks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range({2 * MAX_PENDING})]\n"
            f"for s in socks: s.connect({chr(0) + listener.address[1:]!r})\n"
            "print('holding', flush=True)\n"
            "sys.stdin.readline()\n"
        )
        stranger = start_stranger(["-c", code], stdin=subprocess.PIPE)
        ready, _, _ = select.select([stranger.stdout], [], [], 60)
        assert ready and stranger.stdout.readline().strip() == "holding"
        deadline = time.monotonic() + 10
        while listener.pending < MAX_PENDING or time.monotonic() < deadline - 8:  # every one taken in, and more
            assert listener.accept(0.05) is None and time.monotonic() < deadline
        assert listener.pending == MAX_PENDING
        worker.recv(4096)  # its challenge
        with pytest.raises(BlockingIOError):  # still open, nothing more said: its handshake waits for it
            worker.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK)
    finally:
        _end(stranger)
        worker.close()
        listener.close()


def _has_data(sock: socket.socket) -> bool:
    try:
        return bool(sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK))
    except BlockingIOError:
        return False


def test_a_worker_facing_a_full_queue_of_connections_gives_up_at_its_timeout():
    """Anyone on the host can fill the trainer's queue of connections before its connect() runs: a worker's
    connect then fails within its own timeout, named, where a blocking connect held it for good."""
    from weightsync.transports.local.channel import ChannelListener, connect_channel

    listener = ChannelListener(os.urandom(32))
    queued = []
    try:
        while True:
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peer.setblocking(False)
            try:
                peer.connect("\0" + listener.address[1:])
            except BlockingIOError:
                peer.close()
                break
            queued.append(peer)
        started = time.monotonic()
        with pytest.raises(ws.SyncTimeoutError, match="queue of connections stayed full"):
            connect_channel(listener.address, os.urandom(32), {}, 1.0)
        assert time.monotonic() - started < 1.0 + SLACK_S
    finally:
        for peer in queued:
            peer.close()
        listener.close()


def test_a_peer_that_stops_reading_costs_a_send_of_descriptors_its_bound_not_more():
    """A slot's descriptor follows its message on the channel: a worker that stopped reading with room for the
    message but not for what follows held the sender there with no bound (and its lock with it)."""
    from multiprocessing.connection import Connection

    from weightsync.transports.local.channel import SEND_TIMEOUT, Channel

    mine, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = Channel(Connection(mine.detach()), "worker 0")
    raw = socket.socket(fileno=os.dup(channel.fileno()))
    memfd = os.memfd_create("slot")
    try:
        with contextlib.suppress(BlockingIOError):
            while True:  # (its buffer full of what it does not read, but one byte)
                raw.send(b"x", socket.MSG_DONTWAIT)
        peer.recv(1)
        started = time.monotonic()
        with pytest.raises(ws.ConnectionClosedError, match="stopped reading"):
            channel.send_with_fds({"op": "slot"}, [memfd])
        assert time.monotonic() - started < SEND_TIMEOUT + SLACK_S
    finally:
        os.close(memfd)
        raw.close()
        channel.close()
        peer.close()


def test_an_address_another_process_took_first_is_a_transport_error_naming_it():
    taken = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    taken.bind("\0weightsync-test-taken-" + os.urandom(4).hex())
    try:
        scheme = ws.MultiProcessWeightSyncScheme()
        with pytest.raises(ws.TransportError, match="could not listen at .*Address already in use"):
            scheme.init_on_sender(
                model_id="policy", model=build("tiny"), num_workers=1, address="@" + taken.getsockname()[1:].decode()
            )
    finally:
        taken.close()


def test_a_key_holder_that_stops_reading_before_its_welcome_costs_the_rendezvous_nothing_but_its_bound():
    """A worker that said hello and then read nothing (stopped, or crashing) while its welcome (the layout) was
    sent: the welcome fails within its bound, its channel is closed, and the rendezvous waits on for the real
    worker (it ended at once with an error naming no worker, the workers joined so far left open)."""
    import pickle

    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(1)) for _ in range(20000)])  # (a long layout)
    replica = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(1)) for _ in range(20000)])
    scheme = ws.MultiProcessWeightSyncScheme(timeout=5, connect_timeout=30)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    connection = scheme.receiver_config(0)["connection"]
    address, key = connection["address"], bytes.fromhex(read_key_file(connection["authkey_file"]))
    worker = pickle.loads(pickle.dumps(scheme))
    worker.init_on_receiver(model_id="policy", model=replica, worker_idx=0)
    silent: list[socket.socket] = []
    joined: list[BaseException | None] = []

    def first_a_silent_holder_then_the_worker() -> None:
        silent.append(key_holder(address, key, _hello(worker_idx=0, pid=os.getpid())))
        # (its hello taken once the welcome starts coming: the trainer is writing it, and the worker comes next)
        select.select([silent[0]], [], [], 10)
        try:
            worker.connect()
            joined.append(None)
        except BaseException as exc:  # noqa: BLE001 - judged below
            joined.append(exc)

    thread = threading.Thread(target=first_a_silent_holder_then_the_worker)
    thread.start()
    try:
        scheme.connect()
        thread.join(30)
        assert joined == [None]
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), replica.parameters()))
        assert closed_by_peer(silent[0])
    finally:
        thread.join(30)
        for sock in silent:
            sock.close()
        worker.shutdown()
        scheme.shutdown()
