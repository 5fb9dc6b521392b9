"""The ``wsfile`` transport's settings: how often workers look at the directory, and whether files are synced."""

from __future__ import annotations

from weightsync import checks
from weightsync.core.settings import TransportSettings
from weightsync.options import Option, option

__all__ = ["FSYNC", "POLL_MS", "WsFileSettings"]

POLL_MS = Option(
    "poll_ms",
    2.0,
    float,
    "Milliseconds between two looks at the directory: a worker's for a new version, the sender's for acks.",
    checks.number(0.1, 1000.0),
)
FSYNC = Option(
    "fsync",
    False,
    bool,
    "Flush every version and ack to the disk before it is visible (a directory that must outlive a crash of "
    "the machine); off by default: the directory is private and temporary.",
    checks.boolean,
)


class WsFileSettings(TransportSettings, name="wsfile"):
    """Versions as files in a private directory, which workers poll."""

    poll_ms: float = option(POLL_MS)
    fsync: bool = option(FSYNC)
