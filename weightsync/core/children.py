"""Worker processes a sender knows of: it notices at once when one exits before it connected.

A spawned child that fails before it runs any of our code (a script without an ``if __name__ == "__main__":``
guard, an import error) never connects; without this the sender would wait out its whole ``connect_timeout``.
A sender knows the children that ``multiprocessing`` started with the scheme among their arguments (the
scheme is pickled for them while they start: spawn and forkserver), and the processes handed to
``connect(processes=...)`` (``multiprocessing`` processes, ``subprocess.Popen`` objects).
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.process
import subprocess
from collections.abc import Iterable
from typing import Any

from ..errors import ConfigurationError

__all__ = ["KnownProcesses"]


class KnownProcesses:
    """The worker processes one sender knows of, and which of them have exited."""

    def __init__(self) -> None:
        self._popens: list[Any] = []  # multiprocessing's launchers of children started with the scheme
        self._handed: list[Any] = []

    def note_spawning(self) -> None:
        """The scheme is being pickled: if for a child ``multiprocessing`` is starting, remember that child."""
        popen = multiprocessing.context.get_spawning_popen()
        if popen is not None and all(p is not popen for p in self._popens):
            self._popens.append(popen)

    def hand(self, processes: Iterable[Any]) -> None:
        """Watch ``processes`` too (``multiprocessing`` processes or ``subprocess.Popen`` objects).

        Raises:
            ConfigurationError: something else among them.
        """
        for proc in processes:
            if not isinstance(proc, (multiprocessing.process.BaseProcess, subprocess.Popen)):
                raise ConfigurationError(
                    f"processes= takes multiprocessing processes or subprocess.Popen objects, got {type(proc).__name__}"
                )
            self._handed.append(proc)

    def exited(self) -> list[str]:
        """Each known process that has exited since the last call, in words: ``"worker process doomed (pid 4711)
        exited with code 3"``. Each is said once, then forgotten: a ``connect()`` made again, once its restart is
        on its way, is not ended by it again."""
        found = []
        for popen in list(self._popens):
            code = popen.poll()
            if code is not None:
                found.append(f"worker process {_name(popen)} (pid {popen.pid}) exited with code {code}")
                self._popens.remove(popen)
        for proc in list(self._handed):
            code = proc.poll() if isinstance(proc, subprocess.Popen) else _exitcode(proc)
            if code is not None:
                name = proc.name if isinstance(proc, multiprocessing.process.BaseProcess) else proc.args
                found.append(f"worker process {name} (pid {proc.pid}) exited with code {code}")
                self._handed.remove(proc)
        return found


def _exitcode(proc: multiprocessing.process.BaseProcess) -> int | None:
    try:
        return proc.exitcode
    except ValueError:  # closed: it exited and was joined
        return 0


def _name(popen: Any) -> str:
    """The name of the ``multiprocessing`` process ``popen`` launched (its PID where it is not known)."""
    for proc in list(getattr(multiprocessing.process, "_children", ())):
        if getattr(proc, "_popen", None) is popen:
            return proc.name
    return f"of pid {popen.pid}"
