"""The real scheduler and block manager, driven by a step-time model instead of a model.

No torch: each step's duration comes from ``StepTimeModel`` and every sampled
token is a fixed id (EOS is never produced, so requests run to max_tokens).
``simulate`` replays one arrival trace and checks the scheduler's invariants
after every step; ``scripts/simulate.py`` runs thousands of random traces.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.arrival_traces import load_trace, spread_ties as spread, ties_rng
from common.errors import TierLimitExceeded
from common.tiers import Tier
from worker.block_manager import BlockManager
from worker.config import SchedulerConfig
from worker.policy import make_policy
from worker.preemption import PreemptionConfig, Trigger
from worker.request import Request, RequestStatus, SamplingParams
from worker.scheduler import Scheduler, SchedulerOutput


@dataclass(frozen=True)
class Arrival:
    request_id: str
    time_s: float
    prompt_tokens: int
    max_tokens: int
    tier: Tier


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds for one step: a fixed cost, plus per sequence and per token, plus block copies."""

    base_s: float = 0.004
    per_seq_s: float = 0.0004
    per_token_s: float = 0.00002
    per_block_copy_s: float = 0.00002

    def __call__(self, out: SchedulerOutput) -> float:
        copied = sum(len(c.device_block_ids) for c in out.copies)
        return (self.base_s + self.per_seq_s * len(out.chunks) + self.per_token_s * out.num_batched_tokens
                + self.per_block_copy_s * copied)


@dataclass
class SimResult:
    finished: dict[str, Request] = field(default_factory=dict)
    refused: set[str] = field(default_factory=set)  # over their tier's limit: refused at arrival
    violations: list[str] = field(default_factory=list)
    steps: int = 0
    sim_time_s: float = 0.0
    scheduler: Scheduler | None = None


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def build_scheduler(num_blocks: int, block_size: int, sched: SchedulerConfig, preemption: PreemptionConfig,
                    policy: str, clock) -> Scheduler:
    return Scheduler(sched, BlockManager(num_blocks, block_size), make_policy(policy), preemption, clock=clock)


def simulate(arrivals: list[Arrival], *, num_blocks: int = 64, block_size: int = 16,
             sched: SchedulerConfig | None = None, preemption: PreemptionConfig | None = None,
             policy: str = "priority", step_model: StepTimeModel | None = None,
             max_steps: int = 200_000, check: bool = True) -> SimResult:
    sched = sched or SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=4096)
    preemption = preemption or PreemptionConfig(bytes_per_block=1)
    step_model = step_model or StepTimeModel()
    clock = _Clock()
    s = build_scheduler(num_blocks, block_size, sched, preemption, policy, clock)
    res = SimResult(scheduler=s)
    pending = sorted(arrivals, key=lambda a: (a.time_s, a.request_id))
    seen: set[str] = set()
    seq = idle = 0
    while pending or s.has_unfinished():
        if res.steps >= max_steps:
            res.violations.append(f"starvation: {len(s.waiting) + len(s.running)} requests unfinished "
                                  f"after {max_steps} steps")
            break
        while pending and pending[0].time_s <= clock.now:
            a = pending.pop(0)
            seq += 1
            fits = (min(a.prompt_tokens + a.max_tokens, sched.max_model_len)
                    <= max_blocks_for_tier(a.tier, num_blocks, preemption) * block_size)
            try:
                s.add(Request(a.request_id, [7] * a.prompt_tokens, SamplingParams(max_tokens=a.max_tokens), a.tier,
                              seq, seed=seq, arrival_time=a.time_s))
                seen.add(a.request_id)
            except TierLimitExceeded:
                res.refused.add(a.request_id)
            if check and fits != (a.request_id not in res.refused):
                res.violations.append(f"{a.request_id} ({a.tier.value}, {a.prompt_tokens}+{a.max_tokens} tokens) "
                                      f"{'refused although it fits' if fits else 'accepted beyond its tier limit'}")
        if not s.has_unfinished():
            if pending:
                clock.now = pending[0].time_s
            continue
        out = s.schedule()
        res.steps += 1
        if check:
            _check_step(s, out, res.violations)
            idle = idle + 1 if out.is_empty else 0
            if idle > 0:
                # Liveness: a step with work pending must run something (or move KV for it). One empty step
                # is tolerated: a request that gave way in it may resume in the next.
                res.violations.append(f"stalled: steps {s.step_index - 1}-{s.step_index} ran nothing with "
                                      f"{len(s.running)} running and {len(s.waiting)} waiting")
                break
        clock.now += step_model(out)
        for r in s.postprocess(out, {c.request.request_id: 9 for c in out.chunks if c.sample}):
            if r.finished:
                req = next(c.request for c in out.chunks if c.request.request_id == r.request_id)
                if r.request_id in res.finished:
                    res.violations.append(f"{r.request_id} finished twice")
                req.finish_time = clock.now
                res.finished[r.request_id] = req
    res.sim_time_s = clock.now
    if check:
        lost = seen - set(res.finished)
        if lost and not any(v.startswith(("starvation", "stalled")) for v in res.violations):
            res.violations.append(f"lost requests: {sorted(lost)[:5]}")
        for rid, req in res.finished.items():
            want = max(1, min(req.params.max_tokens, sched.max_model_len - req.num_prompt_tokens))
            if len(req.output_token_ids) != want:
                res.violations.append(f"{rid} produced {len(req.output_token_ids)} of {want}")
        if s.blocks.num_free != s.blocks.num_blocks:
            res.violations.append(f"{s.blocks.num_blocks - s.blocks.num_free} blocks still held at the end")
    return res


def _check_step(s: Scheduler, out: SchedulerOutput, violations: list[str]) -> None:
    pc = s.preemption.config
    for d in out.decisions:
        if d.declined or d.trigger is Trigger.MANUAL:
            continue
        if not pc.preemptible(d.victim_tier):
            violations.append(f"step {s.step_index}: {d.victim_tier.value} request {d.victim_id} preempted")
    gave_way_itself = {d.victim_id for d in out.decisions if d.victim_id == d.beneficiary_id}
    ran = {c.request.request_id for c in out.chunks}
    for d in out.decisions:  # a victim gives way only in a step its beneficiary runs: else it gave way for nothing
        if (not d.declined and d.trigger is not Trigger.MANUAL and d.victim_id not in (d.beneficiary_id, None)
                and d.beneficiary_id not in ran):
            violations.append(f"step {s.step_index}: {d.victim_id} gave way for {d.beneficiary_id}, which did not run")
    for r in out.preempted:
        if (r.last_resume_step is not None and r.request_id not in gave_way_itself
                and len(r.output_token_ids) - r.resume_output_tokens < pc.min_residency_steps):
            violations.append(f"step {s.step_index}: {r.request_id} preempted within its residency")
    try:
        s.blocks.check_invariants()
        if s.host_blocks is not None:
            s.host_blocks.check_invariants()
    except AssertionError as e:
        violations.append(f"step {s.step_index}: block accounting broken: {e}")
    if out.num_batched_tokens > s.config.max_num_batched_tokens or len(s.running) > s.config.max_num_seqs:
        violations.append(f"step {s.step_index}: batch limits exceeded")
    non_p0_running = sum(r.tier is not Tier.P0 for r in s.running)
    if non_p0_running > s.config.max_num_seqs - s.config.p0_reserve_slots:
        violations.append(f"step {s.step_index}: P0 slot reserve breached ({non_p0_running} slots outside P0)")
    if pc.p0_reserve_blocks:
        non_p0 = sum(len(s.blocks.block_table(r.request_id)) for r in s.running + s.waiting if r.tier is not Tier.P0)
        if non_p0 > max(0, s.blocks.num_blocks - pc.p0_reserve_blocks):
            violations.append(f"step {s.step_index}: P0 reserve breached ({non_p0} blocks outside P0)")
    for c in out.chunks:
        if c.request.status is not RequestStatus.RUNNING:
            violations.append(f"step {s.step_index}: {c.request.request_id} scheduled while not running")


def random_trace(rng: random.Random, n: int, *, max_prompt: int = 64, max_new: int = 32,
                 tier_weights: tuple[float, float, float, float] = (0.2, 0.2, 0.3, 0.3),
                 span_s: float = 1.0) -> list[Arrival]:
    """Random arrivals: uniform times over ``span_s``, tiers by weight, bursts included."""
    tiers = list(Tier)
    out = []
    for i in range(n):
        t = rng.random() * span_s if rng.random() > 0.2 else 0.0  # a fifth arrive together at t=0
        out.append(Arrival(f"q{i}", round(t, 6), rng.randint(1, max_prompt), rng.randint(1, max_new),
                           rng.choices(tiers, tier_weights)[0]))
    return out


def azure_trace(path: str | Path, *, limit: int | None = None, tier_mix: dict[Tier, float] | None = None,
                seed: int = 0, max_prompt: int | None = None, max_new: int | None = None,
                spread_ties: bool = True) -> list[Arrival]:
    """Arrivals from an LLM inference trace: the Azure CSV (TIMESTAMP, ContextTokens, GeneratedTokens) or any
    format common/arrival_traces.py reads.

    Times are made relative to the first row; tiers are drawn from ``tier_mix`` with ``seed``. A trace that records
    coarse times (BurstGPT: whole seconds) has each arrival spread through its unit, as scripts/bench_estimate.py
    replays it (``spread_ties=False``: at the recorded times, a unit's arrivals together).
    """
    mix = tier_mix or {Tier.P0: 0.1, Tier.P1: 0.2, Tier.P2: 0.3, Tier.P3: 0.4}
    rng = random.Random(seed)
    tiers, weights = list(mix), list(mix.values())
    rows = load_trace(Path(path), 0, sys.maxsize if limit is None else limit)
    if spread_ties:  # its own generator: the tiers drawn stay those of the recorded times
        rows, _ = spread(rows, ties_rng(seed))
    out: list[Arrival] = []
    for i, (at, prompt, new) in enumerate(rows):
        prompt, new = max(1, prompt), max(1, new)
        if max_prompt:
            prompt = min(prompt, max_prompt)
        if max_new:
            new = min(new, max_new)
        out.append(Arrival(f"az{i}", at, prompt, new, rng.choices(tiers, weights)[0]))
    return out


def max_blocks_for_tier(tier: Tier, num_blocks: int, preemption: PreemptionConfig) -> int:
    """Largest request (in blocks) that ``tier`` can ever hold under the reserve and the low-tier cap.

    Written out here rather than asking the scheduler, so that the simulator checks its refusals."""
    limit = num_blocks if tier is Tier.P0 else num_blocks - preemption.p0_reserve_blocks
    if tier in (Tier.P2, Tier.P3):
        limit = min(limit, int(preemption.low_tier_kv_share * num_blocks))
    return max(0, limit)


@dataclass(frozen=True)
class Case:
    """One random simulator run: the arrivals and the configuration they meet."""

    arrivals: list[Arrival]
    num_blocks: int
    block_size: int
    sched: SchedulerConfig
    preemption: PreemptionConfig
    policy: str


def random_case(rng: random.Random, policy: str = "priority") -> Case:
    """A random workload and configuration, the hard cases included and nothing trimmed to fit.

    Besides uniform random arrivals: requests exactly at and one token over their tier's limit (the
    scheduler must finish the first and refuse the second), P0 floods arriving faster than a step,
    long-prompt victims near the low tiers' limit, and pools of a handful of blocks.
    """
    block_size = rng.choice([4, 8, 16])
    num_blocks = rng.randint(2, 6) if rng.random() < 0.2 else rng.randint(6, 48)
    preemption = PreemptionConfig(
        min_residency_steps=rng.choice([0, 2, 8]),
        guard_remaining_tokens=rng.choice([0, 2, 8]),
        guard_max_generated=rng.choice([None, None, 16]),
        p0_reserve_blocks=rng.choice([0, 0, 1, 3]),
        low_tier_kv_share=rng.choice([1.0, 1.0, 0.75, 0.3]),
        swap_space_blocks=rng.choice([0, 4, 16, 64]),
        recompute_tokens_per_s=rng.choice([100.0, 2000.0, 1e6]),
        bytes_per_block=rng.choice([1, 4096, 2**20]),
    )
    chunked = rng.random() < 0.8
    max_len = 4096 if chunked else 256
    max_num_seqs = rng.randint(1, 8)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, enable_chunked_prefill=chunked, max_model_len=max_len,
                            max_num_batched_tokens=rng.choice([8, 32, 128]) if chunked else max_len,
                            isolate_p0_prefill=rng.random() < 0.5,
                            p0_reserve_slots=min(max_num_seqs - 1, rng.choice([0, 0, 1, 3])))
    arrivals = random_trace(rng, rng.randint(2, 24), max_prompt=rng.choice([8, 64, 160]),
                            max_new=rng.choice([4, 32, 64]), span_s=rng.choice([0.05, 0.5, 2.0]))

    def cap(tier: Tier) -> int:
        return min(max_blocks_for_tier(tier, num_blocks, preemption) * block_size, max_len)

    def add(tier: Tier, time_s: float, total: int, prompt: int | None = None) -> None:
        if total >= 2:
            p = prompt if prompt is not None else rng.randint(1, total - 1)
            arrivals.append(Arrival(f"e{len(arrivals)}", time_s, p, total - p, tier))

    if rng.random() < 0.4:  # at and just over the limit of a few tiers
        for tier in rng.sample(list(Tier), rng.randint(1, 4)):
            add(tier, rng.random() * 0.2, cap(tier))
            add(tier, rng.random() * 0.2, cap(tier) + 1)
    if rng.random() < 0.3:  # a P0 flood: arrivals closer together than one step
        start, gap = rng.random() * 0.2, rng.choice([0.0005, 0.001, 0.003])
        for i in range(rng.randint(8, 40)):
            add(Tier.P0, round(start + i * gap, 6), rng.randint(2, min(cap(Tier.P0), 96)))
    if rng.random() < 0.3:  # long-prompt victims: most of their limit is prompt
        for _ in range(rng.randint(1, 3)):
            tier = rng.choice([Tier.P2, Tier.P3])
            total = rng.randint(max(2, cap(tier) // 2), max(2, cap(tier)))
            add(tier, 0.0, total, max(1, total - rng.randint(1, 16)))
    return Case(arrivals, num_blocks, block_size, sched, preemption, policy)


def run_case(case: Case, check: bool = True) -> SimResult:
    return simulate(case.arrivals, num_blocks=case.num_blocks, block_size=case.block_size, sched=case.sched,
                    preemption=case.preemption, policy=case.policy, check=check)
