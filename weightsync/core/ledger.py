"""What the sender knows of each worker: the last version sent and acked (and when), and whether it is gone."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..errors import ReceiverError, SyncTimeoutError, WeightSyncError, restated

__all__ = ["Ledger", "Peer"]


@dataclass
class Peer:
    """One worker, as the sender sees it."""

    sent: int | None = None
    acked: int | None = None
    #: ``time.perf_counter()`` when :attr:`acked` last moved (the per-worker ack times of send metrics).
    acked_at: float = float("-inf")
    #: The newest version a wait reported this worker timed out on (:meth:`Ledger.timeouts`).
    timed_out: int | None = None
    #: How many waits reported it timed out since it last acked a version it timed out on (:meth:`Ledger.late_again`).
    timeouts: int = 0
    #: The newest version whose call ended without an ack (the worker's failure of it, or the engine's own time-out
    #: of it: an RPC's): no ack of it comes.
    ended: int | None = None


@dataclass
class Ledger:
    """Per worker: versions sent and acked; the workers found gone (with the error that showed it); the
    failures found outside any wait, reported by the next call that targets the worker."""

    model_id: str | None
    peers: dict[int, Peer] = field(default_factory=dict)
    dead: dict[int, WeightSyncError] = field(default_factory=dict)
    errors: dict[int, WeightSyncError] = field(default_factory=dict)

    def ack(self, worker: int, held: int) -> None:
        peer = self.peers[worker]
        if peer.acked is None or held > peer.acked:
            peer.acked = held
            peer.acked_at = time.perf_counter()
            if peer.timed_out is None or held >= peer.timed_out:  # (an older version's ack: still late)
                peer.timeouts = 0
        error = self.errors.get(worker)
        if isinstance(error, SyncTimeoutError) and error.version is not None and error.version <= held:
            del self.errors[worker]  # (no ack of that version came in time, and now it has: no longer news)

    def failed(self, worker: int, error: WeightSyncError) -> None:
        """A failure found outside any wait, which the next call that targets ``worker`` reports. It also says no
        ack of its version comes (the worker failed it, or the engine's own call for it timed out): the worker is
        not late on that version (:meth:`late`)."""
        self.errors[worker] = error
        if error.version is not None:
            peer = self.peers[worker]
            peer.ended = max(error.version, peer.ended if peer.ended is not None else error.version)

    def unanswered(self, worker: int, error: SyncTimeoutError) -> None:
        """``worker``'s call for ``error.version`` gave up on its answer, which may still come (its engine asks for
        it): the worker is late on that version (:meth:`late`), as a wait that timed out on it finds it, and the
        next send that targets it names it so."""
        if error.version is not None:
            peer = self.peers[worker]
            peer.timed_out = max(error.version, peer.timed_out if peer.timed_out is not None else error.version)

    def held_up(self, workers: list[int]) -> None:
        """``workers`` held up a send's staging for its whole wait (no earlier version taken off the wire): each is
        late on the newest version sent to it."""
        for w in workers:
            peer = self.peers[w]
            if peer.sent is not None:
                peer.timed_out = max(peer.sent, peer.timed_out if peer.timed_out is not None else peer.sent)

    def resent(self, workers: list[int], version: int) -> None:
        """``version``, whose changes ``workers`` refused, is on its way to them again, whole: an ack of it can come
        (a refusal ended its call). Each was not late before the refusal (it was sent the version), so its earlier
        ended call, if one counted, was an older version's."""
        for w in workers:
            peer = self.peers[w]
            if peer.ended == version:
                peer.ended = version - 1 if version > 0 else None

    def has_acked(self, worker: int, version: int) -> bool:
        """``worker`` acked ``version`` or a later one."""
        acked = self.peers[worker].acked
        return acked is not None and acked >= version

    def live(self, workers: list[int]) -> list[int]:
        return [w for w in workers if w not in self.dead]

    def gone(self, workers: list[int], version: int | None = None) -> dict[int, WeightSyncError]:
        """Those of ``workers`` found gone, each with the error that showed it, fresh for this call to raise
        (:func:`~weightsync.errors.restated`), about ``version`` where given."""
        return {w: restated(self.dead[w], version) for w in workers if w in self.dead}

    def late(self, workers: list[int], version: int | None = None) -> dict[int, WeightSyncError]:
        """Those of ``workers`` still without their ack of a version a wait found them late on, each with a
        :class:`SyncTimeoutError` about ``version``: a send passes them by until they ack it. (Sent more, a
        worker that stopped would hold the buffers and slots of every version on its way to it, which engines
        keep while it may still read them, and starve the others once all are held.)"""
        return {
            w: SyncTimeoutError(
                f"passed by: still no ack for version {peer.timed_out}, which timed out (last acked: {peer.acked}); "
                "it is sent newer versions once it acks",
                model_id=self.model_id,
                worker_idx=w,
                version=version,
            )
            for w in workers
            if w not in self.dead
            and (peer := self.peers[w]).timed_out is not None
            and not self.has_acked(w, peer.timed_out)
            and (peer.ended is None or peer.ended < peer.timed_out)
        }

    def take_errors(self, workers: list[int] | dict[int, int]) -> dict[int, WeightSyncError]:
        """The failures found earlier for ``workers`` (each reported once: an engine's own time-out of a version,
        found after a wait reported that the worker timed out on it, or on a later one, was reported then)."""
        taken = {w: self.errors.pop(w) for w in list(self.errors) if w in workers}
        return {w: e for w, e in taken.items() if not self._reported(w, e)}

    def _reported(self, worker: int, error: WeightSyncError) -> bool:
        reported = self.peers[worker].timed_out
        timed_out = error.version if isinstance(error, SyncTimeoutError) else None
        return timed_out is not None and reported is not None and timed_out <= reported

    def missing(self, expected: dict[int, int], failures: dict[int, WeightSyncError]) -> list[int]:
        """Live workers of ``expected`` (none of ``failures``) that have not acked their version yet."""
        return [w for w, v in expected.items() if w not in failures and w not in self.dead and not self.has_acked(w, v)]

    def gone_before_acking(
        self, expected: dict[int, int], failures: dict[int, WeightSyncError]
    ) -> dict[int, WeightSyncError]:
        """Workers of ``expected`` recorded as gone without acking their version (one that acked, then left,
        did its part), with the error that named them."""
        return self.gone([w for w, v in expected.items() if w not in failures and not self.has_acked(w, v)])

    def answered(self, failures: dict[int, WeightSyncError]) -> None:
        """Workers of ``failures`` that said they failed the last version sent to them hold the one they acked: no
        ack of it is coming, and a later wait (``wait_async``, a staleness bound) is not for it."""
        for w, error in failures.items():
            peer = self.peers[w]
            if isinstance(error, ReceiverError) and error.version == peer.sent and w not in self.dead:
                peer.sent = peer.acked

    def keep_answers(self, failures: dict[int, WeightSyncError]) -> dict[int, WeightSyncError]:
        """``failures`` less the answers of workers with nothing left on its way to them (:meth:`answered` first:
        each failed the last version sent to it, and is not late), which are kept as failures found outside any
        wait: the next call that targets the worker reports them (or finds them moot: a refusal of changes, whose
        version goes whole). A failure of an older version, a later one on its way, stays a failure."""
        kept = {w: e for w, e in failures.items() if isinstance(e, ReceiverError) and self._idle(w)}
        for w, error in kept.items():
            self.errors.setdefault(w, error)
        return {w: e for w, e in failures.items() if w not in kept}

    def _idle(self, worker: int) -> bool:
        """Nothing is on its way to ``worker`` that it has not answered."""
        return self.peers[worker].sent == self.peers[worker].acked

    def renew(self, worker: int, sent: int | None) -> None:
        """``worker`` is a new process, sent ``sent``: alive, with no failure and no ack yet."""
        self.dead.pop(worker, None)
        self.errors.pop(worker, None)
        peer = self.peers[worker]
        peer.acked, peer.sent, peer.timed_out, peer.ended, peer.timeouts = None, sent, None, None, 0

    @staticmethod
    def overtaken(error: WeightSyncError, answered: int | None) -> bool:
        """Whether ``error`` is a time-out of a version older than ``answered``, a version whose answer from the
        worker came, or is waited for, and says what counts. Such a time-out comes from an engine's calls that gave
        up later than the send that timed out for them (the vLLM driver's)."""
        timed_out = error.version if isinstance(error, SyncTimeoutError) else None
        return timed_out is not None and answered is not None and timed_out < answered

    def timeouts(self, workers: list[int], expected: dict[int, int], within: str) -> dict[int, WeightSyncError]:
        """A :class:`SyncTimeoutError` for each of ``workers`` still without its ack of ``expected`` (recorded: the
        engine's own time-out of that version, found later, is the same failure)."""
        found: dict[int, WeightSyncError] = {
            w: SyncTimeoutError(
                f"no ack for version {expected[w]} within {within} (last acked: {self.peers[w].acked})",
                model_id=self.model_id,
                worker_idx=w,
                version=expected[w],
            )
            for w in workers
            if not self.has_acked(w, expected[w])
        }
        for w in found:
            self.peers[w].timed_out = max(expected[w], self.peers[w].timed_out or 0)
            self.peers[w].timeouts += 1
        return found

    def late_again(self, worker: int) -> bool:
        """Whether waits timed out on ``worker`` more than once with no ack from it in between: an engine that holds
        its later versions back (:attr:`~.engine.SenderEngine.passes_late_by` false) gave it one more send, for an
        outage that ends, and passes it by from then on (a hung worker cost each send its whole wait)."""
        return self.peers[worker].timeouts > 1
