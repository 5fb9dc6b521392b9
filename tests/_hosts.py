"""Hosts for multi-host tests: network namespaces this test run makes, joined through a switch of its own.

Each host is a network namespace with ``lo`` and ``eth0``, an address from 198.18.0.0/15 (the range set aside for
network tests, RFC 2544) and nothing else; the hosts' links meet in a bridge inside one more namespace, the
switch, so no interface, address or route of the machine changes and no packet leaves the namespaces the test
made. Processes run inside a host with :meth:`Host.spawn` (``ip netns exec``); :func:`hosts` ends every one of
them and deletes the namespaces, bounded in time. Without root (or without ``ip``), tests that ask for hosts are
skipped with the reason.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

SUBNET = "198.18.0"
ROOT = Path(__file__).resolve().parent.parent


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, timeout=10, capture_output=True, text=True)


@dataclass
class Host:
    """One namespace: ``name`` (for ``ip netns exec``), ``addr`` (on ``eth0``), the switch port it is plugged in."""

    name: str
    addr: str
    port: str
    switch: str
    init: int = 0  # the host's first process (PID 1 of its PID namespace), as this machine numbers it
    procs: list[subprocess.Popen] = field(default_factory=list)

    def spawn(self, args: list[str], *, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start ``args`` (``python`` means this interpreter) inside this host, in a process group of its own."""
        if args[0] == "python":
            args = [sys.executable, *args[1:]]
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        proc = subprocess.Popen(
            ["nsenter", f"--target={self.init}", "--net", "--pid", "--mount", f"--wd={ROOT}", *args],
            env=full_env,
            cwd=ROOT,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **kwargs,
        )
        self.procs.append(proc)
        return proc

    def run(self, args: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run ``args`` inside this host to the end."""
        proc = self.spawn(args, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end(proc)
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def link(self, up: bool) -> None:
        """Plug this host's cable in or pull it out (its switch port goes up or down)."""
        _ip("-n", self.switch, "link", "set", self.port, "up" if up else "down")

    def lose(self, lost: bool) -> None:
        """Lose every packet to and from this host, or none again: its switch port leaves the switch (or joins it
        again). Unlike a cable pulled (:meth:`link`), its own link stays up, so its kernel goes on sending as into
        a network that drops everything: its TCP retries wait longer and longer, as they do across a real outage
        (with no carrier, the kernel retries every 0.5 s)."""
        _ip("-n", self.switch, "link", "set", self.port, *(["nomaster"] if lost else ["master", "br0"]))

    def shape(self, bits_per_s: float) -> None:
        """Limit what this host sends to ``bits_per_s``: a token bucket (``tbf``) on its ``eth0``, whose bucket
        holds 10 ms of the rate (at least 1 MB) so that the timer's granularity does not lower the rate."""
        burst = max(2**20, int(bits_per_s / 8 / 100))
        subprocess.run(
            ["tc", "-n", self.name, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", f"{int(bits_per_s)}bit",
             "burst", str(burst), "latency", "100ms"],
            check=True, timeout=10, capture_output=True,
        )  # fmt: skip

    def listening(self) -> list[tuple[str, int, str]]:
        """The TCP sockets listening in this host: (address, port, program)."""
        out = subprocess.run(
            ["ip", "netns", "exec", self.name, "ss", "-Htlnp"], check=True, timeout=10, capture_output=True, text=True
        ).stdout
        found = []
        for line in out.splitlines():
            cols = line.split()
            local = cols[3]
            addr, _, port = local.rpartition(":")
            program = cols[5] if len(cols) > 5 else ""
            found.append((addr.strip("[]"), int(port), program))
        return found


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired, ValueError):  # ValueError: its input was closed already
        proc.communicate(timeout=10)


def _boot(host: Host) -> Host:
    """Give ``host`` a PID namespace (and a /proc for it) of its own, held by a first process that every later
    process of the host joins: a host's processes see one another (Ray finds its raylet by listing them) and
    cannot reach another host's memory (TensorPipe would otherwise move tensors between "hosts" with
    process_vm_readv, past the link)."""
    holder = subprocess.Popen(
        ["ip", "netns", "exec", host.name, "unshare", "--pid", "--fork", "--mount-proc", "sleep", "infinity"],
        start_new_session=True,
    )
    host.procs.append(holder)
    deadline = time.monotonic() + 10
    while not (children := psutil.Process(holder.pid).children()):
        if holder.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"could not start host {host.name}'s first process")
        time.sleep(0.01)
    host.init = children[0].pid
    return host


def _can_make_hosts() -> str | None:
    if os.geteuid() != 0:
        return "multi-host tests make network namespaces, which needs root"
    if shutil.which("ip") is None or shutil.which("ss") is None:
        return "multi-host tests need iproute2 (ip, ss)"
    return None


@contextlib.contextmanager
def hosts(n: int = 2) -> Iterator[list[Host]]:
    """``n`` hosts on one switch (addresses 198.18.0.1, .2, ...), ended with everything started in them."""
    reason = _can_make_hosts()
    if reason:
        pytest.skip(reason)
    token = secrets.token_hex(3)
    switch = f"ws-{token}-sw"
    made: list[str] = []
    group: list[Host] = []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i in range(n):
            name, port = f"ws-{token}-{'abc'[i] if i < 3 else i}", f"p{i}"
            _ip("netns", "add", name)
            made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            addr = f"{SUBNET}.{i + 1}"
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            group.append(_boot(Host(name, addr, port, switch)))
        yield group
    finally:
        for host in group:
            for proc in reversed(host.procs):  # the first process last: its end ends every process of the host
                _end(proc)
        for name in reversed(made):
            _ip("netns", "del", name, check=False)
