"""Engine test helpers: transformers' own greedy output (the ground truth) and seeded random prompts."""

from __future__ import annotations

import random

import torch


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """What transformers' generate() produces for ``prompt``, greedily."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def prompts(n: int, seed: int, lo: int = 1, hi: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]
