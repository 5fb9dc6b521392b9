"""A model bound to one storage laid out like the weights buffer: :class:`BoundModel`.

Once every tensor of a model is a view of one storage, in the place the
:class:`~weightsync.layout.FlatLayout` gives it, an update reaches all of them
at once, whatever their number: one copy into that storage (multiprocess), or
one swap of the memory behind it (shared_mem); and a sender bound that way
(``flatten_sender``) publishes with one copy out of it. Binding re-points each tensor
(``tensor.data = view``: about 1.2 us a tensor, 2.4 ms for 2000), which is paid
once, not at every update.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch

from .strategy import write_into

if TYPE_CHECKING:
    from .layout import FlatLayout

__all__ = ["BoundModel"]

_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")


class BoundModel:
    """A model's tensors as views of one CPU storage (``storage``), or nothing bound yet."""

    def __init__(self) -> None:
        self.storage: torch.UntypedStorage | None = None
        #: Typed views of :attr:`storage`, one per key: what the model's tensors are.
        self.views: dict[str, torch.Tensor] = {}
        #: :attr:`storage` as one uint8 tensor: where an update is copied to, or published from, whole.
        self.bytes = torch.empty(0, dtype=torch.uint8)
        self._keys: list[str] = []
        self._tensors: list[torch.Tensor] = []
        self._offsets: list[int] = []
        self._shapes: list[torch.Size] = []
        self._dtypes: list[torch.dtype] = []

    def holds(self, dst: dict[str, torch.Tensor]) -> bool:
        """Whether ``dst`` (the model's tensors, as walked now) is exactly what was bound: the same keys in the
        same order, the same tensor objects, each still the contiguous view of the storage, of the shape and
        dtype, that binding made it. Nothing replaced, moved, re-pointed or reshaped since, so the keys, shapes
        and dtypes checked at binding still hold: a caller need not check them again. About 0.3 us a tensor
        (0.57 ms for 2000), about what building and comparing the ``(shape, dtype)`` check costs (0.4 to 0.6 ms),
        which it replaces."""
        if self.storage is None or len(dst) != len(self._tensors) or list(dst) != self._keys:
            return False
        tensors = list(dst.values())
        base = self.storage.data_ptr()
        # One C-level pass per property (`map` over unbound methods): a Python loop testing all of them
        # per tensor took twice as long.
        return (
            all(map(operator.is_, tensors, self._tensors))
            and list(map(base.__rsub__, map(torch.Tensor.data_ptr, tensors))) == self._offsets
            and list(map(_shape, tensors)) == self._shapes
            and list(map(_dtype, tensors)) == self._dtypes
            and all(map(torch.Tensor.is_contiguous, tensors))
        )

    def bind(
        self,
        dst: dict[str, torch.Tensor],
        storage: torch.UntypedStorage,
        layout: FlatLayout,
        views: dict[str, torch.Tensor] | None = None,
    ) -> torch.UntypedStorage | None:
        """Point every tensor of ``dst`` (all on the CPU, checked against ``layout``) at its view of ``storage``,
        which holds the weights as ``layout`` places them (``views``: those views, if the caller made them).
        Returns the storage bound before, if another."""
        whole = self.bytes if storage is self.storage else torch.empty(0, dtype=torch.uint8).set_(storage)
        if views is None:
            views = self.views if storage is self.storage else layout.views(whole)
        write_into(dst, views, share=True)
        previous = self.storage if self.storage is not storage else None
        self.storage, self.views, self.bytes = storage, views, whole
        base = storage.data_ptr()
        self._keys = list(dst)
        self._tensors = list(dst.values())
        self._offsets = [tensor.data_ptr() - base for tensor in self._tensors]
        self._shapes = [tensor.shape for tensor in self._tensors]
        self._dtypes = [tensor.dtype for tensor in self._tensors]
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
            self.swap(private)  # `private` now holds the old memory, freed with it
        self.forget()

    def forget(self) -> None:
        self.storage, self.views, self.bytes = None, {}, torch.empty(0, dtype=torch.uint8)
        self._keys, self._tensors, self._offsets, self._shapes, self._dtypes = [], [], [], [], []
