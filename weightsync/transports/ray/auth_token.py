"""Ray's authentication token, readable by this user alone.

Since Ray 2.59 a local cluster admits only processes that present its token, which Ray keeps in
``~/.ray/auth_token`` (or where ``RAY_AUTH_TOKEN_PATH`` says). Whoever holds it can submit tasks: run code in
every process of the cluster, the trainer's actors included. Ray writes that file with the process's umask
(0644 under the usual 022), so another user of the host who can enter the home directory reads it. Before
weightsync joins a cluster, the file is made private; a new local cluster's is created private before Ray
would create it.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import tempfile
from pathlib import Path

from ...errors import ConfigurationError

__all__ = ["keep_token_private", "token_path"]

log = logging.getLogger("weightsync.ray")


def token_path() -> Path | None:
    """Where Ray reads its token from, or ``None`` where it reads none from a file (token authentication off,
    or the token given in ``RAY_AUTH_TOKEN``)."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if (mode is not None and mode.lower() != "token") or os.environ.get("RAY_AUTH_TOKEN"):
        return None
    given = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return Path(given) if given else Path.home() / ".ray" / "auth_token"


def keep_token_private(new_cluster: bool) -> None:
    """Make Ray's token file readable and writable by its owner alone (said in a warning where it was not);
    where ``new_cluster`` (``ray.init`` is about to start one) and there is none at the default place, create
    it so, as Ray would otherwise create it open to all.

    Raises:
        ConfigurationError: the file is open to others and cannot be made private (another user's).
    """
    path = token_path()
    if path is None:
        return
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if new_cluster and not os.environ.get("RAY_AUTH_TOKEN_PATH"):  # (Ray creates none at a path it is given)
            _create(path)
        return
    mode = stat.S_IMODE(mode)
    if mode & 0o077:
        try:
            os.chmod(path, 0o600)
        except OSError as exc:
            raise ConfigurationError(
                f"Ray's token file {str(path)!r} is readable by other users (mode {mode:o}), who "
                f"could run code in the Ray cluster with it, and could not be made private: {exc}"
            ) from None
        log.warning("Ray's token file %s was readable by other users (mode %o): made private (0600)", path, mode)


def _create(path: Path) -> None:
    """A new token at ``path`` (256 random bits in hex, as Ray makes one), private from its first byte and whole
    once it is there (a directory made for it is private too)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, written = tempfile.mkstemp(dir=path.parent, prefix=".auth_token.")  # (0600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32))
        try:
            os.link(written, path)
        except FileExistsError:  # (made meanwhile, by another process: made private as any)
            keep_token_private(new_cluster=False)
    finally:
        os.unlink(written)
