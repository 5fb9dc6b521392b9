"""A worker's side of every scheme: one apply path, one owner of the bound model, whatever the engine.

An update is checked (checksum, then the model against the layout, unless it is exactly as bound), then placed
as the engine's placement says — the model swaps memory with, or binds to, the buffer the update arrived in; is
loaded with one copy per piece into the buffer it is bound to; or is written tensor by tensor — and acked.
Weights and version change together under ``weights_lock``; a failure changes nothing and is acked with its cause
(but a :class:`~weightsync.errors.PassOnError`, raised once the update was applied).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..errors import (
    ConfigurationError,
    ConnectionClosedError,
    DeltaBaseError,
    LifecycleError,
    PassOnError,
    SyncTimeoutError,
    WeightMismatchError,
    WeightSyncError,
    context,
    restated,
)
from ..integrity import check_digest
from ..tensors import cuda
from ..tensors.bound import BoundModel, one_device
from ..tensors.copies import write_into
from ..tensors.layout import FlatLayout
from ..tensors.skeleton import filled, materialize
from ..tensors.strategy import check_fits, check_spec, flatten_weights, weights_spec
from .engine import Delivery, ReceiverEngine
from .external import ExternalModel
from .interrupts import held_interrupts
from .kept import KeptCopy
from .rejoin import stop_thread
from .timing import deadline_after, remaining

__all__ = ["Receiver"]

log = logging.getLogger("weightsync.core")


#: Seconds the background thread waits for an update before it looks again whether it must stop.
THREAD_POLL_S = 0.05


class Receiver:
    """The worker's model, the version it holds, and the updates the engine delivers to it.

    Args:
        scheme: the worker's scheme: its ``model``, ``strategy``, ``weights_lock``, ``latest_wins`` (apply
            only the newest of the updates waiting) and ``timeout`` (the longest one update may take, which the
            engine is given at join).
        engine: delivers the updates and acks them.
        where: ``model_id`` and ``worker_idx``, for errors (the index may be set at connect).
    """

    def __init__(self, scheme: Any, engine: ReceiverEngine, where: dict[str, Any]) -> None:
        self.engine, self.where = engine, where
        self.model, self.strategy, self.weights_lock = scheme.model, scheme.strategy, scheme.weights_lock
        self.latest_wins = getattr(scheme, "latest_wins", True)
        #: The longest one update may take (the scheme's timeout): its GPU waits here, the engine's (given at join).
        self.update_timeout = float(getattr(scheme, "timeout", None) or 60.0)
        self.bound = BoundModel()
        self.version: int | None = None
        self.reported: int | None = None
        self._refusal: WeightMismatchError | None = None  # the model does not fit the sender's layout
        #: How the last version handed out by ``scheme.take`` (a :class:`~.pending.PendingUpdate`) lets go of its bytes.
        self.release_pending: weakref.WeakMethod[Callable[[], None]] | None = None
        # The model's tensors the last update went to, and the views they now are, if they read them.
        self._written: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None] = ({}, None)
        self._thread: threading.Thread | None = None
        self._stop, self._applied = threading.Event(), threading.Condition()
        self._thread_error: BaseException | None = None
        #: Called after each update applied, before its ack (a driving program counts its model's versions).
        self.on_applied: Callable[[], None] | None = None
        #: Under the scheme's ``delta``: the copy of the bytes of the version held, which changes are applied to.
        delta, self._track = bool(getattr(scheme, "delta", False)), bool(getattr(scheme, "track_writes", False))
        self.kept = KeptCopy(self._track) if delta else None
        #: A version taken ahead and prepared by the program (:meth:`_prepare`), with the call that makes it current.
        self._prepared: tuple[Delivery, Callable[[], None]] | None = None
        self._outstanding: int | None = None  # the version taken and not applied yet (:meth:`take`)
        self.closed = False
        engine.attach(self.apply)

    def set_model(self, model: Any) -> None:
        """Apply later updates to ``model`` instead (the caller holds ``weights_lock``); it is checked and bound
        afresh at the next update."""
        self.model = model
        self.bound.forget()
        self._written = ({}, None)

    # ---------------------------------------------------------------- joining
    def _spec(self, sent: Any) -> Any:
        """``{name: (shape, dtype)}`` of what the model takes, from a sender that sends ``sent``."""
        if isinstance(self.model, ExternalModel):
            return self.model.spec_for(sent)
        return weights_spec(filled(self.model, self.strategy.extract_as, **self.where))

    def _check(self, layout: FlatLayout) -> WeightMismatchError | None:
        """Whether the model fits ``layout``; a misfit is remembered, and the first update fails with it."""
        try:
            check_spec(layout.spec, self._spec(layout.spec), **self.where)
        except WeightMismatchError as exc:
            self._refusal = exc
        return self._refusal

    def connect(self, timeout: float, background_thread: bool = False) -> None:
        """Join the sender, apply the initial version (a pusher's comes as a call); ``timeout`` counts after imports."""
        if not isinstance(self.model, ExternalModel):  # (what receive() returns is the strategy's format)
            self.strategy.warm()
        deadline = deadline_after(timeout)
        self.engine.join(deadline, self._check, self.update_timeout)
        if not self.engine.pushes:
            while self.version is None:
                if remaining(deadline) <= 0:
                    raise SyncTimeoutError("no initial weights from the sender in time", **self.where)
                self.poll_and_apply(remaining(deadline))
        self.reported = self.version  # connect() itself delivered version 0
        if background_thread:
            self._thread = threading.Thread(
                target=self._thread_loop, name=f"weightsync-{self.where['model_id']}-receiver", daemon=True
            )
            self._thread.start()

    # ---------------------------------------------------------------- applying
    def poll_and_apply(self, timeout: float) -> int | None:
        """Apply what the engine delivers within ``timeout``; return the version now held if it changed."""
        taken = self.take(timeout)
        if not taken:
            return None
        self.apply(taken)
        return self.version

    def take(self, timeout: float) -> list[Delivery]:
        """The updates the engine delivers within ``timeout`` (``[]``: none), taken off the transport, ready and
        not applied (the last one's changes made into its whole version: :meth:`_resolve`): :meth:`apply` them
        (the engine hands out the next ones only then).

        Raises:
            LifecycleError: a version taken earlier is not applied yet (a later one applied first would be rolled
                back by it, and a slot it reads may go to another version), or the receiver was shut down as it waited.
        """
        if self._outstanding is not None:
            raise LifecycleError(
                f"version {self._outstanding} was taken (take()) and is not applied yet: apply or discard it before "
                "taking or receiving another",
                **self.where,
            )
        try:
            taken = self.engine.take(timeout, self.latest_wins)
        except Exception as exc:
            if self.closed:  # (shut down by another thread as it waited: what the engine then raised says nothing)
                raise LifecycleError("this receiver was shut down while it waited for an update", **self.where) from exc
            if isinstance(exc, ConnectionClosedError):
                self._leave_sender_memory()
            raise
        if taken:
            try:
                taken = self._resolve(taken)
                self._prepared = self._prepare(taken[-1])
                self._outstanding = taken[-1].version
                try:
                    self.engine.ready(taken)
                except ConnectionClosedError as exc:  # (its bytes are here whole: applied, as any read before an end)
                    log.info("model %r: version %d taken, unheard: %s", self.where["model_id"], taken[-1].version, exc)
            except BaseException as exc:  # (an interrupt, an engine's own error: nothing was handed out, nothing held)
                self._cut_short(taken, exc)
                raise
        return taken

    def _prepare(self, update: Delivery) -> tuple[Delivery, Callable[[], None]] | None:
        """Under an :class:`ExternalModel` with ``prepare``: the checks ``apply`` makes, then its preparation of
        ``update`` (the call that makes it current, for ``apply``); ``None`` where it is left to ``load``."""
        model, layout = self.model, self.engine.layout
        if not isinstance(model, ExternalModel) or model.prepare is None or layout is None:
            return None
        if update.refusal is not None or self._refusal is not None:
            return None
        where = {**self.where, "version": update.version}
        try:
            check_digest([piece for _, piece in update.pieces], update.digest, **where)
            deadline = deadline_after(self.update_timeout)
            commit = model.prepare(self._program_views(model, update, layout, where, deadline))
        except Exception as exc:  # noqa: BLE001 - the apply checks again and loads it (or refuses it, and says so)
            log.info("model %r: version %d left to the load: %s", self.where["model_id"], update.version, exc)
            return None
        return None if commit is None else (update, commit)

    def _resolve(self, taken: list[Delivery]) -> list[Delivery]:
        """``taken``, its last update's changes made into the whole version they make (in the copy kept here) when
        taken rather than when applied: a worker that takes a version ahead and pauses to apply it (an inference
        engine) pauses for the load alone. Changes refused (not against the version kept here, not fitting the
        layout) come back with that refusal, which :meth:`apply` acks."""
        update = taken[-1]
        layout = self.engine.layout
        if update.delta is None or update.refusal is not None or layout is None:
            return taken
        try:
            where = {**self.where, "version": update.version}
            if self.kept is None:  # its config says delta off, its sender's on: it keeps a copy from the version
                self.kept = KeptCopy(self._track)  # sent next, whole (else every version would come twice)
                log.warning("%schanges came, and this worker kept no copy (delta off in its config): it keeps one "
                            "from now on", context(**where))  # fmt: skip
                raise DeltaBaseError("changes came, and this worker keeps no copy to apply them to", **where)
            whole = self.kept.whole_version(update, self.version, where)
        except Exception as exc:  # noqa: BLE001 - whatever it is, the apply acks it
            whole = dataclasses.replace(update, refusal=exc)
        return [*taken[:-1], whole]

    def apply(self, taken: list[Delivery]) -> int:
        """Apply the last of ``taken`` (the others are superseded), then ack them all; return its version.

        Raises:
            IntegrityError, WeightMismatchError, ConfigurationError: the update was refused (and acked so);
                the model kept its weights.
            PassOnError: the update was applied (the model holds it, and the ack says so), then the program it
                drives failed to pass it on (:attr:`on_applied`).
        """
        update = self._resolve(taken)[-1]  # (done when taken, unless the engine pushes its updates)
        where = {**self.where, "version": update.version}
        gpus: set[torch.device] = set()
        deadline = deadline_after(self.update_timeout)
        prepared, self._prepared = self._prepared, None
        commit = prepared[1] if prepared is not None and prepared[0] is update else None
        try:
            if self._refusal is not None:  # (a copy: one error raised at every update would keep every one's frames)
                raise restated(self._refusal)
            if update.refusal is not None:
                raise update.refusal
            layout = self.engine.layout
            if layout is None:
                raise ConfigurationError("received an update before the layout", **where)
            if commit is None:  # (a prepared version's bytes were checked before they were prepared)
                check_digest([piece for _, piece in update.pieces], update.digest, **where)
            if self.kept is not None:
                self.kept.keep(update, layout, lambda: self._views_of(update, layout))
            if isinstance(self.model, ExternalModel):  # the program loads it: no tensor of ours to write
                self._hand_over(self.model, update, layout, where, deadline, commit)
            else:
                dst = flatten_weights(self.model, self.strategy.extract_as)
                held = self.engine.placement != "write" and self.bound.holds(dst)  # exactly as bound: checks hold
                if not held:
                    check_fits(layout.spec, dst, **where)  # (before any is written)
                    dst = materialize(self.model, dst, update.pieces, self.strategy.extract_as, **where)
                with self.weights_lock:  # weights and version change together for readers holding the lock
                    gpus = self._gpus(dst, held)
                    in_thread = threading.current_thread() is self._thread
                    if gpus and cuda.settle_before_write(self.engine.placement, in_thread):
                        # Inference another thread queued under the lock, on a stream of its own, ends first.
                        cuda.settle(gpus, deadline, whole_device=True)
                    if update.fence is not None:  # bytes another process's GPU stream wrote: read them after it
                        cuda.wait_event(update.fence, gpus, deadline)
                    mends = self.kept if self.engine.placement != "share" else None  # (memory it shares is remapped)
                    with held_interrupts():  # (written and numbered in one step: a Ctrl-C left a model bound, unsaid)
                        if mends is not None and mends.write_changes(dst, update, layout):
                            self._written = (dst, None)
                        else:
                            self._written = (dst, self._place(dst, update, layout, held))
                            if self.kept is not None:  # (the program's writes show next time)
                                self.kept.written(lambda: flatten_weights(self.model, self.strategy.extract_as))
                        self.version = update.version  # (its memory now: held, even if the settle fails, as acked)
                    if gpus:  # the copies are queued on the model's stream: done before the ack says so
                        cuda.settle(gpus, deadline, whole_device=cuda.settle_whole_device(self.engine.placement))
            if self.kept is not None:
                self.kept.version = update.version
            if self.on_applied is not None:  # (before the ack: what the program passes the update on to has it)
                try:
                    self.on_applied()
                except Exception as exc:
                    raise PassOnError(
                        f"version {update.version} was applied here, then passing it on failed: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
        except BaseException as exc:  # (an interrupt, an engine's cancelled load too: the worker goes on)
            if gpus:  # copies queued before the failure may still read the slot: done before the ack frees it
                cuda.settle_after_failure(gpus, self.update_timeout, self.where["model_id"])
            if not isinstance(exc, Exception):
                self._cut_short(taken, exc)
                raise
            self._outstanding = None  # (at the end: a take() while it applies is refused, as before it)
            self._ack(taken, self.version, exc)
            raise
        self._outstanding = None
        self._ack(taken, update.version)
        return update.version

    def discard(self, taken: list[Delivery]) -> None:
        """Let ``taken`` go unapplied (:meth:`PendingUpdate.discard`): acked as not applied, with the reason (a
        version refused when taken is acked with its refusal: changes against a copy this worker does not hold
        are then sent whole); the model keeps its version, and the next version may be taken."""
        self._outstanding, self._prepared = None, None
        where = {**self.where, "version": taken[-1].version}
        refused = taken[-1].refusal or self._refusal
        self._ack(taken, self.version, refused or LifecycleError("the worker discarded it, not applied", **where))

    def _cut_short(self, taken: list[Delivery], cause: BaseException) -> None:
        """``taken`` was cut short by ``cause``: let go, and where that is a Ctrl-C or an engine's cancelled load (not
        an ``Exception``), acked as failed, with the version the model holds (written whole, or not at all). Unacked,
        its worker was late on it for good: passed by, never sent a newer version to ack."""
        self._outstanding, self._prepared = None, None
        version, where = taken[-1].version, {**self.where, "version": taken[-1].version}
        if not isinstance(cause, Exception):  # (an Exception is acked where it is raised, or is the engine's own)
            stage = "after it was written" if self.version == version else "before it was applied"
            with contextlib.suppress(Exception):  # (the interrupt is what the caller hears)
                self._ack(taken, self.version, LifecycleError(f"cut short {stage} ({type(cause).__name__})", **where))

    def _ack(self, taken: list[Delivery], held: int | None, error: BaseException | None = None) -> None:
        """Ack ``taken``. An ack its sender is gone to hear is lost, no more: what was applied stays applied (and
        is reported as such), and the next take meets the sender's end, as after any version read before it."""
        try:
            self.engine.ack(taken, held, error)
        except ConnectionClosedError as exc:
            log.info("model %r: the ack of version %d is lost: %s", self.where["model_id"], taken[-1].version, exc)
            self._leave_sender_memory()  # (the model may now be bound to the slot it arrived in)

    def _hand_over(
        self,
        model: ExternalModel,
        update: Delivery,
        layout: FlatLayout,
        where: dict[str, Any],
        deadline: float,
        commit: Callable[[], None] | None,
    ) -> None:
        """Check ``update`` against what the program loads, and hand it its tensors to load (it copies them); or
        make the version the program prepared current (``commit``: checked before it was prepared)."""
        if commit is not None:
            with self.weights_lock:
                commit()
                self.version = update.version
            return
        views = self._program_views(model, update, layout, where, deadline)
        with self.weights_lock:
            model.load(views)
            self.version = update.version

    def _program_views(
        self, model: ExternalModel, update: Delivery, layout: FlatLayout, where: dict[str, Any], deadline: float
    ) -> dict[str, torch.Tensor]:
        """``update``'s tensors for the program (to load or prepare): checked, and readable (after ``update.fence``)."""
        check_spec(layout.spec, model.spec_for(layout.spec), **where)
        views = self._views_of(update, layout)
        if update.fence is not None:
            cuda.wait_event(update.fence, cuda.cuda_devices(views.values()), deadline)
        return views

    def _gpus(self, dst: dict[str, torch.Tensor], held: bool) -> set[torch.device]:  # (held: the bound storage's)
        return self.bound.gpus() if held else cuda.cuda_devices(dst.values())

    def _place(
        self, dst: dict[str, torch.Tensor], update: Delivery, layout: FlatLayout, held: bool
    ) -> dict[str, torch.Tensor] | None:
        """Put ``update`` into the model; return the views its tensors now are, or ``None`` (their own memory)."""
        placement = self.engine.placement
        if placement in ("take", "share") and update.storage is not None:
            bound = self.bound.storage
            if (
                held
                and update.whole
                and self.bound.can_swap
                and bound is not None
                and bound.device == update.storage.device
            ):
                # O(1): the model's storage takes the delivered memory, the delivery the memory the model had.
                self.bound.swap(update.storage)
                self.engine.taken(update, None, swapped=True)
                return self.bound.views
            if one_device(list(dst.values())) == update.storage.device:
                views = update.storage_views
                if views is None and not update.whole:  # the pieces sit inside the storage: their views
                    views = self._views_of(update, layout)
                left = self.bound.bind(dst, update.storage, layout, views)
                self.engine.taken(update, left, swapped=False)
                return self.bound.views
            # The model is on another device than the update's memory (a GPU model, bytes in host memory): it
            # keeps memory of its own, and each update is one copy per piece into it.
            if self.bound.load(dst, update.pieces, layout, held):
                return self.bound.views
        if placement == "load" and self.bound.load(dst, update.pieces, layout, held):
            return self.bound.views
        views = self._views_of(update, layout)
        # Into GPU tensors only: queued, and waited for once before the ack (`settle`); into host memory, at once.
        to_gpus = all(t.is_cuda for t in dst.values())  # (a CPU model stops at its first tensor)
        return views if write_into(dst, views, share=placement == "share", non_blocking=to_gpus) else None

    def _views_of(self, update: Delivery, layout: FlatLayout) -> dict[str, torch.Tensor]:
        """Typed views of the update's bytes: the engine's (it keeps those of buffers it reuses), else made now."""
        if update.views is not None:
            return update.views
        views: dict[str, torch.Tensor] = {}
        for offset, buffer in update.pieces:
            views.update(layout.views_at(buffer, offset))
        return views

    @property
    def has_thread(self) -> bool:
        """A background thread applies the updates as they arrive."""
        return self._thread is not None

    # ------------------------------------------------------------- reporting
    def receive(self, timeout: float) -> Any:
        """Apply the pending update (or report what the background thread applied); the weights, or ``None``
        (for an :class:`ExternalModel`, which holds no tensor of weightsync's: the model itself)."""
        if self._thread is None:
            if not self.engine.pushes:
                self.poll_and_apply(timeout)
        else:
            with self._applied:
                self._applied.wait_for(lambda: self._thread_error is not None or self.version != self.reported, timeout)
                if self.version == self.reported and self._thread_error is not None:
                    error = self._thread_error
                    if isinstance(error, Exception) and not isinstance(error, ConnectionClosedError):
                        self._thread_error = None  # an apply failure is reported once; what ended the thread stays
                    raise restated(error) if isinstance(error, WeightSyncError) else error  # (raised again: a copy)
        if self.version == self.reported:
            return None
        with self.weights_lock:  # the tensors the update was written to: no second walk of the model
            self.reported = self.version
            if isinstance(self.model, ExternalModel):
                return self.model
            dst, views = self._written
            if views is not None:  # the model reads them: plain tensors, no detach (0.5 us each)
                return self.strategy.format({k: views[k] for k in dst})
            return self.strategy.format({k: v.detach() for k, v in dst.items()})

    def _thread_loop(self) -> None:
        while not self._stop.is_set():
            try:
                changed = self.poll_and_apply(THREAD_POLL_S)
            except Exception as exc:  # noqa: BLE001 - reported to the worker at its next receive()
                self._thread_failed(exc)
                if isinstance(exc, ConnectionClosedError):
                    return
                log.error(  # (its words: a record kept by a log handler must not keep the update's frames)
                    "model %r worker %s: update failed: %s", self.where["model_id"], self.where["worker_idx"], str(exc)
                )
                continue
            except BaseException as exc:  # (a load that exits, an engine's cancelled load): ends the thread, said
                self._thread_failed(exc)
                return
            if changed is not None:
                with self._applied:
                    self._applied.notify_all()

    def _thread_failed(self, exc: BaseException) -> None:
        """What the background thread met, for the worker's next receive() to raise (without its frames' locals:
        the update it failed on, whose slot a worker that never calls receive() would keep mapped)."""
        chain = [exc, exc.__cause__, exc.__context__]  # (what apply raised, and what it was raised from)
        for seen in (e for e in chain if e is not None):
            traceback.clear_frames(seen.__traceback__)
        with self._applied:
            self._thread_error = exc
            self._applied.notify_all()

    # ------------------------------------------------------------- shutdown
    def _leave_sender_memory(self) -> None:
        """The sender closed the channel (shut down or died): a model that runs on the sender's GPU memory
        (``shared_mem`` device slots, CUDA IPC) gets private memory now, while a sender that said goodbye still
        keeps it. Copying later (at ``close()``) would read memory CUDA no longer defines once the sender exited."""
        if self.engine.placement != "share":
            return
        with self.weights_lock:
            storage = self.bound.storage
            if storage is not None and storage.device.type == "cuda":
                self.bound.release()
                self._written = (self._written[0], None)  # (the views of the sender's memory: the model's own now)

    def close(self, timeout: float) -> None:
        """Stop the background thread (waiting at most ``timeout``), give the model memory of its own if it
        shares the engine's, and close the engine."""
        stop_thread(self._thread, self._stop, timeout, "receiver")
        self._thread = None
        if self.engine.placement == "share" and not isinstance(self.model, ExternalModel):
            # The model still reads shared memory: give it private memory so the engine can unmap it.
            with self.weights_lock:
                self.bound.release()
                for tensor in flatten_weights(self.model, self.strategy.extract_as).values():
                    if tensor.is_cpu and tensor.is_shared():  # (a model the user shared is moved too)
                        tensor.data = tensor.data.clone()
        self._written = ({}, None)
        release = self.release_pending() if self.release_pending is not None else None
        if release is not None:  # (a program that keeps it must not keep the engine's memory mapped)
            release()
        self.bound.forget()
        if self.kept is not None:
            self.kept.close()
        self.closed = True
        self.engine.close()
