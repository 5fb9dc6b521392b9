"""How often a signal sent to a process misses a main thread that waits on a queue (docs/vllm.md, "Stopping an
engine"): vLLM's idle engine core waits so, and is stopped by one SIGTERM.

    python benchmarks/probe_signals.py --signals 300 --busy 3

The main thread waits on ``queue.Queue.get()``; ``--busy`` threads hash and sleep in turn (in and out of the
kernel, as an engine core's socket threads are). Another process sends SIGUSR1 every 20 ms; a signal counts as
missed when its Python handler has not run a second later (the main thread is then woken by hand). Python runs
handlers in the main thread only: when the kernel hands the signal to another thread, the handler waits until
the main thread wakes for some other reason.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import queue
import signal
import subprocess
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--signals", type=int, default=300)
    parser.add_argument("--busy", type=int, default=3, help="threads that keep entering and leaving the kernel")
    args = parser.parse_args()
    handled: list[float] = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: handled.append(time.monotonic()))
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            hashlib.sha256(b"x" * 200_000).digest()
            time.sleep(0.0001)

    for _ in range(args.busy):
        threading.Thread(target=busy, daemon=True).start()
    wake: queue.Queue[str | None] = queue.Queue()
    missed = 0
    failed: list[str] = []

    def sender() -> None:
        nonlocal missed
        try:
            for _ in range(args.signals):
                time.sleep(0.02)
                before = len(handled)
                subprocess.run(["kill", "-USR1", str(os.getpid())], check=True, timeout=10)
                sent = time.monotonic()
                while len(handled) == before and time.monotonic() - sent < 1.0:
                    time.sleep(0.001)
                if len(handled) == before:
                    missed += 1
                    wake.put("wake")  # the handler runs once the main thread wakes
                    woken = time.monotonic()
                    while len(handled) == before:
                        if time.monotonic() - woken > 10:
                            raise RuntimeError("the handler did not run within 10 s of waking the main thread")
                        time.sleep(0.001)
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            failed.append(f"{type(exc).__name__}: {exc}")
        finally:
            wake.put(None)

    threading.Thread(target=sender, daemon=True).start()
    while wake.get(timeout=600) is not None:
        pass
    stop.set()
    if failed:
        raise SystemExit(failed[0])
    print(f"{missed} of {args.signals} signals missed the waiting main thread for more than 1 s")


if __name__ == "__main__":
    main()
