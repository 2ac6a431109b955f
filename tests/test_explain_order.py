"""explain's answer does not hang on the order of the spans file's lines: spans of the same start and end (a coarse
clock, one scheduler step's decisions) were kept in the order they were read, and so was what explain told of them.
Lines come in any order (several processes appending, rotated files, an exporter's retry)."""

from __future__ import annotations

import json
import random

from opentelemetry import trace
from opentelemetry.exporter.otlp.json.file import FileSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from common.traces import NoSchedulingSpans, explain_request
from scripts import explain
from tests.test_explain import admission, closed, ns, req_attrs, start
from tests.test_explain_large_inputs import random_spans


def one_step_two_decisions(path) -> None:
    """v (P3) on w0 loses its slot to b1 and its blocks to b2 in one scheduler step: both decisions stamped with the
    same instants (no suspended span recorded); then two dispatch spans of the same instants (to w1 and w2)."""
    provider = TracerProvider(resource=Resource.create({"service.name": "tiered-serve-worker"}))
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(str(path))))
    tr = provider.get_tracer("test")
    ra = req_attrs("v", "P3", "lab")
    admit = admission(tr, None, 0.0, "v", "P3", "lab")
    closed(tr, "gateway.queue", 0.001, 0.01, admit, {**ra, "queue.tier": "P3", "queue.attempt": 1})
    d1 = closed(tr, "gateway.dispatch", 0.01, 0.01, admit, {**ra, "dispatch.worker": "w0", "dispatch.attempt": 1})
    wreq = start(tr, "worker.request", 0.011, d1, ra)
    closed(tr, "worker.prefill", 0.012, 0.02, wreq, ra)
    for b, mode, trigger in (("b1", "keep", "slot"), ("b2", "swap", "blocks")):
        ben = start(tr, "worker.request", 0.02, None, req_attrs(b, "P0", "chat"))
        d = closed(tr, "scheduler.preemption", 0.021, 0.021, ben, {
            "preemption.decision_id": f"pd-{b}", "preemption.trigger": trigger, "preemption.mode": mode,
            "preemption.victim.request_id": "v", "preemption.beneficiary.request_id": b,
            "preemption.beneficiary.tier": "P0"}, links=[trace.Link(wreq.get_span_context(), {"link.role": "victim"})])
        wreq.add_link(d.get_span_context(), {"link.role": "preempted_by"})
        ben.end(end_time=ns(0.03))
    wreq.end(end_time=ns(0.05))
    closed(tr, "gateway.queue", 0.06, 0.07, admit, {**ra, "queue.tier": "P3", "queue.attempt": 2})
    for w in ("w1", "w2"):
        closed(tr, "gateway.dispatch", 0.07, 0.07, admit, {**ra, "dispatch.worker": w, "dispatch.attempt": 2})
    provider.shutdown()


def test_shuffled_lines_give_the_same_answer(tmp_path, capsys):
    path = tmp_path / "spans.jsonl"
    one_step_two_decisions(path)
    lines = path.read_text().splitlines()
    rng = random.Random(17)
    answers = set()
    for k in range(12):
        rng.shuffle(lines)
        shuffled = tmp_path / f"shuffled-{k}.jsonl"
        shuffled.write_text("\n".join(lines) + "\n")
        assert explain.main(["v", "--spans", str(shuffled), "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert explain.main(["v", "--spans", str(shuffled)]) == 0
        answers.add((json.dumps(d, sort_keys=True), capsys.readouterr().out))
    assert len(answers) == 1, [json.loads(a)["workers"] for a, _ in answers]
    d = json.loads(answers.pop()[0])
    assert [c["kind"] for c in d["blame"]].count("preempted") == 2 and d["attempts"] == 3, d["blame"]


def test_shuffled_spans_give_the_same_answer_on_random_inputs():
    """Spans of every name on a grid of instants with many ties, empty and backwards spans, unset starts."""
    rng = random.Random(5)
    for _ in range(1500):
        spans = random_spans(rng)
        for s in spans:
            if rng.random() < 0.5:
                s.attributes["request.id"] = "r"
            if rng.random() < 0.3:
                s.attributes |= {"dispatch.worker": rng.choice("ab"), "queue.tier": rng.choice(["P1", "P2"])}
            if rng.random() < 0.3:
                s.parent_span_id = format(rng.randint(0, 25), "016x")
            if s.name == "scheduler.preemption":
                s.attributes |= {"preemption.victim.request_id": "r", "preemption.beneficiary.request_id":
                                 rng.choice("xy"), "preemption.decision_id": f"d{rng.randint(0, 3)}"}
        want = answer(spans)
        for _ in range(3):
            rng.shuffle(spans)
            assert answer(spans) == want, spans


def answer(spans):
    try:
        exp = explain_request(spans, "r", fallback_all=True)
    except NoSchedulingSpans as e:
        return str(e)
    return json.dumps(exp.to_dict(), sort_keys=True), exp.render_text()
