"""Addresses on the network: the sender's host and port, this host's interfaces, loopback or not; who is on the
other end of a connection (its user, where it runs on this host), and whose connection a full queue drops."""

from __future__ import annotations

import collections
import ipaddress
import logging
import math
import os
import socket
import struct
import sys
import time
from collections.abc import Iterable
from typing import Any

from .. import checks
from ..core.timing import Progress, remaining, shown_seconds
from ..errors import ConfigurationError, SyncTimeoutError

__all__ = [
    "addresses_of",
    "await_listener",
    "bound_silence",
    "crowded_out",
    "interface_for",
    "ip_of",
    "is_loopback",
    "local_address",
    "local_interfaces",
    "resolve_master",
    "store_address",
    "tcp_peer_uids",
]

log = logging.getLogger("weightsync.transports.network")

#: A port no packet is sent to: connecting a UDP socket only asks the kernel which interface routes there.
_PROBE_PORT = 9


#: ``TCP_RTO_MAX_MS`` (Linux 6.15 and later; Python names it from 3.14 on).
_TCP_RTO_MAX_MS = getattr(socket, "TCP_RTO_MAX_MS", 44)


def bound_silence(sock: socket.socket, seconds: float) -> bool:
    """Make the kernel give up on the TCP connection ``sock`` once its peer stays silent ``seconds``: keepalive
    probes while nothing is sent, and ``TCP_USER_TIMEOUT`` while something waits for its acknowledgement
    (Linux). A peer whose host vanished (powered off, cut off) sends no reset: without this, a read waits for it
    forever; with it, the read fails.

    A link down for less heals unseen, up to about 80% of ``seconds``: the kernel counts the silence from what
    it last received, so an idle connection is probed every tenth of ``seconds`` (at least every second), and
    what waits for its acknowledgement is sent again as often (Linux 6.15 and later). Before, probes began after
    a third of it, 2 s apart at ``seconds=12``, and TCP's doubling wait between tries let the next one fall past
    the bound: an outage of half of it ended the connection though the link was back. ``False``: not a TCP
    connection, or an option this platform lacks."""
    every = min(max(1, int(seconds / 10)), 32_767)  # (the kernel's bounds)
    try:
        if sock.type != socket.SOCK_STREAM:
            return False
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, every)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, every)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, min(max(1, math.ceil(seconds / every)), 127))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(seconds * 1000))
    except (OSError, AttributeError):  # not TCP, or an option this platform lacks
        return False
    if sys.platform == "linux":
        try:  # (the kernel takes 1 s to 120 s)
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_RTO_MAX_MS, min(every * 1000, 120_000))
        except OSError:  # a kernel before 6.15: an outage over half the bound may end the connection
            log.debug("TCP_RTO_MAX_MS is not taken by this kernel", exc_info=True)
    return True


def resolve_master(master_addr: str | None, master_port: int | None) -> tuple[str, int]:
    """Address and port of the sender's TCP store: the arguments, else ``MASTER_ADDR``/``MASTER_PORT``,
    else loopback and a free port (``0``).

    Raises:
        ConfigurationError: a host that is not a host name or an IP address (:func:`weightsync.checks.host`:
            the resolver would raise ``UnicodeError`` on a label over 63 characters), named by where it came
            from, or a port outside 0..65535.
    """
    if master_addr:
        host = checks.host(master_addr, "master_addr")
    elif os.environ.get("MASTER_ADDR"):
        host = checks.host(os.environ["MASTER_ADDR"], "the environment variable MASTER_ADDR")
    else:
        host = "127.0.0.1"
    port: Any = master_port if master_port is not None else os.environ.get("MASTER_PORT", 0)
    try:
        port = int(port)
    except (TypeError, ValueError):
        raise ConfigurationError(f"master_port must be an int, got {checks.shown(port)}") from None
    if not 0 <= port < 65536:
        raise ConfigurationError(f"master_port must be in 0..65535, got {port}")
    return host, port


def local_address(toward: str) -> str:
    """The address of this host's interface that routes to ``toward`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(toward), _PROBE_PORT))
            return probe.getsockname()[0]
    except (OSError, UnicodeError):  # UnicodeError: a name IDNA refuses (checked names never get here)
        return "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback: only local processes reach it."""
    import ipaddress

    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def local_interfaces() -> dict[str, str]:
    """This machine's network interfaces that have an IPv4 address: {address: interface name}."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name[:15].encode())
                found[socket.inet_ntoa(fcntl.ioctl(probe.fileno(), siocgifaddr, request)[20:24])] = name
            except OSError:  # no IPv4 address on this interface
                continue
    return found


def interface_for(address: str) -> str | None:
    """The name of this machine's network interface that holds IPv4 ``address`` (``None``: none does)."""
    return local_interfaces().get(address)


def await_listener(
    host: str, port: int, deadline: float, timeout: float, what: str, *, owner: bool = False, **where: Any
) -> int | None:
    """Wait until something accepts TCP connections at ``host:port``, at most until ``deadline`` (``timeout``:
    the whole wait's length, for messages), saying at INFO what it waits for while it lasts. A server's own client
    may retry a refused connection far past any bound of ours (torch's TCP store client: its whole timeout, twice,
    logging a C++ stack each time; Ray's: minutes): one that is not there must fail within its timeout, quietly.
    With ``owner``, returns the user who owns the end that accepted (:func:`tcp_peer_uids`: ``None`` where it is
    on another host); else ``None``.

    Raises:
        SyncTimeoutError: nothing accepted a connection in time (``what`` names the server: "TCP store").
    """
    progress = Progress(log, f"the {what} at {host}:{port}", timeout, **where)
    pause = 0.02
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(remaining(deadline), 5.0))) as probe:
                return tcp_peer_uids([probe])[probe] if owner else None
        except OSError as exc:
            if remaining(deadline) <= 0:
                raise SyncTimeoutError(
                    f"no {what} answered at {host}:{port} within {shown_seconds(timeout)} ({exc.strerror or exc})",
                    **where,
                ) from None
            progress.tick(f"not there yet ({exc.strerror or exc})")
            time.sleep(min(pause, remaining(deadline)))
            pause = min(2 * pause, 0.5)


def crowded_out(users: list[int | None], newcomer: int | None) -> int:
    """Which of a full queue's pending connections goes (its index): the oldest of the user who holds the most of
    them, the newcomer counted (``users``, oldest first, each connection's user, ``None`` where unknown: one more
    user). A user who floods a listener pushes out their own connections, never a worker's of another user."""
    counts = collections.Counter([*users, newcomer])
    most = max(counts, key=lambda uid: (counts[uid], uid == newcomer))
    return next((i for i, uid in enumerate(users) if uid == most), 0)


def _mapped(address: tuple[Any, ...]) -> tuple[Any, ...]:
    """An IPv4 ``(ip, port)`` as an IPv6 socket names it (``::ffff:ip``)."""
    return (f"::ffff:{address[0]}", *address[1:])


def _proc_address(address: tuple[Any, ...]) -> str:
    """``(ip, port, ...)`` as ``/proc/net/tcp*`` writes it: the address's 32-bit words in host order, in hex."""
    ip, port = str(address[0]).split("%", 1)[0], int(address[1])
    if ":" in ip:
        words = struct.unpack("=4I", socket.inet_pton(socket.AF_INET6, ip))
    else:
        words = struct.unpack("=I", socket.inet_aton(ip))
    return "".join(f"{word:08X}" for word in words) + f":{port:04X}"


def tcp_peer_uids(socks: Iterable[socket.socket]) -> dict[socket.socket, int | None]:
    """The user who owns the other end of each TCP connection in ``socks`` (accepted here), where that end is on
    this host, in this network namespace: its row in ``/proc/net/tcp`` or ``tcp6`` (a loopback TCP connection
    has no ``SO_PEERCRED``). ``None`` for a connection from another host, one closed meanwhile, or off Linux.
    """
    wanted: dict[tuple[str, str], socket.socket] = {}
    found: dict[socket.socket, int | None] = {}
    for sock in socks:
        found[sock] = None
        try:  # (the other end's row: its address first; IPv4 ends as an IPv6 socket has them too, mapped)
            peer, mine = sock.getpeername(), sock.getsockname()
            wanted[(_proc_address(peer), _proc_address(mine))] = sock
            if ":" not in str(peer[0]):
                wanted[(_proc_address(_mapped(peer)), _proc_address(_mapped(mine)))] = sock
        except (OSError, ValueError):  # closed meanwhile, or not an IP address
            continue
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not wanted:
            break
        try:
            with open(table) as rows:
                next(rows, None)  # the header
                for row in rows:
                    fields = row.split()
                    if len(fields) > 7 and (fields[1], fields[2]) in wanted and fields[7].isdigit():
                        found[wanted.pop((fields[1], fields[2]))] = int(fields[7])
        except OSError:  # not Linux
            break
    return found


def ip_of(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``address`` as an IP address (an IPv4 address mapped into IPv6 as itself, a scope left out); ``None`` if it
    is none."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def store_address(host: str) -> str:
    """The one address a TCP store "at ``host``" is served and dialled at: ``host`` where it is an IP address,
    else the first IPv4 address it names (the one a store's socket binds: a sender serves on IPv4). Never the name
    itself: torch's client tries each address a name gives in turn, and ``localhost`` names ``::1`` first on many
    hosts, where another user may listen on the same port (a review: a trainer ran its whole run on such a
    user's store, and one that stayed silent held its ``init_on_sender`` for minutes).

    Raises:
        OSError: ``host`` names no IPv4 address (``socket.gaierror``).
    """
    if ip_of(host) is not None:
        return host
    return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])


def addresses_of(host: str, port: int) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IP addresses ``host`` names (what torch's client may have connected to; a connection to the unspecified
    address, ``0.0.0.0`` or ``::``, reaches the loopback one); empty if it names none."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    named = {ip for info in infos if (ip := ip_of(str(info[4][0]))) is not None}
    loopback = {ipaddress.ip_address("::1" if ip.version == 6 else "127.0.0.1") for ip in named if ip.is_unspecified}
    return named | loopback
