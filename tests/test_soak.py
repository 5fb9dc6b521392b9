"""Soak: continuous sends to workers that read their model continuously, for a bounded time.

``WEIGHTSYNC_SOAK_SECONDS`` sets the time per scheme (default 10 s in CI; docs/reliability.md quotes a
60 s run). Zero torn reads, zero lost versions, memory flat on both sides.
"""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch

import weightsync as ws
from tests._bodies import start_readers

SECONDS = float(os.environ.get("WEIGHTSYNC_SOAK_SECONDS", "10"))
MB = 1 << 20


@pytest.mark.parametrize("name", ["multiprocess", "shared_mem"])
def test_soak_no_torn_read_no_lost_version_flat_memory(workers, name):
    scheme = ws.WeightSyncScheme.from_backend(name, timeout=20, connect_timeout=60)
    model, group = start_readers(workers, scheme)
    me = psutil.Process()
    sends, rss_warm = 0, None
    began = time.monotonic()
    while time.monotonic() - began < SECONDS:
        sends += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(sends))  # every version differs in every element: a mix of two is visible
        scheme.send()  # sync: each version is applied and acked by both workers before the next
        if rss_warm is None and time.monotonic() - began > SECONDS / 10:
            rss_warm = me.memory_info().rss
    rss_end = me.memory_info().rss
    assert scheme.acked_versions == {0: sends, 1: sends}
    for w in range(2):
        group.cmds[w].send(("stop",))
        stats = group.recv(w)
        assert stats["torn"] == 0, f"worker {w}: {stats['torn']} torn reads in {stats['reads']}"
        assert stats["applied"] == sends and stats["version"] == sends, f"worker {w} lost versions: {stats}"
        start, end = stats["rss"]
        assert end - start < 16 * MB, f"worker {w} grew by {(end - start) / MB:.1f} MB"
    assert rss_end - rss_warm < 16 * MB, f"the sender grew by {(rss_end - rss_warm) / MB:.1f} MB"
    summary = scheme.stats()
    assert summary["sends"] == sends and summary["worker_failures"] == 0
    print(f"{name}: {sends} sends in {SECONDS:.0f} s, reads {stats['reads']}, torn 0, lost 0")
    scheme.shutdown()
