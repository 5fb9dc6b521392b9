"""What ``python -m weightsync`` starts before it imports the app: the forkserver its workers are forked from.

The job's default start method is forkserver (``start_method: null``, see :mod:`weightsync.app.job`), whose
server imports torch and tensordict before it forks the first worker: about 3 s on 2 cores, which came after the
app's own imports (about 2.5 s) and made most of a short run (6.9 s for the default job, 5.4 s now). Started
first, it imports them while the app does. This module imports nothing heavy: it runs before the config is
composed, so it guesses from the command line, and a run that ends up not forking workers (Ray actors only) leaves
an idle server, which exits with the run.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing import forkserver

__all__ = ["PRELOAD", "may_fork_workers", "start_forkserver_early"]

#: What the forkserver imports before it forks a worker (the worker's code, and what that imports), then how it ends.
PRELOAD = ["torch", "tensordict", "weightsync.app.job", "weightsync.app.forkserver_exit"]
#: Options after which the app starts no worker (Hydra's help, config printing, shell completion).
_NO_WORKERS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-p", "--package", "-sc")
_NO_WORKERS_PREFIXES = ("--shell-completion", "--cfg=", "--info=")


def start_forkserver_early(argv: list[str]) -> bool:
    """Start the forkserver (with :data:`PRELOAD`) if ``argv`` may fork workers from it (:func:`may_fork_workers`);
    return whether it did."""
    if not may_fork_workers(argv):
        return False
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    return True


def may_fork_workers(argv: list[str]) -> bool:
    """Whether the app run with ``argv`` may fork workers from a forkserver: the platform has one, and no option
    says the run starts no worker (help, config printing, completion) or starts them another way."""
    if "forkserver" not in mp.get_all_start_methods():
        return False
    if any(a in _NO_WORKERS or a.startswith(_NO_WORKERS_PREFIXES) for a in argv):
        return False
    return not any(a.startswith("start_method=") and a.split("=", 1)[1] not in ("forkserver", "null") for a in argv)
