"""Telling whether a process of this machine is still there, by PID within its PID namespace and boot."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["pid_exited", "pid_namespace", "process_identity", "process_is_gone"]


def pid_namespace() -> str:
    """This process's PID namespace (its inode): a PID names a process only within its namespace."""
    try:
        return os.readlink("/proc/self/ns/pid").split("[")[-1].rstrip("]")
    except OSError:
        return "unknown"


def pid_exited(pid: int) -> bool:
    """Whether process ``pid`` of this PID namespace has exited (a zombie not yet reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            return stat_file.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def process_identity() -> dict[str, Any]:
    """This process as another one on the same machine can check it: its PID, PID namespace and boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot_file:
            boot = boot_file.read().strip()
    except OSError:
        boot = "unknown"
    return {"pid": os.getpid(), "pidns": pid_namespace(), "boot": boot}


def process_is_gone(identity: dict[str, Any] | None) -> bool | None:
    """Whether the process ``identity`` (from :func:`process_identity`) has exited; ``None`` when this
    process cannot tell (another machine or PID namespace)."""
    mine = process_identity()
    if not identity or "unknown" in (mine["boot"], mine["pidns"]):
        return None
    if (identity.get("boot"), identity.get("pidns")) != (mine["boot"], mine["pidns"]):
        return None
    pid = identity.get("pid")
    if type(pid) is not int or pid <= 0:  # it came from a peer: a PID, or nothing we can judge
        return None
    return pid_exited(pid)
