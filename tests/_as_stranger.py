"""Run a Python program as another user of this host: the adversary of SPEC section 11.

The stranger is uid/gid 65534 (``nobody``) with no supplementary group: it shares nothing with the test run but
the host (its loopback ports, its abstract sockets, ``/proc``). It gets the same interpreter and the same checkout
the tests use, and nothing else: where those live under a directory other users cannot enter (``/root`` here),
a private mount namespace shows the stranger just those paths, read-only bind mounts at the same places, so
``sys.executable`` and the repository's paths mean the same thing on both sides. Needs root (to make the
namespace and change user); elsewhere :func:`stranger_unavailable` says why, and the tests skip with it.

    proc = start_stranger(["-m", "tests._attacks", "rpc", str(port)])   # a subprocess.Popen, as nobody
    done = run_stranger(["-c", "import os; print(os.getuid())"], timeout=30)
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

__all__ = ["STRANGER_GID", "STRANGER_UID", "needs_stranger", "run_stranger", "start_stranger", "stranger_unavailable"]

STRANGER_UID = 65534
STRANGER_GID = 65534
ROOT = Path(__file__).resolve().parent.parent


def _closed_to_others(path: Path) -> bool:
    try:
        return not os.stat(path).st_mode & stat.S_IXOTH
    except OSError:
        return True


def _hidden_ancestors() -> dict[Path, set[Path]]:
    """For each directory other users cannot enter, the paths below it the stranger needs (relative to it)."""
    needed = {Path(sys.executable), Path(sys.executable).resolve(), Path(sys.prefix), Path(sys.base_prefix), ROOT}
    needed |= {Path(p) for p in sys.path if p and Path(p).is_dir()}
    hidden: dict[Path, set[Path]] = {}
    for path in needed:
        path = path.absolute()
        for ancestor in reversed(path.parents):
            if ancestor != Path("/") and _closed_to_others(ancestor):
                rel = path.relative_to(ancestor)
                if rel.parts:
                    hidden.setdefault(ancestor, set()).add(Path(rel.parts[0]))
                break
    return hidden


def _command(argv: list[str]) -> list[str]:
    """A root shell that shows the stranger what it needs, then becomes the stranger and runs Python."""
    lines = ["set -e", "mount --make-rprivate /"]
    for ancestor, entries in sorted(_hidden_ancestors().items()):
        keep = '"$(mktemp -d)"'
        lines.append(f'k={keep}; mount --bind {shlex.quote(str(ancestor))} "$k"')
        lines.append(f"mount -t tmpfs -o mode=0755,size=1m weightsync-stranger {shlex.quote(str(ancestor))}")
        for entry in sorted(entries):
            target = shlex.quote(str(ancestor / entry))
            source = f'"$k"/{shlex.quote(str(entry))}'
            lines.append(f"if [ -d {source} ]; then mkdir -p {target}; else touch {target}; fi")
            lines.append(f"mount --bind -o ro {source} {target}")
        lines.append('umount "$k"; rmdir "$k"')
    become = [
        "setpriv",
        f"--reuid={STRANGER_UID}",
        f"--regid={STRANGER_GID}",
        "--clear-groups",
        "--inh-caps=-all",
        "--",
        sys.executable,
        *argv,
    ]
    lines.append("exec " + shlex.join(become))
    return ["unshare", "--mount", "--", "sh", "-c", "\n".join(lines)]


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(ROOT),
        "HOME": "/nonexistent",
        "PYTHONUNBUFFERED": "1",
        "LANG": "C.UTF-8",
    }
    env.update(extra or {})
    return env


def _cwd() -> str:
    where = tempfile.mkdtemp(prefix="weightsync-stranger-")
    os.chown(where, STRANGER_UID, STRANGER_GID)
    return where


def start_stranger(argv: list[str], *, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    """``python *argv`` as the stranger, in a working directory of its own; output piped, as text."""
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.STDOUT)
    return subprocess.Popen(
        _command(argv), env=_env(env), cwd=popen.pop("cwd", None) or _cwd(), text=True, start_new_session=True, **popen
    )


def run_stranger(argv: list[str], *, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python *argv`` as the stranger to its end (killed past ``timeout`` s, then raising)."""
    proc = start_stranger(argv, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate(timeout=10)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


@functools.lru_cache(maxsize=1)
def stranger_unavailable() -> str | None:
    """Why no test can run as another user here, or ``None`` when one can."""
    if os.geteuid() != 0:
        return "running a test as another user needs root (to make a mount namespace and change user)"
    missing = [tool for tool in ("unshare", "setpriv", "mount") if shutil.which(tool) is None]
    if missing:
        return f"running a test as another user needs {', '.join(missing)} (util-linux)"
    try:
        probe = run_stranger(["-c", "import os, torch, weightsync; print(os.getuid(), os.getgroups())"], timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"could not start a process as uid {STRANGER_UID}: {exc}"
    if probe.returncode != 0 or probe.stdout.split()[:1] != [str(STRANGER_UID)]:
        return f"could not start a process as uid {STRANGER_UID}: {probe.stdout.strip()[-300:]}"
    return None


def needs_stranger(fn):
    """Skip the test, with the reason, where no process can run as another user here."""

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        reason = stranger_unavailable()
        if reason:
            pytest.skip(reason)
        return fn(*args, **kwargs)

    return checked
