"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seed.

Randomness for the token at output index ``i`` of a request comes from a
generator seeded with ``(seed, i)`` alone. A request's tokens therefore do not
depend on what else is in its batch, on batch order, or on whether it was
preempted and recomputed in between.
"""

from __future__ import annotations

import torch

from worker.request import Request

_MASK63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive indices across the seed space


def token_seed(seed: int, index: int) -> int:
    return (seed ^ ((index + 1) * _GOLDEN)) & _MASK63


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generator = torch.Generator(device=device)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """One token per row of ``logits`` ([len(requests), vocab]), row i for requests[i]."""
        logits = logits.float()
        out = logits.argmax(dim=-1)
        sampled_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        for i in sampled_rows:
            out[i] = self._sample_row(logits[i], requests[i])
        return out.tolist()

    def _sample_row(self, row: torch.Tensor, req: Request) -> torch.Tensor:
        p = req.params
        row = row / p.temperature
        if p.top_k is not None and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= p.top_p
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            row = row.masked_fill(drop, float("-inf"))
        probs = row.softmax(-1)
        self._generator.manual_seed(token_seed(req.seed, len(req.output_token_ids)))
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, one RNG call, no CDF search.
        noise = torch.empty_like(probs).exponential_(generator=self._generator)
        return (probs / noise).argmax()
