"""Under a scheme's ``delta``: the trainer's copy of the newest version, and which workers of a send are sent only
what changed since the version they hold (the others are sent it whole).

A worker gets changes only when the version it acked, and the last one sent to it, is the copy's: one that missed
versions, was sent a subset, was dropped or is rejoining gets the version whole. A worker that refuses changes
(:class:`~weightsync.errors.DeltaBaseError`: it does not hold that base) is sent the version whole by the same
send (:class:`~weightsync.core.sender.Sender` does that, told by :meth:`Changes.whole_again`).
"""

from __future__ import annotations

from typing import Any

from ..errors import ReceiverError, WeightSyncError
from ..integrity import digest
from ..tensors.delta_base import DeltaBase, wire_sources
from ..tensors.layout import FlatLayout
from .engine import Outgoing
from .ledger import Peer

__all__ = ["AUTO_WHOLE_SHARE", "Changes"]

#: Under ``delta="auto"``, a version whose changes take at least this share of its bytes goes whole: the few
#: bytes saved do not pay for the worker's work of applying them.
AUTO_WHOLE_SHARE = 0.9


class Changes:
    """The trainer's side of ``delta`` for one scheme, called by its sender in this order for each send:

    1) :meth:`plan`, before the engine stages the version: brings the copy up to it and gives it the changes
       for the workers that hold the copy's previous version;
    2) :meth:`unpublished` if the engine could not stage it (the copy is of a version never sent);
    3) :meth:`submitted` once the engine submitted it: :attr:`sent` says to whom changes went;
    4) :meth:`whole_again`, once the acks are collected (after an asynchronous send too): the version whole, for
       the workers that refused its changes.

    Args:
        options: the scheme's options, read at each send (``delta``: ``False``, ``True`` or ``"auto"``;
            ``checksum``: the workers check the base's digest, then the result's).
        layout: the versions' layout.
    """

    def __init__(self, options: Any, layout: FlatLayout) -> None:
        self.options = options
        self.layout = layout
        #: The newest version's bytes, which the next one is compared with (made at the first send under delta).
        self.base: DeltaBase | None = None
        self._digest: str | None = None  # the copy's checksum (under ``checksum``)
        #: The workers the last send sent only changes, and the bytes of those changes.
        self.sent: dict[int, int] = {}

    def plan(self, out: Outgoing, peers: dict[int, Peer], takes_deltas: bool) -> None:
        """Bring the copy up to ``out``, and give ``out`` the changes for the workers that acked the version it
        held, when that pays (``takes_deltas``: the engine can send changes)."""
        self.sent = {}
        mode = getattr(self.options, "delta", False)
        if not mode or not takes_deltas:
            return
        if self.base is None:
            self.base = DeltaBase(self.layout, track_writes=bool(getattr(self.options, "track_writes", False)))
        before = self.base.version
        most = int(AUTO_WHOLE_SHARE * self.layout.nbytes) if mode == "auto" else None
        sources = wire_sources(self.layout, out.flat)
        own = [key for key, tensor in sources.items() if tensor.data_ptr() == out.flat[key].data_ptr()]
        delta = self.base.update(sources, out.version, whole_if_larger=mode == "auto", most=most, own=own)
        # The workers sent the version whole get it from the copy too: the bytes the next changes are made from,
        # even where another thread steps the trainer's tensors while this send stages them.
        out.flat, out.whole = self.base.views, self.base.buffer
        checked = bool(getattr(self.options, "checksum", False))
        base_digest, self._digest = self._digest, digest([self.base.buffer]) if checked else None
        workers = [w for w in out.workers if before is not None and peers[w].acked == before == peers[w].sent]
        if delta is None or out.initial or not workers or (most is not None and delta.nbytes >= most):
            return
        delta.base_digest, delta.digest = base_digest, self._digest
        out.delta, out.delta_workers, out.published = delta, workers, self.base.buffer

    def unpublished(self) -> None:
        """The version :meth:`plan` brought the copy to was not sent: the next one fills it whole."""
        if self.base is not None:
            self.base.forget()

    def submitted(self, out: Outgoing) -> None:
        """``out`` was submitted: record who was sent its changes."""
        if out.delta is not None:
            self.sent = {w: out.delta.nbytes for w in out.delta_workers}

    def whole_again(self, failures: dict[int, WeightSyncError]) -> Outgoing | None:
        """The version the copy holds, whole (from the copy), for the workers of ``failures`` that refused its
        changes (taken out of ``failures`` and of :attr:`sent`), or ``None`` if none did. From the copy: it is the
        bytes the others were sent changes to, while the trainer's tensors may have moved on since (an
        asynchronous send's acks are collected after it returned; another thread may step meanwhile)."""
        version = self.base.version if self.base is not None else None
        refused = [w for w, e in failures.items() if version is not None and e.version == version and _refused_base(e)]
        if not self._taken_out(refused, failures) or self.base is None or version is None:
            return None
        return Outgoing(version, self.base.views, None, refused)

    def _taken_out(self, refused: list[int], failures: dict[int, WeightSyncError]) -> list[int]:
        """``refused``, taken out of ``failures`` and of :attr:`sent` (they are to be sent the version whole)."""
        for w in refused:
            del failures[w]
            self.sent.pop(w, None)
        return refused

    @staticmethod
    def moot(error: WeightSyncError, expected: int) -> bool:
        """Whether ``error`` is a refusal of an older version's changes than ``expected``, the version the worker
        waits for: that one goes to it whole (it does not hold the version the next changes are made from)."""
        return _refused_base(error) and error.version is not None and error.version < expected

    def close(self) -> None:
        """Let the copy go."""
        if self.base is not None:
            self.base.close()
        self.base = None


def _refused_base(error: WeightSyncError | None) -> bool:
    """Whether ``error`` is a worker's refusal of changes against a version it does not hold."""
    return isinstance(error, ReceiverError) and error.remote_type == "DeltaBaseError"
