"""The private directory both sides share: what each file is, and how it is written so no reader sees half.

::

    layout.json        the layout and the number of workers (the sender writes it first)
    join-<w>.json      worker w joined: its pid (created once: a second claim of w fails)
    acks-<w>.jsonl     worker w's acks, one JSON line each, appended (a line not ended yet is not read)
    v-<version>.bin    a version's bytes, laid out by the layout
    v-<version>.json   the version is complete: the workers it is for, its checksum (written after the .bin)
    closed             the sender shut down

Every file but the ack logs appears whole, by a rename (or a link, for a claim) of a temporary file.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any

from weightsync.errors import ConfigurationError

__all__ = ["PREFIX", "Directory"]

#: The name every sender's directory starts with (``tempfile.mkdtemp(prefix=PREFIX)``).
PREFIX = "weightsync-wsfile-"
_VERSION = re.compile(r"v-(\d{10})\.json")


class Directory:
    """A sender's directory, as either side reads and writes it."""

    def __init__(self, path: str | os.PathLike[str], fsync: bool) -> None:
        self.path = Path(path)
        self.fsync = fsync

    # ------------------------------------------------------------------ names
    def version(self, version: int, suffix: str) -> Path:
        return self.path / f"v-{version:010d}.{suffix}"

    def join(self, worker: int) -> Path:
        return self.path / f"join-{worker}.json"

    def acks(self, worker: int) -> Path:
        return self.path / f"acks-{worker}.jsonl"

    @property
    def layout(self) -> Path:
        return self.path / "layout.json"

    @property
    def closed(self) -> Path:
        return self.path / "closed"

    def versions(self) -> list[int]:
        """The complete versions in the directory, oldest first.

        Raises:
            FileNotFoundError: the directory is gone.
        """
        return sorted(int(m.group(1)) for m in map(_VERSION.fullmatch, os.listdir(self.path)) if m)

    # ---------------------------------------------------------------- writing
    def write(self, path: Path, data: bytes | memoryview) -> None:
        """``path`` holds ``data``, whole, once this returns (an older file of that name is replaced)."""
        os.replace(self._temporary(data), path)

    def claim(self, path: Path, data: bytes) -> bool:
        """Create ``path`` holding ``data``, unless it exists (``False``); no reader sees it half written."""
        tmp = self._temporary(data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            tmp.unlink()
        return True

    def write_json(self, path: Path, value: Any) -> None:
        self.write(path, json.dumps(value).encode())

    def append(self, fd: int, value: Any) -> None:
        """One JSON line at the end of the log open as ``fd`` (``O_APPEND``: one write, never interleaved)."""
        os.write(fd, (json.dumps(value) + "\n").encode())
        if self.fsync:
            os.fsync(fd)

    def _temporary(self, data: bytes | memoryview) -> Path:
        tmp = self.path / f".tmp-{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    # ---------------------------------------------------------------- reading
    def read_json(self, path: Path) -> Any:
        """The JSON ``path`` holds, or ``None`` if there is no such file."""
        try:
            return json.loads(path.read_bytes())
        except FileNotFoundError:
            return None

    def check_private(self, **where: Any) -> None:
        """Refuse a directory that is not this user's alone: a receiver config cannot point a worker elsewhere.

        Raises:
            ConfigurationError: no such directory, or one another user owns or may read or write.
        """
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise ConfigurationError(
                f"no directory {self.path} here: its sender shut down, or runs on another host", **where
            ) from None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ConfigurationError(
                f"{self.path} is not a directory private to this user (mode {stat.filemode(st.st_mode)}, "
                f"owner {st.st_uid}): a wsfile sender makes its own",
                **where,
            )
