"""Attacks on the local channel (``multiprocess``, ``shared_mem``): a stranger's half frames, a key holder's garbage.

As a stranger (another user; run through ``tests/_as_stranger.py``), it finds the trainer's listener the way
any local user can, in ``/proc/net/unix`` (abstract socket names are listed there; the name carries the
trainer's pid, which ``ps`` shows anyone), and touches nothing else:

    python -m tests._attack_local hold <trainer pid> <seconds> <every>

every ``<every>`` s until it reads a line (or EOF) on stdin, opens two connections, one sending one byte of a
length header, one a whole header and part of its body, each then holding on; then it waits for the trainer
to drop them all, giving up ``<seconds>`` s after its start. It prints ``holding`` once the first two are
open, then one JSON line: for each connection, its mode and the times (``time.monotonic()``, one clock for
every process of the host) it was opened, taken by the trainer (its challenge arrived) and dropped by it
(``null``: not yet).

In the test process, :func:`key_holder` does a worker's side of the handshake with the run key and sends
whatever hello the test chooses: a key holder is not a stranger, so that attack needs no other user.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import selectors
import socket
import struct
import sys
import time

#: A listening socket's flag in /proc/net/unix (__SO_ACCEPTCON).
_LISTENING = 0x10000
#: Two ways to stall a reader that waits for a whole frame.
HALF_FRAMES = {
    "header_byte": b"\x00",  # one byte of a 4-byte length header
    "partial_body": struct.pack("!i", 100) + b"x" * 10,  # a header announcing 100 bytes, then 10 of them
}


def find_listener(trainer_pid: int, timeout: float = 10.0) -> str:
    """The abstract name (``\\0weightsync-<pid>-...``) a process listens on, read from /proc/net/unix."""
    prefix = f"@weightsync-{trainer_pid}-"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open("/proc/net/unix") as table:
            next(table)
            for line in table:
                fields = line.split()
                if len(fields) == 8 and int(fields[3], 16) & _LISTENING and fields[7].startswith(prefix):
                    return "\0" + fields[7][1:]
        time.sleep(0.05)
    raise SystemExit(f"no listener named {prefix}... in /proc/net/unix")


def hold(trainer_pid: int, seconds: float, every: float) -> None:
    address = find_listener(trainer_pid)
    sel = selectors.DefaultSelector()
    conns: list[dict] = []
    start = time.monotonic()
    next_open = start
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    opening = True
    while time.monotonic() - start < seconds and (opening or any(e["dropped"] is None for e in conns)):
        now = time.monotonic()
        if opening and now >= next_open:
            for mode, half in sorted(HALF_FRAMES.items()):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect(address)
                    sock.sendall(half)
                except OSError:  # the trainer has gone (shut down): nothing more to open
                    sock.close()
                    opening = False
                    break
                entry = {"mode": mode, "opened": now, "taken": None, "dropped": None}
                conns.append(entry)
                sel.register(sock, selectors.EVENT_READ, entry)
            if len(conns) == len(HALF_FRAMES):
                print("holding", flush=True)
            next_open = now + every
        wake = next_open if opening else start + seconds
        for key, _ in sel.select(timeout=max(0.0, min(wake, start + seconds) - time.monotonic())):
            entry = key.data
            if entry == "stdin":  # the test says stop opening (a line, or EOF): now wait for the drops
                sys.stdin.readline()
                opening = False
                sel.unregister(sys.stdin)
                continue
            try:
                data = key.fileobj.recv(4096)
            except OSError:
                data = b""
            if entry["taken"] is None:
                entry["taken"] = time.monotonic()  # the challenge (or the close) came: the trainer accepted it
            if not data:
                entry["dropped"] = time.monotonic()
                sel.unregister(key.fileobj)
                key.fileobj.close()
    print(json.dumps(conns), flush=True)


def _frame(data: bytes) -> bytes:
    return struct.pack("!i", len(data)) + data


def _read_frame(sock: socket.socket) -> bytes:
    (size,) = struct.unpack("!i", _exactly(sock, 4))
    return _exactly(sock, size)


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the trainer closed the connection")
        data += chunk
    return data


def key_holder(address: str, authkey: bytes, hello: bytes, timeout: float = 10.0) -> socket.socket:
    """Connect to ``address`` with the run key, answer the challenge, send ``hello`` (raw bytes, as they are).

    Returns the socket (a test reads what the trainer made of it: its proof, a refusal, or the close).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect("\0" + address[1:] if address.startswith("@") else address)
    nonce = _read_frame(sock)
    sock.sendall(_frame(hmac.new(authkey, b"worker" + nonce, hashlib.sha256).digest()))
    sock.sendall(_frame(hello))
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    """True when everything the trainer sent on ``sock`` ends in its close (within the socket's timeout)."""
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


if __name__ == "__main__":
    if sys.argv[1] == "hold":
        hold(int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]))
    else:
        raise SystemExit(f"unknown attack {sys.argv[1]!r}")
    os._exit(0)
