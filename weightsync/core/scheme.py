"""The scheme lifecycle shared by every backend: :class:`WeightSyncScheme`.

A scheme object plays one role. In the trainer it is a *sender*: ``init_on_sender`` → ``connect`` →
``send``/``send_async``/``wait_async`` → ``shutdown`` (at the process's exit if not before). In a worker it is a
*receiver*: ``init_on_receiver`` → ``connect(worker_idx=...)`` → ``receive`` → ``shutdown``. A sender pickled after
``init_on_sender`` arrives in the worker as a fresh, receiver-ready scheme that knows how to reach the sender.

This module owns the state machine, argument checking and model resolution;
the sender's pipeline is :class:`~weightsync.core.sender.Sender`, the
receiver's apply path :class:`~weightsync.core.receiver.Receiver`, and each
scheme class supplies its engine (``_sender_engine``, ``_receiver_engine``).
What a scheme holds while it lives is one :class:`~weightsync.core.runtime.Runtime`;
its bases read it: what it tells (:mod:`~weightsync.core.properties`), how it
reaches its workers (:mod:`~weightsync.core.handoff`, over the transport of
:mod:`~weightsync.core.choice`) and the older API (:mod:`~weightsync.core.facade`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from dataclasses import KW_ONLY
from typing import Any, ClassVar

from .. import checks, options, registry
from ..errors import ConfigurationError, LifecycleError, WeightSyncError
from ..model_path import resolve_model
from ..options import option
from ..tensors.layout import FlatLayout, wire_dtype_from_name
from ..tensors.strategy import WeightStrategy, check_sendable
from .drivers import driver_for, driver_of
from .engine import ReceiverEngine, SenderEngine, Sink
from .facade import SchemeFacades
from .handoff import SchemeHandoff
from .interrupts import held_interrupts
from .leaving import shut_down_at_exit
from .pending import PendingUpdate
from .receiver import Receiver
from .sender import Sender
from .states import CLOSED, NEW, RECEIVER, RECEIVER_CONNECTED, SENDER, SENDER_CONNECTED
from .workers import check_num_workers, targets

__all__ = ["WeightSyncScheme", "config_name_for"]


class WeightSyncScheme(SchemeHandoff, SchemeFacades, kw_only=False):
    """Base class of every scheme: the lifecycle of one model across workers.

    Every scheme takes its options as keyword arguments (the first four also by position); each is declared
    once, in its class body (:func:`~weightsync.options.option`), and listed with its meaning in the API
    reference and the Hydra configs. A scheme that runs over several transports also takes ``transport``:
    the transport's name, its settings (as Hydra builds them from the scheme's ``transport`` config), or the
    settings' class; the transport's settings may be given as keyword arguments of the scheme too. A value an
    option refuses raises :class:`~weightsync.errors.ConfigurationError` naming the option.

    A subclass registers itself under a name as it is defined (``class MyScheme(WeightSyncScheme,
    name="mine")``): :func:`weightsync.get_backend`, the Hydra groups, the lazy names of ``weightsync`` and the
    API reference then know it (see "Adding an engine" in docs/design.md).
    """

    strategy: str | WeightStrategy = option(options.STRATEGY)
    sync: bool = option(options.SYNC)
    timeout: float = option(options.TIMEOUT)
    connect_timeout: float = option(options.CONNECT_TIMEOUT)
    _: KW_ONLY
    on_failure: str = option(options.ON_FAILURE)
    max_staleness: int | None = option(options.MAX_STALENESS)
    check_finite: bool = option(options.CHECK_FINITE)

    EXTRA = (
        inspect.Parameter(
            "transport", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="str | TransportSettings | None"
        ),
    )
    #: Name under which the scheme is registered (``name=`` of its class statement; see
    #: :func:`weightsync.get_backend`).
    backend_name: ClassVar[str] = ""
    #: The name of its Hydra config class in :mod:`weightsync.config` (``None``: it has none of its own).
    config_name: ClassVar[str | None] = "SchemeConfig"
    #: Receivers must say which worker they are before connecting.
    needs_worker_idx: ClassVar[bool] = True
    #: The scheme-specific keyword arguments ``init_on_sender`` and ``init_on_receiver`` take (handles).
    SENDER_HANDLES: ClassVar[tuple[str, ...]] = ()
    RECEIVER_HANDLES: ClassVar[tuple[str, ...]] = ()
    #: Off in a scheme that does not take the option (read by the shared code).
    flatten_sender = False

    def __init_subclass__(
        cls, *, name: str = "", aliases: tuple[str, ...] = (), config: str | None = None, **kwargs: Any
    ) -> None:
        super().__init_subclass__(**kwargs)
        for setting in cls.setting_names():  # held by the transport's settings, read through the scheme
            setattr(cls, setting, property(functools.partial(_setting, name=setting), doc=cls.option(setting).doc))
        cls.config_name = config or (config_name_for(cls) if name else None)
        if name:
            cls.backend_name = name
            registry.add_scheme(cls, name, aliases, cls.config_name)

    def _configure(self, given: dict[str, Any], extras: dict[str, Any]) -> None:
        settings = self.setting_names()
        self._take({k: v for k, v in given.items() if k not in settings}, exclude=settings)
        self._strategy: WeightStrategy  # the strategy option, as `_take` holds it
        self._choose_transport(extras["transport"], {k: given[k] for k in settings if k in given})
        self._check_options()
        self._reset_runtime()

    def _check_options(self) -> None:
        """Checks across options, once every option holds its value (a subclass adds its own)."""
        if self.flatten_sender and self.wire_dtype is not None:
            raise ConfigurationError(
                f"flatten_sender publishes the trainer's weights in their own dtype; it cannot be combined with "
                f"wire_dtype={self.wire_dtype!r}"
            )

    def _reset_runtime(self) -> None:
        """Start from a new runtime, as every (re)configuration does (a subclass adds its own state)."""
        self._start_runtime(self._strategy)

    # -------------------------------------------------------------- lifecycle
    def init_on_sender(self, model_id: str = "policy", context: Any = None, **kwargs: Any) -> None:
        """Register the trainer side: the model (or weights) and the workers. Sends nothing.

        Args:
            model_id: the model's name, also a path inside ``context``
                (``"policy"``, ``"env.transform[0].module"``).
            context: an object that holds the model (``get_model(model_id)`` or by
                path) and may provide ``num_workers``; or a program that drives the scheme
                itself (one an integration knows: :mod:`weightsync.integrations`).
            **kwargs: ``model=`` or ``weights=``, ``num_workers=``, and scheme-specific handles;
                what a driving program passes and the scheme does not need is taken.

        Raises:
            LifecycleError: the scheme was already initialized.
            ConfigurationError: a required argument is missing or invalid, or both ``model=`` and ``weights=``.
        """
        rt = self._runtime
        with rt.lock:
            rt.require(NEW, action="init_on_sender")
            if rt.handoff is not None:
                raise LifecycleError(
                    "this scheme was unpickled from a sender: it can only be initialized as a receiver",
                    model_id=model_id,
                )
            rt.model_id = checks.model_id(model_id, "model_id")
            rt.driver = driver = driver_of(context)
            rt.hold_context(context, weakly=driver.holds_its_schemes)
            rt.drive = driver.terms(context)
            driver.extras(context, {extra: kwargs.pop(extra, None) for extra in driver.sender_extras})
            model, weights = kwargs.pop("model", None), kwargs.pop("weights", None)
            if model is not None and weights is not None:  # (one would be sent, the other silently not)
                raise ConfigurationError("init_on_sender takes model= or weights=, not both", model_id=model_id)
            if model is None and weights is None and context is not None:
                model = driver.model(context, model_id)
            rt.model = model if model is not None else weights
            num_workers = kwargs.pop("num_workers", None)
            if num_workers is None and context is not None:
                num_workers = driver.num_workers(context)
            rt.num_workers = check_num_workers(num_workers, rt.model_id)
            self._open_sender(kwargs)
            rt.state = SENDER
            driver.follow(self, context)

    def _open_sender(self, kwargs: dict[str, Any]) -> None:
        """Build the sender core and its engine (which takes the scheme-specific ``kwargs``)."""
        rt = self._runtime
        checks.no_extra(kwargs, self.SENDER_HANDLES, "init_on_sender")
        num_workers, layout = self._count_workers(kwargs), self._sender_layout()
        flat = functools.partial(self._flat_weights, detach=False)
        sending = Sender(
            self, model_id=rt.model_id, num_workers=num_workers, layout=layout, flat_weights=flat, lock=rt.lock
        )
        if self.flatten_sender:
            sending.adopt(rt.model)
        sink, engine = rt.driver.sink(self, sending), None
        try:
            own = rt.driver.sender_engine(self, sink, layout)
            engine = own or self._sender_engine(sink, layout, num_workers, kwargs)
            sending.engine = rt.driver.around(self, engine)
        except BaseException:
            if engine is not None:  # (its sockets, threads or buffers: nothing will drive it)
                engine.close(0)
            rt.driver.abandon(self, sink)
            raise
        rt.num_workers, rt.sending = num_workers, sending
        sending.last_words = lambda workers: rt.driver.last_words(rt.context, workers)
        shut_down_at_exit(self)

    def _count_workers(self, kwargs: dict[str, Any]) -> int:
        """How many workers this sender serves (``num_workers``, unless the engine's handles say so)."""
        rt = self._runtime
        if rt.num_workers is None:
            raise ConfigurationError(f"{type(self).__name__}.init_on_sender needs num_workers=", model_id=rt.model_id)
        return rt.num_workers

    def _sender_layout(self) -> FlatLayout:
        """The flat layout of the registered model's weights (sender side, at init)."""
        rt = self._runtime
        if rt.model is None:
            raise ConfigurationError(
                "init_on_sender needs model= or weights= (or a context holding the model)", model_id=rt.model_id
            )
        flat = rt.strategy.flat(rt.model)
        if not flat:
            raise ConfigurationError("the model has no weights to synchronize", model_id=rt.model_id)
        rt.skeleton = check_sendable(flat, meta_ok=True, model_id=rt.model_id)  # (weights given at each send)
        return FlatLayout.from_weights(flat, wire_dtype_from_name(self.wire_dtype))

    def init_on_receiver(self, model_id: str | None = None, context: Any = None, **kwargs: Any) -> None:
        """Register the worker side: its model and index. Receives nothing yet.

        Args:
            model_id: the model's name or path inside ``context`` (default: the one
                the scheme was handed with, else ``"policy"``).
            context: an object holding the worker's model.
            **kwargs: ``model=``, ``worker_idx=`` and scheme-specific handles.

        Raises:
            LifecycleError: the scheme was already initialized (for example as a sender).
            ConfigurationError: no model, or ``worker_idx`` is not the one a receiver config made this for.
        """
        rt = self._runtime
        with rt.lock:
            rt.require(NEW, action="init_on_receiver")
            model_id = model_id or rt.model_id or "policy"
            rt.model_id = model_id
            rt.context = context
            model = kwargs.pop("model", None)
            if model is None and context is not None:
                model = resolve_model(context, model_id)
            rt.model = model
            worker_idx = kwargs.pop("worker_idx", None)
            if worker_idx is not None:
                rt.worker_idx = self._receiver_idx(worker_idx)
            rt.driver = driver = driver_for(rt.drive, context)
            driver.check_receiver(self, context, knows_sender=rt.handoff is not None)
            self._open_receiver(kwargs)
            rt.state = RECEIVER
            driver.follow(self, context)

    def _open_receiver(self, kwargs: dict[str, Any]) -> None:
        rt = self._runtime
        if rt.model is None:
            raise ConfigurationError(
                "init_on_receiver needs model= (or a context holding the model)", model_id=rt.model_id
            )
        checks.no_extra(kwargs, self.RECEIVER_HANDLES, "init_on_receiver")
        where = {"model_id": rt.model_id, "worker_idx": rt.worker_idx}  # the index may come at connect
        engine = self._receiver_engine(dict(rt.handoff or {}), kwargs, where)
        rt.receiving = Receiver(self, engine, where)

    def connect(
        self, *, worker_idx: int | None = None, weights: Any = None, processes: Iterable[Any] | None = None
    ) -> None:
        """Rendez-vous. Sender: wait for every worker and give each the initial weights (``weights`` overrides the
        registered model's). Receiver: join the sender, receive and apply the initial weights. Blocks for at most
        ``connect_timeout`` (a receiver's counted after it imported what its strategy needs: tensordict takes
        seconds), saying at INFO (``logging``) which workers it still waits for when that lasts.

        A sender watches the worker processes it knows of while it waits: those ``multiprocessing`` started with
        this scheme among their arguments, and ``processes`` (``multiprocessing`` processes or ``subprocess.Popen``
        objects, such as workers started from receiver configs). One that exits before it connected is named at once.

        Raises:
            LifecycleError: called before init, or twice.
            SyncTimeoutError: a peer did not show up in time (named in the message).
            WorkerDiedError: a worker process the sender knows of exited before it connected.
        """
        rt = self._runtime
        with rt.lock:
            if rt.state == SENDER:
                if worker_idx is not None:
                    raise LifecycleError("connect(worker_idx=...) is the receiver's call; this scheme is a sender")
                if rt.sending is not None:  # no_sync has no workers to wait for
                    rt.sending.processes.hand(processes or ())
                try:
                    self._connect_sender(weights)
                except WeightSyncError:
                    # Workers that failed the initial sync are named in the error; once every
                    # worker has joined, the others are served and the sender is connected.
                    if self._rendezvous_complete():
                        rt.state = SENDER_CONNECTED
                    raise
                rt.state = SENDER_CONNECTED
            elif rt.state == RECEIVER:
                if processes is not None:
                    raise LifecycleError("connect(processes=...) is the sender's call; this scheme is a receiver")
                if worker_idx is not None:
                    rt.worker_idx = self._receiver_idx(worker_idx)
                if rt.worker_idx is None and self.needs_worker_idx:
                    raise ConfigurationError("a receiver needs worker_idx (in init_on_receiver or connect)")
                self._connect_receiver()
                rt.state = RECEIVER_CONNECTED
            else:
                rt.require(SENDER, RECEIVER, action="connect")

    def _connect_sender(self, weights: Any) -> None:
        rt = self._runtime
        assert rt.sending is not None
        rt.sending.connect(weights, self.connect_timeout)

    def _rendezvous_complete(self) -> bool:
        rt = self._runtime
        engine = rt.sending.engine if rt.sending is not None else None
        return engine is not None and engine.rendezvous_complete()

    def _connect_receiver(self) -> None:
        rt = self._runtime
        assert rt.receiving is not None
        rt.receiving.where["worker_idx"] = rt.worker_idx
        applies_itself = rt.applies_itself
        rt.receiving.bound.move_shared = applies_itself  # the program shared the trainer's model, not the user
        try:
            rt.receiving.connect(self.connect_timeout, getattr(self, "background_thread", False) or applies_itself)
        except BaseException:
            rt.receiving.engine.close()
            raise
        if applies_itself:  # the program runs the model beside the receiver's thread: they take turns
            rt.hold.hold(rt.model)
            rt.receiving.on_applied = lambda: rt.driver.applied(self)

    def send(self, weights: Any = None, worker_ids: int | Iterable[int] | None = None) -> None:
        """Publish a new version to ``worker_ids`` (all by default).

        ``weights`` may be ``None`` (read the registered model now), an
        ``nn.Module``, a ``TensorDict`` or a dict. With ``sync=True`` this blocks
        until every targeted worker applied and acked (at most ``timeout`` s);
        with ``sync=False`` it returns once the update is published.

        Raises:
            LifecycleError: the scheme is not a connected sender.
            InvalidWeightsError: weights that cannot be sent (nothing was sent).
            WeightSyncError: a worker failed, died or timed out; the message names it.
                The other targeted workers hold the new version.
        """
        rt = self._runtime
        with rt.lock:
            rt.require(SENDER_CONNECTED, action="send")
            self._send(weights, self._targets(worker_ids), self.sync)

    def send_async(self, weights: Any = None, worker_ids: int | Iterable[int] | None = None) -> None:
        """Publish a new version without waiting; pair with :meth:`wait_async`.

        With ``max_staleness=k``, first waits (at most ``timeout``) until every targeted
        worker acked at least the version ``k`` behind the one about to be published, or
        the last version sent to it, where that is older (no ack of a later one is coming:
        one that sends with ``worker_ids`` skipped, or that it refused).
        """
        rt = self._runtime
        with rt.lock:
            rt.require(SENDER_CONNECTED, action="send_async")
            self._send(weights, self._targets(worker_ids), False)

    def _targets(self, worker_ids: int | Iterable[int] | None) -> list[int]:
        """The workers a call names (``None``: all), checked."""
        rt = self._runtime
        return targets(worker_ids, rt.num_workers or 0, rt.model_id)

    def _send(self, weights: Any, targets: list[int], wait: bool) -> None:
        rt = self._runtime
        assert rt.sending is not None
        rt.sending.publish(weights, targets, wait)

    def wait_async(self, timeout: float | None = None) -> None:
        """Wait until every worker acked the last version sent to it (at most ``timeout``, default the scheme's).

        Raises:
            SyncTimeoutError: naming the workers that did not ack in time (with ``on_failure="drop"``,
                they are dropped instead).
        """
        rt, bound = self._runtime, checks.within(timeout, self.timeout, "wait_async(timeout)")
        with rt.lock:
            rt.require(SENDER_CONNECTED, action="wait_async")
            if rt.sending is not None:
                rt.sending.wait(bound)

    def receive(self, timeout: float | None = 0.0) -> Any:
        """Apply a pending update, if any; return the weights applied, or ``None``.

        Args:
            timeout: seconds to wait for an update: ``0`` (default) only checks,
                ``None`` waits up to the scheme's ``timeout``.

        Raises:
            LifecycleError: the scheme is not a connected receiver, or a version taken (:meth:`take`) is not
                applied yet.
            WeightMismatchError: the update did not fit this worker's model; the
                model kept its weights and the sender was told.
            ConnectionClosedError: the sender shut down or died.
            (``background_thread``) what the thread's apply raised, once; what ended the thread, at every call.
        """
        self._runtime.require(RECEIVER_CONNECTED, action="receive")
        return self._receive(checks.within(timeout, self.timeout, "receive(timeout)"))

    def _receive(self, timeout: float) -> Any:
        rt = self._runtime
        assert rt.receiving is not None
        return rt.receiving.receive(timeout)

    def take(self, timeout: float | None = 0.0) -> PendingUpdate | None:
        """Take the next update off the transport now (its bytes, under ``delta`` the version its changes make),
        while the worker goes on with its own work; ``pending.apply()`` then checks and applies it as
        :meth:`receive` would (a program that must pause to load, such as an inference engine, pauses for the
        load only; an ``ExternalModel``'s ``prepare`` runs here). The worker takes no other version until then
        (or ``pending.discard()``): ``take()`` and ``receive()`` refuse meanwhile.

        Args:
            timeout: seconds to wait for an update: ``0`` (default) only checks, ``None`` waits up to the
                scheme's ``timeout``.

        Returns:
            The update (:class:`~weightsync.core.pending.PendingUpdate`), or ``None`` if none came in time.

        Raises:
            LifecycleError: the scheme is not a connected receiver; or its updates are applied as they arrive
                (a background thread applies them, or the engine's updates are calls into this process, as
                Ray's are: :attr:`applied_on_arrival`); or a version taken earlier is not applied yet.
            ConnectionClosedError: the sender shut down or died.
        """
        rt = self._runtime
        rt.require(RECEIVER_CONNECTED, action="take")
        assert rt.receiving is not None
        if self.applied_on_arrival or rt.receiving.has_thread:
            how = "by its background thread"
            if self.applied_on_arrival:
                how = "its engine's updates are calls into this process"
            raise LifecycleError(
                f"take(): this worker's updates are applied as they arrive ({how}): use receive()",
                model_id=self.model_id,
                worker_idx=rt.worker_idx,
            )
        taken = rt.receiving.take(checks.within(timeout, self.timeout, "take(timeout)"))
        return PendingUpdate(rt.receiving, taken) if taken else None

    def shutdown(self) -> None:
        """Release every process, thread, socket and shared-memory slot this side holds. Idempotent. A Ctrl-C
        meanwhile is raised once all is released (each of its two waits is bounded by ``timeout``)."""
        with self._runtime.lock:
            self._shutdown(self.timeout)

    def _shutdown(self, timeout: float) -> None:
        rt = self._runtime
        try:
            if not rt.holds_nothing:
                with held_interrupts():  # (cut short, it held everything, and its next call did nothing)
                    self._close(timeout)
        finally:
            rt.state = CLOSED

    def _close(self, timeout: float) -> None:
        rt = self._runtime
        rt.hold.release()
        if rt.sending is not None:
            rt.sending.close(timeout)
        if rt.receiving is not None:
            rt.receiving.close(timeout)

    def __enter__(self) -> WeightSyncScheme:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        # A finalizer only releases: it waits for no thread and no peer (and takes no lock a thread may hold).
        try:
            if self._runtime.state not in (NEW, CLOSED):
                self._shutdown(0.0)
        except Exception:  # noqa: BLE001 - nothing may escape a finalizer
            pass

    # ---------------------------------------------------------------- engines
    def _sender_engine(self, sink: Sink, layout: FlatLayout, num_workers: int, kwargs: dict[str, Any]) -> SenderEngine:
        """This scheme's engine on the sender, taking the scheme-specific ``kwargs`` of ``init_on_sender``."""
        raise NotImplementedError

    def _receiver_engine(
        self, handoff: dict[str, Any], kwargs: dict[str, Any], where: dict[str, Any]
    ) -> ReceiverEngine:
        """This scheme's engine on a receiver: from the ``handoff`` (pickled scheme or receiver config) and the
        scheme-specific ``kwargs`` of ``init_on_receiver``; ``where`` names the model and the worker (for errors;
        the worker index may be set at connect)."""
        raise NotImplementedError

    # --------------------------------------------------------------- registry
    @classmethod
    def from_backend(cls, name: str, **kwargs: Any) -> WeightSyncScheme:
        """Build the scheme registered under ``name`` (``"multiprocess"``, ``"shared_mem"``, ...)."""
        return registry.get_backend(name)(**kwargs)


def _setting(scheme: WeightSyncScheme, name: str) -> Any:
    return getattr(scheme.settings, name)


def config_name_for(cls: type) -> str:
    """``MultiProcessWeightSyncScheme`` -> ``MultiProcessSchemeConfig``."""
    stem = cls.__name__.removesuffix("Scheme").removesuffix("WeightSync")
    return f"{stem}SchemeConfig"
