"""Counts of jobs that ended without a result, and of jobs whose attempts were lost, on real clusters: a job that
expires in its queue, one whose worker keeps dying until it is dead-lettered, one whose first token reached two
gateways. Each job is counted finished once and its time to first token observed once (summed over gateways);
the queue wait and the hand-off once per dispatch attempt."""

from __future__ import annotations

import os
import signal
import time

import msgpack

from common.ports import free_port
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.test_metrics import scrape, total

COUNTS = (("ts_jobs_finished_total", {"tier": "P2", "state": "expired"}),
          ("ts_jobs_finished_total", {"tier": "P3", "state": "dead"}),
          ("ts_jobs_finished_total", {"tier": "P3", "state": "cancelled"}),
          ("ts_requeues_total", {"cause": "lease_expired", "outcome": "queued"}),
          ("ts_requeues_total", {"cause": "lease_expired", "outcome": "dead"}),
          ("ts_time_to_first_token_seconds_count", {"tier": "P3"}),
          ("ts_request_e2e_latency_seconds_count", {}),
          ("ts_queue_wait_seconds_count", {"tier": "P2"}),
          ("ts_queue_wait_seconds_count", {"tier": "P3"}),
          ("ts_dispatch_handoff_seconds_count", {}))


def counts(urls: list[str]) -> dict[str, float]:
    """Each of COUNTS, summed over ``urls``."""
    pages = [scrape(u) for u in urls]
    return {f"{n}{sorted(lb.items())}": sum(total(p, n, **lb) for p in pages) for n, lb in COUNTS}


def delta(before: dict, after: dict) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before if after[k] != before[k]}


def logged_tokens(c: DurableCluster, job_id: str) -> int:
    return sum(len(msgpack.unpackb(f[b"t"])) for _, f in c.redis.xrange(f"ts:{{c}}:tok:{job_id}"))


def streaming(c: DurableCluster, job_id: str, more_than: int = 0) -> bool:
    """Whether the job runs and has logged more than ``more_than`` tokens. A job that ended first leaves nothing to
    kill: that fails now, not when a wait for a kill's effect runs out."""
    state = c.state(job_id)
    assert state in ("queued", "dispatched"), f"job {job_id} ended ({state}) before it was seen streaming"
    return state == "dispatched" and logged_tokens(c, job_id) > more_than


def test_an_expired_and_a_dead_lettered_job_are_counted_once_each_attempt_observed(tmp_path, tiny_model_dir):
    """A P2 job that waits out its queue timeout, and a P3 job whose worker is killed on each of its two attempts,
    through one gateway: each is counted finished once, by its state; the dead one's two dispatches each observe a
    queue wait and a hand-off (the hand-off of the second, re-dispatched by the gateway that had sent the first,
    was not observed: the first start of any attempt ended it), and its first token once."""
    bind = f"127.0.0.1:{free_port()}"
    env = {"TS_GATEWAY_METRICS_BIND": bind, "TS_GATEWAY_MAX_ATTEMPTS": "2",
           "TS_GATEWAY_TIER_TIMEOUTS_S": '{"P0": 30, "P1": 60, "P2": 1}'}
    urls = [f"http://{bind}/metrics"]
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=1, max_running=1, lease_s=2.0,
                        gateway_env=env) as c:
        before = counts(urls)
        with c.client("batch-co", timeout_s=30.0) as batch:
            dying = batch.submit(prompt_token_ids=[5, 6], max_tokens=2000, ignore_eos=True, tier="P3", seed=3)
            wait_for(lambda: streaming(c, dying.id), 60, "the job to stream")
            c.kill("wk-0")
            # No worker left (it timed out): the wait estimate refuses nothing, and the P2 job waits out its 1 s.
            wait_for(lambda: not batch.info().workers, 30, "the killed worker to time out")
            assert c.state(dying.id) == "queued", "its lease was not requeued"
            first = logged_tokens(c, dying.id)
            expiring = batch.submit(prompt_token_ids=[7], max_tokens=1, tier="P2")
            wait_for(lambda: c.state(expiring.id) == "expired", 30, "the P2 job to expire")
            c.restart("wk-0")
            wait_for(lambda: streaming(c, dying.id, first), 120, "the second attempt to stream")
            c.kill("wk-0")
            wait_for(lambda: c.state(dying.id) == "dead", 30, "the job to be dead-lettered")
            time.sleep(0.5)  # a scrape's worth: anything counted twice is counted by now
            after = counts(urls)
    assert delta(before, after) == {
        "ts_jobs_finished_total[('state', 'expired'), ('tier', 'P2')]": 1,
        "ts_jobs_finished_total[('state', 'dead'), ('tier', 'P3')]": 1,
        "ts_requeues_total[('cause', 'lease_expired'), ('outcome', 'queued')]": 1,
        "ts_requeues_total[('cause', 'lease_expired'), ('outcome', 'dead')]": 1,
        "ts_time_to_first_token_seconds_count[('tier', 'P3')]": 1,
        "ts_queue_wait_seconds_count[('tier', 'P3')]": 2,
        "ts_dispatch_handoff_seconds_count[]": 2}, delta(before, after)


def test_a_first_token_two_gateways_saw_is_observed_once(tmp_path, tiny_model_dir):
    """gw-0 saw the job's first token and observed its TTFT; its worker died before gw-0 wrote the token to the
    log (gw-0's flush interval is long here: the window is one flush, 50 ms, by default), and gw-1 re-dispatched
    it from an empty log and saw a first token again: observed twice. The same happens to a gateway frozen with
    the frames unread while the worker moves the job's stream to another (worker/routes.py)."""
    binds = {g: f"127.0.0.1:{free_port()}" for g in ("gw-0", "gw-1")}
    process_env = {g: {"TS_GATEWAY_METRICS_BIND": b} for g, b in binds.items()}
    process_env["gw-0"]["TS_GATEWAY_STREAM_FLUSH_INTERVAL_S"] = "600"
    urls = [f"http://{b}/metrics" for b in binds.values()]
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=1, max_running=1, lease_s=2.0,
                        process_env=process_env) as c:
        before = counts(urls)
        gw0, gw1 = c.procs["gw-0"].pid, c.procs["gw-1"].pid
        stopped = {gw1}
        os.kill(gw1, signal.SIGSTOP)  # gw-0 dispatches
        try:
            with c.client("batch-co", "gw-0", timeout_s=30.0) as b0:
                job = b0.submit(prompt_token_ids=[5, 6], max_tokens=2000, ignore_eos=True, tier="P3", seed=4)
                next(iter(job.stream(timeout=60)))  # gw-0 has the first token
            assert c.job(job.id)["gateway"] == b"gw-0"
            c.kill("wk-0")
            os.kill(gw0, signal.SIGSTOP)
            stopped.add(gw0)
            os.kill(gw1, signal.SIGCONT)
            stopped.discard(gw1)
            assert logged_tokens(c, job.id) == 0, "gw-0 wrote the token log: nothing is tested"
            c.restart("wk-0")
            wait_for(lambda: c.state(job.id) == "dispatched" and c.job(job.id)["attempt"] == b"2", 120,
                     "gw-1 to dispatch the job again")
            with c.client("batch-co", "gw-1", timeout_s=30.0) as b1:
                next(iter(b1.job(job.id).stream(timeout=60)))
                assert b1.cancel(job.id)
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        wait_for(lambda: delta(before, counts(urls)).get("ts_time_to_first_token_seconds_count[('tier', 'P3')]"),
                 30, "the job's first token to be observed")
        time.sleep(0.5)
        after = counts(urls)
    d = delta(before, after)
    assert d["ts_time_to_first_token_seconds_count[('tier', 'P3')]"] == 1, d
    assert d["ts_jobs_finished_total[('state', 'cancelled'), ('tier', 'P3')]"] == 1, d
