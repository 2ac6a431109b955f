"""Counts that can be checked, on a real two-gateway cluster: every job admitted (on any gateway) is counted
finished exactly once across the gateways, by its final state, whichever gateway saw it end, and the latency
histograms observe each job once. Sums over gateways are what a dashboard adds up (sum by (state))."""

from __future__ import annotations

import os
import signal
import time

import pytest

from gateway.sdk import GatewayClient
from tests.cluster_helpers import frozen, job_hash, local_cluster, state_pids, wait_for
from tests.test_metrics import scrape, total


@pytest.fixture(scope="module")
def cluster(bench_model_dir, tmp_path_factory):
    # One worker with two slots shared by two gateways: a third job queues, and either gateway may dispatch it.
    # The bench model: the tiny one can run both 2000-token fillers in about 2 s, near fill_slots' own wait.
    with local_cluster(tmp_path_factory.mktemp("metrics-counts"), bench_model_dir, workers=1, gateways=2,
                       max_running=2, http=False) as c:
        yield c


def summed(c: dict, name: str, **labels) -> float:
    """``name`` summed over every gateway's /metrics."""
    return sum(total(scrape(url), name, **labels) for url in c["metrics"][:len(c["gateways"])])


def fill_slots(c: dict, lab: GatewayClient, max_tokens: int) -> list:
    jobs = [lab.submit(prompt_token_ids=[3, 4, 5], max_tokens=max_tokens, ignore_eos=True, seed=i) for i in range(2)]
    wait_for(lambda: total(scrape(c["metrics"][len(c["gateways"])]), "ts_num_requests_running", tier="P3") == 2, 60,
             "the worker to run both jobs")
    # Their first tokens told (first_token.lua): a job cancelled before has no time to first token to count. Running
    # is not enough on a loaded machine, where a first token can take seconds.
    wait_for(lambda: all(job_hash(c, j.id).get("first_token_ms") for j in jobs), 60, "both jobs' first tokens")
    # Its load reports say so to both gateways: until then, one that did not send a job thinks its slot free.
    time.sleep(1.0)
    return jobs


def test_a_queued_job_nobody_watches_is_counted_when_cancelled(cluster):
    """A job whose client submitted it and did not stream it lost its stream buffer after a second in the queue
    (nobody watched it); its cancel then ended no stream, and ts_jobs_finished_total never counted it."""
    key = cluster["tenants"]["lab-co"]["api_key"]
    before = summed(cluster, "ts_jobs_finished_total", tier="P3", state="cancelled")
    worker = state_pids(cluster)["wk-0"]
    with GatewayClient(cluster["gateway"], key) as lab:
        running = fill_slots(cluster, lab, max_tokens=2000)
        # The worker stands still while the third job waits: on a quiet machine it finished both 2000-token jobs
        # within the wait below, and the third ran.
        with frozen(worker):
            queued = lab.submit(prompt_token_ids=[6, 7], max_tokens=4, ignore_eos=True)
            time.sleep(2.5)  # past the gateway's idle check (streaming.IDLE_CHECK_S)
            assert job_hash(cluster, queued.id)["state"] == "queued"
            for j in [queued] + running:
                assert j.cancel()
    assert summed(cluster, "ts_jobs_finished_total", tier="P3", state="cancelled") - before == 3


def test_jobs_another_gateway_ran_are_counted_once(cluster):
    """Jobs admitted by gw-0 and dispatched by gw-1 (gw-0 paused while the slots freed): gw-1 stored their
    results, gw-0 only read them. Neither counted them finished (gw-1 counted only jobs it admitted, gw-0 only
    jobs whose end it saw through a stream of its own), nor observed their latency."""
    lab0, lab1 = (GatewayClient(g["endpoint"], cluster["tenants"]["lab-co"]["api_key"]) for g in cluster["gateways"])
    names = ("ts_request_e2e_latency_seconds_count", "ts_time_to_first_token_seconds_count")
    before = {n: summed(cluster, n, tier="P3") for n in names}
    e2e_sum = summed(cluster, "ts_request_e2e_latency_seconds_sum", tier="P3")
    done, cancelled = (summed(cluster, "ts_jobs_finished_total", tier="P3", state=s) for s in ("done", "cancelled"))
    admitted = summed(cluster, "ts_admissions_total", tier="P3")
    gw0, worker = cluster["pids"]["gw-0"], state_pids(cluster)["wk-0"]
    try:
        fillers = fill_slots(cluster, lab1, max_tokens=2000)
        # The worker stands still until gw-0 does: on a quiet machine the fillers could end first, and gw-0
        # dispatch its own jobs.
        with frozen(worker):
            later = [lab0.submit(prompt_token_ids=[8, i], max_tokens=6, ignore_eos=True) for i in range(2)]
            os.kill(gw0, signal.SIGSTOP)
        try:
            for j in fillers:  # through gw-1: the slots free up while only gw-1 listens
                assert lab1.cancel(j.id)
            wait_for(lambda: all(job_hash(cluster, j.id).get("gateway") == "gw-1" for j in later), 30,
                     "gw-1 to dispatch gw-0's jobs")
        finally:
            os.kill(gw0, signal.SIGCONT)
        results = [j.result(timeout=120) for j in later]
    finally:
        lab0.close()
        lab1.close()
    assert [len(r.token_ids) for r in results] == [6, 6]  # result() raises unless a job is done
    assert summed(cluster, "ts_admissions_total", tier="P3") - admitted == 4
    assert summed(cluster, "ts_jobs_finished_total", tier="P3", state="cancelled") - cancelled == 2
    assert summed(cluster, "ts_jobs_finished_total", tier="P3", state="done") - done == 2
    # Latency: each job observed once; TTFT at its first token, so the cancelled fillers too.
    assert summed(cluster, names[0], tier="P3") - before[names[0]] == 2
    assert summed(cluster, names[1], tier="P3") - before[names[1]] == 4
    # Admission to the end, on Redis's clock for the queue part (gw-1 did not admit them): what the clients were told.
    e2e = summed(cluster, "ts_request_e2e_latency_seconds_sum", tier="P3") - e2e_sum
    assert e2e == pytest.approx(sum(r.total_s for r in results), abs=0.3), (e2e, [r.total_s for r in results])


def test_submissions_refused_while_redis_is_down_are_counted(tmp_path, tiny_model_dir):
    """Every `unavailable` a gateway answered a submission with is in ts_refusals_total: those it sent while Redis
    was down (the failed call's, and those of its back-off) were counted nowhere. A raw socket, as the SDK
    retries an `unavailable` on its own."""
    import zmq

    from common import protocol as P
    from common.ports import free_port
    from common.sockets import make_socket
    from tests.durable_cluster import DurableCluster

    bind = f"127.0.0.1:{free_port()}"
    url = f"http://{bind}/metrics"
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=1,
                        gateway_env={"TS_GATEWAY_METRICS_BIND": bind}) as c:
        before = total(scrape(url), "ts_refusals_total", code="unavailable")
        c.kill("redis")
        raw = make_socket(zmq.Context.instance(), zmq.DEALER)
        raw.connect(c.endpoint())
        try:
            for i in range(3):
                raw.send(P.encode(P.SubmitRequest(c.key("lab-co"), 4, prompt_token_ids=[5, i])))
                assert raw.poll(30_000), "no answer while Redis is down"
                reply = P.decode(raw.recv())
                assert isinstance(reply, P.ErrorReply) and reply.code == "unavailable", reply
        finally:
            raw.close(linger=0)
        assert total(scrape(url), "ts_refusals_total", code="unavailable") - before == 3
        c.restart("redis")
