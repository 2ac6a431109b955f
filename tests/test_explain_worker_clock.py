"""explain on a job whose worker's wall clock is behind Redis's (which times the gateway's queue and dispatch spans).
Real processes: redis-server, a gateway, and a worker whose wall clock is set back; spans through the file
exporter, read back by explain."""

from __future__ import annotations

import json
import sys

from scripts import explain
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster

SKEW_S = -3.0  # the worker's wall clock, behind Redis's and the gateway's


class SkewedWorkerCluster(DurableCluster):
    def _cmd(self, name: str) -> list[str]:
        cmd = super()._cmd(name)
        if name not in self.worker_ids:
            return cmd
        # time_ns too: span times are read from it (a host's wall clock is off for both).
        code = (f"import sys, time, runpy; _t = time.time; time.time = lambda: _t() + {SKEW_S!r}; "
                f"_n = time.time_ns; time.time_ns = lambda: _n() + int(1e9 * {SKEW_S!r}); "
                f"sys.argv = ['worker'] + sys.argv[1:]; runpy.run_module('worker', run_name='__main__')")
        assert cmd[1:3] == ["-m", "worker"], cmd
        return [sys.executable, "-c", code, *cmd[3:]]


def test_a_worker_clock_behind_redis_is_said_not_told_as_the_story(tiny_model_dir, tmp_path, capsys):
    """The worker's spans are on its own clock: one 3 s behind Redis's put the job's worker.request 3 s before the
    dispatch that sent it. explain told a 1 s job as 'total 4 s', its worker's queue wait before its gateway queue
    wait, its first prefill before its admission, and seconds of 'other', without a word about the clocks."""
    spans = tmp_path / "spans.jsonl"
    env = {"OTEL_TRACES_EXPORTER": "otlp_json_file", "TS_SPANS_FILE": str(spans), "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with SkewedWorkerCluster(tmp_path, tiny_model_dir, gateways=1, workers=1, gateway_env=env) as c:
        with c.client("batch-co", timeout_s=60.0) as batch:
            job = batch.submit(prompt_token_ids=[5, 6], max_tokens=20, ignore_eos=True, tier="P2")
            job.result(timeout=60)

    def told():
        if explain.main([job.id, "--spans", str(spans), "--json"]) != 0:
            capsys.readouterr()
            return None
        d = json.loads(capsys.readouterr().out)
        return d if d["running_s"] > 0 else None

    wait_for(told, 15, "the job's spans to be exported")
    d = told()
    [off] = [o for o in d["clock_offsets"] if o["at"] == "worker"]
    assert off["worker"] == "wk-0" and off["attempt"] == 1, off
    assert -3.5 < off["offset_s"] <= -2.5, off  # at least this far behind: a bound, from the dispatch's start
    assert explain.main([job.id, "--spans", str(spans)]) == 0
    text = capsys.readouterr().out
    assert "clocks disagree: worker wk-0's clock" in text, text
