"""The worker's steps in the wait model (gateway/estimate_steps.py): held work run out step by step, and the prefill
chunks of the jobs the model starts that lengthen it; and how the estimator takes a worker's report."""

from __future__ import annotations

import math

import pytest

from common import protocol as P
from common.tiers import Tier
from gateway.estimate import RUNNING, WAITING, Held, Queued, Rates, Work, WorkerView, wait_s
from gateway.estimate_dump import decode, encode
from gateway.estimate_steps import StepCost, chunk_pairs, interference_s, run_out
from gateway.workers import MAX_CONTEXT_TOKENS, reported_context, reported_step

P0, P1, P2, P3 = Tier.P0, Tier.P1, Tier.P2, Tier.P3
COST = StepCost(base_s=0.02, token_s=0.001)  # a decode step of 2 sequences: 0.022 s; a 1,000-token chunk: 1.02 s
RATES = Rates(prefill_tps=1000.0, decode_tps=50.0)  # what the token rates would say instead
BY_P0_P1 = 0b11


def held(tier: Tier, prefill: float, decode: float, mask: int = 0, guard: float = 0.0, status: int = RUNNING,
         context: float = 0.0) -> Held:
    return Held(Work(tier, prefill, decode), status, mask, guard, context)


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


PAIRS = StepCost(base_s=0.02, token_s=0.001, pair_s=1e-6)  # 1,000-token chunks: 1.52 s from 0, 2.52 s from 1,000


def test_a_prompts_later_chunks_cost_more_as_they_attend_to_what_came_before():
    ran = run_out([(2000, 1, 0)], PAIRS, 1000)
    first = 0.02 + 1.0 + 1e-6 * 1000 * 1001 / 2
    second = 0.02 + 1.0 + 1e-6 * (1000 * 1000 + 1000 * 1001 / 2)
    assert ran.step_left_s == pytest.approx(first) and ran.ends == pytest.approx([first + second])
    # A prompt the worker has half prefilled (1,000 tokens in its cache) has only the dearer chunk left.
    assert run_out([(1000, 1, 0, 1000)], PAIRS, 1000).ends == pytest.approx([second])
    # Without the pairs' cost (an older worker), both chunks cost the same.
    assert run_out([(2000, 1, 0)], COST, 1000).ends == pytest.approx([2 * 1.02])


def test_decode_steps_grow_with_their_contexts_and_a_job_sent_now_is_read_after_the_one_in_progress():
    # Two sequences at 500 and 1,500 tokens decode 10 and 30 more: each step attends one more pair per sequence.
    ran = run_out([(0, 10, 4, 500), (0, 30, 0, 1500)], PAIRS, 1000)
    steps, t, ctx = [], 0.0, [500, 1500]
    for n in range(30):
        live = [0, 1] if n < 10 else [1]
        steps.append(0.02 + 0.001 * len(live) + 1e-6 * sum(ctx[j] + 1 for j in live))
        for j in live:
            ctx[j] += 1
    assert ran.ends == pytest.approx([sum(steps[:10]), sum(steps)])
    assert ran.guards[0] == pytest.approx(sum(steps[:4]))
    for age in (0.0, 0.05, sum(steps[:7]) + 1e-9, sum(steps[:12]) + 0.003):
        at = run_out([(0, 10, 4, 500), (0, 30, 0, 1500)], PAIRS, 1000, age_s=age)
        done = next(k for k in range(31) if sum(steps[:k + 1]) > age)  # the step in progress at ``age``
        assert at.step_left_s == pytest.approx(sum(steps[:done + 1]) - age)


def _stepped(jobs, cost, budget, age_s):
    """run_out's answer worked out one step at a time, the way a worker runs them, each pair counted one position at
    a time: the reference it must match."""
    seqs = [{"prefill": p, "decode": d, "guard": g, "ctx": c, "made": 0, "end": None, "guarded": None}
            for p, d, g, c in jobs]
    for q in seqs:
        if q["prefill"] <= 0 and q["decode"] <= 0:
            q["end"] = 0.0
        if q["guard"] <= 0:
            q["guarded"] = 0.0
    clock, left = 0.0, 0.0
    while any(q["end"] is None for q in seqs):
        batch = []  # (sequence, positions it computes this step)
        room = budget
        for q in seqs:
            if q["end"] is None and room > 0:
                n = 1 if q["prefill"] <= 0 else min(q["prefill"], room)
                batch.append((q, n))
                room -= n
        pairs = sum(sum(range(q["ctx"] + 1, q["ctx"] + n + 1)) for q, n in batch)  # position k attends k keys
        seconds = cost.base_s + cost.token_s * sum(n for _, n in batch) + cost.pair_s * pairs
        if clock <= age_s < clock + seconds:
            left = clock + seconds - age_s
        clock += seconds
        for q, n in batch:
            q["ctx"] += n
            if q["prefill"] > 0:
                q["prefill"] -= n
                if q["prefill"] > 0:
                    continue  # more chunks to come: no token yet
            q["made"] += 1
            q["decode"] -= 1
            if q["guarded"] is None and q["made"] >= q["guard"]:
                q["guarded"] = clock
            if q["decode"] <= 0:
                q["end"] = clock
    return ([max(0.0, q["end"] - age_s) for q in seqs],
            [max(0.0, min(q["guarded"] if q["guarded"] is not None else math.inf, q["end"]) - age_s) for q in seqs],
            left)


def test_run_out_matches_a_worker_stepped_one_step_at_a_time_on_random_work():
    # Random held work, including the cases that break a shortcut: prompts longer than many budgets, a budget of
    # one token, contexts past a thousand, ages inside long decode runs and past the end, guards past the end.
    import random

    rng = random.Random(12)
    for _ in range(300):
        cost = StepCost(rng.choice([0.0, 0.02]), rng.choice([0.0, 0.001]) or 0.0005, rng.choice([0.0, 1e-6, 3e-7]))
        budget = rng.choice([1, 7, 256, 1000])
        jobs = [(rng.choice([0, 0, rng.randint(1, 5000)]), rng.randint(0, 60), rng.randint(0, 70),
                 rng.choice([0, rng.randint(1, 3000)])) for _ in range(rng.randint(0, 4))]
        jobs = [(p, d, g, c) for p, d, g, c in jobs if budget >= 1]
        age = rng.choice([0.0, rng.uniform(0, 2), rng.uniform(0, 30), 1e4])
        ran = run_out(jobs, cost, budget, age)
        ends, guards, left = _stepped(jobs, cost, budget, age)
        assert ran.ends == pytest.approx(ends, abs=1e-9) and ran.guards == pytest.approx(guards, abs=1e-9)
        assert ran.step_left_s == pytest.approx(left, abs=1e-9)


def test_a_waiting_prompt_and_a_dispatched_one_cost_their_pairs_too():
    # A P0 sent to a worker whose waiting P3 prompt has 1,000 of its tokens in the cache (its second chunk next):
    # it is read after that chunk's step, dearer than a first chunk.
    w = WorkerView(1, RATES, [held(P3, 1000, 10, BY_P0_P1, status=WAITING, context=1000)], step_tokens=1000,
                   step=PAIRS)
    assert w.run_out()[1] == pytest.approx(0.02 + 1.0 + 1e-6 * chunk_pairs(1000, 1000))
    # A prompt started beside running work lengthens it by its tokens and the pairs they attend.
    assert w.interference_s(Work(P2, 2000, 10)) == pytest.approx(interference_s(PAIRS, 2000))
    assert interference_s(PAIRS, 2000) == pytest.approx(2.0 + 1e-6 * 2000 * 2001 / 2)
    assert interference_s(PAIRS, -5) == 0.0


@pytest.mark.parametrize("entry, context", [([3, 0, 0, 5, 10, 3, 0], 0), ([3, 0, 0, 5, 10, 3, 0, 700], 700),
                                            ([3, 0, 0, 5, 10, 3, 0, -1], 0), ([3, 0, 0, 5, 10, 3, 0, 1.5], 0),
                                            ([3, 0, 0, 5, 10, 3, 0, True], 0), ([3, 0, 0, 5, 10, 3, 0, "x"], 0),
                                            ([3, 0, 0, 5, 10, 3, 0, MAX_CONTEXT_TOKENS + 1], 0)])
def test_a_jobs_reported_context_is_believed_only_where_it_makes_sense(entry, context):
    assert reported_context(entry) == context


@pytest.mark.parametrize("base, token, pair", [(0.0, 0.0, 0.0), (0.0, 0.0, 1e-6), (math.nan, 0.001, 0.0),
                                               (0.02, math.inf, 0.0), (-0.01, 0.001, 0.0), (0.02, -0.001, 0.0),
                                               (1e300, 0.001, 0.0), (0.02, math.nan, 0.0), (0.02, 0.001, math.nan),
                                               (0.02, 0.001, -1e-6), (0.02, 0.001, 1e300)])
def test_a_report_without_a_usable_step_cost_keeps_the_token_rates(base, token, pair):
    load = P.WorkerLoad("w", 0, 0, {}, {}, [], 0.0, step_base_s=base, step_token_s=token, step_pair_s=pair)
    assert reported_step(load) is None
    assert reported_step(None) is None
    assert reported_step(P.WorkerLoad("w", 0, 0, {}, {}, [], 0.0, step_base_s=0.02, step_token_s=0.001)) == \
        StepCost(0.02, 0.001)
    assert reported_step(P.WorkerLoad("w", 0, 0, {}, {}, [], 0.0, step_base_s=0.02, step_token_s=0.001,
                                      step_pair_s=1e-6)) == PAIRS


def test_the_dump_keeps_the_step_cost_and_reads_dumps_without_one():
    w = WorkerView(2, RATES, [held(P3, 0, 20, BY_P0_P1, context=812)], step_tokens=1000, step=PAIRS)
    line = encode(1.5, 1.0, 10.0, P2, [w, WorkerView(1, RATES)], [], [], {})
    back = decode({"job_id": "j", **line})
    assert back.workers[0].step == PAIRS and back.workers[1].step is None
    assert back.workers[0].held[0].context == 812
    line["workers"][0]["step"] = [0.02, 0.001]  # a dump from before the pairs' cost: none
    line["workers"][0]["held"][0] = line["workers"][0]["held"][0][:6]  # nor contexts
    back = decode({"job_id": "j", **line})
    assert back.workers[0].step == COST and back.workers[0].held[0].context == 0.0
    del line["workers"][0]["step"]  # a dump from before workers reported it
    assert decode({"job_id": "j", **line}).workers[0].step is None
