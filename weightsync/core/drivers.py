"""Programs that drive a scheme themselves, and what the core asks of them.

Some programs take a scheme from their user and run its lifecycle on their own: in the trainer they call
``init_on_sender(model_id, context=<the program>)`` and pickle the scheme into their worker processes; in
each worker they call ``init_on_receiver`` and ``connect``, and may never call ``receive()``. A
:class:`Driver` answers what the core must know of such a program. Drivers live with their integrations
(:mod:`weightsync.integrations`); the core finds them through :mod:`weightsync.registry`, and only when a scheme
is given a context or arrives driven. What a driver decided for a sender (a :class:`Drive`) travels with the
pickled scheme to its workers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .. import registry
from ..errors import ConfigurationError
from ..model_path import resolve_model

if TYPE_CHECKING:
    from ..tensors.layout import FlatLayout
    from .engine import SenderEngine, Sink

__all__ = ["UNDRIVEN", "Drive", "Driver", "ModelHold", "driver_for", "driver_of", "forward_lock_hooks"]


@dataclass(frozen=True)
class Drive:
    """How a driver drives one scheme: plain data, pickled with the sender's scheme into the driver's workers.

    Attributes:
        driver: the driver's name in the registry (a worker finds its driver by it).
        applies_itself: the program's workers never call ``receive()``: each receiver applies updates itself, in
            a background thread, to a model the program handed it (its copy, which may sit in shared memory the
            program made: that sharing is not the user's, and an update may take the model out of it).
        index_base: the index the program gives its first worker (a scheme counts its workers from 0).
    """

    driver: str
    applies_itself: bool = False
    index_base: int = 0

    def worker_idx(self, given: Any) -> Any:
        """The scheme's index (from 0) of the worker the program calls ``given``; anything but an int is returned
        as it is, for the scheme's check of indices to refuse."""
        if isinstance(given, int) and not isinstance(given, bool):
            return given - self.index_base
        return given


class Driver:
    """A program that drives schemes itself, as the core sees it.

    A subclass registers itself under a name as it is defined (``class MyDriver(Driver, name="mine")``), one
    instance for every scheme it drives: a driver keeps no state of its own; it overrides :meth:`drives`, and
    what else its program needs. Every default is the answer for a context that no program drives: the base
    class's instance, :data:`UNDRIVEN`, is the driver of such a context (and of none).

    On the sender, in ``init_on_sender(model_id, context=...)``, the core calls:

    1. :meth:`drives` — whether ``context`` is this program; the first registered driver that says yes is asked
       the rest (a context none takes, :data:`UNDRIVEN`).
    2. :meth:`terms` — how it drives this scheme (pickled with it into the workers); then :meth:`extras`.
    3. :meth:`model` — the model ``model_id``, unless ``model=`` or ``weights=`` was given.
    4. :meth:`num_workers` — how many workers, unless ``num_workers=`` was given.
    5. :meth:`sink` — what the sender's engine reports acks, refusals and deaths to (default: the core).
    6. :meth:`sender_engine` — an engine of its own for this sender, or ``None``: the scheme's.
    7. :meth:`around` — the engine the core drives: that engine, or one of the program's that wraps it.
    8. :meth:`follow` — the scheme is initialized.

    In a worker, in ``init_on_receiver`` (the driver is the one the pickled :class:`Drive` names, else the one that
    drives ``context``) and after it:

    1. :meth:`check_receiver` — before the receiver opens anything.
    2. :meth:`follow` — the scheme is initialized.
    3. :meth:`applied` — after each update a receiver that applies updates itself applied, before its ack.
    """

    #: Its name in the registry (``name=`` of its class statement).
    name: ClassVar[str] = ""
    #: Keyword arguments the program passes to ``init_on_sender`` that the scheme takes and does not need.
    sender_extras: ClassVar[tuple[str, ...]] = ()
    #: The program holds the schemes it drives: a sender holds it (its context) weakly, not to keep it alive.
    holds_its_schemes: ClassVar[bool] = False

    def __init_subclass__(cls, *, name: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name:
            if cls.drives is Driver.drives:
                raise TypeError(f"{cls.__qualname__} must say which contexts it drives (Driver.drives)")
            cls.name = name
            registry.add_driver(cls(), name)

    def drives(self, context: Any) -> bool:
        """Whether ``context`` is this program (or a part of it that hands schemes a context). Must not import
        the program: a context of another kind is asked too."""
        return False

    def terms(self, context: Any) -> Drive | None:
        """How this program drives a sender initialized with ``context`` (``None``: as no program does)."""
        return Drive(self.name) if self.name else None

    def extras(self, context: Any, given: dict[str, Any]) -> None:
        """The :attr:`sender_extras` given to ``init_on_sender`` (``None``: not given), which the scheme takes and
        does not need (default: nothing is done with them).

        Raises:
            ConfigurationError: one says the program will start its workers in a way the scheme cannot serve."""

    def model(self, context: Any, model_id: str) -> Any:
        """The model ``model_id`` of ``context`` (default: found by name or path, :func:`~weightsync.resolve_model`).

        Raises:
            ConfigurationError: ``context`` holds no such model.
        """
        return resolve_model(context, model_id)

    def num_workers(self, context: Any) -> int | None:
        """How many workers the program runs (default: its ``num_workers``; ``None``: it does not say)."""
        return getattr(context, "num_workers", None)

    def sink(self, scheme: Any, sink: Sink) -> Sink:
        """What the engine of the sender ``scheme`` reports to, given the core's ``sink`` (default: ``sink``).

        A program whose workers finish each update with steps of its own (an inference engine that must resume,
        or record the version it serves) gives a sink of its own: it passes an ack on to the core only once
        those steps are done, so that ``send()`` returns when every worker serves the version."""
        return sink

    def sender_engine(self, scheme: Any, sink: Sink, layout: FlatLayout) -> SenderEngine | None:
        """An engine of the program's own for the sender ``scheme`` (its ``context``, ``model_id``, ``strategy``
        and ``weights_lock`` are set), reporting to ``sink``; ``None`` (default): the scheme's own engine."""
        return None

    def around(self, scheme: Any, engine: SenderEngine) -> SenderEngine:
        """The engine the core drives for the sender ``scheme``, given the one it built (default: ``engine``). A
        program that makes calls of its own around each version (an inference engine's control calls) wraps it."""
        return engine

    def abandon(self, scheme: Any, sink: Sink) -> None:
        """The sender ``scheme`` could not be built after :meth:`sink` gave ``sink`` (its engine raised, or
        :meth:`around` did): let go of what :meth:`sink` took (default: nothing)."""

    def follow(self, scheme: Any, context: Any) -> None:
        """``scheme`` was just initialized (``scheme.is_sender`` says on which side) with ``context``, which may be
        ``None`` in a worker: what the program needs done then (default: nothing)."""

    def check_receiver(self, scheme: Any, context: Any, *, knows_sender: bool) -> None:
        """Refuse a receiver the program set up in a way that cannot work (default: nothing is refused).
        ``knows_sender``: the scheme was pickled from an initialized sender, or built from a receiver config.

        Raises:
            ConfigurationError: naming what the program did and what works instead.
        """

    def last_words(self, context: Any, workers: list[int]) -> list[str]:
        """What the program's ``workers`` said before they exited, where it left their words (their errors), for
        the error that names them (called once a worker process exited before it connected; default: none)."""
        return []

    def applied(self, scheme: Any) -> None:
        """A receiver that applies updates itself (``scheme``'s, whose context is now ``scheme.context``) just
        applied an update, and acks it once this returns (an error raised here is acked as a
        :class:`~weightsync.errors.PassOnError`, the version held). Called by the thread that applied it; default:
        nothing."""


#: The driver of a context that no program drives, and of no context: every answer is the default.
UNDRIVEN = Driver()


def driver_of(context: Any) -> Driver:
    """The driver of the program ``context`` is, or :data:`UNDRIVEN`. Nothing is loaded for a context of ``None``."""
    if context is None:
        return UNDRIVEN
    return next((d for d in registry.drivers().values() if d.drives(context)), UNDRIVEN)


def driver_for(drive: Drive | None, context: Any) -> Driver:
    """A receiver's driver: the one its pickled ``drive`` names, else the one that drives ``context``.

    Raises:
        ConfigurationError: ``drive`` names a driver not installed in this process.
    """
    if drive is None:
        return driver_of(context)
    found = registry.drivers().get(drive.driver)
    if found is None:
        raise ConfigurationError(
            f"this scheme was pickled by a sender that {drive.driver!r} drives, and no integration of that name "
            f"is installed in this process (known: {sorted(registry.drivers())})"
        )
    return found


def forward_lock_hooks(model: Any, lock: Any) -> list[Any]:
    """Hooks on ``model`` (an ``nn.Module``; anything else gets none) that hold ``lock`` for the whole of each
    forward pass, failed ones included, so an update applied under it never lands inside one; the handles, to
    remove them."""
    if not isinstance(model, torch.nn.Module):
        return []

    def hold(module: Any, args: Any) -> None:  # (a pre-hook that returns something replaces the inputs)
        lock.acquire()

    def let_go(module: Any, args: Any, out: Any) -> None:
        lock.release()

    return [model.register_forward_pre_hook(hold), model.register_forward_hook(let_go, always_call=True)]


class ModelHold:
    """A receiver that applies updates itself, beside the program that runs its model: the model's forward passes
    and the updates take turns on ``lock`` (the scheme's ``weights_lock``)."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self._handles: list[Any] = []

    @property
    def holding(self) -> bool:
        """A model is held."""
        return bool(self._handles)

    def hold(self, model: Any) -> None:
        """Hold ``model`` from now on, and no longer the model held before."""
        self.release()
        self._handles = forward_lock_hooks(model, self.lock)

    def release(self) -> None:
        """Let the held model's forward passes run freely again. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
