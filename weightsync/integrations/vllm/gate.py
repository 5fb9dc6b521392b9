"""The trainer's side of vLLM engines as weightsync workers: the scheme's engine, wrapped, making the engines' calls.

The trainer hands its scheme the engines as its context::

    engines = VLLMEngines([llm], pause_mode="keep")
    scheme.init_on_sender(model=hf_model, context=engines)   # one worker per engine
    scheme.connect()   # each engine's weightsync backend joins and loads the trainer's weights
    scheme.send()      # returns when every engine serves the new version

The scheme's own engine moves the bytes (multiprocess, shared_mem, distributed, ...) into each vLLM worker
process, where weightsync's vLLM backend (:mod:`weightsync.integrations.vllm.backend`) loads them. The gate
(:class:`Gate`, which the driver, :mod:`.driver`, puts around the scheme's engine) makes the engines' control
calls around each version, and passes a worker's ack on to the core only once its engine serves the version:

- connect: ``init_weight_transfer_engine({"receiver": scheme.receiver_config(i)})``, then the engine's version is
  ``"0"`` and its prefix cache is reset;
- each version ``v``: once the scheme's engine published it (each engine's backend takes the bytes in the
  background), ``start_weight_update``, pause (``pause_mode``), ``update_weights({"version": v})`` (the backend
  loads ``v``), ``finish_weight_update(weight_version=str(v))``, the prefix cache reset (cached keys and values
  were computed with the old weights), resume. An engine that pauses with its start
  (:attr:`~weightsync.integrations.vllm.clients.EngineClient.starts_with_pause`: an ``AsyncLLM``) is sent both at
  once when the bytes are out: each waits for the step the engine is computing to end, and together they wait for
  one step, not two. Another is started first, while the bytes travel. With the ``ray`` scheme, the calls are
  made in the actor, by the scheme's call into it that loads ``v`` (:mod:`.actor`).

An engine whose calls fail is a failed worker, named; one that does not answer is one that timed out.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any

from ... import errors
from ...core.engine import Outgoing, SenderEngine, Sink
from ...core.timing import remaining, shown_seconds
from ...errors import LifecycleError, WeightSyncError
from ...transports.ray.sender import RaySender
from .actor import update_in_actor
from .calls import around_load, cause, engine_error, gave_up, in_thread, turn_of
from .clients import EngineClient
from .engines import VLLMEngines
from .passing import PassesBy
from .rejoining import Rejoins

__all__ = ["Gate"]

log = logging.getLogger("weightsync.vllm")

#: The longest slice the sender waits on its engine while an engine's calls are also under way (seconds).
SLICE_S = 0.002


class Gate(Rejoins, PassesBy, SenderEngine):
    """The scheme's own engine, wrapped: the engines' control calls go around each version, and a worker's ack
    reaches the core (``core``) only once its engine's calls for that version returned. It is also the sink the
    scheme's engine reports to."""

    def __init__(self, engines: VLLMEngines, scheme: Any, core: Sink) -> None:
        self.engines, self.scheme, self.core = engines, scheme, core
        self.model_id = core.model_id
        self.inner: SenderEngine | None = None
        self._lock = threading.Lock()
        self._closing = False  # set at close: calls not begun by then are not made
        #: worker -> (version, the future of its engine's calls for it) of each version not passed on yet, the
        #: latest last: passed on together once all are done (the first failure that is news reported)
        self._calls: dict[int, list[tuple[int, concurrent.futures.Future]]] = {}
        #: worker -> the version its receiver acked, held back until its engine's calls are done
        self._held: dict[int, int] = {}
        #: worker -> its receiver's failure reported while its engine's calls ran, held until they are done and
        #: passed on once: the engine's call fails because of it (a version whose changes it refused is sent whole
        #: again), but at init the engine's own error is the cause (Ray's version 0 fails without the receiver)
        self._failures: dict[int, WeightSyncError] = {}
        #: worker -> the newest version whose failure the core was told: a call failing for it later is not news
        self._told: dict[int, int] = {}
        #: One engine's calls are made one at a time (an engine's client is not made for concurrent calls).
        self._turns = [threading.Lock() for _ in range(engines.num_workers)]
        #: worker -> its engine's calls under way (whatever the core was told of them): :meth:`settle`, :meth:`idle`
        self._running: dict[int, set[concurrent.futures.Future]] = {}
        #: worker -> the newest version its engine was updated to and named: a turn is not taken in the order the
        #: calls were made, and an older version's, coming after, has nothing left to do
        self._served: dict[int, int] = {}
        #: worker -> whether the scheme's engine took it back, while a new engine joins in its place (:meth:`rejoin`)
        self._joining: dict[int, bool] = {}
        #: workers whose new engine did not join in time, the old one put back, while its init call runs: its
        #: receiver, joining late, is turned away (:meth:`admit`)
        self._abandoned: set[int] = set()
        self._gave_up = {}  # (PassesBy's)

    # ------------------------------------------------ the sink the scheme's engine reports to
    timeout = property(lambda self: self.core.timeout, doc="The core's (the scheme's ``timeout``).")
    connect_timeout = property(lambda self: self.core.connect_timeout, doc="The core's (``connect_timeout``).")

    def acked(self, worker: int, held: int) -> None:
        with self._lock:
            if worker in self._calls:
                self._held[worker] = max(held, self._held.get(worker, held))
                return
        self._ack(worker, held)

    def failed(self, worker: int, error: WeightSyncError) -> None:
        with self._lock:
            if any(not f.done() for _, f in self._calls.get(worker, [])):
                self._failures.setdefault(worker, error)
                return
        self._tell(worker, error)

    def unanswered(self, worker: int, error: errors.SyncTimeoutError) -> None:
        self.failed(worker, error)  # (RPC's calls alone report this, and from_config refuses an engine RPC's receiver)

    def _tell(self, worker: int, error: WeightSyncError) -> None:  # (a call failing later for it is not news)
        with self._lock:
            self._told[worker] = max(error.version if error.version is not None else -1, self._told.get(worker, -1))
        self.core.failed(worker, error)

    def died(self, worker: int, error: WeightSyncError | str) -> None:
        self.core.died(worker, error)

    def is_dead(self, worker: int) -> bool:
        return self.core.is_dead(worker)

    def waiting(self, joined: Any) -> None:
        """The scheme's engine waits for workers to join: an engine whose init call failed never will."""
        self._raise_failed_inits()
        self.core.waiting(joined)

    def rejoining(self, worker: int, version: int | None = None) -> None:
        with self._lock:
            if worker in self._joining:  # (the scheme's engine took it back: the bytes now go to the new engine)
                self._joining[worker] = True
        self.core.rejoining(worker, version)

    def rejoined(self, worker: int, version: int | None) -> None:
        self.core.rejoined(worker, version)

    def send_to(self, weights: Any, workers: list[int], *, wait: bool | None) -> None:
        self.core.send_to(weights, workers, wait=wait)

    def wait_for(self, workers: list[int], timeout: float | None) -> None:
        self.core.wait_for(workers, timeout)

    # ------------------------------------------------ the engines' calls
    def _call(self, worker: int, version: int, steps: Any) -> concurrent.futures.Future:
        """Run ``steps(client, left)`` for ``worker``'s engine in a thread, as its calls for ``version`` (after the
        engine's earlier calls, if any are still under way, within the same time): ``left()`` is what is left of
        that time, which the calls share."""
        client = self.engines.clients[worker]
        timeout = self.core.timeout if version else self.core.connect_timeout
        turn = self._turns[worker]

        def in_turn() -> None:
            with turn_of(turn, client.name, timeout) as deadline:
                if self._closing:
                    raise LifecycleError(f"{client.name}: the scheme shut down before its calls for version {version}")
                steps(client, lambda: max(0.001, remaining(deadline)))

        with self._lock:
            self._calls.setdefault(worker, []).append(
                (version, future := in_thread(in_turn, f"weightsync-vllm-{worker}"))
            )
        return self._track(worker, future)

    def _track(self, worker: int, future: concurrent.futures.Future) -> concurrent.futures.Future:
        """Count ``future``, a call into ``worker``'s engine, as under way until it is done (:meth:`idle`)."""
        with self._lock:
            running = self._running.setdefault(worker, set())
            running.add(future)
        future.add_done_callback(lambda done: self._ended(running, done))
        return future

    def _ended(self, running: set[concurrent.futures.Future], future: concurrent.futures.Future) -> None:
        with self._lock:  # (idle() reads the sets under it)
            running.discard(future)

    def settle(self, workers: list[int], deadline: float) -> dict[int, WeightSyncError]:
        """The calls of engines whose calls end within a send (:attr:`EngineClient.ends_within_send`: an ``LLM``)
        are waited for until ``deadline``; each engine whose calls still run is named."""
        owned = [w for w in workers if self.engines.clients[w].ends_within_send]
        ended = not owned or self.idle(remaining(deadline), owned)
        self._forward()  # (what the calls that ended said)
        if ended:
            return {}
        return {
            w: errors.SyncTimeoutError(
                f"{self.engines.clients[w].name}: its calls still run, {shown_seconds(self.core.timeout)} after the "
                "send ended; do not call it (generate) until they return: VLLMEngines.idle(timeout) waits for that",
                model_id=self.core.model_id,
                worker_idx=w,
            )
            for w in owned
            if not self.idle(0.0, [w])
        }

    def idle(self, timeout: float, workers: list[int] | None = None) -> bool:
        """Wait until no call into the engines of ``workers`` (default: all) is under way, at most ``timeout``;
        return whether none is. (A worker's engine that replaced another is asked about its own calls alone.)"""
        with self._lock:
            running = [f for w in (self._running if workers is None else workers) for f in self._running.get(w, ())]
        return not concurrent.futures.wait(running, max(timeout, 0.0)).not_done

    def _forget(self, worker: int) -> list[tuple[dict[int, Any], Any]]:
        """Drop ``worker``'s calls (its engine is gone or replaced: what its calls did is moot); return what was
        dropped, as (where, what) pairs."""
        with self._lock:
            state = (self._calls, self._held, self._failures, self._told, self._gave_up)
            kept = [(d, d.pop(worker)) for d in state if worker in d]
        return kept

    def _paused(self, client: EngineClient, left: Any, body: Any, worker: int, version: int, **calls: Any) -> None:
        """:func:`~.calls.around_load` in the engines' pause mode, its time recorded."""
        took = around_load(client, left, body, self.engines.pause_mode, self.core.timeout, **calls)
        if took is not None:
            self.engines.record(worker, version, took, paused=client.pauses and self.engines.pause_mode != "none")

    def _init_steps(self, worker: int, initial: bool) -> Any:
        config = self.scheme.receiver_config(worker)
        if isinstance(config.get("scheme"), dict) and "latest_wins" in config["scheme"]:
            # An engine takes the versions one at a time (latest_wins off), however far behind: update_weights(v)
            # then loads v, never a newer version that finish_weight_update would name v (Ray's are calls into its
            # actor, one a version); and in update_weights only (a thread of its own would load each unnamed).
            config["scheme"] = {**config["scheme"], "latest_wins": False}
            config["scheme"].update({"background_thread": False} if "background_thread" in config["scheme"] else {})
        init_info = {"receiver": config, "load_ahead": self.engines.load_ahead}
        # (in this thread: before the scheme's engine publishes the version this engine is to load first)
        self.engines.clients[worker].queue_init(init_info)

        def steps(client: EngineClient, left: Any) -> None:
            def body() -> None:
                client.init(init_info, left())  # returns once the engine loaded the version the trainer sent it
                # (an engine that rejoins is sent a version of its own next, which names it; Ray's call names it)
                if initial and not self._inner().pushes:
                    client.set_version("0", left())

            self._paused(client, left, body, worker, 0)
            if client.pauses and self.engines.pause_mode == "none":  # (the other modes' pause ended in a resume:
                client.resume(left())  # an engine that a trainer which died in an update left paused generates)

        return steps

    def _update_steps(self, worker: int, version: int) -> Any:
        def steps(client: EngineClient, left: Any) -> None:
            with self._lock:
                if version <= self._served.get(worker, -1):
                    return  # (its engine loaded this version on the way to a later one, and is named after that)

            def body() -> None:
                client.update({"version": version}, left())
                client.finish(str(version), left())
                with self._lock:
                    self._served[worker] = max(version, self._served.get(worker, -1))

            def before() -> None:
                # The engine stops for the load, not for the bytes' trip: they are all out to it first (its backend
                # takes them while it generates, with its weights until update_weights: the start need not wait).
                self._inner().wait_sent(worker, time.monotonic() + left())

            def undone() -> bool:  # (the finish that ended the session waited for a load still under way)
                if not client.name_if_loaded(version, self.core.timeout):
                    return False
                with self._lock:
                    self._served[worker] = max(version, self._served.get(worker, -1))
                return True

            self._paused(client, left, body, worker, version, before=before, start=True, undone=undone)

        return steps

    def _raise_failed_inits(self) -> None:
        with self._lock:
            calls = [(w, v, f) for w, made in self._calls.items() for v, f in made]
        for worker, version, future in calls:
            if version == 0 and future.done() and future.exception() is not None:
                raise errors.WorkerDiedError(
                    f"vLLM engine {worker} could not start weightsync: {cause(future.exception())}",
                    model_id=self.core.model_id,
                    worker_idx=worker,
                )

    def _forward(self) -> None:
        """Pass on each ack whose engine's calls are done; report each engine whose calls failed."""
        with self._lock:
            ready = [w for w, calls in self._calls.items() if all(f.done() for _, f in calls) and self._heard(w, calls)]
            done = {w: self._calls.pop(w) for w in ready}
            held = {w: self._held.pop(w) for w in done if w in self._held}
            reported = {w: self._failures.pop(w) for w in done if w in self._failures}
        for worker, calls in done.items():
            version = calls[-1][0]
            if worker not in reported and any(v and f.exception() is not None for v, f in calls):
                self._inner().poll([worker])  # (the receiver's own word of why, the cause, may be on its way)
            told, served = self._told.get(worker, -1), {v for v, f in calls if f.exception() is None}
            # (a version made again with success, sent whole, was served; one the core was told of is not news)
            failures = [(v, e) for v, f in calls if (e := f.exception()) is not None and v not in served and v > told]
            receiver = reported.get(worker)
            init = [(v, e) for v, e in failures if v == 0]
            # What its engine serves, as its receiver acked it, is passed on before a failure (one of an older
            # version, reported late, would leave the core waiting for an ack already come).
            serves = max((v for v in served if v <= held.get(worker, -1)), default=None)
            if serves is not None and (failures or receiver is not None):
                self._ack(worker, serves)
            if init or (failures and receiver is None):
                # The first's cause (a later one is often its consequence), named with the newest version failed:
                # a wait for that version takes a failure of an older one alone for moot.
                after = [(v, e) for v, e in failures if v > max(served, default=-1)] or failures  # (not a served one's)
                failed, error = init[0] if init else (after[-1][0], after[0][1])
                if not self.core.is_dead(worker):
                    # (its engine may still run calls that gave up: answered, if its receiver acked their version)
                    hung = [e for v, e in failures if v > held.get(worker, -1) and gave_up(e)]
                    error = engine_error(worker, failed, hung[0] if hung else error, self.core.model_id)
                    self._report(worker, failed, error, hangs=bool(hung))
                    continue
            elif receiver is not None:
                self._tell(worker, receiver)
            elif worker in held:
                self._ack(worker, held[worker])
            elif version == 0 and not self._inner().pushes:  # (the rendez-vous took the receiver's own word)
                self._ack(worker, version)
            with self._lock:  # (its engine answered its calls)
                self._gave_up.pop(worker, None)

    def _heard(self, worker: int, calls: list[tuple[int, concurrent.futures.Future]]) -> bool:
        """(Under the lock, ``worker``'s calls done) Whether what to tell the core of ``worker`` is known: a call
        failed, its receiver failed, or acked the version the calls were for. Calls that returned are not its ack:
        whoever answers them (anyone on the path to an engine served over HTTP) is not the receiver, whose ack is
        authenticated with the run key (:meth:`wait` goes on polling for it, within the send's time)."""
        version = calls[-1][0]
        if version == 0 or self._inner().pushes or worker in self._failures:  # (Ray's: the call is the receiver's)
            return True
        return self._held.get(worker, -1) >= version or any(f.exception() is not None for _, f in calls)

    # ------------------------------------------------ the engine the core drives
    def _inner(self) -> SenderEngine:
        if self.inner is None:
            raise LifecycleError("the scheme's engine is not built yet")
        return self.inner

    @property
    def rejoins(self) -> bool:  # type: ignore[override]
        return self.inner is not None and self.inner.rejoins

    def set_aside(self, worker: int) -> bool:
        return self._inner().set_aside(worker)

    @property
    def takes_deltas(self) -> bool:  # type: ignore[override]
        """The scheme's engine's: a class attribute of every engine, which ``__getattr__`` would never be asked for
        (without this, ``delta`` was silently off for engines)."""
        return self.inner is not None and self.inner.takes_deltas

    def adopt(self, engine: SenderEngine) -> None:
        """Wrap ``engine``: what the core reads of an engine is its."""
        self.inner = engine
        engine.reports_taken = True  # (before any send: this driver waits in wait_sent before each load)
        if isinstance(engine, RaySender):  # the engine's calls around each load, in the actor's call that loads it
            engine.run_in_actor(update_in_actor)
        self.layout, self.num_workers = engine.layout, engine.num_workers
        self.checksum, self.gpu = engine.checksum, engine.gpu
        self.transports = engine.transports  # (the same dict: the engine fills it)

    def digest(self, buffers: list[Any]) -> str | None:
        return self._inner().digest(buffers)

    def handoff(self) -> dict[str, Any]:
        return self._inner().handoff()

    def connection(self) -> dict[str, Any]:
        return self._inner().connection()

    def rendezvous(self, deadline: float, timeout: float) -> dict[int, WeightSyncError]:
        assert self.inner is not None
        self._check_caller()
        for worker in range(self.engines.num_workers):
            self._call(worker, 0, self._init_steps(worker, initial=True))
        return self.inner.rendezvous(deadline, timeout)

    def rendezvous_complete(self) -> bool:
        return self._inner().rendezvous_complete()

    def stage(self, out: Outgoing, deadline: float) -> Any:
        self._check_caller()  # (before anything is published)
        return self._inner().stage(out, deadline)

    def _check_caller(self) -> None:
        for client in self.engines.clients:
            client.check_caller()

    def submit(self, out: Outgoing, staged: Any) -> None:
        assert self.inner is not None
        # The bytes first: each engine's backend takes them while it generates; its pause then holds the load only.
        self.inner.submit(out, staged)
        if not out.initial and not self.inner.pushes:  # (the initial version: the init calls, at the rendez-vous;
            # Ray's: each update is one call into the engine's actor, which makes the engine's calls: actor.py)
            for worker in out.workers:
                if not self.core.is_dead(worker):
                    self._call(worker, out.version, self._update_steps(worker, out.version))

    def poll(self, workers: list[int]) -> None:
        assert self.inner is not None
        self.inner.poll(workers)
        self._forward()
        self._ask_again(workers)

    def wait(self, workers: list[int], deadline: float) -> None:
        assert self.inner is not None
        self._check_caller()  # (a wait_async)
        with self._lock:
            calls = [f for w in workers for _, f in self._calls.get(w, [])]
            unheard = [w for w in workers if w not in self._calls or self._held.get(w, -1) < self._calls[w][-1][0]]
        if calls and not unheard:  # every receiver acked: what is left is the engines' calls
            running = [f for f in calls if not f.done()]  # (one done and not passed on waits for its later calls)
            if running:
                concurrent.futures.wait(running, remaining(deadline), return_when=concurrent.futures.FIRST_COMPLETED)
        elif calls:
            self.inner.wait(workers, min(deadline, time.monotonic() + SLICE_S))
        else:
            self.inner.wait(workers, deadline)
        self._forward()

    def lost(self, worker: int, reason: str) -> None:
        assert self.inner is not None
        self._forget(worker)
        self.inner.lost(worker, reason)

    def unpublished(self) -> None:
        self._inner().unpublished()

    def poll_rejoin(self) -> Any:
        return self._inner().poll_rejoin()

    def admit(self, candidate: Any) -> tuple[int, int] | None:
        """(Under the core's lock) The receiver of a new engine that did not join in time, joining now, is turned
        away, its worker named gone (its bytes would go to it, its calls to the engine put back in its place)."""
        with self._lock:
            abandoned = set(self._abandoned)  # (the admission may let that init return, whose end clears the mark)
        admitted = self._inner().admit(candidate)
        with self._lock:
            if admitted is None or admitted[0] not in abandoned | self._abandoned:
                return admitted
            self._abandoned.discard(admitted[0])
        self.core.died(admitted[0], f"vLLM engine {admitted[0]}: a replacement that did not join in time joined late")
        return None

    def discard(self, candidate: Any) -> None:
        self._inner().discard(candidate)

    def payload_bytes(self) -> int:
        return self._inner().payload_bytes()

    def close(self, timeout: float) -> None:
        self._closing = True
        if timeout > 0:  # each engine lets its receiver go (it goes on serving the version it holds), but one whose
            # worker is gone or dropped: vLLM's call names no receiver, and the one its engine holds may be another
            # trainer's (whose init took the engine over). First, the receivers gone since the last send:
            try:
                self._inner().poll([w for w in range(self.engines.num_workers) if not self.core.is_dead(w)])
            except Exception as exc:  # noqa: BLE001 - a close goes on (each engine is then told)
                log.info("model %r: at shutdown, the engines' receivers could not be polled: %s", self.model_id, exc)
            stops = [  # (an LLM's call that outlasts the close is waited for by VLLMEngines.idle)
                self._track(w, in_thread(lambda w=w: self._stop(w, timeout), f"weightsync-vllm-{w}"))
                for w in range(self.engines.num_workers)
                if not self.core.is_dead(w)
            ]
            concurrent.futures.wait(stops, timeout)
        if self.inner is not None:
            self.inner.close(timeout)
        self.engines._gate = None
        self.engines._closed = self  # (its calls that outlast it are still waited for by VLLMEngines.idle)

    def _stop(self, worker: int, timeout: float) -> None:
        """Tell ``worker``'s engine to let its receiver go, once its other calls returned (within ``timeout``)."""
        turn = self._turns[worker]
        if not turn.acquire(timeout=timeout):
            log.warning("vLLM engine %d: still busy at shutdown; its receiver goes when the trainer's does", worker)
            return
        try:
            self.engines.clients[worker].shutdown(timeout)
        except Exception as exc:  # noqa: BLE001 - a dead engine has nothing to let go
            log.info("vLLM engine %d: at shutdown: %s", worker, exc)
        finally:
            turn.release()

    def __getattr__(self, name: str) -> Any:  # what a scheme asks of its own engine (Ray's resubmit, transports)
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)
