"""What the core asks of an engine, and what an engine may ask of the core.

The core owns versions, acks, deadlines, the failure policy and metrics; an
engine moves bytes to workers and reports what came back. On the sender, the
core (:class:`~weightsync.core.sender.Sender`) calls a :class:`SenderEngine`
and the engine reports to a :class:`Sink`. On a worker, the core
(:class:`~weightsync.core.receiver.Receiver`) takes :class:`Delivery` objects
from a :class:`ReceiverEngine`, applies them, and has the engine ack them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from .. import integrity
from ..tensors.copies import copy_tensors, write_into

if TYPE_CHECKING:
    from ..errors import SyncTimeoutError, WeightMismatchError, WeightSyncError
    from ..tensors.delta import Delta
    from ..tensors.layout import FlatLayout

__all__ = ["Delivery", "Outgoing", "ReceiverEngine", "SenderEngine", "Sink"]


class Sink(Protocol):
    """The sender core, as an engine sees it: where it reports what came back from each worker, and the
    timing it owns (an engine keeps no copy of the scheme's timeouts: it reads them here when it needs them)."""

    model_id: str | None

    @property
    def timeout(self) -> float:
        """The longest one update may take from its send to its ack (the scheme's ``timeout``): each send's
        deadline is this far. An engine bounds by it what outlasts a call (an RPC's own timeout, a process
        group's operations)."""
        ...

    @property
    def connect_timeout(self) -> float:
        """The longest a rendez-vous may take (the scheme's ``connect_timeout``): an engine that serves its
        workers before the rendez-vous (a store opened at construction) or forms a group with one that comes
        back bounds that by it."""
        ...

    def acked(self, worker: int, held: int) -> None:
        """``worker`` holds version ``held`` (applied, or kept after refusing a later one)."""

    def failed(self, worker: int, error: WeightSyncError) -> None:
        """``worker`` is alive but failed: it refused an update (its error), or its call for ``error.version`` ended
        with no answer, and none comes."""

    def unanswered(self, worker: int, error: SyncTimeoutError) -> None:
        """``worker``'s call for ``error.version`` gave up waiting for the answer, which the engine can still hear
        of (it asks again): the worker is late on that version, as a wait that timed out finds it."""

    def died(self, worker: int, error: WeightSyncError | str) -> None:
        """``worker`` is gone; a string is the cause, and the core names the worker and the version."""

    def is_dead(self, worker: int) -> bool: ...

    def waiting(self, joined: Callable[[], Collection[int]]) -> None:
        """The rendez-vous is waiting (call it at least twice a second; ``joined()``: the workers there so far):
        the core says what is missing now and then, and raises ``WorkerDiedError`` when a worker process it
        knows of has exited."""

    def rejoining(self, worker: int, version: int | None = None) -> None:
        """``worker`` is coming back (:meth:`SenderEngine.admit`): from here on, a failure is the new process's
        (named with ``version``, what it is sent, where the engine knows it already).

        Then :meth:`rejoined`, where the engine takes a worker back on its own (a Ray actor restarted behind its
        handle), not in :meth:`SenderEngine.admit` (the core calls it with what ``admit`` returns)."""

    def rejoined(self, worker: int, version: int | None) -> None:
        """``worker`` is back, and was sent ``version``: it counts as live again, and as a rejoin in the stats."""

    def send_to(self, weights: Any, workers: list[int], *, wait: bool | None) -> None:
        """Publish ``weights`` to ``workers`` through the whole pipeline (the older transport API); ``wait``:
        for their acks (``None``: as the scheme's ``sync`` says)."""

    def wait_for(self, workers: list[int], timeout: float | None) -> None:
        """Wait until each of ``workers`` acked the last version sent to it (the older transport API)."""


@dataclass
class Outgoing:
    """One version on its way out: what a sender's engine stages once and submits to each worker.

    Attributes:
        version: the version it is.
        flat: the trainer's tensors, checked against the layout (copied out under ``no_grad``).
        whole: their one buffer, every tensor in its place (``flatten_sender``), else ``None``.
        workers: the live targeted workers.
        initial: version 0, sent during ``connect()``.
        delta: the changes from the version :attr:`delta_workers` hold (engines that :attr:`SenderEngine.takes_deltas`).
        delta_workers: the workers sent :attr:`delta` instead of the whole version.
        published: with :attr:`delta`, the version's bytes as they travel (the layout's), which the core keeps
            unchanged until its next send: an engine that sent only changes sends a worker that rejoins these
            (until :meth:`SenderEngine.unpublished`).
    """

    version: int
    flat: dict[str, torch.Tensor]
    whole: torch.Tensor | None
    workers: list[int]
    initial: bool = False
    delta: Delta | None = None
    delta_workers: list[int] = field(default_factory=list)
    published: torch.Tensor | None = None

    @property
    def whole_to(self) -> list[int]:
        """The workers sent the whole version (not :attr:`delta`)."""
        changed = set(self.delta_workers) if self.delta is not None else set()
        return [w for w in self.workers if w not in changed]

    def write(self, buffer: torch.Tensor, views: dict[str, torch.Tensor], *, non_blocking: bool = False) -> None:
        """Copy this version's bytes into ``buffer``, laid out as the layout says (``views``: its typed views by
        key): one copy of ``whole`` where the weights already lie in one buffer in their places, else tensor by
        tensor. ``non_blocking``: as :func:`~weightsync.tensors.copies.copy_tensors` says."""
        if self.whole is not None:
            copy_tensors([buffer], [self.whole], non_blocking=non_blocking)
        else:
            write_into(views, self.flat, non_blocking=non_blocking)


@dataclass(eq=False, repr=False)  # its fields and constructor, declared once; engines compare by identity
class SenderEngine(ABC):
    """The trainer's side of an engine: one object per scheme, holding one transport per worker.

    The core (:class:`~weightsync.core.sender.Sender`) calls it in this order:

    1) the constructor, at ``init_on_sender`` (by the scheme's ``_sender_engine``, with the transport's
       settings whole); :meth:`handoff` and :meth:`connection` may be asked from then on (a scheme is pickled,
       or a receiver config is written, before ``connect``);
    2) :meth:`rendezvous`, once, at ``connect``; after a rendez-vous that raised, :meth:`rendezvous_complete`
       says whether the workers that joined are served;
    3) for each version, the initial one included: :meth:`poll` (what came back since), :meth:`stage` once,
       :meth:`submit` once, then :meth:`poll` and :meth:`wait` in turn until every targeted worker acked or the
       deadline passed (not at all for a send that does not wait); then :meth:`settle`; :meth:`payload_bytes` for
       the metrics; :meth:`unpublished` instead, if staging or submitting it raised;
    4) :meth:`lost`, whenever the core gives up on a worker (dead, or dropped), at any step from 2) on;
    5) where :attr:`rejoins`: :meth:`poll_rejoin` in a thread of the core's own, and :meth:`admit` (under the
       core's lock, between sends) for each worker it returns, or :meth:`discard` once the core shuts down (an
       engine whose workers come back only when the user says so is asked by its scheme instead, under the
       same lock: Ray's ``resubmit``);
    6) :meth:`close`, once (also from a finalizer, with no time to wait).

    Every method that may wait takes a deadline and returns (or raises :class:`~weightsync.errors.SyncTimeoutError`)
    by then. Acks, refusals and deaths are reported to the :class:`Sink` as they are found, from any method.

    Attributes:
        sink: the core.
        layout: where each tensor sits in a version's bytes.
        num_workers: how many workers.
        checksum: hash each version's bytes for the workers to check (:meth:`digest`; the scheme's ``checksum``).
        gpu: the GPU every weight of the trainer is on, if one: host buffers the weights are copied into from
            there are page-locked.
    """

    #: Whether a worker that died or was dropped can come back under its index on its own (the engine then
    #: implements :meth:`poll_rejoin` and :meth:`admit`).
    rejoins: ClassVar[bool] = False
    #: Each update is a call into the worker's process, whose return is its ack (Ray's): the worker's other calls
    #: made after it run after it, and their return says nothing of it.
    pushes: ClassVar[bool] = False
    #: It sends :attr:`Outgoing.delta` to :attr:`Outgoing.delta_workers` (the scheme's ``delta`` option).
    takes_deltas: ClassVar[bool] = False
    #: A worker late on a version (:meth:`~weightsync.core.ledger.Ledger.late`) is passed by until it acks it: each
    #: version on its way to a worker holds buffers or slots, kept while the worker may still read them. ``False``:
    #: the engine holds a worker's later versions back itself (Ray's actors under ``latest_wins``): a late worker is
    #: sent one more and waited for, and passed by once that wait timed out too. An engine that tells its workers
    #: apart says so in :meth:`passes_by`.
    passes_late_by: ClassVar[bool] = True

    sink: Sink
    layout: FlatLayout
    num_workers: int
    _: KW_ONLY
    checksum: bool = False
    gpu: torch.device | None = None
    #: One transport per worker (the older API's ``sender_transports``).
    transports: dict[int, Any] = field(default_factory=dict, init=False)
    #: A driver that calls :meth:`wait_sent` sets this before the first send: the workers of an engine whose
    #: :meth:`submit` returns with bytes on their way then say when they took each version (a store write each,
    #: which a send that nobody waits on in that way does not pay).
    reports_taken: bool = field(default=False, init=False)

    @property
    def pin(self) -> bool:
        """Whether host buffers the trainer's weights are copied into are page-locked (the weights are on a GPU)."""
        return self.gpu is not None

    @property
    def shared(self) -> Any:
        """The buffer every worker reads (the scheme's ``shared_transport``): ``None`` where the engine has none."""
        return None

    def digest(self, buffers: list[torch.Tensor]) -> str | None:
        """The checksum of a version's bytes, ``buffers`` in order (host memory), for the workers to check;
        ``None`` without ``checksum``."""
        return integrity.digest(buffers) if self.checksum else None

    def handoff(self) -> dict[str, Any]:
        """What a scheme pickled for a worker carries so the worker can reach this sender (may hold a secret)."""
        return {}

    def connection(self) -> dict[str, Any]:
        """What a receiver config carries so a worker can reach this sender: plain data, no secret."""
        return {}

    @abstractmethod
    def rendezvous(self, deadline: float, timeout: float) -> dict[int, WeightSyncError]:
        """Wait until every worker joined (``timeout``: the seconds from the start to ``deadline``, for messages);
        return those that refused at joining (their model does not fit).

        Raises:
            SyncTimeoutError: workers missing at ``deadline`` (named).
        """

    def rendezvous_complete(self) -> bool:
        """Whether every worker has joined, even if some refused the initial weights."""
        return bool(self.transports)

    @abstractmethod
    def stage(self, out: Outgoing, deadline: float) -> Any:
        """Put ``out``'s bytes where its workers will read them, and return what :meth:`submit` needs (an engine
        that :attr:`takes_deltas` stages nothing whole when every worker of ``out`` is sent its changes). May
        wait, until ``deadline``, for a buffer no worker still reads.

        Raises:
            SyncTimeoutError: no free buffer in time; nothing was published.
        """

    @abstractmethod
    def submit(self, out: Outgoing, staged: Any) -> None:
        """Tell each of ``out.workers`` that ``out.version`` is there (a worker found gone is reported dead)."""

    @abstractmethod
    def poll(self, workers: list[int]) -> None:
        """Report what came back from ``workers`` already, without waiting."""

    @abstractmethod
    def wait(self, workers: list[int], deadline: float) -> None:
        """Block until something may have come back from one of ``workers``, or until ``deadline``."""

    def lost(self, worker: int, reason: str) -> None:
        """``worker`` is gone: release what it held."""
        return None

    def passes_by(self, worker: int) -> bool:
        """Whether a send passes ``worker`` by while it is late (:attr:`passes_late_by`, unless the engine tells its
        workers apart: the vLLM gate)."""
        return self.passes_late_by

    def set_aside(self, worker: int) -> bool:
        """``worker`` is late (a send passes it by, or it held up a version's staging past the send's wait): what
        the versions on their way to it hold leaves the pool the engine stages in, kept alive until it is done with
        them, so that the next versions, which pass it by, have room (called at every send that passes it by:
        nothing more to do once done). Returns whether the engine did (``False``: it cannot give up memory a live
        worker may still read, and the send fails naming the worker)."""
        return False

    def unpublished(self) -> None:
        """Staging or submitting a version raised: the core's copy handed with the last send of changes alone
        (:attr:`Outgoing.published`) may hold that version's bytes now, which were not sent, or not to everyone;
        a worker that rejoins must not be sent them as the version they were handed with."""
        return None

    def settle(self, workers: list[int], deadline: float) -> dict[int, WeightSyncError]:
        """At the end of each send, whether it waited for acks or not, and whatever they said: wait, until
        ``deadline``, for the work this send began for ``workers`` that must end within it (a driver's calls into
        an object that its caller uses next); return the workers whose work still runs, each with its error."""
        return {}

    def wait_sent(self, worker: int, deadline: float) -> None:
        """Wait (until ``deadline``) until the newest version's bytes reached ``worker``: an engine whose
        :meth:`submit` returns with some on their way (sent in the background) waits until the worker took and
        checked them; the others return at once. (A driver waits here before it has the worker's program stop
        to load the version; a worker that does not say so in time is waited for no longer.)"""
        return None

    def poll_rejoin(self) -> Any:
        """A worker asking to come back, or ``None`` after a short wait (about 0.1 s); ``EOFError`` at the end.

        Runs in the core's rejoin thread, without the core's lock."""
        raise EOFError

    def admit(self, candidate: Any) -> tuple[int, int] | None:
        """Under the core's lock: take ``candidate`` back and send it the newest version published.

        Returns ``(worker, version sent)``, or ``None`` when it was turned away (reported as needed)."""
        return None

    def discard(self, candidate: Any) -> None:
        """Turn ``candidate`` away (the core is shutting down)."""
        return None

    def payload_bytes(self) -> int:
        """Bytes of one copy of a version as it travels."""
        return self.layout.nbytes

    @abstractmethod
    def close(self, timeout: float) -> None:
        """Tell the workers, and release every socket, buffer, thread and handle. ``timeout``: the most it may
        wait for a peer (0: no wait at all, as from a finalizer)."""


@dataclass
class Delivery:
    """One update as it reached a worker: the bytes, where they sit, and what the model may do with them.

    Attributes:
        version: the version it holds.
        pieces: ``(byte offset in the layout, uint8 buffer)`` covering every tensor (one buffer, mostly).
        digest: the sender's checksum of the pieces (``None``: not checked).
        views: typed views of the pieces by key, when the engine keeps them (made by the core otherwise).
        storage: memory the model may take as its own (swap, or bind) instead of copying (``"take"`` and
            ``"share"`` placements); ``None``: it copies.
        storage_views: the typed views of ``storage`` the model's tensors would become (``None``: made
            when binding).
        whole: ``storage`` is exactly the layout's bytes: the model's own storage can swap memory with it.
        refusal: what the engine found wrong on arrival (a truncated segment): applying it fails with this.
        fence: the bytes are in GPU memory another process writes: the event its stream records after writing
            (:class:`~weightsync.tensors.cuda.SlotEvent`), which the model's stream waits on before reading them.
        token: the engine's own, for its ack.
        delta: the changes from the version the worker holds, its body arrived (``pieces`` then empty): the core
            makes the whole version of them before anything else.
        changed: of a version the core made from changes, the layout's byte ranges where it may differ from the
            version the worker held (``None``: anywhere).
    """

    version: int
    pieces: list[tuple[int, torch.Tensor]]
    digest: str | None = None
    views: dict[str, torch.Tensor] | None = None
    storage: torch.UntypedStorage | None = None
    storage_views: dict[str, torch.Tensor] | None = None
    whole: bool = True
    refusal: BaseException | None = None
    fence: Any = None
    token: Any = None
    delta: Delta | None = None
    changed: list[tuple[int, int]] | None = None


class ReceiverEngine(ABC):
    """A worker's side of an engine: joins the sender, delivers updates, acks them.

    The core (:class:`~weightsync.core.receiver.Receiver`) calls it in this order:

    1) the constructor, at ``init_on_receiver`` (by the scheme's ``_receiver_engine``), then :meth:`attach`
       with the core's apply path;
    2) :meth:`join`, once, at ``connect``: the engine then knows its :attr:`layout`, and the initial version
       follows as any other;
    3) for each update, unless the engine :attr:`pushes` them (it then calls the apply path itself, which
       does 4 and 5): :meth:`take`, from ``receive()``, ``take()`` or the core's background thread, then
       :meth:`ready` once what it delivered is ready to apply (changes made into the whole version);
    4) once the core placed the last delivery taken: :meth:`taken`, if the model took its storage;
    5) :meth:`ack`, once per :meth:`take` that delivered anything, applied or refused;
    6) :meth:`close`, once.

    ``placement`` says what the model does with an update: ``"write"`` it into its own tensors one by one,
    ``"load"`` it with one copy per piece into a buffer the model is bound to, ``"take"`` the memory it
    arrived in, or ``"share"`` it (read-only, with the other workers).
    """

    placement: str = "write"
    #: Updates arrive as calls into this process (Ray) instead of being taken in ``receive()``.
    pushes: ClassVar[bool] = False
    #: The layout of the updates, once the engine knows it (at join, or with the first update).
    layout: FlatLayout | None = None

    def attach(self, apply: Callable[[list[Delivery]], int]) -> None:
        """An engine whose updates arrive as calls (``pushes``) applies them with ``apply`` (the core's)."""
        return None

    @abstractmethod
    def join(
        self, deadline: float, check: Callable[[FlatLayout], WeightMismatchError | None], update_timeout: float
    ) -> None:
        """Join the sender by ``deadline``; call ``check`` with the layout once it is known (its result: why this
        worker's model does not fit, or ``None``).

        ``update_timeout``: the longest one update may take to arrive and be acked (the scheme's ``timeout``, by which
        the core also bounds its own waits for an update): what bounds, from here on, the engine's waits that no
        call's own timeout does (an update's bytes once announced, a store's silence, a group's operations).
        """

    def take(self, timeout: float, newest: bool) -> list[Delivery]:
        """The updates waiting (all, oldest first, when ``newest``; else the oldest alone), waiting up to
        ``timeout`` for the first; ``[]`` if none came. The core applies the last one and acks them all.

        Raises:
            ConnectionClosedError: the sender shut down or died, and nothing is left to apply.
        """
        return []

    def ready(self, taken: list[Delivery]) -> None:
        """What :meth:`take` delivered is ready to apply: an engine whose sender waits to hear that (a driver that
        pauses the worker's program for the load alone) says so now."""
        return None

    def ack(self, taken: list[Delivery], held: int | None, error: BaseException | None = None) -> None:
        """Tell the sender the updates ``taken`` were applied (``held`` is the version now held), or failed."""
        return None

    def taken(self, delivery: Delivery, left: torch.UntypedStorage | None, swapped: bool) -> None:
        """The model took ``delivery.storage``: by a swap (``delivery.storage`` now holds the memory the model
        had), or by binding (``left``: the storage the model was bound to before, if another)."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release every socket, buffer and handle (the model keeps its weights)."""
