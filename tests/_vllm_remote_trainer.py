"""The trainer of tests/test_vllm_hosts.py, on host A: a Hugging Face Llama, a ``distributed`` scheme whose store
is on host A's address, and one engine behind ``vllm serve`` on host B, given by its URL.

    python -m tests._vllm_remote_trainer URL MODEL_DIR MASTER_ADDR [--versions N] [--wait-s S]

It first waits (at most ``--wait-s``) until the server answers ``/health``, then makes one call out of order
(``start_weight_update`` before the engine's receiver exists) and records the error the server answers.

For each version it changes every weight (seeded), sends, then asks the server, as any client of it would, for
greedy completions of fixed prompts (token ids in, token ids out: ``/v1/completions`` with ``return_token_ids``)
and its weight version (``/weight_info``), and computes the same completions with HF ``generate``. The long prompt
was completed under the previous version: its cached prefix holds keys and values of the old weights, which the
update must have dropped. The last line it prints is ``RESULT <json>``, which the test reads.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from typing import Any

import weightsync as ws
from tests._hf_llama import hf_greedy, step
from weightsync.app.llama import load_llama
from weightsync.integrations.vllm import VLLMEngines
from weightsync.integrations.vllm.served import EngineHTTPError, HTTPEngineClient

#: A short prompt, and a long one that fills prefix-cache blocks (the engine's cache is on by default).
PROMPTS = [[1, 5, 9, 33, 200], list(range(3, 200))]
TOKENS = 8
#: The model's name on the server (``vllm serve --served-model-name``).
SERVED_NAME = "tiny"


#: No proxy: the server is on the test's own network.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _call(url: str, body: dict[str, Any] | None = None, timeout: float = 60) -> Any:
    """GET ``url`` (or POST ``body`` as JSON); the answer's JSON."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with OPENER.open(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_healthy(url: str, within: float) -> float:
    """Wait until the server at ``url`` answers ``/health`` (at most ``within`` seconds); how long it took.

    Raises:
        SystemExit: it did not, with the last error.
    """
    started = time.monotonic()
    while True:
        try:
            with OPENER.open(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        if time.monotonic() - started > within:
            raise SystemExit(f"{url} did not answer /health within {within:.0f} s (last: {last!r})")
        time.sleep(0.5)


def served(url: str) -> list[list[int]]:
    """The server's greedy tokens for each prompt."""
    out = []
    for prompt in PROMPTS:
        answer = _call(
            f"{url}/v1/completions",
            {"model": SERVED_NAME, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True,
             "return_token_ids": True},
        )  # fmt: skip
        out.append(answer["choices"][0]["token_ids"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("model_dir")
    parser.add_argument("master_addr")
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--wait-s", type=float, default=300)
    args = parser.parse_args()

    model = load_llama(args.model_dir)
    step(model, 100)  # the trainer's weights are not the checkpoint the engine started from
    scheme = ws.DistributedWeightSyncScheme(master_addr=args.master_addr, timeout=60, connect_timeout=120)
    engines = VLLMEngines([args.url], pause_mode="keep")
    result: dict[str, Any] = {"versions": []}
    result["server_up_s"] = round(wait_healthy(args.url, args.wait_s), 1)
    try:  # a call out of order: the engine's error, as the server answers it
        HTTPEngineClient(args.url, "vLLM engine 0").start(30)
    except EngineHTTPError as exc:
        result["refused"] = {"status": exc.status, "route": exc.route, "error": str(exc)}
    try:
        scheme.init_on_sender(model=model, context=engines)
        result["connection"] = scheme.receiver_config(0)["connection"]  # what the engine was sent over HTTP
        started = time.monotonic()
        scheme.connect()
        result["connect_s"] = round(time.monotonic() - started, 3)
        for version in range(args.versions + 1):
            before = hf_greedy(model, PROMPTS, TOKENS)
            if version:
                step(model, version)
                started = time.monotonic()
                scheme.send()
                send_s = round(time.monotonic() - started, 3)
            else:
                send_s = None
            now = hf_greedy(model, PROMPTS, TOKENS)
            result["versions"].append({
                "version": version,
                "send_s": send_s,
                "changed": version == 0 or now != before,  # equality below is not the old version's
                "hf": now,
                "served": served(args.url),
                "weight_version": _call(f"{args.url}/weight_info")["weight_version"],
            })  # fmt: skip
        result["paused"] = [t.paused for t in engines.timings]
    finally:
        scheme.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
