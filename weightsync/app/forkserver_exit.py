"""Imported by the job's forkserver alone (the last of :data:`~weightsync.app.early.PRELOAD`): once the job ends,
the server ends as soon as Python's exit begins, its streams flushed, without the interpreter's teardown of the
torch it imported (0.9 s on 2 cores), which whatever reads the job's output waited for: the server holds the job's
stdout and stderr. Its workers, forked from it, end as forked processes do (``os._exit``), never through this."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys

__all__: list[str] = []


def _end() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


atexit.register(_end)
