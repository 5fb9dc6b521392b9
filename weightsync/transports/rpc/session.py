"""This process's ``torch.distributed.rpc`` world: one agent per process, shared by its RPC schemes.

Every RPC scheme of a process shares one *session*: the world of the sender
(``weightsync-trainer``, rank 0) and its workers (``weightsync-worker-<i>``,
rank ``i + 1``), formed over a TCP store the sender serves on
``master_addr:master_port``. A user who already runs RPC passes
``worker_names=`` and the scheme uses that agent as it is.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist
import torch.distributed.rpc as rpc

from ...core.timing import WAIT_TICK_S, Progress, deadline_after, shown_seconds, wait_until
from ...errors import ConfigurationError, SyncTimeoutError, first_line
from ..network import interface_for, local_address
from ..store import open_store, store_read
from ..storeclient import Probe, dial_store

__all__ = [
    "SENDER_NAME",
    "Session",
    "agent_running",
    "default_worker_name",
    "forget_ended",
    "join_worker_session",
    "leave_session",
    "open_sender_session",
    "say_ended",
    "sender_gone",
    "sender_said",
    "session",
    "start_agent",
]

log = logging.getLogger("weightsync.transports.rpc")
#: The scheme of the rendezvous URL this module hands ``init_rpc``.
RENDEZVOUS_SCHEME = "weightsync"

SENDER_NAME = "weightsync-trainer"
#: The TensorPipe transports of an agent weightsync starts (:func:`backend_options`).
TRANSPORTS = ["uv"]
#: Seconds a clean shutdown waits for the other processes of the RPC world to shut down too (each of the barrier's
#: two halves). 3 s was too short once in CI, on 2 cores under load: the trainer stopped on its own and a worker's
#: agent logged the connection it closed.
GRACEFUL_S = 5.0
#: Seconds a worker leaving its RPC world gives a check of its sender's store that is out to come back.
PROBE_SETTLE_S = 1.0


def default_worker_name(worker_idx: int) -> str:
    return f"weightsync-worker-{worker_idx}"


# ------------------------------------------------------------------ sessions
_SESSION_LOCK = threading.Lock()
_STORES: dict[str, dist.Store] = {}  # rendezvous token -> the store init_rpc is to use


def _rendezvous(url: Any, **kwargs: Any):
    """``weightsync://<token>``: hand init_rpc the store this process already opened for that session."""
    token = urlparse(url).netloc
    store = _STORES.get(token)
    if store is None:
        raise ConfigurationError(f"no weightsync RPC session {token!r} in this process")
    yield store, kwargs.get("rank", -1), kwargs.get("world_size", -1)


_handler_registered = False


def _register_handler() -> None:
    """Teach ``init_rpc`` our rendezvous URLs, once, on first use (never at import: nothing happens at import)."""
    global _handler_registered
    from torch.distributed.rendezvous import _rendezvous_handlers, register_rendezvous_handler

    if not _handler_registered and RENDEZVOUS_SCHEME not in _rendezvous_handlers:
        register_rendezvous_handler(RENDEZVOUS_SCHEME, _rendezvous)
    _handler_registered = True


@dataclass
class Session:
    """This process's RPC world, shared by its RPC schemes."""

    token: str
    host: str
    port: int
    world_size: int
    counter: int  # init_rpc's prefix counter on the sender; workers must use the same
    store: dist.Store | None = None
    started: bool = False
    owned: bool = True  # weightsync started the agent (and stops it)
    users: int = 0
    pid: int = field(default_factory=os.getpid)  # the process it belongs to (a forked child inherits a copy)
    clean: bool = True  # every scheme that left it so far left cleanly (the whole world is shutting down)
    environment: dict[str, str | None] = field(default_factory=dict)  # variables set for the agent: old values
    probe: Probe | None = None  # a worker's: does its sender's store still answer?


_SESSION: Session | None = None
# torch.distributed.rpc cannot be started twice in one process (pytorch/pytorch#46491): once the
# agent stopped, this process may not host another RPC world.
_SPENT = False
_ONCE = (
    "torch.distributed.rpc can run once per process (pytorch/pytorch#46491) and this process already ran "
    "an RPC world; start the next one in a new process"
)


def session() -> Session | None:
    """This process's RPC session, if any (a copy inherited through ``fork`` is not this process's)."""
    global _SESSION
    if _SESSION is not None and _SESSION.pid != os.getpid():
        _SESSION = None
    return _SESSION


def open_sender_session(master: tuple[str, int], world_size: int, timeout: float) -> Session:
    """The sender's session: a new one (store served now, agent started at connect), or the one already open."""
    import secrets

    global _SESSION
    with _SESSION_LOCK:
        current = session()
        if current is not None:
            if current.world_size != world_size:
                raise ConfigurationError(
                    f"this process already runs an RPC world of {current.world_size - 1} workers; every RPC scheme "
                    f"of a process shares it (got num_workers={world_size - 1})"
                )
            current.users += 1
            return current
        if _SPENT:
            raise ConfigurationError(_ONCE)
        if rpc.is_available() and agent_running():
            raise ConfigurationError(
                "RPC is already initialized in this process: pass worker_names= (the RPC names of the workers) "
                "to init_on_sender to use that agent"
            )
        store, (host, port), _ = open_store(master[0], master[1], timeout)  # (an IP: workers dial it)
        _SESSION = Session(secrets.token_hex(8), host, port, world_size, _init_counter(), store, users=1)
        return _SESSION


def join_worker_session(handoff: dict[str, Any], timeout: float, silence: float, **where: Any) -> Session:
    """A worker's session, from what its sender handed it (shared with its other RPC schemes); ``silence``: how
    long its store may leave a call unanswered before the sender counts as gone (:func:`sender_gone`)."""
    global _SESSION
    with _SESSION_LOCK:
        current = session()
        if current is not None:
            if current.token != handoff["token"]:
                raise ConfigurationError(
                    "this process already belongs to another RPC world; one process joins one sender", **where
                )
            current.users += 1
            return current
        if _SPENT:
            raise ConfigurationError(_ONCE, **where)
        store, hangup = dial_store(handoff["master_addr"], int(handoff["master_port"]), timeout, silence, **where)
        _SESSION = Session(
            handoff["token"],
            handoff["master_addr"],
            int(handoff["master_port"]),
            int(handoff["world_size"]),
            int(handoff["counter"]),
            store,
            users=1,
            probe=_Listening(store, hangup, "weightsync-rpc-probe"),
        )
        return _SESSION


#: What a sender's rendez-vous calls while it waits, with a function naming the workers there so far.
Waiting = Callable[[Callable[[], list[int]]], None]


def start_agent(
    sess: Session, name: str, rank: int, timeout: float, waiting: Waiting | None = None, **where: Any
) -> None:
    """Start this process's agent for ``sess`` once (blocks until the whole world joined, at most ``timeout``;
    ``waiting(joined)`` is called meanwhile, with the workers there so far: the sender core's
    :meth:`~weightsync.core.engine.Sink.waiting`)."""
    global _SPENT
    with _SESSION_LOCK:
        if sess.started:
            return
        store = sess.store
        assert store is not None
        if int(store.add(f"weightsync-joined/{rank}", 1)) > 1:
            raise ConfigurationError(
                f"{name} already joined this RPC world once, and torch.distributed.rpc cannot take a rank back "
                "into a running world (its membership is fixed when it forms): restart the trainer with its "
                "workers, or use a scheme whose workers can rejoin (multiprocess, shared_mem, distributed, ray)",
                **where,
            )
        _await_world(sess, store, timeout, waiting, **where)
        _register_handler()
        _STORES[sess.token] = store
        try:
            # init_rpc prefixes its keys with a per-process counter: both sides must use the sender's.
            with rpc._init_counter_lock:
                rpc._init_counter = sess.counter
            options = backend_options(f"{RENDEZVOUS_SCHEME}://{sess.token}", timeout)
            # TensorPipe, and the gloo group init_rpc forms for itself, listen on the address the host name
            # resolves to, unless told an interface: name the one that reaches the sender (loopback for a local
            # sender), so a single-host run stays on 127.0.0.1 and a worker on another host is reachable.
            ifname = os.environ.get("TP_SOCKET_IFNAME") or interface_for(local_address(sess.host))
            gloo_ifname = os.environ.get("GLOO_SOCKET_IFNAME") or ifname
            # Both are read when the agent starts, and set until it stopped: changing the environment while
            # the agent's threads run (a peer's call may start a process: exec reads the environment as another
            # thread shifts it) is a race that C's setenv does not survive.
            sess.environment = _set_environment(TP_SOCKET_IFNAME=ifname, GLOO_SOCKET_IFNAME=gloo_ifname)
            with warnings.catch_warnings(), _group_timeout(timeout):
                warnings.simplefilter("ignore")  # init_rpc's own use of a gloo group warns about torch internals
                rpc.init_rpc(name, rank=rank, world_size=sess.world_size, rpc_backend_options=options)
        except RuntimeError as exc:
            if agent_running():  # (it started, and the world did not form: nobody would stop it)
                _stop_agent(sess)
                _SPENT = True
            _restore_environment(sess)
            raise SyncTimeoutError(
                f"the RPC world ({sess.world_size} processes) did not form within {shown_seconds(timeout)}: "
                f"{first_line(exc)}",
                **where,
            ) from None
        finally:
            _STORES.pop(sess.token, None)
        sess.started = True


@contextlib.contextmanager
def _group_timeout(seconds: float) -> Any:
    """Bound the gloo group ``init_rpc`` forms for itself by ``seconds``: its timeout is torch's
    ``DEFAULT_PROCESS_GROUP_TIMEOUT`` (about 24.8 days), read when it forms, and a process that joined the store and
    then died held the others there that long. (Under ``_SESSION_LOCK``: one agent starts at a time. A torch
    without the constant keeps its own.)"""
    constants: Any = getattr(rpc, "constants", None)
    default = getattr(constants, "DEFAULT_PROCESS_GROUP_TIMEOUT", None)
    if not isinstance(default, datetime.timedelta):
        yield
        return
    constants.DEFAULT_PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=max(seconds, 1.0))
    try:
        yield
    finally:
        constants.DEFAULT_PROCESS_GROUP_TIMEOUT = default


def backend_options(init_method: str, timeout: float) -> rpc.TensorPipeRpcBackendOptions:
    """TensorPipe's options for an agent weightsync starts: its TCP transport (``uv``) alone. TensorPipe's
    shared-memory transport polls its rings on a thread that never sleeps: each process of the world would keep a
    core busy for as long as it lives (measured: 3.0 s of CPU in 3 s idle, none with ``uv`` alone), which on a
    trainer's host takes a core from the training and from the sends. Tensors between processes of one host still
    go through TensorPipe's cross-process copy (its ``cma`` channel) where the host allows it. (``_transports`` is
    an argument of torch's since 1.8, underscored: without it, torch's default.)"""
    try:
        return rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=timeout, _transports=TRANSPORTS)
    except TypeError:  # pragma: no cover - a torch without the argument
        return rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=timeout)


def _await_world(sess: Session, store: dist.Store, timeout: float, waiting: Waiting | None, **where: Any) -> None:
    """Wait, at most ``timeout``, until every process of the world has said, in the session's ``store``, that it
    is joining (``init_rpc`` itself would wait for an absent one as long as torch's own process-group timeout, 30
    minutes)."""
    keys = [f"weightsync-joined/{rank}" for rank in range(sess.world_size)]
    deadline = deadline_after(timeout)
    progress = Progress(log, f"the RPC world of {sess.host}:{sess.port} to form", timeout, **where)

    def joined() -> list[int]:
        return [rank - 1 for rank, key in enumerate(keys) if rank > 0 and store.check([key])]

    def meanwhile() -> None:
        if waiting is not None:
            waiting(joined)
        else:  # a worker: it says what it waits for itself
            progress.tick(lambda: f"{len(joined())} of {sess.world_size - 1} workers there")

    try:
        if not wait_until(lambda: store.check(keys), deadline, WAIT_TICK_S / 5, meanwhile):
            absent = [rank for rank, key in enumerate(keys) if not store.check([key])]
            names = ["the sender" if rank == 0 else f"worker {rank - 1}" for rank in absent] or ["a process"]
            raise SyncTimeoutError(
                f"the RPC world ({sess.world_size} processes) did not form within {shown_seconds(timeout)}: "
                f"{', '.join(names)} never joined",
                **where,
            )
    except (RuntimeError, dist.DistError) as exc:
        gone = first_line(exc)
        raise SyncTimeoutError(f"the sender's store went away while the RPC world formed: {gone}", **where) from None


def _set_environment(**values: str | None) -> dict[str, str | None]:
    """Set environment variables (those given as ``None`` are left alone); return what those set were
    (``None``: unset), for :func:`_restore_environment`."""
    given = {key: value for key, value in values.items() if value is not None}
    saved = {key: os.environ.get(key) for key in given}
    os.environ.update(given)
    return saved


def _restore_environment(sess: Session) -> None:
    """Put back the variables the session set to start its agent, once no thread of the agent runs."""
    saved, sess.environment = sess.environment, {}
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


#: The longest last word of a sender a worker reads (characters).
MAX_WORD = 2000


def _ended(model_id: str | None, worker_idx: int) -> str:
    return f"weightsync-ended/{model_id}/{worker_idx}"


class _Listening(Probe):
    """A worker's probe of its sender's store that also looks, in each check, for the sender's last word to each
    of the worker's models (:func:`say_ended`)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.watched: set[str] = set()
        self.said: dict[str, str] = {}

    def _ask(self) -> None:
        super()._ask()
        for key in [k for k in list(self.watched) if k not in self.said]:
            raw = store_read(self.store, key)
            if raw is not None:
                self.said[key] = raw[: 4 * MAX_WORD].decode("utf-8", "replace")[:MAX_WORD]


def forget_ended(sess: Session, model_id: str | None, worker_idx: int) -> None:
    """A new scheme of ``model_id`` for worker ``worker_idx`` in ``sess`` (the session outlives one scheme of
    it: another keeps it): what the sender said to an earlier one is not said to it. Called by the sender's
    side as it opens (the word is deleted from the store), and by the worker's as it joins (its probe forgets
    it)."""
    key = _ended(model_id, worker_idx)
    if isinstance(sess.probe, _Listening):
        sess.probe.said.pop(key, None)
    elif sess.store is not None and sess.owned:
        with contextlib.suppress(RuntimeError, dist.DistError):
            sess.store.delete_key(key)


def say_ended(sess: Session | None, model_id: str | None, worker_idx: int, word: str) -> None:
    """Leave in the session's store (the sender's: it answers at once) why the sender serves worker ``worker_idx``
    no more (it dropped it, or shut down without its goodbye reaching it): RPC tells a process nothing of a peer no
    call of its is waiting on, and the store outlives the agent (torch keeps it), so without this word a worker
    left alive waited for versions for good (:func:`sender_said`)."""
    if sess is not None and sess.store is not None and sess.owned:
        with contextlib.suppress(RuntimeError, dist.DistError):
            sess.store.set(_ended(model_id, worker_idx), word[:MAX_WORD])


def sender_said(sess: Session, model_id: str | None, worker_idx: int) -> str | None:
    """The sender's last word to worker ``worker_idx`` of ``model_id`` (:func:`say_ended`), once a check of the
    worker's probe found it; ``None`` until then. Never blocks (asked by the probe's next check)."""
    if not isinstance(sess.probe, _Listening):
        return None
    key = _ended(model_id, worker_idx)
    sess.probe.watched.add(key)
    return sess.probe.said.get(key)


def sender_gone(sess: Session) -> str | None:
    """Why a worker's sender is out of reach (its TCP store, which lives in the sender, stopped answering),
    or ``None`` while it answers. RPC itself says nothing about a peer no call is waiting on. Never blocks: the
    store is asked on a thread of its own (:class:`~..store.Probe`), so this says what the last question found,
    and asks again."""
    return sess.probe() if sess.probe is not None else None


def leave_session(sess: Session, clean: bool = False) -> None:
    """One scheme is done with the session; the last one stops the agent and the store.

    ``clean``: the whole world is shutting down with it (the sender said goodbye to every worker, all alive; a
    worker got that goodbye). When every scheme of the session left cleanly, the agent stops with TensorPipe's
    graceful shutdown, a barrier of the world's processes, bounded by :data:`GRACEFUL_S`; else, or past that
    bound, it stops on its own. (On its own, each TensorPipe agent logs a warning for every connection the
    other end closes.)"""
    global _SESSION, _SPENT
    with _SESSION_LOCK:
        sess.users -= 1
        sess.clean = sess.clean and clean
        if sess.users > 0:
            return
        if sess.probe is not None:
            # A check still out would hold every later call on the store, the agent's barrier included: one that
            # does not come back in time (the sender stopped answering) is ended, and this process leaves without
            # that barrier. (Taken as gone at once, a check of a store that answers left the world unclean: the
            # sender waited for this process at its barrier for GRACEFUL_S, and TensorPipe logged errors.)
            sess.clean = sess.clean and sess.probe.settle(PROBE_SETTLE_S)
            sess.probe.close(GRACEFUL_S)
        if sess.started and sess.owned:
            _stop_agent(sess)
            _SPENT = True
        sess.store = None
        if _SESSION is sess:
            _SESSION = None


def _stop_agent(sess: Session) -> None:
    store = sess.store if sess.clean else None
    graceful = store is not None
    if store is not None:
        # The barrier's second half waits on the store: bound it too.
        store.set_timeout(datetime.timedelta(seconds=GRACEFUL_S))
    # If the barrier fails (a peer did not come), torch still stops this agent, on its own.
    with contextlib.suppress(RuntimeError, dist.DistError):
        rpc.shutdown(graceful=graceful, timeout=GRACEFUL_S)
    if not agent_running():
        _restore_environment(sess)


def agent_running() -> bool:
    try:
        rpc.get_worker_info()
        return True
    except RuntimeError:
        return False


def _init_counter() -> int:
    with rpc._init_counter_lock:
        return rpc._init_counter
