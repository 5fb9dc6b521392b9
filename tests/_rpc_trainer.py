"""A trainer process for one RPC test: torch.distributed.rpc starts once per process (pytorch/pytorch#46491)."""

from __future__ import annotations

import inspect
import traceback


def run(scenario: str, conn) -> None:
    """Run ``scenario`` (a body of :mod:`tests._bodies` and its arguments) as the sender; report to ``conn``."""
    groups = []
    try:
        import weightsync as ws
        from tests import _bodies as bodies
        from tests.conftest import _CTX, WorkerGroup

        def workers(target, n, make_args):
            groups.append(WorkerGroup(_CTX, target, n, make_args))
            return groups[-1]

        # "body[:strategy[:key=value,...]]": scheme arguments after the strategy.
        name, _, rest = scenario.partition(":")
        strategy, _, extra = rest.partition(":")
        kwargs = dict(item.split("=", 1) for item in extra.split(",") if item)
        if strategy:
            kwargs["strategy"] = strategy
        scheme = ws.RPCWeightSyncScheme(timeout=20, connect_timeout=60, **kwargs)
        body = getattr(bodies, name)
        if "strategy" in inspect.signature(body).parameters:
            body(scheme, workers, strategy)
        else:
            body(scheme, workers)
        conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
        conn.send(("failed", traceback.format_exc()))
    finally:
        for group in groups:
            group.stop()
