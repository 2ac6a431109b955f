"""Token sampling for a whole batch at once: greedy, temperature, top-k, top-p, per-request seeds.

Randomness for the token at output index ``i`` of a request comes from a
generator seeded with ``(seed, i)`` alone. A request's tokens therefore do not
depend on what else is in its batch, on batch order, or on whether it was
preempted and recomputed in between. Only drawing that noise is per row (one
``exponential_`` each, no sort); masking, scaling and the draw itself are one
set of batched ops over all sampled rows.

Penalties and min_tokens change a request's logits first, greedy picks
included (worker/logit_extras.py).

Edge cases handled by construction:
- temperature near 0: logits are shifted so the row maximum is 0 before the
  division, so the quotient is at most 0 and never overflows to inf/NaN;
- temperature past float32's range: clamped to its largest value, not inf, so a
  token top-k masked stays -inf (-inf / inf would be NaN);
- the exponential noise is never 0: draws are clamped to the smallest normal
  float, so ``p / E`` is finite (and a masked token, p = 0, stays at 0 instead
  of 0/0 = NaN, which argmax would pick);
- top-p keeps at least the most likely token, however small top_p is (even one
  that rounds to 0 in float32);
- top-k keeps exactly k tokens; ties at the k-th value go to the lower token id
  (top-p likewise keeps the lower ids among equal probabilities).
"""

from __future__ import annotations

import torch

from worker import logit_extras
from worker.request import Request

_MASK63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive indices across the seed space
# Rows of the one host tensor the sampler copies to the device.
_ROW, _TOP_K, _TEMP, _TOP_P = range(4)


def token_seed(seed: int, index: int) -> int:
    return (seed ^ ((index + 1) * _GOLDEN)) & _MASK63


def exponential_noise(raw: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws made safe to divide by: a draw of exactly 0 becomes the smallest normal float."""
    return raw.clamp_min_(torch.finfo(raw.dtype).tiny)


class Sampler:
    def __init__(self, device: torch.device, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.device = device
        self.eos_token_ids = tuple(eos_token_ids)
        self._generator = torch.Generator(device=device)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """One token per row of ``logits`` ([len(requests), vocab]), row i for requests[i]."""
        given, logits = logits, logits.float()
        if logit_extras.wanted(requests):  # changed in place: on a copy, where float() gave back the caller's tensor
            logits = logits.clone() if logits is given else logits.contiguous()
            logit_extras.apply_(logits, requests, self.eos_token_ids)
        out = logits.argmax(dim=-1)
        sampled = [(i, r) for i, r in enumerate(requests) if not r.params.greedy]
        if sampled:
            cols = self._to_device(sampled, logits.shape[-1])
            out = out.index_put((cols[_ROW],), self._sample_rows(logits, sampled, cols))
        return out.tolist()  # the step's one device -> host transfer

    def _to_device(self, sampled: list[tuple[int, Request]], vocab: int) -> torch.Tensor:
        """Per-row parameters in one host -> device copy: two int64 rows, then two float64 rows."""
        ints, floats = [], []
        for i, r in sampled:
            p = r.params
            ints.append((i, min(p.top_k or vocab, vocab)))
            floats.append((p.temperature, p.top_p))
        host = torch.empty(4, len(sampled), dtype=torch.int64)
        host[:_TEMP] = torch.tensor(ints, dtype=torch.int64).T
        host[_TEMP:].view(torch.float64).copy_(torch.tensor(floats, dtype=torch.float64).T)
        return host.to(self.device, non_blocking=True) if self.device.type != "cpu" else host

    def _sample_rows(self, logits: torch.Tensor, sampled: list[tuple[int, Request]],
                     cols: torch.Tensor) -> torch.Tensor:
        vocab = logits.shape[-1]
        x = logits.index_select(0, cols[_ROW])
        top_ks = [min(r.params.top_k, vocab) for _, r in sampled if r.params.top_k is not None]
        if top_ks and min(top_ks) < vocab:
            x = _top_k(x, cols[_TOP_K], max(top_ks))
        # [n, 1]; a temperature below float32's range would become 0 (and 0/0 NaN), one above it inf (and a token
        # top-k masked, -inf / inf, NaN: the row drew token 0): clamp it into the range.
        f32 = torch.finfo(torch.float32)
        temp = cols[_TEMP:_TEMP + 1].view(torch.float64).T.float().clamp_(f32.tiny, f32.max)
        # Shift first: the quotient is <= 0, so a temperature near 0 sends the rest to -inf, never to NaN.
        x = (x - x.amax(dim=-1, keepdim=True)) / temp
        if any(r.params.top_p < 1.0 for _, r in sampled):
            top_p = cols[_TOP_P:].view(torch.float64).T.float()
            x = _top_p(x, top_p)
        probs = x.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for j, (_, r) in enumerate(sampled):
            self._generator.manual_seed(token_seed(r.seed, len(r.output_token_ids)))
            noise[j].exponential_(generator=self._generator)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, one RNG call, no CDF search.
        return (probs / exponential_noise(noise)).argmax(dim=-1)


def _top_k(x: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Keep exactly k[i] tokens of row i (the lower ids among ties at the k-th value)."""
    vocab = x.shape[-1]
    kth = x.topk(k_max, dim=-1).values.gather(1, (k.clamp(max=k_max) - 1)[:, None])
    above = x > kth
    tie = x == kth
    room = k[:, None] - above.sum(dim=-1, keepdim=True)
    keep = above | (tie & (tie.cumsum(dim=-1) <= room)) | (k >= vocab)[:, None]
    return x.masked_fill(~keep, float("-inf"))


def _top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest prefix (by probability, lower ids first among ties) whose mass reaches top_p."""
    probs = x.softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    # Rows without top-p get a threshold above any sum, so float error at the tail drops nothing.
    limit = torch.where(top_p < 1.0, top_p, torch.full_like(top_p, 2.0))
    drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= limit
    # The most likely token always stays: a top_p that rounds to 0.0 in float32 (below ~1e-45) reached the first
    # token's preceding mass (0) too, masked every token, and the NaN softmax drew token 0.
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))
