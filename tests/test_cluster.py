"""The cluster end to end: real redis-server, gateway and worker processes on loopback, the SDK."""

from __future__ import annotations

import threading

import pytest

from common.errors import Forbidden, InvalidRequest, JobCancelled, JobFailed, QuotaExceeded, Unauthorized
from gateway.sdk import AsyncGatewayClient, GatewayClient
from tests.cluster_helpers import job_hash, local_cluster, snapshot, wait_for


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("cluster"), tiny_model_dir, workers=2, max_running=2,
                       aging_interval=1.0, http=False) as state:
        yield state


def client(cluster, tenant: str) -> GatewayClient:
    return GatewayClient(cluster["gateway"], cluster["tenants"][tenant]["api_key"], timeout_s=30)


def test_p0_jobs_finish_before_a_p3_flood_and_every_p3_completes(cluster):
    lab, chat = client(cluster, "lab-co"), client(cluster, "chat-co")
    flood = [lab.submit(prompt_token_ids=[5 + i, 6, 7], max_tokens=400, ignore_eos=True, seed=i) for i in range(12)]
    wait_for(lambda: sum(job_hash(cluster, j.id)["state"] == "dispatched" for j in flood) == 4, 30,
             "the flood to fill all four slots")
    urgent = [chat.submit(prompt_token_ids=[9, 9, i], max_tokens=20, ignore_eos=True, tier="P0") for i in range(3)]
    assert {j.tier for j in urgent} == {"P0"} and {j.tier for j in flood} == {"P3"}
    results = {j.id: j.result(timeout=120) for j in urgent + flood}
    assert all(len(results[j.id].token_ids) == 400 for j in flood)
    assert all(len(results[j.id].token_ids) == 20 for j in urgent)
    done_at = {j.id: int(job_hash(cluster, j.id)["finished_at_ms"]) for j in urgent + flood}
    p3_finishes = sorted(done_at[j.id] for j in flood)
    # Every P0 is done before the P3 jobs that were running or queued when it arrived (4 slots, 12 P3s).
    assert max(done_at[j.id] for j in urgent) < p3_finishes[4]


def test_stream_delivers_each_index_once_and_matches_the_result(cluster):
    lab = client(cluster, "lab-co")
    job = lab.submit("hello world", max_tokens=50, temperature=0.8, seed=3, ignore_eos=True)
    chunks = list(job.stream())
    indices = [i for c in chunks for i in range(c.index, c.index + len(c.token_ids))]
    assert indices == list(range(50))
    result = job.result(timeout=30)
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert "".join(c.text for c in chunks) == result.text
    assert result.finish_reason == "length" and result.total_s >= result.queued_s >= 0
    # Resumed from an index, it delivers exactly the rest; an index that is no index is refused, never a stream
    # that ends at once with none of the job's tokens.
    assert [t for c in job.stream(from_index=45) for t in c.token_ids] == result.token_ids[45:]
    for bad in (-1, 2.5, True, "3"):
        with pytest.raises(InvalidRequest) as e:
            list(job.stream(from_index=bad))
        assert e.value.field == "from_index"


def test_refusals_store_nothing_and_charge_nothing(cluster):
    lab, chat = client(cluster, "lab-co"), client(cluster, "chat-co")
    wait_for(lambda: all(v == 0 for v in lab.info().queue_depths.values()), 60, "an idle cluster")
    # Spend the P0 burst, so the next P0 is refused with a retry-after.
    accepted = []
    with pytest.raises(QuotaExceeded) as quota:
        for i in range(10):
            accepted.append(chat.submit(prompt_token_ids=[4, i], max_tokens=1, ignore_eos=True, tier="P0"))
    assert 1 <= len(accepted) <= 5 and quota.value.retry_after_s > 0
    for j in accepted:
        j.result(timeout=30)
    wait_for(lambda: all(v == 0 for v in lab.info().queue_depths.values()), 30, "the burst jobs to finish")
    before = snapshot(cluster)
    refusals = [
        (lambda: GatewayClient(cluster["gateway"], "not-a-key").submit("hi"), Unauthorized),
        (lambda: lab.submit("hi", tier="P0"), Forbidden),
        (lambda: lab.submit("hi", tier="P9"), InvalidRequest),
        (lambda: lab.submit(prompt_token_ids=[1] * 3000, max_tokens=4, ignore_eos=True), InvalidRequest),
        (lambda: lab.submit(prompt_token_ids=[10**6], max_tokens=4, ignore_eos=True), InvalidRequest),
        (lambda: lab.submit("hi", max_tokens=0, ignore_eos=True), InvalidRequest),
        (lambda: lab.submit("hi", temperature=-1.0), InvalidRequest),
        (lambda: lab.submit(), InvalidRequest),
        # Wrong types are the SDK's typed refusal too, never a raw OverflowError or a protocol error.
        (lambda: lab.submit("hi", seed=2**64), InvalidRequest),
        (lambda: lab.submit("hi", seed=-1), InvalidRequest),
        (lambda: lab.submit("hi", max_tokens=2.5), InvalidRequest),
        (lambda: lab.submit("hi", max_tokens=True), InvalidRequest),
        (lambda: lab.submit("hi", top_k=2.0), InvalidRequest),
        (lambda: lab.submit("hi", temperature="hot"), InvalidRequest),
        (lambda: lab.submit(prompt_token_ids=[1.5], max_tokens=1), InvalidRequest),
        (lambda: lab.submit(prompt_token_ids=[True], max_tokens=1), InvalidRequest),
        (lambda: lab.submit(prompt_token_ids="abc", max_tokens=1), InvalidRequest),
        (lambda: lab.submit(prompt_token_ids=[2**70], max_tokens=1), InvalidRequest),
        (lambda: lab.submit(b"bytes", max_tokens=1), InvalidRequest),
        (lambda: lab.submit("hi", idempotency_key=42), InvalidRequest),
        (lambda: GatewayClient(cluster["gateway"], lab.api_key, timeout_s=0), InvalidRequest),
        (lambda: GatewayClient(cluster["gateway"], lab.api_key, timeout_s=float("nan")), InvalidRequest),
        (lambda: GatewayClient(cluster["gateway"], None), InvalidRequest),
        (lambda: AsyncGatewayClient(cluster["gateway"], lab.api_key, retries=-1), InvalidRequest),
        (lambda: chat.submit(prompt_token_ids=[4], max_tokens=1, ignore_eos=True, tier="P0"), QuotaExceeded),
    ]
    for call, error in refusals:
        with pytest.raises(error):
            call()
    assert snapshot(cluster) == before  # no job, no idempotency key, no quota charge


def test_idempotency_key_returns_the_same_job(cluster):
    lab = client(cluster, "lab-co")
    a = lab.submit("same", max_tokens=3, idempotency_key="order-42", ignore_eos=True)
    b = lab.submit("same", max_tokens=3, idempotency_key="order-42", ignore_eos=True)
    assert a.id == b.id and not a.duplicate and b.duplicate
    assert a.result(timeout=30).token_ids == b.result(timeout=30).token_ids


def test_an_idempotency_key_reused_for_another_request_is_refused(cluster):
    """Under a key, another prompt or other sampling is a refusal naming the first job: its result would not be
    this request's. The refusal stores and charges nothing; a retry of the first request still gets its job."""
    lab = client(cluster, "lab-co")
    first = lab.submit("first", max_tokens=3, idempotency_key="order-43", ignore_eos=True)
    assert len(first.result(timeout=30).token_ids) == 3  # done: the snapshot below holds still
    before = snapshot(cluster)
    for other in [dict(prompt="second", max_tokens=3), dict(prompt="first", max_tokens=4),
                  dict(prompt="first", max_tokens=3, temperature=0.5), dict(prompt="first", max_tokens=3, seed=7)]:
        with pytest.raises(InvalidRequest) as e:
            lab.submit(**other, idempotency_key="order-43", ignore_eos=True)
        assert e.value.field == "idempotency_key" and first.id in str(e.value)
    assert snapshot(cluster) == before
    assert lab.submit("first", max_tokens=3, idempotency_key="order-43", ignore_eos=True).id == first.id


def test_aging_promotes_a_waiting_p3_job(cluster):
    lab, batch = client(cluster, "lab-co"), client(cluster, "batch-co")
    blockers = [batch.submit(prompt_token_ids=[3, i], max_tokens=2000, ignore_eos=True, tier="P2") for i in range(4)]
    wait_for(lambda: sum(job_hash(cluster, j.id)["state"] == "dispatched" for j in blockers) == 4, 30,
             "P2 work to fill every slot")
    waiting = lab.submit("patience", max_tokens=2, ignore_eos=True)
    assert waiting.tier == "P3"
    enqueued = job_hash(cluster, waiting.id)["enqueued_at_ms"]
    # One aging interval (1 s here) later it has moved up, keeping its enqueue time; P1 at most, never P0.
    h = wait_for(lambda: (lambda h: h if h["tier"] != "P3" else None)(job_hash(cluster, waiting.id)), 20,
                 "the P3 job to age")
    assert h["tier"] in ("P2", "P1") and h["tier_granted"] == "P3" and h["enqueued_at_ms"] == enqueued
    for j in blockers:
        batch.cancel(j.id)
    assert len(waiting.result(timeout=60).token_ids) == 2
    assert job_hash(cluster, waiting.id)["tier"] != "P0"


def test_a_p1_still_preempts_when_aged_p3_jobs_are_ahead_of_it_in_the_p1_queue(cluster):
    """Aged jobs keep their place in line for free slots, but preempt only as the tier they were admitted at
    (none, for a P3): however many of them sit at the head of the P1 queue, a P1 admitted as one still goes
    to a worker running work it may preempt."""
    lab, api = client(cluster, "lab-co"), client(cluster, "api-co")
    running = [lab.submit(prompt_token_ids=[3, i], max_tokens=2000, ignore_eos=True) for i in range(4)]
    wait_for(lambda: sum(job_hash(cluster, j.id)["state"] == "dispatched" for j in running) == 4, 30,
             "P3 work to fill every slot")
    aged = [lab.submit(prompt_token_ids=[4, i], max_tokens=2000, ignore_eos=True) for i in range(12)]
    # Two aging intervals (1 s each) on, all twelve are in the P1 queue, older than any P1 admitted now:
    # more than the victims there are (4 slots, each preemptible by P0 and P1).
    wait_for(lambda: all(job_hash(cluster, j.id)["tier"] == "P1" for j in aged), 20, "the queued P3s to age to P1")
    try:
        urgent = api.submit(prompt_token_ids=[9, 9], max_tokens=2, ignore_eos=True, tier="P1")
        result = urgent.result(timeout=60)
        assert len(result.token_ids) == 2
        finished = int(job_hash(cluster, urgent.id)["finished_at_ms"])
        # It preempted a running P3 rather than wait behind the aged ones for a slot to free.
        assert all(job_hash(cluster, j.id)["state"] in ("queued", "dispatched") for j in aged), [
            job_hash(cluster, j.id)["state"] for j in aged]
        assert all(job_hash(cluster, j.id).get("finished_at_ms") is None
                   or int(job_hash(cluster, j.id)["finished_at_ms"]) > finished for j in running)
    finally:
        for j in running + aged:
            lab.cancel(j.id)


def test_cancel_frees_the_worker(cluster):
    lab = client(cluster, "lab-co")
    job = lab.submit("long", max_tokens=1800, ignore_eos=True)
    wait_for(lambda: job_hash(cluster, job.id)["state"] == "dispatched", 30, "dispatch")
    assert lab.cancel(job.id) is True
    assert lab.status(job.id).state == "cancelled"
    assert lab.cancel(job.id) is False
    # Its stream ends in the job's fate, as result() does, never quietly as if the tokens were all there. Its
    # own error, a JobFailed still (what callers caught before it had one).
    with pytest.raises(JobCancelled, match="cancelled"):
        for _ in job.stream():
            pass
    with pytest.raises(JobCancelled, match="cancelled") as e:
        job.result(timeout=30)
    assert isinstance(e.value, JobFailed)
    # The slot is free again: a short job runs at once.
    assert len(lab.submit("next", max_tokens=2, ignore_eos=True).result(timeout=30).token_ids) == 2


def test_async_client_has_the_same_surface(cluster):
    import asyncio

    async def go():
        c = AsyncGatewayClient(cluster["gateway"], cluster["tenants"]["api-co"]["api_key"], timeout_s=30)
        try:
            job = await c.submit("async", max_tokens=8, ignore_eos=True)
            assert job.tier == "P1"
            seen = [i async for chunk in job.stream() for i in range(chunk.index, chunk.index + len(chunk.token_ids))]
            result = await job.result()
            status = await c.status(job.id)
            gone = await c.submit("async, cancelled", max_tokens=1800, ignore_eos=True)
            assert await gone.cancel() is True
            with pytest.raises(JobFailed, match="cancelled"):
                async for _ in gone.stream():
                    pass
            return seen, result, status
        finally:
            c.close()

    seen, result, status = asyncio.run(go())
    assert seen == list(range(len(seen))) and len(result.token_ids) == 8 and status.state == "done"


def test_status_of_another_tenants_job_is_not_found(cluster):
    from common.errors import NotFound

    lab, api = client(cluster, "lab-co"), client(cluster, "api-co")
    job = lab.submit("mine", max_tokens=1, ignore_eos=True)
    with pytest.raises(NotFound):
        api.status(job.id)
    job.result(timeout=30)


def test_concurrent_streams_from_threads(cluster):
    lab = client(cluster, "lab-co")
    jobs = [lab.submit(prompt_token_ids=[7, i], max_tokens=30, ignore_eos=True, seed=i) for i in range(6)]
    out: dict[str, list[int]] = {}

    def consume(job):
        out[job.id] = [t for c in job.stream() for t in c.token_ids]

    threads = [threading.Thread(target=consume, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(len(out[j.id]) == 30 for j in jobs)
