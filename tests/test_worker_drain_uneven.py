"""A redeploy on workers of different sizes: while the only worker a job fits drains, exits and comes back, the job
is neither refused as invalid nor failed on a smaller worker; once no worker of its size has been seen for a while,
it is what it was (too big for the cluster).

Real processes (tests/durable_cluster.py): redis-server, a gateway, a real small worker, and a peer speaking the
worker protocol as the big worker (tests/uneven_cluster.BigWorker), so a test can make it drain, fall silent and
come back with the same id, as a redeploy does.
"""

from __future__ import annotations

import time

import pytest

from gateway.sdk import InvalidRequest, Overloaded
from tests.cluster_helpers import wait_for
from tests.uneven_cluster import SmallWorkerCluster, uneven_cluster

pytestmark = pytest.mark.faults  # real clusters: `make test-faults` runs these alone


def stored(c: SmallWorkerCluster) -> set[bytes]:
    """Every job, token stream and quota bucket in the cluster's Redis."""
    return {k for pattern in ("job", "tok", "quota") for k in c.redis.keys(f"ts:{{c}}:{pattern}:*")}


def test_a_new_job_only_a_draining_worker_fits_is_refused_as_overloaded_not_invalid(tmp_path, tiny_model_dir):
    """The big worker drains (a redeploy's SIGTERM) beside a small one. A new job only the big worker fits was refused
    as InvalidRequest (TierLimitExceeded, the small worker's limit): a client told its valid request was invalid, and
    not to retry it, seconds before the big worker came back. It is refused as overloaded now (retryable; nothing
    stored, no P0 quota charged), and still as invalid where it is past every worker's limit."""
    with uneven_cluster(tmp_path, tiny_model_dir, limit=1024, draining=True) as u:
        c = u.cluster
        chat = c.client("chat-co", timeout_s=60.0)
        before = stored(c)
        with pytest.raises(Overloaded, match="draining"):
            chat.submit(prompt_token_ids=[5] * 10, max_tokens=100, tier="P0", ignore_eos=True)
        with pytest.raises(InvalidRequest, match="exceeds the 64"):  # past the big worker too: too big
            chat.submit(prompt_token_ids=[5] * 10, max_tokens=1100, tier="P0", ignore_eos=True)
        assert stored(c) == before  # no job, no stream, no quota bucket
        small = chat.submit(prompt_token_ids=[5] * 10, max_tokens=20, tier="P0", ignore_eos=True)
        assert len(small.result(timeout=60).token_ids) == 20
        u.big.draining.clear()  # back from its redeploy
        u.big.free.set()
        time.sleep(1.5)  # its next reports say it serves again
        big = chat.submit(prompt_token_ids=[5] * 10, max_tokens=100, tier="P0", ignore_eos=True)
        assert big.result(timeout=60).token_ids == [7] * 100
        chat.close()


def test_a_queued_job_waits_through_its_workers_redeploy_rather_than_failing_on_a_smaller_one(tmp_path,
                                                                                              tiny_model_dir):
    """A job only the big worker fits is queued while it runs other work; the worker drains, exits (no goodbye) and
    is dropped after worker_timeout_s (5 s). The job was then taken for one no worker left could run and sent to the
    small worker, which failed it ("pool holds only 4 blocks"), though the big worker came back a moment later with
    the same size. It waits for it now, and runs there."""
    with uneven_cluster(tmp_path, tiny_model_dir) as u:
        c = u.cluster
        lab = c.client("lab-co", timeout_s=60.0)
        big = lab.submit(prompt_token_ids=[5] * 100, max_tokens=100, ignore_eos=True)  # fits wk-big only
        u.big.draining.set()
        time.sleep(1.0)  # its reports say so
        u.big.stop()  # drained: it exits
        wait_for(lambda: "wk-big" not in lab.info().workers, 30, "the gateway to drop the drained worker")
        time.sleep(1.0)  # dispatch passes with the small worker's free slots
        assert c.state(big.id) == "queued", c.job(big.id).get("reason")
        u.redeploy().free.set()  # same id and size
        assert big.result(timeout=60).token_ids == [7] * 100
        assert c.job(big.id)["attempt"] == b"1"
        lab.close()
