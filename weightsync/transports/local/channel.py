"""An authenticated message channel between a sender and one local worker.

The listener binds a Linux abstract-namespace Unix socket: it has no file to
leave behind and vanishes with the process, even on SIGKILL. Anyone on the
host can reach an abstract socket, so both ends prove they hold the scheme's
random auth key (an HMAC challenge each way) before any message is read.

Messages are small JSON objects framed by :class:`multiprocessing.connection.Connection`;
nothing received is ever unpickled. File descriptors (shared-memory slots)
travel as ``SCM_RIGHTS`` ancillary data on the same socket.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import secrets
import select
import socket
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from ...core.timing import Progress, deadline_after, remaining
from ...errors import (
    AuthenticationError,
    ConnectionClosedError,
    SyncTimeoutError,
    TransportError,
)
from ..plainjson import loads_object

__all__ = [
    "Channel",
    "ChannelListener",
    "connect_channel",
    "readable",
]

log = logging.getLogger("weightsync.transports.channel")

#: Bytes of each side's random challenge.
_NONCE = 32
#: The most a peer may send before it proved it holds the key (a challenge or its answer).
_HANDSHAKE_MAX = 256


def _poll_ms(timeout: float) -> int:
    # poll() counts whole milliseconds: round up, so a short wait is not a busy loop.
    return 0 if timeout <= 0 else max(1, math.ceil(timeout * 1000))


def readable(fds: list[int], timeout: float) -> list[int]:
    """The descriptors among ``fds`` with something to read (a message, EOF or an error) within ``timeout`` s.

    One ``poll(2)``: 1.1 us for two descriptors, where :func:`multiprocessing.connection.wait` builds a
    selector each call (3.4 us). The local schemes poll several times a send, on their round trip.
    """
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(_poll_ms(timeout))]


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

    def fileno(self) -> int:
        return self._conn.fileno()

    @property
    def connection(self) -> Connection:
        return self._conn

    def send(self, msg: dict[str, Any]) -> None:
        """Send one message. Raises :class:`ConnectionClosedError` if the peer is gone."""
        data = json.dumps(msg, separators=(",", ":")).encode()
        with self._send_lock:
            self._send_bytes(data)

    def _send_bytes(self, data: bytes) -> None:
        try:
            self._conn.send_bytes(data)
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            self.closed = True
            raise ConnectionClosedError(f"channel to {self.peer} is closed ({exc})") from exc

    def send_with_fds(self, msg: dict[str, Any], fds: list[int]) -> None:
        """Send a message followed by file descriptors, atomically with respect to other senders."""
        data = json.dumps(msg, separators=(",", ":")).encode()
        with self._send_lock:
            self._send_bytes(data)
            with socket.fromfd(self._conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                try:
                    socket.send_fds(sock, [b"F"], fds)
                except OSError as exc:
                    self.closed = True
                    raise ConnectionClosedError(f"channel to {self.peer} is closed ({exc})") from exc

    def recv_fds(self, count: int, timeout: float) -> list[int]:
        """Receive ``count`` descriptors sent by :meth:`send_with_fds` after the message just read."""
        if not self.poll(timeout):
            raise SyncTimeoutError(f"no file descriptor from {self.peer} within {timeout:.1f}s")
        with socket.fromfd(self._conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            _, fds, _, _ = socket.recv_fds(sock, 1, count)
        if len(fds) != count:
            for fd in fds:
                os.close(fd)
            raise TransportError(f"expected {count} file descriptors from {self.peer}, got {len(fds)}")
        return list(fds)

    def poll(self, timeout: float = 0.0) -> bool:
        """True when a message (or EOF) is ready to be read."""
        if self._conn.closed:
            return True  # reading says how (a closed descriptor's number may belong to another file by now)
        return bool(self._poller.poll(_poll_ms(timeout)))

    def recv(self, timeout: float = 0.0) -> dict[str, Any] | None:
        """Next message, or ``None`` if none arrives within ``timeout`` seconds.

        Raises:
            ConnectionClosedError: the peer closed its end.
        """
        try:
            if not self.poll(timeout):
                return None
            data = self._conn.recv_bytes()
        except (EOFError, OSError) as exc:
            self.closed = True
            raise ConnectionClosedError(f"channel to {self.peer} closed") from exc
        msg = loads_object(data, f"a message from {self.peer}", max_bytes=len(data))
        if "op" not in msg:
            raise TransportError(f"malformed message from {self.peer}: {msg!r:.80}")
        return msg

    def recv_until(self, deadline: float, what: str) -> dict[str, Any]:
        """Next message before ``deadline``; raises :class:`SyncTimeoutError` naming ``what`` otherwise."""
        msg = self.recv(remaining(deadline))
        if msg is None:
            raise SyncTimeoutError(f"timed out waiting for {what} from {self.peer}")
        return msg

    def close(self) -> None:
        self.closed = True
        try:
            self._conn.close()
        except OSError:
            pass


#: Seconds a connecting peer has to complete the auth handshake.
HANDSHAKE_TIMEOUT = 5.0


class ChannelListener:
    """Accepts authenticated channels from workers on an abstract Unix socket."""

    def __init__(self, authkey: bytes, address: str | None = None) -> None:
        self._authkey = authkey
        self.address = address or f"@weightsync-{os.getpid()}-{secrets.token_hex(8)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(_abstract(self.address))
            self._sock.listen(128)
        except OSError:
            self._sock.close()
            raise

    def fileno(self) -> int:
        return self._sock.fileno()

    def accept(self, timeout: float) -> tuple[Channel, dict[str, Any]] | None:
        """Accept and authenticate one worker; ``None`` if nobody connects within ``timeout``.

        Returns the channel and the worker's hello message.

        Raises:
            AuthenticationError: the peer failed the challenge (its connection is closed).
        """
        deadline = deadline_after(timeout)
        self._sock.settimeout(max(timeout, 1e-3))
        try:
            raw, _ = self._sock.accept()
        except TimeoutError:
            return None
        raw.setblocking(True)
        conn = Connection(raw.detach())
        channel = Channel(conn, "worker (handshake)")
        # The handshake has a bound of its own: a short wait for connections (the sender's rejoin
        # listener polls every 0.1 s) must not cut short a peer that is answering.
        deadline = deadline_after(max(remaining(deadline), HANDSHAKE_TIMEOUT))
        try:
            nonce = secrets.token_bytes(_NONCE)
            conn.send_bytes(nonce)
            if not conn.poll(remaining(deadline)):
                raise AuthenticationError("peer did not answer the auth challenge in time")
            answer = conn.recv_bytes(_HANDSHAKE_MAX)
            if not hmac.compare_digest(answer, _digest(self._authkey, nonce, b"worker")):
                conn.send_bytes(b"denied")
                raise AuthenticationError("peer failed the auth-key challenge")
            hello = channel.recv_until(deadline, "hello")
            peer_nonce = bytes.fromhex(hello.pop("nonce", ""))
            conn.send_bytes(_digest(self._authkey, peer_nonce, b"sender"))
        except (EOFError, OSError, ConnectionClosedError, AuthenticationError, SyncTimeoutError, ValueError) as exc:
            channel.close()
            if isinstance(exc, AuthenticationError):
                log.warning("refused a connection on %s: %s", self.address, exc)
                raise
            raise AuthenticationError(f"handshake failed: {exc}") from exc
        channel.peer = f"worker {hello.get('worker_idx')} (pid {hello.get('pid')})"
        return channel, hello

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


def connect_channel(
    address: str, authkey: bytes, hello: dict[str, Any], timeout: float, *, wait_for_listener: bool = True
) -> Channel:
    """Connect to a :class:`ChannelListener`, authenticate both ways, and send ``hello``.

    Retries while the listener does not exist yet, up to ``timeout`` seconds; with ``wait_for_listener=False``
    (the caller knows it was listening), a refused connection is raised at once.

    Raises:
        SyncTimeoutError: no listener answered in time.
        ConnectionRefusedError, FileNotFoundError: nothing listens at ``address`` here (``wait_for_listener``
            false).
        AuthenticationError: the key was refused, or the listener could not prove it holds it.
    """
    deadline = deadline_after(timeout)
    progress = Progress(log, f"the sender at {address!r}", timeout)
    delay = 0.01
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(_abstract(address))
            break
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            if not wait_for_listener:
                raise
            if remaining(deadline) <= 0:
                raise SyncTimeoutError(f"no sender listening at {address!r} after {timeout:.1f}s") from exc
            # The sender may not have bound yet: back off briefly (bounded by the deadline).
            progress.tick("nothing listens there yet")
            time.sleep(min(delay, remaining(deadline)))
            delay = min(delay * 2, 0.2)
    conn = Connection(sock.detach())
    channel = Channel(conn, f"sender at {address}")
    try:
        while not conn.poll(min(remaining(deadline), 1.0)):
            if remaining(deadline) <= 0:
                raise SyncTimeoutError(
                    f"the sender at {address!r} did not take this worker in within {timeout:.1f}s (its connect() "
                    "did not run, or ended)"
                )
            progress.tick("it listens, but its connect() has not taken this worker in yet")
        nonce = conn.recv_bytes(_HANDSHAKE_MAX)
        conn.send_bytes(_digest(authkey, nonce, b"worker"))
        my_nonce = secrets.token_bytes(_NONCE)
        channel.send({**hello, "op": "hello", "nonce": my_nonce.hex()})
        if not conn.poll(remaining(deadline)):
            raise SyncTimeoutError(f"sender at {address!r} did not answer the handshake within {timeout:.1f}s")
        proof = conn.recv_bytes(_HANDSHAKE_MAX)
    except SyncTimeoutError:  # a TimeoutError, hence an OSError: not a closed handshake
        channel.close()
        raise
    except (EOFError, OSError, ConnectionClosedError) as exc:
        channel.close()
        raise AuthenticationError(f"sender at {address!r} closed the handshake (wrong auth key?)") from exc
    except BaseException:
        channel.close()
        raise
    if not hmac.compare_digest(proof, _digest(authkey, my_nonce, b"sender")):
        channel.close()
        raise AuthenticationError(f"sender at {address!r} refused the auth key or failed to prove its own")
    return channel
