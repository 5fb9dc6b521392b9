"""Store clients: a worker's connection to its sender's TCP store, dialled within a bound, its calls made where a
store that stops answering (its process stopped, its host gone) holds no caller past its bound."""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ..core.timing import as_timedelta, deadline_after, remaining, shown_seconds
from ..errors import ConnectionClosedError, SyncTimeoutError, first_line
from .network import addresses_of, await_listener, bound_silence, ip_of, store_address

__all__ = ["Hangup", "Probe", "StoreCalls", "Unanswered", "connect_store", "dial_store", "hung_up_at"]

log = logging.getLogger("weightsync.transports.store")

T = TypeVar("T")

#: How long past its deadline a block run :func:`hung_up_at` may still wait on its store (seconds).
HANGUP_GRACE_S = 0.5


def connect_store(host: str, port: int, timeout: float, silence: float | None = None, **where: Any) -> dist.Store:
    """A client of the TCP store at ``host:port``, waiting at most ``timeout`` for it to answer (saying at INFO
    what it waits for, when that takes more than a moment).

    ``silence``: the longest the store may leave a call unanswered once connected. A store whose host vanished
    (powered off, cut off) sends no reset, and torch's client would wait for its answer forever, past any
    timeout it was given; with ``silence``, the connection's kernel gives up (TCP keepalive and
    ``TCP_USER_TIMEOUT``, Linux) and the call fails with ``DistError``. A link down for less heals unseen.

    Raises:
        SyncTimeoutError: nothing answered within ``timeout``.
    """
    return dial_store(host, port, timeout, silence, **where)[0]


def dial_store(
    host: str, port: int, timeout: float, silence: float | None = None, **where: Any
) -> tuple[dist.Store, Hangup]:
    """:func:`connect_store`, and the :class:`Hangup` of the client's connection: for a client whose calls block
    a thread of its own, which nothing else wakes while its store is silent."""
    deadline = deadline_after(timeout)
    try:  # (the address its sender serves at, never another the name gives: one another user may listen on)
        address = store_address(host)
    except (OSError, UnicodeError):  # (a name that names nothing now: dialled as it is, ended by its own error)
        address = host
    # No dial of ours to that port (the host spelled any way) opens a connection meanwhile, a listener's probe
    # included: the connection the client opens is found as the one new connection to the port.
    dialing = _dialing(port)
    if not dialing.acquire(timeout=max(remaining(deadline), 0.001)):
        raise SyncTimeoutError(
            f"no TCP store answered at {host}:{port} within {shown_seconds(timeout)} (another dial to it did not end)",
            **where,
        )
    store, found, error = _client(address, port, deadline, timeout, dialing, where)
    if store is None:
        why = f": {first_line(error)}" if error is not None else ""
        raise SyncTimeoutError(
            f"no TCP store answered at {host}:{port} within {shown_seconds(timeout)}{why}", **where
        ) from error
    if len(found) > 1:  # torch's client opens one: another thread dialled the same store meanwhile
        log.debug("%d new connections to the store at %s:%d; none is taken as the client's", len(found), host, port)
        found = []
    hangup = Hangup(found)
    if silence is not None and not hangup.bound_silence(silence):
        log.warning(
            "the calls to the TCP store at %s:%d cannot be bounded here (its client's connection was not found): a "
            "store that stops answering holds them",
            host,
            port,
        )
    return store, hangup


def _client(
    host: str, port: int, deadline: float, timeout: float, dialing: threading.Lock, where: dict[str, Any]
) -> tuple[dist.Store | None, list[tuple[int, str]], BaseException | None]:
    """torch's client of the store at ``host:port``, made by ``deadline`` (``None`` where it was not, with why if
    torch said), and its connection(s), once something listens there (:func:`await_listener`, which raises if
    nothing does by ``deadline``: ``timeout``, for its message). Its constructor waits for the store's answer to
    its first word with no bound (a store whose process is stopped still has its connections taken by the
    kernel), so it runs on a thread of its own, and a connection it opened and left unanswered at the deadline is
    shut down, which ends it. ``dialing`` (held) is released once: where this fails before that thread runs, else
    by the thread once it ended: one it could not end holds it, and later dials to the port fail within their bound."""
    made: dict[str, Any] = {}
    handed = threading.Lock()  # taken once, by the thread as it runs or by a failure before: that one releases

    def make() -> None:
        if not handed.acquire(blocking=False):  # (its start was interrupted, and that released ``dialing``)
            return
        try:
            made["store"] = dist.TCPStore(host, port, is_master=False, timeout=own)
            made["found"] = _connections_to(addresses, port, since=before)
        except Exception as exc:  # noqa: BLE001 - torch's reason, told the caller
            made["error"] = exc
        finally:
            dialing.release()

    try:  # (until its thread runs, nothing else releases ``dialing``)
        await_listener(host, port, deadline, timeout, "TCP store", **where)
        addresses, before = addresses_of(host, port), _open_fds()
        left = remaining(deadline)
        own = as_timedelta(left - min(0.25, left / 10))  # (ends first: no retry of its own starts at the deadline)
        thread = threading.Thread(target=make, name=f"weightsync-store-dial-{port}", daemon=True)
        thread.start()
    except BaseException:  # (an interrupt in ``thread.start()`` may come once the thread runs: it releases then)
        if handed.acquire(blocking=False):
            dialing.release()
        raise
    thread.join(max(remaining(deadline), 0.001))
    if thread.is_alive():  # (a retry it made meanwhile, on a connection of its own, is shut down too)
        ends = deadline_after(1.0)
        while thread.is_alive() and remaining(ends) > 0:
            Hangup(_connections_to(addresses, port, since=before))()
            thread.join(0.05)
        return None, [], None
    return made.get("store"), made.get("found", []), made.get("error")


class Hangup:
    """Shuts down the TCP connection(s) of one store client, found by :func:`dial_store` (torch's client does not
    expose them): a call blocked on the client fails at once (``DistError``), and so does every later call.
    Calling it is the client's end; nothing closes its descriptors but torch, when the client goes away.

    Args:
        connections: each connection's descriptor and what ``/proc/self/fd`` named it when found (a descriptor
            closed meanwhile, its number maybe reused, is left alone).
    """

    def __init__(self, connections: list[tuple[int, str]]) -> None:
        self.connections = connections

    def _sockets(self) -> list[socket.socket]:
        """A second descriptor of each connection still open (the caller closes them)."""
        found = []
        for fd, what in self.connections:
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != what:
                    continue
                found.append(socket.socket(fileno=os.dup(fd)))
            except OSError:  # closed meanwhile
                continue
        return found

    def bound_silence(self, seconds: float) -> bool:
        """:func:`~.network.bound_silence` on each connection; ``False`` where there was none to bound."""
        bounded = 0
        for sock in self._sockets():
            with sock:
                bounded += bound_silence(sock, seconds)
        return bounded > 0

    def __call__(self) -> bool:
        """Shut the connections down; ``False`` where none was found (not Linux: the caller wakes its thread
        another way)."""
        shut = 0
        for sock in self._sockets():
            with sock, contextlib.suppress(OSError):  # already shut by its peer
                sock.shutdown(socket.SHUT_RDWR)
                shut += 1
        return shut > 0


def hung_up_at(hangup: Hangup, deadline: float, what: str, **where: Any) -> _HungUpAt:
    """A context that runs its block with its store client's connection shut down (``hangup``) if the block still
    runs a moment past ``deadline`` (the block's own bounded waits say first what they waited for): a store whose
    process is stopped leaves every call of torch's client unanswered with no bound, and the call then fails
    (``DistError``).

    Raises:
        SyncTimeoutError: the connection was shut down (the client is done), whatever the block raised (an
            ``Exception``: an interrupt or an exit goes on as it is) or not.
    """
    return _HungUpAt(hangup, deadline, f"{what}: the store did not answer in time; is its process stopped?", where)


class _HungUpAt:
    def __init__(self, hangup: Hangup, deadline: float, message: str, where: dict[str, Any]) -> None:
        self.hangup, self.message, self.where = hangup, message, where
        self.fired = False
        self.timer = threading.Timer(remaining(deadline) + HANGUP_GRACE_S, self._fire)
        self.timer.daemon = True

    def _fire(self) -> None:
        self.fired = True
        self.hangup()

    def __enter__(self) -> None:
        self.timer.start()

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        self.timer.cancel()
        self.timer.join()  # (a hangup under way ends first: read after it, ``fired`` is final)
        if not self.fired or (exc is not None and not isinstance(exc, Exception)):
            return
        raise SyncTimeoutError(self.message, **self.where) from exc


class Probe:
    """Asks a store, on a thread of its own, whether it still answers. A store whose process is stopped (a
    debugger, ``SIGSTOP``) keeps its connections and the kernel acknowledges what is sent to it, so torch's client
    waits for the answer with no bound: the caller, whose own wait is bounded, must not be the one asking. (A
    store whose host vanished fails the check once the connection's silence is bounded: :meth:`Hangup.bound_silence`.)

    Calling the probe never blocks: it starts a check unless one is out, and says why the store is gone (a check
    failed), or ``None``: it answered, or has not yet.

    Args:
        store: the client to ask (torch's client serialises its calls: another call on it waits behind a check
            that is out).
        hangup: its connection's :class:`Hangup`, which :meth:`close` calls when a check is still out.
        name: the thread's name.
    """

    KEY = "weightsync-probe"

    def __init__(self, store: dist.Store, hangup: Hangup, name: str) -> None:
        self.store, self.hangup, self.name = store, hangup, name
        self._lock = threading.Lock()
        self._out = False
        self._failed: str | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def __call__(self) -> str | None:
        with self._lock:
            if self._failed is None and not self._out and not self._closed:
                self._out = True
                self._thread = threading.Thread(target=self._check, name=self.name, daemon=True)
                self._thread.start()
            return self._failed

    @property
    def out(self) -> bool:
        """A check is out, unanswered so far."""
        with self._lock:
            return self._out

    def _check(self) -> None:
        failed = None
        try:
            self._ask()
        except (RuntimeError, dist.DistError) as exc:
            failed = first_line(exc)
        with self._lock:
            self._out, self._failed = False, failed

    def _ask(self) -> None:  # one check, in the probe's thread: raises where the store does not answer
        self.store.check([self.KEY])

    def settle(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) for the check that is out, if one is; whether none is out now (a store that
        answers, however slowly, comes back: one stopped does not)."""
        with self._lock:
            thread = self._thread if self._out else None
        if thread is not None:
            thread.join(timeout)
        return not self.out

    def close(self, timeout: float) -> None:
        """End the check that is out, if one is (its store's connection is shut down: the store's client is
        done), and wait for the thread, at most ``timeout`` seconds. No check starts after this (a receive that
        overlaps the end asks nothing)."""
        with self._lock:
            self._closed, thread = True, self._thread
        if thread is None:
            return
        if self.out:
            self.hangup()
        thread.join(timeout)


class Unanswered(SyncTimeoutError):
    """A store call that :class:`StoreCalls` made did not end in time (it goes on, unwaited for)."""


class _Call:
    """One call :class:`StoreCalls` makes, and how it ended."""

    def __init__(self, call: Callable[[], Any], key: object, posted: bool = False, discard: Any = None) -> None:
        self.call, self.key, self.posted, self.discard = call, key, posted, discard
        self.started = self.ended = False
        self.waiting = 0  # callers waiting for its end
        self.value: Any = None
        self.error: BaseException | None = None

    def dropped(self) -> None:
        """It ended and nobody will take what it made: ``discard`` that (a rejoin's group and doorbell)."""
        if self.discard is not None and self.error is None and self.value is not None:
            try:
                self.discard(self.value)
            except Exception:  # noqa: BLE001 - best effort: what it made is of no use to anyone
                log.debug("discarding what an untaken store call made failed", exc_info=True)


class StoreCalls:
    """Makes a store client's calls on a thread of its own, in the order they come, each caller waiting at most
    until its deadline. A store whose process is stopped (a debugger, ``SIGSTOP``) leaves torch's client waiting
    for an answer with no bound (:class:`Probe`), and every other call on that client waits behind it: the caller
    of a bounded receive must not be the one waiting.

    A call its caller stopped waiting for still ends when the store answers. A call asked with a ``key`` (a look
    for one message) is not asked twice: the next caller with that key waits for the one already made, and takes
    what it found (what it found is taken once; finding nothing, or having been taken, a new one is made). A
    store slower than the callers' bounds then still delivers what it holds.

    Args:
        hangup: the client's connection's :class:`Hangup`, which :meth:`close` calls when a call is still out.
        name: the thread's name.
    """

    #: How long the idle thread waits for a call before it ends (the next call starts it again; seconds).
    IDLE_S = 1.0
    #: How long :meth:`close` lets a call still out end before it shuts the connection down (seconds).
    GRACE_S = 0.2

    def __init__(self, hangup: Hangup | None, name: str) -> None:
        self.hangup, self.name = hangup, name
        self._cond = threading.Condition()
        self._queue: collections.deque[_Call] = collections.deque()  # the calls to make, the one out first
        self._keyed: dict[object, _Call] = {}  # per key, the call made last whose caller did not take its end
        self._thread: threading.Thread | None = None
        self._closed = False

    def ask(
        self, call: Callable[[], T], deadline: float, what: str, key: object = None, discard: Any = None, **where: Any
    ) -> T:
        """``call()`` made on the thread (after the calls before it); what it returned, or raises what it raised.
        ``discard(value)``, for a keyed call: what to do with what it returned if nobody takes it (the next call
        asked has another key, or the calls close).

        Raises:
            Unanswered: it did not end by ``deadline``; says ``what`` was asked.
            ConnectionClosedError: the calls were closed.
        """
        with self._cond:
            stale = [made for k, made in self._keyed.items() if made.ended and not made.waiting and k != key]
            for made in stale:
                del self._keyed[made.key]  # (a look for a message that came another way)
            job = self._keyed.get(key) if key is not None else None
            if job is None or (job.ended and (job.value is None or job.error is not None)):
                job = self._start(call, key, discard=discard)  # (a look that found nothing, or failed, is made again)
                if key is not None:
                    self._keyed[key] = job
            job.waiting += 1
            try:
                ended = self._cond.wait_for(lambda: job.ended, max(remaining(deadline), 0.0))
            finally:
                job.waiting -= 1
            if ended and key is not None and self._keyed.get(key) is job:
                del self._keyed[key]  # taken
        for made in stale:
            made.dropped()
        if not ended:
            raise Unanswered(f"the sender's store did not answer ({what}); is its process stopped?", **where)
        if job.error is not None:
            raise job.error
        return job.value

    def post(self, call: Callable[[], Any]) -> None:
        """Make ``call()`` on the thread, after the calls before it, and return at once (what it returns or raises
        is dropped: it says so itself). Raises ConnectionClosedError once closed."""
        with self._cond:
            self._start(call, None, posted=True)

    @property
    def busy(self) -> bool:
        """A call is out (another call on the same client would wait behind it)."""
        with self._cond:
            return bool(self._queue) and self._queue[0].started

    def _start(self, call: Callable[[], Any], key: object, posted: bool = False, discard: Any = None) -> _Call:
        if self._closed:
            raise ConnectionClosedError(f"{self.name}: the store's client was closed")
        job = _Call(call, key, posted, discard)
        self._queue.append(job)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._cond.notify_all()
        return job

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: self._closed or bool(self._queue), self.IDLE_S):
                    self._thread = None  # idle: the next call starts one again
                    return
                if not self._queue:  # closed, every write posted before made
                    return
                job = self._queue[0]
                job.started = True
            try:
                job.value = job.call()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
                job.error = exc
            with self._cond:
                job.ended = True
                self._queue.popleft()
                self._cond.notify_all()
                untaken = self._closed and not job.waiting and self._keyed.get(job.key) is job
                if untaken:  # (ended after the close: nobody asks for it again)
                    del self._keyed[job.key]
            if untaken:
                job.dropped()

    def close(self, timeout: float) -> None:
        """No call is taken after this, and the calls asked and not made yet are not (their callers hear why at
        once); the writes posted are made, for a moment: then a call still out is ended (its store's connection is
        shut down: the client is done, and the writes left fail at once); the thread is waited for, at most
        ``timeout`` seconds."""
        with self._cond:
            self._closed, thread = True, self._thread
            for job in [job for job in self._queue if not job.started and not job.posted]:
                job.error, job.ended = ConnectionClosedError(f"{self.name}: closed"), True
                self._queue.remove(job)
            untaken = [job for job in self._keyed.values() if job.ended and not job.waiting]
            for job in untaken:
                del self._keyed[job.key]
            self._cond.notify_all()
        for job in untaken:  # (a call that ends later is dropped as it ends)
            job.dropped()
        with self._cond:
            # (calls to a store that answers end in a moment: the connection is shut only under one that does not)
            out = not self._cond.wait_for(lambda: not self._queue, min(timeout, self.GRACE_S))
        if thread is None:
            return
        if out and self.hangup is not None:
            self.hangup()
        thread.join(timeout)


def _open_fds() -> set[tuple[int, str]]:
    """This process's descriptors, each with what it refers to (a number is reused once closed: listing them
    takes one)."""
    found: set[tuple[int, str]] = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:  # not Linux: no bound
        return found
    for fd in fds:
        try:
            found.add((int(fd), os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # the listing's own descriptor, closed by now
            continue
    return found


_dials_guard = threading.Lock()
_dials: dict[int, threading.Lock] = {}


def _dialing(port: int) -> threading.Lock:
    """The lock this process's dials to ``port`` take in turn (whatever host they name, and however they spell it),
    so that each finds its own connection."""
    with _dials_guard:
        return _dials.setdefault(port, threading.Lock())


def _connections_to(
    addresses: set[ipaddress.IPv4Address | ipaddress.IPv6Address], port: int, since: set[tuple[int, str]]
) -> list[tuple[int, str]]:
    """The TCP connections to ``port`` at one of ``addresses`` this process opened after ``since`` (its
    descriptors then), each as its descriptor and what ``/proc/self/fd`` names it."""
    found = []
    for fd, what in sorted(_open_fds() - since):
        try:
            sock = socket.socket(fileno=os.dup(fd))  # a second descriptor of the same socket
        except OSError:  # not a socket, or closed meanwhile
            continue
        with sock:
            try:
                peer = sock.getpeername() if sock.type == socket.SOCK_STREAM else None
            except OSError:  # not connected
                continue
        if not isinstance(peer, tuple) or len(peer) < 2 or peer[1] != port or ip_of(str(peer[0])) not in addresses:
            continue  # not a TCP connection to that store (a Unix socket's peer is a string)
        found.append((fd, what))
    return found
