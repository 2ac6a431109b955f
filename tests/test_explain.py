"""scripts/explain.py and common/traces/ on traces made by the real OpenTelemetry SDK.

The traces follow the project's span schema: an SDK client span, gateway admission / queue /
dispatch, and worker request / queue / prefill / decode / suspended spans, written by several
"processes" (one tracer provider each) through the official OTLP-JSON file exporter into one
file. Preemption decisions live in the beneficiary's trace and link to the victim's
``worker.request`` span, which links back (``preempted_by``). The same file is then served as
Jaeger api_v3 answers by an in-process HTTP server.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from common import traces as tm
from common.spans_file import AppendStream
from common.traces import otlp_json
from scripts import explain
from tests.jaeger_helpers import FakeJaeger, jaeger_from_file, not_found, resource_spans_of

pytest.importorskip("opentelemetry.sdk.trace")
FileSpanExporter = pytest.importorskip("opentelemetry.exporter.otlp.json.file").FileSpanExporter

from opentelemetry import trace  # noqa: E402
from opentelemetry.context import Context  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
GOLDEN_OTLP = DATA / "otlp" / "trace.json"
GOLDEN_SUMMARIES = DATA / "jaeger" / "apiv3_FindTraceSummaries_response.json"
GOLDEN_GET_TRACE = DATA / "jaeger" / "apiv3_GetTrace_response.json"
SCRIPT = ROOT / "scripts" / "explain.py"

T0 = 1_750_000_000 * 10**9  # all times below are seconds after this instant


def ns(t: float) -> int:
    return T0 + round(t * 1e9)


# --------------------------------------------------------------------------------------------
# Building traces with the SDK


class AppendExporter(FileSpanExporter):
    """The cluster's exporter (common/tracing.py: FileSpanExporter over an AppendStream), closing its stream when its
    provider shuts down: the SDK's exporter does not close a stream it was given, and each writer a test made held the
    spans file open in the pytest process for the rest of the run."""

    def __init__(self, path) -> None:
        self.stream = AppendStream(path)
        super().__init__(stream=self.stream)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        super().shutdown(timeout_millis, **kwargs)
        self.stream.close()


class Cluster:
    """One tracer provider per process, all appending OTLP-JSON lines to one file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.providers: list[TracerProvider] = []
        self.tracers: dict[str, trace.Tracer] = {}

    def tracer(self, process: str, service: str) -> trace.Tracer:
        if process not in self.tracers:
            provider = TracerProvider(resource=Resource.create({"service.name": service,
                                                                "service.instance.id": process}))
            provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(str(self.path))))
            self.providers.append(provider)
            self.tracers[process] = provider.get_tracer("tiered_serve.test")
        return self.tracers[process]

    def shutdown(self) -> None:
        for p in self.providers:
            p.shutdown()


def req_attrs(rid: str, tier: str, tenant: str) -> dict:
    return {"request.id": rid, "request.tier": tier, "tenant.id": tenant}


def start(tracer, name, t, parent=None, attrs=None, links=()):
    ctx = trace.set_span_in_context(parent) if parent is not None else Context()
    return tracer.start_span(name, context=ctx, start_time=ns(t), attributes=attrs or {}, links=list(links))


def closed(tracer, name, t0, t1, parent=None, attrs=None, links=(), events=()):
    span = start(tracer, name, t0, parent, attrs, links)
    for ev_name, t, ev_attrs in events:
        span.add_event(ev_name, ev_attrs, timestamp=ns(t))
    span.end(end_time=ns(t1))
    return span


def admission(gw, root, t, rid, tier, tenant, *, requested=None, granted=None, quota="none", position=0,
              ahead=None, estimate=0.0):
    a = dict(req_attrs(rid, granted or tier, tenant))
    a.update({"admission.tier_requested": requested or tier, "admission.tier_granted": granted or tier,
              "admission.quota": quota, "admission.estimated_wait_s": estimate, "queue.position": position})
    for t_ in ("P0", "P1", "P2", "P3"):
        a[f"queue.ahead.{t_}"] = (ahead or {}).get(t_, 0)
    return closed(gw, "gateway.admit", t, t + 0.001, root, a)


def p0_beneficiary(c: Cluster, rid: str, t: float, *, victim_span, victim_rid, victim_tier, victim_tenant,
                   decision_id, mode, trigger, blocks, moved, cost, resume_t, end_t, worker="w0"):
    """A P0 request of chat-co that preempts ``victim_span`` at ``t`` (its decision span in its own trace)."""
    client, gw, wk = c.tracer("chat-app", "chat-app"), c.tracer("gw", "tiered-serve-gateway"), \
        c.tracer(worker, "tiered-serve-worker")
    ra = req_attrs(rid, "P0", "chat-co")
    root = start(client, "sdk.submit", t - 0.05, None, ra)
    admission(gw, root, t - 0.049, rid, "P0", "chat-co", quota="ok")
    closed(gw, "gateway.queue", t - 0.048, t - 0.046, root, {**ra, "queue.tier": "P0", "queue.tier_granted": "P0"})
    dispatch = closed(gw, "gateway.dispatch", t - 0.046, t - 0.044, root,
                      {**ra, "dispatch.worker": worker, "dispatch.reason": "cheapest_preemption",
                       "dispatch.attempt": 1})
    wreq = start(wk, "worker.request", t - 0.04, dispatch, ra)
    closed(wk, "worker.queue", t - 0.04, t, wreq, ra)
    decision = closed(wk, "scheduler.preemption", t, t + 0.0001, wreq, {
        "preemption.decision_id": decision_id, "preemption.trigger": trigger, "preemption.mode": mode,
        "preemption.declined": False,
        "preemption.victim.request_id": victim_rid, "preemption.victim.tier": victim_tier,
        "preemption.victim.tenant": victim_tenant,
        "preemption.beneficiary.request_id": rid, "preemption.beneficiary.tier": "P0",
        "preemption.beneficiary.tenant": "chat-co",
        "preemption.blocks_freed": blocks, "preemption.bytes_moved": moved, "preemption.estimated_cost_s": cost,
        "kv.utilisation": 0.93, "scheduler.running.P0": 0, "scheduler.running.P1": 0,
        "scheduler.running.P2": 0, "scheduler.running.P3": 2, "scheduler.waiting.P0": 1,
        "scheduler.waiting.P1": 0, "scheduler.waiting.P2": 0, "scheduler.waiting.P3": 3,
    }, links=[trace.Link(victim_span.get_span_context(), {"link.role": "victim"}),
              trace.Link(wreq.get_span_context(), {"link.role": "beneficiary"})])
    victim_span.add_link(decision.get_span_context(), {"link.role": "preempted_by"})
    closed(wk, "worker.prefill", t + 0.0001, t + 0.03, wreq, ra)
    closed(wk, "worker.decode", t + 0.03, resume_t - 0.01, wreq, ra)
    wreq.end(end_time=ns(resume_t - 0.005))
    root.end(end_time=ns(end_t))
    return decision


def build_spans_file(path: Path) -> dict:
    c = Cluster(path)
    client, gw = c.tracer("batch-app", "batch-client"), c.tracer("gw", "tiered-serve-gateway")
    w0, w1 = c.tracer("w0", "tiered-serve-worker"), c.tracer("w1", "tiered-serve-worker")
    ids: dict[str, str] = {}

    # (a) req-p3: P3 of lab-co, aged to P2 in the queue, then preempted twice on w0 by two P0 requests.
    ra = req_attrs("req-p3", "P3", "lab-co")
    root = start(client, "sdk.submit", 0.0, None, ra)
    admission(gw, root, 0.010, "req-p3", "P3", "lab-co", position=1, ahead={"P3": 1}, estimate=0.9)
    closed(gw, "gateway.queue", 0.012, 1.012, root, {**ra, "queue.tier": "P2", "queue.tier_granted": "P3"},
           events=[("aged", 0.800, {"from_tier": "P3", "to_tier": "P2"})])
    dispatch = closed(gw, "gateway.dispatch", 1.012, 1.015, root,
                      {**ra, "dispatch.worker": "w0", "dispatch.reason": "credit", "dispatch.attempt": 1})
    # w0 was in the middle of a step when the job was dispatched: it read it when the step ended.
    wreq = start(w0, "worker.request", 1.020, dispatch, {
        **ra, "worker.step_before.start_unix_ns": ns(1.001), "worker.step_before.end_unix_ns": ns(1.019),
        "worker.step_before.requests": 12, "worker.step_before.tokens": 340})
    closed(w0, "worker.queue", 1.020, 1.100, wreq, ra)
    closed(w0, "worker.prefill", 1.100, 1.180, wreq, ra)
    closed(w0, "worker.prefill", 1.180, 1.250, wreq, ra)
    d1 = p0_beneficiary(c, "chat-1", 1.500, victim_span=wreq, victim_rid="req-p3", victim_tier="P3",
                        victim_tenant="lab-co", decision_id="pd-1", mode="keep", trigger="slot", blocks=0, moved=0,
                        cost=0.0, resume_t=2.300, end_t=2.400)
    closed(w0, "worker.suspended", 1.500, 2.300, wreq, {
        **ra, "suspend.mode": "keep", "suspend.decision_id": "pd-1", "suspend.by_request_id": "chat-1",
        "suspend.by_tier": "P0", "suspend.by_tenant": "chat-co", "suspend.trigger": "slot"},
        links=[trace.Link(d1.get_span_context())])
    d2 = p0_beneficiary(c, "chat-2", 3.000, victim_span=wreq, victim_rid="req-p3", victim_tier="P3",
                        victim_tenant="lab-co", decision_id="pd-2", mode="swap", trigger="kv_memory", blocks=12,
                        moved=786432, cost=0.004, resume_t=3.600, end_t=3.700)
    closed(w0, "worker.suspended", 3.000, 3.600, wreq, {
        **ra, "suspend.mode": "swap", "suspend.decision_id": "pd-2", "suspend.by_request_id": "chat-2",
        "suspend.by_tier": "P0", "suspend.by_tenant": "chat-co", "suspend.trigger": "kv_memory"},
        links=[trace.Link(d2.get_span_context())])
    closed(w0, "worker.decode", 1.250, 5.900, wreq, ra)
    wreq.end(end_time=ns(5.900))
    root.end(end_time=ns(6.000))
    ids["req-p3"] = format(root.get_span_context().trace_id, "032x")
    ids["chat-1"] = format(d1.get_span_context().trace_id, "032x")
    ids["chat-2"] = format(d2.get_span_context().trace_id, "032x")

    # (b) chat-9: P0 of chat-co, queued behind 3 jobs, then a declined preemption on w1.
    rb = req_attrs("chat-9", "P0", "chat-co")
    root = start(c.tracer("chat-app", "chat-app"), "sdk.submit", 10.0, None, rb)
    admission(gw, root, 10.005, "chat-9", "P0", "chat-co", quota="ok", position=3, ahead={"P0": 2, "P3": 1},
              estimate=1.0)
    closed(gw, "gateway.queue", 10.006, 11.206, root, {**rb, "queue.tier": "P0", "queue.tier_granted": "P0"})
    dispatch = closed(gw, "gateway.dispatch", 11.206, 11.208, root,
                      {**rb, "dispatch.worker": "w1", "dispatch.reason": "credit", "dispatch.attempt": 1})
    wreq = start(w1, "worker.request", 11.210, dispatch, rb)
    closed(w1, "worker.queue", 11.210, 11.460, wreq, rb)
    closed(w1, "scheduler.preemption_declined", 11.300, 11.3001, wreq, {
        "preemption.decision_id": "pd-3", "preemption.trigger": "slot", "preemption.mode": "declined",
        "preemption.declined": True, "preemption.declined_reason": "victims_within_residency",
        "preemption.beneficiary.request_id": "chat-9", "preemption.beneficiary.tier": "P0",
        "preemption.beneficiary.tenant": "chat-co", "kv.utilisation": 0.5,
        "scheduler.running.P0": 0, "scheduler.running.P3": 4, "scheduler.waiting.P0": 1})
    closed(w1, "worker.prefill", 11.460, 11.500, wreq, rb)
    closed(w1, "worker.decode", 11.500, 12.450, wreq, rb)
    wreq.end(end_time=ns(12.450))
    root.end(end_time=ns(12.500))
    ids["chat-9"] = format(root.get_span_context().trace_id, "032x")

    # (c) api-7: asked for P0 with its quota spent (served as P1); its lease on w0 expired, attempt 2 on w1.
    rc = req_attrs("api-7", "P1", "chat-co")
    root = start(c.tracer("chat-app", "chat-app"), "sdk.submit", 20.0, None, rc)
    admission(gw, root, 20.001, "api-7", "P1", "chat-co", requested="P0", granted="P1", quota="downgraded")
    closed(gw, "gateway.queue", 20.002, 20.102, root, {**rc, "queue.tier": "P1", "queue.tier_granted": "P1"})
    closed(gw, "gateway.dispatch", 20.102, 20.104, root,
           {**rc, "dispatch.worker": "w0", "dispatch.reason": "credit", "dispatch.attempt": 1})
    # w0 died with the job: its worker.request span was never exported. The lease expired at 22.104.
    closed(gw, "gateway.queue", 22.104, 22.204, root, {**rc, "queue.tier": "P1", "queue.tier_granted": "P1",
                                                       "queue.position": 1, "queue.ahead.P1": 1})
    dispatch = closed(gw, "gateway.dispatch", 22.204, 22.206, root,
                      {**rc, "dispatch.worker": "w1", "dispatch.reason": "credit", "dispatch.attempt": 2})
    wreq = start(w1, "worker.request", 22.210, dispatch, rc)
    closed(w1, "worker.queue", 22.210, 22.220, wreq, rc)
    closed(w1, "worker.prefill", 22.220, 22.300, wreq, rc)
    closed(w1, "worker.decode", 22.300, 23.900, wreq, rc)
    wreq.end(end_time=ns(23.900))
    root.end(end_time=ns(24.000))
    ids["api-7"] = format(root.get_span_context().trace_id, "032x")

    # An unrelated trace without request attributes (another library's spans in the same file).
    closed(client, "HTTP GET /", 30.0, 30.1)
    c.shutdown()
    return ids


@pytest.fixture(scope="module")
def spans(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("spans") / "spans.jsonl"
    ids = build_spans_file(path)
    return path, ids


# --------------------------------------------------------------------------------------------
# The Jaeger api_v3 stand-in (tests/jaeger_helpers.py), answering from files


def jaeger_golden(route: str, query: dict[str, str]):
    if route == "/api/v3/traces":
        return 200, json.loads(GOLDEN_SUMMARIES.read_text())
    if route == "/api/v3/traces/00000000000000000000000000000001":
        return 200, json.loads(GOLDEN_GET_TRACE.read_text())
    return not_found("trace not found")


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    rc = explain.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def as_json(capsys, *argv: str) -> dict:
    rc, out, err = run_main(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


# --------------------------------------------------------------------------------------------
# Parsing


def test_golden_otlp_example_parses():
    got = otlp_json.parse_spans_text(GOLDEN_OTLP.read_text())
    [s] = got.spans
    assert s.trace_id == "5b8efff798038103d269b633813fc60c"  # upper-case hex in, lower-case out
    assert s.span_id == "eee19b7ec3c1b174" and s.parent_span_id == "eee19b7ec3c1b173"
    assert s.name == "I'm a server span" and s.service == "my.service" and s.kind == 2
    assert s.start_ns == 1544712660000000000 and s.duration_s == 1.0
    assert s.attributes == {"my.span.attr": "some value"}


def test_golden_jaeger_get_trace_parses():
    [s] = otlp_json.spans_from_document(json.loads(GOLDEN_GET_TRACE.read_text()))
    assert (s.trace_id, s.span_id, s.parent_span_id, s.name) == \
        ("00000000000000000000000000000001", "0000000000000002", None, "foobar")
    assert s.start_ns == 0 and s.status_code == 2
    assert otlp_json.trace_ids_from_summaries(json.loads(GOLDEN_SUMMARIES.read_text())) == \
        ["00000000000000000000000000000001"]


def test_ids_values_and_times_of_every_otlp_shape():
    tid = bytes(range(1, 17))
    sid = bytes(range(1, 9))
    assert otlp_json.normalise_id(base64.b64encode(tid).decode(), 16) == tid.hex()
    assert otlp_json.normalise_id(base64.b64encode(sid).decode(), 8) == sid.hex()
    assert otlp_json.normalise_id(tid.hex().upper(), 16) == tid.hex()
    assert otlp_json.normalise_id("", 8) is None and otlp_json.normalise_id("0" * 16, 8) is None
    assert otlp_json.parse_nanos("1544712660000000000") == otlp_json.parse_nanos(1544712660000000000) == 1544712660000000000
    assert otlp_json.parse_nanos(None) == 0
    attrs = otlp_json.parse_attributes([
        {"key": "s", "value": {"stringValue": "x"}}, {"key": "i", "value": {"intValue": "42"}},
        {"key": "i2", "value": {"intValue": 7}}, {"key": "d", "value": {"doubleValue": 0.5}},
        {"key": "inf", "value": {"doubleValue": "Infinity"}}, {"key": "b", "value": {"boolValue": True}},
        {"key": "a", "value": {"arrayValue": {"values": [{"intValue": "1"}, {"stringValue": "two"}]}}},
        {"key": "kv", "value": {"kvlistValue": {"values": [{"key": "k", "value": {"boolValue": False}}]}}},
        {"key": "by", "value": {"bytesValue": base64.b64encode(b"\x01\xff").decode()}},
        {"key": "empty", "value": {}},
    ])
    assert attrs == {"s": "x", "i": 42, "i2": 7, "d": 0.5, "inf": float("inf"), "b": True, "a": [1, "two"],
                     "kv": {"k": False}, "by": "01ff", "empty": None}


def test_reads_the_sdk_file_exporter_lines(spans):
    path, ids = spans
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    assert len(lines) > 20  # one line per span (SimpleSpanProcessor), several processes
    got = otlp_json.read_spans_file(path)
    assert {s.trace_id for s in got.spans} >= set(ids.values())
    decision = next(s for s in got.spans
                    if s.name == "scheduler.preemption" and s.get("preemption.decision_id") == "pd-1")
    assert decision.trace_id == ids["chat-1"] and {lk.attributes["link.role"] for lk in decision.links} == \
        {"victim", "beneficiary"}
    victim = next(s for s in got.spans if s.name == "worker.request" and s.get("request.id") == "req-p3")
    assert [lk.attributes["link.role"] for lk in victim.links] == ["preempted_by", "preempted_by"]
    queue = next(s for s in got.spans if s.name == "gateway.queue" and s.get("request.id") == "req-p3")
    assert queue.events[0].name == "aged" and queue.events[0].attributes == {"from_tier": "P3", "to_tier": "P2"}
    roots = [s for s in got.spans if s.name == "sdk.submit"]
    assert roots and all(s.parent_span_id is None for s in roots)


def test_a_large_file_is_read_a_line_at_a_time_not_held_whole(spans, tmp_path):
    """up.py's spans file grows about 2.6 KB a job, unrotated: a day of traffic is gigabytes. The reader held the
    whole text and a list of its lines (twice the file in memory) to explain one request; it streams it now, and
    holds the lines that name the request or its traces."""
    path, _ = spans
    big = tmp_path / "big.jsonl"
    # Another job's span, as up.py writes them: ids of another trace, and words. Not one 400-character run of id
    # characters: every substring of such a run is looked up as a possible id (~1,600 a line), and under
    # tracemalloc that took minutes here while the reading and its memory are the same.
    other = {"traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174", "name": "worker.step",
             "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000000018000000",
             "attributes": [{"key": "note", "value": {"stringValue": "a step of another job " * 8}}]}
    filler = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [other]}]}]}) + "\n"
    with big.open("w") as out:
        out.write(filler * 40_000)  # about 18 MB ahead of the request's lines, and as much after
        out.write(path.read_text())
        out.write(filler * 40_000)
    want = otlp_json.read_spans_file(path, "req-p3")
    # Measured in a process of its own: tracemalloc counts every thread's allocations, and threads that earlier tests
    # left in this one (a client's, an exporter's) allocate while the read runs, the more the slower the machine.
    child = subprocess.run([sys.executable, "-c", READ_UNDER_TRACEMALLOC, str(big), "req-p3"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    peak, got = json.loads(child.stdout)
    assert sorted(map(tuple, got)) == sorted((s.trace_id, s.span_id) for s in want.spans)
    assert peak < 8 * 2**20, f"peak {peak / 2**20:.1f} MiB reading a {big.stat().st_size / 2**20:.0f} MiB file"


READ_UNDER_TRACEMALLOC = """
import json, sys, tracemalloc
from common.traces import otlp_json
tracemalloc.start()
got = otlp_json.read_spans_file(sys.argv[1], sys.argv[2])
_, peak = tracemalloc.get_traced_memory()
print(json.dumps([peak, [(s.trace_id, s.span_id) for s in got.spans]]))
"""


# --------------------------------------------------------------------------------------------
# Analysis, from the OTLP-JSON file


def test_p3_preempted_twice_by_p0_requests(spans, capsys):
    path, ids = spans
    rc, out, err = run_main(capsys, "req-p3", "--spans", str(path))
    assert rc == 0, err
    assert "request req-p3 (P3, tenant lab-co): total 6.00 s = queued 1.08 s + running 3.40 s + suspended 1.40 s" in out
    assert "queued 1.00 s behind 1 job (P3: 1)" in out
    assert "aged P3 -> P2 at +0.8 s" in out
    assert "suspended 0.80 s (keep) by request chat-1 (P0, tenant chat-co), decision pd-1" in out
    assert "suspended 0.60 s (swap) by request chat-2 (P0, tenant chat-co), decision pd-2" in out
    assert "12 KV blocks freed, 768.0 KiB moved" in out  # from pd-2's decision span, in chat-2's trace
    assert out.index("aged P3") < out.index("chat-1") < out.index("chat-2")  # chronological

    data = as_json(capsys, "req-p3", "--spans", str(path))
    assert data["trace_ids"] == [ids["req-p3"]]
    assert data["total_s"] == pytest.approx(6.0) and data["queued_s"] == pytest.approx(1.08)
    assert data["running_s"] == pytest.approx(3.40) and data["suspended_s"] == pytest.approx(1.40)
    # Every interval between the spans is named: nothing is left as "other".
    assert data["other_s"] == pytest.approx(0.0) and data["transit_s"] == pytest.approx(0.12)
    assert data["transit"] == pytest.approx({"to_gateway": 0.010, "admission": 0.002, "dispatch": 0.003,
                                             "to_worker": 0.005, "lost": 0.0, "hand_back": 0.0, "delivery": 0.1,
                                             "other": 0.0})
    assert "in transit 0.12 s (to gateway 0.01, to worker 0.01, delivery 0.10) + other 0.00 s" in out
    to_worker = next(c for c in data["blame"] if c["kind"] == "to_worker")
    assert to_worker["duration_s"] == pytest.approx(0.005)
    assert to_worker["detail"] == {"worker": "w0", "step_requests": 12, "step_tokens": 340,
                                   "step_s": pytest.approx(0.018)}
    assert "reached worker w0 0.005 s after dispatch: it was running a step (12 requests, 340 tokens, 0.018 s)" \
        in out
    sus = data["suspensions"]
    assert [(s["by_request_id"], s["by_tier"], s["by_tenant"], s["decision_id"], s["mode"]) for s in sus] == \
        [("chat-1", "P0", "chat-co", "pd-1", "keep"), ("chat-2", "P0", "chat-co", "pd-2", "swap")]
    assert sum(s["duration_s"] for s in sus) == pytest.approx(data["suspended_s"])
    assert [d["decision_id"] for d in data["decisions"]] == ["pd-1", "pd-2"]
    assert all(d["role"] == "victim" for d in data["decisions"])
    assert data["decisions"][1]["trace_id"] == ids["chat-2"] and data["decisions"][1]["bytes_moved"] == 786432
    assert [c["kind"] for c in data["blame"]] == ["queue", "aging", "to_worker", "worker_queue", "suspended",
                                                  "suspended"]
    assert {p["phase"] for p in data["phases"]} == {"queue", "dispatch", "worker_queue", "prefill", "decode",
                                                     "suspended"}


def test_p0_queued_behind_other_jobs(spans, capsys):
    path, _ = spans
    rc, out, err = run_main(capsys, "chat-9", "--spans", str(path))
    assert rc == 0, err
    assert "queued 1.20 s behind 3 jobs (P0: 2, P3: 1)" in out
    assert "waited 0.25 s in worker w1's queue" in out
    assert "waited: no preemption possible (victims_within_residency)" in out
    data = as_json(capsys, "chat-9", "--spans", str(path))
    q = data["blame"][0]
    assert q["kind"] == "queue" and q["detail"]["jobs_ahead"] == 3 and q["detail"]["ahead"] == \
        {"P0": 2, "P1": 0, "P2": 0, "P3": 1}
    assert q["duration_s"] == pytest.approx(1.2)
    assert data["queued_s"] == pytest.approx(1.45) and data["suspended_s"] == 0
    assert data["running_s"] == pytest.approx(0.99) and data["total_s"] == pytest.approx(2.5)


def test_beneficiary_sees_whom_it_preempted(spans, capsys):
    path, _ = spans
    data = as_json(capsys, "chat-2", "--spans", str(path))
    [cause] = [c for c in data["blame"] if c["kind"] == "preempting"]
    assert cause["text"] == "preempted request req-p3 (P3, tenant lab-co) to get its slot, decision pd-2 (swap)"
    assert any(c["kind"] == "dispatch" and "cheapest preemption" in c["text"] for c in data["blame"])


def test_quota_downgrade_and_lease_expiry(spans, capsys):
    path, _ = spans
    rc, out, err = run_main(capsys, "api-7", "--spans", str(path))
    assert rc == 0, err
    assert "P0 quota spent: served as P1" in out
    assert "lease expired on worker w0; attempt 2 on worker w1 (2.00 s lost on w0)" in out
    assert "re-queued 0.10 s behind 1 job (P1: 1)" in out
    assert out.index("quota") < out.index("lease expired") < out.index("re-queued")
    data = as_json(capsys, "api-7", "--spans", str(path))
    assert data["attempts"] == 2 and data["workers"] == ["w0", "w1"]
    assert data["tier_requested"] == "P0" and data["tier_granted"] == "P1"
    # The two seconds between the first dispatch and the re-queue were lost on w0, not left unexplained.
    assert data["transit"]["lost"] == pytest.approx(2.0) and data["other_s"] == pytest.approx(0.0)


def test_decisions_without_suspended_spans_still_name_the_preemptor(spans, tmp_path, capsys):
    path, _ = spans
    lines = [ln for ln in path.read_text().splitlines() if '"name":"worker.suspended"' not in ln]
    thinned = tmp_path / "no-suspended.jsonl"
    thinned.write_text("\n".join(lines) + "\n")
    data = as_json(capsys, "req-p3", "--spans", str(thinned))
    assert data["suspended_s"] == 0
    assert [c["text"] for c in data["blame"] if c["kind"] == "preempted"] == [
        "preempted (keep) by request chat-1 (P0, tenant chat-co), decision pd-1 (suspended period not recorded)",
        "preempted (swap) by request chat-2 (P0, tenant chat-co), decision pd-2 (suspended period not recorded)"]


def test_single_document_with_base64_ids_gives_the_same_answer(spans, tmp_path, capsys):
    path, _ = spans

    def b64(hex_id: str) -> str:
        return base64.b64encode(bytes.fromhex(hex_id)).decode()

    rss = resource_spans_of(path)
    for rs in rss:
        for ss in rs["scopeSpans"]:
            for s in ss["spans"]:
                for k in ("traceId", "spanId", "parentSpanId"):
                    if k in s:
                        s[k] = b64(s[k])
                for lk in s.get("links", []):
                    lk["traceId"], lk["spanId"] = b64(lk["traceId"]), b64(lk["spanId"])
                s["startTimeUnixNano"] = int(s["startTimeUnixNano"])  # ints as well as strings
    doc = tmp_path / "one.json"
    doc.write_text(json.dumps({"resourceSpans": rss}, indent=2))
    for rid in ("req-p3", "chat-9"):
        assert as_json(capsys, rid, "--spans", str(doc)) == as_json(capsys, rid, "--spans", str(path))


def test_a_truncated_line_is_skipped_with_a_warning(spans, tmp_path, capsys):
    path, _ = spans
    text = path.read_text()
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text(text + text.splitlines()[0][:40] + ' "req-p3"\n')
    rc, out, err = run_main(capsys, "req-p3", "--spans", str(damaged))
    assert rc == 0 and "suspended 0.80 s (keep) by request chat-1" in out
    assert "warning" in err and "not JSON" in err


def test_request_split_over_two_traces(tmp_path, capsys):
    """A worker that did not continue the gateway's trace context starts a second trace: both count,
    and the caller's own span around sdk.submit does not stretch the request's total."""
    path = tmp_path / "split.jsonl"
    c = Cluster(path)
    app, gw = c.tracer("app", "chat-app"), c.tracer("gw", "tiered-serve-gateway")
    wk = c.tracer("w0", "tiered-serve-worker")
    ra = req_attrs("split-1", "P2", "batch-co")
    handler = start(app, "POST /summarise", -1.0)
    root = start(app, "sdk.submit", 0.0, handler, ra)
    admission(gw, root, 0.001, "split-1", "P2", "batch-co", position=2, ahead={"P1": 1, "P2": 1})
    closed(gw, "gateway.queue", 0.002, 0.502, root, {**ra, "queue.tier": "P2"})
    closed(gw, "gateway.dispatch", 0.502, 0.503, root,
           {**ra, "dispatch.worker": "w0", "dispatch.reason": "credit", "dispatch.attempt": 1})
    wreq = start(wk, "worker.request", 0.505, None, ra)  # no parent: a new trace
    closed(wk, "worker.queue", 0.505, 0.605, wreq, ra)
    closed(wk, "worker.decode", 0.605, 1.0, wreq, ra)
    wreq.end(end_time=ns(1.0))
    root.end(end_time=ns(1.01))
    handler.end(end_time=ns(3.0))
    c.shutdown()
    data = as_json(capsys, "split-1", "--spans", str(path))
    assert len(data["trace_ids"]) == 2
    assert data["total_s"] == pytest.approx(1.01) and data["queued_s"] == pytest.approx(0.6)
    assert data["running_s"] == pytest.approx(0.395)
    assert data["blame"][0]["text"] == "queued 0.50 s behind 2 jobs (P1: 1, P2: 1)"
    with FakeJaeger(jaeger_from_file(path)) as jaeger:
        gateway_only = as_json(capsys, "split-1", "--jaeger", jaeger.url)
        assert len(gateway_only["trace_ids"]) == 1 and gateway_only["running_s"] == 0
        both = as_json(capsys, "split-1", "--jaeger", jaeger.url, "--service", "tiered-serve-gateway",
                       "--service", "tiered-serve-worker")
        assert both == data
        assert [q["query.service_name"] for p, q in jaeger.calls if p == "/api/v3/traces"][-2:] == \
            ["tiered-serve-gateway", "tiered-serve-worker"]


def test_a_promised_start_is_named_as_a_cause(tmp_path, capsys):
    """A P3 whose promise fell due while it waited (gateway/promises.py): the queue span's event says when, so the
    user sees why nothing newer went ahead of it from then on."""
    path = tmp_path / "promise.jsonl"
    c = Cluster(path)
    app, gw = c.tracer("app", "batch-app"), c.tracer("gw", "tiered-serve-gateway")
    ra = req_attrs("prom-1", "P3", "lab-co")
    root = start(app, "sdk.submit", 0.0, None, ra)
    admission(gw, root, 0.001, "prom-1", "P3", "lab-co", position=3, ahead={"P2": 3}, estimate=2.0)
    closed(gw, "gateway.queue", 0.002, 2.302, root, {**ra, "queue.tier": "P2", "queue.tier_granted": "P3"},
           events=[("promised start", 1.502, {"to_tier": "P2"})])
    closed(gw, "gateway.dispatch", 2.302, 2.303, root,
           {**ra, "dispatch.worker": "w0", "dispatch.reason": "credit", "dispatch.attempt": 1})
    root.end(end_time=ns(2.4))
    c.shutdown()
    data = as_json(capsys, "prom-1", "--spans", str(path))
    promise = next(b for b in data["blame"] if b["kind"] == "promise")
    assert promise["detail"] == {"to_tier": "P2", "after_queued_s": pytest.approx(1.5)}
    assert "promised start fell due at +1.5 s: moved to P2" in promise["text"]
    assert [b["kind"] for b in data["blame"]][:2] == ["queue", "promise"]


def test_no_scheduling_spans(spans, capsys):
    path, _ = spans
    rc, out, err = run_main(capsys, "no-such-request", "--spans", str(path))
    assert rc == 1 and "no scheduling spans for request no-such-request" in err and out == ""
    rc, out, err = run_main(capsys, "some-request", "--spans", str(GOLDEN_OTLP), "--json")
    assert rc == 1 and "no scheduling spans for request some-request" in err
    assert json.loads(out)["error"].startswith("no scheduling spans for request some-request")
    with pytest.raises(tm.NoSchedulingSpans):
        tm.explain_request(otlp_json.spans_from_document(json.loads(GOLDEN_GET_TRACE.read_text())), "x", fallback_all=True)


def test_png_timeline(spans, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path, _ = spans
    png = tmp_path / "timeline.png"
    rc, out, err = run_main(capsys, "req-p3", "--spans", str(path), "--png", str(png))
    assert rc == 0, err
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_trace_analysis_does_not_import_matplotlib():
    code = "import sys, common.traces; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=30).returncode == 0


# --------------------------------------------------------------------------------------------
# Jaeger api_v3


def test_jaeger_gives_the_same_answer_and_follows_links(spans, capsys):
    path, ids = spans
    with FakeJaeger(jaeger_from_file(path)) as jaeger:
        for rid in ("req-p3", "chat-9", "api-7"):
            jaeger.calls.clear()
            before = datetime.now().astimezone()
            from_jaeger = as_json(capsys, rid, "--jaeger", jaeger.url)
            assert from_jaeger == as_json(capsys, rid, "--spans", str(path))
            route, q = jaeger.calls[0]
            assert route == "/api/v3/traces"
            assert q["query.service_name"] == "tiered-serve-gateway"
            assert json.loads(q["query.attributes"]) == {"request.id": rid}
            t_min = datetime.fromisoformat(q["query.start_time_min"].replace("Z", "+00:00"))
            t_max = datetime.fromisoformat(q["query.start_time_max"].replace("Z", "+00:00"))
            assert q["query.start_time_max"].endswith("Z")
            assert (t_max - t_min).total_seconds() == pytest.approx(24 * 3600)
            assert abs((t_max - before).total_seconds()) < 30
            assert jaeger.get_trace_ids()[0] == ids[rid]
        # req-p3's decisions live in chat-1's and chat-2's traces: reached through the preempted_by links.
        jaeger.calls.clear()
        text_rc, out, err = run_main(capsys, "req-p3", "--jaeger", jaeger.url + "/", "--service",
                                     "tiered-serve-gateway", "--lookback", "2h")
        assert text_rc == 0, err
        assert jaeger.get_trace_ids() == [ids["req-p3"], ids["chat-1"], ids["chat-2"]]
        assert "12 KV blocks freed" in out
        q = jaeger.calls[0][1]
        t_min = datetime.fromisoformat(q["query.start_time_min"].replace("Z", "+00:00"))
        t_max = datetime.fromisoformat(q["query.start_time_max"].replace("Z", "+00:00"))
        assert (t_max - t_min).total_seconds() == pytest.approx(2 * 3600)
        # Another service name finds nothing: a clear message, exit 2.
        rc, out, err = run_main(capsys, "req-p3", "--jaeger", jaeger.url, "--service", "nobody")
        assert rc == 2 and "found no trace with request.id=req-p3 for service nobody" in err


def test_jaeger_golden_summaries_answer(capsys):
    with FakeJaeger(jaeger_golden) as jaeger:
        rc, out, err = run_main(capsys, "req-1", "--jaeger", jaeger.url)
    assert rc == 1 and "no scheduling spans for request req-1" in err
    assert jaeger.get_trace_ids() == ["00000000000000000000000000000001"]


@pytest.mark.parametrize(("app", "expect"), [
    (lambda r, q: (500, {"error": {"httpCode": 500, "message": "storage unavailable"}}),
     "answered HTTP 500 for /api/v3/traces: storage unavailable"),
    (lambda r, q: not_found("No traces found"), "found no trace with request.id=req-p3"),
    (lambda r, q: (200, b"<html>proxy error</html>"), "something that is not JSON"),
    (lambda r, q: (200, {"result": {"resourceSpans": []}}) if r == "/api/v3/traces" else not_found("x"),
     "found no trace"),
    (lambda r, q: (200, {"summaries": [{"traceId": "00000000000000000000000000000009"}]}) if r == "/api/v3/traces"
     else not_found("trace not found"), "returned no spans for the traces of request req-p3"),
    (lambda r, q: time.sleep(1.5) or (200, {}), "did not answer within 0.3 s"),
])
def test_jaeger_failures_are_clear_messages(app, expect, capsys):
    with FakeJaeger(app) as jaeger:
        rc, out, err = run_main(capsys, "req-p3", "--jaeger", jaeger.url, "--timeout", "0.3")
    assert rc == 2 and expect in err and "Traceback" not in err and out == ""


# --------------------------------------------------------------------------------------------
# The CLI as a process


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60, cwd="/")


def test_cli_help_and_exit_codes(spans, tmp_path):
    path, _ = spans
    r = cli("--help")
    assert r.returncode == 0 and "REQUEST_ID" in r.stdout and "--jaeger" in r.stdout and "exit status" in r.stdout
    r = cli("chat-9", "--spans", str(path), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["request_id"] == "chat-9"
    r = cli("nobody", "--spans", str(path))
    assert r.returncode == 1 and "no scheduling spans for request nobody" in r.stderr
    r = cli("x", "--spans", str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "cannot read" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "junk.txt").write_text("not json at all\n")
    r = cli("x", "--spans", str(tmp_path / "junk.txt"))
    assert r.returncode == 2 and "no OTLP/JSON" in r.stderr and "Traceback" not in r.stderr
    with FakeJaeger(jaeger_golden) as jaeger:
        closed_url = jaeger.url
    r = cli("x", "--jaeger", closed_url, "--timeout", "2")  # nothing listens there any more
    assert r.returncode == 2 and "cannot reach Jaeger" in r.stderr and "Traceback" not in r.stderr
    r = cli("x")  # neither --spans nor --jaeger
    assert r.returncode == 2 and "one of the arguments --spans --jaeger is required" in r.stderr
