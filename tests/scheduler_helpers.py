"""Scheduler test helpers: requests with distinct arrival numbers, and one scheduler step whose every sampled
sequence gets token 9."""

from __future__ import annotations

from common.tiers import Tier
from worker import SamplingParams
from worker.request import Request
from worker.scheduler import Scheduler

_seq = iter(range(1, 10**9))


def req(rid: str, tier: Tier, prompt: int = 8, max_tokens: int = 32) -> Request:
    n = next(_seq)
    return Request(rid, [7] * prompt, SamplingParams(max_tokens=max_tokens), tier, n, seed=n)


def step(s: Scheduler):
    out = s.schedule()
    s.postprocess(out, {c.request.request_id: 9 for c in out.chunks if c.sample})
    return out
