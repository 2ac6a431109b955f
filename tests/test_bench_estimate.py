"""scripts/bench_estimate.py: it sizes the replay from the rates the workers log at start-up, and its unjudged tail
keeps arriving only until the judged jobs are done."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest

from scripts import bench_estimate, estimate_report
from worker import Engine, EngineConfig


def test_the_worker_logs_its_calibration_in_the_form_the_bench_reads(tiny_model_dir, tmp_path, caplog):
    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=3))
    service = WorkerService(WorkerConfig(worker_id="wk-c", gateways=["tcp://127.0.0.1:9"], model="tiny"), engine)
    try:
        with caplog.at_level(logging.INFO, logger="worker"):
            service.connect()
    finally:
        service.close()
    lines = [r.getMessage() for r in caplog.records if "calibrated" in r.getMessage()]
    assert len(lines) == 1
    (tmp_path / "worker-0.log").write_text(f"2026-12-01 10:00:00 worker INFO {lines[0]}\n")
    [(prefill, decode, slots)] = bench_estimate.calibrated_rates(tmp_path, 1, timeout_s=1)
    measured = service.rates.rates()
    assert slots == 3
    assert prefill == pytest.approx(measured[0], abs=0.1) and decode == pytest.approx(measured[1], abs=0.1)
    assert prefill > 0 and decode > 0


def test_a_worker_without_a_calibration_line_is_an_error_not_a_guess(tmp_path):
    (tmp_path / "worker-0.log").write_text("worker INFO calibrated: prefill 100.0 tokens/s, decode 10.0 tokens/s "
                                           "per sequence, 2 slots\n")
    (tmp_path / "worker-1.log").write_text("worker INFO starting\n")
    with pytest.raises(SystemExit, match="no calibration line"):
        bench_estimate.calibrated_rates(tmp_path, 2, timeout_s=0.3)


def test_offered_load_is_slot_seconds_of_work_per_second_per_slot():
    jobs = [{"at": 0.0, "prompt_tokens": 100, "max_tokens": 10}, {"at": 10.0, "prompt_tokens": 300, "max_tokens": 30}]
    rates = [(100.0, 10.0, 2), (300.0, 30.0, 2)]  # mean prefill 200/s, decode 20/s, 4 slots
    work = (100 / 200 + 10 / 20) + (300 / 200 + 30 / 20)  # 4 slot-seconds
    assert bench_estimate.offered_load(jobs, rates) == pytest.approx(work / 10.0 / 4)


@pytest.mark.parametrize("argv", [["--load", "0.8", "--speedup", "2"], ["--load", "0"], ["--speedup", "-1"],
                                  ["--warmup", "-1"]])
def test_contradictory_or_empty_pacing_is_refused_before_a_cluster_starts(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_estimate.main(["--trace", str(tmp_path / "none.csv"), *argv])
    assert e.value.code == 2 and ("--load" in capsys.readouterr().err)


def test_the_tail_arrives_unjudged_and_stops_when_the_judged_jobs_are_done(tiny_model_dir, tmp_path):
    from tests.cluster_helpers import job_ids, local_cluster, wait_for

    def job(i: int, at: float, tier: str) -> dict:
        return {"i": i, "at": at, "tier": tier, "prompt_tokens": 4, "max_tokens": 4, "prompt_token_ids": [5, 6, 7, 8]}

    judged = [job(i, 0.5 + 0.1 * i, t) for i, t in enumerate(("P0", "P1", "P2", "P3"))]
    soon = [job(10 + i, 0.0, "P1") for i in range(3)]  # before any judged job: surely sent
    never = [job(20 + i, 3600.0, "P0") for i in range(3)]  # an hour on: cancelled when the judged ones are done
    with local_cluster(tmp_path, tiny_model_dir, workers=1, http=False) as state:
        started = time.monotonic()
        records, sent = asyncio.run(bench_estimate.replay(state, judged, 60.0, soon + never))
        assert time.monotonic() - started < 60
        assert [r["i"] for r in records] == [0, 1, 2, 3] and all(r["outcome"] == "done" for r in records)
        assert sent == 3 and len(job_ids(state)) == 4 + 3  # the far tail was never submitted
        bench_estimate.where_they_ran(state, records)
        up = {"P2": "P1", "P3": "P2"}  # where a promise moves a job (a P2's or P3's, due at once on a short wait)
        for r in records:  # where each ran, and when it was sent: within its wait (the rest is the hand-off)
            assert r["worker"] == "wk-0" and r["attempts"] == 1 and 0 <= r["sent_s"] <= r["wait_s"] + 0.05, r
            if r["promoted_s"] is None:
                assert r["queue"] == r["tier"], r
            else:
                assert r["tier"] in up and r["queue"] == up[r["tier"]] and 0 <= r["promoted_s"] <= r["sent_s"], r
        # The gateway's hand-off histogram covers each of the 7 jobs that ran, once (the tail's may still be
        # starting when the judged ones are done).
        wait_for(lambda: (estimate_report.mean_handoff(state["metrics"][0]) or (0, 0))[1] == 7, 30, "7 hand-offs")
        assert estimate_report.mean_handoff(state["metrics"][0])[0] >= 0


def test_measured_load_scales_the_paced_load_by_the_jobs_real_time_in_their_slots():
    rates = [(100.0, 10.0, 2), (100.0, 10.0, 2)]  # a job of 100 prompt + 10 output tokens: 2 s by calibration
    rec = {"outcome": "done", "prompt_tokens": 100, "max_tokens": 10, "preemptions": 0, "wait_s": 1.0}
    records = [dict(rec, total_s=1.0 + held) for held in (2.4, 2.5, 2.6)]  # 1.25x the calibration's 2 s (median)
    records += [dict(rec, total_s=60.0, preemptions=1), dict(outcome="overloaded")]  # left out
    assert bench_estimate.measured_load(records, rates, 0.8) == pytest.approx(1.0)
    assert bench_estimate.measured_load([dict(outcome="failed")], rates, 0.8) is None
    # A load is a sum: two short jobs at the calibration's pace and one ten times their size at half its pace
    # offer 2 + 2 + 40 slot-seconds where the calibration says 2 + 2 + 20 (a median of ratios would say 1x).
    big = dict(rec, prompt_tokens=1000, max_tokens=100)
    mixed = [dict(rec, total_s=3.0), dict(rec, total_s=3.0), dict(big, total_s=41.0)]
    assert bench_estimate.measured_load(mixed, rates, 0.8) == pytest.approx(0.8 * 44 / 24)


def test_the_warm_up_runs_the_traces_own_job_sizes_as_p3_all_at_once():
    jobs = [{"i": i, "at": float(i), "tier": "P0", "prompt_tokens": 10 * i + 1, "max_tokens": i + 1,
             "prompt_token_ids": [3] * (10 * i + 1)} for i in range(40)]
    warm = bench_estimate.warmup_jobs(jobs, 16, seed=1)
    assert len(warm) == 16 and len({j["i"] for j in warm}) == 16
    assert all(j["tier"] == "P3" and j["at"] == 0.0 and j["i"] >= bench_estimate.WARMUP_IDS for j in warm)
    sizes = {(j["prompt_tokens"], j["max_tokens"]) for j in jobs}
    assert all((j["prompt_tokens"], j["max_tokens"]) in sizes for j in warm)
    assert warm == bench_estimate.warmup_jobs(jobs, 16, seed=1)  # seeded
    assert len(bench_estimate.warmup_jobs(jobs[:3], 16, seed=1)) == 3  # a short trace: all of it
    assert jobs[0]["tier"] == "P0"  # the judged jobs are untouched


def test_the_pace_comes_from_the_warm_up_jobs_real_time_in_their_slots():
    rates = [(100.0, 10.0, 2), (100.0, 10.0, 2)]  # 100 prompt + 10 output tokens: 2 s by calibration
    rec = {"outcome": "done", "prompt_tokens": 100, "max_tokens": 10, "preemptions": 0, "wait_s": 0.5}
    records = [dict(rec, total_s=0.5 + held) for held in (0.8, 1.0, 1.2)]  # 3 s for 6 s by calibration: 2x faster
    records += [dict(rec, total_s=60.0, preemptions=1), dict(outcome="failed", error="x")]  # left out
    paced, factor = bench_estimate.paced_rates(rates, records)
    assert factor == pytest.approx(0.5) and paced == [(200.0, 20.0, 2), (200.0, 20.0, 2)]
    jobs = [dict(rec, at=0.0), dict(rec, at=10.0)]
    assert bench_estimate.offered_load(jobs, paced) == pytest.approx(bench_estimate.offered_load(jobs, rates) / 2)
    with pytest.raises(SystemExit, match="no warm-up job finished"):
        bench_estimate.paced_rates(rates, [dict(outcome="failed", error="refused")])


def test_a_traces_largest_rows_are_capped_to_the_context_not_sent_to_be_refused():
    # BurstGPT and the 2024 Azure traces have outputs longer than the bench model's context once scaled, and
    # rows with no output at all (failed requests): each must become a request the cluster accepts.
    trace = [(0.0, 100_000, 100_000), (0.5, 10, 100_000), (1.0, 100_000, 3), (1.5, 0, 0), (2.0, 40, 20)]

    class A:
        seed, mix, token_scale, max_len, speedup = 1, "10,20,30,40", 0.25, 2048, None
    jobs = bench_estimate.plan(trace, A)
    assert all(1 <= j["max_tokens"] and 1 <= j["prompt_tokens"] and j["prompt_tokens"] + j["max_tokens"] <= 2048
               and len(j["prompt_token_ids"]) == j["prompt_tokens"] for j in jobs), jobs
    assert [(j["prompt_tokens"], j["max_tokens"]) for j in jobs][-1] == (10, 5)  # an ordinary row as it was


def test_the_report_judges_each_tier_as_the_issue_says_with_the_uncertainty_of_few_jobs():
    summarize, table, wilson = estimate_report.summarize, estimate_report.table, estimate_report.wilson

    def job(tier, estimate, wait, outcome="done"):
        return {"tier": tier, "estimate_s": estimate, "wait_s": wait, "outcome": outcome}
    records = ([job("P2", 2.0, 1.0), job("P2", 0.5, 1.0), job("P2", 2.01, 1.0), job("P2", 1.0, 4.0),  # 2x counts
                job("P2", 9.0, 0.4), job("P2", 1.0, None, "overloaded")]  # too short to judge; never ran
               + [job("P1", 1.1, 1.0)] * 8 + [job("P1", 5.0, 1.0)] * 2)
    s = summarize(records, min_wait=0.5)
    assert (s["P2"]["waited"], s["P2"]["within_2x"], s["P2"]["overloaded"]) == (4, 0.5, 1)
    assert s["P2"]["median_rel_error"] == (0.75 + 1.0) / 2  # of |e - w| / w: 1.0, 0.5, 1.01, 0.75
    assert (s["P1"]["waited"], s["P1"]["within_2x"]) == (10, 0.8)
    lo, hi = s["P1"]["within_2x_95ci"]
    assert 0.49 < lo < 0.50 and 0.94 < hi < 0.95  # 8 of 10: the Wilson interval
    assert wilson(0, 0) is None and wilson(5, 5)[1] == 1.0 and wilson(0, 5)[0] == 0.0
    assert re.search(r"^P1 .* 80\.0 % +49-94 % ", table(s, 0.5), re.M)


def test_a_promise_that_slipped_is_one_whose_job_started_half_an_aging_interval_or_more_after_it():
    def job(tier, estimate, wait, promoted, outcome="done"):
        return {"tier": tier, "estimate_s": estimate, "wait_s": wait, "promoted_s": promoted, "outcome": outcome}
    records = [job("P3", 1.0, 61.0, 0.5),  # moved at once, started as aging lifted it on: slipped, 61x off
               job("P3", 40.0, 70.0, 39.5),  # slipped by 30.5 s, exactly half an interval; told within 2x
               job("P3", 40.0, 69.0, 39.5),  # 29.5 s after: kept, if late
               job("P3", 5.0, 5.2, None),  # never moved
               job("P3", 0.2, 0.3, 0.0),  # too short a wait to judge
               job("P2", 3.0, 3.1, 2.5),  # kept
               job("P2", 3.0, None, 2.5, "failed")]  # never ran: not judged
    assert estimate_report.slipped_promises(records, 0.5, 60.0) == {
        "P2": {"promoted": 1, "slipped": 0, "slipped_within_2x": 0},
        "P3": {"promoted": 3, "slipped": 2, "slipped_within_2x": 1}}
    assert estimate_report.slipped_promises(records, 0.5, float("inf"))["P3"]["slipped"] == 0  # no aging: none
    assert estimate_report.slipped_promises([job("P1", 1.0, 2.0, None)], 0.5, 60.0) == {}
