"""A private network namespace with only loopback, so that Ray's traffic in tests stays on 127.0.0.1."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess

import pytest

_CLONE_NEWNET = 0x40000000


@contextlib.contextmanager
def loopback_only_network():
    """Run the enclosed code in a new network namespace whose only interface is ``lo``.

    Ray binds its services to the node's address, ignoring ``_node_ip_address``; in a namespace with
    only loopback that address is 127.0.0.1, so the cluster's traffic never leaves loopback. Threads
    and processes started inside inherit the namespace; the test process returns to its own after.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    original = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        if libc.unshare(_CLONE_NEWNET) != 0:
            pytest.skip(
                "Ray binds the machine's own address; keeping its traffic on loopback needs a private network "
                f"namespace, which needs root here ({os.strerror(ctypes.get_errno())})"
            )
        try:
            subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=10)
            yield
        finally:
            if libc.setns(original, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "could not return to the original network namespace")
    finally:
        os.close(original)
