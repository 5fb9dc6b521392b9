"""A worker's side of the local engine: join the sender's listener, map its slots, deliver the updates."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ...core.engine import Delivery, ReceiverEngine
from ...core.timing import remaining
from ...errors import ConfigurationError, ConnectionClosedError, LifecycleError
from ...tensors.bound import BoundModel
from ...tensors.layout import FlatLayout
from ..keyfiles import ORPHAN_GRACE_S, read_key_file, remove_key_file_if_orphaned
from .channel import connect_channel
from .hello import hello_of
from .mp import MPTransport, Update
from .peers import PeerProcess
from .settings import MPSettings

__all__ = ["LocalReceiver"]


class LocalReceiver(ReceiverEngine):
    """The worker's channel to its sender, the slots it mapped, and the updates not applied yet.

    Args:
        address: the sender's abstract address.
        authkey: the sender's auth key (hex).
        key_file: the key file it was read from, if any (removed at close once its sender is gone).
        settings: the transport's: ``mp`` or ``shared_mem``, whose transport's ``pinning`` says the model reads
            the slots.
        placement: ``"load"``, ``"write"`` or ``"share"`` (see :class:`~weightsync.core.engine.ReceiverEngine`).
        where: ``model_id`` and ``worker_idx`` (this dict is the receiver core's: it knows the index at connect).
        device: the device of the worker's model (``"cuda:0"``, ``"cpu"``; ``None``: several), which the sender
            reads to choose where this worker's slots live.
    """

    def __init__(
        self,
        address: str,
        authkey: str,
        key_file: str | None,
        settings: MPSettings,
        *,
        placement: str,
        where: dict[str, Any],
        device: str | None = None,
    ) -> None:
        self.address, self._authkey, self.key_file = address, authkey, key_file
        self.settings = settings
        self.transport_class: type[MPTransport] = settings.transport_class()
        self.placement = placement
        self.where = where
        self.device = device
        self.transport: MPTransport | None = None
        self.num_workers: int | None = None
        self._pending: deque[Update] = deque()
        self._views: dict[int, tuple[Any, dict[str, Any]]] = {}  # slot -> (its buffer, typed views), made once
        # slot -> (its spare storage, typed views of it): what the model is bound to when it switches to that slot
        # where the memory behind a storage cannot be swapped (torch < 2.12).
        self._spare_views: dict[int, tuple[Any, dict[str, Any]]] = {}

    @classmethod
    def from_handoff(
        cls, handoff: dict[str, Any], kwargs: dict[str, Any], settings: MPSettings, **options: Any
    ) -> LocalReceiver:
        """From what a pickled scheme or a receiver config carries, and ``init_on_receiver``'s ``address=``,
        ``authkey=`` or ``authkey_file=``; ``settings`` and ``options`` as the constructor takes them.

        Raises:
            ConfigurationError: the key file cannot be read (the message says why).
            LifecycleError: nothing says where the sender is.
        """
        address = kwargs.pop("address", None) or handoff.get("address")
        authkey = kwargs.pop("authkey", None)
        authkey_file = kwargs.pop("authkey_file", None) or handoff.get("authkey_file")
        key_file = None
        if authkey is not None:
            authkey = authkey.hex() if isinstance(authkey, bytes) else authkey
        elif authkey_file is not None:
            authkey = read_key_file(authkey_file, model_id=options["where"]["model_id"])
            key_file = authkey_file
        else:
            authkey = handoff.get("authkey")
        if not address or not authkey:
            raise LifecycleError(
                "this receiver does not know where its sender is: hand it the scheme pickled after "
                "init_on_sender(), or pass address= and authkey=",
                model_id=options["where"]["model_id"],
            )
        return cls(address, authkey, key_file, settings, **options)

    def join(self, deadline: float, check: Callable[[FlatLayout], Any], update_timeout: float) -> None:
        hello = hello_of(self.where["worker_idx"], self.where["model_id"], self.device)
        try:
            # A sender writes its key file once it listens: with one read, a refused connection will not heal.
            channel = connect_channel(
                self.address,
                bytes.fromhex(self._authkey),
                hello,
                remaining(deadline),
                wait_for_listener=self.key_file is None,
            )
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            raise ConfigurationError(
                f"nothing listens at {self.address!r} from here, though its sender wrote the key file "
                f"{self.key_file}: the sender runs on another host or in another network namespace (the local "
                "schemes connect the processes of one host: across hosts use distributed, rpc or ray; "
                "docs/multinode.md), or it was killed",
                **self.where,
            ) from exc
        try:
            welcome = channel.recv_until(deadline, "the sender's welcome")
            if welcome["op"] == "refused":
                raise ConfigurationError(f"the sender refused this worker: {welcome.get('reason')}", **self.where)
            self.layout = FlatLayout.from_plain(welcome["layout"])
            self.num_workers = int(welcome["num_workers"])
            self.transport = self.transport_class(channel, self.where["worker_idx"])
            self.transport.process = PeerProcess.of_socket(channel.fileno())  # the sender's
            self.transport.pin_host = self.device is not None and self.device.startswith("cuda")
        except BaseException:
            channel.close()
            raise
        check(self.layout)  # a misfit is remembered: the first update is refused with it, and the sender told

    def take(self, timeout: float, newest: bool) -> list[Delivery]:
        assert self.transport is not None
        try:
            self._pending.extend(self.transport.receive_weights(0.0 if self._pending else timeout))
        except ConnectionClosedError:
            if not self._pending:
                raise
        if len(self._views) > len(self.transport.slot_buffers):  # slots the sender retired: their views go too
            self._views = {k: v for k, v in self._views.items() if k in self.transport.slot_buffers}
            self._spare_views = {k: v for k, v in self._spare_views.items() if k in self.transport.slot_buffers}
        if not self._pending:
            return []
        if newest:
            taken = list(self._pending)
            self._pending.clear()
        else:
            taken = [self._pending.popleft()]  # one version per call: the worker's loop sees each
        # Only the last is applied: the others are superseded, and acked by its ack.
        return [Delivery(u.version, [], token=u) for u in taken[:-1]] + [self._delivery(taken[-1])]

    def _delivery(self, update: Update) -> Delivery:
        assert self.transport is not None
        where = {**self.where, "version": update.version}
        buffer = self.transport.slot_buffers.get(update.slot)
        refusal: BaseException | None = None
        if update.slot in self.transport.bad_slots:
            error, reason = self.transport.bad_slots[update.slot]
            refusal = error(reason, **where)
        elif buffer is None:
            refusal = LifecycleError(f"update names slot {update.slot}, which was never shared", **where)
        views = None
        if buffer is not None and self.layout is not None:
            cached = self._views.get(update.slot)
            if cached is None or cached[0] is not buffer:  # a slot's typed views are made once
                cached = self._views[update.slot] = (buffer, self.layout.views(buffer))
            views = cached[1]
        storage = self.transport.spare(update.slot)
        return Delivery(
            update.version,
            [] if buffer is None else [(0, buffer)],
            digest=update.digest,
            views=views,
            storage=storage,
            storage_views=None if storage is None else self._views_of_spare(update.slot, storage),
            refusal=refusal,
            fence=self.transport.events.get(update.slot),
            token=update,
        )

    def _views_of_spare(self, slot: int, storage: torch.UntypedStorage) -> dict[str, Any] | None:
        """The typed views of ``slot``'s spare ``storage`` that binding the model to it makes its tensors (made once
        per storage object); ``None`` where the model swaps memory instead (torch >= 2.12: no views needed).

        Without the swap, a switching worker binds its model to the slot's spare at every update, and making the
        views of a device slot cost about 0.5 ms for a model of 120 tensors on an H100 (a CUDA view costs a few
        microseconds): more than half of a ``shared_mem`` update's fixed cost. The spare of a slot stays the same
        storage object from update to update (the mapping the model left goes back to its slot), and its memory
        never moves, so its views stay right."""
        if BoundModel.can_swap or self.layout is None:
            return None
        cached = self._spare_views.get(slot)
        if cached is None or cached[0] is not storage:
            whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            cached = self._spare_views[slot] = (storage, self.layout.views(whole))
        return cached[1]

    def ready(self, taken: list[Delivery]) -> None:
        assert self.transport is not None
        update = taken[-1].token
        if update.report_taken:
            self.transport.send_taken(update.version)

    def ack(self, taken: list[Delivery], held: int | None, error: BaseException | None = None) -> None:
        assert self.transport is not None
        self.transport.send_ack(taken[-1].version, error=error, held=held)

    def taken(self, delivery: Delivery, left: Any, swapped: bool) -> None:
        assert self.transport is not None
        self.transport.took(delivery.token.slot, delivery.storage if swapped else left)

    def close(self) -> None:
        self._views.clear()  # they hold the slots' mappings
        self._spare_views.clear()
        sender_closed = self.transport is not None and self.transport.closed_by_sender
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.key_file is not None:
            # A sender that shut down removed its key file before closing; one that was killed could not.
            remove_key_file_if_orphaned(self.key_file, grace=ORPHAN_GRACE_S if sender_closed else 0.0)
            self.key_file = None
