"""explain across clocks and lost attempts, from a real cluster's spans (redis-server, gateway and worker processes,
spans through the file exporter): a gateway whose wall clock is off Redis's at admission, and a first attempt whose
worker was killed before it exported its spans."""

from __future__ import annotations

import json
import time

import pytest

from scripts import explain
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster

SKEW_S = -30.0  # the gateway's wall clock, behind Redis's (and the worker's)


def _spans_env(path) -> dict:
    return {"OTEL_TRACES_EXPORTER": "otlp_json_file", "TS_SPANS_FILE": str(path), "OTEL_BSP_SCHEDULE_DELAY": "100"}


def _explained(job_id: str, spans, capsys, ready=lambda d: True) -> tuple[dict, str]:
    """explain's --json and text of the job, once ``ready`` says its spans are all exported."""
    def told():
        if explain.main([job_id, "--spans", str(spans), "--json"]) != 0:
            capsys.readouterr()
            return None
        d = json.loads(capsys.readouterr().out)
        return d if ready(d) else None

    wait_for(told, 15, "the job's spans to be exported")
    d = told()
    assert explain.main([job_id, "--spans", str(spans)]) == 0
    return d, capsys.readouterr().out


def test_a_gateway_clock_behind_redis_is_not_told_as_admission_time(tiny_model_dir, tmp_path, capsys):
    """The admission span was on the admitting gateway's own clock, the queue span on Redis's: with the gateway 30 s
    behind, explain told 30 s 'in transit (admission 30.00)' between them, a wrong number only the clocks line hinted
    at. The admission span says how far the gateway's clock was from Redis's as admit.lua ran, and explain reads it
    on Redis's clock."""
    spans = tmp_path / "spans.jsonl"
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=1, gateway_env=_spans_env(spans),
                        clock_skew_s={"gw-0": SKEW_S}) as c:
        with c.client("batch-co", timeout_s=60.0) as batch:
            job = batch.submit(prompt_token_ids=[5, 6], max_tokens=4, ignore_eos=True, tier="P2")
            result = job.result(timeout=120)
    d, text = _explained(job.id, spans, capsys, lambda d: d["running_s"] > 0)
    assert d["transit"]["admission"] < 1.0, d["transit"]
    # The whole life is seconds long, not the skew: nothing counts the clocks' difference as time spent.
    assert d["total_s"] < abs(SKEW_S) / 2, d
    assert d["other_s"] < 0.05, d
    assert d["to_first_prefill_s"] == pytest.approx(result.queued_s, abs=0.05), (d["to_first_prefill_s"], result)
    # Still said: the clocks disagreed at the admission too.
    told = [o for o in d["clock_offsets"] if o.get("at") == "admission"]
    assert told and abs(told[0]["offset_s"] - SKEW_S) < 2, d["clock_offsets"]
    assert "admission 30" not in text, text
    assert "at the admission" in text, text


def test_a_first_attempt_never_exported_keeps_its_wait_to_the_first_prefill(tiny_model_dir, tmp_path, capsys):
    """A worker killed -9 before its batch exporter ran (OTEL_BSP_SCHEDULE_DELAY, 5 s by default) exports nothing of
    the attempt: explain took to_first_prefill_s from the second attempt's prefill, seconds after the first one that
    JobResult.queued_s reports, and said nothing. The re-dispatch's span carries the first prefill as the job's hash
    recorded it (Redis's clock), which explain uses."""
    spans = tmp_path / "spans.jsonl"
    quiet = {"wk-0": {"OTEL_BSP_SCHEDULE_DELAY": "600000"}}  # the first attempt's worker exports nothing
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=1, lease_s=2.0, gateway_env=_spans_env(spans),
                        process_env=quiet) as c:
        with c.client("batch-co", timeout_s=120.0) as batch:
            job = batch.submit(prompt_token_ids=[5, 6], max_tokens=2000, ignore_eos=True, tier="P2")
            wait_for(lambda: c.state(job.id) == "dispatched" and "first_prefill_ms" in c.job(job.id), 60,
                     "the first attempt's prefill to be recorded")
            c.kill("wk-0")
            wait_for(lambda: c.state(job.id) == "queued", 30, "the lease to expire and the job to be re-queued")
            time.sleep(1.0)
            quiet["wk-0"] = {}
            c.restart("wk-0")
            result = job.result(timeout=120)
            assert c.job(job.id)["attempt"] == b"2"
    d, text = _explained(job.id, spans, capsys, lambda d: d["running_s"] > 0 and d["attempts"] == 2)
    assert d["to_first_prefill_s"] == pytest.approx(result.queued_s, abs=0.05), (d["to_first_prefill_s"], result)
