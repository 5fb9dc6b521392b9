"""A receiver's model bound to one storage laid out like the weights buffer: :class:`BoundModel`.

Once every tensor of the model is a view of one storage, in the place the
:class:`~weightsync.layout.FlatLayout` gives it, an update reaches all of them
at once, whatever their number: one copy into that storage (multiprocess), or
one swap of the memory behind it (shared_mem). Binding re-points each tensor
(``tensor.data = view``: about 1.2 us a tensor, 2.4 ms for 2000), which is paid
once, not at every update.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .strategy import write_into

if TYPE_CHECKING:
    from .layout import FlatLayout

__all__ = ["BoundModel"]


class BoundModel:
    """The model's tensors as views of one CPU storage (``storage``), or nothing bound yet."""

    def __init__(self) -> None:
        self.storage: torch.UntypedStorage | None = None
        #: Typed views of :attr:`storage`, one per key: what the model's tensors are.
        self.views: dict[str, torch.Tensor] = {}
        self._tensors: list[torch.Tensor] = []
        self._offsets: list[int] = []

    def holds(self, dst: dict[str, torch.Tensor]) -> bool:
        """Whether ``dst`` (the model's tensors, as walked now) is, tensor for tensor, what was bound, and each
        still views the storage where it was put: nothing the user replaced, moved or re-pointed since.
        About 0.12 us a tensor; the caller has checked the keys, shapes and dtypes."""
        if self.storage is None or len(dst) != len(self._tensors):
            return False
        base = self.storage.data_ptr()
        for tensor, bound, offset in zip(dst.values(), self._tensors, self._offsets):
            if tensor is not bound or tensor.data_ptr() - base != offset:
                return False
        return True

    def bind(
        self, dst: dict[str, torch.Tensor], storage: torch.UntypedStorage, layout: FlatLayout
    ) -> torch.UntypedStorage | None:
        """Point every tensor of ``dst`` (all on the CPU, checked against ``layout``) at its view of ``storage``,
        which holds the weights as ``layout`` places them. Returns the storage bound before, if another."""
        views = self.views if storage is self.storage else layout.views(torch.empty(0, dtype=torch.uint8).set_(storage))
        write_into(dst, views, share=True)
        previous = self.storage if self.storage is not storage else None
        self.storage, self.views = storage, views
        base = storage.data_ptr()
        self._tensors = list(dst.values())
        self._offsets = [tensor.data_ptr() - base for tensor in self._tensors]
        return previous

    def swap(self, storage: torch.UntypedStorage) -> None:
        """Give the bound tensors ``storage``'s memory, and ``storage`` theirs (same size): O(1).

        ``UntypedStorage._swap_data_ptr_`` is what torch's own FSDP and CUDA-graph trees use to move tensors
        between buffers; the tensors, their views and the storage object stay, only the memory changes."""
        assert self.storage is not None
        self.storage._swap_data_ptr_(storage)

    def release(self) -> None:
        """Give the bound storage private memory holding the same bytes (one copy), and forget it: the memory it
        had (a shared slot) is then held only by whoever else holds it."""
        if self.storage is not None:
            private = torch.UntypedStorage(self.storage.nbytes())
            private.copy_(self.storage)
            self.storage._swap_data_ptr_(private)  # `private` now holds the old memory, freed with it
        self.forget()

    def forget(self) -> None:
        self.storage, self.views, self._tensors, self._offsets = None, {}, [], []
