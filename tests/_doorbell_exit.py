"""A process whose doorbell's store fails while the interpreter is torn down, run by
tests/test_distributed_doorbell.py. It serves a TCP store in a child process, listens on a doorbell there, and
kills the child from an object's ``__del__`` run in the teardown (after the ``atexit`` callbacks): a bell thread
still blocked on that store then sees its call fail there, which CPython 3.11 answers by aborting the process.

    python -m tests._doorbell_exit left     # the bell is never closed, and has no ringer: it is hung up at exit
    python -m tests._doorbell_exit rung     # the bell is never closed: it is rung at exit
    python -m tests._doorbell_exit silent   # the store stops answering (stopped, no reset); the bell is closed

Prints what it did; exits 0 if nothing aborted it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from tests._workers import stop_process
from weightsync.transports.distributed.doorbell import Doorbell
from weightsync.transports.storeclient import dial_store

SERVE = (
    "import time, torch.distributed as dist; "
    "s = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
    "print(s.port, flush=True); time.sleep(60)"
)


class KillInTeardown:
    """Kills the store's process when the interpreter's teardown drops this object, and gives the bell's thread
    a moment to see its call fail."""

    def __init__(self, server: subprocess.Popen) -> None:
        self.pid, self.kill, self.sigkill, self.sleep = server.pid, os.kill, signal.SIGKILL, time.sleep

    def __del__(self) -> None:  # (the modules' names may be gone by now: only what it holds)
        self.kill(self.pid, self.sigkill)
        self.sleep(1.0)


def main(mode: str) -> None:
    server = subprocess.Popen(  # (not on this process's stderr: whoever reads it to its end would wait for it)
        [sys.executable, "-c", SERVE], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        port = int(server.stdout.readline()) if server.stdout else 0
        client, hangup = dial_store("127.0.0.1", port, 30, silence=60)
        client.set_timeout(timedelta(seconds=3600))
        ringer = None
        if mode != "left":
            ringer = dist.PrefixStore("run", dist.TCPStore("127.0.0.1", port, is_master=False))
        bell = Doorbell(dist.PrefixStore("run", client), "bell/0", "test-doorbell", hangup, ringer)
        if mode == "silent":
            stop_process(server.pid)  # no answer, no reset: a host that vanished
            began = time.monotonic()
            bell.close()
            print(f"closed in {time.monotonic() - began:.1f}s, listening: {bell._thread.is_alive()}", flush=True)
    except BaseException:
        server.kill()  # (stopped or not)
        raise
    global keeper  # dropped with the module's names, in the teardown
    keeper = KillInTeardown(server)
    print("exiting", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
