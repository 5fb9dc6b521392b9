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

The storage may be on any one device: the CPU, or the GPU all the model's
tensors are on. The swap needs ``UntypedStorage._swap_data_ptr_`` (torch 2.12
and later); with an older torch, :attr:`BoundModel.can_swap` is false and
callers bind the new storage instead (re-pointing every tensor), which gives
the same result at the cost of binding.
"""

from __future__ import annotations

import logging
import operator
from typing import TYPE_CHECKING

import torch

from ..errors import ConfigurationError
from .copies import copy_tensors, in_shared_memory, point_at, write_into

if TYPE_CHECKING:
    from .layout import FlatLayout

__all__ = ["CAN_SWAP", "BoundModel", "one_device", "room_to_bind"]

log = logging.getLogger(__name__)

#: Whether this torch can swap the memory behind two storages (``UntypedStorage._swap_data_ptr_``).
CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def one_device(tensors: list[torch.Tensor]) -> torch.device | None:
    """The device every tensor of ``tensors`` is on (``None``: none, or several)."""
    if not tensors:
        return None
    first = tensors[0]
    if all(t.is_cpu for t in tensors):  # the common case, without building a device per tensor
        return first.device
    device = first.device
    return device if all(t.device == device for t in tensors) else None


#: GPU memory that must stay free beside a second copy of a model while it is bound (kernels' workspaces).
BIND_HEADROOM = 1 << 28


def room_to_bind(nbytes: int, free_bytes: int) -> bool:
    """Whether a GPU with ``free_bytes`` free can hold, for a moment, a second copy of a model of ``nbytes``:
    binding copies the model into one new storage, and its old memory is freed only after. Where it cannot,
    updates are copied into the model's own tensors (no second buffer; one copy per tensor, queued together)."""
    return free_bytes >= nbytes + BIND_HEADROOM


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """``storage`` as one uint8 tensor on its device."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")


class BoundModel:
    """A model's tensors as views of one storage (``storage``, on their device), or nothing bound yet."""

    #: Whether :meth:`swap` works with this torch (else callers :meth:`bind` the other storage).
    can_swap = CAN_SWAP
    #: :meth:`load` moves a model in shared memory to memory of its own too (its sharing is not the user's: a
    #: TorchRL collector pickled the trainer's policy into the worker).
    move_shared = False

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

    def gpus(self) -> set[torch.device]:
        """The GPU of the tensors bound (none: they are on the CPU); for a model that :meth:`holds` them."""
        assert self.storage is not None
        return {self.storage.device} if self.storage.device.type == "cuda" else set()

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
        """Point every tensor of ``dst`` (all on ``storage``'s device, checked against ``layout``) at its view of
        ``storage``, which holds the weights as ``layout`` places them (``views``: those views, if the caller made
        them). Returns the storage bound before, if another."""
        whole = self.bytes if storage is self.storage else _bytes_of(storage)
        if views is None:
            views = self.views if storage is self.storage else layout.views(whole)
        point_at(dst, views)
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
        the model is first bound to one private storage on its device, laid out by ``layout`` (each tensor
        re-pointed at its view, with the update's values); its memory then stays the same from update to
        update. The pieces may be on another device (a host slot for a GPU model): each is one copy. Returns
        ``False``, with nothing done, where the caller must copy tensor by tensor: tensors on several devices, a
        layout that casts (``wire_dtype``), or a model in shared memory at its first update (processes of the
        receiver's own may read it: it is written into, never moved).
        """
        if held:
            # Into a GPU: queued on its stream, waited for once by the caller before it acks (never per piece).
            targets = [self.bytes[o : o + b.numel()] for o, b in pieces]
            copy_tensors(targets, [b for _, b in pieces], non_blocking=self.bytes.is_cuda)
            return True
        if self._shared_at_first is None:
            self._shared_at_first = not self.move_shared and in_shared_memory(dst)
        device = one_device(list(dst.values()))
        if self._shared_at_first or layout.casts or device is None:
            return False
        if device.type == "cuda" and not room_to_bind(layout.nbytes, torch.cuda.mem_get_info(device)[0]):
            log.info("no room on %s for a second copy of the model while binding it: copying into its tensors", device)
            return False
        whole = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)  # padding between pieces is never read
        copy_tensors([whole[o : o + b.numel()] for o, b in pieces], [b for _, b in pieces], non_blocking=whole.is_cuda)
        self.bind(dst, whole.untyped_storage(), layout)
        return True

    def adopt(self, flat: dict[str, torch.Tensor], layout: FlatLayout, model_id: str | None = None) -> None:
        """Sender (``flatten_sender``): move the trainer's tensors ``flat`` (checked against ``layout``, which
        must not cast) into one zeroed storage on their device, laid out by ``layout``, keeping their values and
        objects.

        Raises:
            ConfigurationError: the tensors are on several devices (named); nothing moved.
        """
        device = one_device(list(flat.values()))
        if device is None:
            devices = sorted({str(tensor.device) for tensor in flat.values()})
            raise ConfigurationError(
                f"flatten_sender needs every weight on one device; they are on {devices}", model_id=model_id
            )
        whole = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)  # zeroed: padding reaches the workers
        views = layout.views(whole)
        write_into(views, flat)
        self.bind(flat, whole.untyped_storage(), layout, views)

    def published(
        self, flat: dict[str, torch.Tensor], layout: FlatLayout, held: bool, registered: bool, model_id: str | None
    ) -> torch.Tensor | None:
        """Sender (``flatten_sender``): the bytes of the storage the trainer's tensors ``flat`` view, all of
        them in their place (``held``: what :meth:`holds` says; else the registered model, changed since, is
        adopted anew); ``None`` where the caller copies tensor by tensor: weights passed explicitly
        (``registered`` false), or on several devices."""
        if not held:
            if not registered or one_device(list(flat.values())) is None:
                return None
            log.debug("model %r: the trainer's weights changed since they were bound; binding them anew", model_id)
            self.adopt(flat, layout, model_id)
        return self.bytes

    def swap(self, storage: torch.UntypedStorage) -> None:
        """Give the bound tensors ``storage``'s memory, and ``storage`` theirs (same size): O(1).

        ``UntypedStorage._swap_data_ptr_`` is what torch's own FSDP and CUDA-graph trees use to move tensors
        between buffers; the tensors, their views and the storage object stay, only the memory changes. Only
        where :attr:`can_swap` (torch 2.12 and later)."""
        assert self.storage is not None and self.can_swap
        # Private, so torch's stubs leave it out; can_swap checked that this torch has it.
        self.storage._swap_data_ptr_(storage)  # type: ignore[attr-defined]

    def release(self) -> None:
        """Give the bound tensors private memory holding the same bytes (one copy), and forget them: the memory
        they had (a shared slot) is then held only by whoever else holds it."""
        if self.storage is not None:
            private = torch.empty(self.storage.nbytes(), dtype=torch.uint8, device=self.storage.device)
            private.copy_(self.bytes)
            if self.can_swap:
                self.swap(private.untyped_storage())  # `private` now holds the old memory, freed with it
            else:
                with torch.no_grad():
                    for tensor, offset in zip(self._tensors, self._offsets):
                        nbytes = tensor.numel() * tensor.element_size()
                        tensor.data = private[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
        self.forget()

    def forget(self) -> None:
        self.storage, self.views, self.bytes = None, {}, torch.empty(0, dtype=torch.uint8)
        self._keys, self._tensors, self._offsets, self._shapes, self._dtypes = [], [], [], [], []
