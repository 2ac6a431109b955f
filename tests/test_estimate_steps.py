"""The worker's steps in the wait model (gateway/estimate_steps.py): held work run out step by step, and the prefill
chunks of the jobs the model starts that lengthen it; and how the estimator takes a worker's report."""

from __future__ import annotations

import math

import pytest

from common import protocol as P
from common.tiers import Tier
from gateway.estimate import RUNNING, WAITING, Held, Queued, Rates, Work, WorkerView, wait_s
from gateway.estimate_dump import decode, encode
from gateway.estimate_steps import StepCost, run_out
from gateway.workers import reported_step

P0, P1, P2, P3 = Tier.P0, Tier.P1, Tier.P2, Tier.P3
COST = StepCost(base_s=0.02, token_s=0.001)  # a decode step of 2 sequences: 0.022 s; a 1,000-token chunk: 1.02 s
RATES = Rates(prefill_tps=1000.0, decode_tps=50.0)  # what the token rates would say instead
BY_P0_P1 = 0b11


def held(tier: Tier, prefill: float, decode: float, mask: int = 0, guard: float = 0.0, status: int = RUNNING) -> Held:
    return Held(Work(tier, prefill, decode), status, mask, guard)


def test_decoding_work_runs_out_a_step_a_token_faster_as_the_batch_empties():
    ran = run_out([(0, 10, 0), (0, 30, 0)], COST, 1024)
    # 10 steps of two sequences, then 20 of one.
    assert ran.ends == pytest.approx([10 * 0.022, 10 * 0.022 + 20 * 0.021])
    assert ran.step_left_s == pytest.approx(0.022)  # a job sent now is read after the step starting now


def test_a_prompt_prefilled_in_chunks_holds_back_the_decoding_job_beside_it():
    # The decoding job is older, so it takes its token first; the prompt takes the rest of each step's budget.
    ran = run_out([(0, 5, 0), (2500, 3, 0)], COST, 1000)
    chunks = [0.02 + 0.001 * 1000, 0.02 + 0.001 * 1000, 0.02 + 0.001 * 503]  # 999 + 1, 999 + 1, 502 + 1 tokens
    assert ran.step_left_s == pytest.approx(chunks[0])
    assert ran.ends[0] == pytest.approx(sum(chunks) + 2 * 0.022)  # 3 tokens in the chunks' steps, then 2 more
    assert ran.ends[1] == pytest.approx(sum(chunks) + 2 * 0.022)  # its first token with its last chunk, then 2
    # Two prompts: the older one takes the whole budget first (the worker's order), the newer one waits for it.
    ran = run_out([(1500, 1, 0), (100, 1, 0)], COST, 1000)
    assert ran.ends[0] == pytest.approx(1.02 + 0.02 + 0.001 * 600)  # 1000, then 500 beside the other's 100
    assert ran.ends[1] == ran.ends[0]


def test_guards_fractions_and_nothing_left():
    ran = run_out([(0, 10, 4), (0, 2.3, 0), (0, 0, 0)], COST, 1024)
    assert ran.ends[2] == 0.0 and ran.guards[2] == 0.0  # nothing left: free now
    assert ran.ends[1] == pytest.approx(3 * 0.022)  # 2.3 tokens expected: the worker draws 3
    assert ran.guards[0] == pytest.approx(3 * 0.022 + 0.021)  # its 4th token, the last 1 alone
    assert run_out([], COST, 1024).ends == []


def test_a_short_job_beside_a_long_prompt_frees_its_slot_after_the_prompt_not_at_the_token_rates():
    # A P2 behind two running P3s: one decoding 20 tokens beside another's 3,000-token prompt. At the token rates
    # the decoding one ends in 0.4 s (and the P2 joins after the chunk then in progress, at 1 s); stepped, it
    # waits out the prompt's chunks (about 3 s) first.
    w = WorkerView(2, RATES, [held(P3, 0, 20, BY_P0_P1), held(P3, 3000, 100, BY_P0_P1)], step_tokens=1000)
    assert wait_s(P2, [w]) == pytest.approx(1.0)
    w.step = COST
    ran = run_out([(0, 20, 0), (3000, 100, 0)], COST, 1000)
    assert wait_s(P2, [w]) == pytest.approx(min(ran.ends)) and min(ran.ends) > 3.0
    # A P0 preempts at once, but joins after the chunk in progress.
    assert wait_s(P0, [w]) == pytest.approx(ran.step_left_s)


def test_a_dispatched_prompt_lengthens_the_work_beside_it():
    # One worker, two slots: a P3 decoding 100 tokens, a free slot. A queued P2 with a 2,000-token prompt goes to
    # the free slot; the P2 behind it waits for the P3, whose steps now batch that prompt's chunks too.
    w = WorkerView(2, RATES, [held(P3, 0, 100, BY_P0_P1)], step_tokens=1000, step=COST)
    ahead = [Queued(Work(P2, 2000, 500), -1.0)]
    alone = run_out([(0, 100, 0)], COST, 1000).ends[0]
    assert wait_s(P2, [w], ahead) == pytest.approx(alone + 2000 * COST.token_s)
    # Without a step cost nothing lengthens: the P3's 100 tokens at 50 a second.
    w = WorkerView(2, RATES, [held(P3, 0, 100, BY_P0_P1)], step_tokens=1000)
    assert wait_s(P2, [w], ahead) == pytest.approx(2.0)


def test_waiting_work_that_starts_next_step_is_stepped_with_the_running_work():
    w = WorkerView(2, RATES, [held(P3, 0, 10, BY_P0_P1), held(P3, 500, 10, BY_P0_P1, status=WAITING)],
                   step_tokens=1000, step=COST)
    ran = run_out([(0, 10, 0), (500, 10, 0)], COST, 1000)
    assert wait_s(P2, [w]) == pytest.approx(min(ran.ends))
    assert w.run_out()[1] == pytest.approx(0.02 + 0.001 * 501)  # the waiting prompt's first step, beside a token


def test_work_reported_a_while_ago_has_run_on_and_a_step_is_in_progress():
    # Reported 0.5 s ago: a job decoding 10 tokens beside a 1,500-token prompt (steps of 1 + 999 and 1 + 501).
    jobs = [(0, 10, 0), (1500, 20, 0)]
    now = run_out(jobs, COST, 1000)
    later = run_out(jobs, COST, 1000, age_s=0.5)
    assert later.ends == pytest.approx([e - 0.5 for e in now.ends])
    assert later.step_left_s == pytest.approx(1.02 - 0.5)  # the first chunk's step, 0.5 s in
    later = run_out(jobs, COST, 1000, age_s=1.6)  # past both chunks (1.02 + 0.522 s), in a decode step
    assert later.step_left_s == pytest.approx(0.022 - (1.6 - 1.542) % 0.022)
    assert run_out(jobs, COST, 1000, age_s=60).ends == [0.0, 0.0]  # all done by now: free
    assert run_out(jobs, COST, 1000, age_s=60).step_left_s == 0.0  # and idle


def test_a_free_slot_goes_before_a_preemption_as_the_dispatcher_has_it():
    # Worker 0 is full, one of its jobs a P3 a P1 may preempt at once; worker 1 has a free slot beside a prompt
    # being prefilled. The dispatcher sends a P1 to the free slot (it preempts only where every worker is full),
    # where it waits for the chunk in progress.
    full = WorkerView(2, RATES, [held(P2, 0, 100, 0b01), held(P3, 0, 100, BY_P0_P1)], handoff_s=0.05,
                      step_tokens=1000, step=COST)
    prefilling = WorkerView(2, RATES, [held(P3, 2000, 100, BY_P0_P1)], handoff_s=0.05, step_tokens=1000, step=COST)
    assert wait_s(P1, [full, prefilling]) == pytest.approx(1.02)
    assert wait_s(P1, [prefilling, full]) == pytest.approx(1.02)  # whatever the workers' order
    assert wait_s(P1, [full]) == pytest.approx(0.05)  # no free slot anywhere: it preempts the P3


@pytest.mark.parametrize("base, token", [(0.0, 0.0), (math.nan, 0.001), (0.02, math.inf), (-0.01, 0.001),
                                         (0.02, -0.001), (1e300, 0.001), (0.02, math.nan)])
def test_a_report_without_a_usable_step_cost_keeps_the_token_rates(base, token):
    load = P.WorkerLoad("w", 0, 0, {}, {}, [], 0.0, step_base_s=base, step_token_s=token)
    assert reported_step(load) is None
    assert reported_step(None) is None
    assert reported_step(P.WorkerLoad("w", 0, 0, {}, {}, [], 0.0, step_base_s=0.02, step_token_s=0.001)) == \
        StepCost(0.02, 0.001)


def test_the_dump_keeps_the_step_cost_and_reads_dumps_without_one():
    w = WorkerView(2, RATES, [held(P3, 0, 20, BY_P0_P1)], step_tokens=1000, step=COST)
    line = encode(1.5, 1.0, 10.0, P2, [w, WorkerView(1, RATES)], [], [], {})
    back = decode({"job_id": "j", **line})
    assert back.workers[0].step == COST and back.workers[1].step is None
    del line["workers"][0]["step"]  # a dump from before workers reported it
    assert decode({"job_id": "j", **line}).workers[0].step is None
