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

        _CTX.set_forkserver_preload(PRELOAD)  # this process's own server: one a test, no compiling in it

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
