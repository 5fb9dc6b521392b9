"""A model bound to one storage laid out like the weights buffer: :class:`BoundModel`.

Once every tensor of a model is a view of one storage, in the place the
:class:`~weightsync.tensors.layout.FlatLayout` gives it, an update reaches all of them
at once, whatever their number: one copy into that storage per buffer of the
update (multiprocess workers, Ray actors), or one swap of the memory behind it
with the buffer the update is in (shared_mem, and the distributed and rpc
workers that take each update's buffer); and a sender bound that way
(``flatten_sender``) publishes with one copy out of it, or none (Ray). Binding
re-points each tensor (``tensor.data = view``: about 1.2 us a tensor, 2.4 ms
for 2000), which is paid once, not at every update.
"""

from __future__ import annotations

import logging
import operator
from typing import TYPE_CHECKING

import torch

from ..errors import ConfigurationError
from .copies import copy_tensors, in_shared_memory, write_into

if TYPE_CHECKING:
    from .layout import FlatLayout

__all__ = ["BoundModel"]

log = logging.getLogger(__name__)

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
        self._shared_at_first: bool | None = None  # :meth:`load`: whether the model was in shared memory

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

    def load(
        self,
        dst: dict[str, torch.Tensor],
        pieces: list[tuple[int, torch.Tensor]],
        layout: FlatLayout,
        held: bool,
    ) -> bool:
        """Receiver: copy an update into the model's tensors ``dst`` (checked against ``layout``; ``held``: what
        :meth:`holds` says of them), one copy per piece whatever the number of tensors. ``pieces``:
        ``(byte offset in the layout, uint8 buffer)`` covering every tensor (:meth:`FlatLayout.placed`).

        Unless ``held`` (the first update, or a model whose tensors were replaced, moved or reshaped since),
        the model is first bound to one private storage laid out by ``layout`` (each tensor re-pointed at its
        view, with the update's values); its memory then stays the same from update to update. Returns
        ``False``, with nothing done, where the caller must copy tensor by tensor: a tensor off the CPU, a
        layout that casts (``wire_dtype``), or a model in shared memory at its first update (processes of the
        receiver's own may read it: it is written into, never moved).
        """
        if held:
            copy_tensors([self.bytes[o : o + b.numel()] for o, b in pieces], [b for _, b in pieces])
            return True
        if self._shared_at_first is None:
            self._shared_at_first = in_shared_memory(dst)
        if self._shared_at_first or layout.casts or not all(tensor.is_cpu for tensor in dst.values()):
            return False
        whole = torch.empty(layout.nbytes, dtype=torch.uint8)  # padding between pieces is never read
        copy_tensors([whole[o : o + b.numel()] for o, b in pieces], [b for _, b in pieces])
        self.bind(dst, whole.untyped_storage(), layout)
        return True

    def adopt(self, flat: dict[str, torch.Tensor], layout: FlatLayout, model_id: str | None = None) -> None:
        """Sender (``flatten_sender``): move the trainer's tensors ``flat`` (checked against ``layout``, which
        must not cast) into one zeroed storage laid out by ``layout``, keeping their values and objects.

        Raises:
            ConfigurationError: a tensor is off the CPU (named); nothing moved.
        """
        off_cpu = [key for key, tensor in flat.items() if not tensor.is_cpu]
        if off_cpu:
            raise ConfigurationError(
                f"flatten_sender needs every weight on the CPU; {off_cpu[:3]} are on {flat[off_cpu[0]].device}",
                model_id=model_id,
            )
        whole = torch.zeros(layout.nbytes, dtype=torch.uint8)  # zeroed: padding reaches the workers
        views = layout.views(whole)
        write_into(views, flat)
        self.bind(flat, whole.untyped_storage(), layout, views)

    def published(
        self, flat: dict[str, torch.Tensor], layout: FlatLayout, held: bool, registered: bool, model_id: str | None
    ) -> torch.Tensor | None:
        """Sender (``flatten_sender``): the bytes of the storage the trainer's tensors ``flat`` view, all of
        them in their place (``held``: what :meth:`holds` says; else the registered model, changed since, is
        adopted anew); ``None`` where the caller copies tensor by tensor: weights passed explicitly
        (``registered`` false), or off the CPU."""
        if not held:
            if not registered or not all(tensor.is_cpu for tensor in flat.values()):
                return None
            log.debug("model %r: the trainer's weights changed since they were bound; binding them anew", model_id)
            self.adopt(flat, layout, model_id)
        return self.bytes

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
