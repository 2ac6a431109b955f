"""The batched sampler on its own: edge cases of temperature, noise and top-k, batch independence, the law it samples.

Uses the real Sampler on hand-built logits and Request objects (no model needed).
"""

from __future__ import annotations

import collections

import pytest
import torch

from common.tiers import Tier
from worker.request import Request, SamplingParams
from worker.sampler import Sampler, exponential_noise

CPU = torch.device("cpu")


def req(params: SamplingParams, seed: int, generated: int = 0, rid: str = "r") -> Request:
    r = Request(rid, [1, 2, 3], params, Tier.P3, arrival_seq=0, seed=seed)
    r.output_token_ids = [7] * generated
    return r


def draws(logits_row: torch.Tensor, params: SamplingParams, seeds) -> list[int]:
    """One token per seed, all in one batch (row i uses seeds[i])."""
    reqs = [req(params, s) for s in seeds]
    return Sampler(CPU).sample(logits_row.expand(len(reqs), -1).clone(), reqs)


@pytest.mark.parametrize("temperature", [1e-39, 1e-45, 1e-300, 5e-324])
def test_temperature_near_zero_is_greedy_not_nan(temperature):
    # row / T overflows float32 to +-inf for these T, and softmax of inf is NaN: the draw must still be the argmax.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 512, generator=g) * 5
    reqs = [req(SamplingParams(temperature=temperature, top_p=tp, top_k=tk), seed=i)
            for i, (tp, tk) in enumerate([(1.0, None), (0.9, None), (1.0, 50), (0.5, 5)])]
    assert Sampler(CPU).sample(logits, reqs) == logits.argmax(-1).tolist()


def test_exponential_noise_is_never_zero():
    # torch's exponential_ can return exactly 0 (CUDA's float32 path); p / 0 is inf, and 0 / 0 is NaN,
    # which argmax picks: a masked token would be drawn. The sampler's noise is strictly positive and finite.
    raw = torch.tensor([0.0, 0.0, 1e-45, 2.5, 17.0])
    e = exponential_noise(raw.clone())
    assert bool(torch.isfinite(e).all()) and float(e.min()) > 0.0
    probs = torch.tensor([0.0, 0.6, 0.0, 0.4, 0.0])
    assert int((probs / e).argmax()) == 1  # the zero draw on token 1 wins; the one on masked token 0 does not


def test_masked_tokens_are_never_drawn():
    # With p/E sampling, E == 0 on a masked token (p == 0) gives 0/0 = NaN, which argmax picks. Never here.
    logits = torch.zeros(512)
    logits[100:] = -1e4
    tokens = draws(logits, SamplingParams(temperature=1.0, top_k=10), range(3000))
    assert set(tokens) <= set(range(10))


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_top_k_keeps_exactly_k_tokens_among_ties(k):
    flat = torch.zeros(512)  # every token tied
    tokens = draws(flat, SamplingParams(temperature=1.0, top_k=k), range(2000))
    assert set(tokens) == set(range(k))  # exactly k survive, the lower ids


def test_top_k_ties_at_the_boundary_only():
    logits = torch.tensor([5.0, 1.0, 3.0, 3.0, 3.0, 0.0])  # top-3 = {0} + two of the three tied at 3.0
    tokens = draws(logits, SamplingParams(temperature=5.0, top_k=3), range(3000))
    assert set(tokens) == {0, 2, 3}


def test_top_p_ties_keep_lower_ids():
    flat = torch.zeros(10)  # 0.1 each: 0.25 needs three tokens
    tokens = draws(flat, SamplingParams(temperature=1.0, top_p=0.25), range(2000))
    assert set(tokens) == {0, 1, 2}


def test_samples_follow_the_softmax():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    n = 8000
    counts = collections.Counter(draws(probs.log(), SamplingParams(temperature=1.0), range(n)))
    chi2 = sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs.tolist()))
    assert chi2 < 25.0, (chi2, counts)  # 4 degrees of freedom: p < 1e-4 for a correct sampler
    hot = collections.Counter(draws(probs.log(), SamplingParams(temperature=2.0), range(n)))
    want = probs.sqrt() / probs.sqrt().sum()
    assert all(abs(hot[i] / n - float(w)) < 0.03 for i, w in enumerate(want))


def test_token_depends_only_on_seed_and_index_not_the_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 512, generator=g)
    params = [SamplingParams(temperature=0.9, top_k=40), SamplingParams(), SamplingParams(temperature=1.3, top_p=0.8),
              SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=3, top_p=0.5),
              SamplingParams(temperature=1e-40)]
    reqs = [req(p, seed=10 + i, generated=i, rid=f"r{i}") for i, p in enumerate(params)]
    batch = Sampler(CPU).sample(logits, reqs)
    alone = [Sampler(CPU).sample(logits[i:i + 1], [r])[0] for i, r in enumerate(reqs)]
    assert batch == alone
    order = [4, 2, 0, 5, 1, 3]
    shuffled = Sampler(CPU).sample(logits[order], [reqs[i] for i in order])
    assert shuffled == [batch[i] for i in order]
    # The output index is part of the seed: the next token of the same request draws differently.
    later = [Sampler(CPU).sample(logits[:1], [req(params[0], seed=10, generated=j)])[0] for j in range(20)]
    assert len(set(later)) > 1


def test_one_host_transfer_per_call():
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 512, generator=g)
    reqs = [req(SamplingParams(temperature=1.0, top_k=5 + i, top_p=0.9), seed=i) for i in range(8)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        Sampler(CPU).sample(logits, reqs)
    syncs = sum(e.count for e in prof.key_averages() if e.key in ("aten::item", "aten::_local_scalar_dense"))
    assert syncs == 0  # .tolist() reads the result in one go; no per-row .item()


@pytest.mark.parametrize("temperature", [3.5e38, 1e300, 1.7e308])
def test_a_temperature_past_float32s_range_keeps_top_k_and_top_p(temperature):
    """Above float32's largest value the temperature became inf on its way to the device, and a token top-k had
    masked (-inf) divided by it was NaN: every row with top-k drew token 0 whatever its logits, a result silently
    wrong (the gateway accepts any finite temperature). A huge temperature is a uniform draw among the kept."""
    logits = torch.arange(64, dtype=torch.float32)[None]  # token 0 is the least likely
    for params, kept in ((SamplingParams(temperature=temperature, top_k=4), set(range(60, 64))),
                         (SamplingParams(temperature=temperature, top_k=1), {63}),
                         (SamplingParams(temperature=temperature, top_k=8, top_p=0.5), set(range(56, 64)))):
        got = draws(logits[0], params, range(200))
        assert set(got) <= kept and len(set(got)) > 1 or set(got) == kept == {63}, (params, sorted(set(got)))
