"""A finished job's figures (queued_s, ttft_s, total_s) are one set: the final message streamed to clients of the
gateway that stores the result, a later read of the result through any gateway, and the metrics agree. On real
clusters, with a scripted worker (tests/test_durability.Adversary) so that each moment is the test's."""

from __future__ import annotations

import threading
import time

import pytest

from common import protocol as P
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.test_durability import Adversary


def result_in_thread(client, job_id: str) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = client.job(job_id).result(timeout=60)
        except Exception as e:  # noqa: BLE001  (the test reports it)
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_job_another_gateway_admitted_ends_with_the_figures_its_result_keeps(tmp_path, tiny_model_dir):
    """gw-0 admits the job (it hears of no worker), gw-1 dispatches it and stores its result while a client waits
    for it there. That client's final message said total_s 0.0 and no TTFT (gw-1 knew no admission time of its
    own), and the stored TTFT was the worker's, from its receipt of the dispatch: shorter than the job's wait."""
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=0) as c:
        worker = Adversary(c.gateways["gw-1"][1], "wk-adv", slots=1)
        try:
            worker.load([], free=0)
            wait_for(lambda: c.client("lab-co", "gw-1").info().workers, 10, "gw-1 to know the worker")
            with c.client("lab-co", "gw-0") as lab0, c.client("lab-co", "gw-1") as lab1:
                job = lab0.submit(prompt_token_ids=[1, 2], max_tokens=2, ignore_eos=True)
                waiter, out = result_in_thread(lab1, job.id)
                time.sleep(1.5)  # a wait the client sees before the job starts
                worker.load([], free=1)
                d = worker.recv(P.DispatchJob, beat=[])
                assert d.job_id == job.id
                worker.send(P.JobTokens(d.job_id, d.attempt, 0, [5], 0.0, 0.0))
                time.sleep(0.3)
                worker.send(P.JobFinished(d.job_id, d.attempt, "done", "length", 2, 0.02, 0.35, 0, None, [5, 6],
                                          0.01, 0.3))
                worker.recv(P.JobFinishedAck, beat=[d.job_id])
                waiter.join(30)
                assert "result" in out, out
                streamed = out["result"]
                later = lab1.job(job.id).result(timeout=30)
                again = lab0.job(job.id).result(timeout=30)
        finally:
            worker.close()
    assert later.queued_s >= 1.5 and later.ttft_s is not None and later.ttft_s >= later.queued_s - 0.01, later
    for r in (streamed, again):
        assert r.queued_s == pytest.approx(later.queued_s, abs=0.05), (r, later)
        assert r.ttft_s is not None and r.ttft_s == pytest.approx(later.ttft_s, abs=0.05), (r, later)
        assert r.total_s == pytest.approx(later.total_s, abs=0.05), (r, later)
