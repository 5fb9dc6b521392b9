"""An engine behind ``vllm serve``, on this host or another, driven through vLLM's RL routes over HTTP
(:class:`HTTPEngineClient`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import ipaddress
import json
import socket
import ssl
import threading
import time
import urllib.parse
from typing import Any

from ... import checks
from ...core.timing import shown_seconds
from ...errors import ConfigurationError, SyncTimeoutError
from .calls import in_thread
from .clients import EngineClient

__all__ = ["QUOTED_CHARS", "READ_BYTES", "EngineHTTPError", "HTTPEngineClient"]

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
    gives_up = True

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
        # (the host's name resolved within the deadline too: the resolver's own wait has no bound of ours)
        conn._create_connection = lambda address, _timeout, source: self._connection(  # type: ignore[attr-defined]
            address, deadline, source
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
                f"{self.name}: POST {route} at {self.url} answered {response.status} {_quoted(response.reason[:80])}: "
                f"{_quoted(text) or '(no body)'}",
                route,
                response.status,
                text,
            )
        try:
            return json.loads(answer)
        except (ValueError, RecursionError):  # (not JSON, or nested past the parser's depth)
            return None

    def _connection(self, address: tuple[str, int], deadline: float, source: Any) -> socket.socket:
        """A connection to ``address`` by the first of its host's addresses that takes one, all before
        ``deadline``: a name (not an address) is resolved in a thread waited for until then.

        Raises:
            TimeoutError: not within the deadline. OSError: the name does not resolve, or no address answers.
        """
        host, port = address
        try:
            ipaddress.ip_address(host)
        except ValueError:  # a name: resolved below, in a thread
            pass
        else:  # an address: nothing to resolve, no thread (each call comes here)
            return socket.create_connection((host, port), max(0.001, deadline - time.monotonic()), source)
        resolving = in_thread(lambda: socket.getaddrinfo(host, port, type=socket.SOCK_STREAM), "weightsync-resolve")
        try:
            found = resolving.result(max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{host} did not resolve in time") from None
        last: OSError = OSError(f"{host} has no address")
        for *_, sockaddr in found:
            try:
                return socket.create_connection(sockaddr[:2], max(0.001, deadline - time.monotonic()), source)
            except OSError as exc:
                last = exc
        raise last

    def _timed_out(self, route: str, timeout: float) -> SyncTimeoutError:
        return SyncTimeoutError(
            f"{self.name}: POST {route} at {self.url} did not return within {shown_seconds(timeout)}"
        )

    def init(self, init_info: dict[str, Any], timeout: float) -> None:
        self._post("/init_weight_transfer_engine", timeout, {"init_info": init_info})

    def start(self, timeout: float) -> None:
        self._post("/start_weight_update", timeout)

    def update(self, update_info: dict[str, Any], timeout: float) -> None:
        self._post("/update_weights", timeout, {"update_info": update_info})

    def finish(self, version: str | None, timeout: float) -> None:
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


def _quoted(text: str) -> str:
    """``text`` with what is not printable escaped (a server's answer is quoted in errors and logs as data: a line
    break or a terminal's escape sequence in it would forge lines or colours there)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


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
