"""A worker's doorbell: the sender rings it with each message it announces in the store, so that a worker
waiting for the next announcement looks at once instead of polling the store on a back-off.

A ring is a push to a queue of the store (``bell/<worker>``, under the transport's prefix). A thread of the
worker's, on a store client of its own, blocks popping that queue and counts the rings; the worker waits on that
count, with its own timeout, and looks whenever it moves. A ring carries a copy of the sealed announcement the
sender just wrote to the store, which saves the worker the store's round trips to read it (three: torch's ``get``
waits for the key first): the worker takes it only if it opens with the run key under the very key it expects
(:meth:`~weightsync.transports.distributed.auth.Sealer.open`, as the store's copy must), and otherwise reads
the store as without it. Anyone who reaches the store may ring, with anything (the worker finds nothing it
expects, and waits again; at most :data:`KEPT` rings of at most :data:`MAX_SAID_BYTES` are kept), or take a ring
away (the worker then looks at its next periodic look: late, never wrong).

Why not a message on the process group, or the store's own wait:

- a receive posted on a gloo group cannot be taken back. Nothing wakes a thread waiting on one (``abort()``,
  ``shutdown()`` or dropping the group leave it blocked, and the process aborts at exit), and one left waiting past
  the group's operation timeout closes every connection of the group: an idle worker would lose its group;
- a store wait that times out logs two warnings of torch's: waiting on the store in short slices floods the logs.
  The bell's thread waits in one long slice (:data:`IDLE_S`) and is woken at close by a ring of the worker's own.

A bell whose ring cannot wake it (its store is gone or silent) is woken by shutting its client's connection down
(:class:`~weightsync.transports.storeclient.Hangup`), and every bell still listening when the process exits is closed
first, rung awake where it can be (an ``atexit`` callback; a bell made later is closed as it is made): a thread
left blocked in torch's store client would otherwise see its call fail while the interpreter is being torn down,
and CPython 3.11 ends such a thread by unwinding it through C++ code that may not be unwound, which aborts the
process (``terminate called without an active exception``).
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ...core.timing import as_timedelta
from ...errors import WeightSyncError, first_line
from ..storeclient import Hangup, StoreCalls, dial_store

if TYPE_CHECKING:
    from .group import Link

__all__ = ["IDLE_S", "KEPT", "LAST", "MAX_SAID_BYTES", "Doorbell", "dial_doorbell", "ring"]

log = logging.getLogger("weightsync.transports.distributed")

#: The longest one wait of the bell's thread (its store client's timeout): an idle worker's thread times out,
#: and torch logs it, this seldom.
IDLE_S = 3600.0
#: What the sender's last ring says (it said goodbye, or dropped the worker): the thread stops listening, so that
#: the sender's store going away next leaves it nothing to fail on. A stranger's ``LAST`` only slows the worker
#: down to its periodic looks.
LAST = b"last"
#: Seconds :meth:`Doorbell.close` waits for the thread to end once it rang the bell itself, and again once it
#: hung up the bell's connection.
CLOSE_WAIT_S = 2.0
#: The most rings whose content a bell keeps until the worker looks (the newest), and the largest it keeps: an
#: announcement is a few hundred bytes (a delta's description, a few bytes per 4 MB of the model), and one that
#: is not kept is read from the store.
KEPT = 8
MAX_SAID_BYTES = 1 << 20


def ring(store: dist.Store, key: str, last: bool = False, said: bytes = b"") -> None:
    """Ring the doorbell at ``key`` of ``store`` with ``said`` (the sealed announcement just written; ``last``:
    the sender's last word to that worker)."""
    store.queue_push(key, LAST if last else said)


class Doorbell:
    """Counts the rings of the doorbell at ``key``, popped on a thread of its own from ``client``.

    Args:
        client: a store client for this bell alone (its calls block the thread), its timeout :data:`IDLE_S`, under
            the same prefix as the store the sender rings.
        key: the bell's key.
        name: the thread's name.
        hangup: shuts ``client``'s connection down (:func:`~weightsync.transports.storeclient.dial_store`), for a close
            whose ring cannot wake the thread.
        ringer: another client of the same store (same prefix), through which :meth:`close` rings the bell to wake
            the thread.
        ringer_busy: whether a call on ``ringer`` is out (a ring would wait behind it: the store may be stopped);
            :meth:`close` then hangs up instead.
    """

    def __init__(
        self,
        client: dist.Store,
        key: str,
        name: str,
        hangup: Hangup | None = None,
        ringer: dist.Store | None = None,
        ringer_busy: Callable[[], bool] | None = None,
    ) -> None:
        self._client: dist.Store | None = client
        self._hangup = hangup
        self._ringer, self._ringer_busy = ringer, ringer_busy
        self.key = key
        self.rings = 0
        #: Why the thread stopped listening (the store went away, the sender's last ring, close): ``None`` while
        #: it listens.
        self.ended: str | None = None
        self._said: deque[bytes] = deque(maxlen=KEPT)
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._listen, name=name, daemon=True)
        self._thread.start()
        with _guard:
            closing = _exiting
            if not closing:
                _listening.add(self)
        if closing:  # made after the exit's callback closed the others
            self.close()

    def _listen(self) -> None:
        client = self._client
        assert client is not None
        while True:
            try:
                said = client.queue_pop(self.key, True)
            except dist.DistStoreError:  # IDLE_S without a ring: wait again
                if self.ended is None:
                    continue
                return
            except dist.DistError as exc:  # the store went away: the worker's next look at it says so
                self._end(f"the store went away ({first_line(exc)})")
                return
            with self._cond:
                if self.ended is not None:  # closed: the ring was the worker's own
                    return
                self.rings += 1
                if said and said != LAST and len(said) <= MAX_SAID_BYTES:
                    self._said.append(said)
                self._cond.notify_all()
            if said == LAST:
                self._end("the sender's last ring")
                return

    def _end(self, why: str) -> None:
        with self._cond:
            if self.ended is None:
                self.ended = why
            self._cond.notify_all()

    def take(self, check: Callable[[bytes], object]) -> bytes | None:
        """The oldest thing a ring carried that ``check`` accepts (it raises a :class:`WeightSyncError` for what it
        refuses: anyone may ring), taken out of those kept; ``None`` if none is."""
        with self._cond:
            for said in self._said:
                try:
                    check(said)
                except WeightSyncError:
                    continue
                self._said.remove(said)
                return said
        return None

    def wait(self, seen: int, timeout: float) -> None:
        """Wait until the bell rang since the count was ``seen``, at most ``timeout`` seconds (at once if it stopped
        listening: the caller then looks on its own)."""
        with self._cond:
            self._cond.wait_for(lambda: self.rings != seen or self.ended is not None, timeout)

    def close(self) -> None:
        """Stop listening: ring the bell through its ``ringer`` to wake the thread, and wait for it a moment; a
        thread the ring did not wake (the store is gone or silent, or no ``ringer``) is woken by hanging up the
        bell's own connection (torch then logs the failed call as a warning)."""
        self._end("closed")
        with _guard:
            _listening.discard(self)
        ringer, self._ringer = self._ringer, None
        if self._thread.is_alive() and ringer is not None and not (self._ringer_busy and self._ringer_busy()):
            try:
                ring(ringer, self.key)
            except dist.DistError as exc:  # the store is gone: the ring wakes nothing
                log.debug("could not ring the doorbell %r to close it: %s", self.key, first_line(exc))
            else:
                self._thread.join(CLOSE_WAIT_S)
        if self._thread.is_alive() and self._hangup is not None and self._hangup():
            self._thread.join(CLOSE_WAIT_S)
        if self._thread.is_alive():
            log.warning(
                "the doorbell %r is still waiting on its store; it ends with its connection (a process that exits "
                "before then may abort)",
                self.key,
            )
        self._client = None


#: The bells still listening, closed before the process exits (:func:`_close_listening`), and whether it did.
_listening: weakref.WeakSet[Doorbell] = weakref.WeakSet()
_exiting = False
_guard = threading.Lock()


@atexit.register
def _close_listening() -> None:
    """Close every bell still listening, while its thread can still end as threads do (``atexit`` callbacks run
    before the interpreter's teardown)."""
    global _exiting
    with _guard:
        _exiting = True
        bells = list(_listening)
    for bell in bells:
        try:
            bell.close()
        except Exception as exc:  # noqa: BLE001 - the others are closed all the same
            log.warning("could not close the doorbell %r as the process exits: %s", bell.key, first_line(exc))


def dial_doorbell(
    address: tuple[str, int],
    prefix: str,
    link: Link,
    timeout: float,
    silence: float,
    calls: StoreCalls | None,
    **where: Any,
) -> Doorbell:
    """A worker's doorbell in ``link``'s store, on a store client of its own (its thread blocks on it), connected
    to the store at ``address`` within ``timeout``, its keys under ``prefix`` (and the pair's scope, for a rejoined
    worker); ``silence``: the longest the store may leave its connection silent (:func:`~..store.dial_store`);
    ``calls``: where the worker's calls on ``link``'s store client are made (a close rings only where none is out).
    """
    w = where["worker_idx"]
    client, hangup = dial_store(*address, max(timeout, 1.0), silence=silence, **where)
    client.set_timeout(as_timedelta(IDLE_S))
    store: dist.Store = dist.PrefixStore(prefix, client)
    assert link.sealer is not None
    if link.sealer.scope:  # a rejoined worker's pair: its keys lie under the pair's scope, as its sealer's do
        store = dist.PrefixStore(link.sealer.scope.rstrip("/"), store)
    busy = None if calls is None else (lambda: calls.busy)  # (the ringer is the store client the calls use)
    name = f"weightsync-{where['model_id']}-doorbell{w}"
    return Doorbell(store, f"bell/{w}", name, hangup, ringer=link.store, ringer_busy=busy)
