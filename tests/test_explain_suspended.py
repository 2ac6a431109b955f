"""explain on a suspended period that more than one decision took from: its slot to one request, then its KV blocks
to another, in the same engine step or a later one. The real engine (tiny model) writes its spans through the
OpenTelemetry SDK's OTLP-JSON file exporter; explain reads that file, as it reads a worker's spans file."""

from __future__ import annotations

import json

from opentelemetry.exporter.otlp.json.file import FileSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Link

from scripts import explain
from tests.engine_helpers import prompts
from tests.test_explain import closed, req_attrs, start
from worker import Engine, EngineConfig, SamplingParams
from worker.tracing import EngineTracer

# Two slots, six blocks of four tokens, two of them kept for P0 (tests/test_preemption_engine.py's cases).
CONFIG = dict(max_num_seqs=2, num_kv_blocks=6, block_size=4, p0_reserve_blocks=2, swap_space_mb=0,
              isolate_p0_prefill=False)


def provider_to(path) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": "tiered-serve-worker"}))
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(str(path))))
    return provider


def run_engine(model_dir, path, *, p2_prompt_len: int) -> None:
    """A P2 (x) and a P3 (v, tenant lab) fill every unreserved block; a P0 (a, tenant chat) comes. With an 8-token
    P2 the P3 gives its slot to the P0 and its blocks to the P2 in one step; with a 7-token P2 the blocks go in a
    later step, when the P2 resumes."""
    engine = Engine.from_pretrained(model_dir, EngineConfig(**CONFIG))
    provider = provider_to(path)
    engine.tracer = EngineTracer(provider.get_tracer("test"))
    ps = prompts(3, seed=93, lo=8, hi=9)
    engine.add_request("x", ps[0][:p2_prompt_len], SamplingParams(max_tokens=6, ignore_eos=True), tier="P2")
    engine.add_request("v", ps[1], SamplingParams(max_tokens=6, ignore_eos=True), tier="P3", tenant="lab")
    engine.step()
    engine.add_request("a", ps[2][:4], SamplingParams(max_tokens=4, ignore_eos=True), tier="P0", tenant="chat")
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    provider.shutdown()


def explained(path, capsys, rid="v") -> tuple[str, dict]:
    assert explain.main([rid, "--spans", str(path)]) == 0
    text = capsys.readouterr().out
    assert explain.main([rid, "--spans", str(path), "--json"]) == 0
    return text, json.loads(capsys.readouterr().out)


def decisions_against_v(path) -> list[dict]:
    """The attributes of each decision that took from v, read from the file."""
    out = []
    for line in path.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for sp in ss["spans"]:
                    a = {kv["key"]: next(iter(kv["value"].values())) for kv in sp.get("attributes", [])}
                    if sp["name"] == "scheduler.preemption" and a.get("preemption.victim.request_id") == "v":
                        out.append(a)
    return out


def decision_steps(path) -> dict[str, int]:
    """decision id -> the engine step it was made in (scheduler.step), for the decisions that took from v."""
    return {a["preemption.decision_id"]: int(a["scheduler.step"]) for a in decisions_against_v(path)}


def decision_ids(path) -> dict[str, str]:
    """beneficiary -> decision id of the decisions that took from v, read from the file."""
    return {a["preemption.beneficiary.request_id"]: a["preemption.decision_id"] for a in decisions_against_v(path)}


def test_every_decision_of_a_suspended_period_is_told_in_order(tiny_model_dir, tmp_path, capsys):
    """The P3 gave its slot to the P0 (keep), then its blocks to the P2 (recompute), in one step. Its suspended span
    lists both, but explain read only the single-valued attributes (the last decision) and told the first as
    "preempted ... (suspended period not recorded)", as if it had no suspended period: a cause told wrong."""
    path = tmp_path / "spans.jsonl"
    run_engine(tiny_model_dir, path, p2_prompt_len=8)
    ids = decision_ids(path)
    text, d = explained(path, capsys)
    assert "not recorded" not in text, text
    assert (f"by 2 decisions in turn: request a (P0, tenant chat), decision {ids['a']} (keep, trigger slot); "
            f"then request x (P2), decision {ids['x']} (recompute, trigger kv_memory)") in text, text
    # Each decision's own details, in order, under the line.
    assert text.index(f"decision {ids['a']}: 0 KV blocks freed") < text.index(f"decision {ids['x']}: 2 KV blocks"), text
    assert [c["kind"] for c in d["blame"]] == ["suspended"], d["blame"]
    (cause,) = d["blame"]
    assert [(t["decision_id"], t["by_request_id"], t["by_tier"], t["by_tenant"], t["mode"], t["trigger"])
            for t in cause["detail"]["takings"]] == [(ids["a"], "a", "P0", "chat", "keep", "slot"),
                                                     (ids["x"], "x", "P2", None, "recompute", "kv_memory")]
    assert [t["decision"]["decision_id"] for t in cause["detail"]["takings"]] == [ids["a"], ids["x"]]
    # The single-valued fields stay the last decision's, as before.
    assert (cause["detail"]["decision_id"], cause["detail"]["mode"]) == (ids["x"], "recompute")
    (sus,) = d["suspensions"]
    assert [t["by_request_id"] for t in sus["takings"]] == ["a", "x"]
    (phase,) = [p for p in d["phases"] if p["phase"] == "suspended"]
    assert phase["label"] == "by a (P0) then by x (P2)"


def test_a_later_steps_decision_is_told_with_its_time(tiny_model_dir, tmp_path, capsys):
    """The P3's blocks went to the P2 steps after its slot went to the P0: both told, the later one with when."""
    path = tmp_path / "spans.jsonl"
    run_engine(tiny_model_dir, path, p2_prompt_len=7)
    ids = decision_ids(path)
    text, d = explained(path, capsys)
    assert "not recorded" not in text, text
    (cause,) = [c for c in d["blame"] if c["kind"] == "suspended"]
    a, x = cause["detail"]["takings"]
    assert (a["by_request_id"], a["mode"], x["by_request_id"], x["mode"]) == ("a", "keep", "x", "recompute")
    steps = decision_steps(path)
    assert steps[ids["x"]] > steps[ids["a"]], steps  # a later step's: what this test is about
    told = (f"request a (P0, tenant chat), decision {ids['a']} (keep, trigger slot); then request x (P2), decision "
            f"{ids['x']} (recompute, trigger kv_memory)")
    assert told in text, text
    # Its time is told where it came 5 ms or more into the suspended period (a step of the tiny model on one torch
    # thread may take less): then it must be the decision's own.
    after = text.split(told, 1)[1]
    assert after.startswith(f" at +{x['at_s']:.2f} s") or not after.startswith(" at +"), text


def hand_made(path, suspended_attrs: dict, *, decisions=("a", "x")) -> None:
    """v's worker.request with one worker.suspended span of ``suspended_attrs``, and a decision span for each of
    ``decisions`` (beneficiary a: keep for its slot; x: recompute for blocks) in that beneficiary's trace."""
    provider = provider_to(path)
    wk = provider.get_tracer("test")
    ra = req_attrs("v", "P3", "lab")
    wreq = start(wk, "worker.request", 0.0, None, ra)
    closed(wk, "worker.prefill", 0.0, 0.1, wreq, ra)
    spans = []
    for i, (ben, mode, trig) in enumerate((("a", "keep", "slot"), ("x", "recompute", "kv_memory"))):
        if ben not in decisions:
            continue
        breq = start(wk, "worker.request", 0.1, None, req_attrs(ben, "P0" if ben == "a" else "P2", "chat"))
        spans.append(closed(wk, "scheduler.preemption", 0.1 + i * 0.001, 0.1011 + i * 0.001, breq, {
            "preemption.decision_id": f"pd-{i + 1}", "preemption.trigger": trig, "preemption.mode": mode,
            "preemption.victim.request_id": "v", "preemption.victim.tier": "P3",
            "preemption.beneficiary.request_id": ben, "preemption.beneficiary.tier": "P0" if ben == "a" else "P2",
            "preemption.beneficiary.tenant": "chat"}))
        breq.end()
    closed(wk, "worker.suspended", 0.102, 0.5, wreq, {**ra, **suspended_attrs},
           links=[Link(s.get_span_context()) for s in spans])
    closed(wk, "worker.decode", 0.5, 0.6, wreq, ra)
    wreq.end(end_time=int(wreq.start_time + 0.6e9))
    provider.shutdown()


LAST = {"suspend.mode": "recompute", "suspend.decision_id": "pd-2", "suspend.by_request_id": "x",
        "suspend.by_tier": "P2", "suspend.by_tenant": "chat", "suspend.trigger": "kv_memory"}


def test_a_suspended_span_without_the_lists_is_read_as_before(tmp_path, capsys):
    """A worker of an earlier release names only the last decision: the earlier one is told as before."""
    path = tmp_path / "old.jsonl"
    hand_made(path, LAST)
    text, d = explained(path, capsys)
    assert "preempted (keep) by request a (P0, tenant chat), decision pd-1 (suspended period not recorded)" in text
    assert "suspended 0.40 s (recompute) by request x (P2, tenant chat), decision pd-2, trigger kv_memory" in text
    assert [c["kind"] for c in d["blame"]] == ["preempted", "suspended"]


def test_hostile_decision_lists_are_told_bounded_not_a_traceback(tmp_path, capsys):
    """Lists no worker of this project writes (of another type, of other lengths, of a million entries, naming a
    decision not found): an answer in bounded time and lines, telling what it could."""
    cases = [
        ({"suspend.decision_ids": "pd-1", "suspend.by_request_ids": 7}, ["pd-1", "pd-2"]),
        ({"suspend.decision_ids": ["pd-1"], "suspend.by_request_ids": ["a", "q", "x"]}, ["pd-1", None, "pd-2"]),
        ({"suspend.decision_ids": ["pd-9", "pd-1", "pd-2"], "suspend.by_request_ids": ["z", "a", "x"]},
         ["pd-9", "pd-1", "pd-2"]),
        ({"suspend.decision_ids": [f"pd-{i}" for i in range(10**5)] + ["pd-2"]}, None),
    ]
    for i, (lists, expect) in enumerate(cases):
        path = tmp_path / f"h{i}.jsonl"
        hand_made(path, {**LAST, **lists})
        text, d = explained(path, capsys)
        (cause,) = [c for c in d["blame"] if c["kind"] == "suspended"]
        told = [t["decision_id"] for t in cause["detail"]["takings"]]
        assert len(text) < 20_000 and told[-1] == "pd-2", (i, text[:2000])
        if expect is not None:
            assert told == expect, (i, told)
        else:
            assert len(told) == 64 and cause["detail"]["takings_untold"] == 10**5 + 1 - 64, len(told)
            assert "by 100001 decisions in turn" in text and "99937 more decisions not told" in text
        # Neither decision found is told again as a preemption without its suspended period.
        assert "suspended period not recorded" not in text, (i, text)
