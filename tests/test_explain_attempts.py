"""explain on a job dispatched thousands of times (each attempt's lease expired and it was re-queued): each attempt
leaves a queue, dispatch, worker request, worker queue and prefill span. Spans are made by the real OpenTelemetry SDK
and written through its OTLP-JSON file exporter. Judged by how this process's CPU time grows (time.process_time),
never by a wall-clock limit."""

from __future__ import annotations

import json
import time

from opentelemetry.exporter.otlp.json.file import FileSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from common.traces import explain_request
from common.traces.otlp_json import read_spans_file
from scripts import explain
from tests.test_explain import admission, closed, req_attrs, start


def dispatched_often(path, n: int) -> None:
    """job-1 (P2): admitted, then ``n`` times queued, dispatched to w<i % 3>, waiting in its queue and running a
    prefill chunk there before its lease expired (the last attempt ran to its end)."""
    provider = TracerProvider(resource=Resource.create({"service.name": "tiered-serve-gateway"}))
    provider.add_span_processor(BatchSpanProcessor(FileSpanExporter(str(path)), max_queue_size=6 * n + 16,
                                                   max_export_batch_size=512))
    gw = provider.get_tracer("test")
    ra = req_attrs("job-1", "P2", "lab-co")
    admit = admission(gw, None, 0.0, "job-1", "P2", "lab-co")
    t = 0.001
    for i in range(1, n + 1):
        closed(gw, "gateway.queue", t, t + 0.01, admit, {**ra, "queue.tier": "P2", "queue.tier_granted": "P2",
                                                         "queue.attempt": i, "queue.position": i % 4})
        dispatch = closed(gw, "gateway.dispatch", t + 0.01, t + 0.011, admit,
                          {**ra, "dispatch.worker": f"w{i % 3}", "dispatch.reason": "credit", "dispatch.attempt": i})
        wreq = start(gw, "worker.request", t + 0.012, dispatch, ra)
        closed(gw, "worker.queue", t + 0.012, t + 0.02, wreq, ra)
        closed(gw, "worker.prefill", t + 0.02, t + 0.03, wreq, ra)
        wreq.end(end_time=wreq.start_time + 20_000_000)
        t += 0.05
    provider.shutdown()


def test_a_job_dispatched_thousands_of_times_is_explained_in_time_growing_with_its_attempts(tmp_path, capsys):
    """Each phase counted its attempt by a pass over every dispatch, each re-dispatch looked for its re-queue in
    every queue span, each worker queue and worker request for its dispatch in every dispatch, each worker queue
    wait for its worker request in every one: from 500 attempts to 2,000, 12x the CPU of the analysis.
    Now about 4x (the analysis alone timed: the file's reading is linear and would hide it)."""
    cpu: dict[int, float] = {}
    for n in (500, 2000):
        path = tmp_path / f"spans-{n}.jsonl"
        dispatched_often(path, n)
        spans = read_spans_file(path, "job-1").spans
        spent = []
        for _ in range(2):  # the least of two: one collection could double a run
            t = time.process_time()
            exp = explain_request(spans, "job-1")
            exp.to_dict(), exp.render_text()
            spent.append(time.process_time() - t)
        cpu[n] = min(spent)
        assert explain.main(["job-1", "--spans", str(path), "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["attempts"] == n and d["workers"] == [f"w{i % 3}" for i in range(1, n + 1)], d["workers"][:5]
        assert [p["attempt"] for p in d["phases"] if p["phase"] == "prefill"] == list(range(1, n + 1))
        told = [c for c in d["blame"] if c["kind"] == "redispatch"]
        assert len(told) == n - 1 and told[-1]["text"].startswith(f"lease expired on worker w{(n - 1) % 3}; "
                                                                  f"attempt {n} on worker w{n % 3}"), told[-1]
        assert d["missing"] == [] and d["other_s"] < 1e-6, d["missing"]
    assert cpu[2000] < 8 * cpu[500], cpu  # 16x for the square, 4x linear
