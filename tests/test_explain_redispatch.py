"""explain on a re-dispatched job, from a real cluster's spans: a worker killed -9 after the job started, restarted
later, and the job's second attempt run there."""

from __future__ import annotations

import json
import time

import pytest

from scripts import explain
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.test_metrics_finals import logged_tokens


def test_explain_names_both_waits_of_a_redispatched_job(tiny_model_dir, tmp_path, capsys):
    """explain's queued time holds every queue wait of every attempt; JobResult.queued_s is admission to the first
    prefill (README, Wait estimates). After a re-dispatch they differ by the whole re-queue, and explain gave only
    its own: a user comparing it with the result saw two numbers for 'queued', and nothing said why."""
    spans = tmp_path / "spans.jsonl"
    env = {"OTEL_TRACES_EXPORTER": "otlp_json_file", "TS_SPANS_FILE": str(spans), "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=1, lease_s=2.0, gateway_env=env) as c:
        with c.client("batch-co", timeout_s=120.0) as batch:
            job = batch.submit(prompt_token_ids=[5, 6], max_tokens=2000, ignore_eos=True, tier="P2")
            wait_for(lambda: c.state(job.id) == "dispatched" and c.redis.exists(f"ts:{{c}}:tok:{job.id}"), 60,
                     "the job to stream")
            c.kill("wk-0")
            wait_for(lambda: c.state(job.id) == "queued", 30, "the lease to expire and the job to be re-queued")
            time.sleep(1.0)  # it waits in its queue again, with no worker
            c.restart("wk-0")
            result = job.result(timeout=120)
            assert c.job(job.id)["attempt"] == b"2"
    wait_for(lambda: explain.main([job.id, "--spans", str(spans), "--json"]) == 0
             and json.loads(capsys.readouterr().out)["attempts"] == 2, 10, "the second attempt's spans")
    assert explain.main([job.id, "--spans", str(spans), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    # Both, named: every wait, and the one the result reports (the spans' clocks and the hash's ms apart).
    assert d["queued_s"] > result.queued_s + 1.0, (d["queued_s"], result.queued_s)
    assert d["to_first_prefill_s"] == pytest.approx(result.queued_s, abs=0.02), (d["to_first_prefill_s"], result)
    assert explain.main([job.id, "--spans", str(spans)]) == 0
    text = capsys.readouterr().out
    assert f"queued {d['queued_s']:.2f} s in all" in text, text
    assert f"{result.queued_s:.2f} s from admission to its first prefill (JobResult.queued_s)" in text or \
        f"{d['to_first_prefill_s']:.2f} s from admission to its first prefill (JobResult.queued_s)" in text, text


def test_explain_tells_the_kept_part_of_a_killed_workers_run(tiny_model_dir, tmp_path, capsys):
    """A worker killed -9 after streaming tokens for a while: the next attempt resumes from those tokens (the token
    log), so its run up to the last of them was kept work. explain told the whole of it as "lost" (dispatch until
    the re-queue), as if the tokens had to be made again."""
    spans = tmp_path / "spans.jsonl"
    env = {"OTEL_TRACES_EXPORTER": "otlp_json_file", "TS_SPANS_FILE": str(spans), "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=1, lease_s=2.0, gateway_env=env) as c:
        with c.client("batch-co", timeout_s=120.0) as batch:
            job = batch.submit(prompt_token_ids=[5, 6], max_tokens=2000, ignore_eos=True, tier="P2", seed=7)
            wait_for(lambda: c.state(job.id) == "dispatched" and logged_tokens(c, job.id) >= 30, 60,
                     "the job to stream a while")
            time.sleep(0.5)
            c.kill("wk-0")
            wait_for(lambda: c.state(job.id) == "queued", 30, "the lease to expire and the job to be re-queued")
            kept = logged_tokens(c, job.id)
            [(last_id, _)] = c.redis.xrevrange(f"ts:{{c}}:tok:{job.id}", count=1)
            last_ms = int(last_id.split(b"-")[0])
            c.restart("wk-0")
            job.result(timeout=120)
    wait_for(lambda: explain.main([job.id, "--spans", str(spans), "--json"]) == 0
             and json.loads(capsys.readouterr().out)["attempts"] == 2, 10, "the second attempt's spans")
    assert explain.main([job.id, "--spans", str(spans), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    [cause] = [b for b in d["blame"] if b["kind"] == "redispatch"]
    assert cause["detail"]["kept_tokens"] == kept > 0, (cause, kept)
    [sent] = [p for p in d["phases"] if p["phase"] == "dispatch" and p["attempt"] == 1]
    ran_s = (last_ms * 1_000_000 - d["start_unix_ns"]) / 1e9 - sent["end_s"]  # dispatch to the last kept token
    assert ran_s > 0.4, ran_s
    assert cause["detail"]["kept_s"] == pytest.approx(ran_s, abs=0.01), (cause, ran_s)
    # Kept work is running time; lost is only the rest (the lease's expiry), and every second is still named.
    assert d["kept_s"] == pytest.approx(ran_s, abs=0.05), (d["kept_s"], ran_s)
    assert d["transit"]["lost"] == pytest.approx(cause["duration_s"], abs=0.05), (d["transit"], cause)
    assert d["other_s"] < 0.002, d
    parts = d["queued_s"] + d["running_s"] + d["suspended_s"] + d["transit_s"] + d["other_s"]
    assert parts == pytest.approx(d["total_s"], abs=0.002), d
    assert explain.main([job.id, "--spans", str(spans)]) == 0
    text = capsys.readouterr().out
    assert f"({kept} tokens kept: " in text and f" s of its run on wk-0; {cause['duration_s']:.2f} s lost on wk-0)" \
        in text, text
