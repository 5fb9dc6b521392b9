"""The engines one trainer's scheme serves (:class:`VLLMEngines`, the scheme's context), and what their calls took.

The gate that makes their calls around each version is :mod:`~weightsync.integrations.vllm.gate`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ... import checks
from ...core.states import SENDER_CONNECTED
from ...core.timing import deadline_after, remaining
from ...core.workers import targets
from ...errors import ConfigurationError, LifecycleError
from .clients import PAUSE_MODES, PROTOCOL, AsyncLLMClient, EngineClient, LLMClient, RayActorClient
from .served import HTTPEngineClient

__all__ = ["EngineTiming", "VLLMEngines", "check_options", "engine_client"]


class _Serving(Protocol):
    """What :meth:`VLLMEngines.replace` asks of the driver's engine serving them."""

    scheme: Any
    core: Any

    @property
    def takes_back(self) -> bool: ...

    def rejoin(self, worker: int, timeout: float) -> None: ...

    def idle(self, timeout: float, workers: list[int] | None = None) -> bool: ...


#: How many :class:`EngineTiming` records :class:`VLLMEngines` keeps.
KEPT = 1000


@dataclass(frozen=True)
class EngineTiming:
    """One engine's calls for one version.

    Attributes:
        worker: the engine's worker index.
        version: the version.
        seconds: from its pause to its resume (``paused``: how long it did not generate), else from its
            ``start_weight_update`` call to its prefix cache's reset.
        paused: the engine was paused.
    """

    worker: int
    version: int
    seconds: float
    paused: bool


class VLLMEngines:
    """The vLLM engines one trainer's scheme serves: give it as ``init_on_sender(context=...)``.

    Args:
        engines: one per worker, in worker order: a ``vllm.LLM``, an ``AsyncLLM`` (with ``loop``), the URL of a
            ``vllm serve`` server run with ``VLLM_SERVER_DEV_MODE=1``, here or on another host
            (``"http://host:8000"``, or vLLM's ``HTTPVLLMWeightSyncClient`` of it: paused through its routes), or
            a Ray actor holding an engine (its handle; ``ray.remote(vllm.LLM)``), or any object with vLLM's
            trainer-side calls (``RayVLLMWeightSyncClient``). Each was started with
            ``weight_transfer_config={"backend": "weightsync"}``.
        pause_mode: what requests in flight do while an engine loads a version: ``"keep"`` (frozen, then
            continued under the new version), ``"wait"`` (finished under the old one first), ``"abort"``, or
            ``"none"`` (no pause: an ``LLM`` driven between its ``generate`` calls has nothing in flight; refused
            for an engine that serves requests while it loads, which would compute with a mix of two versions).
            Engines that cannot pause (an ``LLM``, in an actor or not; vLLM's ``RayVLLMWeightSyncClient``) are not
            paused whatever the mode.
        loop: the event loop an ``AsyncLLM`` runs on (running in another thread than the trainer's sends).
        load_ahead: ``True``: a CPU engine runs vLLM's processing of each version (its loader and post-load
            packing, most of a load there) on a shadow of its model as soon as the version arrives, while it goes
            on generating, and the pause only makes the version current (a few ms). ``False`` (default): vLLM's
            whole reload in the pause. Where generation keeps every core busy, the processing takes them from it
            either way: ahead, the engine stops for less time and ``send()`` waits longer (``docs/vllm.md``,
            "Loading ahead"). A GPU engine always reloads in the pause (its processing of unquantized weights is
            next to nothing).

    Raises:
        ConfigurationError: an unknown pause mode, ``"none"`` for an engine that pauses, no engine, an engine
            that is not one, or one engine given twice.
    """

    def __init__(
        self,
        engines: Sequence[Any],
        *,
        pause_mode: str = "keep",
        loop: asyncio.AbstractEventLoop | None = None,
        load_ahead: bool = False,
    ) -> None:
        check_options(pause_mode, load_ahead)
        if isinstance(engines, (str, bytes)) or not isinstance(engines, Sequence) or not engines:
            raise ConfigurationError("VLLMEngines needs a non-empty list of engines, one per worker")
        self.loop = loop
        self.clients: list[EngineClient] = [engine_client(e, f"vLLM engine {i}", loop) for i, e in enumerate(engines)]
        _each_once(self.clients)
        self.num_workers = len(self.clients)
        self._gate: _Serving | None = None  # the driver's, while a connected scheme serves these engines
        self.pause_mode, self.load_ahead = "keep", False
        self.serve_with(pause_mode, load_ahead)
        self._closed: _Serving | None = None  # the last that did: its calls may outlast it (idle)
        #: The last updates' calls, per engine (newest last, at most :data:`KEPT`): see :meth:`record`.
        self.timings: list[EngineTiming] = []
        self._timings_lock = threading.Lock()

    def serve_with(self, pause_mode: str, load_ahead: bool) -> None:
        """Serve the engines from now on with ``pause_mode`` and ``load_ahead`` (as the constructor takes them; a
        :class:`~.scheme.VLLMWeightSyncScheme` given these engines sets its own).

        Raises:
            ConfigurationError: an unknown mode, ``"none"`` for an engine that serves requests while it loads, or
                engines another scheme serves.
        """
        if self._gate is not None:
            raise ConfigurationError("these VLLMEngines already serve another scheme: give each scheme its own")
        check_options(pause_mode, load_ahead)
        _paused_where_it_serves(pause_mode, self.clients)
        self.pause_mode, self.load_ahead = pause_mode, load_ahead

    @property
    def remote_collectors(self) -> list[Any]:
        """The Ray actors holding the engines, for a Ray scheme (whose updates are calls into each actor).

        Raises:
            ConfigurationError: an engine is not a Ray actor."""
        actors = [c.target for c in self.clients if isinstance(c, RayActorClient)]
        if len(actors) != self.num_workers:
            raise ConfigurationError(
                "a Ray scheme reaches vLLM engines held by Ray actors: give VLLMEngines each engine's actor handle "
                "(ray.remote(vllm.LLM)...), or use another transport"
            )
        return actors

    def record(self, worker: int, version: int, seconds: float, *, paused: bool) -> None:
        """Note how long engine ``worker``'s calls for ``version`` took: from its pause to its resume when it was
        paused (how long it did not generate), else from ``start_weight_update`` to the reset of its prefix cache.
        (An engine in a Ray actor served by the ``ray`` scheme makes its calls inside the scheme's call that loads
        the version, which the driver does not time: :mod:`~weightsync.integrations.vllm.actor`.)"""
        with self._timings_lock:
            self.timings.append(EngineTiming(worker, version, seconds, paused))
            del self.timings[:-KEPT]

    def idle(self, timeout: float | None = None, worker_ids: list[int] | None = None) -> bool:
        """Wait until no call of the trainer's into the engines of ``worker_ids`` (default: every engine) is under
        way, at most ``timeout`` seconds (default: the scheme's ``timeout``; 0: do not wait); return whether none
        is. A send returns with none into a ``vllm.LLM`` unless it raised that one still runs: that ``LLM`` must
        not be called (``generate``) until this says so (it takes no call beside another); nor after
        ``shutdown()``, which may return with such a call under way. An engine that :meth:`replace` put in another's
        place is asked about alone (the calls into the one it replaced are not counted).

        Raises:
            ConfigurationError: ``timeout`` is not None or a number of seconds from 0 to an hour, or ``worker_ids``
                names no engine."""
        gates = [g for g in (self._gate, self._closed) if g is not None]  # (the calls of both may be under way)
        if worker_ids is not None:
            worker_ids = targets(worker_ids, self.num_workers, None)
        if not gates:
            checks.within(timeout, 0.0, "idle(timeout)")
            return True
        deadline = deadline_after(checks.within(timeout, gates[0].core.timeout, "idle(timeout)"))
        return all(gate.idle(remaining(deadline), worker_ids) for gate in gates)

    def replace(self, worker_idx: int, engine: Any, timeout: float | None = None) -> None:
        """Serve ``engine`` as worker ``worker_idx`` from now on (an engine restarted after the old one died or was
        dropped): it joins the trainer (the scheme's engine takes the worker back), then the trainer's weights are
        sent to it alone as a new version, which it serves when this returns. (The newest version the trainer
        published may have reached no one: published while this worker was gone, to no other.)

        Raises:
            LifecycleError: the scheme these engines serve is not connected.
            ConfigurationError: no such worker, ``engine`` is not an engine, serves another worker already, or
                pauses under ``pause_mode="none"``, or the scheme's engine does not take workers back.
            WeightSyncError: the engine could not join (named), or not within ``timeout`` (default: the scheme's
                ``connect_timeout``): the engine it was to replace is served as before (one that hangs, its receiver
                still joined, must be killed or dropped first), unless the worker is dropped (it was, or the new
                engine's receiver joined before its engine failed): ``replace`` may then be called again; or the
                send to it failed.
        """
        gate = self._gate
        if gate is None or gate.scheme.state != SENDER_CONNECTED:  # (its gate is made at init_on_sender)
            state = "not initialized, or shut down" if gate is None else gate.scheme.state
            raise LifecycleError(f"VLLMEngines.replace: the scheme these engines serve is {state}, not connected")
        if type(worker_idx) is not int or not 0 <= worker_idx < self.num_workers:
            raise ConfigurationError(f"worker_idx must be an int in [0, {self.num_workers}), got {worker_idx!r}")
        if not gate.takes_back:
            raise ConfigurationError(
                f"{type(gate.scheme).__name__}'s engine does not take a worker back: a restarted engine cannot rejoin "
                "it (restart the trainer's scheme instead)"
            )
        within = checks.within(timeout, gate.core.connect_timeout, "replace(timeout)")  # (before the engine is called)
        old, new = self.clients[worker_idx], engine_client(engine, f"vLLM engine {worker_idx}", self.loop)
        _each_once([*self.clients[:worker_idx], new, *self.clients[worker_idx + 1 :]])
        _paused_where_it_serves(self.pause_mode, [new])
        self.clients[worker_idx] = new
        try:
            gate.rejoin(worker_idx, within)
        except BaseException:  # the engine it was to replace is served as before (one that hangs, still joined),
            if not gate.core.is_dead(worker_idx):  # unless the worker is dropped (then its calls go nowhere)
                self.clients[worker_idx] = old
            raise
        gate.scheme.send(worker_ids=[worker_idx])
        if not gate.scheme.sync:
            gate.scheme.wait_async()


def check_options(pause_mode: str, load_ahead: bool) -> None:
    """Refuse an unknown pause mode, or a ``load_ahead`` that is not a bool (:class:`VLLMEngines` takes them)."""
    if pause_mode not in PAUSE_MODES:
        raise ConfigurationError(f"pause_mode must be one of {list(PAUSE_MODES)}, got {pause_mode!r}")
    if not isinstance(load_ahead, bool):
        raise ConfigurationError(f"load_ahead must be True or False, got {load_ahead!r}")


def _paused_where_it_serves(pause_mode: str, clients: list[EngineClient]) -> None:
    """Refuse ``pause_mode="none"`` for an engine that serves requests while it loads (one that pauses).

    Raises:
        ConfigurationError: naming those engines.
    """
    serving = [c.name for c in clients if c.pauses]
    if pause_mode == "none" and serving:
        raise ConfigurationError(
            f"pause_mode='none' would load each version into {', '.join(serving)} while its requests in flight "
            "run: they would compute with a mix of two versions, named for one. It is for a vllm.LLM, which "
            "generates only inside generate(); an engine that serves requests meanwhile pauses: 'keep' (the "
            "default: frozen for the load, then continued), 'wait' or 'abort'"
        )


def _each_once(clients: list[EngineClient]) -> None:
    """Refuse an engine given twice: its two workers' calls would meet in it (an ``LLM`` takes no call beside
    another), and the first worker's connect waits for the version 0 that the second's, queued behind it, holds up.

    Raises:
        ConfigurationError: naming both places.
    """
    seen: dict[Any, str] = {}
    for client in clients:
        target = client.target  # (a server's URL, made canonical by its client; a Ray actor's handles share its id)
        key = target if isinstance(target, str) else getattr(target, "_actor_id", None) or id(target)
        if key in seen:
            raise ConfigurationError(
                f"{seen[key]} and {client.name} are the same engine: give each worker an engine of its own"
            )
        seen[key] = client.name


def engine_client(target: Any, name: str, loop: asyncio.AbstractEventLoop | None = None) -> EngineClient:
    """The client of an engine ``target``: an :class:`EngineClient` as it is, a ``vllm.LLM``, an ``AsyncLLM`` (with
    ``loop``, the running event loop it was made on), the URL of a ``vllm serve`` server (``"http://host:8000"``)
    or vLLM's ``HTTPVLLMWeightSyncClient`` of one (both: an :class:`HTTPEngineClient`, which also pauses it and
    resets its prefix cache), a Ray actor's handle (:class:`RayActorClient`), or any object with vLLM's four
    trainer-side calls.

    Raises:
        ConfigurationError: ``target`` is none of those (the message names what it lacks), or a URL that is not one.
    """
    if isinstance(target, EngineClient):
        return target
    if isinstance(target, str):
        return HTTPEngineClient(target, name)
    if type(target).__name__ == "HTTPVLLMWeightSyncClient" and isinstance(getattr(target, "base_url", None), str):
        # (its own calls have no pause, and no reset of the prefix cache: the engine would serve stale keys)
        return HTTPEngineClient(target.base_url, name)
    kind = type(target).__name__
    if kind == "ActorHandle":
        return RayActorClient(target, name)
    if kind == "AsyncLLM" or asyncio.iscoroutinefunction(getattr(target, "start_weight_update", None)):
        if loop is None or loop.is_closed():
            raise ConfigurationError(
                f"{name} is an {kind}, whose calls run on its event loop: give VLLMEngines(..., loop=<that loop>) "
                "(it must be running, in another thread than the one that sends)"
            )
        return AsyncLLMClient(target, name, loop)
    if "LLM" in (c.__name__ for c in type(target).__mro__) and hasattr(target, "llm_engine"):  # (a subclass too)
        return LLMClient(target, name)
    missing = [call for call in PROTOCOL if not callable(getattr(target, call, None))]
    if missing:
        raise ConfigurationError(
            f"{name} ({kind}) is not a vLLM engine or a client of one: it has no {', '.join(missing)} (give a "
            "vllm.LLM, an AsyncLLM with its loop, or an object with vLLM's trainer-side calls)"
        )
    return EngineClient(target, name)
