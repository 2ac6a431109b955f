"""explain on spans whose attribute values no gateway of this project writes, but any other producer exporting to the
same Jaeger or file may (a request.id is only a string): a clear answer, never a traceback or a hang.

Spans are made by the real OpenTelemetry SDK and written through its OTLP-JSON file exporter."""

from __future__ import annotations

import json
import re
import time

from opentelemetry.exporter.otlp.json.file import FileSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from scripts import explain
from tests.test_explain import admission, closed, ns, req_attrs, start


def one_job(path, attempt) -> None:
    """job-1: admitted, queued, dispatched as ``attempt`` (what the dispatch span says), run on w0."""
    provider = TracerProvider(resource=Resource.create({"service.name": "tiered-serve-gateway"}))
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(str(path))))
    gw = provider.get_tracer("test")
    ra = req_attrs("job-1", "P2", "lab-co")
    admit = admission(gw, None, 0.0, "job-1", "P2", "lab-co")
    closed(gw, "gateway.queue", 0.001, 0.5, admit, {**ra, "queue.tier": "P2", "queue.tier_granted": "P2"})
    dispatch = closed(gw, "gateway.dispatch", 0.5, 0.502, admit,
                      {**ra, "dispatch.worker": "w0", "dispatch.reason": "credit", "dispatch.attempt": attempt})
    wreq = start(gw, "worker.request", 0.503, dispatch, ra)
    closed(gw, "worker.prefill", 0.51, 0.6, wreq, ra)
    wreq.end(end_time=ns(1.0))
    provider.shutdown()


def test_an_infinite_attempt_number_is_an_answer_not_a_traceback(tmp_path, capsys):
    """A double attribute of +inf where an integer is read (dispatch.attempt): int(inf) raised OverflowError, which
    the readers of attribute values did not catch, and explain died with a traceback."""
    path = tmp_path / "spans.jsonl"
    one_job(path, float("inf"))
    assert "Infinity" in path.read_text()
    assert explain.main(["job-1", "--spans", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["total_s"] > 0.9 and d["workers"] == ["w0"], d


def test_a_huge_attempt_number_is_told_in_bounded_time_and_lines(tmp_path, capsys):
    """A dispatch that says attempt 10**12: explain listed each earlier attempt as missing, one line each, counting
    to 10**12 (hours of CPU and memory without bound); 10**7 took seconds and printed ten million lines."""
    path = tmp_path / "spans.jsonl"
    one_job(path, 10**12)
    t = time.monotonic()
    assert explain.main(["job-1", "--spans", str(path), "--json"]) == 0
    assert time.monotonic() - t < 5
    d = json.loads(capsys.readouterr().out)
    assert d["missing"] == ["gateway.dispatch of attempts 1-999999999999: their queue waits, hand-offs and workers"], \
        d["missing"]
    # One missing attempt keeps its words.
    path2 = tmp_path / "two.jsonl"
    one_job(path2, 2)
    assert explain.main(["job-1", "--spans", str(path2), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["missing"] == ["gateway.dispatch of attempt 1: that attempt's queue wait, hand-off and worker"], d


def test_nan_and_infinite_figures_leave_the_json_strict_and_the_text_without_nan(tmp_path, capsys):
    """A wait estimate, a decision's cost and its KV share of NaN or +-inf (doubles any producer may write): explain
    told "estimated nan s at admission" and "KV inf% used", and --json wrote NaN and Infinity, which JSON (RFC 8259)
    has not: jq, JavaScript and Go refuse the whole answer. Such a figure is now left out, as one not recorded."""
    path = tmp_path / "spans.jsonl"
    provider = TracerProvider(resource=Resource.create({"service.name": "tiered-serve-gateway"}))
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(str(path))))
    gw = provider.get_tracer("test")
    ra = req_attrs("job-1", "P2", "lab-co")
    admit = admission(gw, None, 0.0, "job-1", "P2", "lab-co", estimate=float("nan"))
    closed(gw, "gateway.queue", 0.001, 0.5, admit, {**ra, "queue.tier": "P2", "queue.tier_granted": "P2"})
    dispatch = closed(gw, "gateway.dispatch", 0.5, 0.502, admit,
                      {**ra, "dispatch.worker": "w0", "dispatch.reason": "credit", "dispatch.attempt": 1})
    wreq = start(gw, "worker.request", 0.503, dispatch, ra)
    closed(gw, "worker.prefill", 0.51, 0.6, wreq, ra)
    closed(gw, "scheduler.preemption", 0.6, 0.6001, wreq, {
        "preemption.decision_id": "pd-1", "preemption.victim.request_id": "job-1",
        "preemption.beneficiary.request_id": "b", "preemption.estimated_cost_s": float("nan"),
        "kv.utilisation": float("inf")})
    closed(gw, "worker.suspended", 0.6, 0.7, wreq, {**ra, "suspend.decision_id": "pd-1"})
    wreq.end(end_time=ns(1.0))
    provider.shutdown()
    assert explain.main(["job-1", "--spans", str(path)]) == 0
    text = capsys.readouterr().out
    assert not re.search(r"\bnan\b|\binf\b", text, re.I), text
    assert "by request b, decision pd-1" in text, text
    assert explain.main(["job-1", "--spans", str(path), "--json"]) == 0

    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    d = json.loads(capsys.readouterr().out, parse_constant=refuse)
    (dec,) = d["decisions"]
    assert dec["estimated_cost_s"] is None and dec["kv_utilisation"] is None, dec
