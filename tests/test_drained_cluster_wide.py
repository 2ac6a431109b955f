"""A redeploy's drained worker is remembered by the cluster, not by one gateway: a gateway restarted while the worker
was away (or one that never heard it drain) knows that a job only it fits is waiting for it.

Real processes (tests/durable_cluster.py): redis-server, a gateway, a real small worker, and a peer speaking the
worker protocol as the big worker (tests/uneven_cluster.BigWorker).
"""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from common.ports import free_port
from common.redis_keys import KeySpace
from common.redis_server import RedisServer
from gateway.drained import SharedDrained
from gateway.sdk import InvalidRequest, Overloaded
from tests.cluster_helpers import wait_for
from tests.uneven_cluster import uneven_cluster

pytestmark = pytest.mark.faults  # real clusters: `make test-faults` runs these alone


def heard_draining(c) -> None:
    """Until the gateway has read a report of wk-big's that says it drains: it notes that in Redis (the cluster's
    memory, gateway/drained.py) in the handler that tells its own copy. A fixed wait of three reports, before,
    depended on a loaded machine's pace."""
    wait_for(lambda: c.redis.hexists("ts:{c}:drained-workers", "wk-big"), 30, "the gateway to hear that wk-big drains")


def test_a_gateway_restarted_while_the_big_worker_redeploys_keeps_its_job_waiting_for_it(tmp_path, tiny_model_dir):
    """The big worker drains and exits while a job only it fits is queued; then the gateway restarts (it is redeployed
    too). The memory of the drained worker was the old gateway's alone: the new one saw only the small worker, took
    the job for one any worker may run, and sent it there to fail ("pool holds only 4"); a new such job was refused as
    invalid. The drained worker's size is in Redis now: the job waits for its return, a new one is told to retry."""
    with uneven_cluster(tmp_path, tiny_model_dir) as u:
        c = u.cluster
        lab = c.client("lab-co", timeout_s=60.0)
        big = lab.submit(prompt_token_ids=[5] * 100, max_tokens=100, ignore_eos=True)  # fits wk-big only
        lab.close()
        u.big.draining.set()
        heard_draining(c)
        u.big.stop()  # drained: it exits
        c.kill("gw-0")
        c.restart("gw-0")
        c.worker_ids.remove("wk-big")
        c.wait_workers("gw-0")  # the small worker only
        lab = c.client("lab-co", timeout_s=60.0)
        small = lab.submit(prompt_token_ids=[5] * 10, max_tokens=20, ignore_eos=True)
        assert len(small.result(timeout=60).token_ids) == 20  # dispatch ran with the small worker's credit
        assert c.state(big.id) == "queued", c.job(big.id).get("reason")
        with pytest.raises(Overloaded, match="draining"):
            lab.submit(prompt_token_ids=[5] * 100, max_tokens=100, ignore_eos=True)
        u.redeploy().free.set()  # same id and size
        assert big.result(timeout=60).token_ids == [7] * 100
        wait_for(lambda: not c.redis.hlen("ts:{c}:drained-workers"), 10, "the returned worker to be forgotten")
        lab.close()


def test_a_retry_of_a_job_admitted_before_the_drain_gets_its_job_not_overloaded(tmp_path, tiny_model_dir):
    """A job only the big worker fits is admitted under an idempotency key; its answer is lost, and the big worker
    begins to drain (a redeploy) before the retry. The retry was refused as overloaded, "nothing was stored": the
    admission checks ran before the key was looked up. The client was told its job did not exist while it waited in
    the queue, and a new submission (a new key) would run it twice. The retry gets its job now; a new request under
    another key is still refused, another request under the key is told so, and nothing is stored for either."""
    with uneven_cluster(tmp_path, tiny_model_dir) as u:
        c = u.cluster
        lab = c.client("lab-co", timeout_s=60.0)
        big = lab.submit(prompt_token_ids=[5] * 100, max_tokens=100, ignore_eos=True, idempotency_key="big-1")
        u.big.draining.set()
        heard_draining(c)
        again = lab.submit(prompt_token_ids=[5] * 100, max_tokens=100, ignore_eos=True, idempotency_key="big-1")
        assert again.id == big.id and again.duplicate
        jobs = set(c.redis.keys("ts:{c}:job:*"))
        with pytest.raises(Overloaded, match="draining"):
            lab.submit(prompt_token_ids=[5] * 100, max_tokens=100, ignore_eos=True, idempotency_key="big-2")
        with pytest.raises(InvalidRequest, match="idempotency_key"):  # another request under the key: as ever
            lab.submit(prompt_token_ids=[6] * 100, max_tokens=100, ignore_eos=True, idempotency_key="big-1")
        assert set(c.redis.keys("ts:{c}:job:*")) == jobs
        u.big.draining.clear()  # back from its redeploy
        u.big.free.set()
        assert again.result(timeout=60).token_ids == [7] * 100
        lab.close()


def test_the_cluster_memory_counts_for_its_time_and_an_outage_leaves_the_copy_read_last():
    """SharedDrained against a real redis-server: a draining worker's limits are read back by another gateway's copy
    (until when, on Redis's clock), a worker back is deleted, and a Redis that does not answer changes nothing read
    (nor raises into the worker frame's handler)."""
    with RedisServer() as server:
        keys = KeySpace(prefix=f"dr-{uuid.uuid4().hex[:8]}")
        writer, reader = (SharedDrained(server.client(), keys, ttl_s=0.5) for _ in range(2))
        writer.note("wk-big", {"P3": 1024}, now=10.0)
        reader.refresh(now=10.0)
        assert reader.alive(10.0) == {"wk-big": {"P3": 1024}}
        assert reader.alive(10.6) == {}  # its time is up on this gateway's clock too, read again or not
        time.sleep(0.6)
        reader.refresh(now=12.0)
        assert reader.entries == {}  # Redis's clock: gone
        writer.note("wk-big", {"P3": 1024}, now=13.0)
        reader.refresh(now=13.0)
        reader.back("wk-big")
        assert not server.client().hexists(keys.drained_workers, "wk-big")
        writer.note("wk-other", {"P3": 512}, now=14.0)
        reader.refresh(now=14.0)
        dead = redis.Redis(port=free_port(), socket_timeout=1)  # nothing listens there
        reader.client, writer.client = dead, dead
        writer.note("wk-third", {"P3": 256}, now=15.0)  # logged, not raised
        reader.refresh(now=15.0)
        assert reader.alive(14.2) == {"wk-other": {"P3": 512}}
