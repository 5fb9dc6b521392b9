"""How the trainer drives one vLLM engine's weight updates: through the engine's own control calls.

vLLM's weight-transfer interface is driven from outside the engine: ``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update`` (the calls of vLLM's trainer-side protocol,
``VLLMWeightSyncClient``), plus, where the engine serves requests while it is updated, ``pause_generation`` and
``resume_generation``. An :class:`EngineClient` makes the trainer's calls the same whatever holds the engine: a
``vllm.LLM``, a ``vllm.v1.engine.async_llm.AsyncLLM`` running on an event loop, an engine behind ``vllm serve``
on this host or another (its URL, ``"http://host:8000"``, or vLLM's ``HTTPVLLMWeightSyncClient``: its RL routes,
through :class:`~weightsync.integrations.vllm.served.HTTPEngineClient`), a Ray actor holding an engine (its
handle, :class:`RayActorClient`), or any object with vLLM's four calls (vLLM's ``RayVLLMWeightSyncClient``, or a
client of your own); :func:`~weightsync.integrations.vllm.engines.engine_client` picks the client of each.
Nothing here needs vLLM: where it is installed, vLLM's request classes are imported as a client that sends them
is made (:func:`transfer_request`), not within the trainer's ``connect``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
from typing import Any

from ...core.timing import shown_seconds
from ...errors import ConfigurationError, SyncTimeoutError, WorkerDiedError

__all__ = [
    "PAUSE_MODES",
    "PROTOCOL",
    "AsyncLLMClient",
    "EngineClient",
    "LLMClient",
    "RayActorClient",
    "transfer_request",
]

#: What happens to requests in flight while an engine loads a version (vLLM's pause modes), or ``"none"``: the
#: engine is not paused (an ``LLM`` driven between its ``generate`` calls has nothing in flight).
#: ``keep``: they are frozen and resume under the new version (their cache recomputed); ``wait``: the update
#: waits until they finished under the old one; ``abort``: they end at once (``finish_reason="abort"``).
PAUSE_MODES = ("keep", "wait", "abort", "none")

#: vLLM's trainer-side protocol: the calls every engine client has.
PROTOCOL = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


class EngineClient:
    """One engine's control calls, as the trainer makes them (each call returns when the engine did it).

    Args:
        target: what holds the engine (see :func:`engine_client`).
        name: the engine's name in errors.
    """

    #: The engine can pause and resume generation.
    pauses: bool = False
    #: :meth:`start_and_pause` sends both calls at once: the engine takes them between the same two steps.
    starts_with_pause: bool = False
    #: The calls a send makes end before that send returns, whatever it raised (a ``vllm.LLM``: its owner calls it
    #: next, from its own thread, and it takes no call beside another).
    ends_within_send: bool = False
    #: A call that outlasts its ``timeout`` ends there, whatever the engine still does (an ``AsyncLLM``'s future, an
    #: HTTP request, ``ray.get``); ``False``: it runs until the engine returns (a ``vllm.LLM``'s, or a plain object's
    #: synchronous calls, in a thread of their own).
    gives_up: bool = False

    def __init__(self, target: Any, name: str) -> None:
        self.target, self.name = target, name

    def check_caller(self) -> None:
        """Refuse a connect, send or wait made where this engine's calls cannot run meanwhile (an ``AsyncLLM``'s
        own event loop: they would each wait their whole ``timeout``).

        Raises:
            ConfigurationError: naming the engine and where to call from.
        """

    def queue_init(self, init_info: dict[str, Any]) -> None:
        """Called in the sender's thread before its scheme publishes the initial version, and before :meth:`init`
        (in another thread): a client whose engine runs its calls in the order they were made (a Ray actor) makes
        the init call here, so that it comes before the scheme's own calls into the engine."""

    def init(self, init_info: dict[str, Any], timeout: float) -> None:
        self.target.init_weight_transfer_engine(init_info)

    def start(self, timeout: float) -> None:
        self.target.start_weight_update()

    def update(self, update_info: dict[str, Any], timeout: float) -> None:
        self.target.update_weights(update_info)

    def finish(self, version: str | None, timeout: float) -> None:
        self.target.finish_weight_update(weight_version=version)

    def name_if_loaded(self, version: int, timeout: float) -> bool:
        """After an update whose calls failed here (timed out) and were ended: the engine runs a call to its end
        whatever became of its caller, so it may hold ``version`` all the same. If it does, name it so; each call
        within ``timeout``. Returns whether it held it (raises where a call failed)."""
        try:
            self.start(timeout)
        except Exception:
            # A start that timed out (behind the engine's call in progress) begins its session all the same, later:
            # ended behind it, or it would refuse every later start.
            with contextlib.suppress(Exception):
                self.finish(None, timeout)
            raise
        try:
            self.update({"version": version, "wait": False}, timeout)
        except Exception:
            self.finish(None, timeout)
            return False
        self.finish(str(version), timeout)
        return True

    def set_version(self, version: str, timeout: float) -> None:
        """Say which version the engine serves, outside an update (after the initial version)."""
        setter = getattr(self.target, "update_weight_version", None)
        if setter is not None:
            setter(version)

    def reset_prefix_cache(self, timeout: float) -> None:
        """Forget every cached prefix (its keys and values were computed with the previous weights), the running
        requests' too (they are computed again, with the new weights): without them vLLM's reset fails while a
        request runs (it returns ``False`` and logs a warning). Raises where the engine says it did not."""
        reset = getattr(self.target, "reset_prefix_cache", None)
        if reset is not None:
            kwargs = {"reset_running_requests": True} if _takes(reset, "reset_running_requests") else {}
            self._reset_done(reset(**kwargs))

    def _reset_done(self, done: Any) -> None:
        if done is False:
            raise RuntimeError(
                f"{self.name}: the engine did not reset its prefix cache: its cached keys and values were computed "
                "with the old weights"
            )

    def pause(self, mode: str, timeout: float) -> None:
        """Stop generating (``mode``: what requests in flight do, :data:`PAUSE_MODES`); clears the prefix cache."""

    def resume(self, timeout: float) -> None:
        """Generate again."""

    def start_and_pause(self, mode: str, timeout: float) -> None:
        """:meth:`start` and :meth:`pause` at once, for a client that :attr:`starts_with_pause` (the driver calls
        :meth:`start` and :meth:`pause` apart otherwise); where it raises, the engine generates, with no update
        begun."""
        raise NotImplementedError(f"{type(self).__name__} sets starts_with_pause without a start_and_pause")

    def shutdown(self, timeout: float) -> None:
        """Let the engine's weightsync receiver go (the engine goes on serving)."""
        stop = getattr(self.target, "shutdown_weight_transfer_engine", None)
        if stop is not None:
            stop()


class LLMClient(EngineClient):
    """A ``vllm.LLM``: synchronous calls, in the trainer's thread or another one, between ``generate`` calls (an
    ``LLM`` has no pause: drive its updates and its generation from one loop). It is not made for calls from two
    threads at once: a ``generate`` made while an update's call runs took that call's answer for its own, and the
    engine failed from then on. So a send, ``send_async`` included, returns only once its calls ended."""

    ends_within_send = True

    def init(self, init_info: dict[str, Any], timeout: float) -> None:
        self.target.init_weight_transfer_engine({"init_info": init_info})

    def update(self, update_info: dict[str, Any], timeout: float) -> None:
        self.target.update_weights({"update_info": update_info})


class AsyncLLMClient(EngineClient):
    """A ``vllm`` ``AsyncLLM``, which runs on the event loop ``loop`` (another thread's): each call is scheduled there
    and waited for, at most ``timeout``."""

    pauses = True
    starts_with_pause = True
    gives_up = True

    def __init__(self, target: Any, name: str, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(target, name)
        self.loop = loop
        _requests()  # (as RayActorClient's)

    def check_caller(self) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # (no loop runs in this thread)
            return
        if running is self.loop:
            raise ConfigurationError(
                f"{self.name}: called from the event loop its AsyncLLM runs on, which cannot run the engine's calls "
                "while this waits for them: connect, send and wait from another thread (in a coroutine: "
                "await asyncio.to_thread(scheme.send))"
            )

    def _run(self, call: Any, timeout: float, what: str) -> Any:
        if not self.loop.is_running():  # (scheduled there, the call would wait its whole timeout, unsaid why)
            call.close()
            raise ConfigurationError(
                f"{self.name}: the event loop given for it does not run, so its {what} cannot: run the loop its "
                "AsyncLLM was made on in a thread of its own (loop.run_forever()), and pass that loop"
            )
        future = asyncio.run_coroutine_threadsafe(call, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise SyncTimeoutError(f"{self.name}: {what} did not return within {shown_seconds(timeout)}") from None

    def init(self, init_info: dict[str, Any], timeout: float) -> None:
        self._run(self.target.init_weight_transfer_engine(transfer_request("init", init_info)), timeout, "init")

    def start(self, timeout: float) -> None:
        self._run(self.target.start_weight_update(), timeout, "start_weight_update")

    def update(self, update_info: dict[str, Any], timeout: float) -> None:
        self._run(self.target.update_weights(transfer_request("update", update_info)), timeout, "update_weights")

    def finish(self, version: str | None, timeout: float) -> None:
        self._run(self.target.finish_weight_update(weight_version=version), timeout, "finish_weight_update")

    def set_version(self, version: str, timeout: float) -> None:
        self._run(self.target.update_weight_version(version), timeout, "update_weight_version")

    def reset_prefix_cache(self, timeout: float) -> None:
        call = self.target.reset_prefix_cache(reset_running_requests=True)
        self._reset_done(self._run(call, timeout, "reset_prefix_cache"))

    def pause(self, mode: str, timeout: float) -> None:
        self._run(self._pause(mode), timeout, f"pause_generation({mode})")

    async def _pause(self, mode: str) -> None:
        """``pause_generation(mode=mode, clear_cache=True)`` without its closing 20 ms sleep, which vLLM's own
        comment says is "not required for correctness" (it lets output processing catch up for the caller's
        sake): the engine does not generate during it, and it was most of the pause's own cost. An engine
        without the calls it makes (another vLLM release) is paused through ``pause_generation`` itself."""
        core: Any = getattr(self.target, "engine_core", None)
        renderer: Any = getattr(self.target, "renderer", None)
        if not (hasattr(core, "pause_scheduler_async") and hasattr(renderer, "clear_mm_cache_async")):
            await self.target.pause_generation(mode=mode, clear_cache=True)
            return
        await renderer.clear_mm_cache_async()
        await core.pause_scheduler_async(mode=mode, clear_cache=True)

    def resume(self, timeout: float) -> None:
        self._run(self.target.resume_generation(), timeout, "resume_generation")

    def start_and_pause(self, mode: str, timeout: float) -> None:
        """Both at once: each is answered once the step the engine computes has ended (its engine core takes requests
        between two steps), so one step is waited for instead of two (about 10 ms at 40 tokens a second)."""
        self._run(self._start_and_pause(mode), timeout, f"start_weight_update and pause_generation({mode})")

    async def _start_and_pause(self, mode: str) -> None:
        both: tuple[Any, Any] = await asyncio.gather(
            self.target.start_weight_update(), self._pause(mode), return_exceptions=True
        )
        started, paused = both
        # Where one failed, the other is undone (best effort: the failure raised is the first one's), so that the
        # engine generates with no update begun, as after a start or a pause that failed alone.
        if isinstance(started, BaseException):
            if not isinstance(paused, BaseException):
                with contextlib.suppress(Exception):
                    await self.target.resume_generation()
            raise started
        if isinstance(paused, BaseException):
            with contextlib.suppress(Exception):
                await self.target.finish_weight_update(weight_version=None)
            raise paused

    def shutdown(self, timeout: float) -> None:
        self._run(self.target.shutdown_weight_transfer_engine(), timeout, "shutdown_weight_transfer_engine")


class RayActorClient(EngineClient):
    """A Ray actor holding an engine (``ray.remote(vllm.LLM)``, or an actor class with the same methods), as vLLM's
    ``RayVLLMWeightSyncClient`` drives one: each call is ``actor.<call>.remote(...)``, waited for at most
    ``timeout``. The actor runs its calls in the order they were made, the scheme's own (Ray's updates) included.
    It pauses if the actor has ``pause_generation`` (an ``AsyncLLM``'s)."""

    gives_up = True

    def __init__(self, target: Any, name: str) -> None:
        super().__init__(target, name)
        self.pauses = _has_method(target, "pause_generation") and _has_method(target, "resume_generation")
        self._queued: tuple[dict[str, Any], Any] | None = None
        _requests()  # (vLLM's import, where the trainer has none yet: seconds, here rather than in connect's time)

    def _get(self, ref: Any, timeout: float, what: str) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref)
            raise SyncTimeoutError(f"{self.name}: {what} did not return within {shown_seconds(timeout)}") from None
        except ray.exceptions.RayActorError as exc:
            raise WorkerDiedError(f"{self.name}: its actor died ({type(exc).__name__}) during {what}") from exc
        except ray.exceptions.RayTaskError as exc:  # the engine's own error, without Ray's dump of the actor
            cause = exc.cause if isinstance(exc.cause, Exception) else None
            if cause is None:
                raise
            raise cause from None

    def _call(self, call: str, timeout: float, *args: Any, **kwargs: Any) -> Any:
        return self._get(getattr(self.target, call).remote(*args, **kwargs), timeout, call)

    def queue_init(self, init_info: dict[str, Any]) -> None:
        self._queued = (init_info, self.target.init_weight_transfer_engine.remote(transfer_request("init", init_info)))

    def init(self, init_info: dict[str, Any], timeout: float) -> None:
        queued, self._queued = self._queued, None
        if queued is not None and queued[0] is init_info:
            self._get(queued[1], timeout, "init_weight_transfer_engine")
        else:
            self._call("init_weight_transfer_engine", timeout, transfer_request("init", init_info))

    def start(self, timeout: float) -> None:
        self._call("start_weight_update", timeout)

    def update(self, update_info: dict[str, Any], timeout: float) -> None:
        self._call("update_weights", timeout, transfer_request("update", update_info))

    def finish(self, version: str | None, timeout: float) -> None:
        self._call("finish_weight_update", timeout, weight_version=version)

    def set_version(self, version: str, timeout: float) -> None:
        self._call("update_weight_version", timeout, version)

    def reset_prefix_cache(self, timeout: float) -> None:
        self._reset_done(self._call("reset_prefix_cache", timeout, reset_running_requests=True))

    def pause(self, mode: str, timeout: float) -> None:
        self._call("pause_generation", timeout, mode=mode, clear_cache=True)

    def resume(self, timeout: float) -> None:
        self._call("resume_generation", timeout)

    def shutdown(self, timeout: float) -> None:
        import ray

        if ray.is_initialized():  # (Ray's own exit ran first: its calls would start a cluster anew, Ray's way)
            self._call("shutdown_weight_transfer_engine", timeout)


def _takes(call: Any, name: str) -> bool:
    """Whether ``call`` takes a keyword argument ``name`` (``False`` where its signature cannot be read)."""
    try:
        parameters = inspect.signature(call).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _has_method(actor: Any, name: str) -> bool:
    try:
        getattr(actor, name)
    except AttributeError:
        return False
    return True


def transfer_request(kind: str, info: dict[str, Any]) -> Any:
    """vLLM's request object for ``init_weight_transfer_engine`` / ``update_weights`` (what an ``AsyncLLM`` takes;
    an ``LLM`` takes it too), or its dict form where vLLM is not installed beside the trainer (an ``LLM`` takes
    that)."""
    requests = _requests()
    if requests is None:
        return {f"{kind}_info": info}
    return requests[0](init_info=info) if kind == "init" else requests[1](update_info=info)


@functools.cache
def _requests() -> tuple[Any, Any] | None:
    """vLLM's init and update request classes (``None`` where vLLM is not installed). Their module imports most of
    vLLM (its configs, ``transformers``): 4 s on 2 idle cores, 3 to 4 times that on busy ones."""
    try:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    except ImportError:
        return None
    return WeightTransferInitRequest, WeightTransferUpdateRequest
