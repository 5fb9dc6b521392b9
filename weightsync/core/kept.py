"""Under ``delta``: a worker's copy of the bytes of the version it holds, which the next version's changes are
applied to (:class:`KeptCopy`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import DeltaBaseError
from ..integrity import digest
from ..tensors.copies import copy_tensors, write_into
from ..tensors.delta import SAME, Chunk, apply_delta, changed_spans, chunks_of, np_word
from ..tensors.kernels import prepare_writes
from ..tensors.layout import FlatLayout
from ..tensors.written import open_tracker
from .engine import Delivery

__all__ = ["UNPROTECT_MIN_BYTES", "KeptCopy"]

#: Under ``track_writes``, a run of bytes this long or longer is unprotected in one call before an update writes it
#: (about 3 ms for 100 MB, where a fault per 4 KB page costs about 14).
UNPROTECT_MIN_BYTES = 256 << 10


class KeptCopy:
    """The bytes of the version a worker holds, as they travelled (the sender's), and which version they are.

    The receiver keeps each version it applies here (:meth:`keep`); changes against it make the next version
    whole in this copy (:meth:`whole_version`), nothing of the model written. Under ``track_writes``
    (``track_writes=True``) the kernel also records the model's pages its program wrote since an update, so that
    such a version is written into the model as the chunks that changed and those pages (:meth:`write_changes`).
    """

    def __init__(self, track_writes: bool) -> None:
        #: The copy (the layout's buffer), its views and its chunks; ``None`` until a version was kept.
        self.buffer: torch.Tensor | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._chunks: list[Chunk] = []
        #: The version the copy holds whole (``None``: none, or one not applied yet).
        self.version: int | None = None
        self.tracker = open_tracker() if track_writes else None

    def whole_version(self, update: Delivery, held: int | None, where: dict[str, Any]) -> Delivery:
        """The whole version ``update``'s changes make of the version this worker holds (``held``): the copy, with
        the changes written in. Nothing of the model is written.

        Raises:
            DeltaBaseError: the changes are against another version than the one kept here (none kept, a version
                whose apply failed, or bytes other than the sender's under ``checksum``).
            ConfigurationError: the changes do not fit the layout.
        """
        delta = update.delta
        assert delta is not None
        kept, self.version = self.version, None  # until the version made here is applied
        buffer = self.buffer
        if buffer is None or kept is None or delta.base != kept or kept != held:
            raise DeltaBaseError(
                f"the update holds the changes from version {delta.base}, and this worker holds {held} "
                f"(the bytes kept to apply changes to: {kept}): refused, nothing written",
                **where,
            )
        if delta.base_digest is not None and digest([buffer]) != delta.base_digest:
            raise DeltaBaseError(
                f"the update holds the changes from version {delta.base}, and the copy of that version kept here "
                "does not hash to the sender's: refused, nothing written",
                **where,
            )
        apply_delta(buffer, self._chunks, delta)
        changed: list[tuple[int, int]] = []  # (the chunks that changed, merged)
        for chunk, kind in zip(self._chunks, delta.kinds):
            if kind != SAME:
                if changed and changed[-1][1] == chunk.start:
                    changed[-1] = (changed[-1][0], chunk.end)
                else:
                    changed.append((chunk.start, chunk.end))
        return Delivery(update.version, [(0, buffer)], delta.digest, token=update.token, changed=changed)

    def keep(self, update: Delivery, layout: FlatLayout, views_of: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Copy the bytes of ``update`` (checked, about to be applied; ``views_of()``: its typed views), tensor by
        tensor, into the copy (the padding stays zero, as the sender's copy's)."""
        if self.buffer is None or self.buffer.numel() != layout.nbytes:
            self.buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
            self._views, self._chunks = layout.views(self.buffer), chunks_of(layout)
            prepare_writes(np_word(chunk) for chunk in self._chunks)  # (the version kept first, at connect, pays)
        if update.pieces and update.pieces[0][1].data_ptr() == self.buffer.data_ptr():
            return  # made here from changes: the copy holds it already
        self.version = None
        write_into(self._views, views_of())

    def write_changes(self, dst: dict[str, torch.Tensor], update: Delivery, layout: FlatLayout) -> bool:
        """Under ``track_writes``, an update made here from changes: write into the model's tensors ``dst`` only
        the chunks that changed and the pages its program wrote since the last update (the rest holds the version
        it is made from); whether it did (``False``: the update is to be placed whole)."""
        if self.tracker is None or update.changed is None:
            return False
        (offset, buffer), *others = update.pieces
        if offset or others or buffer.numel() != layout.nbytes:
            return False
        spans = changed_spans(dst, buffer, layout, update.changed, self.tracker.written(dst))
        if spans is None:
            return False
        targets, sources = spans
        # (its pages open first, in one call, where it is more than a few: a write to a protected page faults)
        self.tracker.unprotect([t for t in targets if t.numel() >= UNPROTECT_MIN_BYTES])
        copy_tensors(targets, sources)
        self.tracker.protect(targets)  # (the program's writes elsewhere since the scan above still show next time)
        return True

    def written(self, tensors: Callable[[], dict[str, torch.Tensor]]) -> None:
        """The model's tensors (``tensors()``, walked only under ``track_writes``) were just written whole: protect
        them again (the program's writes show from here on)."""
        if self.tracker is not None:
            self.tracker.written(tensors())

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
