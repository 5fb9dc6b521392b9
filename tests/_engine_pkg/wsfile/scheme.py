"""``WsFileWeightSyncScheme``: the public class of the ``wsfile`` engine, registered as ``"wsfile"``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from weightsync import checks, options
from weightsync.core.engine import ReceiverEngine, SenderEngine, Sink
from weightsync.core.scheme import WeightSyncScheme
from weightsync.errors import ConfigurationError, LifecycleError
from weightsync.options import option
from weightsync.tensors.layout import FlatLayout

from .directory import PREFIX
from .settings import FSYNC, POLL_MS, WsFileSettings

__all__ = ["WsFileWeightSyncScheme"]

_NAME = checks.text(rf"{PREFIX}[A-Za-z0-9_]+", max_len=100, what=f"a directory named {PREFIX}...")


def _directory(value: Any, where: str) -> str:
    """An absolute, normalized path to a directory a wsfile sender makes (checked as text: nothing is read)."""
    path = checks.text(max_len=4096, what="an absolute path")(value, where)
    if not os.path.isabs(path) or os.path.normpath(path) != path:
        raise ConfigurationError(f"{where} must be an absolute, normalized path, got {path!r:.120}")
    _NAME(os.path.basename(path), where)
    return path


class WsFileWeightSyncScheme(WeightSyncScheme, name="wsfile"):
    """Synchronize a model to workers on this host through files in a private directory.

    The sender makes a directory only its user can enter, writes each version's bytes there as one file
    (renamed into place once whole), then a small file saying which workers it is for. Each worker polls the
    directory (every ``poll_ms``), reads the newest version for it, applies it and appends its ack to a log
    of its own. A worker's process that exited, or a receiver that shut down, is reported gone. The sender
    removes the directory at ``shutdown()``.

    In a worker: the scheme pickled after ``init_on_sender``, or ``weightsync.from_config(receiver_config(i))``,
    then ``init_on_receiver(model=..., worker_idx=i)`` and ``connect()``; ``init_on_receiver`` also takes
    ``directory=`` (the sender's directory, for a scheme built from options only).
    """

    checksum: bool = option(options.CHECKSUM)
    poll_ms: float = option(POLL_MS)
    fsync: bool = option(FSYNC)

    TRANSPORTS = (WsFileSettings,)
    RECEIVER_HANDLES = ("directory",)

    def _sender_engine(self, sink: Sink, layout: FlatLayout, num_workers: int, kwargs: dict[str, Any]) -> SenderEngine:
        from .sender import WsFileSender

        assert self.settings is not None
        return WsFileSender(sink, layout, num_workers, settings=self.settings, checksum=self.checksum)

    def _receiver_engine(
        self, handoff: dict[str, Any], kwargs: dict[str, Any], where: dict[str, Any]
    ) -> ReceiverEngine:
        from .receiver import WsFileReceiver

        assert self.settings is not None
        directory = kwargs.pop("directory", None) or handoff.get("directory")
        if directory is None:
            raise LifecycleError(
                "this receiver does not know its sender's directory: hand it the scheme pickled after "
                "init_on_sender(), its receiver_config(), or pass directory=",
                model_id=where["model_id"],
            )
        return WsFileReceiver(_directory(directory, "directory"), settings=self.settings, where=where)

    @classmethod
    def check_receiver_connection(cls, connection: Mapping[str, Any], model_id: str) -> dict[str, Any]:
        """The sender's directory: an absolute path, named as a wsfile sender names the directories it makes."""
        return checks.fields(connection, {"directory": _directory}, "connection", required=("directory",))
