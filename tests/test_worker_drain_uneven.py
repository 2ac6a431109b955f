"""A redeploy on workers of different sizes: while the only worker a job fits drains, exits and comes back, the job
is neither refused as invalid nor failed on a smaller worker; once no worker of its size has been seen for a while,
it is what it was (too big for the cluster).

Real processes (tests/durable_cluster.py): redis-server, a gateway, a real small worker, and a peer speaking the
worker protocol as the big worker (tests/test_dispatch_fit.BigWorker), so a test can make it drain, fall silent and
come back with the same id, as a redeploy does.
"""

from __future__ import annotations

import time

import pytest

from gateway.sdk import InvalidRequest, Overloaded
from tests.cluster_helpers import wait_for
from tests.test_dispatch_fit import BigWorker, SmallWorkerCluster, start_small_worker

pytestmark = pytest.mark.faults  # real clusters: `make test-faults` runs these alone


def stored(c: SmallWorkerCluster) -> set[bytes]:
    """Every job, token stream and quota bucket in the cluster's Redis."""
    return {k for pattern in ("job", "tok", "quota") for k in c.redis.keys(f"ts:{{c}}:{pattern}:*")}


def test_a_new_job_only_a_draining_worker_fits_is_refused_as_overloaded_not_invalid(tmp_path, tiny_model_dir):
    """The big worker drains (a redeploy's SIGTERM) beside a small one. A new job only the big worker fits was refused
    as InvalidRequest (TierLimitExceeded, the small worker's limit): a client told its valid request was invalid, and
    not to retry it, seconds before the big worker came back. It is refused as overloaded now (retryable; nothing
    stored, no P0 quota charged), and still as invalid where it is past every worker's limit."""
    with SmallWorkerCluster(tmp_path, tiny_model_dir) as c:
        big_worker = BigWorker(c.gateways["gw-0"][1], str(tiny_model_dir), limit=1024)
        try:
            big_worker.draining.set()
            c.worker_ids.append("wk-big")
            c.wait_workers("gw-0")
            start_small_worker(c)
            chat = c.client("chat-co", timeout_s=60.0)
            before = stored(c)
            with pytest.raises(Overloaded, match="draining"):
                chat.submit(prompt_token_ids=[5] * 10, max_tokens=100, tier="P0", ignore_eos=True)
            with pytest.raises(InvalidRequest, match="exceeds the 64"):  # past the big worker too: too big
                chat.submit(prompt_token_ids=[5] * 10, max_tokens=1100, tier="P0", ignore_eos=True)
            assert stored(c) == before  # no job, no stream, no quota bucket
            small = chat.submit(prompt_token_ids=[5] * 10, max_tokens=20, tier="P0", ignore_eos=True)
            assert len(small.result(timeout=60).token_ids) == 20
            big_worker.draining.clear()  # back from its redeploy
            big_worker.free.set()
            time.sleep(1.5)  # its next reports say it serves again
            big = chat.submit(prompt_token_ids=[5] * 10, max_tokens=100, tier="P0", ignore_eos=True)
            assert big.result(timeout=60).token_ids == [7] * 100
            chat.close()
        finally:
            big_worker.stop()


def test_a_queued_job_waits_through_its_workers_redeploy_rather_than_failing_on_a_smaller_one(tmp_path,
                                                                                              tiny_model_dir):
    """A job only the big worker fits is queued while it runs other work; the worker drains, exits (no goodbye) and
    is dropped after worker_timeout_s (5 s). The job was then taken for one no worker left could run and sent to the
    small worker, which failed it ("pool holds only 4 blocks"), though the big worker came back a moment later with
    the same size. It waits for it now, and runs there."""
    with SmallWorkerCluster(tmp_path, tiny_model_dir) as c:
        big_worker = BigWorker(c.gateways["gw-0"][1], str(tiny_model_dir))
        try:
            c.worker_ids.append("wk-big")
            c.wait_workers("gw-0")
            start_small_worker(c)
            lab = c.client("lab-co", timeout_s=60.0)
            big = lab.submit(prompt_token_ids=[5] * 100, max_tokens=100, ignore_eos=True)  # fits wk-big only
            big_worker.draining.set()
            time.sleep(1.0)  # its reports say so
            big_worker.stop()  # drained: it exits
            wait_for(lambda: "wk-big" not in lab.info().workers, 30, "the gateway to drop the drained worker")
            time.sleep(1.0)  # dispatch passes with the small worker's free slots
            assert c.state(big.id) == "queued", c.job(big.id).get("reason")
            big_worker = BigWorker(c.gateways["gw-0"][1], str(tiny_model_dir))  # redeployed, same id and size
            big_worker.free.set()
            assert big.result(timeout=60).token_ids == [7] * 100
            assert c.job(big.id)["attempt"] == b"1"
            lab.close()
        finally:
            big_worker.stop()
