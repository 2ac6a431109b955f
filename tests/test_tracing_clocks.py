"""Spans of a cluster whose clocks disagree: a gateway's wall clock behind Redis's, which times the queue.

Real processes (redis-server, a gateway whose wall clock is set back, a worker), spans through the file exporter,
read back by explain."""

from __future__ import annotations

import json
import time

import pytest

from common.traces.otlp_json import read_spans_file
from scripts import explain
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster

SKEW_S = -30.0  # the gateway's wall clock, behind Redis's (and the worker's) by more than any wait here


def test_a_gateway_clock_behind_redis_keeps_the_queue_wait(tiny_model_dir, tmp_path, capsys):
    """gateway.queue began at the admission as Redis recorded it and ended on the gateway's clock: a gateway 30 s
    behind Redis made a span that ended 30 s before it began, which explain (and Jaeger) took as no wait at all,
    with nothing said about it. Its ends are both on Redis's clock now, and the span says the clocks disagreed."""
    spans = tmp_path / "spans.jsonl"
    env = {"OTEL_TRACES_EXPORTER": "otlp_json_file", "TS_SPANS_FILE": str(spans), "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=1, max_running=1, gateway_env=env,
                        clock_skew_s={"gw-0": SKEW_S}) as c:
        with c.client("batch-co", timeout_s=60.0) as batch:
            # One slot: the second job waits in Redis for the first to end (long enough to outlast this process being
            # starved on a loaded machine between the two submits: at 300 tokens it once ended first).
            first = batch.submit(prompt_token_ids=[5, 6], max_tokens=1200, ignore_eos=True, tier="P2")
            wait_for(lambda: c.state(first.id) == "dispatched", 60, "the first job to be dispatched")
            second = batch.submit(prompt_token_ids=[7, 8], max_tokens=2, ignore_eos=True, tier="P2")
            second.result(timeout=120)
            first.result(timeout=120)
            job = c.job(second.id)
    waited_s = (int(job["dispatched_at_ms"]) - int(job["enqueued_at_ms"])) / 1e3
    assert waited_s > 0.1, job  # it did wait

    def queue_spans():
        return [s for s in read_spans_file(spans, second.id).spans
                if s.name == "gateway.queue" and s.get("request.id") == second.id]

    wait_for(lambda: queue_spans(), 10, "the queue span to be exported")
    [queue] = queue_spans()
    assert queue.end_ns >= queue.start_ns, (queue.start_ns, queue.end_ns)
    assert queue.duration_s == pytest.approx(waited_s, abs=0.002), (queue.duration_s, waited_s)
    # The span says by how much the gateway's clock and Redis's disagreed (the claim's reply time aside).
    assert queue.get("queue.clock_offset_ms") == pytest.approx(SKEW_S * 1e3, abs=2000), queue.attributes

    assert explain.main([second.id, "--spans", str(spans), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    [told] = [b for b in d["blame"] if b["kind"] == "queue"]
    assert told["duration_s"] == pytest.approx(waited_s, abs=0.002), told
    assert d["clock_offsets"] and abs(d["clock_offsets"][0]["offset_s"] - SKEW_S) < 2, d["clock_offsets"]
    assert explain.main([second.id, "--spans", str(spans)]) == 0
    text = capsys.readouterr().out
    assert "clocks disagree" in text, text


def test_a_gateway_clock_behind_redis_keeps_the_wait_of_a_job_cancelled_in_its_queue(tiny_model_dir, tmp_path):
    """A job cancelled while queued: its gateway.queue span began at the admission on Redis's clock and ended at the
    gateway's wall clock, clamped to its start; a gateway 30 s behind Redis told a job that waited seconds that it
    waited none. It ends at the cancel as Redis recorded it (finished_at_ms), as an expiry's does."""
    spans = tmp_path / "spans.jsonl"
    env = {"OTEL_TRACES_EXPORTER": "otlp_json_file", "TS_SPANS_FILE": str(spans), "OTEL_BSP_SCHEDULE_DELAY": "100"}
    # No worker: the job waits in its queue until it is cancelled.
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0, gateway_env=env,
                        clock_skew_s={"gw-0": SKEW_S}) as c:
        with c.client("batch-co", timeout_s=30.0) as batch:
            job = batch.submit(prompt_token_ids=[5], max_tokens=1, tier="P3")
            time.sleep(1.0)
            assert batch.cancel(job.id) and c.state(job.id) == "cancelled"
        rec = c.job(job.id)
    waited_s = (int(rec["finished_at_ms"]) - int(rec["enqueued_at_ms"])) / 1e3

    def queue_spans():
        return [s for s in read_spans_file(spans, job.id).spans if s.name == "gateway.queue"]

    wait_for(lambda: queue_spans(), 10, "the queue span to be exported")
    [queue] = queue_spans()
    assert queue.get("queue.outcome") == "cancelled"
    assert queue.end_ns == int(rec["finished_at_ms"]) * 1_000_000, (queue.end_ns, rec)  # the cancel, as Redis has it
    assert queue.duration_s == pytest.approx(waited_s, abs=0.002), (queue.duration_s, waited_s)
