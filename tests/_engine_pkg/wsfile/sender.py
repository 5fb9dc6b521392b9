"""The trainer's side of ``wsfile``: writes each version into the directory, reads the workers' acks."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from weightsync.core.engine import Outgoing, SenderEngine, Sink
from weightsync.core.timing import WAIT_TICK_S, remaining
from weightsync.errors import ReceiverError, SyncTimeoutError, WeightSyncError
from weightsync.integrity import digest
from weightsync.tensors.layout import FlatLayout

from .directory import PREFIX, Directory
from .settings import WsFileSettings

__all__ = ["WsFileSender"]


class WsFileSender(SenderEngine):
    """A private directory (made here, removed at close), one staging buffer, and each worker's ack log.

    Args:
        settings: the transport's settings.
        checksum: hash each version's bytes for the workers to check.
    """

    def __init__(
        self, sink: Sink, layout: FlatLayout, num_workers: int, *, settings: WsFileSettings, checksum: bool
    ) -> None:
        super().__init__(sink, layout, num_workers)
        self.poll_s = settings.poll_ms / 1000
        self.checksum = checksum
        self.dir = Directory(tempfile.mkdtemp(prefix=PREFIX), settings.fsync)  # mode 0700
        self.dir.write_json(self.dir.layout, {"layout": layout.to_plain(), "num_workers": num_workers})
        self._staging = torch.empty(layout.nbytes, dtype=torch.uint8)
        self._views = layout.views(self._staging)
        self._pids: dict[int, int] = {}  # each joined worker's process
        self._logs: dict[int, Any] = {}  # each joined worker's ack log, open for reading
        self._unread: dict[int, bytes] = {}  # the end of each log that is not a whole line yet
        self._held: dict[int, int] = {}  # the version each worker last said it holds
        self._failure: dict[int, ReceiverError] = {}  # each worker's last failure, until a later success
        self._on_disk: list[int] = []  # versions whose files are in the directory

    def handoff(self) -> dict[str, Any]:
        return {"directory": str(self.dir.path)}

    def connection(self) -> dict[str, Any]:
        return {"directory": str(self.dir.path)}

    # ------------------------------------------------------------ rendez-vous
    def rendezvous(self, deadline: float, timeout: float) -> dict[int, WeightSyncError]:
        while True:
            for w in sorted(set(range(self.num_workers)) - set(self._pids)):
                joined = self.dir.read_json(self.dir.join(w))
                if joined is not None:
                    self._pids[w] = int(joined["pid"])
                    self._logs[w] = open(self.dir.acks(w), "rb")  # the worker made it before claiming its index
                    self._unread[w] = b""
            missing = sorted(set(range(self.num_workers)) - set(self._pids))
            if not missing:
                return {}  # a model that does not fit is refused by its worker, as the ack of version 0
            if remaining(deadline) <= 0:
                raise SyncTimeoutError(
                    f"workers {missing} did not join through {self.dir.path} within {timeout:.1f}s",
                    model_id=self.sink.model_id,
                )
            self.sink.waiting(lambda: list(self._pids))
            time.sleep(min(self.poll_s, WAIT_TICK_S, remaining(deadline)))

    def rendezvous_complete(self) -> bool:
        return len(self._pids) == self.num_workers

    # ---------------------------------------------------------------- sending
    def stage(self, out: Outgoing, deadline: float) -> str | None:
        with torch.no_grad():  # (the scheme takes no flatten_sender: out.whole is always None)
            for key, view in self._views.items():
                view.copy_(out.flat[key])
        self.dir.write(self.dir.version(out.version, "bin"), memoryview(self._staging.numpy()))
        self._on_disk.append(out.version)
        return digest([self._staging]) if self.checksum else None

    def submit(self, out: Outgoing, staged: str | None) -> None:
        # The .json makes the version visible: its bytes are complete by now.
        self.dir.write_json(self.dir.version(out.version, "json"), {"workers": out.workers, "digest": staged})
        self._forget_old(keep=out.version)

    def _forget_old(self, keep: int) -> None:
        """Remove the versions no live worker can still take: those older than every live worker holds."""
        live = [w for w in self._pids if not self.sink.is_dead(w)]
        floor = min((self._held.get(w, -1) for w in live), default=keep)
        for version in [v for v in self._on_disk if v < min(floor, keep)]:
            self.dir.version(version, "json").unlink(missing_ok=True)  # invisible first, then gone
            self.dir.version(version, "bin").unlink(missing_ok=True)
            self._on_disk.remove(version)

    # ------------------------------------------------------------------ acks
    def poll(self, workers: list[int]) -> None:
        for w in workers:
            if w not in self._logs or self.sink.is_dead(w):
                continue
            alive = _alive(self._pids[w])  # before reading: an ack written before it exited is read below
            left = False
            for record in self._read_log(w):
                left = left or bool(record.get("left"))
                if not left:
                    self._on_ack(w, record)
            if left or not alive:
                # A worker that reported a failure and then left is remembered for that failure.
                cause = "it closed its receiver" if left else f"its process {self._pids[w]} exited"
                self.sink.died(w, self._failure.get(w) or cause)

    def _read_log(self, w: int) -> list[dict[str, Any]]:
        data = self._unread[w] + self._logs[w].read()
        whole, _, self._unread[w] = data.rpartition(b"\n")
        return [json.loads(line) for line in whole.split(b"\n") if line]

    def _on_ack(self, w: int, record: dict[str, Any]) -> None:
        error, held = record.get("error"), record.get("held")
        self._failure.pop(w, None)
        if error is not None:
            where = {"model_id": self.sink.model_id, "worker_idx": w, "version": record["version"]}
            self._failure[w] = ReceiverError(str(error["type"]), str(error["message"]), **where)
            self.sink.failed(w, self._failure[w])
        if held is not None:
            self._held[w] = int(held)
            self.sink.acked(w, int(held))

    def wait(self, workers: list[int], deadline: float) -> None:
        time.sleep(min(self.poll_s, remaining(deadline)))  # acks are files: nothing to block on but time

    def close(self, timeout: float) -> None:
        for log in self._logs.values():
            log.close()
        self._logs.clear()
        if self.dir.path.is_dir():
            self.dir.write(self.dir.closed, b"")  # workers that look now see it; those that look later, no directory
            shutil.rmtree(self.dir.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not reaped by its parent yet, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True  # no /proc here: the signal said it exists
    return state != "Z"
