"""What one scheme holds while it lives: :class:`Runtime`, its state declared once.

A scheme's options say what it is; its runtime says where it is: its place in the lifecycle, the model it
registered, the workers, its sender or receiver core and the program that drives it. Every part of a scheme reads
that state from here (its facts, its handoff, the older facade), so none has to guess what the others hold.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import LifecycleError
from .drivers import UNDRIVEN, Drive, Driver, ModelHold
from .states import CLOSED, NEW, SENDER_CONNECTED

if TYPE_CHECKING:
    from ..tensors.strategy import WeightStrategy
    from .receiver import Receiver
    from .sender import Sender

__all__ = ["Runtime"]

#: Every scheme's runtime in this process, for :func:`_free_locks_in_fork_child` (registered with the first).
_RUNTIMES: weakref.WeakSet[Runtime] = weakref.WeakSet()


@dataclass(eq=False)
class Runtime:
    """The state of one scheme between its construction and its shutdown; never pickled (a pickled scheme carries
    its options and its handoff, and starts a new one).

    Attributes:
        strategy: how the scheme's weights are read and written (its ``strategy`` option).
        state: where it is in its lifecycle (:mod:`weightsync.core.states`).
        model_id: the model's name or path inside ``context`` (``None`` before init).
        context: the object the model was found in, or the program that drives the scheme (a sender's, held weakly
            where the program holds the scheme: :attr:`~weightsync.core.drivers.Driver.holds_its_schemes`).
        model: the registered model (sender: or its weights).
        skeleton: sender: the registered model holds tensors without data (the meta device): a send that reads it
            is checked (and refused), and weights must be given (``send(weights=...)``).
        worker_idx: receiver: which worker this is (``None`` until known).
        num_workers: sender: how many workers it serves; a receiver rebuilt from a sender knows it too.
        handoff: what a worker needs to reach its sender (from a pickled sender or a receiver config), else ``None``.
        drive: how a program drives this scheme (travels with a pickled sender), else ``None``.
        driver: the program that drives it (:data:`~weightsync.core.drivers.UNDRIVEN`: none).
        sending: the sender core, once ``init_on_sender`` ran.
        receiving: the receiver core, once ``init_on_receiver`` ran.
        facades: the older API's facades handed out so far (``"sender"``, ``"receiver"``), one of each.
        lock: held by every lifecycle call (and by a sender's rejoin thread when it admits a worker).
        weights_lock: held while a receiver writes or switches its model's weights; a worker whose forward pass
            runs beside a background receiver thread holds it too.
        hold: the model's forward passes taking turns with updates on ``weights_lock``, where a program applies
            updates itself.
        pid: the process it left :data:`NEW` in (its construction's until then): one that reached another process by
            ``fork`` after that is refused by name there.
        forked_in_use: this is a copy ``fork`` made while another thread of the parent held one of its locks (in a
            set-up call, a send, an update's write): refused by name as a forked copy, whatever its state.
    """

    strategy: WeightStrategy
    state: str = NEW
    model_id: str | None = None
    held_context: Any = None  # (the context, or a weak reference to it: read :attr:`context`)
    model: Any = None
    skeleton: bool = False
    worker_idx: int | None = None
    num_workers: int | None = None
    handoff: dict[str, Any] | None = None
    drive: Drive | None = None
    driver: Driver = UNDRIVEN
    sending: Sender | None = None
    receiving: Receiver | None = None
    facades: dict[str, Any] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    weights_lock: threading.RLock = field(default_factory=threading.RLock)
    hold: ModelHold = field(init=False)
    pid: int = field(default_factory=os.getpid)
    forked_in_use: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.hold = ModelHold(self.weights_lock)
        _watch_forks()
        _RUNTIMES.add(self)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "state" and value != NEW and getattr(self, "state", NEW) == NEW:  # (a new one forked is new)
            object.__setattr__(self, "pid", os.getpid())
        object.__setattr__(self, name, value)

    @property
    def forked(self) -> bool:
        """This is a copy ``fork`` made of a scheme another process set up, or of one another thread of it held at the
        fork (:attr:`forked_in_use`): what it holds is that process's (its shutdown here lets go of nothing: a
        worker's ``finally: shutdown()`` removed its trainer's key file)."""
        return self.forked_in_use or (self.state != NEW and self.pid != os.getpid())

    @property
    def holds_nothing(self) -> bool:
        """Nothing for a shutdown to let go of: never initialized, shut down, or a copy ``fork`` made."""
        return self.state in (NEW, CLOSED) or self.forked

    def require(self, *states: str, action: str) -> None:
        """Refuse ``action`` unless the scheme is in one of ``states``.

        Raises:
            LifecycleError: naming the state it is in, the ones ``action`` needs, the model and the worker.
        """
        if self.forked_in_use or (self.state not in states and self.forked):
            raise LifecycleError(
                f"cannot {action}: this scheme is {self.state} in process {self.pid}"
                f"{', in use by another thread there,' if self.forked_in_use else ','} and reached process "
                f"{os.getpid()} by fork, not pickled: give each worker the scheme pickled (multiprocessing's 'spawn' "
                "or 'forkserver' start method does; 'fork', Linux's default before Python 3.14, does not) or its "
                "receiver_config(worker_idx)",
                model_id=self.model_id,
                worker_idx=self.worker_idx,
            )
        if self.state not in states:
            raise LifecycleError(
                f"cannot {action}: scheme is {self.state}; {action} needs it {' or '.join(states)}"
                f"{self._taken(action)}",
                model_id=self.model_id,
                worker_idx=self.worker_idx,
            )

    def _taken(self, action: str) -> str:
        """Why a set-up call meets a sender connected already: a second program (one that starts its workers before
        it calls the scheme) handed a scheme that serves another's workers, whose own the first refused by then."""
        if self.state != SENDER_CONNECTED or action not in ("init_on_sender", "connect"):
            return ""
        each = "give each program a scheme of its own, built from the same config)"
        if self.context is None:
            return f" (it is connected already; where another program was handed it, {each}"
        return f" (it serves a {type(self.context).__name__} already: a scheme serves one program's workers; {each}"

    @property
    def context(self) -> Any:
        held = self.held_context
        return held() if isinstance(held, weakref.ref) else held

    @context.setter
    def context(self, context: Any) -> None:
        self.held_context = context

    def hold_context(self, context: Any, *, weakly: bool) -> None:
        """Hold ``context``; ``weakly``: where it is a program that holds its schemes, which a sender kept alive past
        its owner's last reference (a thread of the scheme's holds the scheme): its ``__del__``, which ends its
        workers, never ran, and the process hung at its exit joining them (an audit)."""
        self.held_context = weakref.ref(context) if weakly and context is not None else context

    @property
    def applies_itself(self) -> bool:
        """A program drives this receiver: it applies updates itself, and its model's sharing is the program's."""
        return self.drive is not None and self.drive.applies_itself


def _free_locks_in_fork_child() -> None:
    """A fork copies a lock as it is: one another thread of the parent held at that moment (a set-up call or a send
    under way in a trainer, a rejoin's admission, an update being written in a worker) stayed held in the child for
    good, where that thread does not exist, and the child's ``init_on_receiver`` and ``shutdown`` (and, with a hold,
    its model's forward passes) waited on it forever. Such a lock is freed in the child, much as the standard library
    frees its logging handlers' locks, and its scheme marked :attr:`Runtime.forked_in_use`: refused there by name, its
    shutdown letting go of nothing. A lock free at the fork, or held by the forking thread (which goes on in the
    child, and releases it), is left as it is. A worker forked while its receiver wrote an update holds, in the child,
    the weights as they were at that instant: part of the old version, part of the new."""
    for rt in list(_RUNTIMES):
        for lock in (rt.lock, rt.weights_lock):
            if lock.acquire(blocking=False):  # (free, or the forking thread's own: an RLock takes it again)
                lock.release()
            else:
                lock._at_fork_reinit()  # type: ignore[attr-defined]
                rt.forked_in_use = True


@functools.cache
def _watch_forks() -> None:
    """Register :func:`_free_locks_in_fork_child`, once a process, with its first scheme (an import registers
    nothing)."""
    os.register_at_fork(after_in_child=_free_locks_in_fork_child)
