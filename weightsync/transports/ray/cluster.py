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
import tempfile
from pathlib import Path

from ...errors import ConfigurationError

__all__ = ["LOCAL", "bootstrap_address", "private_temp_dir"]

#: What ``ray.init(address=...)`` takes for "start a new local cluster".
LOCAL = "local"


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
    that only this user may enter, under Ray's usual place (``RAY_TMPDIR``, else the system's temp dir).

    Ray makes its temp dir, and each session's directory, sockets and logs in it, writable by every user (mode
    0777, no sticky bit): under ``/tmp/ray`` another user can replace a running cluster's socket files and the
    files that name its ports, which Ray's processes started later connect to and read. A directory only this
    user enters (0700, made by :func:`tempfile.mkdtemp`) above Ray's keeps them out; it stays after the cluster,
    as Ray's own session directories do (their logs). The path is short: Ray's sockets live in it (108 bytes).
    """
    parent = tempfile.mkdtemp(prefix="ws-ray-", dir=os.environ.get("RAY_TMPDIR") or None)
    return os.path.join(parent, "ray")
