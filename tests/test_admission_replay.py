"""An idempotent retry gets the job its key admitted, whatever the cluster looks like now.

Real processes (tests/durable_cluster.py): redis-server, a gateway, a real small worker, and a peer speaking the
worker protocol as the big worker (tests/uneven_cluster.BigWorker).
"""

from __future__ import annotations

import time

import pytest

from gateway.sdk import InvalidRequest
from tests.uneven_cluster import uneven_cluster

pytestmark = pytest.mark.faults  # real clusters: `make test-faults` runs these alone


def test_a_retry_after_the_only_worker_it_fits_left_gets_its_job_not_tier_limit_exceeded(tmp_path, tiny_model_dir):
    """A job only the big worker fits is admitted under an idempotency key; its answer is lost and the big worker dies
    (no drain: nothing in Redis says it comes back), and the gateway restarts knowing only the small worker. The retry
    was refused as TierLimitExceeded ("could never finish", nothing stored), from the fit check that ran before the
    key was looked up: the client, told its job did not exist, would submit it anew. It gets its job now; a new
    request of that size (another key) is still refused, and nothing is stored for it."""
    with uneven_cluster(tmp_path, tiny_model_dir) as u:
        c = u.cluster
        lab = c.client("lab-co", timeout_s=60.0)
        big = lab.submit(prompt_token_ids=[5] * 100, max_tokens=100, ignore_eos=True, idempotency_key="big-1")
        lab.close()
        u.big.stop()  # killed: no drain, so no gateway keeps its size
        c.kill("gw-0")
        c.restart("gw-0")
        c.worker_ids.remove("wk-big")
        c.wait_workers("gw-0")  # the small worker only
        time.sleep(0.5)
        lab = c.client("lab-co", timeout_s=60.0)
        again = lab.submit(prompt_token_ids=[5] * 100, max_tokens=100, ignore_eos=True, idempotency_key="big-1")
        assert again.id == big.id and again.duplicate
        jobs = set(c.redis.keys("ts:{c}:job:*"))
        with pytest.raises(InvalidRequest, match="may hold on this cluster"):  # no job fits nowhere anew
            lab.submit(prompt_token_ids=[5] * 100, max_tokens=100, ignore_eos=True, idempotency_key="big-2")
        with pytest.raises(InvalidRequest, match="may hold on this cluster"):
            lab.submit(prompt_token_ids=[5] * 100, max_tokens=100, ignore_eos=True)
        with pytest.raises(InvalidRequest, match="idempotency_key"):  # another request under the key: as ever
            lab.submit(prompt_token_ids=[6] * 100, max_tokens=100, ignore_eos=True, idempotency_key="big-1")
        assert set(c.redis.keys("ts:{c}:job:*")) == jobs
        lab.close()
