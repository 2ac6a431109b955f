"""explain on a request some of whose spans are not in the input: the older ones rotated away (up.py --spans-keep)
or never exported by a worker killed -9. It says what is missing and counts each second of the rest once.

Spans are made by the real OpenTelemetry SDK and written through the exporter the cluster uses (AppendStream),
rotated by the function up.py calls."""

from __future__ import annotations

import json

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from common.spans_file import rotate, rotated_files
from scripts import explain
from tests.test_explain import AppendExporter, admission, closed, ns, req_attrs, start


def tracers(path, *names):
    out, providers = [], []
    for name in names:
        provider = TracerProvider(resource=Resource.create({"service.name": name}))
        provider.add_span_processor(SimpleSpanProcessor(AppendExporter(path)))
        providers.append(provider)
        out.append(provider.get_tracer("test"))
    return out, providers


def explained(capsys, rid, path) -> tuple[dict, str]:
    assert explain.main([rid, "--spans", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert explain.main([rid, "--spans", str(path)]) == 0
    return d, capsys.readouterr().out


def test_a_job_whose_admission_was_rotated_away_is_told_incomplete(tmp_path, capsys):
    # It queued 1.2 s; its admission and queue spans went into the file that was rotated first.
    path = tmp_path / "spans.jsonl"
    (gw, wk), providers = tracers(path, "tiered-serve-gateway", "tiered-serve-worker")
    ra = req_attrs("job-1", "P2", "lab-co")
    admit = admission(gw, None, 0.0, "job-1", "P2", "lab-co", position=3, ahead={"P2": 3})
    closed(gw, "gateway.queue", 0.001, 1.201, admit, {**ra, "queue.tier": "P2", "queue.tier_granted": "P2",
                                                      "queue.attempt": 1})
    rotate(path, 1, keep=2)
    dispatch = closed(gw, "gateway.dispatch", 1.201, 1.203, admit,
                      {**ra, "dispatch.worker": "w0", "dispatch.reason": "credit", "dispatch.attempt": 1})
    wreq = start(wk, "worker.request", 1.205, dispatch, ra)
    closed(wk, "worker.queue", 1.205, 1.305, wreq, ra)
    closed(wk, "worker.prefill", 1.305, 1.405, wreq, ra)
    wreq.end(end_time=ns(2.0))
    for p in providers:
        p.shutdown()
    # Straddling a rotation (FILE.1 and FILE): the whole story.
    d, text = explained(capsys, "job-1", path)
    assert d["missing"] == [] and "incomplete" not in text, text
    assert d["total_s"] == pytest.approx(2.0) and d["queued_s"] == pytest.approx(1.3), d
    # Two rotations later, with --spans-keep 1: its admission and queue wait are gone.
    rotate(path, 1, keep=1)
    assert [p.name for p in rotated_files(path)] == ["spans.jsonl.1"]
    d, text = explained(capsys, "job-1", path)
    assert d["total_s"] == pytest.approx(0.799), d  # from its dispatch on: what is there
    assert [m.split(":")[0] for m in d["missing"]] == ["gateway.admit", "gateway.queue of 1 of its 1 attempts"], d
    assert "incomplete: not in the input" in text and "  - gateway.admit: its admission" in text, text


def test_a_lost_attempts_queue_wait_is_not_taken_off_the_next_attempts_run(tmp_path, capsys):
    # Worker w0 was killed -9 during attempt 1: it had exported the ended worker.queue and worker.prefill, never
    # their open worker.request. That queue wait was counted as queued, taken off attempt 2's running and told
    # again as time "to worker": running 1.28 s and to worker 0.41 s instead of 1.68 s and 0.01 s.
    path = tmp_path / "spans.jsonl"
    (gw, w0, w1), providers = tracers(path, "tiered-serve-gateway", "tiered-serve-worker", "tiered-serve-worker")
    ra = req_attrs("job-2", "P1", "chat-co")
    admit = admission(gw, None, 0.0, "job-2", "P1", "chat-co")
    closed(gw, "gateway.queue", 0.001, 0.101, admit, {**ra, "queue.tier": "P1", "queue.tier_granted": "P1",
                                                      "queue.attempt": 1})
    d1 = closed(gw, "gateway.dispatch", 0.101, 0.103, admit,
                {**ra, "dispatch.worker": "w0", "dispatch.reason": "credit", "dispatch.attempt": 1})
    lost = start(w0, "worker.request", 0.109, d1, ra)  # never ended
    closed(w0, "worker.queue", 0.109, 0.509, lost, ra)
    closed(w0, "worker.prefill", 0.509, 0.809, lost, ra)
    closed(gw, "gateway.queue", 2.103, 2.203, admit, {**ra, "queue.tier": "P1", "queue.tier_granted": "P1",
                                                      "queue.attempt": 2})
    d2 = closed(gw, "gateway.dispatch", 2.203, 2.205, admit, {
        **ra, "dispatch.worker": "w1", "dispatch.reason": "credit", "dispatch.attempt": 2,
        "dispatch.lost_worker": "w0", "dispatch.requeue_cause": "lease_expired"})
    wreq = start(w1, "worker.request", 2.209, d2, ra)
    closed(w1, "worker.queue", 2.209, 2.219, wreq, ra)
    closed(w1, "worker.prefill", 2.219, 2.299, wreq, ra)
    closed(w1, "worker.decode", 2.299, 3.899, wreq, ra)
    wreq.end(end_time=ns(3.899))
    for p in providers:
        p.shutdown()
    d, text = explained(capsys, "job-2", path)
    assert d["running_s"] == pytest.approx(1.68) and d["queued_s"] == pytest.approx(0.61), d
    assert d["transit"]["to_worker"] == pytest.approx(0.01) and d["transit"]["lost"] == pytest.approx(1.594), d
    parts = d["queued_s"] + d["running_s"] + d["suspended_s"] + d["transit_s"] + d["other_s"]
    assert parts == pytest.approx(d["total_s"]) and d["other_s"] < 1e-6, d
    assert [m.split(" (")[0] for m in d["missing"]] == ["worker.request of the attempt on worker w0"], d
    assert "lease expired on worker w0; attempt 2 on worker w1" in text, text


def test_a_dead_lettered_jobs_lost_prefill_is_counted_once(tmp_path, capsys):
    # No worker.request at all (its worker killed -9): its prefill was counted as running and again as lost, so the
    # parts came to 4.0 s of a 3.0 s total.
    path = tmp_path / "spans.jsonl"
    (gw, w0), providers = tracers(path, "tiered-serve-gateway", "tiered-serve-worker")
    ra = req_attrs("job-3", "P2", "lab-co")
    admit = admission(gw, None, 0.0, "job-3", "P2", "lab-co")
    closed(gw, "gateway.queue", 0.001, 0.101, admit, {**ra, "queue.attempt": 1})
    d1 = closed(gw, "gateway.dispatch", 0.101, 0.103, admit, {**ra, "dispatch.worker": "w0", "dispatch.attempt": 1})
    lost = start(w0, "worker.request", 0.109, d1, ra)  # never ended
    closed(w0, "worker.queue", 0.109, 0.209, lost, ra)
    closed(w0, "worker.prefill", 0.209, 1.209, lost, ra)
    closed(gw, "gateway.dead_letter", 3.0, 3.0, admit, {**ra, "dead_letter.attempt": 1,
                                                        "dead_letter.lost_worker": "w0"})
    for p in providers:
        p.shutdown()
    d, text = explained(capsys, "job-3", path)
    parts = d["queued_s"] + d["running_s"] + d["suspended_s"] + d["transit_s"] + d["other_s"]
    assert parts == pytest.approx(d["total_s"]) and d["transit"]["lost"] == pytest.approx(1.791), d
    assert "dead-lettered" in text, text


def test_a_batch_appended_to_one_cut_short_is_read(tmp_path, capsys):
    """A full disk cut a process's batch short (its line without an end); once there was room again, the next
    batch was appended to that line. explain skipped the whole line as not JSON, and with it the batch after the
    cut: here the job's dispatch, so that its hand-over to the worker was told as 'other'."""
    path = tmp_path / "spans.jsonl"
    (gw, wk, other), providers = tracers(path, "tiered-serve-gateway", "tiered-serve-worker", "tiered-serve-worker")
    ra = req_attrs("job-1", "P2", "lab-co")
    admit = admission(gw, None, 0.0, "job-1", "P2", "lab-co")
    closed(gw, "gateway.queue", 0.001, 0.201, admit, {**ra, "queue.tier": "P2", "queue.tier_granted": "P2",
                                                      "queue.attempt": 1})
    closed(other, "worker.request", 0.1, 0.2, None, req_attrs("job-2", "P3", "lab-co"))
    lines = path.read_text().splitlines()
    path.write_text("".join(ln + "\n" for ln in lines[:-1]) + lines[-1][:150])  # the other's batch, as far as it got
    dispatch = closed(gw, "gateway.dispatch", 0.201, 0.203, admit,
                      {**ra, "dispatch.worker": "w0", "dispatch.reason": "credit", "dispatch.attempt": 1})
    wreq = start(wk, "worker.request", 0.205, dispatch, ra)
    closed(wk, "worker.prefill", 0.21, 0.3, wreq, ra)
    wreq.end(end_time=ns(0.5))
    for p in providers:
        p.shutdown()
    assert '"stringValue":"lab-co"' in path.read_text().splitlines()[2], "not the cut batch's line"
    d, text = explained(capsys, "job-1", path)
    assert d["transit"]["dispatch"] == pytest.approx(0.002) and d["other_s"] == pytest.approx(0.0), d
    assert d["workers"] == ["w0"] and [p["phase"] for p in d["phases"]] == ["queue", "dispatch", "prefill"], d
