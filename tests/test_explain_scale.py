"""explain on a request with thousands of spans: a long offline job preempted again and again leaves a decision
span and a suspended span for each time. Spans are made by the real OpenTelemetry SDK and written through its
OTLP-JSON file exporter, as a worker writes them."""

from __future__ import annotations

import json
import time

from opentelemetry.exporter.otlp.json.file import FileSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Link

from scripts import explain
from tests.test_explain import closed, ns, req_attrs, start


def preempted_often(path, n: int) -> None:
    """v (P3) runs a chunk, is preempted by b<i> (P0, its decision in b<i>'s trace, linked both ways) and
    suspended, ``n`` times."""
    provider = TracerProvider(resource=Resource.create({"service.name": "tiered-serve-worker"}))
    provider.add_span_processor(BatchSpanProcessor(FileSpanExporter(str(path)), max_queue_size=4 * n + 16,
                                                   max_export_batch_size=512))
    wk = provider.get_tracer("test")
    ra = req_attrs("v", "P3", "lab")
    wreq = start(wk, "worker.request", 0.0, None, ra)
    t = 0.0
    for i in range(n):
        closed(wk, "worker.prefill", t, t + 0.001, wreq, ra)
        ben = start(wk, "worker.request", t + 0.001, None, req_attrs(f"b{i}", "P0", "chat"))
        d = closed(wk, "scheduler.preemption", t + 0.001, t + 0.0011, ben, {
            "preemption.decision_id": f"pd-{i}", "preemption.trigger": "slot", "preemption.mode": "keep",
            "preemption.victim.request_id": "v", "preemption.beneficiary.request_id": f"b{i}",
            "preemption.beneficiary.tier": "P0"}, links=[Link(wreq.get_span_context(), {"link.role": "victim"})])
        wreq.add_link(d.get_span_context(), {"link.role": "preempted_by"})
        ben.end(end_time=ns(t + 0.0015))
        closed(wk, "worker.suspended", t + 0.0012, t + 0.002, wreq,
               {**ra, "suspend.mode": "keep", "suspend.decision_id": f"pd-{i}", "suspend.by_request_id": f"b{i}"},
               links=[Link(d.get_span_context())])
        t += 0.002
    wreq.end(end_time=ns(t))
    provider.shutdown()


def test_a_request_preempted_thousands_of_times_is_explained_in_seconds(tmp_path, capsys):
    """Two loops grew with the square of the preemptions: reading the file, the set of the request's trace ids was
    rebuilt from every id sought (four per link) for each span; and each decision looked for the links to it through
    every link of every span of the request. 6,000 preemptions took 33 s on a 2-core machine, now about 5 s.
    Judged by how the CPU time grows from 1,500 preemptions to 6,000 (this process's, so other load on the machine
    does not count): about 6x now (4x would be linear; what is left is the spans file's scan for the ids sought),
    16x for the square."""
    cpu: dict[int, float] = {}
    for n in (1500, 6000):
        path = tmp_path / f"spans-{n}.jsonl"
        preempted_often(path, n)
        t = time.process_time()
        assert explain.main(["v", "--spans", str(path), "--json"]) == 0
        cpu[n] = time.process_time() - t
        d = json.loads(capsys.readouterr().out)
        assert len(d["suspensions"]) == n and [c["kind"] for c in d["blame"]] == ["suspended"] * n
        assert d["blame"][-1]["text"].startswith(
            f"suspended 0.00 s (keep) by request b{n - 1} (P0), decision pd-{n - 1}")
    assert cpu[6000] < 9 * cpu[1500], cpu
