"""A worker's line: one TCP connection between the sender and a worker of the run's group, carrying what each
update needs at once: its sealed announcement, the bytes of a version small enough to travel with it, and the
worker's ack.

Without it, an update wakes three processes' threads in turn before a byte moves: the sender rings the doorbell
in the store (the store's thread, then the worker's doorbell thread, then the worker), gloo's threads carry the
bytes, and a waiter thread of the sender's completes the ack. On a line, the worker's own thread waits on the
socket and reads the announcement and the bytes in one go, and the sender's own thread reads the ack: on a host
with few cores, that is most of a small model's sync.

Who may use a line: the sender listens on a port of its own (its address sealed in the store, ``line``) during
the rendez-vous only. Whoever connects is challenged with a fresh nonce and must answer with the run key's proof
for one worker (:func:`~.auth.line_proof`); the sender then names the workers it has a line with in the sealed
verdict, and every other worker is reached as before (its doorbell, gloo's acks), as is a worker that rejoins.
What travels on a line is authenticated as elsewhere (sealed announcements, keyed digests, tagged acks): the
line only saves the hops. A worker whose line stopped midway (a link down) hangs it up; nothing is announced to
it again, and it waits for the sender's word in the store that it was dropped (it then rejoins) or that the
sender shut down.

Frames: an announcement is its length (4 bytes, big-endian) and the sealed bytes; the bytes of a version it says
travel inline follow it raw (their size is the layout's); an ack is :data:`ACK` (the ack's words and tag).
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ...core.timing import deadline_after, remaining
from ...errors import ConnectionClosedError, SyncTimeoutError, TransportError, WeightSyncError
from .. import descriptors
from ..network import bound_silence, crowded_out, tcp_peer_uids
from .auth import ACK_TAG_WORDS, line_proof

__all__ = ["ACK", "FRAME", "LINE_WAIT_S", "Dialing", "Line", "Listener", "PeerClosed"]

log = logging.getLogger("weightsync.transports.distributed")

#: An announcement's length, before it.
FRAME = struct.Struct(">I")
#: An ack: the message's sequence number, the version held, the status, and the run key's tag.
ACK = struct.Struct(f">{3 + ACK_TAG_WORDS}q")
#: How long the sender waits for the lines of the workers that said hello, once they all did (seconds): a worker
#: whose line is not up by then is reached through its doorbell.
LINE_WAIT_S = 2.0
NONCE_BYTES = 16
_PROOF = struct.Struct(">q32s")  # the worker's index and its proof
#: The longest a worker's connection to the line port may take (seconds); the challenge comes later.
CONNECT_S = 5.0
#: How long a worker whose line the sender took waits for its answer to have gone out (it has: the sender read it).
ANSWERED_WAIT_S = 2.0
#: Connections the listener holds that have not proven themselves yet, at most; one more closes the oldest of the
#: user who holds the most (a connection from this host is its user's; one from elsewhere, of a user unknown).
MAX_UNPROVEN = 64


def _done() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future


class PeerClosed(ConnectionClosedError):
    """The line's peer ended it (its end, or a reset): its host's kernel was there to say so."""


class Line:
    """One end of a line. Every wait has a deadline; a line that fails once is closed for good, but for a write
    made on the caller's thread that meets the peer's end: what the peer sent before its end is still read (a
    worker's ack written after its sender shut down, which left its last word on the line).

    The sender writes without blocking its thread (:meth:`write`: what the socket does not take at once is
    written on a thread of the line's own, in order); a worker reads and writes on its own thread.

    Args:
        sock: the connected socket.
        name: the writing thread's name.
        write_timeout: the longest one write may wait for the peer to read (seconds).
        silence: the longest the peer may stay silent before the line fails (:func:`~..network.bound_silence`):
            a peer whose host vanished sends no reset, and a worker waiting for its next announcement would
            wait for it forever. ``None``: unbounded.
    """

    def __init__(self, sock: socket.socket, name: str, write_timeout: float, silence: float | None = None) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if silence is not None and not bound_silence(sock, silence):
            log.debug("could not bound the silence of line %s on this platform", name)
        self._sock: socket.socket | None = sock
        self._name = name
        self.write_timeout = write_timeout
        self._inbox = bytearray()  # the start of something read in part (an ack the sender polls for)
        #: Held by a write while it checks the line and hands its rest to the thread, and by close while it takes
        #: the socket and ends the thread (from the thread itself, too): a write never finds the thread ended.
        self._lock = threading.RLock()
        self._tail: Future = _done()  # the last write handed to the thread
        self._writer: ThreadPoolExecutor | None = None
        #: A write the peer took nothing of for :attr:`write_timeout`: the line is done, and left open for
        #: :meth:`close`. A peer still alive that finds its end only then (the sender's ``drop()`` closes it once it
        #: said so in the store) learns it was dropped; an end found before that word reads as a sender gone.
        self._stalled = False
        self._peer_ended = False  # a write met the peer's end: nothing more is written, what it sent is read

    def fileno(self) -> int:
        """The socket's (to wait on); -1 once closed, or done (a write stalled)."""
        return self._sock.fileno() if self._sock is not None and not self._stalled else -1

    def _socket(self, writing: bool = False) -> socket.socket:
        if self._sock is None:
            raise ConnectionClosedError("the line is closed")
        if self._stalled:
            raise ConnectionClosedError("the line's peer read nothing in time")
        if writing and self._peer_ended:
            raise PeerClosed("the line's peer went away")
        return self._sock

    # ------------------------------------------------------------------ write
    def write(self, chunks: list[Any]) -> Future:
        """Write ``chunks`` (bytes-like) in order after everything written before; the future completes once the
        socket took the last byte (at once, most often). A peer that reads nothing for :attr:`write_timeout`
        fails it, and the line closes.

        Raises:
            ConnectionClosedError: the line is closed, or the peer went away.
        """
        views = [memoryview(c).cast("B") for c in chunks]
        with self._lock:
            sock = self._socket(writing=True)
            if self._tail.done():
                views = self._send_now(sock, views)
                if not views:
                    return _done()
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix=self._name)
            self._tail = self._writer.submit(self._send_all, views, deadline_after(self.write_timeout))
            return self._tail

    def _send_now(self, sock: socket.socket, views: list[memoryview]) -> list[memoryview]:
        """Send what the socket takes without waiting; what is left."""
        try:
            while views:
                sent = sock.send(views[0])
                views[0] = views[0][sent:]
                if not len(views[0]):
                    views.pop(0)
        except BlockingIOError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                self.close(0.0)
                raise ConnectionClosedError(f"the line's peer went away ({exc})") from None
            self._peer_ended = True  # (the socket still holds what the peer sent before its end)
            raise PeerClosed(f"the line's peer went away ({exc})") from None
        return views

    def _send_all(self, views: list[memoryview], deadline: float) -> None:
        try:
            sock = self._socket(writing=True)
            while views:
                left = remaining(deadline)
                if left <= 0 or not descriptors.writable(sock.fileno(), left):
                    self._stalled = True
                    raise SyncTimeoutError("the line's peer read nothing in time")
                views = self._send_now(sock, views)
        except BaseException:
            if not self._stalled:  # (a stalled line is closed by whoever drops its peer)
                self.close(0.0)
            raise

    def send(self, data: bytes, timeout: float) -> None:
        """Write ``data`` and wait until the socket took it, ``timeout`` at most."""
        future = self.write([data])
        try:
            future.result(max(timeout, 0.0))
        except TimeoutError:
            self.close(0.0)
            raise SyncTimeoutError("the line's peer read nothing in time") from None

    # ------------------------------------------------------------------- read
    def readable(self, timeout: float) -> bool:
        """Whether something (or the end of the line) waits to be read, waiting up to ``timeout``."""
        if self._inbox:
            return True
        sock = self._socket()
        return bool(descriptors.readable([sock.fileno()], timeout))

    def _recv_into(self, view: memoryview) -> int:
        """Read what is there into ``view`` (0: nothing yet)."""
        try:
            got = self._socket().recv_into(view)
        except BlockingIOError:
            return 0
        except OSError as exc:
            self.close(0.0)
            ended = PeerClosed if exc.errno == errno.ECONNRESET else ConnectionClosedError  # (not a silence)
            raise ended(f"the line's peer went away ({exc})") from None
        if got == 0:
            self.close(0.0)
            raise PeerClosed("the line's peer closed it")
        return got

    def take(self, size: int) -> bytes | None:
        """``size`` bytes if they all arrived, without waiting (what arrived of them is kept); else ``None``."""
        while len(self._inbox) < size:
            chunk = bytearray(size - len(self._inbox))
            got = self._recv_into(memoryview(chunk))
            if not got:
                return None
            self._inbox += chunk[:got]
        taken, self._inbox = bytes(self._inbox[:size]), self._inbox[size:]
        return taken

    def read_into(self, views: list[memoryview], deadline: float, arrived: Callable[[int], None] | None = None) -> None:
        """Fill ``views`` in order by ``deadline``; ``arrived(n)`` after each read, ``n`` the bytes in so far."""
        total = 0
        for view in views:
            at = 0
            if self._inbox:
                at = min(len(view), len(self._inbox))
                view[:at] = self._inbox[:at]
                del self._inbox[:at]
            while at < len(view):
                got = self._recv_into(view[at:])
                if not got:
                    left = remaining(deadline)
                    if left <= 0 or not descriptors.readable([self._socket().fileno()], left):
                        raise SyncTimeoutError("the line's peer sent too little in time")
                    continue
                at += got
                if arrived is not None:
                    arrived(total + at)
            total += len(view)

    def read(self, size: int, deadline: float) -> bytes:
        """``size`` bytes, by ``deadline``."""
        out = bytearray(size)
        self.read_into([memoryview(out)], deadline)
        return bytes(out)

    def frame(self, deadline: float, max_bytes: int) -> bytes:
        """The next announcement, by ``deadline``.

        Raises:
            TransportError: it says it is longer than ``max_bytes`` (the line is closed: nothing after it can be
                told apart).
        """
        (size,) = FRAME.unpack(self.read(FRAME.size, deadline))
        if size > max_bytes:
            self.close(0.0)
            raise TransportError(f"a frame of {size} bytes on the line, over its {max_bytes}; closed the line")
        return self.read(size, deadline)

    def hang_up(self) -> None:
        """End both directions now, without closing the socket: a thread reading or writing it sees the end at
        once (:meth:`close` follows, once that thread is done)."""
        with contextlib.suppress(OSError, ConnectionClosedError):
            self._socket().shutdown(socket.SHUT_RDWR)

    def close(self, timeout: float) -> None:
        """Close, once what was written before went out or ``timeout`` passed."""
        with contextlib.suppress(Exception):
            self._tail.result(max(timeout, 0.0))
        with self._lock:
            sock, self._sock = self._sock, None
            if self._writer is not None:  # (a write handed to it after this fails: the line is closed)
                self._writer.shutdown(wait=False)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)  # after what is written: the peer reads it, then the end
                for _ in range(64):  # what came and was not read (closing over it resets the line), 4 MB at most
                    if not sock.recv(1 << 16):
                        break
            sock.close()


class Listener:
    """The sender's port for lines, open from its construction until the rendez-vous took the lines.

    Args:
        host: the address of this host's interface toward the workers (as gloo's).
    """

    def __init__(self, host: str) -> None:
        self._sock: socket.socket | None = socket.create_server((host, 0))
        self._sock.setblocking(False)
        self.address = (host, self._sock.getsockname()[1])

    def accept(
        self, key: bytes, prefix: str, workers: set[int], deadline: float, make: Callable[[int, socket.socket], Line]
    ) -> dict[int, Line]:
        """The lines of ``workers``, each from a connection that answered its challenge with the run key's proof for
        that worker, taken until every one of them has its line or ``deadline``; anything else that connects is
        closed. ``make(worker, socket)``: the line of a proven connection."""
        listener = self._sock
        assert listener is not None
        pending: dict[socket.socket, tuple[bytes, bytearray]] = {}
        users: dict[socket.socket, int | None] = {}  # whose each connection is, found once the queue was full
        lines: dict[int, Line] = {}
        try:
            while set(workers) - set(lines) and remaining(deadline) > 0:
                by_fd = {sock.fileno(): sock for sock in pending}
                for fd in descriptors.readable([listener.fileno(), *by_fd], remaining(deadline)):
                    if fd == listener.fileno():
                        self._challenge(listener, pending, users)
                        continue
                    sock = by_fd[fd]
                    if sock not in pending:  # the oldest, closed just now for the connection the listener took
                        continue
                    nonce, said = pending[sock]
                    try:
                        chunk = sock.recv(_PROOF.size - len(said))
                    except OSError:
                        chunk = b""
                    said += chunk
                    if chunk and len(said) < _PROOF.size:
                        continue
                    del pending[sock]
                    users.pop(sock, None)
                    worker, given = _PROOF.unpack(said) if len(said) == _PROOF.size else (-1, b"")
                    if (
                        worker in workers
                        and worker not in lines
                        and hmac.compare_digest(given, line_proof(key, prefix, worker, nonce))
                    ):
                        lines[worker] = make(worker, sock)
                    else:
                        log.warning("a connection to the line port did not prove itself as a worker; closed it")
                        sock.close()
        except BaseException:
            for line in lines.values():
                line.close(0.0)
            raise
        finally:
            for sock in pending:
                sock.close()
        return lines

    @staticmethod
    def _challenge(
        listener: socket.socket,
        pending: dict[socket.socket, tuple[bytes, bytearray]],
        users: dict[socket.socket, int | None],
    ) -> None:
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        nonce = secrets.token_bytes(NONCE_BYTES)
        try:
            sock.setblocking(False)
            sock.send(nonce)  # a fresh socket's buffer takes 16 bytes
        except OSError:
            sock.close()
            return
        pending[sock] = (nonce, bytearray())
        if len(pending) > MAX_UNPROVEN:  # the oldest of the user who holds the most goes
            users.update(tcp_peer_uids([s for s in pending if s not in users]))
            queue = list(pending)
            oldest = queue[crowded_out([users[s] for s in queue[:-1]], users[sock])]
            del pending[oldest]
            users.pop(oldest, None)
            oldest.close()

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


class Dialing:
    """A worker's line while the rendez-vous decides on it: connected at once, the sender's challenge answered
    on a thread of its own (the sender challenges once every worker said hello) while the worker waits for the
    verdict, which says whether the sender took the line.

    Args:
        address: the sender's line port.
        key, prefix: the run key and the run's prefix.
        worker: this worker's index.
        deadline: the latest the challenge may come.
        make: the line of the connected socket.
    """

    def __init__(
        self,
        address: tuple[str, int],
        key: bytes,
        prefix: str,
        worker: int,
        deadline: float,
        make: Callable[[socket.socket], Line],
    ) -> None:
        self._line: Line | None = None
        self._answered = threading.Event()
        self._worker = worker
        try:
            sock = socket.create_connection(address, timeout=max(min(remaining(deadline), CONNECT_S), 0.001))
        except OSError as exc:
            log.debug("worker %d: no line to the sender at %s:%d (%s)", worker, *address, exc)
            return
        self._line = make(sock)
        self._thread = threading.Thread(
            target=self._answer, args=(self._line, key, prefix, deadline), name="weightsync-line-dial", daemon=True
        )
        self._thread.start()

    def _answer(self, line: Line, key: bytes, prefix: str, deadline: float) -> None:
        try:
            nonce = line.read(NONCE_BYTES, deadline)
            line.send(_PROOF.pack(self._worker, line_proof(key, prefix, self._worker, nonce)), remaining(deadline))
            self._answered.set()
        except WeightSyncError as exc:  # (the line closed itself)
            log.debug("worker %d: the sender's line port did not take this line (%s)", self._worker, exc)

    def line(self, taken: bool) -> Line | None:
        """The line, where the sender ``taken`` it (its verdict says so: the answer went out before); else ``None``,
        and the connection is closed."""
        line = self._line
        if line is not None and taken and self._answered.wait(ANSWERED_WAIT_S):
            self._line = None
            self._thread.join(ANSWERED_WAIT_S)
            return line
        self.cancel()
        return None

    def cancel(self) -> None:
        """Give up the line (the rendez-vous failed, or went on without it); the thread ends at once."""
        line, self._line = self._line, None
        if line is not None:
            line.hang_up()  # (the thread's wait ends: the line is read to its end)
            self._thread.join(ANSWERED_WAIT_S)
            line.close(0.0)
