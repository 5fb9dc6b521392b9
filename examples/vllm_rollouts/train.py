"""A GRPO-style loop: a Hugging Face Llama learns, a vLLM engine generates with it, weightsync keeps them in step.

    python examples/vllm_rollouts/train.py
    python examples/vllm_rollouts/train.py weightsync/scheme=multiprocess iterations=40
    python examples/vllm_rollouts/train.py weightsync/scheme=distributed

Each iteration the engine samples a group of completions per prompt; a toy reward scores each one (the share of
its tokens whose id is below ``target_below``); each completion's advantage is its reward against its group's
(GRPO); the trainer raises the log-probability of the better ones with AdamW and sends the new weights. ``send()``
returns when the engine serves them: the next iteration samples from the version just trained, which the loop
checks (the engine's ``weight_version`` is weightsync's version). At the end, the engine's greedy tokens must
equal ``generate`` of the trainer's model.
"""

from __future__ import annotations

import logging
import os
import statistics
from pathlib import Path

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

import weightsync.config  # noqa: F401 - registers the weightsync/... config groups
from weightsync.app.llama import TINY, load_llama, write_llama
from weightsync.integrations.vllm import VLLMEngines

log = logging.getLogger("train")


def completion_logprobs(model, prompt: list[int], completions: list[list[int]]) -> torch.Tensor:
    """The sum of each completion's token log-probabilities under ``model`` (one row per completion)."""
    ids = torch.tensor([prompt + c for c in completions])
    logits = model(ids).logits[:, len(prompt) - 1 : -1].float()
    picked = torch.log_softmax(logits, -1).gather(2, ids[:, len(prompt) :, None])[..., 0]
    return picked.sum(1)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.manual_seed(cfg.seed)
    model_dir = write_llama(Path(cfg.model_dir), TINY)
    model = load_llama(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    # The engine, started from its own config: only the backend says weightsync. Its engine core runs in this
    # process, its worker in its own: an engine core process can miss the SIGTERM that stops it (docs/vllm.md,
    # "Stopping an engine").
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        distributed_executor_backend="mp",
        max_model_len=512,
        max_num_seqs=cfg.group_size * cfg.prompts,
        kv_cache_memory_bytes=64 * 2**20,
        seed=cfg.seed,
        weight_transfer_config={"backend": "weightsync"},
    )
    scheme = instantiate(cfg.weightsync.scheme)
    # An LLM generates only inside generate(): between calls nothing is in flight, so nothing needs pausing.
    engines = VLLMEngines([llm], pause_mode="none")
    scheme.init_on_sender(model=model, context=engines)
    scheme.connect()
    log.info("%s serving 1 vLLM engine, options %s", type(scheme).__name__, scheme.option_values())
    sampling = SamplingParams(temperature=1.0, max_tokens=cfg.completion_tokens, n=cfg.group_size, seed=cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    first = last = 0.0
    try:
        for it in range(cfg.iterations):
            assert llm.get_weight_version() == str(scheme.version), "the engine does not serve the newest version"
            prompts = [torch.randint(3, 1000, (8,), generator=generator).tolist() for _ in range(cfg.prompts)]
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
            optimizer.zero_grad()
            rewards_seen = []
            for prompt, out in zip(prompts, outputs):
                completions = [list(o.token_ids) for o in out.outputs]
                rewards = torch.tensor([sum(t < cfg.target_below for t in c) / len(c) for c in completions])
                advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
                loss = -(advantages * completion_logprobs(model, prompt, completions)).mean() / len(prompts)
                loss.backward()
                rewards_seen.append(float(rewards.mean()))
            optimizer.step()
            scheme.send()  # returns when the engine serves the new version
            reward = statistics.mean(rewards_seen)
            first = reward if it == 0 else first
            last = reward
            log.info("iteration %2d  version %2d  mean reward %.3f", it, scheme.version, reward)
        greedy = SamplingParams(temperature=0.0, max_tokens=cfg.completion_tokens)
        prompt = prompts[0]
        served = list(
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy, use_tqdm=False)[0].outputs[0].token_ids
        )
        with torch.no_grad():
            trained = model.generate(torch.tensor([prompt]), max_new_tokens=cfg.completion_tokens, do_sample=False)
        same = served == trained[0, len(prompt) :].tolist()
    finally:
        scheme.shutdown()
        llm.llm_engine.engine_core.shutdown(timeout=60)  # (an LLM has none of its own; 60 s to exit cleanly)
    log.info(
        "mean reward %.3f -> %.3f; the engine computes the trained model: %s", first, last, "yes" if same else "NO"
    )
    if not same:
        raise SystemExit("the engine's greedy tokens differ from the trained model's")


if __name__ == "__main__":
    main()
