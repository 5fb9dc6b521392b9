"""torch.distributed process groups of weightsync's own, and completing their operations on a thread."""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...core.timing import as_timedelta, remaining
from ...errors import ConfigurationError, SyncTimeoutError, TransportError, first_line
from ..network import local_address

if TYPE_CHECKING:
    from .auth import Sealer

__all__ = ["GROUP_TIMEOUT_FACTOR", "Link", "Waiter", "gpu_identity", "is_timeout", "new_group", "new_group_within"]

#: A group's own operation timeout is never less than this many times the scheme's ``timeout``: past it, gloo
#: disconnects a peer that stalled in the middle of an update.
GROUP_TIMEOUT_FACTOR = 4
#: Seconds a caller that gave up on a group's formation waits for gloo's thread to give up too.
FORMATION_GRACE_S = 2.0


def gpu_identity() -> str:
    """This process's current GPU, by UUID: two processes on one GPU compare equal whatever their device indices."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def new_group(backend: str, store: dist.Store, rank: int, size: int, timeout: float, master_addr: str) -> Any:
    """A standalone process group (not the default one, not registered with torch.distributed's world).

    gloo binds the interface that routes to ``master_addr`` (loopback for a
    local sender; ``GLOO_SOCKET_IFNAME`` overrides), so a single-host run
    never opens a socket outside 127.0.0.1.
    """
    if backend == "gloo":
        if not dist.is_gloo_available():
            raise ConfigurationError("backend='gloo' but this torch build has no gloo")
        ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        device = (
            dist.ProcessGroupGloo.create_device(interface=ifname.split(",")[0])
            if ifname
            else dist.ProcessGroupGloo.create_device(hostname=local_address(master_addr))
        )
        # torch's stub calls the gloo options class ProcessGroupGloo.Options, but that name is Backend.Options at
        # runtime (it takes no devices): the class that does is _Options.
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [device]
        options._timeout = as_timedelta(timeout)
        return dist.ProcessGroupGloo(store, rank, size, options)
    if backend == "nccl":
        if not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise ConfigurationError("backend='nccl' needs CUDA and a torch build with NCCL; use backend='gloo' on CPU")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = as_timedelta(timeout)
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ConfigurationError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def new_group_within(
    deadline: float,
    what: str,
    backend: str,
    store: dist.Store,
    rank: int,
    size: int,
    timeout: float,
    master_addr: str,
    **where: Any,
) -> Any:
    """:func:`new_group`, formed by ``deadline`` or given up; its operations then time out after ``timeout``.

    Anyone who reaches the store can claim a rank there as the group forms (its keys are public), so a rank may
    never come. gloo forms the group (waiting on the store and on its peers) with a timeout that ends at
    ``deadline``, then takes ``timeout`` for its operations; the formation runs on a thread of its own, which
    the caller stops waiting for at ``deadline`` whatever torch's C++ code does (NCCL forms lazily).

    Raises:
        SyncTimeoutError: the group did not form by ``deadline`` (``what``: which group, for the message).
        torch.distributed.DistError: torch's store or gloo failed (a peer went away).
        TransportError: anything else the formation raised: a rank's address in the store that is no address
            (anyone who reaches the store can write one; gloo raises ``ValueError`` on it).
    """
    made: Future = Future()
    forming = min(timeout, max(remaining(deadline), 0.001)) if backend == "gloo" else timeout

    def form() -> None:
        try:
            pg = new_group(backend, store, rank, size, forming, master_addr)
            if forming != timeout:
                pg._set_default_timeout(as_timedelta(timeout))  # gloo's own: every context of the group
            made.set_result(pg)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            made.set_exception(exc)

    thread = threading.Thread(target=form, name="weightsync-group-formation", daemon=True)
    thread.start()
    try:
        return made.result(timeout=max(remaining(deadline), 0.0))
    except dist.DistError:
        raise
    except (ValueError, RuntimeError) as exc:
        raise TransportError(f"{what} could not form: {first_line(exc)}", **where) from None
    except TimeoutError:
        thread.join(FORMATION_GRACE_S)  # gloo gives up at the same deadline: let its thread end with the call
        raise SyncTimeoutError(
            f"{what} did not form in time: a rank did not connect (a peer is late or gone, or a process that reached "
            "the store claimed a rank)",
            **where,
        ) from None


def is_timeout(exc: BaseException) -> bool:
    """A gloo/NCCL wait that ran out of time, as opposed to a peer that went away."""
    return "timed out" in str(exc).lower() or "timeout" in type(exc).__name__.lower()


@dataclass
class Link:
    """The group and store a transport talks over: the engine's, filled in once the group formed, or a pair
    of a transport's own (a worker that rejoined); and what seals and opens the store's values there."""

    pg: Any = None
    store: dist.Store | None = None
    sealer: Sealer | None = None


class Waiter:
    """Completes one peer's gloo/NCCL operations, in order, on a thread of its own.

    gloo offers no non-blocking completion test for point-to-point operations,
    and a wait with a timeout closes the connection to the peer: a slow worker
    would be cut off. The thread waits without a timeout (the group's own
    operation timeout still applies); callers wait on the returned futures
    with theirs. A dead peer fails the pending operations at once.
    """

    def __init__(self, name: str) -> None:
        self._queue: deque[tuple[Any, Future]] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, work: Any) -> Future:
        future: Future = Future()
        with self._cond:
            self._queue.append((work, future))
            self._cond.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop)
                if self._stop:
                    for _, future in self._queue:
                        future.cancel()
                    return
                work, future = self._queue.popleft()
            try:
                work.wait()
                future.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)

    def close(self, timeout: float) -> bool:
        """Stop after the operation in progress; ``False`` if it is still blocked after ``timeout``."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)
        return not self._thread.is_alive()
