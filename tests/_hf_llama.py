"""The trainer's side of the vLLM tests (tests/test_vllm.py, tests/_vllm_remote_trainer.py): what a Hugging Face
model computes with the trainer's weights, which an engine that serves them must compute too, and a training step
that changes them."""

from __future__ import annotations

from typing import Any

import torch


def hf_greedy(model: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """HF ``generate``'s greedy continuation of ``n`` tokens for each prompt (token ids), past the end-of-sequence
    token as the engines are asked for theirs (``ignore_eos``): a step whose model says it after a token or two
    must not make the two differ in length."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None
            )
            out.append(ids[0, len(p) :].tolist())
    return out


def step(model: Any, seed: int, scale: float = 0.05) -> None:
    """One 'training step': every weight moves (what the engine computes changes)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * scale)
