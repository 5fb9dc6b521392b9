"""A trainer process for one RPC test: torch.distributed.rpc starts once per process (pytorch/pytorch#46491)."""

from __future__ import annotations

import inspect
import traceback

import yaml


def resolve_host_name_to(address: str) -> None:
    """From now on, in this process and its children, the host's name resolves to ``address``: a private
    mount namespace in which /etc/hosts says so (needs root)."""
    import ctypes
    import os
    import socket
    import subprocess
    import tempfile

    if ctypes.CDLL(None, use_errno=True).unshare(0x00020000) != 0:  # CLONE_NEWNS
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True, timeout=10)
    hosts = os.path.join(tempfile.mkdtemp(), "hosts")
    with open(hosts, "w") as f:
        f.write(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")
    subprocess.run(["mount", "--bind", hosts, "/etc/hosts"], check=True, timeout=10)


def fork_a_server(conn) -> bool:
    """Start this process's forkserver by forking this process, not as multiprocessing does (a fresh Python that
    imports the preloaded modules again): this process is itself a child of the tests' forkserver and holds torch,
    tensordict and weightsync already, with no thread and no RPC agent yet, which a worker forked from it gets as
    a worker forked from the tests' server does. A fresh server cost each RPC test about 7 s of CPU (its imports).
    The server, and the workers it forks, do not hold ``conn`` (the test's pipe): the test sees it end with this
    process.

    Uses multiprocessing's forkserver internals as of Python 3.12 (3.13 adds an authentication key): ``False``
    (nothing done) on other versions, or where a thread runs already, and the caller starts a server the usual way.
    """
    import os
    import socket
    import sys
    import threading
    from multiprocessing import connection, forkserver, resource_tracker, util

    if sys.version_info >= (3, 13) or threading.active_count() > 1:  # (a fork copies no thread but the caller's)
        return False
    server = forkserver._forkserver  # type: ignore[attr-defined]
    resource_tracker.ensure_running()
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # every client holds the write end: the server ends once they all ended
        pid = os.fork()
        if pid == 0:  # the server: serves until every client is gone (SystemExit), never returns
            code = 1
            try:
                os.close(alive_w)
                os.close(conn.fileno())
                forkserver.main(listener.fileno(), alive_r, [])
            except SystemExit:
                code = 0
            finally:
                os._exit(code)
        os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return True


def run(scenario: str, conn, host_address: str | None = None) -> None:
    """Run ``scenario`` (a body of :mod:`tests._bodies` and its arguments) as the sender; report to ``conn``.
    With ``host_address``, the host's name resolves to it in this process and its workers."""
    groups = []
    try:
        if host_address is not None:
            resolve_host_name_to(host_address)
        import weightsync as ws
        from tests import _bodies as bodies
        from tests.conftest import _CTX, PRELOAD, WorkerGroup

        if not fork_a_server(conn):  # its own server, one a test (no RPC agent may run where workers fork)
            _CTX.set_forkserver_preload(PRELOAD)  # (no compiling in it)

        def workers(target, n, make_args):
            groups.append(WorkerGroup(_CTX, target, n, make_args))
            return groups[-1]

        # "body[:strategy[:key=value,...]]": scheme arguments after the strategy.
        name, _, rest = scenario.partition(":")
        strategy, _, extra = rest.partition(":")
        kwargs = {
            key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in extra.split(",") if item)
        }
        if strategy:
            kwargs["strategy"] = strategy
        opted_in = {"timeout": 20, "connect_timeout": 60, "allow_store_peers_to_run_code": True}
        scheme = ws.RPCWeightSyncScheme(**{**opted_in, **kwargs})
        body = getattr(bodies, name)
        if "strategy" in inspect.signature(body).parameters:
            body(scheme, workers, strategy)
        else:
            body(scheme, workers)
        if kwargs.get("delta") and not scheme.stats()["changes_sent"]:
            raise AssertionError(f"{scenario}: no version went as changes")
        conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
        conn.send(("failed", traceback.format_exc()))
    finally:
        for group in groups:
            group.stop()
