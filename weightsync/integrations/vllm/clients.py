"""How the trainer drives one vLLM engine's weight updates: through the engine's own control calls.

vLLM's weight-transfer interface is driven from outside the engine: ``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update`` (the calls of vLLM's trainer-side protocol,
``VLLMWeightSyncClient``), plus, where the engine serves requests while it is updated, ``pause_generation`` and
``resume_generation``. An :class:`EngineClient` makes the trainer's calls the same whatever holds the engine: a
``vllm.LLM``, a ``vllm.v1.engine.async_llm.AsyncLLM`` running on an event loop, an engine behind ``vllm serve``
on this host or another (its URL, ``"http://host:8000"``, or vLLM's ``HTTPVLLMWeightSyncClient``: its RL routes,
through :class:`HTTPEngineClient`), a Ray actor holding an engine (its handle, :class:`RayActorClient`), or any
object with vLLM's four calls (vLLM's ``RayVLLMWeightSyncClient``, or a
client of your own). Nothing here imports vLLM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import socket
import ssl
import threading
import time
import urllib.parse
from typing import Any

from ... import checks
from ...errors import ConfigurationError, SyncTimeoutError, WorkerDiedError

__all__ = [
    "PAUSE_MODES",
    "EngineClient",
    "EngineHTTPError",
    "HTTPEngineClient",
    "RayActorClient",
    "engine_client",
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

    def __init__(self, target: Any, name: str) -> None:
        self.target, self.name = target, name

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

    def finish(self, version: str, timeout: float) -> None:
        self.target.finish_weight_update(weight_version=version)

    def set_version(self, version: str, timeout: float) -> None:
        """Say which version the engine serves, outside an update (after the initial version)."""
        setter = getattr(self.target, "update_weight_version", None)
        if setter is not None:
            setter(version)

    def reset_prefix_cache(self, timeout: float) -> None:
        """Forget every cached prefix (its keys and values were computed with the previous weights)."""
        reset = getattr(self.target, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    def pause(self, mode: str, timeout: float) -> None:
        """Stop generating (``mode``: what requests in flight do, :data:`PAUSE_MODES`); clears the prefix cache."""

    def resume(self, timeout: float) -> None:
        """Generate again."""

    def shutdown(self, timeout: float) -> None:
        """Let the engine's weightsync receiver go (the engine goes on serving)."""
        stop = getattr(self.target, "shutdown_weight_transfer_engine", None)
        if stop is not None:
            stop()


class LLMClient(EngineClient):
    """A ``vllm.LLM``: synchronous calls, in the trainer's thread or another one, between ``generate`` calls (an
    ``LLM`` has no pause: drive its updates and its generation from one loop)."""

    def init(self, init_info: dict[str, Any], timeout: float) -> None:
        self.target.init_weight_transfer_engine({"init_info": init_info})

    def update(self, update_info: dict[str, Any], timeout: float) -> None:
        self.target.update_weights({"update_info": update_info})


class AsyncLLMClient(EngineClient):
    """A ``vllm`` ``AsyncLLM``, which runs on the event loop ``loop`` (another thread's): each call is scheduled there
    and waited for, at most ``timeout``."""

    pauses = True

    def __init__(self, target: Any, name: str, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(target, name)
        self.loop = loop

    def _run(self, call: Any, timeout: float, what: str) -> Any:
        future = asyncio.run_coroutine_threadsafe(call, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise SyncTimeoutError(f"{self.name}: {what} did not return within {timeout:.1f}s") from None

    def init(self, init_info: dict[str, Any], timeout: float) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.target.init_weight_transfer_engine(WeightTransferInitRequest(init_info)), timeout, "init")

    def start(self, timeout: float) -> None:
        self._run(self.target.start_weight_update(), timeout, "start_weight_update")

    def update(self, update_info: dict[str, Any], timeout: float) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.target.update_weights(WeightTransferUpdateRequest(update_info)), timeout, "update_weights")

    def finish(self, version: str, timeout: float) -> None:
        self._run(self.target.finish_weight_update(weight_version=version), timeout, "finish_weight_update")

    def set_version(self, version: str, timeout: float) -> None:
        self._run(self.target.update_weight_version(version), timeout, "update_weight_version")

    def reset_prefix_cache(self, timeout: float) -> None:
        self._run(self.target.reset_prefix_cache(), timeout, "reset_prefix_cache")

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

    def shutdown(self, timeout: float) -> None:
        self._run(self.target.shutdown_weight_transfer_engine(), timeout, "shutdown_weight_transfer_engine")


#: How much of a server's error answer an error quotes (characters), and how much of any answer is read (bytes).
QUOTED_CHARS = 2000
READ_BYTES = 1 << 20


class EngineHTTPError(RuntimeError):
    """A route of ``vllm serve`` answered with an error status.

    Attributes:
        route: the route called (``"/update_weights"``).
        status: the HTTP status.
        body: the start of the server's answer (at most :data:`QUOTED_CHARS` characters).
    """

    def __init__(self, message: str, route: str, status: int, body: str) -> None:
        super().__init__(message)
        self.route, self.status, self.body = route, status, body


class HTTPEngineClient(EngineClient):
    """An engine served by ``vllm serve``, on this host or another, through vLLM's RL routes, which the server
    mounts when it runs with ``VLLM_SERVER_DEV_MODE=1``: ``/init_weight_transfer_engine``,
    ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/update_weight_version``,
    ``/pause``, ``/resume``, ``/reset_prefix_cache``, ``/shutdown_weight_transfer_engine``. Each call is one POST
    that returns when the server answered. No proxy is used (the routes belong on the trainer's network, never
    past it: whoever reaches them can drive the engine's updates) and a redirect is not followed.

    Args:
        url: the server's base URL, ``http://host:port`` (or ``https://``; a path prefix is kept).
        name: the engine's name in errors.

    Raises:
        ConfigurationError: ``url`` is not an http(s) URL with a host (checked here, before any call).

    Each call raises:
        EngineHTTPError: the server answered with an error status (the route, the status and the start of its
            answer named).
        SyncTimeoutError: the server did not answer within the call's ``timeout`` (which bounds the whole call:
            a server that answers a byte at a time is cut off too).
        ConnectionError: nothing answers at the URL (refused, unreachable, an unknown host), or the server broke
            the connection off.
    """

    pauses = True

    def __init__(self, url: str, name: str) -> None:
        self.url = _server_url(url, name)
        super().__init__(self.url, name)
        parts = urllib.parse.urlsplit(self.url)
        self._host, self._port, self._path = str(parts.hostname), parts.port, parts.path
        self._tls = ssl.create_default_context() if parts.scheme == "https" else None

    def _post(self, route: str, timeout: float, body: dict[str, Any] | None = None, **query: str) -> Any:
        """POST ``body`` (as JSON) to ``route`` with ``query``, within ``timeout``; the server's answer, parsed
        (``None`` if it is not JSON)."""
        path = self._path + route + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = b"" if body is None else json.dumps(body).encode()
        deadline = time.monotonic() + timeout
        conn = (
            http.client.HTTPSConnection(self._host, self._port, timeout=timeout, context=self._tls)
            if self._tls is not None
            else http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        )
        try:
            try:
                conn.connect()
            except TimeoutError:
                raise self._timed_out(route, timeout) from None
            except OSError as exc:
                raise ConnectionError(
                    f"{self.name}: nothing answers at {self.url} ({exc}): is `vllm serve` running there, and "
                    "reachable from this host?"
                ) from None
            # The socket's timeout bounds each wait on it; a server answering a byte at a time is cut off at the
            # deadline.
            cut = threading.Event()
            cutoff = threading.Timer(max(0.0, deadline - time.monotonic()), _cut, (conn.sock, cut))
            cutoff.name, cutoff.daemon = "weightsync-vllm-http-deadline", True
            cutoff.start()
            try:
                conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                answer = response.read(READ_BYTES)
                if cut.is_set():  # (what was read before the cut may even parse: it is not the server's answer)
                    raise self._timed_out(route, timeout)
            except (OSError, http.client.HTTPException) as exc:
                if isinstance(exc, TimeoutError) or cut.is_set():
                    raise self._timed_out(route, timeout) from None
                raise ConnectionError(
                    f"{self.name}: the server at {self.url} broke off POST {route}: {exc!r}"
                ) from None
            finally:
                cutoff.cancel()
                cutoff.join()
        finally:
            conn.close()
        if not 200 <= response.status < 300:  # (a redirect too: it would send the call elsewhere)
            text = answer[: 4 * QUOTED_CHARS].decode("utf-8", "replace")
            text = text if len(text) <= QUOTED_CHARS else text[: QUOTED_CHARS - 3] + "..."
            raise EngineHTTPError(
                f"{self.name}: POST {route} at {self.url} answered {response.status} {response.reason[:80]}: "
                f"{text or '(no body)'}",
                route,
                response.status,
                text,
            )
        try:
            return json.loads(answer)
        except ValueError:
            return None

    def _timed_out(self, route: str, timeout: float) -> SyncTimeoutError:
        return SyncTimeoutError(f"{self.name}: POST {route} at {self.url} did not return within {timeout:.1f}s")

    def init(self, init_info: dict[str, Any], timeout: float) -> None:
        self._post("/init_weight_transfer_engine", timeout, {"init_info": init_info})

    def start(self, timeout: float) -> None:
        self._post("/start_weight_update", timeout)

    def update(self, update_info: dict[str, Any], timeout: float) -> None:
        self._post("/update_weights", timeout, {"update_info": update_info})

    def finish(self, version: str, timeout: float) -> None:
        self._post("/finish_weight_update", timeout, {"weight_version": version})

    def set_version(self, version: str, timeout: float) -> None:
        self._post("/update_weight_version", timeout, {"new_version": version})

    def reset_prefix_cache(self, timeout: float) -> None:
        """Forget every cached prefix, the running requests' too (they are computed again, with the new weights):
        without them the reset fails while any request runs."""
        answer = self._post("/reset_prefix_cache", timeout, reset_running_requests="true")
        if not (isinstance(answer, dict) and answer.get("success") is True):
            raise RuntimeError(
                f"{self.name}: the server at {self.url} did not reset its prefix cache (it answered "
                f"{checks.shown(answer)}): its cached keys and values were computed with the old weights"
            )

    def pause(self, mode: str, timeout: float) -> None:
        self._post("/pause", timeout, mode=mode, clear_cache="true")

    def resume(self, timeout: float) -> None:
        self._post("/resume", timeout)

    def shutdown(self, timeout: float) -> None:
        self._post("/shutdown_weight_transfer_engine", timeout)


def _cut(sock: socket.socket | None, cut: threading.Event) -> None:
    """End every wait on ``sock`` (its deadline passed), and say so in ``cut``."""
    cut.set()
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _server_url(url: Any, name: str) -> str:
    """``url`` without its trailing slashes, once it is an http(s) URL with a host and nothing the routes would
    be appended after (a query, a fragment) or that errors would quote (a user and password).

    Raises:
        ConfigurationError: it is not.
    """
    hint = "give the server's base URL, such as http://host:8000"
    if not isinstance(url, str) or any(c.isspace() or not c.isprintable() for c in url):
        raise ConfigurationError(f"{name}: {checks.shown(url)} is not a URL: {hint}")
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018 - read to check it (a port out of range, or not a number, raises)
    except ValueError as exc:
        raise ConfigurationError(f"{name}: {checks.shown(url)} has a bad port ({exc}): {hint}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigurationError(f"{name}: {checks.shown(url)} is not an http(s) URL with a host: {hint}")
    if "?" in url or "#" in url or "@" in parts.netloc:
        raise ConfigurationError(
            f"{name}: {checks.shown(url)} has a query, a fragment or a user name: {hint} (and a path prefix, if any)"
        )
    return url.rstrip("/")


class RayActorClient(EngineClient):
    """A Ray actor holding an engine (``ray.remote(vllm.LLM)``, or an actor class with the same methods), as vLLM's
    ``RayVLLMWeightSyncClient`` drives one: each call is ``actor.<call>.remote(...)``, waited for at most
    ``timeout``. The actor runs its calls in the order they were made, the scheme's own (Ray's updates) included.
    It pauses if the actor has ``pause_generation`` (an ``AsyncLLM``'s)."""

    def __init__(self, target: Any, name: str) -> None:
        super().__init__(target, name)
        self.pauses = _has_method(target, "pause_generation") and _has_method(target, "resume_generation")
        self._queued: tuple[dict[str, Any], Any] | None = None

    def _get(self, ref: Any, timeout: float, what: str) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref)
            raise SyncTimeoutError(f"{self.name}: {what} did not return within {timeout:.1f}s") from None
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
        self._queued = (init_info, self.target.init_weight_transfer_engine.remote(_request("init", init_info)))

    def init(self, init_info: dict[str, Any], timeout: float) -> None:
        queued, self._queued = self._queued, None
        if queued is not None and queued[0] is init_info:
            self._get(queued[1], timeout, "init_weight_transfer_engine")
        else:
            self._call("init_weight_transfer_engine", timeout, _request("init", init_info))

    def start(self, timeout: float) -> None:
        self._call("start_weight_update", timeout)

    def update(self, update_info: dict[str, Any], timeout: float) -> None:
        self._call("update_weights", timeout, _request("update", update_info))

    def finish(self, version: str, timeout: float) -> None:
        self._call("finish_weight_update", timeout, weight_version=version)

    def set_version(self, version: str, timeout: float) -> None:
        self._call("update_weight_version", timeout, version)

    def reset_prefix_cache(self, timeout: float) -> None:
        self._call("reset_prefix_cache", timeout)

    def pause(self, mode: str, timeout: float) -> None:
        self._call("pause_generation", timeout, mode=mode, clear_cache=True)

    def resume(self, timeout: float) -> None:
        self._call("resume_generation", timeout)

    def shutdown(self, timeout: float) -> None:
        self._call("shutdown_weight_transfer_engine", timeout)


def _has_method(actor: Any, name: str) -> bool:
    try:
        getattr(actor, name)
    except AttributeError:
        return False
    return True


def _request(kind: str, info: dict[str, Any]) -> Any:
    """vLLM's request object for ``init_weight_transfer_engine`` / ``update_weights`` (what an ``AsyncLLM`` takes;
    an ``LLM`` takes it too), or its dict form where vLLM is not installed beside the trainer (an ``LLM`` takes
    that)."""
    try:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    except ImportError:
        return {f"{kind}_info": info}
    if kind == "init":
        return WeightTransferInitRequest(init_info=info)
    return WeightTransferUpdateRequest(update_info=info)


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
    if kind == "LLM" and hasattr(target, "llm_engine"):
        return LLMClient(target, name)
    missing = [call for call in PROTOCOL if not callable(getattr(target, call, None))]
    if missing:
        raise ConfigurationError(
            f"{name} ({kind}) is not a vLLM engine or a client of one: it has no {', '.join(missing)} (give a "
            "vllm.LLM, an AsyncLLM with its loop, or an object with vLLM's trainer-side calls)"
        )
    return EngineClient(target, name)
