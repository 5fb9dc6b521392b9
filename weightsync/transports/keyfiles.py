"""Auth key files: how a receiver config names its sender's key without carrying it (the local schemes' socket
key, the ``distributed`` scheme's run key).

The sender writes its random key, as hex, to an owner-only file (mode 0600)
in an owner-only directory (``$XDG_RUNTIME_DIR/weightsync-<uid>/``, else
``/tmp/weightsync-<uid>/``, mode 0700; see :func:`key_dir` for when another
user holds that name), named after its listening address
(a run key: after :func:`key_name`) and PID namespace, and removes it at
shutdown. A receiver config carries the
file's path; since that path may come from a file another host wrote, a
receiver reads only a path shaped like one the sender writes, for the
address the same config names (:func:`check_key_file_path`, pure), and only
a plain file of its own user, not a link, holding a key and nothing else
(:func:`read_key_file`).

The sender holds a lock on its file (``flock``) until it removes it: a file of the same name found when a sender
writes its own is one whose sender is gone (killed before its shutdown: the kernel released its lock), replaced,
unless its lock is still held (a live sender of the same name: the same fixed address in another network
namespace), which is an error naming it.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import stat
import tempfile
import time
from typing import Any

from ..core.timing import deadline_after, remaining
from ..errors import ConfigurationError
from .processes import pid_exited, pid_namespace

__all__ = [
    "KEY_BYTES",
    "ORPHAN_GRACE_S",
    "check_key_file_path",
    "check_run_key_path",
    "is_own_dir",
    "key_name",
    "key_dir",
    "read_key_file",
    "remove_key_file",
    "remove_key_file_if_orphaned",
    "write_key_file",
]

#: Seconds a worker that saw its sender go gives the sender's process to be marked exited, before it judges
#: whether the sender's key file is orphaned.
ORPHAN_GRACE_S = 1.0
#: Bytes of an auth key, a local scheme's or a run's (stored as twice as many hex digits).
KEY_BYTES = 32
_HEX_KEY = re.compile(rf"[0-9a-f]{{{2 * KEY_BYTES}}}")
#: path -> the descriptor of a key file this process wrote, which holds the file's lock until it is removed
_HELD: dict[str, int] = {}


def _dir_name() -> str:
    return f"weightsync-{os.getuid()}"


def key_dir() -> str:
    """This user's key directory: ``<base>/weightsync-<uid>``, made if missing, where ``<base>`` is
    ``$XDG_RUNTIME_DIR`` if it names a directory, else the temporary directory (``$TMPDIR``, ``/tmp``).

    It is used only if it is a directory (not a link) owned by this user with mode 0700. In a shared
    ``/tmp`` another user can take that name first (a directory, a file or a symbolic link of theirs),
    which would deny this user key files for every run: then the keys go to
    ``<base>/weightsync-<uid>.<random>/weightsync-<uid>``, both levels made private by this process
    (``mkdtemp``), and found again by later runs (only this user can own such a directory, and nothing
    there is trusted before its owner and mode are checked). No link is ever followed.

    Raises:
        ConfigurationError: no private directory can be made under ``<base>`` (not writable, say).
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = runtime if runtime and os.path.isdir(runtime) else tempfile.gettempdir()
    path = os.path.join(base, _dir_name())
    try:
        os.mkdir(path, 0o700)  # not makedirs: a link planted at `path` must not count as the directory
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigurationError(f"cannot make the auth key directory {path}: {exc.strerror}") from exc
    if is_own_dir(path):
        return path
    return _fallback_dir(base)


def _fallback_dir(base: str) -> str:
    """A private key directory of this user's under ``base`` when ``base/weightsync-<uid>`` is held by another
    user: one made earlier (both levels this user's, mode 0700, not links), else a new one."""
    prefix = _dir_name() + "."
    try:
        names = sorted(name for name in os.listdir(base) if name.startswith(prefix))
    except OSError:
        names = []
    for name in names:
        outer = os.path.join(base, name)
        inner = os.path.join(outer, _dir_name())
        if is_own_dir(outer) and is_own_dir(inner):
            return inner
    try:
        outer = tempfile.mkdtemp(prefix=prefix, dir=base)  # mode 0700, a name no one could guess
        inner = os.path.join(outer, _dir_name())
        os.mkdir(inner, 0o700)
    except OSError as exc:
        raise ConfigurationError(f"cannot make a private auth key directory under {base}: {exc.strerror}") from exc
    return inner


def is_own_dir(path: str, closed: int = 0o077) -> bool:
    """Whether ``path`` itself (not what a link there points to) is a directory of this user's whose mode has none
    of the bits ``closed`` (the default: 0700, private; ``0o022``: no other user may write in it)."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not stat.S_IMODE(info.st_mode) & closed


def _check_dir(path: str, **where: Any) -> None:
    os.lstat(path)  # FileNotFoundError: the caller says what a missing directory means
    if not is_own_dir(path):
        raise ConfigurationError(
            f"{path} must be a directory owned by this user with mode 0700 (it holds auth keys)", **where
        )


def _file_name(address: str) -> str:
    return f"{address.lstrip('@')}.{pid_namespace()}.key"


def write_key_file(address: str, authkey: bytes) -> str:
    """Write ``authkey`` to a new owner-only file named after ``address``; return its path.

    Receiver configs name this file instead of carrying the key, so they can be
    logged and saved. The sender removes it at shutdown.
    """
    directory = key_dir()
    for name in os.listdir(directory):  # keys of senders that were killed before they could remove them
        if _owner_is_gone(name):
            remove_key_file(os.path.join(directory, name))
    path = os.path.join(directory, _file_name(address))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        if not _is_abandoned(path):
            raise ConfigurationError(
                f"auth key file {path} is held by a running process: another sender of this user listens at "
                f"{address!r} (in another network namespace), or a process a killed sender forked still runs; "
                "give this sender another address"
            ) from None
        remove_key_file(path)  # its sender was killed: this process holds the address now
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, authkey.hex().encode("ascii"))
    except OSError:
        os.close(fd)
        remove_key_file(path)
        raise
    _HELD[path] = fd
    return path


def _is_abandoned(path: str) -> bool:
    """Whether no process holds the lock of the key file at ``path`` (its sender exited without removing it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def check_key_file_path(path: Any, address: str, where: str) -> str:
    """``path`` if it has the shape of the key file a sender listening at ``address`` writes; reads nothing.

    Raises:
        ConfigurationError: naming ``where``: not an absolute, normal path to a file named for ``address``
            in a ``weightsync-<uid>`` directory of this user.
    """
    return _check_path(path, re.escape(address.lstrip("@")), where, f"the sender at {address!r} writes", address)


def check_run_key_path(path: Any, where: str) -> str:
    """``path`` if it has the shape of a run key file (:func:`write_key_file` for a name from :func:`key_name`),
    in any ``weightsync-<uid>`` directory: a worker on another host keeps the copy it was given there.

    Raises:
        ConfigurationError: naming ``where``.
    """
    return _check_path(path, r"weightsync-[0-9]+-[0-9a-f]{24}", where, "a sender writes", "weightsync-<pid>-<token>")


def key_name() -> str:
    """A name for a run key file of this process's: ``weightsync-<pid>-<token>`` (swept once the pid exited), its
    token longer than a local socket's, so that no local scheme's key file passes for a run key."""
    return f"weightsync-{os.getpid()}-{secrets.token_hex(12)}"


def _check_path(path: Any, stem: str, where: str, whose: str, shown: str) -> str:
    if (
        type(path) is not str
        or not path.isprintable()
        or not os.path.isabs(path)
        or os.path.normpath(path) != path
        or os.path.basename(os.path.dirname(path)) != _dir_name()
        or not re.fullmatch(rf"{stem}\.([0-9]+|unknown)\.key", os.path.basename(path))
    ):
        raise ConfigurationError(
            f"{where} must be the path of the auth key file {whose} "
            f"(<dir>/{_dir_name()}/{shown.lstrip('@')}.<pid namespace>.key), got {path!r:.200}"
        )
    return path


def read_key_file(path: str, missing: str | None = None, **where: Any) -> str:
    """The hex auth key stored at ``path`` (``missing``: what to say if there is no file there).

    Reads only a plain file (not a link, a FIFO or a device) owned by this user and readable by no one else,
    in a directory of this user's with mode 0700, that holds a key and nothing else.

    Raises:
        ConfigurationError: the file is missing (the sender shut down, or runs on another host), or fails
            any of the conditions above (the message says which).
    """
    why = missing or "the sender has shut down, or runs on another host"
    missing = f"auth key file {path} does not exist: {why}"
    try:
        _check_dir(os.path.dirname(path), **where)
        # O_NONBLOCK: a FIFO planted in place of the file must not block the open.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise ConfigurationError(missing, **where) from exc
    except OSError as exc:  # ELOOP: a symbolic link
        reason = f"auth key file {path} cannot be opened as a plain file ({exc.strerror})"
        raise ConfigurationError(reason, **where) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigurationError(f"auth key file {path} is not a plain file; refusing it", **where)
        if info.st_uid != os.getuid():
            raise ConfigurationError(f"auth key file {path} belongs to another user; refusing it", **where)
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise ConfigurationError(f"auth key file {path} is readable by other users; refusing it", **where)
        data = os.read(fd, 2 * KEY_BYTES + 2)
    finally:
        os.close(fd)
    key = data.decode("ascii", "replace").strip()
    if not _HEX_KEY.fullmatch(key):
        raise ConfigurationError(f"auth key file {path} does not hold a weightsync auth key; refusing it", **where)
    return key


def _owner_is_gone(name: str) -> bool | None:
    """Whether the sender that wrote key file ``name`` (``weightsync-<pid>-<token>.<pid namespace>.key``) has
    exited; ``None``: not to be judged from here, now or later (a file of another PID namespace: a container
    sharing the directory, or a copy of the file from the sender's host; a name not of that form)."""
    stem, _, namespace = name.removesuffix(".key").rpartition(".")
    parts = stem.split("-")
    if not name.endswith(".key") or namespace != pid_namespace() or namespace == "unknown":
        return None
    if len(parts) != 3 or parts[0] != "weightsync" or not parts[1].isdigit():
        return None
    return pid_exited(int(parts[1]))


def remove_key_file_if_orphaned(path: str, grace: float = 0.0) -> None:
    """Remove the key file at ``path`` if the sender that wrote it has exited (a worker cleaning up after it).

    A worker learns of a killed sender when the kernel closes the sender's sockets, a moment before the
    process is marked exited: ``grace`` seconds are allowed for that.
    """
    deadline = deadline_after(grace)
    while os.path.exists(path):
        gone = _owner_is_gone(os.path.basename(path))
        if gone:
            remove_key_file(path)
            return
        if gone is None or remaining(deadline) <= 0:  # (one that cannot be judged here: no grace to wait)
            return
        time.sleep(0.01)


def remove_key_file(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = _HELD.pop(path, None)
    if fd is not None:  # (after the unlink: no moment where the file is there unlocked)
        os.close(fd)
