"""explain on a request id that no span of its own carries, only other requests' spans name (a preemption decision's
victim or beneficiary, another request's suspension): its own spans rotated away or never exported. A clear message
that says where it is named, never an answer of zero seconds made of another request's spans. Spans made by the real
OpenTelemetry SDK (tests/test_explain.py's cluster)."""

from __future__ import annotations

import json

from common.traces import otlp_json
from tests.test_explain import run_main, spans  # noqa: F401  (spans: the module's fixture)

DECISIONS = {"scheduler.preemption", "scheduler.preemption_declined"}


def without_own(path, tmp_path, rid: str):
    """The file less every line of ``rid``'s own spans (its decisions, which carry no request.id, stay)."""
    kept = []
    for line in path.read_text().splitlines():
        got = otlp_json.spans_from_document(json.loads(line))
        if not any(str(s.get("request.id")) == rid and s.name not in DECISIONS for s in got):
            kept.append(line)
    out = tmp_path / f"without-{rid}.jsonl"
    out.write_text("\n".join(kept) + "\n")
    assert json.dumps(rid) in out.read_text()  # still named, by others' spans
    return out


def test_a_request_named_only_by_decisions_is_told_so_not_as_zero_seconds(spans, tmp_path, capsys):  # noqa: F811
    """chat-2 preempted req-p3 (decision pd-2, a span of chat-2's trace that names both). With chat-2's own spans
    gone, explain said 'request chat-2: total 0.00 s = queued 0.00 s + running 0.00 s ...', an empty trace id and
    nothing missing, exit 0: the decision's instant taken for the whole request."""
    path, ids = spans
    for rid, decisions in (("chat-2", ["pd-2"]), ("req-p3", ["pd-1", "pd-2"])):
        thinned = without_own(path, tmp_path, rid)
        rc, out, err = run_main(capsys, rid, "--spans", str(thinned))
        assert rc == 1 and out == "", (rid, out)
        assert f"no scheduling spans for request {rid}" in err, err
        for d in decisions:
            assert d in err, (rid, err)
        assert "Traceback" not in err
        rc, out, err = run_main(capsys, rid, "--spans", str(thinned), "--json")
        assert rc == 1, out
        data = json.loads(out)
        assert data["request_id"] == rid and data["trace_ids"] == []
        assert [d["decision_id"] for d in data["named_by"]] == decisions, data
        role = "beneficiary" if rid == "chat-2" else "victim"
        assert {d["role"] for d in data["named_by"]} == {role}
    # Its own spans there: explained as before.
    rc, out, err = run_main(capsys, "chat-2", "--spans", str(path))
    assert rc == 0 and "preempted request req-p3" in out, err


def test_a_request_named_only_in_another_requests_suspension_is_unknown(spans, tmp_path, capsys):  # noqa: F811
    """chat-1 is named by req-p3's worker.suspended span (suspend.by_request_id) alone: no trace of its own."""
    path, _ = spans
    kept = []
    for line in path.read_text().splitlines():
        got = otlp_json.spans_from_document(json.loads(line))
        if all(str(s.get("request.id")) == "req-p3" for s in got):
            kept.append(line)
    only = tmp_path / "only-p3.jsonl"
    only.write_text("\n".join(kept) + "\n")
    assert json.dumps("chat-1") in only.read_text()
    rc, out, err = run_main(capsys, "chat-1", "--spans", str(only), "--json")
    assert rc == 1 and "no scheduling spans for request chat-1 (no trace carries it)" in err, err
    assert json.loads(out)["trace_ids"] == []
