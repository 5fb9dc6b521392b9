"""TCP stores: served by the sender; what is read there is data, bounded and checked. (A worker's client of its
sender's store: :mod:`.storeclient`.)"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import threading
import weakref
from typing import Any

import torch.distributed as dist

from ..core.timing import Progress, as_timedelta, deadline_after, shown_seconds, wait_until
from ..errors import ConfigurationError, SyncTimeoutError, TransportError
from .network import addresses_of, await_listener, ip_of, store_address
from .plainjson import loads_object
from .storeclient import connect_store

__all__ = [
    "MAX_HELLO_JSON",
    "MAX_STORE_JSON",
    "SILENT_TIMEOUTS",
    "await_key",
    "open_store",
    "put_back_count",
    "store_count",
    "store_counted",
    "store_json",
    "store_read",
    "store_set",
    "store_value",
]

log = logging.getLogger("weightsync.transports.store")

#: Connections a served store queues before it accepts them (workers, rejoins, the sender's own clients).
BACKLOG = 1024
#: A worker gives up on its sender's store once a call to it has gone unanswered for this many times the scheme's
#: ``timeout``: the sender's host vanished, or the link stayed down that long.
SILENT_TIMEOUTS = 4
#: How often a worker looks for a key it waits for in its sender's store.
KEY_POLL_S = 0.02
#: The largest store value read as JSON: a layout of some 100,000 tensors. Anyone who reaches the store can
#: write its keys (it has no authentication), so what is read there is bounded and checked, never unpickled.
MAX_STORE_JSON = 16 * 1024 * 1024
#: The largest hello (or request to rejoin) read: a worker's error text (4000 characters) and its process's names.
MAX_HELLO_JSON = 64 * 1024
#: What :func:`store_json` asks the store to answer for a key that holds nothing (no JSON starts with a NUL byte).
_ABSENT = "\x00weightsync: nothing"
_ABSENT_BYTES = _ABSENT.encode()


def store_read(store: dist.Store, key: str) -> bytes | None:
    """The value under ``key`` (``None``: none), read without waiting, in one round trip. ``get`` waits for a key
    that is not there, up to the store's own timeout, holding every other call on that client behind it; and anyone
    who reaches the store may delete a key between a look for it and its read (reviews held a trainer's connect, and
    then its sends, that long so)."""
    try:
        raw = store.compare_set(key, _ABSENT, _ABSENT)  # (the value; where there is none, what it was given, unset)
    except MemoryError:  # torch's client makes room for what the answer's header claims, before any byte of it
        raise TransportError(
            f"store key {key!r}: the store's answer claims more bytes than this process can hold (a store that is "
            "not its sender's?); refusing it"
        ) from None
    return None if raw == _ABSENT_BYTES else raw


def store_value(store: dist.Store, key: str) -> bytes:
    """:func:`store_read` of a key that was seen there (or must be): TransportError where it holds nothing."""
    raw = store_read(store, key)
    if raw is None:
        raise TransportError(f"store key {key!r} holds nothing (deleted once seen); refusing it")
    return raw


def store_json(store: dist.Store, key: str, max_bytes: int = MAX_STORE_JSON) -> dict[str, Any]:
    """The JSON object stored under ``key`` (:func:`store_value`), read as data: at most ``max_bytes``, an object,
    nothing else.

    Raises:
        TransportError: no value under ``key``, or one too large, too deep, not plain JSON, or not a JSON object.
    """
    return loads_object(store_value(store, key), f"store key {key!r}", max_bytes=max_bytes)


def store_count(store: dist.Store, key: str) -> int:
    """The count under ``key`` (0 while absent), read as data: anyone who reaches the store can write there, and
    its server drops the connection of a client that adds to a value that is no number.

    Raises:
        ValueError: the value is not a count (at most 18 digits).
    """
    return store_counted(store, key)[0]


def store_counted(store: dist.Store, key: str) -> tuple[int, str]:
    """:func:`store_count`, with the value it read (``""``: none), for :func:`put_back_count`."""
    raw = store_read(store, key)
    if raw is None:
        return 0, ""
    if len(raw) > 18 or not raw.isdigit():
        raise ValueError(f"store key {key!r} holds no count")
    return int(raw), raw.decode()


def put_back_count(store: dist.Store, key: str, read: str, count: int) -> None:
    """Set the count under ``key`` to ``count`` where it still holds what was ``read`` there (:func:`store_counted`),
    in one step: a count is never added to (a word written there meanwhile would make the store's server drop this
    client), and one that moved since is left as it is."""
    store.compare_set(key, read, str(count))


def open_store(host: str, port: int, timeout: float) -> tuple[dist.Store, tuple[str, int], bool]:
    """Serve a TCP store bound to ``host:port`` (only that address: :func:`~.network.store_address`, which the
    store's own clients dial too); return (store, (address, port), owned): the address and port it is served at,
    for workers to dial.

    If the port is taken (typically by the training job's own store at
    ``MASTER_PORT``), join that store as a client instead (refused, with
    ConfigurationError, where another user of this host listens there): the scheme then
    works under a key prefix of its own and leaves the job's keys alone. A
    store this process serves there (another scheme given the same port) is
    held by that client: served until both let go, whichever shuts down
    first, rather than closed under the client by the other's shutdown.
    """
    with _served_guard:  # (two schemes opening one port at once: the second finds the first's store)
        try:
            address = store_address(host)
            sock = socket.create_server((address, port), backlog=BACKLOG)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or port == 0:
                raise ConfigurationError(f"cannot serve a TCP store on {host}:{port}: {exc}") from exc
            served = _served_here(address, port)
        else:
            bound = sock.getsockname()
            store = dist.TCPStore(
                address,
                bound[1],
                is_master=True,
                wait_for_workers=False,
                timeout=as_timedelta(timeout),
                master_listen_fd=sock.detach(),
            )
            _served[(os.getpid(), ip_of(str(bound[0])), bound[1])] = store
            return store, (address, bound[1]), True
    if served is None:
        _refuse_a_strangers(address, port, timeout)
    log.info("%s:%d is taken; joining the store there under weightsync's own prefix", address, port)
    client = connect_store(address, port, timeout)
    if served is not None:  # (a client of its own all the same: calls on one client wait behind each other)
        weakref.finalize(client, _let_go, served)
    return client, (address, port), False


def _refuse_a_strangers(host: str, port: int, timeout: float) -> None:
    """Refuse to join the store at a taken ``port`` of this host unless this user serves it: a store another user
    served would see every key of the run, and could hold each call made to it (a job's own store runs as its
    user). Its owner is read off a connection to it (the end it accepted: :func:`await_listener`), dialled until
    it answers, within ``timeout``: a port another user bound and listens on only later is met once it does (not
    a row of listeners, which would miss that, and count one that shares no address with ``host``).

    Raises:
        ConfigurationError: another user serves it. SyncTimeoutError: nothing answered there in time.
    """
    owner = await_listener(host, port, deadline_after(timeout), timeout, "TCP store", owner=True)
    if owner is not None and owner != os.geteuid():
        raise ConfigurationError(
            f"{host}:{port} is taken by a listener of another user (uid {owner}), not by a store of this job's: "
            "pick another master_port (or leave it 0 for a free one)"
        )


def _let_go(served: dist.Store) -> None:
    """What a client of a store this process serves does with that store once the client is gone: nothing (the
    finalizer held it)."""


#: The stores this process serves, by (pid, address, port), held weakly: a store is served as long as a scheme
#: holds it. (The pid: a forked child inherits the table, not the server's thread.)
_served: weakref.WeakValueDictionary[tuple[int, Any, int], dist.Store] = weakref.WeakValueDictionary()
_served_guard = threading.Lock()


def _served_here(host: str, port: int) -> dist.Store | None:
    """The store this process serves on ``port`` at an address ``host`` names, or at every address (its caller
    holds ``_served_guard``)."""
    wildcard = {ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::")}
    for ip in [*addresses_of(host, port), *wildcard]:
        store = _served.get((os.getpid(), ip, port))
        if store is not None:
            return store
    return None


def await_key(store: dist.Store, key: str, deadline: float, timeout: float, what: str, **where: Any) -> None:
    """Wait until ``store`` holds ``key``, at most until ``deadline``, saying at INFO what for (``what``) while
    it lasts (torch's own ``wait`` says nothing).

    Raises:
        SyncTimeoutError: it did not come within ``timeout``.
        torch.distributed.DistError: the store went away.
    """
    progress = Progress(log, what, timeout, **where)
    if not wait_until(lambda: store.check([key]), deadline, KEY_POLL_S, lambda: progress.tick("not yet")):
        raise SyncTimeoutError(f"gave up waiting for {what} after {shown_seconds(timeout)}", **where)


def store_set(store: dist.Store, key: str, value: bytes) -> None:
    """``store.set(key, value)`` with bytes, as every sealed value is: torch's ``Store.set`` takes ``str`` or
    ``bytes`` (a str is encoded; bytes are kept as they are), while its type stub names ``str`` only."""
    store.set(key, value)  # type: ignore[arg-type]
