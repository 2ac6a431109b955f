"""Priority preemption on the pure scheduler: decisions, guards, modes, and the invariants under random traces."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.tiers import Tier
from worker.block_manager import BlockManager
from worker.config import SchedulerConfig
from worker.policy import PriorityPolicy
from worker.preemption import DeclineReason, PreemptionConfig, PreemptMode, Trigger
from worker.request import Request, RequestStatus, SamplingParams
from worker.scheduler import Scheduler
from worker.simulator import Arrival, Case, max_blocks_for_tier, random_case, run_case, simulate

_seq = iter(range(1, 10**9))


def req(rid: str, tier: Tier, prompt: int = 8, max_tokens: int = 32) -> Request:
    n = next(_seq)
    return Request(rid, [7] * prompt, SamplingParams(max_tokens=max_tokens), tier, n, seed=n)


def sched(num_blocks=64, block_size=4, max_num_seqs=2, budget=64, **pc) -> Scheduler:
    pc.setdefault("bytes_per_block", 1024)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=4096),
                     BlockManager(num_blocks, block_size), PriorityPolicy(), PreemptionConfig(**pc))


def step(s: Scheduler):
    out = s.schedule()
    s.postprocess(out, {c.request.request_id: 9 for c in out.chunks if c.sample})
    return out


def test_p0_takes_a_slot_from_p3_by_keep_in_the_same_step():
    s = sched(max_num_seqs=2)
    a, b = req("a", Tier.P3), req("b", Tier.P3)
    s.add(a), s.add(b)
    step(s), step(s)
    p0 = req("p0", Tier.P0)
    s.add(p0)
    out = step(s)
    assert [d.mode for d in out.decisions] == [PreemptMode.KEEP]
    d = out.decisions[0]
    assert d.trigger is Trigger.SLOT and d.beneficiary_id == "p0" and d.victim_tier is Tier.P3
    assert d.victim_id == "b"  # same tier and progress: the later arrival gives way
    assert any(c.request is p0 for c in out.chunks)
    assert b.status is RequestStatus.SUSPENDED and s.blocks.has_blocks("b")  # keep: KV stays resident
    assert s.stats.wasted_tokens == 0 and s.stats.bytes_swapped == 0
    # b resumes when a slot frees, before any newer P3, with its KV intact.
    computed = b.num_computed_tokens
    late = req("late", Tier.P3)
    s.add(late)
    while b.status is not RequestStatus.RUNNING:
        step(s)
    assert b.last_resume_step == s.step_index and late.status is RequestStatus.WAITING
    assert b.num_computed_tokens == computed + 1  # resumed where it stopped: one decode, no re-prefill
    assert d.running_per_tier["P3"] == 2 and d.waiting_per_tier["P0"] == 1  # the state it was decided in


def test_p1_never_preempts_p2_and_says_so_once():
    s = sched(max_num_seqs=1)
    p2 = req("p2", Tier.P2, max_tokens=20)
    s.add(p2)
    step(s)
    p1 = req("p1", Tier.P1)
    s.add(p1)
    declined = [d for _ in range(10) for d in step(s).decisions]
    assert len(declined) == 1 and declined[0].declined
    assert declined[0].declined_reason is DeclineReason.NO_LOWER_TIER and declined[0].beneficiary_id == "p1"
    assert p2.status is RequestStatus.RUNNING and p1.status is RequestStatus.WAITING


def test_progress_and_residency_guards():
    s = sched(max_num_seqs=1, guard_remaining_tokens=4, min_residency_steps=5)
    near = req("near", Tier.P3, max_tokens=6)
    s.add(near)
    step(s), step(s)  # 2 generated, 4 left: guarded
    s.add(req("p0", Tier.P0))
    out = step(s)
    assert [d.declined_reason for d in out.decisions] == [DeclineReason.PROGRESS]
    assert near.status is RequestStatus.RUNNING

    s = sched(max_num_seqs=1, guard_remaining_tokens=0, min_residency_steps=5)
    victim = req("victim", Tier.P3, max_tokens=50)
    s.add(victim)
    step(s)
    s.add(req("first", Tier.P0, max_tokens=1))
    assert step(s).decisions[0].victim_id == "victim"
    step(s)  # "first" produced its only token and left; the victim resumes
    assert victim.last_resume_step == s.step_index
    s.add(req("second", Tier.P0))
    decisions = [d for _ in range(4) for d in step(s).decisions]
    assert [d.declined_reason for d in decisions] == [DeclineReason.RESIDENCY]
    while victim.status is RequestStatus.RUNNING:
        step(s)
    assert s.step_index - victim.last_resume_step >= 5


@pytest.mark.parametrize("recompute_tokens_per_s,swap_space_blocks,expected", [
    (1.0, 64, PreemptMode.SWAP),  # recompute is slow and the host has room
    (1e12, 64, PreemptMode.RECOMPUTE),  # recompute is nearly free
    (1.0, 0, PreemptMode.RECOMPUTE),  # no host pool
])
def test_kv_bound_preemption_chooses_mode_by_cost(recompute_tokens_per_s, swap_space_blocks, expected):
    s = sched(num_blocks=8, block_size=4, max_num_seqs=4, recompute_tokens_per_s=recompute_tokens_per_s,
              swap_space_blocks=swap_space_blocks)
    big = req("big", Tier.P3, prompt=24, max_tokens=8)  # 6 of the 8 blocks
    s.add(big)
    step(s)
    p0 = req("p0", Tier.P0, prompt=8, max_tokens=4)  # its footprint is 3 blocks
    s.add(p0)
    out = step(s)
    d = out.decisions[0]
    assert d.trigger is Trigger.KV_MEMORY and d.mode is expected and d.blocks_freed == 6
    assert d.cost_inputs["recompute_tokens"] == 24 and d.estimated_cost_s >= 0
    assert any(c.request is p0 for c in out.chunks)
    if expected is PreemptMode.SWAP:
        assert out.copies and out.copies[0].to_host and d.bytes_moved == 6 * 1024
    else:
        assert big.num_computed_tokens == 0 and s.stats.wasted_tokens == 24


def test_p0_reserve_and_low_tier_share():
    s = sched(num_blocks=10, block_size=4, max_num_seqs=8, p0_reserve_blocks=3, low_tier_kv_share=0.5)
    p3 = [req(f"p3-{i}", Tier.P3, prompt=8, max_tokens=2) for i in range(4)]  # 3 blocks each at the end
    for r in p3:
        s.add(r)
    out = step(s)
    # The low-tier share (5 blocks) admits two 2-block prompts, not three.
    assert len(out.chunks) == 2
    p1 = req("p1", Tier.P1, prompt=4, max_tokens=4)  # 2 blocks, never from the P0 reserve
    p0 = req("p0", Tier.P0, prompt=8, max_tokens=4)  # 3 blocks
    s.add(p1), s.add(p0)
    out = step(s)
    assert p0.status is RequestStatus.RUNNING
    # p1 fits the raw free blocks but not outside the reserve; the P3s are one token from done.
    assert p1.status is RequestStatus.WAITING
    assert [(d.trigger, d.declined_reason) for d in out.decisions if d.declined] == [
        (Trigger.RESERVE, DeclineReason.PROGRESS)]
    for _ in range(20):
        non_p0 = sum(len(s.blocks.block_table(r.request_id)) for r in s.running + s.waiting if r.tier is not Tier.P0)
        low = sum(len(s.blocks.block_table(r.request_id)) for r in s.running + s.waiting if r.tier is Tier.P3)
        assert non_p0 <= 10 - 3 and low <= 5
        step(s)
    assert not s.has_unfinished() and p1.output_token_ids == [9] * 4


def test_keep_suspended_blocks_are_reclaimed_when_memory_runs_out():
    # A P3 suspended in keep mode holds blocks; a P0 that needs them must get them (no deadlock).
    s = sched(num_blocks=6, block_size=4, max_num_seqs=1, guard_remaining_tokens=0)
    p3 = req("p3", Tier.P3, prompt=12, max_tokens=8)
    s.add(p3)
    step(s)
    s.add(req("chat", Tier.P0, prompt=4, max_tokens=2))  # slot only: keep
    out = step(s)
    assert out.decisions[0].mode is PreemptMode.KEEP
    s.add(req("chat2", Tier.P0, prompt=8, max_tokens=8))  # 4 blocks: only p3's kept blocks can make room
    for _ in range(40):
        if not s.has_unfinished():
            break
        step(s)
    assert not s.has_unfinished() and s.blocks.num_free == 6
    assert s.stats.demotions >= 1 and p3.output_token_ids == [9] * 8


# -- invariants under random traces (the same checks scripts/simulate.py runs) ----------------------------------


@st.composite
def cases(draw) -> Case:
    block_size = draw(st.sampled_from([2, 4, 16]))
    num_blocks = draw(st.integers(4, 40))
    pc = PreemptionConfig(
        min_residency_steps=draw(st.integers(0, 10)), guard_remaining_tokens=draw(st.integers(0, 8)),
        guard_max_generated=draw(st.one_of(st.none(), st.integers(0, 30))),
        p0_reserve_blocks=draw(st.integers(0, 2)), low_tier_kv_share=draw(st.sampled_from([1.0, 0.8, 0.6])),
        swap_space_blocks=draw(st.sampled_from([0, 3, 50])), bytes_per_block=draw(st.sampled_from([1, 2**20])),
        recompute_tokens_per_s=draw(st.sampled_from([1.0, 1e9])))
    sched = SchedulerConfig(max_num_seqs=draw(st.integers(1, 6)), max_num_batched_tokens=draw(st.sampled_from(
        [4, 16, 64])), max_model_len=4096, isolate_p0_prefill=draw(st.booleans()))
    arrivals = []
    for i in range(draw(st.integers(1, 16))):
        tier = draw(st.sampled_from(list(Tier)))
        cap = max_blocks_for_tier(tier, num_blocks, pc) * block_size
        if cap < 2:
            continue
        prompt = draw(st.integers(1, min(cap - 1, 48)))
        arrivals.append(Arrival(f"h{i}", draw(st.floats(0, 0.2)), prompt,
                                draw(st.integers(1, min(cap - prompt, 24))), tier))
    return Case(arrivals, num_blocks, block_size, sched, pc, draw(st.sampled_from(["priority", "fifo"])))


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_invariants_hold_on_random_traces(case):
    res = run_case(case)
    assert res.violations == []
    assert set(res.finished) == {a.request_id for a in case.arrivals}


def test_the_invariant_checker_catches_a_scheduler_that_preempts_p0(monkeypatch):
    # Guard against a checker that cannot fail: let every tier preempt every other while
    # `preemptible` still says P0 is safe; the simulator must report the P0 preemption.
    monkeypatch.setattr(PreemptionConfig, "may_preempt", lambda self, a, v: True)
    res = simulate([Arrival("old", 0.0, 8, 40, Tier.P0), Arrival("new", 0.05, 4, 4, Tier.P0)],
                   sched=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=4096),
                   preemption=PreemptionConfig(bytes_per_block=1, guard_remaining_tokens=0))
    assert any("P0 request old preempted" in v for v in res.violations)


def test_simulator_random_cases_are_clean():
    rng = random.Random(1234)
    for _ in range(200):
        assert run_case(random_case(rng)).violations == []


def test_isolated_p0_prefill_runs_in_a_step_of_its_own():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=4096,
                                  isolate_p0_prefill=True),
                  BlockManager(64, 4), PriorityPolicy(), PreemptionConfig(bytes_per_block=1))
    p3 = [req(f"p3-{i}", Tier.P3) for i in range(2)]
    for r in p3:
        s.add(r)
    step(s)
    p0 = req("p0", Tier.P0, prompt=12)
    s.add(p0)
    out = step(s)
    assert [c.request for c in out.chunks] == [p0]  # the decodes wait this one step
    out = step(s)
    assert {c.request.request_id for c in out.chunks} == {"p0", "p3-0", "p3-1"}
    # Without isolation the P0's prefill shares the step with the decodes.
    s2 = sched(max_num_seqs=4)
    for r in [req(f"q3-{i}", Tier.P3) for i in range(2)]:
        s2.add(r)
    step(s2)
    s2.add(req("q0", Tier.P0, prompt=12))
    assert len(step(s2).chunks) == 3


@pytest.mark.parametrize("head_tier", [Tier.P0, Tier.P1])
def test_a_waiting_urgent_request_starts_in_the_next_step_beside_long_lower_tier_prefills(head_tier):
    """Without isolation, running P3 prompts mid-prefill took the whole token budget before the waiting list
    was looked at: an urgent request with a free slot and blocks waited until every one of them had finished
    its prompt (13 steps here). Now it starts in the next step, and the prefills go on with what is left."""
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=4096),
                  BlockManager(512, 4), PriorityPolicy(), PreemptionConfig(bytes_per_block=1))
    long = [req(f"p3-{i}", Tier.P3, prompt=400, max_tokens=4) for i in range(2)]
    for r in long:
        s.add(r)
    step(s)
    urgent = req("urgent", head_tier, prompt=12)
    s.add(urgent)
    out = step(s)
    assert urgent in [c.request for c in out.chunks]
    assert sum(c.num_tokens for c in out.chunks) == 64  # the budget is still used in full
    assert any(c.request in long for c in out.chunks)  # the prefills go on beside it
    for _ in range(100):
        if not s.has_unfinished():
            break
        step(s)
    assert all(r.status is RequestStatus.FINISHED for r in long + [urgent])


def _unchunked(num_seqs: int, budget: int, **pc) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=budget, max_model_len=budget,
                                     enable_chunked_prefill=False),
                     BlockManager(256, 4), PriorityPolicy(), PreemptionConfig(bytes_per_block=1, **pc))


def test_unchunked_p1_preempts_just_enough_p3_decodes_to_fit_its_prompt_in_the_budget():
    """Without chunked prefill a P1 prompt must fit whole in what the running decodes leave of the step's budget.
    It waited for the P3s to finish (9 steps here), although it may preempt them: it now takes the budget of as
    few P3s as it needs (keep: their KV stays), and starts in the step it is first looked at."""
    s = _unchunked(num_seqs=8, budget=16)
    p3 = [req(f"p3-{i}", Tier.P3, prompt=1, max_tokens=10) for i in range(6)]
    for r in p3:
        s.add(r)
    step(s)
    p1 = req("p1", Tier.P1, prompt=13, max_tokens=2)
    s.add(p1)
    out = step(s)
    assert p1 in [c.request for c in out.chunks]
    assert out.num_batched_tokens <= 16
    taken = [d for d in out.decisions if not d.declined]
    assert len(taken) == 3 and {d.mode for d in taken} == {PreemptMode.KEEP}  # 16 - 13 leaves room for 3 decodes
    assert {d.trigger for d in taken} == {Trigger.BUDGET} and {d.victim_tier for d in taken} == {Tier.P3}
    assert all(s.blocks.has_blocks(d.victim_id) for d in taken)
    for _ in range(60):
        if not s.has_unfinished():
            break
        step(s)
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in p3 + [p1])
    assert s.blocks.num_free == s.blocks.num_blocks


def test_unchunked_budget_preemption_respects_the_guards_and_takes_nothing_in_vain():
    """Victims the guards protect are not counted; when the others cannot free enough of the budget, nobody gives
    way (a preemption that does not let the P1 start would only slow the P3s) and one declined decision says why."""
    s = _unchunked(num_seqs=8, budget=16, guard_remaining_tokens=4)
    near_done = [req(f"near-{i}", Tier.P3, prompt=1, max_tokens=5) for i in range(4)]
    far = [req(f"far-{i}", Tier.P3, prompt=1, max_tokens=30) for i in range(2)]
    for r in near_done + far:
        s.add(r)
    step(s)
    s.add(req("p1", Tier.P1, prompt=13, max_tokens=2))  # needs 3 of the 6 decodes gone; only 2 may go
    out = step(s)
    assert [c.request.request_id for c in out.chunks if c.request.request_id == "p1"] == []
    assert [d.declined_reason for d in out.decisions] == [DeclineReason.INSUFFICIENT]
    assert not out.preempted
