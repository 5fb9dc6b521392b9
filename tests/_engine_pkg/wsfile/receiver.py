"""A worker's side of ``wsfile``: claims its index, polls the directory for versions, appends its acks."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from weightsync.core.engine import Delivery, ReceiverEngine
from weightsync.core.timing import deadline_after, remaining
from weightsync.errors import ConfigurationError, ConnectionClosedError, IntegrityError
from weightsync.tensors.layout import FlatLayout

from .directory import Directory
from .settings import WsFileSettings

__all__ = ["WsFileReceiver"]

#: The longest error text an ack carries.
MAX_ERROR_TEXT = 2000


class WsFileReceiver(ReceiverEngine):
    """One worker's view of the sender's directory: the versions for it not taken yet, and its ack log.

    Updates are read into one buffer of this engine, then loaded into the model (one copy per update: the
    buffer is read again by the next update).

    Args:
        directory: the sender's directory.
        settings: the transport's settings.
        where: ``model_id`` and ``worker_idx`` (the receiver core's dict: it knows the index at connect).
    """

    placement = "load"

    def __init__(self, directory: str, *, settings: WsFileSettings, where: dict[str, Any]) -> None:
        self.dir = Directory(directory, settings.fsync)
        self.poll_s = settings.poll_ms / 1000
        self.where = where
        self._buffer: torch.Tensor | None = None
        self._log: int | None = None  # the ack log's descriptor
        self._next = 0  # the first version not looked at yet
        self._mine: list[tuple[int, str | None]] = []  # versions for this worker not taken yet, with their checksum

    def join(self, deadline: float, check: Callable[[FlatLayout], Any], update_timeout: float) -> None:
        # update_timeout is not needed here: every wait of this engine is bounded by its own call's timeout.
        self.dir.check_private(**self.where)
        plain = self.dir.read_json(self.dir.layout)
        if plain is None:
            raise ConnectionClosedError(
                f"the sender of {self.dir.path} shut down before this worker joined", **self.where
            )
        worker = self.where["worker_idx"]
        if not 0 <= worker < int(plain["num_workers"]):
            raise ConfigurationError(f"the sender serves {plain['num_workers']} workers", **self.where)
        self.layout = FlatLayout.from_plain(plain["layout"])
        self._buffer = torch.empty(self.layout.nbytes, dtype=torch.uint8)
        self._log = os.open(self.dir.acks(worker), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        if not self.dir.claim(self.dir.join(worker), json.dumps({"pid": os.getpid()}).encode()):
            os.close(self._log)  # the log is the other process's: this one says nothing in it
            self._log = None
            raise ConfigurationError(f"another process joined {self.dir.path} as worker {worker}", **self.where)
        check(self.layout)  # a misfit is remembered by the core: version 0 is refused with it, and the sender told

    def take(self, timeout: float, newest: bool) -> list[Delivery]:
        deadline = deadline_after(timeout)
        while not self._look():
            if self.dir.closed.exists():
                raise ConnectionClosedError("the sender shut down", **self.where)
            if remaining(deadline) <= 0:
                return []
            time.sleep(min(self.poll_s, remaining(deadline)))
        taken = self._mine if newest else self._mine[:1]
        self._mine = self._mine[len(taken) :]
        # Only the last is read and applied: the others are superseded, and acked by its ack.
        return [Delivery(v, [], token=v) for v, _ in taken[:-1]] + [self._read(*taken[-1])]

    def _look(self) -> bool:
        """Note the versions published since the last look that are for this worker; whether any is waiting."""
        try:
            versions = [v for v in self.dir.versions() if v >= self._next]
        except FileNotFoundError:
            raise ConnectionClosedError("the sender shut down (its directory is gone)", **self.where) from None
        for version in versions:
            meta = self.dir.read_json(self.dir.version(version, "json"))
            if meta is not None and self.where["worker_idx"] in meta["workers"]:
                self._mine.append((version, meta["digest"]))
            self._next = version + 1
        return bool(self._mine)

    def _read(self, version: int, checksum: str | None) -> Delivery:
        assert self._buffer is not None and self.layout is not None
        refusal = None
        try:
            with open(self.dir.version(version, "bin"), "rb") as f:
                size = f.readinto(memoryview(self._buffer.numpy())) + len(f.read(1))
        except FileNotFoundError:
            raise ConnectionClosedError("the sender shut down (its directory is gone)", **self.where) from None
        if size != self.layout.nbytes:
            refusal = IntegrityError(
                f"{self.dir.version(version, 'bin').name} holds {size} bytes where the layout needs "
                f"{self.layout.nbytes}",
                **self.where,
                version=version,
            )
        return Delivery(version, [(0, self._buffer)], checksum, refusal=refusal, token=version)

    def ack(self, taken: list[Delivery], held: int | None, error: BaseException | None = None) -> None:
        assert self._log is not None
        failure = None if error is None else {"type": type(error).__name__, "message": str(error)[:MAX_ERROR_TEXT]}
        self.dir.append(self._log, {"version": taken[-1].version, "held": held, "error": failure})

    def close(self) -> None:
        if self._log is not None:
            self.dir.append(self._log, {"left": True})  # the sender stops waiting for this worker
            os.close(self._log)
            self._log = None
