"""An authenticated message channel between a sender and one local worker.

The listener binds a Linux abstract-namespace Unix socket: it has no file to leave behind and vanishes with the
process, even on SIGKILL. Anyone on the host can reach an abstract socket, so both ends prove they hold the scheme's
random auth key (an HMAC challenge each way) before any message is read.

Messages are small JSON objects framed as :class:`multiprocessing.connection.Connection` frames (a 4-byte big-endian
length, then the bytes); nothing received is ever unpickled. File descriptors (shared-memory slots) travel as
``SCM_RIGHTS`` ancillary data on the same socket.

Every read is bounded in size and in time, a frame as a whole: before the handshake by :data:`_HANDSHAKE_MAX` /
:data:`_HELLO_MAX` bytes and :data:`HANDSHAKE_TIMEOUT` seconds per peer, after it by :data:`MAX_MESSAGE` bytes and
:data:`FRAME_TIMEOUT` seconds once a frame has begun. The listener runs the handshakes of all connecting peers at
once, as a non-blocking state machine over ``poll(2)`` (at most :data:`MAX_PENDING` of them), so a peer that sends
half a frame and holds delays nobody but itself.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from ...core.interrupts import held_interrupts
from ...core.timing import Progress, Throttled, deadline_after, remaining, shown_seconds
from ...errors import AuthenticationError, ConnectionClosedError, SyncTimeoutError, TransportError, WeightSyncError
from ..descriptors import poll_ms, readable
from ..network import crowded_out
from ..plainjson import loads_object
from .frames import FrameReader, frame, read_frame

__all__ = [
    "Channel",
    "ChannelListener",
    "connect_channel",
]

log = logging.getLogger("weightsync.transports.channel")

#: Bytes of each side's random challenge.
_NONCE = 32
#: The most a peer may send before it proved it holds the key (a challenge or its answer).
_HANDSHAKE_MAX = 256
#: The longest hello a worker may send (it names its index, pid, model id and device: a few hundred bytes).
_HELLO_MAX = 4096
#: The longest message accepted once both ends proved the key (the welcome carries the layout: one entry of
#: about 100 bytes per tensor). A longer frame closes the channel with a :class:`ConnectionClosedError`.
MAX_MESSAGE = 64 * 1024 * 1024
#: Seconds the rest of a frame may take to arrive once its first byte did (the sender writes a frame at once).
FRAME_TIMEOUT = 5.0
#: Seconds a message may take to leave: a peer that stopped reading (a stopped process) leaves a write waiting once
#: the socket's buffer is full (a welcome carrying a large layout fills it), and the channel is then closed.
SEND_TIMEOUT = 5.0
#: Seconds a connecting peer has to complete the auth handshake, counted from its connection.
HANDSHAKE_TIMEOUT = 5.0
#: The most peers in the middle of a handshake at once; one more drops the oldest of the user who holds the most.
MAX_PENDING = 64
#: The most connections taken from the backlog in one look (then the pending handshakes are served).
_ACCEPT_BATCH = 16


def _digest(authkey: bytes, nonce: bytes, role: bytes) -> bytes:
    return hmac.new(authkey, role + nonce, hashlib.sha256).digest()


def _abstract(address: str) -> str:
    # "@name" is the printable spelling of an abstract address ("\0name").
    return "\0" + address[1:] if address.startswith("@") else address


class Channel:
    """One end of an authenticated connection: JSON messages and file descriptors.

    ``send`` is safe to call from several threads; a single thread reads.
    """

    def __init__(self, conn: Connection, peer: str) -> None:
        self._conn = conn
        self.peer = peer
        self._send_lock = threading.Lock()
        self.closed = False
        self._poller = select.poll()
        self._poller.register(conn.fileno(), select.POLLIN)
        # Writes go through a socket object of the same connection: each one without blocking (MSG_DONTWAIT),
        # waited for with poll(2) until SEND_TIMEOUT; the descriptor itself stays blocking for its reader.
        self._sock = socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)
        self._writable = select.poll()
        self._writable.register(self._sock.fileno(), select.POLLOUT)

    def fileno(self) -> int:
        return self._conn.fileno()

    @property
    def connection(self) -> Connection:
        return self._conn

    def send(self, msg: dict[str, Any], timeout: float = SEND_TIMEOUT) -> None:
        """Send one message (``timeout``: how long the peer may leave its buffer full). Raises
        :class:`ConnectionClosedError` if the peer is gone, or took nothing in time."""
        data = json.dumps(msg, separators=(",", ":")).encode()
        with self._send_lock:
            self._send_bytes(data, timeout=timeout)

    def _send_bytes(self, data: bytes, fds: list[int] | None = None, timeout: float = SEND_TIMEOUT) -> None:
        """Write ``data`` as one frame, then (with ``fds``) one byte carrying those descriptors, all of it within
        ``timeout`` (else the channel is closed: a frame written in part leaves nothing readable after it). A
        Ctrl-C meanwhile waits for the write's end (:class:`held_interrupts`): half a frame, or a frame without its
        descriptors, left the channel out of step for good."""
        out = memoryview(frame(data))
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        deadline = deadline_after(timeout)
        try:
            with held_interrupts():
                self._write(out, rights, deadline, timeout)
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            self.closed = True
            raise ConnectionClosedError(f"channel to {self.peer} is closed ({exc})") from exc

    def _write(
        self, out: memoryview, rights: list[tuple[int, int, array.array]], deadline: float, timeout: float
    ) -> None:
        while out or rights:
            try:
                if out:
                    out = out[self._sock.send(out, socket.MSG_DONTWAIT) :]
                else:  # (socket.send_fds drops its flags before Python 3.12: sendmsg, as it does)
                    self._sock.sendmsg([b"F"], rights, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
                    rights = []
            except BlockingIOError:  # the peer's buffer is full: wait until it reads, or the deadline
                if remaining(deadline) <= 0:
                    self.close()
                    raise ConnectionClosedError(
                        f"{self.peer} did not take a message within {shown_seconds(timeout)} "
                        "(it stopped reading); closed the channel"
                    ) from None
                self._writable.poll(poll_ms(remaining(deadline)))

    def send_with_fds(self, msg: dict[str, Any], fds: list[int]) -> None:
        """Send a message followed by file descriptors, atomically with respect to other senders."""
        data = json.dumps(msg, separators=(",", ":")).encode()
        with self._send_lock:
            self._send_bytes(data, fds)

    def recv_fds(self, count: int, timeout: float) -> list[int]:
        """Receive ``count`` descriptors sent by :meth:`send_with_fds` after the message just read."""
        if not self.poll(timeout):
            raise SyncTimeoutError(f"no file descriptor from {self.peer} within {shown_seconds(timeout)}")
        _, fds, _, _ = socket.recv_fds(self._sock, 1, count)
        if len(fds) != count:
            for fd in fds:
                os.close(fd)
            raise TransportError(f"expected {count} file descriptors from {self.peer}, got {len(fds)}")
        return list(fds)

    def poll(self, timeout: float = 0.0) -> bool:
        """True when a message (or EOF) is ready to be read."""
        if self._conn.closed:
            return True  # reading says how (a closed descriptor's number may belong to another file by now)
        return bool(self._poller.poll(poll_ms(timeout)))

    def hung_up(self) -> bool:
        """True where the peer closed its end and nothing is left to read (looked at, not read)."""
        try:
            return self._conn.closed or (self.poll(0) and not self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError as exc:  # (a reset: hung up too)
            return not isinstance(exc, BlockingIOError)

    def recv(self, timeout: float = 0.0) -> dict[str, Any] | None:
        """Next message, or ``None`` if none arrives within ``timeout`` seconds.

        Raises:
            ConnectionClosedError: the peer closed its end; or it sent a frame over :data:`MAX_MESSAGE` bytes, did
                not finish one within :data:`FRAME_TIMEOUT` of its first byte, or sent something other than a
                bounded JSON object with an ``op`` (then this end closes the channel: nothing it says is usable).
        """
        try:
            if not self.poll(timeout):
                return None
            # The frame has begun: all of it must come within FRAME_TIMEOUT, and fit MAX_MESSAGE.
            what = f"the channel to {self.peer}"
            data = read_frame(self.fileno(), deadline_after(FRAME_TIMEOUT), MAX_MESSAGE, what)
            msg = loads_object(data, f"a message from {self.peer}", max_bytes=MAX_MESSAGE)
            if not isinstance(msg.get("op"), str):
                raise TransportError(f"malformed message from {self.peer}: {str(msg)[:80]}")
        except WeightSyncError as exc:  # half a frame, one too long, or garbage: the stream is lost, and the channel
            self.close()
            raise ConnectionClosedError(f"{exc.detail}; closed the channel") from exc
        except (EOFError, OSError) as exc:
            self.closed = True
            raise ConnectionClosedError(f"channel to {self.peer} closed") from exc
        return msg

    def recv_until(self, deadline: float, what: str) -> dict[str, Any]:
        """Next message before ``deadline``; raises :class:`SyncTimeoutError` naming ``what`` otherwise."""
        msg = self.recv(remaining(deadline))
        if msg is None:
            raise SyncTimeoutError(f"timed out waiting for {what} from {self.peer}")
        return msg

    def close(self) -> None:
        self.closed = True
        for end in (self._sock, self._conn):
            with contextlib.suppress(OSError):
                end.close()


class _Pending:
    """A peer in the middle of the handshake: its socket, the challenge it was sent, what it sent so far."""

    def __init__(self, sock: socket.socket, nonce: bytes) -> None:
        self.sock = sock
        self.nonce = nonce
        self.uid = _peer_uid(sock)
        self.deadline = deadline_after(HANDSHAKE_TIMEOUT)
        self.proved = False  # it answered the challenge: what comes next is its hello
        self.reader = FrameReader(_HANDSHAKE_MAX, "a connecting peer")


def _peer_uid(sock: socket.socket) -> int | None:
    """The user the peer of a Unix socket ran as when it connected (``SO_PEERCRED``, Linux); ``None`` elsewhere."""
    try:
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except (AttributeError, OSError):
        return None
    return int(uid)


class _Refused(Exception):
    """A pending peer failed its handshake: ``str()`` says how (logged; the peer is closed)."""


def _hello_nonce(hello: dict[str, Any]) -> bytes:
    """The worker's challenge from its hello, type-checked (a hex string of :data:`_NONCE` bytes)."""
    if hello.get("op") != "hello":
        raise _Refused(f"its first message is {str(hello.get('op'))[:40]!r}, not a hello")
    nonce = hello.pop("nonce", None)
    if not isinstance(nonce, str) or len(nonce) != 2 * _NONCE:
        raise _Refused(f"its hello holds no {_NONCE}-byte nonce")
    try:
        return bytes.fromhex(nonce)
    except ValueError:
        raise _Refused("its hello's nonce is not hexadecimal") from None


class ChannelListener:
    """Accepts authenticated channels from workers on an abstract Unix socket.

    Anyone on the host can connect, so nothing a peer sends before it proved the key can hold the listener:
    every connecting peer gets its own :data:`HANDSHAKE_TIMEOUT` from its connection, the handshakes of all
    of them advance together without blocking (a peer is read only when ``poll`` says it sent something, and
    only up to the end of its current frame), and at most :data:`MAX_PENDING` are held at once. One thread
    calls :meth:`accept` at a time.
    """

    def __init__(self, authkey: bytes, address: str | None = None) -> None:
        self._authkey = authkey
        self.address = address or f"@weightsync-{os.getpid()}-{secrets.token_hex(8)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._pending: dict[int, _Pending] = {}  # by descriptor, oldest first
        self._closed = False
        self.refusals = Throttled(log)
        try:
            self._sock.bind(_abstract(self.address))
            self._sock.listen(128)
            self._sock.setblocking(False)
        except OSError as exc:  # (taken by another process first, say: any user can bind an abstract name)
            self._sock.close()
            raise TransportError(f"could not listen at {self.address!r}: {exc}") from exc

    def fileno(self) -> int:
        return self._sock.fileno()

    @property
    def pending(self) -> int:
        """How many peers are in the middle of their handshake."""
        return len(self._pending)

    def accept(self, timeout: float) -> tuple[Channel, dict[str, Any]] | None:
        """The next worker to complete the handshake within ``timeout`` s, with its hello; ``None`` if none did.

        Handshakes that are not over when ``timeout`` ends go on at the next call (each peer within its own
        :data:`HANDSHAKE_TIMEOUT`). A peer that fails (a wrong key, a malformed or oversized frame, silence
        past its deadline) is closed and logged, and the wait goes on for the others.

        Raises:
            OSError: the listener was closed.
        """
        deadline = deadline_after(timeout)
        while True:
            if self._closed:
                raise OSError("the listener is closed")
            self._expire()
            wait = remaining(deadline)
            if self._pending:
                wait = min(wait, min(remaining(p.deadline) for p in self._pending.values()))
            for fd in readable([self._sock.fileno(), *self._pending], wait):
                if fd == self._sock.fileno():
                    self._take_new()
                    continue
                peer = self._pending.get(fd)
                if peer is None:
                    continue
                accepted = self._advance(peer)
                if accepted is not None:
                    return accepted
            if remaining(deadline) <= 0:
                return None

    def _drop(self, peer: _Pending, why: str | None) -> None:
        self._pending.pop(peer.sock.fileno(), None)
        if why is not None:
            self.refusals.warning("refused a connection on %s: %s", self.address, why, key=f"user {peer.uid}")
        peer.sock.close()

    def _expire(self) -> None:
        for peer in [p for p in self._pending.values() if remaining(p.deadline) <= 0]:
            self._drop(peer, f"it did not complete the handshake within {shown_seconds(HANDSHAKE_TIMEOUT)}")

    def _take_new(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the backlog keeps the connection for later
                log.warning("could not accept a connection on %s: %s", self.address, exc)
                return
            sock.setblocking(False)
            peer = _Pending(sock, secrets.token_bytes(_NONCE))
            if len(self._pending) >= MAX_PENDING:
                self._make_room(peer)
            self._pending[sock.fileno()] = peer
            try:
                self._send(peer, peer.nonce)
            except _Refused as exc:
                self._drop(peer, str(exc))

    def _make_room(self, newcomer: _Pending) -> None:
        """Drop the oldest handshake of the user who holds the most (the newcomer counted): a user who floods
        the listener pushes out their own connections, never a worker's of another user."""
        queue = list(self._pending.values())
        oldest = queue[crowded_out([p.uid for p in queue], newcomer.uid)]
        self._drop(oldest, f"{MAX_PENDING} handshakes were pending: dropped the oldest of the user with the most")

    @staticmethod
    def _send(peer: _Pending, data: bytes) -> None:
        # A few dozen bytes into a socket that holds at most the few we sent before: it never has to wait.
        framed = frame(data)
        try:
            sent = peer.sock.send(framed, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except OSError as exc:
            raise _Refused(f"it closed the connection ({exc})") from None
        if sent != len(framed):
            raise _Refused("it does not read what it is sent")

    def _advance(self, peer: _Pending) -> tuple[Channel, dict[str, Any]] | None:
        """Read what ``peer`` sent, up to the end of its current frame; the channel once its handshake is done."""
        try:
            try:
                data = peer.sock.recv(peer.reader.want())
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as exc:
                raise _Refused(f"its connection failed ({exc})") from None
            if not data:
                raise _Refused("it closed the connection during the handshake")
            try:
                got = peer.reader.feed(data)
            except TransportError as exc:
                raise _Refused(exc.detail) from None
            if got is None:
                return None
            if not peer.proved:
                if not hmac.compare_digest(got, _digest(self._authkey, peer.nonce, b"worker")):
                    with contextlib.suppress(_Refused):
                        self._send(peer, b"denied")
                    raise _Refused("it failed the auth-key challenge")
                peer.proved = True
                peer.reader = FrameReader(_HELLO_MAX, "a worker's hello")
                return None
            try:
                hello = loads_object(got, "a worker's hello", max_bytes=_HELLO_MAX)
            except TransportError as exc:
                raise _Refused(exc.detail) from None
            self._send(peer, _digest(self._authkey, _hello_nonce(hello), b"sender"))
        except _Refused as exc:
            self._drop(peer, str(exc))
            return None
        self._pending.pop(peer.sock.fileno())
        peer.sock.setblocking(True)
        channel = Channel(Connection(peer.sock.detach()), "worker (handshake)")
        channel.peer = f"worker {str(hello.get('worker_idx'))[:20]} (pid {str(hello.get('pid'))[:20]})"
        return channel, hello

    def close(self) -> None:
        """Stop listening and drop every pending handshake."""
        self._closed = True
        for peer in list(self._pending.values()):
            self._drop(peer, None)
        with contextlib.suppress(OSError):
            self._sock.close()
        self.refusals.flush(f"connections refused on {self.address}")


def connect_channel(
    address: str, authkey: bytes, hello: dict[str, Any], timeout: float, *, wait_for_listener: bool = True
) -> Channel:
    """Connect to a :class:`ChannelListener`, authenticate both ways, and send ``hello``.

    Retries while the listener does not exist yet, up to ``timeout`` seconds; with ``wait_for_listener=False``
    (the caller knows it was listening), a refused connection is raised at once.

    Raises:
        SyncTimeoutError: no listener answered in time.
        ConnectionRefusedError, FileNotFoundError: nothing listens at ``address`` here (``wait_for_listener`` false).
        ConnectionClosedError: the sender closed the connection before its handshake (it shut down or exited).
        AuthenticationError: the key was refused, or the listener could not prove it holds it.
    """
    deadline = deadline_after(timeout)
    progress = Progress(log, f"the sender at {address!r}", timeout)
    delay = 0.01
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)  # (a listener whose queue is full would hold a blocking connect for good)
        try:
            sock.connect(_abstract(address))
            sock.setblocking(True)
            break
        except (FileNotFoundError, ConnectionRefusedError, BlockingIOError) as exc:
            sock.close()
            full = isinstance(exc, BlockingIOError)  # its queue of connections is full (strangers, say): again
            if not wait_for_listener and not full:
                raise
            if remaining(deadline) <= 0:
                raise SyncTimeoutError(
                    f"the sender at {address!r} did not take a connection within {shown_seconds(timeout)} "
                    "(its queue of connections stayed full)"
                    if full
                    else f"no sender listening at {address!r} after {shown_seconds(timeout)}"
                ) from exc
            # The sender may not have bound yet: back off briefly (bounded by the deadline).
            progress.tick("its queue of connections is full" if full else "nothing listens there yet")
            time.sleep(min(delay, remaining(deadline)))
            delay = min(delay * 2, 0.2)
        except BaseException:
            sock.close()
            raise
    conn = Connection(sock.detach())
    channel, proving = Channel(conn, f"sender at {address}"), False
    try:
        while not conn.poll(min(remaining(deadline), progress.every)):  # (in slices: a wait under 1 s says why too)
            if remaining(deadline) <= 0:
                raise SyncTimeoutError(
                    f"the sender at {address!r} did not take this worker in within {shown_seconds(timeout)} "
                    "(its connect() did not run, or ended)"
                )
            progress.tick("it listens, but its connect() has not taken this worker in yet")
        what = f"the sender at {address!r}"
        nonce = read_frame(conn.fileno(), deadline, _HANDSHAKE_MAX, what)
        proving = True  # (a close before this says nothing of the key: the sender went away)
        conn.send_bytes(_digest(authkey, nonce, b"worker"))
        my_nonce = secrets.token_bytes(_NONCE)
        channel.send({**hello, "op": "hello", "nonce": my_nonce.hex()})
        proof = read_frame(conn.fileno(), deadline, _HANDSHAKE_MAX, what)
    except SyncTimeoutError:  # a TimeoutError, hence an OSError: not a closed handshake
        channel.close()
        raise
    except (EOFError, OSError, ConnectionClosedError) as exc:
        channel.close()
        if not proving:
            raise ConnectionClosedError(
                f"the sender at {address!r} closed the connection before its handshake began: it shut down or exited"
            ) from exc
        raise AuthenticationError(f"sender at {address!r} closed the handshake (wrong auth key?)") from exc
    except TransportError as exc:  # a frame over the handshake's bound
        channel.close()
        raise AuthenticationError(f"the sender at {address!r} broke the handshake ({exc.detail})") from exc
    except BaseException:
        channel.close()
        raise
    if not hmac.compare_digest(proof, _digest(authkey, my_nonce, b"sender")):
        channel.close()
        raise AuthenticationError(f"sender at {address!r} refused the auth key or failed to prove its own")
    return channel
