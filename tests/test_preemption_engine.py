"""Preemption on the real engine (tiny model): manual suspends in every mode keep the output token-identical,
priority preemption for a batch slot and for KV memory, the preemption matrix and the victim guards, and the
trace spans each decision leaves behind."""

from __future__ import annotations

import random
import weakref
from collections import Counter
from collections.abc import Callable

import pytest
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.tiers import Tier
from tests.engine_helpers import hf_greedy, prompts
from worker import Engine, EngineConfig, FinishReason, SamplingParams
from worker.preemption import PreemptMode
from worker.request import RequestStatus
from worker.tracing import EngineTracer

MODES = ("keep", "swap", "recompute")


# -- helpers ----------------------------------------------------------------------------------------------------


class OpenSpans(SpanProcessor):
    """Names of the spans started but not yet ended."""

    def __init__(self) -> None:
        self.open: dict[int, str] = {}

    def on_start(self, span, parent_context=None) -> None:
        self.open[span.context.span_id] = span.name

    def on_end(self, span) -> None:
        self.open.pop(span.context.span_id, None)


def traced(engine: Engine) -> InMemorySpanExporter:
    """Route the engine's spans to an in-memory exporter (no global tracer provider).

    ``exporter.open_spans`` tells which spans are still open."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    opened = OpenSpans()
    provider.add_span_processor(opened)
    exporter.open_spans = opened.open
    engine.tracer = EngineTracer(provider.get_tracer("test"))
    _EXPORTERS[engine] = exporter
    return exporter


_EXPORTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Run:
    """Drives one engine step by step and records, per request, its tokens, first-token and finish steps."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.first_step: dict[str, int] = {}
        self.finish_step: dict[str, int] = {}
        self.reasons: dict[str, FinishReason] = {}
        self.tiers: dict[str, str] = {}
        self.n = 0  # steps taken

    def add(self, rid: str, prompt: list[int], params: SamplingParams, tier: str = "P3",
            tenant: str | None = None) -> None:
        self.engine.add_request(rid, prompt, params, tier=tier, tenant=tenant)
        self.tokens[rid] = []
        self.tiers[rid] = tier

    def step(self) -> set[str]:
        """One engine step; the ids that got a token in it."""
        self.n += 1
        got = set()
        for out in self.engine.step():
            rid = out.request_id
            assert rid not in self.finish_step, f"{rid} produced output after finishing"
            self.tokens[rid].extend(out.new_token_ids)
            assert out.num_output_tokens == len(self.tokens[rid])
            self.first_step.setdefault(rid, self.n)
            got.add(rid)
            if out.finished:
                self.finish_step[rid] = self.n
                self.reasons[rid] = out.finish_reason
        self.check_pools()
        return got

    def check_pools(self) -> None:
        self.engine.blocks.check_invariants()
        host = self.engine.scheduler.host_blocks
        if host is not None:
            host.check_invariants()

    def finish(self, on_step: Callable[[set[str]], None] | None = None, max_steps: int = 5000) -> None:
        while self.engine.has_unfinished():
            got = self.step()
            if on_step is not None:
                on_step(got)
            assert self.n < max_steps, "engine made no progress"
        assert set(self.finish_step) == set(self.tokens)
        assert_drained(self.engine)
        exporter = _EXPORTERS.get(self.engine)
        if exporter is not None:
            assert not exporter.open_spans, f"spans left open: {sorted(exporter.open_spans.values())}"


def assert_drained(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert engine.kv_usage().num_used == 0
    host = engine.scheduler.host_blocks
    if host is not None:
        assert host.num_free == host.num_blocks  # host pool all free
        host.check_invariants()
    engine.blocks.check_invariants()


def uninterrupted(model_dir, config: EngineConfig, specs) -> dict[str, list[int]]:
    """Tokens of every request in ``specs`` ((rid, prompt, params[, tier]) tuples), all added at step 0 of a
    fresh engine with ``config`` and never suspended by hand."""
    run = Run(Engine.from_pretrained(model_dir, config))
    for rid, prompt, params, *tier in specs:
        run.add(rid, prompt, params, *tier)
    run.finish()
    assert not run.engine.stats().preemptions, "the baseline run must not be preempted"
    return run.tokens


# -- 1. token-identical output under manual suspends --------------------------------------------------------------

EQ_CONFIG = dict(num_kv_blocks=256, max_num_batched_tokens=64, swap_space_mb=16)
EQ_PROMPTS = prompts(8, seed=31, lo=1, hi=80)
EQ_MAX_TOKENS = [14, 9, 17, 12, 20, 11, 15, 18]


def eq_params(kind: str, i: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(max_tokens=EQ_MAX_TOKENS[i])
    return SamplingParams(max_tokens=EQ_MAX_TOKENS[i], temperature=0.9, top_k=40, top_p=0.95, seed=7919 * (i + 1))


def eq_specs(kind: str):
    return [(f"r{i}", p, eq_params(kind, i)) for i, p in enumerate(EQ_PROMPTS)]


@pytest.fixture(scope="module")
def eq_baseline(tiny_model_dir, hf_reference):
    assert len({len(p) for p in EQ_PROMPTS}) == 8 and min(map(len, EQ_PROMPTS)) < 16 < max(map(len, EQ_PROMPTS))
    base = {kind: uninterrupted(tiny_model_dir, EngineConfig(**EQ_CONFIG), eq_specs(kind))
            for kind in ("greedy", "seeded")}
    for i, p in enumerate(EQ_PROMPTS):
        assert base["greedy"][f"r{i}"] == hf_greedy(hf_reference, p, EQ_MAX_TOKENS[i]), f"r{i}"
    # The seeded run really samples (otherwise the second half of the matrix would test greedy again).
    assert base["seeded"] != base["greedy"]
    return base


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("mode", [*MODES, "mixed"])
def test_manual_suspends_give_identical_tokens(tiny_model_dir, eq_baseline, mode, k, kind):
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(**EQ_CONFIG))
    run = Run(engine)
    for spec in eq_specs(kind):
        run.add(*spec)
    since_resume: Counter = Counter()  # tokens each request produced since it last (re)started
    done: Counter = Counter()  # manual suspends by mode
    per_request: Counter = Counter()

    def suspend_some(got: set[str]) -> None:
        for rid in got:
            since_resume[rid] += 1
        for req in list(engine.scheduler.running):
            rid = req.request_id
            if since_resume[rid] < k:
                continue
            m = MODES[(int(rid[1:]) + per_request[rid]) % 3] if mode == "mixed" else mode
            computed = req.num_computed_tokens
            assert computed == req.num_tokens - 1  # suspended right after a sampled token
            engine.suspend(rid, m)
            since_resume[rid] = 0
            per_request[rid] += 1
            done[m] += 1
            assert req.status is RequestStatus.SUSPENDED and req.preempt_mode == m
            assert req not in engine.scheduler.running and req in engine.scheduler.waiting
            nblocks = engine.blocks.blocks_for(computed)
            if m == "keep":
                assert len(engine.blocks.block_table(rid)) == nblocks and req.num_computed_tokens == computed
            elif m == "swap":
                assert not engine.blocks.has_blocks(rid) and req.num_computed_tokens == computed
                assert len(engine.scheduler.host_blocks.block_table(rid)) == nblocks
            else:
                assert not engine.blocks.has_blocks(rid) and req.num_computed_tokens == 0

    run.finish(suspend_some)

    assert run.tokens == eq_baseline[kind]
    stats = engine.stats()
    assert sum(done.values()) >= 8 * (1 if k == 3 else 5)
    assert stats.by_mode() == {m: done[m] for m in MODES}
    assert stats.preemptions == Counter({(Tier.P3, PreemptMode(m)): n for m, n in done.items()})
    assert (stats.bytes_swapped > 0) == (done["swap"] > 0)
    assert (stats.recomputed_tokens > 0) == (done["recompute"] > 0)
    # Every suspend happened after a sampled token, so what was thrown away is exactly what was prefilled again.
    assert stats.recomputed_tokens == stats.wasted_tokens
    assert stats.demotions == 0 and stats.declined == 0
    if mode == "mixed":
        assert all(done[m] > 0 for m in MODES)
        assert sum(1 for n in per_request.values() if n >= 3) > 0  # some request saw every mode
    assert engine.runner.host_cache and engine.scheduler.host_blocks.num_blocks == 16 * 2**20 // 8192


# -- 2. priority preemption for a batch slot ----------------------------------------------------------------------

P3_PROMPTS = prompts(4, seed=41, lo=10, hi=40)
P0_PROMPT = prompts(1, seed=42, lo=9, hi=12)[0]
P3_MAX = 40


def p3_params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=P3_MAX, ignore_eos=True, temperature=0.9, top_k=40, top_p=0.95, seed=100 + i)
    return SamplingParams(max_tokens=P3_MAX, ignore_eos=True)


P0_PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def slot_scenario(model_dir, policy: str, trace: bool = False, tenants: bool = False):
    engine = Engine.from_pretrained(model_dir, EngineConfig(policy=policy, max_num_seqs=4, num_kv_blocks=256))
    exporter = traced(engine) if trace else None
    run = Run(engine)
    for i, p in enumerate(P3_PROMPTS):
        run.add(f"p3-{i}", p, p3_params(i), "P3", tenant=f"batch-{i}" if tenants else None)
    for _ in range(3):
        run.step()
    assert len(engine.scheduler.running) == 4
    return engine, run, exporter


@pytest.fixture(scope="module")
def p3_alone(tiny_model_dir):
    specs = [(f"p3-{i}", p, p3_params(i)) for i, p in enumerate(P3_PROMPTS)]
    return uninterrupted(tiny_model_dir, EngineConfig(max_num_seqs=4, num_kv_blocks=256), specs)


def test_p0_takes_a_slot_from_a_p3_in_keep_mode(tiny_model_dir, hf_reference, p3_alone):
    engine, run, _ = slot_scenario(tiny_model_dir, "priority")
    running = list(engine.scheduler.running)
    # Lowest tier first, then least progress (fewest computed tokens), then the latest arrival.
    expected_victim = min(running, key=lambda r: (r.num_computed_tokens, -r.arrival_seq))
    blocks_before = len(engine.blocks.block_table(expected_victim.request_id))

    run.add("p0", P0_PROMPT, P0_PARAMS, "P0")
    got = run.step()

    assert "p0" in got and run.first_step["p0"] == run.n  # scheduled and sampled at once
    suspended = [r for r in running if r.status is RequestStatus.SUSPENDED]
    assert suspended == [expected_victim]
    victim = suspended[0]
    assert victim.preempt_mode == "keep" and victim.request_id not in got
    assert len(engine.blocks.block_table(victim.request_id)) == blocks_before  # KV stays resident
    stats = engine.stats()
    assert stats.preemptions == Counter({(Tier.P3, PreemptMode.KEEP): 1})
    assert stats.by_mode() == {"keep": 1, "swap": 0, "recompute": 0}
    assert stats.wasted_tokens == 0 and stats.bytes_swapped == 0 and stats.declined == 0
    assert {r.request_id for r in engine.scheduler.running} == {"p0"} | {r.request_id for r in running} - {
        victim.request_id}

    run.finish()
    p3s = [f"p3-{i}" for i in range(4)]
    assert run.finish_step["p0"] < min(run.finish_step[r] for r in p3s)
    assert run.tokens["p0"] == hf_greedy(hf_reference, P0_PROMPT, P0_PARAMS.max_tokens)
    for rid in p3s:
        assert len(run.tokens[rid]) == P3_MAX and run.reasons[rid] is FinishReason.LENGTH
        assert run.tokens[rid] == p3_alone[rid], rid
    stats = engine.stats()
    assert sum(stats.preemptions.values()) == 1 and stats.wasted_tokens == 0 and stats.recomputed_tokens == 0


def test_fifo_p0_waits_for_a_p3_to_finish(tiny_model_dir, p3_alone):
    engine, run, _ = slot_scenario(tiny_model_dir, "fifo")
    run.add("p0", P0_PROMPT, P0_PARAMS, "P0")
    got = run.step()
    assert "p0" not in got and engine.get_request("p0").status is RequestStatus.WAITING
    run.finish()
    p3s = [f"p3-{i}" for i in range(4)]
    first_p3_finish = min(run.finish_step[r] for r in p3s)
    assert run.first_step["p0"] > first_p3_finish
    assert not engine.stats().preemptions and engine.stats().declined == 0
    for rid in p3s:
        assert run.tokens[rid] == p3_alone[rid]


# -- 3. priority preemption for KV memory -------------------------------------------------------------------------

KV_PROMPTS = [prompts(1, seed=50 + n, lo=n, hi=n + 1)[0] for n in (36, 38, 40)]  # + 24 tokens: 60..64, 4 blocks
KV_MAX = 24
KV_P0 = prompts(1, seed=60, lo=10, hi=11)[0]  # + 10 tokens: 2 blocks
KV_P0_PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def kv_params(i: int) -> SamplingParams:
    if i == 1:
        return SamplingParams(max_tokens=KV_MAX, ignore_eos=True, temperature=0.9, top_k=40, top_p=0.95, seed=5)
    return SamplingParams(max_tokens=KV_MAX, ignore_eos=True)


def kv_scenario(model_dir, trace: bool = False, **overrides):
    """Three P3s that fill 12 of 13 blocks, then a P0 that needs 2."""
    engine = Engine.from_pretrained(model_dir, EngineConfig(num_kv_blocks=13, max_num_seqs=8, **overrides))
    exporter = traced(engine) if trace else None
    run = Run(engine)
    for i, p in enumerate(KV_PROMPTS):
        run.add(f"p3-{i}", p, kv_params(i), "P3", tenant="t-low" if trace else None)
    while engine.kv_usage().num_free > 1:
        run.step()
        assert run.n < 20
    assert engine.kv_usage().num_used == 12 and len(engine.scheduler.running) == 3
    assert not engine.stats().preemptions
    return engine, run, exporter


@pytest.fixture(scope="module")
def kv_alone(tiny_model_dir):
    specs = [(f"p3-{i}", p, kv_params(i)) for i, p in enumerate(KV_PROMPTS)] + [("p0", KV_P0, KV_P0_PARAMS, "P0")]
    return uninterrupted(tiny_model_dir, EngineConfig(num_kv_blocks=64, max_num_seqs=8), specs)


@pytest.mark.parametrize("mode,overrides", [
    ("swap", dict(swap_space_mb=16, recompute_tokens_per_s=1.0)),
    ("swap", dict(swap_space_mb=16)),  # the default cost model: copying 4 tiny blocks beats re-prefilling 40+ tokens
    ("recompute", dict(swap_space_mb=0, recompute_tokens_per_s=1.0)),
    ("recompute", dict(swap_space_mb=16, swap_bytes_per_s=1.0)),  # host room, but the copy is priced out
], ids=["swap-cheap", "swap-default-cost", "no-host-pool", "swap-priced-out"])
def test_p0_needing_kv_blocks_preempts_by_swap_or_recompute(tiny_model_dir, kv_alone, mode, overrides):
    engine, run, _ = kv_scenario(tiny_model_dir, **overrides)
    running = list(engine.scheduler.running)
    victim = min(running, key=lambda r: (r.num_computed_tokens, -r.arrival_seq))
    computed = victim.num_computed_tokens
    nblocks = len(engine.blocks.block_table(victim.request_id))
    assert nblocks == engine.blocks.blocks_for(computed) == 4

    run.add("p0", KV_P0, KV_P0_PARAMS, "P0")
    got = run.step()

    assert "p0" in got
    assert [r for r in running if r.status is RequestStatus.SUSPENDED] == [victim]
    assert victim.preempt_mode == mode and not engine.blocks.has_blocks(victim.request_id)
    stats = engine.stats()
    assert stats.preemptions == Counter({(Tier.P3, PreemptMode(mode)): 1})
    bpb = engine.runner.bytes_per_block
    if mode == "swap":
        assert stats.bytes_swapped == nblocks * bpb > 0 and stats.wasted_tokens == 0
        assert len(engine.scheduler.host_blocks.block_table(victim.request_id)) == nblocks
    else:
        assert stats.bytes_swapped == 0 and stats.wasted_tokens == computed and victim.num_computed_tokens == 0

    run.finish()
    assert run.tokens == kv_alone
    assert run.finish_step["p0"] < run.finish_step[victim.request_id]
    stats = engine.stats()
    assert sum(stats.preemptions.values()) == 1
    if mode == "swap":
        assert stats.bytes_swapped == 2 * nblocks * bpb  # out and back in
        assert stats.recomputed_tokens == 0
    else:
        assert stats.recomputed_tokens == computed  # prompt + all output but the last sampled token


# -- 4. the matrix and the guards ---------------------------------------------------------------------------------


def test_p1_never_preempts_p2_and_declines_once(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=4, num_kv_blocks=256))
    exporter = traced(engine)
    run = Run(engine)
    ps = prompts(6, seed=70, lo=5, hi=30)
    for i in range(4):
        run.add(f"p2-{i}", ps[i], SamplingParams(max_tokens=12 + 4 * i, ignore_eos=True), "P2")
    run.step()
    run.add("p1-a", ps[4], SamplingParams(max_tokens=5, ignore_eos=True), "P1")
    run.add("p1-b", ps[5], SamplingParams(max_tokens=5, ignore_eos=True), "P1")
    for _ in range(8):
        run.step()
        assert engine.get_request("p1-a").status is RequestStatus.WAITING
        assert all(engine.get_request(f"p2-{i}").status is RequestStatus.RUNNING for i in range(4))
    assert engine.stats().declined == 1  # once, not once per step
    run.finish()
    stats = engine.stats()
    assert not stats.preemptions
    # p1-b was refused too, once it headed the queue behind p1-a: one decline per waiting request.
    assert stats.declined == 2
    assert run.first_step["p1-a"] > run.finish_step["p2-0"]
    declined = [s for s in exporter.get_finished_spans() if s.name == "scheduler.preemption_declined"]
    assert sorted(s.attributes["preemption.beneficiary.request_id"] for s in declined) == ["p1-a", "p1-b"]
    for s in declined:
        assert s.attributes["preemption.declined_reason"] == "no_lower_tier_running"
        assert s.attributes["preemption.trigger"] == "slot"
        assert s.attributes["preemption.mode"] == "declined" and s.attributes["preemption.declined"] is True
        assert "preemption.victim.request_id" not in s.attributes
    assert not [s for s in exporter.get_finished_spans() if s.name == "scheduler.preemption"]


def test_p1_preempts_the_p3_and_not_the_p2s(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=4, num_kv_blocks=256))
    run = Run(engine)
    ps = prompts(5, seed=71, lo=5, hi=30)
    # The P3 has made the most progress, so only the matrix (not progress) can single it out.
    run.add("p3", ps[0] + ps[0], SamplingParams(max_tokens=30, ignore_eos=True), "P3")
    for i in range(3):
        run.add(f"p2-{i}", ps[1 + i], SamplingParams(max_tokens=30, ignore_eos=True), "P2")
    for _ in range(2):
        run.step()
    run.add("p1", ps[4], SamplingParams(max_tokens=5, ignore_eos=True), "P1")
    assert "p1" in run.step()
    assert engine.get_request("p3").status is RequestStatus.SUSPENDED
    assert engine.stats().preemptions == Counter({(Tier.P3, PreemptMode.KEEP): 1})
    run.finish()
    assert set(k[0] for k in engine.stats().preemptions) == {Tier.P3}


@pytest.mark.parametrize("guard", [4, 0])
def test_p3_close_to_done_is_not_chosen(tiny_model_dir, guard):
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=4, num_kv_blocks=256,
                                                                 guard_remaining_tokens=guard))
    run = Run(engine)
    ps = prompts(4, seed=72, lo=20, hi=30)
    run.add("near", [7, 8], SamplingParams(max_tokens=6, ignore_eos=True), "P3")  # fewest computed tokens
    for i in range(3):
        run.add(f"far-{i}", ps[i], SamplingParams(max_tokens=40, ignore_eos=True), "P3")
    run.step()
    run.step()
    near = engine.get_request("near")
    assert near.params.max_tokens - len(near.output_token_ids) == 4
    assert min(engine.scheduler.running, key=lambda r: r.num_computed_tokens) is near
    run.add("p0", [9, 10, 11], SamplingParams(max_tokens=3, ignore_eos=True), "P0")
    assert "p0" in run.step()
    suspended = [r.request_id for r in engine.scheduler.waiting if r.status is RequestStatus.SUSPENDED]
    if guard == 4:  # 4 tokens left <= guard: the least-progress far request goes instead
        assert len(suspended) == 1 and suspended[0].startswith("far-") and near.status is RequestStatus.RUNNING
    else:  # control: without the guard the near request is the natural victim
        assert suspended == ["near"]
    run.finish()


def test_all_victims_guarded_declines_once_and_p0_waits(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=4, num_kv_blocks=256,
                                                                 guard_remaining_tokens=12))
    exporter = traced(engine)
    run = Run(engine)
    for i, p in enumerate(prompts(4, seed=73, lo=5, hi=20)):
        run.add(f"p3-{i}", p, SamplingParams(max_tokens=12 + i, ignore_eos=True), "P3")
    for _ in range(3):
        run.step()
    assert all(r.params.max_tokens - len(r.output_token_ids) <= 12 for r in engine.scheduler.running)
    run.add("p0", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), "P0")
    run.finish()
    stats = engine.stats()
    assert not stats.preemptions and stats.declined == 1
    assert run.first_step["p0"] == run.finish_step["p3-0"] + 1  # the first slot to free up
    declined = [s for s in exporter.get_finished_spans() if s.name.startswith("scheduler.preemption")]
    assert len(declined) == 1 and declined[0].name == "scheduler.preemption_declined"
    assert declined[0].attributes["preemption.declined_reason"] == "victims_near_completion"
    assert declined[0].attributes["preemption.beneficiary.request_id"] == "p0"


def test_p0_is_never_suspended_by_the_scheduler(tiny_model_dir):
    rng = random.Random(74)
    specs = []
    arrivals: dict[int, list] = {}
    for i in range(12):
        tier = "P0" if i % 3 == 0 else rng.choice(["P1", "P2", "P3", "P3"])
        p = [rng.randrange(3, 512) for _ in range(rng.randint(4, 36))]
        params = (SamplingParams(max_tokens=rng.randint(6, 16), ignore_eos=True) if i % 2 else
                  SamplingParams(max_tokens=rng.randint(6, 16), ignore_eos=True, temperature=1.0, seed=i))
        specs.append((f"{tier}-{i}", p, params, tier))
        arrivals.setdefault(rng.randrange(0, 12), []).append(specs[-1])
    # 12 blocks of 16 tokens and 5 slots: P3/P2 work is preempted by P0 and P1 arrivals and by growth.
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(num_kv_blocks=12, max_num_seqs=5,
                                                                 max_num_batched_tokens=64, swap_space_mb=1,
                                                                 min_residency_steps=2))
    run = Run(engine)
    p0s: list = []
    while engine.has_unfinished() or any(k >= run.n for k in arrivals):
        for rid, p, params, tier in arrivals.get(run.n, []):
            run.add(rid, p, params, tier)
            if tier == "P0":
                p0s.append(engine.get_request(rid))
        run.step()
        for r in p0s:
            assert r.status is not RequestStatus.SUSPENDED and r.num_preemptions == 0, r.request_id
        assert run.n < 2000
    assert_drained(engine)
    stats = engine.stats()
    assert sum(stats.preemptions.values()) > 0, "the workload must make the scheduler preempt"
    assert all(tier in (Tier.P2, Tier.P3) for tier, _ in stats.preemptions)  # the default matrix
    alone = uninterrupted(tiny_model_dir, EngineConfig(num_kv_blocks=128, max_num_seqs=16), specs)
    assert run.tokens == alone


# -- 5. tracing ---------------------------------------------------------------------------------------------------


def spans_named(exporter: InMemorySpanExporter, name: str) -> list:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def request_span(exporter: InMemorySpanExporter, rid: str):
    found = [s for s in spans_named(exporter, "worker.request") if s.attributes["request.id"] == rid]
    assert len(found) == 1, rid
    return found[0]


def test_slot_preemption_spans(tiny_model_dir):
    engine, run, exporter = slot_scenario(tiny_model_dir, "priority", trace=True, tenants=True)
    running = list(engine.scheduler.running)
    victim = min(running, key=lambda r: (r.num_computed_tokens, -r.arrival_seq))
    vid = victim.request_id
    used_before = engine.kv_usage().num_used
    run.add("p0", P0_PROMPT, P0_PARAMS, "P0", tenant="chat")
    run.step()
    assert victim.status is RequestStatus.SUSPENDED

    # The decision span is out at once; the suspended span stays open until the victim resumes.
    suspended_closed_at = None
    resumed_at = None

    def watch(got: set[str]) -> None:
        nonlocal suspended_closed_at, resumed_at
        if resumed_at is None and vid in got:
            resumed_at = run.n
        if suspended_closed_at is None and spans_named(exporter, "worker.suspended"):
            suspended_closed_at = run.n
        if victim.status is RequestStatus.SUSPENDED:
            assert not spans_named(exporter, "worker.suspended")

    assert not spans_named(exporter, "worker.suspended")
    run.finish(watch)
    assert resumed_at is not None and suspended_closed_at == resumed_at > run.finish_step["p0"]

    (decision,) = spans_named(exporter, "scheduler.preemption")
    assert not spans_named(exporter, "scheduler.preemption_declined")
    a = decision.attributes
    assert a["preemption.decision_id"].startswith("pd-")
    assert a["preemption.trigger"] == "slot" and a["preemption.mode"] == "keep"
    assert a["preemption.declined"] is False
    assert a["preemption.victim.request_id"] == vid and a["preemption.victim.tier"] == "P3"
    assert a["preemption.victim.tenant"] == victim.tenant
    assert a["preemption.beneficiary.request_id"] == "p0" and a["preemption.beneficiary.tier"] == "P0"
    assert a["preemption.beneficiary.tenant"] == "chat"
    assert a["preemption.blocks_freed"] == 0 and a["preemption.bytes_moved"] == 0
    assert a["preemption.estimated_cost_s"] == 0.0
    # The state the decision was taken in: before the victim gave way and before the P0 took anything.
    assert a["kv.utilisation"] == pytest.approx(used_before / 256) and used_before > 4
    assert {t: a[f"scheduler.running.{t}"] for t in ("P0", "P1", "P2", "P3")} == {"P0": 0, "P1": 0, "P2": 0, "P3": 4}
    assert {t: a[f"scheduler.waiting.{t}"] for t in ("P0", "P1", "P2", "P3")} == {"P0": 1, "P1": 0, "P2": 0, "P3": 0}

    victim_span = request_span(exporter, vid)
    p0_span = request_span(exporter, "p0")
    assert victim_span.attributes["tenant.id"] == victim.tenant and p0_span.attributes["tenant.id"] == "chat"
    assert victim_span.attributes["request.preemptions"] == 1
    roles = {link.attributes.get("link.role"): link.context.span_id for link in decision.links}
    assert roles == {"victim": victim_span.context.span_id, "beneficiary": p0_span.context.span_id}
    assert all(link.context.trace_id in (victim_span.context.trace_id, p0_span.context.trace_id)
               for link in decision.links)
    # The victim's request span links back to the decision that preempted it.
    back = [link for link in victim_span.links if link.context.span_id == decision.context.span_id]
    assert len(back) == 1 and back[0].attributes.get("link.role") == "preempted_by"
    for rid in [r.request_id for r in running if r is not victim] + ["p0"]:
        assert not request_span(exporter, rid).links

    (susp,) = spans_named(exporter, "worker.suspended")
    assert susp.parent is not None and susp.parent.span_id == victim_span.context.span_id
    assert susp.context.trace_id == victim_span.context.trace_id
    sa = susp.attributes
    assert sa["suspend.decision_id"] == a["preemption.decision_id"]
    assert sa["suspend.by_request_id"] == "p0" and sa["suspend.by_tier"] == "P0"
    assert sa["suspend.by_tenant"] == "chat" and sa["suspend.mode"] == "keep" and sa["suspend.trigger"] == "slot"
    assert sa["request.id"] == vid and sa["tenant.id"] == victim.tenant
    assert [link.context.span_id for link in susp.links] == [decision.context.span_id]
    assert susp.end_time <= victim_span.end_time


@pytest.mark.parametrize("swap_space_mb,mode", [(16, "swap"), (0, "recompute")])
def test_kv_preemption_span(tiny_model_dir, swap_space_mb, mode):
    engine, run, exporter = kv_scenario(tiny_model_dir, trace=True, swap_space_mb=swap_space_mb,
                                        recompute_tokens_per_s=1.0)
    victim = min(engine.scheduler.running, key=lambda r: (r.num_computed_tokens, -r.arrival_seq))
    computed = victim.num_computed_tokens
    run.add("p0", KV_P0, KV_P0_PARAMS, "P0", tenant="t-high")
    run.step()
    run.finish()
    stats = engine.stats()
    spans = spans_named(exporter, "scheduler.preemption")
    assert len(spans) == sum(stats.preemptions.values()) + stats.demotions == 1
    a = spans[0].attributes
    bpb = engine.runner.bytes_per_block
    assert a["preemption.trigger"] == "kv_memory" and a["preemption.mode"] == mode
    assert a["preemption.victim.request_id"] == victim.request_id and a["preemption.victim.tenant"] == "t-low"
    assert a["preemption.beneficiary.request_id"] == "p0" and a["preemption.beneficiary.tenant"] == "t-high"
    assert a["preemption.blocks_freed"] == 4
    assert a["kv.utilisation"] == pytest.approx(12 / 13)  # the state the decision was taken in
    assert a["scheduler.running.P3"] == 3 and a["scheduler.waiting.P0"] == 1 and a["scheduler.waiting.P3"] == 0
    assert a["scheduler.running.P0"] == a["scheduler.running.P1"] == a["scheduler.running.P2"] == 0
    if mode == "swap":
        assert a["preemption.bytes_moved"] == 4 * bpb
        assert a["preemption.estimated_cost_s"] == pytest.approx(2 * 4 * bpb / 4e9)
    else:
        assert a["preemption.bytes_moved"] == 0
        assert a["preemption.estimated_cost_s"] == pytest.approx(computed / 1.0)
    assert a["preemption.cost.recompute_tokens"] == computed and a["preemption.cost.victim_blocks"] == 4
    victim_span = request_span(exporter, victim.request_id)
    assert [link.context.span_id for link in victim_span.links] == [spans[0].context.span_id]
    (susp,) = spans_named(exporter, "worker.suspended")
    assert susp.parent.span_id == victim_span.context.span_id
    assert susp.attributes["suspend.mode"] == mode and susp.attributes["suspend.by_request_id"] == "p0"
    assert susp.attributes["suspend.decision_id"] == a["preemption.decision_id"]


def test_manual_suspend_spans(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(num_kv_blocks=64, swap_space_mb=16))
    exporter = traced(engine)
    run = Run(engine)
    run.add("a", [5, 6, 7, 8], SamplingParams(max_tokens=10, ignore_eos=True), tenant="acme")
    run.add("b", [9, 10, 11], SamplingParams(max_tokens=10, ignore_eos=True))
    run.step()
    for rid, mode in (("a", "swap"), ("b", "recompute")):
        engine.suspend(rid, mode)
    with pytest.raises(ValueError):
        engine.suspend("a", "keep")  # no longer running
    run.step()
    run.step()
    engine.suspend("a", "keep")
    run.finish()
    decisions = spans_named(exporter, "scheduler.preemption")
    assert [(s.attributes["preemption.victim.request_id"], s.attributes["preemption.mode"]) for s in decisions] == [
        ("a", "swap"), ("b", "recompute"), ("a", "keep")]
    ids = [s.attributes["preemption.decision_id"] for s in decisions]
    assert len(set(ids)) == 3
    for s in decisions:
        assert s.attributes["preemption.trigger"] == "manual"
    assert decisions[0].attributes["preemption.victim.tenant"] == "acme"
    suspended = spans_named(exporter, "worker.suspended")
    assert sorted(s.attributes["suspend.decision_id"] for s in suspended) == sorted(ids)
    a_span, b_span = request_span(exporter, "a"), request_span(exporter, "b")
    assert len(a_span.links) == 2 and len(b_span.links) == 1
    for s in suspended:
        parent = a_span if s.attributes["request.id"] == "a" else b_span
        assert s.parent.span_id == parent.context.span_id


# -- suspends at any step (mid-prefill too), on every tier --------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("mode", ["keep", "swap", "keep+swap"])
def test_suspends_mid_prefill_on_every_tier_give_identical_tokens(tiny_model_dir, eq_baseline, mode, k):
    """Suspended every k steps it was scheduled in, including between prefill chunks; tiers P0..P3 (P0 and P1
    hold their whole footprint, so a swap moves only the computed part of a longer table). Recompute is left out
    here: restarting the prefill every k steps could starve a long prompt forever. A 24-token budget splits
    most prompts into several chunks (the greedy baseline equals transformers' generate, whatever the budget)."""
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(**{**EQ_CONFIG, "max_num_batched_tokens": 24}))
    run = Run(engine)
    for i, spec in enumerate(eq_specs("greedy")):
        run.add(*spec, tier=f"P{i % 4}")
    scheduled: Counter = Counter()
    done: Counter = Counter()
    mid_prefill = 0
    before: dict[str, int] = {}

    def suspend_some(got: set[str]) -> None:
        nonlocal mid_prefill
        for req in list(engine.scheduler.running):
            rid = req.request_id
            if req.num_computed_tokens != before.get(rid):
                scheduled[rid] += 1
            if scheduled[rid] < k:
                continue
            m = ("keep", "swap")[done.total() % 2] if mode == "keep+swap" else mode
            mid_prefill += req.num_computed_tokens < req.num_prompt_tokens
            engine.suspend(rid, m)
            scheduled[rid] = 0
            done[m] += 1
        before.clear()
        before.update({r.request_id: r.num_computed_tokens for r in engine.scheduler.running})

    run.finish(suspend_some)
    assert run.tokens == eq_baseline["greedy"]
    assert mid_prefill >= 3
    assert engine.stats().by_mode() == {m: done[m] for m in MODES}
    assert {tier for tier, _ in engine.stats().preemptions} == set(Tier)


# -- regressions -----------------------------------------------------------------------------------------------------------


def test_recompute_mid_prefill_counts_only_the_discarded_tokens(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=16))
    run = Run(engine)
    run.add("a", list(range(3, 63)), SamplingParams(max_tokens=4))  # 60 prompt tokens, 16 per step
    run.step()
    assert engine.get_request("a").num_computed_tokens == 16
    engine.suspend("a", "recompute")
    run.finish()
    stats = engine.stats()
    assert stats.wasted_tokens == 16
    assert stats.recomputed_tokens == 16  # only the discarded 16 are prefilled *again*


def test_abort_right_after_a_manual_suspend_leaves_no_span_open(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(num_kv_blocks=64, swap_space_mb=1))
    exporter = traced(engine)
    run = Run(engine)
    run.add("a", [5, 6, 7], SamplingParams(max_tokens=4))
    run.add("b", [8, 9, 10], SamplingParams(max_tokens=4))
    run.step()
    engine.suspend("a", "swap")
    assert engine.abort("a") is True
    del run.tokens["a"]  # aborted: it never finishes
    run.finish()  # drains, then asserts no span is left open
    assert not exporter.open_spans


def test_unchunked_p1_preempts_p3_decodes_for_the_token_budget_and_tokens_stay_identical(tiny_model_dir,
                                                                                        hf_reference):
    """Chunked prefill off: a P1 prompt that fits whole only in the budget the running P3 decodes leave waited
    until P3s finished (about 28 steps here). It now preempts just enough P3s (keep) and starts in the next step;
    every request's tokens are still transformers' greedy ones and every block comes back."""
    config = EngineConfig(max_num_seqs=8, num_kv_blocks=256, max_num_batched_tokens=48, max_model_len=48,
                          enable_chunked_prefill=False)
    run = Run(Engine.from_pretrained(tiny_model_dir, config))
    ps = prompts(6, seed=91, lo=2, hi=6)
    p3_params = SamplingParams(max_tokens=30)
    for i in range(6):
        run.add(f"p3-{i}", ps[i], p3_params, "P3")
    run.step()
    p1_prompt = prompts(1, seed=92, lo=44, hi=45)[0]  # 48 - 44: room for four of the six decodes
    run.add("p1", p1_prompt, SamplingParams(max_tokens=3, ignore_eos=True), "P1")
    assert "p1" in run.step()
    assert run.engine.stats().preemptions == Counter({(Tier.P3, PreemptMode.KEEP): 2})
    run.finish()
    assert run.tokens["p1"] == hf_greedy(hf_reference, p1_prompt, 3)
    for i in range(6):
        assert run.tokens[f"p3-{i}"] == hf_greedy(hf_reference, ps[i], 30), f"p3-{i}"


def test_a_request_that_gives_its_slot_and_its_blocks_to_two_others_names_both_in_its_suspended_span(tiny_model_dir):
    """In one step the P3 gives its slot to a P0 (keep) and then its blocks to a running P2 that must grow (the
    P0 reserve holds the free blocks back from it). Its worker.suspended span named only the P2: the "why was I
    slow" story lost the P0. The span now lists every decision and beneficiary, and links to each decision."""
    config = EngineConfig(max_num_seqs=2, num_kv_blocks=6, block_size=4, p0_reserve_blocks=2, swap_space_mb=0,
                          isolate_p0_prefill=False)
    engine = Engine.from_pretrained(tiny_model_dir, config)
    exporter = traced(engine)
    run = Run(engine)
    ps = prompts(3, seed=93, lo=8, hi=9)
    run.add("x", ps[0], SamplingParams(max_tokens=6, ignore_eos=True), "P2")
    run.add("v", ps[1], SamplingParams(max_tokens=6, ignore_eos=True), "P3")
    run.step()  # both prompts fill their two blocks; the free two are the P0 reserve
    run.add("a", ps[2][:4], SamplingParams(max_tokens=4, ignore_eos=True), "P0")
    run.step()
    decisions = {s.attributes["preemption.beneficiary.request_id"]: s for s in spans_named(
        exporter, "scheduler.preemption") if s.attributes["preemption.victim.request_id"] == "v"}
    assert set(decisions) == {"a", "x"}
    assert decisions["a"].attributes["preemption.mode"] == "keep"
    assert decisions["x"].attributes["preemption.mode"] == "recompute"
    run.finish()
    (susp,) = [s for s in spans_named(exporter, "worker.suspended") if s.attributes["request.id"] == "v"]
    sa = susp.attributes
    ids = [decisions[b].attributes["preemption.decision_id"] for b in ("a", "x")]
    assert list(sa["suspend.decision_ids"]) == ids and list(sa["suspend.by_request_ids"]) == ["a", "x"]
    # The single-valued attributes (what explain reads) name the decision that set the mode it was in.
    assert sa["suspend.decision_id"] == ids[1] and sa["suspend.by_request_id"] == "x"
    assert sa["suspend.mode"] == "recompute" and sa["suspend.trigger"] == "kv_memory"
    assert {lk.context.span_id for lk in susp.links} == {s.context.span_id for s in decisions.values()}


def test_a_keep_suspended_request_whose_blocks_go_later_says_so_in_its_suspended_span(tiny_model_dir):
    """The P3 gives its slot to a P0 (keep). The P2 beside it cannot grow past the P0 reserve and gives way itself;
    when the P0 is done, the P2 resumes on the P3's blocks (recompute), steps after the P3's suspended span opened.
    That span still said "keep, by the P0" when it ended: the recompute and its cause were missing. The open span
    takes up the later decision too."""
    config = EngineConfig(max_num_seqs=2, num_kv_blocks=6, block_size=4, p0_reserve_blocks=2, swap_space_mb=0,
                          isolate_p0_prefill=False)
    engine = Engine.from_pretrained(tiny_model_dir, config)
    exporter = traced(engine)
    run = Run(engine)
    ps = prompts(3, seed=93, lo=8, hi=9)
    run.add("x", ps[0][:7], SamplingParams(max_tokens=6, ignore_eos=True), "P2")
    run.add("v", ps[1], SamplingParams(max_tokens=6, ignore_eos=True), "P3")
    run.step()
    run.add("a", ps[2][:4], SamplingParams(max_tokens=4, ignore_eos=True), "P0", tenant="chat")
    run.step()
    assert engine.get_request("v").preempt_mode == "keep"
    run.finish()
    decisions = {s.attributes["preemption.beneficiary.request_id"]: s for s in spans_named(
        exporter, "scheduler.preemption") if s.attributes["preemption.victim.request_id"] == "v"}
    assert set(decisions) == {"a", "x"} and decisions["x"].attributes["preemption.mode"] == "recompute"
    assert decisions["x"].attributes["scheduler.step"] > decisions["a"].attributes["scheduler.step"]
    (susp,) = [s for s in spans_named(exporter, "worker.suspended") if s.attributes["request.id"] == "v"]
    sa = susp.attributes
    ids = [decisions[b].attributes["preemption.decision_id"] for b in ("a", "x")]
    assert list(sa["suspend.decision_ids"]) == ids and list(sa["suspend.by_request_ids"]) == ["a", "x"]
    assert sa["suspend.decision_id"] == ids[1] and sa["suspend.by_request_id"] == "x"
    assert sa["suspend.mode"] == "recompute" and sa["suspend.trigger"] == "kv_memory"
    assert sa.get("suspend.by_tenant", "") == ""  # x has none; "chat" was a's
    assert {lk.context.span_id for lk in susp.links} == {s.context.span_id for s in decisions.values()}
