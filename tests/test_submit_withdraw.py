"""A submission its client gave up on is withdrawn, and the SDK's own idempotency keys are kept as long as a result.

A ``submit()`` that ends without its reply (``asyncio.wait_for`` timing out, a cancelled task, a gateway slower
than ``timeout_s``) may have been admitted all the same: its job then ran, and took its tenant's quota, with nobody
told its id (a retry is a new call, a new key: a second job). The SDK now withdraws the call's own key
(CancelRequest.idempotency_key): the gateway cancels the job admitted under it, or, where none is yet, marks the key
so that the submission still on its way is refused with nothing stored. A caller's own key is never withdrawn (a
resubmit under it finds the job). The SDK's keys (``retry_key``) are kept ``result_ttl_s``, not 24 h.

A real gateway process and Redis, no worker: jobs stay queued; the gateway is frozen (SIGSTOP) so that a reply
comes too late.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import threading
import uuid

import httpx
import pytest
import redis
import zmq
from prometheus_client.parser import text_string_to_metric_families

from common import protocol as P
from common.errors import InvalidRequest, ServingError
from common.ports import free_port
from common.redis_keys import KeySpace
from common.redis_server import RedisServer
from common.sockets import make_socket
from gateway.sdk import AsyncGatewayClient, GatewayClient
from gateway.sdk._requests import withdraw_request
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.test_tokenizer_match import _Gateway

PROMPT = [3, 4, 5]


class _Cluster:
    def __init__(self, gw: _Gateway, url: str, prefix: str) -> None:
        self.gw, self.keys, self.redis = gw, KeySpace(prefix), redis.Redis.from_url(url)

    def key(self, tenant: str) -> str:
        return self.gw.tenants[tenant]["api_key"]

    def idem(self, tenant: str, key: str) -> bytes | None:
        return self.redis.get(self.keys.idem(tenant, key))

    def jobs(self, tenant: str) -> dict[str, str]:
        """Every job the tenant has in Redis, by id: its state."""
        ids = [i.decode() for i in self.redis.zrange(self.keys.tenant_jobs(tenant), 0, -1)]
        return {i: (self.redis.hget(self.keys.job(i), "state") or b"").decode() for i in ids}

    def state(self) -> tuple:
        """What a refusal must leave as it was: job hashes, queues, idempotency keys, quotas."""
        scan = lambda pattern: sorted(self.redis.scan_iter(f"{self.keys.base}:{pattern}"))  # noqa: E731
        return (scan("job:*"), [self.redis.zcard(q) for q in self.keys.queues()], scan("idem:*"),
                [self.redis.hgetall(k) for k in scan("quota:*")])

    def frozen(self):
        return _Frozen(self.gw.proc.pid)

    def withdrawals(self) -> dict[str, float]:
        """The gateway's ts_withdrawals_total, by outcome."""
        text = httpx.get(self.metrics_url, timeout=10).text
        return {s.labels["outcome"]: s.value for family in text_string_to_metric_families(text)
                if family.name == "ts_withdrawals" for s in family.samples if s.name == "ts_withdrawals_total"}


class _Frozen:
    """The gateway stopped (SIGSTOP) for the block; continued however it ends."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __enter__(self):
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc) -> None:
        os.kill(self.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with RedisServer() as redis_server:
        prefix = f"withdraw-{uuid.uuid4().hex[:8]}"
        metrics_at = f"127.0.0.1:{free_port()}"
        os.environ["TS_GATEWAY_METRICS_BIND"] = metrics_at  # the gateway process's environment is this one's
        try:
            gw = _Gateway(tmp_path_factory.mktemp("withdraw"), "gw-withdraw", redis_server.url, prefix)
        finally:
            del os.environ["TS_GATEWAY_METRICS_BIND"]
        try:
            c = _Cluster(gw.started(), redis_server.url, prefix)
            c.metrics_url = f"http://{metrics_at}/metrics"
            yield c
        finally:
            os.kill(gw.proc.pid, signal.SIGCONT)  # a test that failed inside frozen() must not leave it stopped
            gw.stop()


@pytest.fixture
def sdk(cluster):
    with GatewayClient(cluster.gw.clients, cluster.key("api-co"), timeout_s=30) as client:
        yield client


def test_the_sdk_s_own_keys_are_kept_as_long_as_a_result_a_caller_s_for_the_idempotency_ttl(cluster, sdk):
    own = sdk.submit(prompt_token_ids=PROMPT, max_tokens=4, tier="P3", idempotency_key=f"mine-{uuid.uuid4().hex}")
    auto = sdk.submit(prompt_token_ids=PROMPT, max_tokens=4, tier="P3")
    ttls = {}
    for k in cluster.redis.scan_iter(f"{cluster.keys.base}:idem:api-co:*"):
        job_id = cluster.redis.get(k).decode().split(" ")[0]
        ttls[job_id] = cluster.redis.ttl(k)
    assert 3500 < ttls[auto.id] <= 3600, ttls  # result_ttl_s (1 h), not 24 h
    assert ttls[own.id] > 86000, ttls
    # The retry key is still a key: a retry of the same request under it is the job's duplicate.
    again = sdk.submit(prompt_token_ids=PROMPT, max_tokens=4, tier="P3", idempotency_key=k.decode().split(":")[-1])
    assert again.id in (auto.id, own.id)
    for job in (own, auto):
        job.cancel()


def test_a_withdrawn_key_admits_nothing_and_charges_nothing(cluster):
    key = f"gone-{uuid.uuid4().hex}"
    counted = cluster.withdrawals()
    with GatewayClient(cluster.gw.clients, cluster.key("chat-co"), timeout_s=30) as client:
        reply = client._call(withdraw_request(client.api_key, key))
        assert (reply.job_id, reply.cancelled) == ("", True)
        assert cluster.idem("chat-co", key) == b"-"
        assert 3500 < cluster.redis.ttl(cluster.keys.idem("chat-co", key)) <= 3600
        before = cluster.state()
        for tier in ("P0", "P2"):  # P0: the tenant's quota is not charged
            with pytest.raises(InvalidRequest, match="withdrawn") as e:
                client.submit(prompt_token_ids=PROMPT, max_tokens=4, tier=tier, idempotency_key=key)
            assert e.value.field == "idempotency_key"
        assert cluster.state() == before
        # Withdrawn again: still nothing under it.
        reply = client._call(withdraw_request(client.api_key, key))
        assert (reply.job_id, reply.cancelled) == ("", True)
        assert cluster.state() == before
    assert cluster.withdrawals() == counted | {"before_admission": counted["before_admission"] + 2}


def test_withdrawing_a_key_whose_job_was_admitted_cancels_that_job(cluster, sdk):
    key = f"late-{uuid.uuid4().hex}"
    counted = cluster.withdrawals()
    job = sdk.submit(prompt_token_ids=PROMPT, max_tokens=4, tier="P2", idempotency_key=key)
    assert job.status().state == "queued"
    reply = sdk._call(withdraw_request(sdk.api_key, key))
    assert (reply.job_id, reply.cancelled) == (job.id, True)
    assert job.status().state == "cancelled"
    reply = sdk._call(withdraw_request(sdk.api_key, key))
    assert (reply.job_id, reply.cancelled) == (job.id, False)  # it had ended
    assert cluster.withdrawals() == counted | {"admitted": counted["admitted"] + 2}
    again = sdk.submit(prompt_token_ids=PROMPT, max_tokens=4, tier="P2", idempotency_key=key)
    assert again.id == job.id and again.status().state == "cancelled"  # the key still names its job


def test_a_withdrawal_is_the_tenant_s_own(cluster, sdk):
    key = f"shared-{uuid.uuid4().hex}"
    job = sdk.submit(prompt_token_ids=PROMPT, max_tokens=4, tier="P2", idempotency_key=key)
    with GatewayClient(cluster.gw.clients, cluster.key("batch-co"), timeout_s=30) as other:
        reply = other._call(withdraw_request(other.api_key, key))
        assert (reply.job_id, reply.cancelled) == ("", True)  # batch-co's key of that name, not api-co's
        theirs = other.submit(prompt_token_ids=PROMPT, max_tokens=4, tier="P2", idempotency_key=f"{key}-2")
    assert job.status().state == "queued"
    assert sdk.submit(prompt_token_ids=PROMPT, max_tokens=4, tier="P2", idempotency_key=key).id == job.id
    job.cancel()
    theirs.cancel()


def _raw(cluster, msg) -> P.ErrorReply | P.CancelReply | P.SubmitReply:
    """``msg`` sent as is (no SDK check), the gateway's answer."""
    sock = make_socket(zmq.Context.instance(), zmq.DEALER)
    try:
        sock.connect(cluster.gw.clients)
        sock.send(P.encode(msg))
        assert sock.poll(10_000), "the gateway did not answer"
        return P.decode(sock.recv())
    finally:
        sock.close(linger=0)


@pytest.mark.parametrize("fields", [
    {"idempotency_key": ""}, {"idempotency_key": "k" * 201}, {"idempotency_key": "k", "job_id": "some-job"},
    {"idempotency_key": 12}, {"idempotency_key": ["k"]},
])
def test_bad_withdrawals_are_refused_and_change_nothing(cluster, fields):
    before = cluster.state()
    reply = _raw(cluster, P.CancelRequest(cluster.key("api-co"), fields.pop("job_id", ""), request_id="r", **fields))
    assert isinstance(reply, P.ErrorReply) and reply.request_id == "r", reply
    if isinstance(fields["idempotency_key"], str):
        assert (reply.code, reply.field) == ("invalid_request", "idempotency_key"), reply
    else:  # the decoder's own type check
        assert reply.code == "protocol" and "idempotency_key" in reply.message, reply
    assert cluster.state() == before


def test_a_stranger_withdraws_nothing(cluster):
    before = cluster.state()
    reply = _raw(cluster, P.CancelRequest("not-a-key", "", idempotency_key="k"))
    assert isinstance(reply, P.ErrorReply) and reply.code == "unauthorized", reply
    assert cluster.state() == before


@pytest.mark.parametrize("fields", [{"retry_key": True}, {"retry_key": "yes", "idempotency_key": "k"},
                                    {"retry_key": 1, "idempotency_key": "k"}])
def test_a_bad_retry_key_is_refused_and_stores_nothing(cluster, fields):
    before = cluster.state()
    reply = _raw(cluster, P.SubmitRequest(cluster.key("api-co"), 4, prompt_token_ids=PROMPT, tier="P2", **fields))
    assert isinstance(reply, P.ErrorReply), reply
    if fields["retry_key"] is True:  # a retry key with no key
        assert (reply.code, reply.field) == ("invalid_request", "retry_key"), reply
    else:
        assert reply.code == "protocol" and "retry_key" in reply.message, reply
    assert cluster.state() == before


def test_racing_submissions_and_withdrawals_leave_no_job_running(cluster):
    """Each key's submission and withdrawal sent together, in a random order, through two clients: whichever
    Redis runs first, the key's job (if any) ends cancelled, and a refused submission stored nothing."""
    rng = random.Random(12)
    keys = [f"race-{i}-{uuid.uuid4().hex[:6]}" for i in range(60)]
    tenant = "lab-co"
    before = set(cluster.jobs(tenant))

    async def after(delay_s: float, call):
        await asyncio.sleep(delay_s)
        return await call

    async def one(a: AsyncGatewayClient, b: AsyncGatewayClient, key: str):
        # Each sent after its own random pause of up to 20 ms: about as often first as second at the gateway.
        submit = after(rng.random() * 0.02, a.submit(prompt_token_ids=PROMPT, max_tokens=4, tier="P3",
                                                      idempotency_key=key))
        withdraw = after(rng.random() * 0.02, b._call(withdraw_request(b.api_key, key)))
        return await asyncio.gather(submit, withdraw, return_exceptions=True)

    async def main():
        async with AsyncGatewayClient(cluster.gw.clients, cluster.key(tenant), timeout_s=30) as a, \
                AsyncGatewayClient(cluster.gw.clients, cluster.key(tenant), timeout_s=30) as b:
            warm = await a.submit(prompt_token_ids=PROMPT, max_tokens=4, tier="P3")  # each connection made, its
            await b.info()  # frame sizes asked
            before.add(warm.id)
            await warm.cancel()
            return await asyncio.gather(*(one(a, b, k) for k in keys))

    outcomes = asyncio.run(main())
    jobs = {i: s for i, s in cluster.jobs(tenant).items() if i not in before}
    admitted = refused = 0
    for key, pair in zip(keys, outcomes):
        submitted = next(r for r in pair if not isinstance(r, P.CancelReply))
        withdrawn = next(r for r in pair if isinstance(r, P.CancelReply))
        if isinstance(submitted, InvalidRequest):
            refused += 1
            assert "withdrawn" in str(submitted) and withdrawn.job_id == ""
            assert cluster.idem(tenant, key) == b"-"
        else:
            admitted += 1
            assert withdrawn.job_id == submitted.id and withdrawn.cancelled, (key, withdrawn)
            assert jobs[submitted.id] == "cancelled"
    assert admitted + refused == len(keys) and len(jobs) == admitted, (admitted, refused, jobs)
    assert min(admitted, refused) >= 10, (admitted, refused)  # both orders were tried
    assert set(jobs.values()) <= {"cancelled"}


def _queued(cluster, tenant: str, since: set[str]) -> dict[str, str]:
    return {i: s for i, s in cluster.jobs(tenant).items() if i not in since}


def test_an_async_submit_given_up_on_withdraws_its_job(cluster):
    """The gateway frozen past the caller's wait_for: its submission was taken all the same; the withdrawal that
    follows it on the connection cancels the job it admitted once the gateway goes on."""
    tenant = "batch-co"
    before = set(cluster.jobs(tenant))

    async def main():
        async with AsyncGatewayClient(cluster.gw.clients, cluster.key(tenant), timeout_s=5) as client:
            await client.info()  # a connection made before the freeze: the frame reaches the gateway's socket
            with cluster.frozen():
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(client.submit(prompt_token_ids=PROMPT, max_tokens=4, tier="P3"), 0.5)
                await asyncio.sleep(0.3)
            # Leaving the block waits for the withdrawal before the connection closes.

    asyncio.run(main())
    jobs = _queued(cluster, tenant, before)
    assert len(jobs) == 1 and list(jobs.values()) == ["cancelled"], jobs


def test_a_caller_s_own_key_is_not_withdrawn(cluster):
    tenant = "batch-co"
    before = set(cluster.jobs(tenant))
    key = f"mine-{uuid.uuid4().hex}"

    async def main():
        async with AsyncGatewayClient(cluster.gw.clients, cluster.key(tenant), timeout_s=5) as client:
            await client.info()
            with cluster.frozen():
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(client.submit(prompt_token_ids=PROMPT, max_tokens=4, tier="P3",
                                                         idempotency_key=key), 0.5)
            return await client.submit(prompt_token_ids=PROMPT, max_tokens=4, tier="P3", idempotency_key=key)

    job = asyncio.run(main())
    jobs = _queued(cluster, tenant, before)
    assert list(jobs) == [job.id] and jobs[job.id] == "queued", jobs  # the resubmit found it
    assert job.duplicate
    with GatewayClient(cluster.gw.clients, cluster.key(tenant)) as client:
        client.cancel(job.id)


def test_a_blocking_submit_that_timed_out_withdraws_its_job(cluster):
    """A gateway stalled past the caller's timeout_s (and its retries): submit() raises TimeoutError; the SDK's
    withdrawal, retried longer in the background, reaches the gateway once it goes on."""
    tenant = "api-co"
    before = set(cluster.jobs(tenant))
    with GatewayClient(cluster.gw.clients, cluster.key(tenant), timeout_s=0.5, retries=0) as client:
        client.info()
        os.kill(cluster.gw.proc.pid, signal.SIGSTOP)
        timer = threading.Timer(1.5, os.kill, (cluster.gw.proc.pid, signal.SIGCONT))
        timer.start()
        try:
            with pytest.raises(TimeoutError):
                client.submit(prompt_token_ids=PROMPT, max_tokens=4, tier="P3")
        finally:
            timer.join()
        wait_for(lambda: list(_queued(cluster, tenant, before).values()) == ["cancelled"], 30,
                 "the job taken from the late submission to be withdrawn")


OLDER_GATEWAY = """
import dataclasses, runpy, sys
from common import client_messages as m, protocol as P
for name, new in (("SubmitRequest", "retry_key"), ("CancelRequest", "idempotency_key")):
    cls = getattr(m, name)
    fields = [(f.name, f.type, f) for f in dataclasses.fields(cls) if f.name != new]
    default = cls.__dataclass_fields__[new].default
    older = dataclasses.make_dataclass(name, fields, frozen=True, namespace={new: default})
    setattr(m, name, older); setattr(P, name, older); P.MESSAGES[name] = older
sys.argv = ["gateway"] + sys.argv[1:]
runpy.run_module("gateway", run_name="__main__")
"""


class _OlderGateway(DurableCluster):
    def _cmd(self, name: str) -> list[str]:
        cmd = super()._cmd(name)
        return [sys.executable, "-c", OLDER_GATEWAY, *cmd[3:]] if name in self.gateways else cmd


def test_a_gateway_older_than_retry_keys_takes_the_sdk_s_submissions(tmp_path, tiny_model_dir):
    """It refuses ``retry_key`` as a protocol error: both clients send the submission again without it (the key is
    then kept its 24 h, as before), and a withdrawal it cannot read changes nothing."""
    with _OlderGateway(tmp_path, tiny_model_dir, gateways=1, workers=0) as c:
        with c.client("lab-co", timeout_s=10) as sdk:
            job = sdk.submit(prompt_token_ids=PROMPT, max_tokens=3, tier="P3")
            assert not job.duplicate and c.state(job.id) == "queued"
            with pytest.raises(ServingError, match="protocol"):
                sdk._call(withdraw_request(sdk.api_key, "some-key"))

        async def submit_async():
            async with AsyncGatewayClient(c.endpoint(), c.key("lab-co"), timeout_s=10) as client:
                return await client.submit(prompt_token_ids=PROMPT, max_tokens=3, tier="P3")

        assert c.state(asyncio.run(submit_async()).id) == "queued"
        ttls = [c.redis.ttl(k) for k in c.redis.scan_iter(f"{KeySpace('ts').base}:idem:lab-co:*")]
        assert len(ttls) == 2 and min(ttls) > 86000, ttls
