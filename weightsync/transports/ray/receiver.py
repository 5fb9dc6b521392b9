"""An actor's side of the Ray engine: updates arrive as calls into the actor, and are applied there."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ...core.engine import Delivery, ReceiverEngine
from ...errors import ConfigurationError
from ...tensors.delta import Delta, chunks_of
from ...tensors.layout import FlatLayout
from .transport import LayoutWanted, register_receiver, unregister_receiver

__all__ = ["RayReceiver"]


class RayReceiver(ReceiverEngine):
    """The receiver of one model in this actor, found by :func:`~weightsync.transports.ray.apply_in_actor`.

    An actor cannot share the object store's memory with its model (the store hands out read-only buffers,
    and the object must be freed), so it copies: ``placement`` is ``"load"`` (one copy per buffer into the
    model bound at its first update) or ``"write"`` (``keep_storage``: tensor by tensor).
    """

    pushes = True

    def __init__(self, *, placement: str, where: dict[str, Any]) -> None:
        self.placement = placement
        self.where = where
        self._apply: Callable[[list[Delivery]], int] | None = None
        #: An actor that runs calls side by side (``max_concurrency`` > 1) may run two updates at once, or a later
        #: one first: they apply one at a time, and never an older version after a newer one.
        self._applying = threading.Lock()
        self._held: int | None = None
        register_receiver(where["model_id"], self)

    def attach(self, apply: Callable[[list[Delivery]], int]) -> None:
        self._apply = apply

    def join(self, deadline: float, check: Callable[[FlatLayout], Any], update_timeout: float) -> None:
        pass  # nothing to join: the sender's connect() delivers version 0 as a call to this actor

    def push(
        self,
        version: int,
        buffers: list[torch.Tensor],
        ranges: list,
        layout: dict | None,
        digest: str | None,
        changes: dict | None = None,
    ) -> int:
        """Called inside the actor by the sender's call: apply the update (``changes``: the description of the
        changes ``buffers[0]`` holds, against the version held); return the version held (a later one than
        ``version``, which is then not applied, where a later one was applied first).

        Raises:
            LayoutWanted: no layout came with the update, and this process holds none.
        """
        with self._applying:
            if version == 0 and layout is not None:  # a sender's first (a new one, a restarted trainer): over again
                self._held = None
            if self._held is not None and version <= self._held:
                return self._held
            if layout is None and self.layout is None:
                raise LayoutWanted(
                    "this actor was sent an update without the layout and holds none: a new process (Ray restarted it)",
                    **{**self.where, "version": version},
                )
            refusal, pieces, delta = None, [], None
            try:
                if layout is not None:
                    self.layout = FlatLayout.from_plain(layout)
                if self.layout is not None and changes is not None:
                    delta = Delta.from_plain(changes, chunks_of(self.layout))
                    if len(buffers) != 1 or buffers[0].dtype != torch.uint8:
                        raise ConfigurationError(f"a body of changes in {len(buffers)} buffers, where one is sent")
                    delta.body = buffers[0]
                elif self.layout is not None:
                    pieces = self.layout.placed(buffers, [tuple(r) for r in ranges])
            except ConfigurationError as exc:
                refusal = exc
            assert self._apply is not None
            self._held = self._apply([Delivery(version, pieces, digest, refusal=refusal, delta=delta)])
            return self._held

    def close(self) -> None:
        unregister_receiver(self.where["model_id"] or "", self)
