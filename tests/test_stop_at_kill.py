"""kill -9 of the worker a stop was sent to, before its completion: the job's next attempt (another worker, or the
same one restarted) ends where its caller's answer did, and the record the SDK reads afterwards says so: done,
finish_reason "stop", exactly the first n tokens the job makes (the ones its stream delivered first).

A real cluster (scripts/up.py): Redis, two gateways, two real workers on the tiny model. The job is dispatched by
gw-0; its worker is frozen (SIGSTOP, so it makes nothing more), the stop goes through gw-1, then the worker is killed.
The stop lies past what the job has made (its next worker makes the rest) or at it (its next worker, resuming from
the token log, holds that many already and ends at once).
"""

from __future__ import annotations

import os
import signal
import time

import msgpack
import pytest

from gateway.sdk import GatewayClient
from tests.cluster_helpers import frozen, job_hash, local_cluster, state_pids, wait_for

pytestmark = pytest.mark.faults

PROMPT, MAX_TOKENS, TEMPERATURE, SEED = [5, 6, 7], 1900, 0.0, 11  # long: it runs when its worker is frozen


def logged(state: dict, job_id: str) -> int:
    """Tokens of the job's token log (what the gateways have streamed of it)."""
    entries = state["redis_client"].xrange(f"{state['key_prefix']}:{{c}}:tok:{job_id}")
    return max((int(f[b"i"]) + len(msgpack.unpackb(f[b"t"])) for _, f in entries), default=0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    with local_cluster(tmp_path_factory.mktemp("stop-kill"), tiny_model_dir, workers=2, gateways=2, max_running=1,
                       lease_s=2.0, http=False) as state:
        yield state


@pytest.mark.parametrize("past", [40, 0], ids=["past-what-it-made", "at-what-it-made"])
def test_a_stop_survives_kill_9_of_its_worker_and_the_record_holds_the_answer(cluster, reference, past):
    key = cluster["tenants"]["api-co"]["api_key"]
    gw0, gw1 = (g["endpoint"] for g in cluster["gateways"])
    with GatewayClient(gw0, key, timeout_s=30) as c0, GatewayClient(gw1, key, timeout_s=30, retries=20) as c1:
        job = c0.submit(prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=SEED,
                        ignore_eos=True)
        first = next(iter(job.stream(timeout=60))).token_ids
        worker = wait_for(lambda: job_hash(cluster, job.id).get("worker"), 30, "the job's worker")
        pid = state_pids(cluster)[worker]
        with frozen(pid):
            time.sleep(0.5)  # the tokens it sent before it stood still reach the log
            n = logged(cluster, job.id) + past
            assert job_hash(cluster, job.id)["state"] == "dispatched" and n < MAX_TOKENS
            assert c1.cancel(job.id, stop_at=n) is True  # through the gateway that did not dispatch it
            os.kill(pid, signal.SIGKILL)  # before it read the stop: it never completes
        result = c1.job(job.id).result(timeout=180)
        want = reference([(PROMPT, n, TEMPERATURE, SEED)])[0]
        assert (result.finish_reason, len(result.token_ids)) == ("stop", n)
        assert result.token_ids == want and want[:len(first)] == first
        for c in (c0, c1):  # read afterwards, through either gateway
            assert c.status(job.id).state == "done"
            again = c.job(job.id).result(timeout=30)
            assert (again.token_ids, again.finish_reason) == (want, "stop")
        assert int(job_hash(cluster, job.id)["attempt"]) >= 2
