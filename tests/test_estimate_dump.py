"""The estimate dump (gateway/estimate_dump.py) and its replay (scripts/estimate_replay.py): what the wait model saw
at each admission, written by a real gateway, must give back exactly the estimate it told, for the admitted job it
is filed under, or comparing models on it compares nothing."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time

import pytest

from common.errors import QuotaExceeded
from common.tiers import Tier
from gateway import estimate_dump
from gateway.estimate import (RUNNING, SUSPENDED, WAITING, Arrivals, Held, Queued, Rates, Work, WorkerView,
                              replay)
from gateway.estimate_futures import told_wait_s
from gateway.estimate_steps import StepCost
from gateway.sdk import GatewayClient
from scripts import estimate_replay
from tests.cluster_helpers import job_hash, local_cluster, wait_for

P0, P1, P2, P3 = Tier.P0, Tier.P1, Tier.P2, Tier.P3


def strict_json(text: str):
    """JSON as the standard has it: Python's Infinity and NaN are not JSON, and other readers refuse them."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def random_state(rng: random.Random):
    tier = rng.choice([P1, P2, P3])
    workers = [WorkerView(rng.randint(1, 4), Rates(rng.uniform(200, 2000), rng.uniform(10, 60)),
                          [Held(Work(rng.choice([P0, P1, P2, P3]), rng.choice([0.0, rng.uniform(0, 900)]),
                                     rng.uniform(1, 300)), rng.choice([RUNNING, SUSPENDED, WAITING]),
                                rng.choice([0, 0b01, 0b11]), rng.choice([0.0, float(rng.randint(1, 16))]))
                           for _ in range(rng.randint(0, 6))],
                          rng.uniform(0, 0.5), rng.uniform(0, 0.05), rng.choice([math.inf, rng.randint(16, 2048)]),
                          *rng.choice([(), (StepCost(rng.uniform(0, 0.05), rng.uniform(0, 0.002)), rng.uniform(0, 1))]))
               for _ in range(rng.randint(1, 3))]  # a worker that reports its step cost, or one that does not
    queued = [Queued(Work(rng.choice([P0, P1, P2, P3]), rng.uniform(1, 900), rng.uniform(1, 300)),
                     -rng.uniform(0, 200), rng.choice([math.inf, rng.uniform(-30, 60)]))
              for _ in range(rng.randint(0, 90))]
    arrivals = [Arrivals(Work(t, rng.uniform(0, 900), rng.uniform(0, 300)), rng.choice([0.0, rng.uniform(0, 2)]),
                         *rng.choice([(), (None, 0.0), (rng.choice([0.0, rng.uniform(0, 2)]), rng.uniform(0, 30))]))
                for t in (P0, P1, P2)[:tier.rank]]  # steady, or a surge dying away (to nothing) or a lull filling in
    unread = {P3: (rng.randint(1, 5000), Work(P3, 100.0, 50.0))} if rng.random() < 0.3 else {}
    kw = {"enqueued_s": 0.0, "aging_interval_s": rng.choice([60.0, math.inf]),
          "promoted_s": rng.choice([math.inf, rng.uniform(1, 50)])}
    return tier, workers, queued, arrivals, unread, kw


def test_a_dumped_state_gives_back_the_same_estimate(tmp_path):
    rng = random.Random(12)
    path = tmp_path / "dump.jsonl"
    writer = estimate_dump.DumpWriter(path)
    told = {}
    for n in range(60):
        tier, workers, queued, arrivals, unread, kw = random_state(rng)
        est = told_wait_s(tier, workers, queued, arrivals=arrivals, unread=unread, **kw)
        writer.hold(estimate_dump.encode(est, 1.0, 1000.0 + n, tier, workers, queued, arrivals, unread, **kw))
        if n % 7 == 3:  # refused after its estimate: written for nobody, and not under the next job's id
            continue
        own = Work(tier, rng.randint(1, 900), rng.uniform(1, 300))
        writer.admitted(f"job-{n}", 1000.0 + n, own)
        told[f"job-{n}"] = est, own
    writer.admitted("after-a-refusal", 2000.0)  # what is held is the refused admission's: nothing written
    writer.admitted("no-estimate-held", 1000.0 + n)  # nothing held: nothing written
    writer.close()
    lines = path.read_text().splitlines()
    assert len(lines) == len(told)
    for line in lines:
        strict_json(line)
    dumps = list(estimate_dump.read(path))
    assert [d.job_id for d in dumps] == list(told)
    for d in dumps:
        est, own = told[d.job_id]
        args, kw = d.args()
        again = told_wait_s(*args, **kw)
        assert again == est or (math.isinf(again) and math.isinf(est)), d.job_id
        assert (d.work, d.told_s) == (own, est)


def test_a_dumped_state_of_workers_of_different_sizes_keeps_which_workers_each_queued_job_fits(tmp_path):
    # Queued.fits (a job ahead that only some workers fit) moves the estimate: a dump without it gave back another.
    rng, fit_rng = random.Random(31), random.Random(32)
    path = tmp_path / "dump.jsonl"
    writer = estimate_dump.DumpWriter(path)
    told, moved = {}, 0
    for n in range(60):
        tier, workers, queued, arrivals, unread, kw = random_state(rng)
        queued = [dataclasses.replace(q, fits=frozenset(fit_rng.sample(range(len(workers)),
                                                                       fit_rng.randint(1, len(workers)))))
                  if fit_rng.random() < 0.5 else q for q in queued]
        est = told_wait_s(tier, workers, queued, arrivals=arrivals, unread=unread, **kw)
        blind = [dataclasses.replace(q, fits=None) for q in queued]
        moved += est != told_wait_s(tier, workers, blind, arrivals=arrivals, unread=unread, **kw)
        writer.hold(estimate_dump.encode(est, 1.0, 1000.0 + n, tier, workers, queued, arrivals, unread, **kw))
        writer.admitted(f"job-{n}", 1000.0 + n, Work(tier, 10, 10.0))
        told[f"job-{n}"] = est
    writer.close()
    assert moved >= 5, moved  # else the dump is not tested on what it must keep
    for d in estimate_dump.read(path):
        args, kw = d.args()
        again = told_wait_s(*args, **kw)
        assert again == told[d.job_id] or (math.isinf(again) and math.isinf(told[d.job_id])), d.job_id


def test_the_replay_lists_the_dispatches_it_expects_before_the_job():
    rates = Rates(prefill_tps=1000.0, decode_tps=100.0)
    workers = [WorkerView(1, rates, [Held(Work(P3, 0, 200), RUNNING, 0b11)])]  # its slot frees in 2 s
    older = [Queued(Work(P2, 0, 50 * (i + 1)), -10.0 + i) for i in range(3)]  # 0.5, 1 and 1.5 s each
    newer = Queued(Work(P2, 0, 50), -1.0)  # admitted after the job: never before it
    seen: list = []
    wait, n = replay(P2, workers, [newer, *older], enqueued_s=-2.0, dispatches=seen)
    assert [(t, i, w) for t, i, w in seen] == [(2.0, 0, older[0].work), (2.5, 0, older[1].work),
                                               (3.5, 0, older[2].work)]
    assert (wait, n) == (5.0, len(seen) + 1) == (5.0, replay(P2, workers, [newer, *older], enqueued_s=-2.0)[1])


def test_a_line_that_is_not_a_dump_is_refused_with_its_place(tmp_path):
    path = tmp_path / "dump.jsonl"
    path.write_text('{"v": 1, "job_id": "a"}\n')
    with pytest.raises(ValueError, match=r"dump.jsonl:1: not an estimate dump line"):
        list(estimate_dump.read(path))
    path.write_text('{"v": 99, "job_id": "a"}\n')
    with pytest.raises(ValueError, match="version 99"):
        list(estimate_dump.read(path))
    # A gateway killed while writing its last line: the lines before it are read, the cut one left out.
    writer = estimate_dump.DumpWriter(tmp_path / "cut.jsonl")
    tier, workers, queued, arrivals, unread, kw = random_state(random.Random(1))
    writer.hold(estimate_dump.encode(1.0, 1.0, 5.0, tier, workers, queued, arrivals, unread, **kw))
    writer.admitted("whole", 5.0)
    writer.close()
    whole = (tmp_path / "cut.jsonl").read_text()
    (tmp_path / "cut.jsonl").write_text(whole + whole[:len(whole) // 2])
    assert [d.job_id for d in estimate_dump.read(tmp_path / "cut.jsonl")] == ["whole"]


def test_a_dump_written_before_later_fields_still_reads():
    """Dumps of earlier runs stay comparable: arrivals of four fields (before settling rates) are steady, and
    workers without step_tokens (before workers said their step budget) prefill a prompt in one step."""
    tier, workers, queued, arrivals, unread, kw = random_state(random.Random(7))
    line = estimate_dump.encode(1.0, 1.0, 5.0, tier, workers, queued, arrivals, unread, **kw)
    for w in line["workers"]:
        del w["step_tokens"]
    line["arrivals"] = [a[:4] for a in line["arrivals"]]
    d = estimate_dump.decode({**json.loads(json.dumps(line)), "job_id": "old"})
    assert [w.step_tokens for w in d.workers] == [math.inf] * len(workers)
    assert all(a.steady() for a in d.arrivals) and [a.per_s for a in d.arrivals] == [a.per_s for a in arrivals]


def test_a_dump_file_that_cannot_be_written_is_a_configuration_error(tmp_path):
    with pytest.raises(ValueError, match=r"estimate_dump: cannot append to '.*no-such-dir/d.jsonl'"):
        estimate_dump.DumpWriter(tmp_path / "no-such-dir" / "d.jsonl")


def test_the_replay_refuses_a_dump_of_another_run(tmp_path, capsys):
    dump, bench = tmp_path / "dump.jsonl", tmp_path / "run.json"
    rng = random.Random(3)
    writer = estimate_dump.DumpWriter(dump)
    tier, workers, queued, arrivals, unread, kw = random_state(rng)
    writer.hold(estimate_dump.encode(1.0, 1.0, 0.0, tier, workers, queued, arrivals, unread, **kw))
    writer.admitted("job-a", 0.0)
    writer.close()
    bench.write_text(json.dumps({"args": {"min_wait": "0.5"}, "jobs": [
        {"job_id": "job-b", "tier": "P2", "outcome": "done", "wait_s": 3.0, "estimate_s": 2.0}]}))
    with pytest.raises(SystemExit, match="no job of the bench run is in the dump"):
        estimate_replay.main(["--dump", str(dump), "--bench-json", str(bench)])


def test_a_real_gateway_dumps_each_admitted_jobs_estimate_and_the_replay_reproduces_them(tiny_model_dir, tmp_path,
                                                                                        capsys):
    dump = tmp_path / "estimates.jsonl"
    env = {"TS_GATEWAY_ESTIMATE_DUMP": str(dump)}
    with local_cluster(tmp_path, tiny_model_dir, workers=1, max_running=1, env=env, http=False) as c:
        def client(tenant):
            return GatewayClient(c["gateway"], c["tenants"][tenant]["api_key"], timeout_s=30)
        lab, batch, api, chat = client("lab-co"), client("batch-co"), client("api-co"), client("chat-co")
        blocker = lab.submit(prompt_token_ids=[3, 4], max_tokens=2000, ignore_eos=True)
        wait_for(lambda: job_hash(c, blocker.id).get("state") == "dispatched", 60, "the blocker to run")
        t0 = time.monotonic()
        handles, refused, at = [blocker], 0, {blocker.id: 0.0}
        # Mixed tiers queue behind the P3 (a P2 may not preempt it); then P0s past chat-co's quota (a burst of 4)
        # are refused after their estimate was made: theirs must be written for nobody, never under the next
        # admitted job's id.
        for i in range(32):
            who, tier = [(batch, "P2"), (lab, "P3"), (api, "P1"), (batch, "P2")][i % 4] if i < 24 else (chat, "P0")
            try:
                handles.append(who.submit(prompt_token_ids=[5 + i, 6, 7], max_tokens=40 if i < 24 else 4, tier=tier,
                                          ignore_eos=True))
                at[handles[-1].id] = time.monotonic() - t0
            except QuotaExceeded:
                refused += 1
        assert refused > 0  # the case the test is about happened
        lab.cancel(blocker.id)
        jobs = []
        for h in handles[1:]:
            r = h.result(timeout=300)
            jobs.append({"job_id": h.id, "at": at[h.id], "tier": h.tier, "outcome": "done", "wait_s": r.queued_s,
                         "estimate_s": h.estimated_wait_s})
    dumps = {d.job_id: d for d in estimate_dump.read(dump)}
    assert set(dumps) == {h.id for h in handles}  # every admitted job, once; no refused one
    assert len(dump.read_text().splitlines()) == len(handles)
    for h in handles:
        assert math.isclose(dumps[h.id].told_s, h.estimated_wait_s, rel_tol=1e-6, abs_tol=1e-6), h.id
        assert dumps[h.id].tier.value == h.tier
    assert any(d.workers and d.workers[0].held for d in dumps.values())  # the blocker was seen
    bench = tmp_path / "run.json"
    bench.write_text(json.dumps({"args": {"min_wait": "0.5"}, "jobs": jobs}))
    assert estimate_replay.main(["--dump", str(dump), "--bench-json", str(bench), "--check", "--min-wait", "0"]) == 0
    assert f"{len(jobs)} estimates replayed (0 of the run's jobs not in the dump); 0 differ" in capsys.readouterr().out
    assert any(w.step is not None for d in dumps.values() for w in d.workers)  # the worker said its step cost
    # The same states as if it had not: the token rates time the jobs, and the replay says how many estimates move.
    assert estimate_replay.main(["--dump", str(dump), "--bench-json", str(bench), "--no-step-cost",
                                 "--min-wait", "0"]) == 0
    assert f"{len(jobs)} estimates replayed" in capsys.readouterr().out
    # And with what the attention's pairs cost left out of the step cost.
    assert estimate_replay.main(["--dump", str(dump), "--bench-json", str(bench), "--no-pair-cost",
                                 "--min-wait", "0"]) == 0
    assert f"{len(jobs)} estimates replayed" in capsys.readouterr().out
    # Why a job waited: the last P2 admitted, behind the older P1s and P2s, and the P0s that came after it.
    last_p2 = [h for h in handles if h.tier == "P2"][-1]
    assert estimate_replay.main(["--dump", str(dump), "--bench-json", str(bench), "--explain", last_p2.id[:12]]) == 0
    said = capsys.readouterr().out
    assert f"job {last_p2.id} P2" in said and "worker 0: 1 slots" in said
    model = next(line for line in said.splitlines() if "the model's" in line)
    listed = model.split(": ", 1)[1].split()
    assert f"the model's {len(listed)} dispatches before it" in model and listed  # P1s and P2s were ahead of it
    mine = next(j for j in jobs if j["job_id"] == last_p2.id)
    went = [j for j in jobs if j is not mine and mine["at"] <= j["at"] + j["wait_s"] < mine["at"] + mine["wait_s"]]
    assert any(j["tier"] == "P0" for j in went)  # admitted after it, they preempted their way in first
    said_went = next(line for line in said.splitlines() if "what started before it" in line)
    assert said_went.startswith(f"  what started before it ({len(went)};")


def test_leaving_out_the_pairs_cost_keeps_the_rest_of_the_step_cost():
    w = WorkerView(2, Rates(1000.0, 50.0), [Held(Work(Tier.P3, 0, 10), RUNNING, 0b11, 0.0, 700.0)],
                   step=StepCost(0.02, 0.001, 1e-6))
    assert estimate_replay.without_pair_cost(w).step == StepCost(0.02, 0.001, 0.0)
    assert estimate_replay.without_pair_cost(w).held == w.held and w.step.pair_s == 1e-6  # a copy, the rest kept
    assert estimate_replay.without_pair_cost(WorkerView(2, Rates(1000.0, 50.0))).step is None


def test_a_dumped_state_keeps_which_workers_the_job_itself_fits():
    """A job only the big worker fits is replayed on every worker (the small one runs the jobs ahead that fit it): a
    dump without the job's own workers gave back the wait of a job that fits both (the small worker's free slot)."""
    rates = Rates(1000.0, 50.0)
    workers = [WorkerView(2, rates), WorkerView(1, rates, [Held(Work(P3, 0, 1000), RUNNING, 0b11)])]
    queued = [Queued(Work(P3, 10, 50), -10.0 + k) for k in range(2)]
    kw = {"enqueued_s": 0.0, "aging_interval_s": math.inf, "promoted_s": math.inf}
    told = told_wait_s(P3, workers, queued, fits=frozenset({1}), **kw)
    assert told > told_wait_s(P3, workers, queued, **kw)
    line = estimate_dump.encode(told, 1.0, 5.0, P3, workers, queued, [], {}, fits=frozenset({1}), **kw)
    d = estimate_dump.decode({**strict_json(json.dumps(line)), "job_id": "big-only"})
    args, again = d.args()
    assert told_wait_s(*args, **again) == told
    alike = estimate_dump.encode(told, 1.0, 5.0, P3, workers, queued, [], {}, **kw)
    assert "fits" not in alike  # dumps of jobs every worker fits are as they were
