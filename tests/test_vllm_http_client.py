"""``HTTPEngineClient``: the trainer's client of an engine behind ``vllm serve``, on CPU without vLLM.

The server here is a small ``http.server`` on loopback that answers vLLM's RL routes as vLLM's server does
(``entrypoints/rl/online/api_router.py``, ``entrypoints/serve/dev/cache/api_router.py``) and records each request:
the routes, bodies and query strings the client sends, its errors, its bounds. Behind the server, for the
driver's test, is tests/test_vllm_driver.py's engine (weightsync's backend in this process). The same client on
a real ``vllm serve`` on another host: tests/test_vllm_hosts.py.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import weightsync as ws
from tests._vllm_engine import engine_spec
from tests._workers import build
from tests.test_vllm_driver import PausingEngine, _same, _step
from weightsync.integrations.vllm import VLLMEngines
from weightsync.integrations.vllm.engines import engine_client
from weightsync.integrations.vllm.served import QUOTED_CHARS, EngineHTTPError, HTTPEngineClient

#: How long a route told to hang holds its request at most (the tests release it sooner).
HANG_S = 30.0


@dataclass
class Call:
    route: str
    query: dict[str, str]
    body: Any


class Server:
    """vLLM's RL routes on 127.0.0.1 (a port of its own), in a thread; each request is recorded in :attr:`calls`.

    A route answers like vLLM's (``{"message": ...}``; ``/reset_prefix_cache``: ``{"success": true}``) after
    calling the same-named method of ``engine``, if one is given; ``fail[route] = (status, text)`` makes it answer
    that instead; a route in ``hang`` never answers, and one in ``trickle`` answers a byte at a time without end
    (until the server stops); one in ``forged`` answers as if it had called the engine, without calling it (a man
    in the middle of the plain-HTTP routes)."""

    CALLS = {
        "/init_weight_transfer_engine": lambda e, q, b: e.init_weight_transfer_engine(b["init_info"]),
        "/start_weight_update": lambda e, q, b: e.start_weight_update(),
        "/update_weights": lambda e, q, b: e.update_weights(b["update_info"]),
        "/finish_weight_update": lambda e, q, b: e.finish_weight_update(weight_version=b["weight_version"]),
        "/update_weight_version": lambda e, q, b: e.update_weight_version(b["new_version"]),
        "/pause": lambda e, q, b: e.pause_generation(q["mode"]),
        "/resume": lambda e, q, b: e.resume_generation(),
        "/reset_prefix_cache": lambda e, q, b: e.reset_prefix_cache(),
        "/shutdown_weight_transfer_engine": lambda e, q, b: e.shutdown_weight_transfer_engine(),
    }

    def __init__(self, engine: Any = None, prefix: str = "") -> None:
        self.engine, self.prefix = engine, prefix
        self.calls: list[Call] = []
        self.fail: dict[str, tuple[int, str]] = {}
        self.hang: set[str] = set()
        self.trickle: set[str] = set()
        self.answers: dict[str, Any] = {}
        self.forged: set[str] = set()
        self.released = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                parts = urllib.parse.urlsplit(self.path)
                route = parts.path.removeprefix(server.prefix)
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw) if raw else None
                server.calls.append(Call(route, dict(urllib.parse.parse_qsl(parts.query)), body))
                if route in server.hang:
                    server.released.wait(HANG_S)
                    return
                if route in server.trickle:  # a header one byte at a time, each well within a socket timeout
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                    while not server.released.wait(0.05):
                        self.wfile.write(b"a")
                        self.wfile.flush()
                    return
                status, answer = server.fail.get(route) or server._answer(route, parts.query, body)
                data = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
                self.send_response(status)
                if status in (301, 302, 307, 308):
                    self.send_header("Location", "http://127.0.0.1:1/elsewhere")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}{prefix}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), name="vllm-routes", daemon=True)
        self.thread.start()

    def _answer(self, route: str, query: str, body: Any) -> tuple[int, Any]:
        if route not in self.CALLS:
            return 404, {"detail": "Not Found"}
        if self.engine is not None and route not in self.forged:
            try:
                self.CALLS[route](self.engine, dict(urllib.parse.parse_qsl(query)), body)
            except Exception as exc:  # vLLM's server answers a failed call with a 500
                return 500, {"error": f"{type(exc).__name__}: {exc}"}
        if route in self.answers:
            return 200, self.answers[route]
        return 200, {"success": True} if route == "/reset_prefix_cache" else {"message": "ok"}

    def routes(self) -> list[str]:
        return [c.route for c in self.calls]

    def stop(self) -> None:
        self.released.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


@pytest.fixture
def server():
    s = Server()
    yield s
    s.stop()


def test_each_call_is_vllms_route_with_its_body_and_query(server):
    client = HTTPEngineClient(server.url + "/", "engine 0")
    init_info = {"receiver": {"scheme": "distributed", "connection": {"authkey_file": "/k"}}}
    client.init(init_info, 5)
    client.set_version("0", 5)
    client.start(5)
    client.pause("keep", 5)
    client.update({"version": 3}, 5)
    client.finish("3", 5)
    client.resume(5)
    client.reset_prefix_cache(5)
    client.shutdown(5)
    assert [(c.route, c.query, c.body) for c in server.calls] == [
        ("/init_weight_transfer_engine", {}, {"init_info": init_info}),
        ("/update_weight_version", {}, {"new_version": "0"}),
        ("/start_weight_update", {}, None),
        ("/pause", {"mode": "keep", "clear_cache": "true"}, None),
        ("/update_weights", {}, {"update_info": {"version": 3}}),
        ("/finish_weight_update", {}, {"weight_version": "3"}),
        ("/resume", {}, None),
        ("/reset_prefix_cache", {"reset_running_requests": "true"}, None),
        ("/shutdown_weight_transfer_engine", {}, None),
    ]
    assert client.pauses and client.url == server.url


@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
def test_each_pause_mode_is_the_query_vllm_reads(server, mode):
    HTTPEngineClient(server.url, "engine 0").pause(mode, 5)
    assert server.calls[-1].query == {"mode": mode, "clear_cache": "true"}


def test_a_path_prefix_is_kept_before_each_route():
    prefixed = Server(prefix="/engines/a")
    try:
        HTTPEngineClient(prefixed.url, "engine 0").start(5)
        assert prefixed.routes() == ["/start_weight_update"] and prefixed.url.endswith("/engines/a")
    finally:
        prefixed.stop()


@pytest.mark.parametrize(
    "status, text, match",
    [
        (500, '{"error": "ValueError: update_info version must be an int >= 0"}', "500.*update_info version"),
        (400, '{"detail": "Field required"}', "400.*Field required"),
        (404, "", r"404.*\(no body\)"),  # a server run without VLLM_SERVER_DEV_MODE has no such route
        (307, "", "307"),  # not followed
    ],
)
def test_an_error_status_is_raised_with_the_route_and_the_servers_answer(server, status, text, match):
    server.fail["/update_weights"] = (status, text)
    with pytest.raises(EngineHTTPError, match=f"engine 0: POST /update_weights at {server.url} answered {match}") as e:
        HTTPEngineClient(server.url, "engine 0").update({"version": 1}, 5)
    assert e.value.status == status and e.value.route == "/update_weights" and e.value.body == text
    assert server.routes() == ["/update_weights"]


def test_a_long_error_answer_is_quoted_cut_short(server):
    server.fail["/init_weight_transfer_engine"] = (500, "x" * 100_000)
    with pytest.raises(EngineHTTPError) as e:
        HTTPEngineClient(server.url, "engine 0").init({}, 5)
    assert len(e.value.body) == QUOTED_CHARS and e.value.body.endswith("...")
    assert len(str(e.value)) < QUOTED_CHARS + 200


def test_a_servers_answer_is_quoted_as_data_and_one_nested_past_the_parsers_depth_is_not_json(server):
    """What a server says goes into errors and logs: its line breaks and terminal escapes are escaped there (a
    forged log line, a line erased), kept as they came in ``body``. An answer of 200,000 nested brackets is not
    JSON to the client (``RecursionError`` escaped it before)."""
    forged = "x\n2026-01-01 00:00:00 INFO weightsync: version 7 served by every engine\x1b[2K\x1b[1A"
    server.fail["/update_weights"] = (500, forged)
    with pytest.raises(EngineHTTPError) as e:
        HTTPEngineClient(server.url, "engine 0").update({"version": 1}, 5)
    assert "\n" not in str(e.value) and "\x1b" not in str(e.value) and "\\n2026-01-01" in str(e.value)
    assert e.value.body == forged
    server.answers["/start_weight_update"] = "[" * 200_000
    HTTPEngineClient(server.url, "engine 0").start(5)  # (its answer is not read: a 200 is what it says)
    server.answers["/reset_prefix_cache"] = "[" * 200_000
    with pytest.raises(RuntimeError, match="did not reset its prefix cache .it answered None"):
        HTTPEngineClient(server.url, "engine 0").reset_prefix_cache(5)


def test_a_host_name_that_takes_long_to_resolve_is_a_named_timeout_within_the_calls_timeout(monkeypatch):
    """The resolver's wait has no bound of its own: the call's timeout bounds it too (it took the resolver's
    whole time before)."""
    resolve, answered = socket.getaddrinfo, threading.Event()

    def slow(host, *args, **kwargs):
        if host == "engine-b.internal":
            answered.wait(30)  # (until the test is done with it)
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    started = time.monotonic()
    with pytest.raises(ws.SyncTimeoutError, match="engine 0: POST /start_weight_update .* within 1s"):
        HTTPEngineClient("http://engine-b.internal:8000", "engine 0").start(1.0)
    assert time.monotonic() - started < 2.5
    answered.set()
    for thread in threading.enumerate():  # (nothing interrupts a resolver: its thread ends when it answers)
        if thread.name == "weightsync-resolve":
            thread.join(10)


def test_a_prefix_cache_the_server_did_not_reset_is_an_error(server):
    server.answers["/reset_prefix_cache"] = {"success": False}
    with pytest.raises(RuntimeError, match="engine 0: the server at .* did not reset its prefix cache.*False"):
        HTTPEngineClient(server.url, "engine 0").reset_prefix_cache(5)


def test_a_server_that_never_answers_is_a_named_timeout_within_the_calls_timeout(server):
    server.hang.add("/update_weights")
    client = HTTPEngineClient(server.url, "engine 3")
    started = time.monotonic()
    with pytest.raises(ws.SyncTimeoutError, match="engine 3: POST /update_weights .* did not return within 0.5s"):
        client.update({"version": 1}, 0.5)
    assert 0.4 < time.monotonic() - started < 3


def test_a_server_that_answers_a_byte_at_a_time_is_cut_off_at_the_calls_timeout(server):
    server.trickle.add("/pause")
    started = time.monotonic()
    with pytest.raises(ws.SyncTimeoutError, match="engine 0: POST /pause .* did not return within 1s"):
        HTTPEngineClient(server.url, "engine 0").pause("keep", 1.0)
    assert 0.9 < time.monotonic() - started < 3


def test_nothing_listening_at_the_url_is_a_connection_error_naming_it():
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=f"engine 0: nothing answers at {url} .*refused.*vllm serve"):
        HTTPEngineClient(url, "engine 0").start(5)
    assert time.monotonic() - started < 3


def test_proxies_from_the_environment_are_not_used(server, monkeypatch):
    """The routes carry the receiver config: they go straight to the engine, never through a proxy."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # (discard: a proxy there would fail every call)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    HTTPEngineClient(server.url, "engine 0").resume(5)
    assert server.routes() == ["/resume"]


@pytest.mark.parametrize(
    "url",
    [
        "localhost:8000",
        "ftp://host:8000",
        "http://",
        "http://:8000",
        "http://host:99999",
        "http://host:port",
        "http://host:8000/?debug=1",
        "http://host:8000/#top",
        "http://host:8000/?",
        "http://user:secret@host:8000",
        "http://host :8000",
        "http://host:8000\n",
        "",
    ],
)
def test_a_url_that_is_not_a_servers_is_refused_when_the_client_is_made(url):
    with pytest.raises(ws.ConfigurationError, match="engine 0: .*give the server's base URL"):
        HTTPEngineClient(url, "engine 0")


def test_engine_client_takes_a_url_and_vllms_http_client_as_an_http_engine_client():
    direct = engine_client("https://10.0.0.2:8000/", "engine 0")
    assert type(direct) is HTTPEngineClient and direct.url == "https://10.0.0.2:8000" and direct.pauses

    class HTTPVLLMWeightSyncClient:  # vLLM's (distributed/weight_transfer/clients.py): the routes, no pause, no reset
        def __init__(self, base_url: str, timeout: float = 300) -> None:
            self.base_url, self.timeout = base_url.rstrip("/"), timeout

        def init_weight_transfer_engine(self, init_info: dict) -> None: ...
        def start_weight_update(self) -> None: ...
        def update_weights(self, update_info: dict) -> None: ...
        def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    theirs = engine_client(HTTPVLLMWeightSyncClient("http://10.0.0.2:8000"), "engine 1")
    assert type(theirs) is HTTPEngineClient and theirs.url == "http://10.0.0.2:8000" and theirs.name == "engine 1"
    with pytest.raises(ws.ConfigurationError, match="engine 2: 'http://10.0.0.2:8000/x\\?y=1' has a query"):
        engine_client(HTTPVLLMWeightSyncClient("http://10.0.0.2:8000/x?y=1"), "engine 2")
    with pytest.raises(ws.ConfigurationError, match="vLLM engine 0: 'not a url' is not a URL"):
        VLLMEngines(["not a url"])


def test_engines_behind_two_servers_are_driven_in_vllms_order_for_each_version():
    """Two servers, each in front of an engine with weightsync's backend, given to VLLMEngines by their URLs: per
    version each gets start, pause, update and finish, then resume, and serves the trainer's weights when send()
    returns. (Not paused, in mode "none", they are refused: their requests in flight would compute with a mix of
    two versions.)"""
    model = build("tiny")
    engines = [PausingEngine(engine_spec(model)), PausingEngine(engine_spec(model))]
    servers = [Server(engine) for engine in engines]
    with pytest.raises(ws.ConfigurationError, match="pause_mode='none' would load each version into vLLM engine 0"):
        VLLMEngines([s.url for s in servers], pause_mode="none")
    scheme = ws.MultiProcessWeightSyncScheme(timeout=10, connect_timeout=30)
    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([s.url for s in servers], pause_mode="keep"))
        scheme.connect()
        for version in (1, 2, 3):
            _step(model, version)
            scheme.send()
            assert all(e.version == str(version) and _same(e, model) for e in engines)
    finally:
        scheme.shutdown()
        for server in servers:
            server.stop()
    # (not paused at its init, the engine is resumed after it: one a trainer that died in an update left paused)
    joined = ["/pause", "/init_weight_transfer_engine", "/update_weight_version", "/resume"]
    each = ["/start_weight_update", "/pause", "/update_weights", "/finish_weight_update", "/resume"]
    wanted = [*joined, *each * 3, "/shutdown_weight_transfer_engine"]
    for server in servers:
        assert server.routes() == wanted
        bodies = [c.body for c in server.calls if c.route in ("/update_weights", "/finish_weight_update")]
        assert bodies == [b for v in (1, 2, 3) for b in ({"update_info": {"version": v}}, {"weight_version": str(v)})]
        assert all(c.query == {"mode": "keep", "clear_cache": "true"} for c in server.calls if c.route == "/pause")


def test_a_version_is_served_when_the_engines_receiver_acked_it_not_when_its_routes_answered():
    """Whoever answers the plain-HTTP routes is not the engine's receiver: a man in the middle answering start,
    update and finish with 200 without passing them on makes the send time out naming the engine, the version not
    acked. (Before, the calls' answers stood for the receiver's ack, and send() returned at once.)"""
    model = build("tiny")
    engine = PausingEngine(engine_spec(model))
    server = Server(engine)
    scheme = ws.MultiProcessWeightSyncScheme(timeout=3, connect_timeout=30)
    try:
        scheme.init_on_sender(model=model, context=VLLMEngines([server.url], pause_mode="keep"))
        scheme.connect()
        server.forged = {"/start_weight_update", "/update_weights", "/finish_weight_update"}
        _step(model, 1)
        with pytest.raises(ws.SyncTimeoutError, match=r"worker 0, version 1\] no ack for version 1"):
            scheme.send()
        assert scheme.acked_versions == {0: 0} and engine.version == "0" and not _same(engine, model)
        server.forged = set()
        _step(model, 2)
        scheme.send()
        assert scheme.acked_versions == {0: 2} and engine.version == "2" and _same(engine, model)
    finally:
        scheme.shutdown()
        server.stop()
