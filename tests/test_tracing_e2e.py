"""End-to-end traces: a real cluster exports over OTLP/HTTP to a receiver in this test, which decodes
the protobuf as Jaeger's receiver does; then explain reads the same spans from a file and from an
api_v3-shaped server."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from gateway.sdk import GatewayClient
from scripts import explain
from tests.cluster_helpers import job_hash, local_cluster, wait_for
from tests.jaeger_helpers import FakeJaeger, jaeger_from_file


class OtlpReceiver:
    """POST /v1/traces with an ExportTraceServiceRequest protobuf, as Jaeger's OTLP/HTTP receiver takes it."""

    def __init__(self) -> None:
        self.resource_spans: list[dict] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                with outer.lock:
                    outer.resource_spans += [_hex_ids(MessageToDict(rs)) for rs in req.resource_spans]
                data = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def spans(self) -> list[dict]:
        """Flattened spans, each with its service name."""
        with self.lock:
            out = []
            for rs in self.resource_spans:
                service = _attrs(rs.get("resource", {})).get("service.name")
                for ss in rs.get("scopeSpans", []):
                    for s in ss.get("spans", []):
                        out.append(s | {"service": service, "attrs": _attrs(s)})
            return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _b64_to_hex(v: str) -> str:
    return base64.b64decode(v).hex()


def _hex_ids(rs: dict) -> dict:
    """protobuf JSON writes bytes as base64; OTLP/JSON (and Jaeger) use hex ids."""
    for ss in rs.get("scopeSpans", []):
        for s in ss.get("spans", []):
            for k in ("traceId", "spanId", "parentSpanId"):
                if s.get(k):
                    s[k] = _b64_to_hex(s[k])
            for link in s.get("links", []):
                link["traceId"], link["spanId"] = _b64_to_hex(link["traceId"]), _b64_to_hex(link["spanId"])
    return rs


def _attrs(obj: dict) -> dict:
    return {kv["key"]: next(iter(kv["value"].values()), None) for kv in obj.get("attributes", [])}


@pytest.fixture(scope="module")
def traced_run(tiny_model_dir, tmp_path_factory):
    receiver = OtlpReceiver()
    client_provider = TracerProvider(resource=Resource.create({"service.name": "test-client"}))
    client_provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{receiver.url}/v1/traces")))
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    tmp = tmp_path_factory.mktemp("traced")
    try:
        with local_cluster(tmp, tiny_model_dir, workers=1, max_running=2, env=env, http=False) as c:
            def client(tenant):
                return GatewayClient(c["gateway"], c["tenants"][tenant]["api_key"], timeout_s=60,
                                     tracer_provider=client_provider)
            lab, chat = client("lab-co"), client("chat-co")
            flood = [lab.submit(prompt_token_ids=[5, i], max_tokens=1500, ignore_eos=True) for i in range(4)]
            wait_for(lambda: sum(job_hash(c, j.id)["state"] == "dispatched" for j in flood) == 2, 30,
                     "two P3 jobs running")
            wait_for(lambda: all(len(list(_first_tokens(j))) for j in flood[:1]), 30, "tokens flowing")
            urgent = chat.submit(prompt_token_ids=[9, 9], max_tokens=64, ignore_eos=True, tier="P0")
            # Three more P0 turns at once (the tenant's P0 burst allows four in all), all long enough to outlive
            # the submissions. The worker has two slots and a gateway sends a job only where it can run or
            # preempt (a P0 never preempts a P0), so once two P0s hold both slots the other two wait in Redis,
            # the last behind the third.
            more = [chat.submit(prompt_token_ids=[9, i], max_tokens=64, ignore_eos=True, tier="P0") for i in range(3)]
            results = {j.id: j.result(timeout=120) for j in [urgent] + more + flood}
            wait_for(lambda: any(s["name"] == "scheduler.preemption" for s in receiver.spans()), 30,
                     "the decision span to be exported")
        # The cluster has stopped: every process flushed its spans on the way out.
        yield {"spans": receiver.spans(), "resource_spans": receiver.resource_spans, "urgent": urgent.id,
               "more_p0": [j.id for j in more],
               "flood": [j.id for j in flood], "results": results}
    finally:
        receiver.close()


def _first_tokens(job):
    for chunk in job.stream(timeout=30):
        yield chunk
        return


def test_one_trace_per_request_across_sdk_gateway_and_worker(traced_run):
    spans = traced_run["spans"]
    for job_id in [traced_run["urgent"]] + traced_run["flood"]:
        own = [s for s in spans if s["attrs"].get("request.id") == job_id]
        assert len({s["traceId"] for s in own}) == 1, job_id
        names = {s["name"] for s in own}
        assert {"sdk.submit", "gateway.admit", "gateway.queue", "gateway.dispatch", "worker.request",
                "worker.queue", "worker.prefill", "worker.decode"} <= names, names
        assert {s["service"] for s in own} >= {"test-client", "tiered-serve-gateway", "tiered-serve-worker"}
        assert all(s["attrs"].get("request.tier") for s in own)
        assert all(s["attrs"].get("tenant.id") for s in own if s["service"] != "test-client")
        by_id = {s["spanId"]: s for s in own}
        worker_req = next(s for s in own if s["name"] == "worker.request")
        dispatch = by_id[worker_req["parentSpanId"]]
        assert dispatch["name"] == "gateway.dispatch" and dispatch["attrs"]["dispatch.worker"] == "wk-0"


def test_preemption_decision_spans_link_victim_and_beneficiary(traced_run):
    spans = traced_run["spans"]
    decisions = [s for s in spans if s["name"] == "scheduler.preemption"]
    assert decisions
    request_spans = {s["spanId"]: s for s in spans if s["name"] == "worker.request"}
    for d in decisions:
        a = d["attrs"]
        for key in ("preemption.decision_id", "preemption.trigger", "preemption.mode", "preemption.victim.request_id",
                    "preemption.victim.tier", "preemption.beneficiary.request_id", "preemption.beneficiary.tier",
                    "preemption.blocks_freed", "preemption.bytes_moved", "preemption.estimated_cost_s",
                    "kv.utilisation", "scheduler.running.P3", "scheduler.waiting.P0"):
            assert key in a, key
        assert a["preemption.beneficiary.tier"] == "P0"
        assert a["preemption.victim.tier"] == "P3" and a["preemption.trigger"] == "slot" and a["preemption.mode"] == "keep"
        linked = {request_spans[link["spanId"]]["attrs"]["request.id"] for link in d.get("links", [])
                  if link["spanId"] in request_spans}
        assert linked == {a["preemption.victim.request_id"], a["preemption.beneficiary.request_id"]}
        victim_span = next(s for s in request_spans.values()
                           if s["attrs"]["request.id"] == a["preemption.victim.request_id"])
        assert any(link["spanId"] == d["spanId"] for link in victim_span.get("links", []))  # linked both ways


def test_victim_trace_shows_its_suspended_period(traced_run):
    spans = traced_run["spans"]
    d = next(s for s in spans if s["name"] == "scheduler.preemption")
    victim = d["attrs"]["preemption.victim.request_id"]
    suspended = [s for s in spans if s["name"] == "worker.suspended" and s["attrs"]["request.id"] == victim]
    assert suspended
    victim_trace = {s["traceId"] for s in spans if s["attrs"].get("request.id") == victim}
    assert {s["traceId"] for s in suspended} == victim_trace
    assert suspended[0]["attrs"]["suspend.by_request_id"] == d["attrs"]["preemption.beneficiary.request_id"]
    assert suspended[0]["attrs"]["suspend.decision_id"] == d["attrs"]["preemption.decision_id"]
    assert traced_run["results"][victim].preemptions >= 1


def test_explain_names_the_preempting_request_from_a_file_and_from_jaeger(traced_run, tmp_path, capsys):
    spans_file = tmp_path / "spans.jsonl"
    spans_file.write_text("".join(json.dumps({"resourceSpans": [rs]}) + "\n" for rs in traced_run["resource_spans"]))
    d = next(s for s in traced_run["spans"] if s["name"] == "scheduler.preemption")
    victim, urgent = d["attrs"]["preemption.victim.request_id"], d["attrs"]["preemption.beneficiary.request_id"]
    assert explain.main([victim, "--spans", str(spans_file)]) == 0
    text = capsys.readouterr().out
    assert urgent in text and "P0" in text and "chat-co" in text
    with FakeJaeger(jaeger_from_file(spans_file)) as jaeger:
        assert explain.main([victim, "--jaeger", jaeger.url, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
    assert any(s["by_request_id"] == urgent for s in data["suspensions"])
    assert data["suspended_s"] > 0
    # Nothing is left unexplained on real spans: every interval is queued, running, suspended or in transit
    # (to the gateway, admission, dispatch, to the worker, delivery), and they add up to the total.
    for rid in [victim, urgent, *traced_run["more_p0"]]:
        assert explain.main([rid, "--spans", str(spans_file), "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["other_s"] < 0.002, (rid, d["transit"], d["other_s"])
        parts = d["queued_s"] + d["running_s"] + d["suspended_s"] + d["transit_s"] + d["other_s"]
        assert parts == pytest.approx(d["total_s"], abs=0.002), d


def test_explain_on_a_queued_p0_request_names_what_was_ahead(traced_run, tmp_path, capsys):
    spans_file = tmp_path / "spans.jsonl"
    spans_file.write_text("".join(json.dumps({"resourceSpans": [rs]}) + "\n" for rs in traced_run["resource_spans"]))
    admits = {s["attrs"]["request.id"]: s for s in traced_run["spans"]
              if s["name"] == "gateway.admit" and s["attrs"].get("request.id") in traced_run["more_p0"]}
    # The P0 that found the most P0s queued ahead of it at admission: at least one (it really queued).
    job = max(admits, key=lambda j: int(admits[j]["attrs"]["queue.ahead.P0"]))

    def timeline():
        """Per P0, its admission, dispatch and worker spans in ms from the first: the failure message."""
        ids = [traced_run["urgent"], *traced_run["more_p0"]]
        own = [s for s in traced_run["spans"] if s["attrs"].get("request.id") in ids and s["name"] in
               ("gateway.admit", "gateway.dispatch", "worker.request", "worker.prefill")]
        t0 = min(int(s["startTimeUnixNano"]) for s in own)

        def ms(ns: str) -> int:
            return round((int(ns) - t0) / 1e6)

        return {i[:6]: sorted((ms(s["startTimeUnixNano"]), ms(s["endTimeUnixNano"]), s["name"])
                              for s in own if s["attrs"]["request.id"] == i) for i in ids}

    assert int(admits[job]["attrs"]["queue.ahead.P0"]) >= 1, timeline()
    assert explain.main([job, "--spans", str(spans_file)]) == 0
    text = capsys.readouterr().out
    assert "behind" in text and "P0" in text
    with FakeJaeger(jaeger_from_file(spans_file)) as jaeger:
        assert explain.main([job, "--jaeger", jaeger.url, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
    assert data["tier"] == "P0" and any(c["kind"] == "queue" for c in data["blame"])


def test_gateway_spans_are_on_the_unix_clock_and_explain_totals_are_real(traced_run, tmp_path, capsys):
    """The gateway's loop clock is monotonic: its queue spans ended, and its dispatch spans began, at a
    monotonic time (hours since boot), so every queue span ran backwards, every dispatch span lasted 56 years,
    and explain told a total of 1.8e9 s, of which 'in transit (dispatch)' all but the running time."""
    spans = traced_run["spans"]
    first = min(int(s["startTimeUnixNano"]) for s in spans)
    last = max(int(s["endTimeUnixNano"]) for s in spans)
    assert (last - first) / 1e9 < 600, "spans stretch over more than the run"
    for s in spans:
        assert int(s["endTimeUnixNano"]) >= int(s["startTimeUnixNano"]), (s["name"], s["attrs"])
    by_id = {s["spanId"]: s for s in spans}
    for d in (s for s in spans if s["name"] == "gateway.dispatch"):
        queue = next(s for s in spans if s["name"] == "gateway.queue" and s["attrs"]["request.id"] == d["attrs"]
                     ["request.id"] and s["attrs"]["queue.attempt"] == d["attrs"]["dispatch.attempt"])
        assert queue["endTimeUnixNano"] == d["startTimeUnixNano"]
        assert by_id[d["parentSpanId"]]["name"] == "gateway.admit"
    spans_file = tmp_path / "spans.jsonl"
    spans_file.write_text("".join(json.dumps({"resourceSpans": [rs]}) + "\n" for rs in traced_run["resource_spans"]))
    # The flood's last two P3 jobs waited in Redis for a slot (two slots, four jobs, then the P0s came).
    waited = traced_run["flood"][2:]
    for rid in [traced_run["urgent"], *traced_run["flood"]]:
        assert explain.main([rid, "--spans", str(spans_file), "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert 0 < d["total_s"] < 300, d["total_s"]
        assert d["transit"]["dispatch"] < 1.0, d["transit"]
        if rid in waited:
            assert d["queued_s"] > 0.1, d


def test_explain_tells_the_wait_of_a_job_cancelled_or_expired_in_its_queue(tiny_model_dir, tmp_path, capsys):
    """A job that left its queue undispatched (cancelled, or its queue timeout ran out) had no gateway.queue span
    (the gateway made it at dispatch only): explain told a job that waited out its whole timeout 'total 0.00 s'
    and 'nothing held it up'."""
    import time

    from tests.durable_cluster import DurableCluster

    spans = tmp_path / "spans.jsonl"
    env = {"OTEL_TRACES_EXPORTER": "otlp_json_file", "TS_SPANS_FILE": str(spans), "OTEL_BSP_SCHEDULE_DELAY": "100",
           "TS_GATEWAY_TIER_TIMEOUTS_S": '{"P0": 30, "P1": 60, "P2": 1}'}
    # No worker: nothing is dispatched, and with no measured capacity the wait estimate refuses nothing.
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0, gateway_env=env) as c:
        with c.client("batch-co", timeout_s=30.0) as batch:
            expiring = batch.submit(prompt_token_ids=[5], max_tokens=1, tier="P2")
            waiting = batch.submit(prompt_token_ids=[6], max_tokens=1, tier="P3")
            wait_for(lambda: c.state(expiring.id) == "expired", 30, "the P2 job to expire")
            time.sleep(0.5)
            assert batch.cancel(waiting.id) and c.state(waiting.id) == "cancelled"
        waited = {j: (int(c.job(j)["finished_at_ms"]) - int(c.job(j)["enqueued_at_ms"])) / 1e3
                  for j in (expiring.id, waiting.id)}
    for job_id, outcome in ((expiring.id, "then expired: its queue timeout ran out"),
                            (waiting.id, "then cancelled while queued")):
        assert explain.main([job_id, "--spans", str(spans)]) == 0
        text = capsys.readouterr().out
        assert outcome in text and "nothing held it up" not in text, text
        assert explain.main([job_id, "--spans", str(spans), "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["queued_s"] == pytest.approx(waited[job_id], abs=0.05), (d, waited)
        assert [b["detail"]["outcome"] for b in d["blame"] if b["kind"] == "queue"] == [outcome.split()[1].rstrip(":")]
        parts = d["queued_s"] + d["running_s"] + d["suspended_s"] + d["transit_s"] + d["other_s"]
        assert parts == pytest.approx(d["total_s"], abs=0.002) and d["other_s"] < 0.002, d


def test_explain_names_the_lost_last_attempt_of_a_dead_lettered_job(tiny_model_dir, tmp_path, capsys):
    """A lease lost on the last allowed attempt dead-letters the job. Earlier lost attempts are told by the next
    dispatch's span (dispatch.requeue_cause, dispatch.lost_worker), but the last one has no next dispatch: its trace
    ended at its dispatch, and explain could not say why the job failed nor where its time went after it."""
    from tests.durable_cluster import DurableCluster

    spans = tmp_path / "spans.jsonl"
    env = {"OTEL_TRACES_EXPORTER": "otlp_json_file", "TS_SPANS_FILE": str(spans), "OTEL_BSP_SCHEDULE_DELAY": "100",
           "TS_GATEWAY_MAX_ATTEMPTS": "1"}
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=1, lease_s=2.0, gateway_env=env) as c:
        with c.client("batch-co", timeout_s=30.0) as batch:
            job = batch.submit(prompt_token_ids=[5, 6], max_tokens=2000, ignore_eos=True, tier="P2")
            wait_for(lambda: c.state(job.id) == "dispatched" and c.redis.exists(f"ts:{{c}}:tok:{job.id}"), 60,
                     "the job to stream")
            c.kill("wk-0")  # its lease runs out, on the only attempt it may have
            wait_for(lambda: c.state(job.id) == "dead", 30, "the job to be dead-lettered")
            dead = c.job(job.id)
    assert explain.main([job.id, "--spans", str(spans), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    [cause] = [b for b in d["blame"] if b["kind"] == "dead_letter"]
    assert {k: cause["detail"].get(k) for k in ("attempt", "worker", "cause")} == \
        {"attempt": 1, "worker": "wk-0", "cause": "lease_expired"}, cause
    # Its time runs to the dead-lettering (Redis's clock, as the queue's spans), the lost part named as lost.
    end_s = (int(dead["finished_at_ms"]) * 1_000_000 - d["start_unix_ns"]) / 1e9
    assert d["total_s"] == pytest.approx(end_s, abs=0.01), d
    assert d["transit"]["lost"] > 1.0 and d["other_s"] < 0.002, d
    assert explain.main([job.id, "--spans", str(spans)]) == 0
    text = capsys.readouterr().out
    assert "lease expired on worker wk-0" in text and "dead-lettered" in text, text
