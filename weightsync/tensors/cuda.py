"""Weights on GPUs: what the engines ask of CUDA, in one room.

* **Device memory shared between processes** (CUDA IPC). A slot in device
  memory is shared with each worker through the calls ``torch.multiprocessing``
  itself uses to pass CUDA tensors (``UntypedStorage._share_cuda_`` on the
  sender, ``UntypedStorage._new_shared_cuda`` on the worker), but the handles
  travel as plain data (:func:`share` / :func:`open_share`: ints and hex
  strings inside the engines' authenticated JSON messages), so nothing is
  unpickled. torch counts each share: the sender's memory stays allocated while
  a worker maps it, and is freed once the worker lets it go (or, for a worker
  that died, once the sender lets its share go: :func:`release_share`).
* **Order without device-wide synchronisation.** Each device slot has an
  interprocess event (:class:`SlotEvent`) the sender records on its stream
  after writing the slot; a worker's stream waits on it before reading
  (:func:`wait_event`), and the worker waits for its own stream
  (:func:`settle`) before it acks, so an ack means the copy is done.
* **Pinned host memory.** A host slot a GPU writes or reads is registered
  with ``cudaHostRegister`` (:class:`Pinned`), so device-host copies run
  asynchronously at the bus's speed instead of through pageable memory.

Nothing here runs on a machine without CUDA: the engines call it only for
tensors on a CUDA device.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..errors import TransportError

__all__ = [
    "Pinned",
    "SlotEvent",
    "check_share",
    "cuda_devices",
    "open_share",
    "release_share",
    "settle",
    "share",
    "wait_event",
]

log = logging.getLogger(__name__)

#: Hex digits of a CUDA IPC handle (``cudaIpcMemHandle_t``, ``cudaIpcEventHandle_t``: 64 bytes each).
IPC_HANDLE_HEX = 128
#: The longest name of a torch reference-counter file a share may carry (hex of its bytes).
MAX_COUNTER_HEX = 512
_HEX = re.compile(r"[0-9a-f]*")
#: ``cudaHostRegisterPortable``: the memory is page-locked for every CUDA context of the process.
HOST_REGISTER_PORTABLE = 1


def cuda_devices(tensors: Iterable[torch.Tensor]) -> set[torch.device]:
    """The CUDA devices among ``tensors``' (empty when all are elsewhere)."""
    return {t.device for t in tensors if t.is_cuda}


# ------------------------------------------------------------------ CUDA IPC
def share(storage: torch.UntypedStorage) -> dict[str, Any]:
    """A new share of ``storage`` (device memory) for one mapping in one other process, as plain data.

    Each share is counted by torch on its own: hand each to one mapping only."""
    device, handle, size, offset, counter, counter_offset, event, event_sync = storage._share_cuda_()
    return {
        "device": int(device),
        "handle": bytes(handle).hex(),
        "size": int(size),
        "offset": int(offset),
        "counter": bytes(counter).hex(),
        "counter_offset": int(counter_offset),
        "event": bytes(event).hex() if event is not None else "",
        "event_sync": bool(event_sync),
    }


def check_share(plain: Any, what: str = "a CUDA share") -> dict[str, Any]:
    """``plain`` checked as a share :func:`share` made (exact types, bounded hex strings).

    Raises:
        TransportError: naming the field that is wrong.
    """
    if not isinstance(plain, Mapping):
        raise TransportError(f"{what} must be a mapping, got {type(plain).__name__}")
    expected = {
        "device": int,
        "handle": str,
        "size": int,
        "offset": int,
        "counter": str,
        "counter_offset": int,
        "event": str,
        "event_sync": bool,
    }
    if set(plain) != set(expected):
        raise TransportError(f"{what} has fields {sorted(plain)}, expected {sorted(expected)}")
    for key, kind in expected.items():
        value = plain[key]
        if type(value) is not kind:
            raise TransportError(f"{what}: {key} must be {kind.__name__}, got {type(value).__name__}")
        if kind is int and value < 0:
            raise TransportError(f"{what}: {key} must be >= 0, got {value}")
    for key, longest in (("handle", IPC_HANDLE_HEX), ("event", IPC_HANDLE_HEX), ("counter", MAX_COUNTER_HEX)):
        value = plain[key]
        if len(value) > longest or len(value) % 2 or not _HEX.fullmatch(value):
            raise TransportError(f"{what}: {key} must be at most {longest} lowercase hex digits")
    if len(plain["handle"]) != IPC_HANDLE_HEX:
        raise TransportError(f"{what}: handle must be {IPC_HANDLE_HEX} hex digits")
    return dict(plain)


def open_share(plain: Mapping[str, Any]) -> torch.UntypedStorage:
    """Map a share (checked by :func:`check_share`) into this process: a storage on the sender's device.

    Raises:
        TransportError: CUDA could not map it (the message says why: no CUDA here, another machine, ...).
    """
    if not torch.cuda.is_available():
        raise TransportError("the sender shares device memory, and this process has no CUDA device")
    try:
        torch.cuda._lazy_init()
        return torch.UntypedStorage._new_shared_cuda(
            plain["device"],
            bytes.fromhex(plain["handle"]),
            plain["size"],
            plain["offset"],
            bytes.fromhex(plain["counter"]),
            plain["counter_offset"],
            bytes.fromhex(plain["event"]),
            plain["event_sync"],
        )
    except RuntimeError as exc:
        raise TransportError(f"could not map the sender's device memory (CUDA IPC): {exc}") from exc


def release_share(plain: Mapping[str, Any]) -> None:
    """Let go of a share whose mapping will never release it (its worker died): the sender's memory can then
    be freed when the sender frees it."""
    try:
        torch.UntypedStorage._release_ipc_counter(
            bytes.fromhex(plain["counter"]), plain["counter_offset"], device=torch.device("cuda", plain["device"])
        )
    except RuntimeError as exc:  # the counter file is gone already: nothing left to release
        log.debug("releasing a CUDA share: %s", exc)


# -------------------------------------------------------------------- events
class SlotEvent:
    """An interprocess CUDA event: the sender records it after writing a slot, workers wait on it."""

    def __init__(self, event: Any, device: torch.device) -> None:
        self.event, self.device = event, device

    @classmethod
    def create(cls, device: torch.device) -> SlotEvent:
        with torch.cuda.device(device):
            event = torch.cuda.Event(interprocess=True)
            event.record(torch.cuda.current_stream(device))  # an event gets its device when first recorded
        return cls(event, device)

    @classmethod
    def open(cls, device_index: int, handle_hex: str) -> SlotEvent:
        """The event another process shares (``handle_hex``: :meth:`handle`, checked like a share's)."""
        if len(handle_hex) != IPC_HANDLE_HEX or not _HEX.fullmatch(handle_hex):
            raise TransportError(f"an event handle must be {IPC_HANDLE_HEX} lowercase hex digits")
        device = torch.device("cuda", device_index)
        try:
            return cls(torch.cuda.Event.from_ipc_handle(device, bytes.fromhex(handle_hex)), device)
        except RuntimeError as exc:
            raise TransportError(f"could not open the sender's CUDA event: {exc}") from exc

    def handle(self) -> str:
        return bytes(self.event.ipc_handle()).hex()

    def record(self) -> None:
        """Mark the end of the work queued so far on this device's current stream."""
        self.event.record(torch.cuda.current_stream(self.device))


def wait_event(event: SlotEvent, devices: set[torch.device]) -> None:
    """Make the current stream of each of ``devices`` (GPUs) wait on ``event`` (on the GPU, no host wait); with no
    GPU, wait on the host."""
    if not devices:
        event.event.synchronize()
    for device in devices:
        event.event.wait(torch.cuda.current_stream(device))


def settle(devices: set[torch.device]) -> None:
    """Wait until the work queued so far on the current stream of each of ``devices`` (GPUs) is done."""
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


# --------------------------------------------------------------- pinned memory
class Pinned:
    """Host memory registered with CUDA as page-locked while this object holds it (``cudaHostRegister``).

    Registration can fail (no CUDA, a limit on locked memory): the memory then stays pageable, copies still
    work, slower, and :attr:`pinned` says so."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.ptr = tensor.data_ptr()
        self.pinned = False
        if not torch.cuda.is_available() or tensor.numel() == 0:
            return
        code = int(torch.cuda.cudart().cudaHostRegister(self.ptr, tensor.nbytes, HOST_REGISTER_PORTABLE))
        if code != 0:
            log.warning("could not pin %d bytes of host memory (cudaError %d): slower copies", tensor.nbytes, code)
            return
        self.pinned = True

    def release(self) -> None:
        if self.pinned:
            self.pinned = False
            code = int(torch.cuda.cudart().cudaHostUnregister(self.ptr))
            if code != 0:
                log.debug("cudaHostUnregister returned %d", code)
