"""Which Ray cluster a scheme joins: the one it is given, or a new local one; never one that another user of the
host named for it.

Ray's ``ray.init()`` with no address joins the cluster whose address a file in Ray's temp dir names
(``/tmp/ray/ray_current_cluster``, which ``ray start`` writes), and ``"auto"`` falls back to any cluster whose
processes run on the host. Ray makes that dir writable by every user: another user who wrote the file, or ran a
cluster, had the trainer join theirs, whose workers then ran code in the trainer (a security review, as uid 65534:
the actors' returned pickles ran as root in the trainer; with a Ray token, the trainer handed it to them).
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ...errors import ConfigurationError
from ..keyfiles import is_own_dir

__all__ = ["LOCAL", "bootstrap_address", "own_tpu_logs", "private_ray_files", "private_temp_dir"]

#: What ``ray.init(address=...)`` takes for "start a new local cluster".
LOCAL = "local"
#: The longest socket path Ray makes under its temp dir (``/session_<date>_<pid>/sockets/plasma_store``), and the
#: longest it takes (an ``AF_UNIX`` path: 107 bytes on Linux, 103 on macOS).
_SESSION_SOCKET = len("/session_2026-12-07_11-11-07_275980_4194304/sockets/plasma_store")
_MAX_SOCKET = 103 if sys.platform.startswith("darwin") else 107
#: Where Ray looks for TPU logs to link into a new cluster's logs, where ``TPU_LOG_DIR`` names no directory.
_SHARED_TPU_LOGS = "/tmp/tpu_logs"


def bootstrap_address(address: str | None, temp_dir: str | None = None) -> str:
    """What ``ray.init(address=...)`` is given for ``address`` (the scheme's, else ``RAY_ADDRESS``): an address as
    it is; :data:`LOCAL` (a new local cluster) where there is none; for ``"auto"``, ``RAY_ADDRESS`` where it names
    one (as Ray reads it), else the address ``ray start``, run by this user, left in Ray's temp dir (``temp_dir``,
    else Ray's default).

    Raises:
        ConfigurationError: ``"auto"``, and that file is missing, another user's, or one others may write.
    """
    if not address:
        return LOCAL
    if address != "auto":
        return address
    if os.environ.get("RAY_ADDRESS") not in (None, "", "auto"):  # (Ray's own rule: it names the cluster)
        return os.environ["RAY_ADDRESS"]
    from ray._private.utils import get_ray_address_file  # (where ray.init looks)

    path = Path(get_ray_address_file(temp_dir))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ConfigurationError(
            f"address='auto' found no cluster started by `ray start` ({path}: {exc.strerror}): give the cluster's "
            "address (host:port), or none for a new local cluster"
        ) from None
    with contextlib.closing(os.fdopen(fd)) as file:
        found_stat = os.fstat(fd)
        owner = found_stat.st_uid
        if owner != os.getuid() or found_stat.st_mode & 0o022:
            raise ConfigurationError(
                f"address='auto' would join the cluster named in {path}, which user {owner} wrote (this is user "
                f"{os.getuid()}; mode {stat.S_IMODE(found_stat.st_mode):o}): every user of this host can write "
                "there, and a cluster another user runs runs code in this process. Give the cluster's address "
                "(host:port)"
            )
        found = file.read().strip()
    if not found:
        raise ConfigurationError(f"address='auto': {path} names no cluster: give the cluster's address (host:port)")
    return found


def private_temp_dir() -> str:
    """Where a new local cluster keeps its files (``ray.init(_temp_dir=...)``): ``ray`` in a directory of its own
    that only this user may enter, under Ray's usual place (``RAY_TMPDIR``, else ``TMPDIR`` on Linux, else
    ``/tmp``; ``/tmp`` where that is too long for Ray's socket paths).

    Ray makes its temp dir, and each session's directory, sockets and logs in it, writable by every user (mode
    0777, no sticky bit): under ``/tmp/ray`` another user can replace a running cluster's socket files and the
    files that name its ports, which Ray's processes started later connect to and read. A directory only this
    user enters (0700, made by :func:`tempfile.mkdtemp`) above Ray's keeps them out; it stays after the cluster,
    as Ray's own session directories do (their logs).
    """
    base = os.environ.get("RAY_TMPDIR") or (os.environ.get("TMPDIR") if sys.platform.startswith("linux") else None)
    base = os.path.abspath(base or "/tmp")
    if len(os.fsencode(base)) + len("/ws-ray-XXXXXXXX/ray") + _SESSION_SOCKET > _MAX_SOCKET:
        base = "/tmp"  # (Ray refuses to start past it: "AF_UNIX path length cannot exceed 107 bytes")
    return os.path.join(tempfile.mkdtemp(prefix="ws-ray-", dir=base), "ray")


@contextlib.contextmanager
def own_tpu_logs(temp_dir: str) -> Iterator[None]:
    """While a new local cluster starts in ``temp_dir`` (:func:`private_temp_dir`): Ray links its logs to
    ``/tmp/tpu_logs`` where ``TPU_LOG_DIR`` names no directory, and its log monitor sends each line of the files
    there to the driver; any user may make that directory (and link other files into it). Unless it is this
    user's, not open to others, ``TPU_LOG_DIR`` names an empty directory beside the cluster's for the start."""
    named = os.environ.get("TPU_LOG_DIR")
    # (absent, it is not this user's either: another user may make it before Ray looks)
    if is_own_dir(_SHARED_TPU_LOGS, closed=0o022) or (named and os.path.isdir(named)):
        yield
        return
    empty = os.path.join(os.path.dirname(temp_dir), "tpu_logs")
    os.makedirs(empty, mode=0o700, exist_ok=True)
    os.environ["TPU_LOG_DIR"] = empty
    try:
        yield
    finally:
        if named is None:
            os.environ.pop("TPU_LOG_DIR", None)
        else:
            os.environ["TPU_LOG_DIR"] = named


@contextlib.contextmanager
def private_ray_files() -> Iterator[str]:
    """For a new local cluster's start (``ray.init(_temp_dir=...)`` inside it): its files' place,
    :func:`private_temp_dir`, with :func:`own_tpu_logs` around the start."""
    temp_dir = private_temp_dir()
    with own_tpu_logs(temp_dir):
        yield temp_dir
