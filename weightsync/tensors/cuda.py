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

import ctypes
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..errors import SyncTimeoutError, TransportError

__all__ = [
    "Pinned",
    "SlotEvent",
    "check_share",
    "clear_last_error",
    "cuda_devices",
    "device_uuid",
    "local_index",
    "open_share",
    "release_share",
    "settle",
    "settle_after_failure",
    "settle_before_write",
    "settle_whole_device",
    "share",
    "visible_uuids",
    "wait_done",
    "wait_event",
]

log = logging.getLogger(__name__)

#: Bytes of a ``cudaIpcEventHandle_t`` (what ``torch.cuda.Event.ipc_handle()`` and ``_share_cuda_`` give).
EVENT_HANDLE_BYTES = 64
#: The longest memory handle a share may carry. The handle is opaque here: torch's caching allocator writes a
#: version byte, a type byte and the 64-byte ``cudaIpcMemHandle_t`` for a ``cudaMalloc`` block (66 bytes,
#: ``b"\x02c..."`` since torch 2.5; a later torch may bump the version byte), and a longer record for an expandable
#: segment (a header and a handle per segment). ``_new_shared_cuda`` checks it; this bound only caps what is read.
MAX_HANDLE_BYTES = 1 << 16
#: The longest name of a torch reference-counter file a share may carry (``/torch_<pid>_<random>_<n>``, 23 bytes).
MAX_COUNTER_BYTES = 256
#: The longest GPU UUID a share may name (``str(torch.cuda.get_device_properties(i).uuid)``: 36 characters).
MAX_UUID_CHARS = 64
_HEX = re.compile(r"(?:[0-9a-f]{2})*")
_UUID = re.compile(r"[0-9A-Za-z-]{1,64}")
#: ``cudaHostRegisterPortable``: the memory is page-locked for every CUDA context of the process.
HOST_REGISTER_PORTABLE = 1
#: ``cudaHostRegisterReadOnly``: the GPU only reads the memory (needed to register a read-only mapping).
HOST_REGISTER_READ_ONLY = 8
#: Longest pause between two looks at an event that is not done yet (seconds): the bounded waits poll.
POLL_MAX_S = 5e-4
#: Seconds a bounded wait looks at its event without sleeping, before it backs off to :data:`POLL_MAX_S`.
SPIN_S = 0.02


def cuda_devices(tensors: Iterable[torch.Tensor]) -> set[torch.device]:
    """The CUDA devices among ``tensors``' (empty when all are elsewhere)."""
    return {t.device for t in tensors if t.is_cuda}


# --------------------------------------------------------------- GPU identity
def device_uuid(device: torch.device | int) -> str:
    """The UUID of a GPU of this process, as torch spells it (the same GPU has the same UUID in every process,
    whatever ``CUDA_VISIBLE_DEVICES`` numbers it there)."""
    index = device if isinstance(device, int) else (device.index if device.index is not None else 0)
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_uuids() -> list[str]:
    """The UUIDs of the GPUs this process sees, by index (empty without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [device_uuid(i) for i in range(torch.cuda.device_count())]


def local_index(uuid: str, uuids: list[str]) -> int | None:
    """The index, in this process, of the GPU whose UUID is ``uuid`` (``uuids``: :func:`visible_uuids`); ``None``
    when this process does not see it. Indexes differ between processes: ``CUDA_VISIBLE_DEVICES=1`` makes the
    second GPU of the machine ``cuda:0`` of that process."""
    wanted = uuid.lower().removeprefix("gpu-")
    for index, seen in enumerate(uuids):
        if seen.lower().removeprefix("gpu-") == wanted:
            return index
    return None


# ------------------------------------------------------------------ CUDA IPC
def share(storage: torch.UntypedStorage, uuid: str) -> dict[str, Any]:
    """A new share of ``storage`` (device memory on the GPU whose UUID is ``uuid``) for one mapping in one other
    process, as plain data.

    Each share is counted by torch on its own: hand each to one mapping only."""
    device, handle, size, offset, counter, counter_offset, event, event_sync = storage._share_cuda_()
    return {
        "device": int(device),
        "uuid": uuid,
        "handle": bytes(handle).hex(),
        "size": int(size),
        "offset": int(offset),
        "counter": bytes(counter).hex(),
        "counter_offset": int(counter_offset),
        "event": bytes(event).hex() if event is not None else "",
        "event_sync": bool(event_sync),
    }


_SHARE_FIELDS = {
    "device": int,
    "uuid": str,
    "handle": str,
    "size": int,
    "offset": int,
    "counter": str,
    "counter_offset": int,
    "event": str,
    "event_sync": bool,
}


def check_share(plain: Any, what: str = "a CUDA share") -> dict[str, Any]:
    """``plain`` checked as a share :func:`share` made: exact fields and types, hex strings of bounded length
    (the memory handle is opaque: 1 to :data:`MAX_HANDLE_BYTES` bytes; an event handle is 64 bytes, or absent).

    Raises:
        TransportError: naming the field that is wrong.
    """
    if not isinstance(plain, Mapping):
        raise TransportError(f"{what} must be a mapping, got {type(plain).__name__}")
    if set(plain) != set(_SHARE_FIELDS):
        raise TransportError(f"{what} has fields {sorted(map(str, plain))}, expected {sorted(_SHARE_FIELDS)}")
    for key, kind in _SHARE_FIELDS.items():
        value = plain[key]
        if type(value) is not kind:
            raise TransportError(f"{what}: {key} must be {kind.__name__}, got {type(value).__name__}")
        if type(value) is int and value < 0:
            raise TransportError(f"{what}: {key} must be >= 0, got {value}")
    for key, longest in (("handle", MAX_HANDLE_BYTES), ("counter", MAX_COUNTER_BYTES)):
        value = plain[key]
        if not 0 < len(value) <= 2 * longest or not _HEX.fullmatch(value):
            raise TransportError(f"{what}: {key} must be 1 to {longest} bytes as lowercase hex digits")
    if plain["event"] and (len(plain["event"]) != 2 * EVENT_HANDLE_BYTES or not _HEX.fullmatch(plain["event"])):
        raise TransportError(f"{what}: event must be {EVENT_HANDLE_BYTES} bytes as lowercase hex digits, or empty")
    if not _UUID.fullmatch(plain["uuid"]):
        raise TransportError(f"{what}: uuid must be a GPU UUID (at most {MAX_UUID_CHARS} letters, digits, '-')")
    return dict(plain)


def _local_device(uuid: str, uuids: list[str] | None) -> int:
    index = local_index(uuid, visible_uuids() if uuids is None else uuids)
    if index is None:
        raise TransportError(
            f"the sender's GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES): it can map only the "
            "memory of a GPU it sees"
        )
    return index


def open_share(plain: Mapping[str, Any], uuids: list[str] | None = None) -> torch.UntypedStorage:
    """Map a share (checked by :func:`check_share`) into this process: a storage on the GPU the share names by
    UUID, whatever index that GPU has here (``uuids``: :func:`visible_uuids`, looked up when ``None``).

    Raises:
        TransportError: CUDA could not map it (the message says why: no CUDA here, a GPU this process does not
            see, another machine, ...).
    """
    if not torch.cuda.is_available():
        raise TransportError("the sender shares device memory, and this process has no CUDA device")
    index = _local_device(plain["uuid"], uuids)
    try:
        torch.cuda._lazy_init()
        return torch.UntypedStorage._new_shared_cuda(
            index,
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
    """Let go of a share whose mapping will never release it: call it only once the process it was handed to is
    known to be gone (a live process's mapping would outlive the memory). The sender's memory can then be freed
    when the sender frees it."""
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
    def open(cls, uuid: str, handle_hex: str, uuids: list[str] | None = None) -> SlotEvent:
        """The event another process shares (``handle_hex``: :meth:`handle`) on the GPU whose UUID is ``uuid``."""
        if len(handle_hex) != 2 * EVENT_HANDLE_BYTES or not _HEX.fullmatch(handle_hex):
            raise TransportError(f"an event handle must be {EVENT_HANDLE_BYTES} bytes as lowercase hex digits")
        device = torch.device("cuda", _local_device(uuid, uuids))
        try:
            return cls(torch.cuda.Event.from_ipc_handle(device, bytes.fromhex(handle_hex)), device)
        except RuntimeError as exc:
            raise TransportError(f"could not open the sender's CUDA event: {exc}") from exc

    def handle(self) -> str:
        return bytes(self.event.ipc_handle()).hex()

    def record(self) -> None:
        """Mark the end of the work queued so far on this device's current stream."""
        self.event.record(torch.cuda.current_stream(self.device))


def wait_done(query: Callable[[], bool], deadline: float, what: str) -> None:
    """Wait until ``query()`` (an event's ``query``) says the work is done, at most until ``deadline``
    (``time.monotonic()``). A host wait on an event (``synchronize``) has no bound: an event another process
    recorded never completes if that process dies with the work queued, and a worker must not hang on it.

    Raises:
        SyncTimeoutError: not done by ``deadline`` (``what`` says what was waited for).
    """
    # Looks as often as it can for a while (an update's copies take a millisecond or so, and a sleep of the OS
    # costs 50 us or more), letting other threads run between looks; then sleeps longer and longer.
    spin_until = time.monotonic() + SPIN_S
    pause = 5e-5
    while not query():
        now = time.monotonic()
        if now >= deadline:
            raise SyncTimeoutError(f"{what} was not done in time (its GPU work is still queued)")
        if now < spin_until:
            time.sleep(0)
            continue
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)


def wait_event(event: SlotEvent, devices: set[torch.device], deadline: float) -> None:
    """Make the current stream of each of ``devices`` (GPUs) wait on ``event`` (on the GPU, no host wait); with no
    GPU, wait on the host, at most until ``deadline``."""
    if not devices:
        wait_done(event.event.query, deadline, "the sender's write of the slot")
    for device in devices:
        event.event.wait(torch.cuda.current_stream(device))


def settle(devices: set[torch.device], deadline: float, *, whole_device: bool = False) -> None:
    """Wait until the work queued so far on the current stream of each of ``devices`` (GPUs) is done, at most
    until ``deadline`` (that stream may wait on another process's event: polled, never an unbounded wait).

    ``whole_device``: then wait for every stream of this process on those devices too (what
    :func:`settle_whole_device` decides). Once the current stream is done, nothing queued anywhere waits on another
    process, so that wait ends with this process's own work.

    Raises:
        SyncTimeoutError: the current stream's work was not done by ``deadline``.
    """
    for device in devices:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        wait_done(done.query, deadline, f"the copy into the model on {device}")
    if whole_device:
        for device in devices:
            torch.cuda.synchronize(device)


def settle_after_failure(devices: set[torch.device], timeout: float, model_id: Any) -> None:
    """:func:`settle` after an update failed, before its ack frees the slot that copies queued may still read:
    within ``timeout`` of its own (the failure may be that the first wait ran out); a failure of its own is logged
    (the first one is what is reported)."""
    try:
        settle(devices, time.monotonic() + timeout)
    except Exception as late:  # noqa: BLE001 - the first failure is the one reported
        log.warning("model %r: after a failed update, its GPU work: %s", model_id, str(late))


def settle_whole_device(placement: str) -> bool:
    """Whether a worker must wait for every stream of its GPU before it acks an update placed by ``placement``.

    ``"share"`` and ``"take"``: the model's tensors now read the new memory, and the memory they read before
    goes back to the sender, to be rewritten, as soon as the ack arrives. Kernels the worker queued on any
    stream of its own (inference on a user stream, from another thread with ``background_thread=True``) still
    read the old memory: the ack waits for them. ``"load"`` and ``"write"``: the update is copied into the
    model's own memory on the current stream and the slot is read by that copy only: the current stream is
    enough (no wait for inference in flight).
    """
    return placement in ("share", "take")


def settle_before_write(placement: str, in_background: bool) -> bool:
    """Whether a worker must wait for every stream of its GPU before an update placed by ``placement`` is written.

    ``in_background``: the update is applied by the scheme's own thread (``background_thread=True``) while the
    worker's own threads run inference under ``weights_lock``. Their host side lets go of the lock as soon as
    their kernels are queued, on streams of their own that may still read the model's memory: ``"load"`` and
    ``"write"`` copy the update into that very memory, and a copy queued on the applying thread's stream alone
    could overwrite it under those kernels (a torn read). An update the worker's own thread applies in
    ``receive()`` is ordered after what that thread queued on its stream, like any in-place change in PyTorch;
    ``"share"`` and ``"take"`` write nothing the model reads (its tensors move to the new memory).
    """
    return in_background and placement in ("load", "write")


# --------------------------------------------------------------- pinned memory
_last_error: Callable[[], int] | None = None


def _find_get_last_error() -> Callable[[], int] | None:
    """``cudaGetLastError`` of the CUDA runtime torch uses: torch's binding if it has one, else the loaded
    ``libcudart`` (torch's bindings return errors without clearing them)."""
    fn = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if fn is not None:
        return fn
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path).cudaGetLastError  # already loaded: the same runtime instance
        except (OSError, AttributeError):
            continue
    return None


def clear_last_error() -> None:
    """Reset the CUDA runtime's last error of this thread. A failed runtime call (``cudaHostRegister``) leaves it
    set, and the next kernel launch torch checks would report it as its own failure."""
    global _last_error
    if _last_error is None:
        _last_error = _find_get_last_error()
    if _last_error is None:
        log.debug("cannot reach cudaGetLastError: a failed registration may be reported by the next launch")
        return
    _last_error()


class Pinned:
    """Host memory registered with CUDA as page-locked while this object holds it (``cudaHostRegister``).

    Registration can fail (no CUDA, a limit on locked memory, a read-only mapping on a GPU that cannot pin
    one): the memory then stays pageable, copies still work, slower, :attr:`pinned` says so, and the runtime's
    last error is cleared so the failure is not reported by the next kernel launch.

    Args:
        tensor: the host memory (contiguous).
        read_only: the memory is mapped read-only (the GPU only reads it).
        cudart: the runtime bindings (``torch.cuda.cudart()``; tests pass a stand-in).
        clear: what resets the runtime's last error (:func:`clear_last_error`).
    """

    def __init__(
        self,
        tensor: torch.Tensor,
        *,
        read_only: bool = False,
        cudart: Any = None,
        clear: Callable[[], None] = clear_last_error,
    ) -> None:
        self.ptr = tensor.data_ptr()
        self.pinned = False
        if cudart is None:
            if not torch.cuda.is_available():
                return
            cudart = torch.cuda.cudart()
        self._cudart = cudart
        if tensor.numel() == 0:
            return
        flags = HOST_REGISTER_PORTABLE | (HOST_REGISTER_READ_ONLY if read_only else 0)
        code = int(cudart.cudaHostRegister(self.ptr, tensor.nbytes, flags))
        if code != 0:
            clear()
            log.warning("could not pin %d bytes of host memory (cudaError %d): slower copies", tensor.nbytes, code)
            return
        self.pinned = True

    def release(self) -> None:
        if self.pinned:
            self.pinned = False
            code = int(self._cudart.cudaHostUnregister(self.ptr))
            if code != 0:
                self._clear_quietly(code)

    @staticmethod
    def _clear_quietly(code: int) -> None:
        clear_last_error()
        log.debug("cudaHostUnregister returned %d", code)


# ------------------------------------------------------------ kept-alive objects
_kept: list[tuple[list[Any], list[Any]]] = []


def keep_until_gone(objects: list[Any], processes: list[Any]) -> None:
    """Keep ``objects`` (interprocess events) alive until every process of ``processes`` (objects with a
    ``gone()`` method) has exited. Destroying an event another process opened is undefined for that process
    (``cudaIpcOpenEventHandle``): a worker may still wait on it. What is kept costs a few bytes of driver state."""
    _kept[:] = [(objs, procs) for objs, procs in _kept if not all(p.gone() for p in procs)]
    if objects and not all(p.gone() for p in processes):
        _kept.append((list(objects), list(processes)))
