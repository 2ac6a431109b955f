"""A long-running cluster must not grow Redis without bound: every key it writes either expires (a TTL, and a
sensible one) or belongs to the documented fixed set (common/redis_keys.py), and no fixed key's collection keeps an
entry per job past the job's life, but the capped dead-letter and per-tenant sets.

A real cluster (scripts/up.py: redis-server, a gateway, a worker, the HTTP door) is driven through every way a job
ends: done through the SDK (sync and async) and the door, idempotent duplicates, cancelled (SDK, and the door at a
stop string), expired in its queue, failed, dead-lettered, re-dispatched after a worker's kill -9, and across a
gateway's kill -9; refusals must store nothing. Then every key is listed with its type, TTL and size. The one part
that is not a real process is the worker that fails a job: a raw CURVE peer with the cluster's worker key (no real
worker fails a job the gateway admitted, by design)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest
import redis
import zmq

from common import protocol as P
from common.errors import (Forbidden, InvalidRequest, JobCancelled, JobExpired, JobFailed, QuotaExceeded,
                           Unauthorized)
from common.sockets import curve_client, make_socket
from gateway.sdk import AsyncGatewayClient, GatewayClient
from tests.cluster_helpers import (assert_unchanged, frozen, job_hash, job_ids, local_cluster, process_running,
                                   snapshot, state_pids, wait_for)
from tests.test_http import key, post, sse

FINAL = {"done", "failed", "expired", "cancelled", "dead"}
LEASE_S = 3.0
ENV = {"TS_GATEWAY_MAX_ATTEMPTS": "2", "TS_GATEWAY_WORKER_TIMEOUT_S": "3",
       "TS_GATEWAY_TIER_TIMEOUTS_S": '{"P0": 30, "P1": 60, "P2": 1, "P3": null}'}
HOUR_MS, DAY_MS = 3_600_000, 86_400_000
TENANTS = ("chat-co", "api-co", "batch-co", "lab-co")

# Keys that may live for ever: a fixed set whatever the traffic (common/redis_keys.py).
FIXED = {"q:P0", "q:P1", "q:P2", "q:P3", "inflight", "dead", "drain", "aging", "deadlines", "promises", "tokenizer"}
FIXED |= {f"tenant-jobs:{t}" for t in TENANTS}
# Per-job, per-request, per-worker or per-tenant keys: each must expire, within this many ms at most.
EXPIRING = [(re.compile(r"job:[^:]+"), HOUR_MS), (re.compile(r"tok:[^:]+"), HOUR_MS),
            (re.compile(r"idem:[^:]+:.+"), DAY_MS), (re.compile(r"quota:[^:]+"), HOUR_MS),
            (re.compile(r"worker-key:[^:]+"), 10 * 60_000), (re.compile(r"drained-workers"), 10 * 60_000),
            (re.compile(r"model"), 10 * 60_000)]
# Sets that hold one entry per job only while it is queued or dispatched: empty once the cluster is idle.
LIVE_ONLY = ("q:P0", "q:P1", "q:P2", "q:P3", "inflight", "aging", "deadlines")


def test_every_key_expires_or_is_one_of_a_fixed_set(tmp_path, tiny_model_dir):
    started = time.monotonic()
    with local_cluster(tmp_path, tiny_model_dir, workers=1, max_running=4, lease_s=LEASE_S, env=ENV) as c:
        r: redis.Redis = c["redis_client"]
        ended: dict[str, str] = {}  # job id -> the end this test drove it to (checked against the record)
        sdk = {t: GatewayClient(c["gateway"], key(c, t), timeout_s=60) for t in TENANTS}
        try:
            _done_cancelled_duplicates(c, sdk, ended)
            _http(c, ended)
            _refusals_store_nothing(c, sdk)
            _gateway_killed(c, sdk, ended)
            _worker_killed_dead_expired_failed(c, sdk, ended, tiny_model_dir)
            wait_for(lambda: all(_state(c, j) in FINAL for j in ended), 60,
                     f"every job to end: { {j: _state(c, j) for j in ended} }", interval=0.2)
            wait_for(lambda: not any(r.zcard(_k(c, name)) for name in LIVE_ONLY), 30, "an idle cluster")
        finally:
            for client in sdk.values():
                client.close()
        states = {j: _state(c, j) for j in ended}
        assert {j: s for j, s in states.items() if s != ended[j]} == {}, "a job ended otherwise than driven"
        assert set(states.values()) == FINAL
        assert any(int(job_hash(c, j)["attempt"]) >= 2 and s == "done" for j, s in states.items()), \
            "no job was re-dispatched and finished"
        _audit(c)
    print(f"runtime {time.monotonic() - started:.1f} s")


# -- the job paths ------------------------------------------------------------------------------------------------


def _done_cancelled_duplicates(c, sdk, ended) -> None:
    lab, api = sdk["lab-co"], sdk["api-co"]
    for i in range(3):
        job = lab.submit(prompt_token_ids=[5, 6, i], max_tokens=8, ignore_eos=True, seed=i)
        assert len(job.result(timeout=60).token_ids) == 8
        ended[job.id] = "done"
    a = api.submit("same", max_tokens=3, idempotency_key="order-1", ignore_eos=True)
    b = api.submit("same", max_tokens=3, idempotency_key="order-1", ignore_eos=True)
    assert a.id == b.id and b.duplicate and len(a.result(timeout=60).token_ids) == 3
    ended[a.id] = "done"
    running = lab.submit(prompt_token_ids=[7, 7], max_tokens=1800, ignore_eos=True)
    wait_for(lambda: job_hash(c, running.id)["state"] == "dispatched", 30, "dispatch")
    assert lab.cancel(running.id) is True
    with pytest.raises(JobCancelled):
        running.result(timeout=30)
    ended[running.id] = "cancelled"

    async def go():
        async with AsyncGatewayClient(c["gateway"], key(c, "api-co"), timeout_s=60) as ac:
            job = await ac.submit("async", max_tokens=6, ignore_eos=True)
            assert len((await job.result()).token_ids) == 6
            gone = await ac.submit("async, cancelled", max_tokens=1800, ignore_eos=True)
            assert await gone.cancel() is True
            return job.id, gone.id

    done_id, cancelled_id = asyncio.run(go())
    ended[done_id], ended[cancelled_id] = "done", "cancelled"


def _http(c, ended) -> None:
    body = {"prompt": [5, 17, 42, 99, 7], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    r = post(c, "/v1/completions", body, tenant="api-co")
    assert r.status_code == 200, r.text
    ended[r.headers["X-Request-Id"]] = "done"
    text = r.json()["choices"][0]["text"]
    headers = {"Authorization": f"Bearer {key(c, 'api-co')}", "Idempotency-Key": "http-1"}
    with httpx.stream("POST", c["http"] + "/v1/completions", json=body | {"stream": True}, headers=headers,
                      timeout=60) as s:
        assert s.status_code == 200
        assert sse(s.iter_lines())[1]
        first = s.headers["X-Request-Id"]
    again = httpx.post(c["http"] + "/v1/completions", json=body | {"stream": True}, headers=headers, timeout=60)
    assert again.status_code == 200 and again.headers["X-Request-Id"] == first  # the key's job, not a new one
    ended[first] = "done"
    r = post(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
             tenant="api-co")
    assert r.status_code == 200, r.text
    ended[r.headers["X-Request-Id"]] = "done"
    # A stop string the greedy answer completes early: the door ends the answer there, and the job with it (done).
    stop = text[len(text) // 4:len(text) // 4 + 2]
    assert stop.strip(), text
    r = post(c, "/v1/completions", body | {"stop": stop, "max_tokens": 1500}, tenant="api-co")
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop", r.text
    ended[r.headers["X-Request-Id"]] = "done"


def _refusals_store_nothing(c, sdk) -> None:
    lab, chat = sdk["lab-co"], sdk["chat-co"]
    r = c["redis_client"]
    # Over quota: the P0 burst spent, the next P0 is refused and stores nothing (its bucket refills at 2/s, so the
    # refusal is checked where it happens, not in the snapshot below).
    idem = _k(c, "idem:*").replace("{", "\\{").replace("}", "\\}")
    spent, before_jobs, before_idem = [], job_ids(c), len(list(r.scan_iter(match=idem)))
    with pytest.raises(QuotaExceeded):
        for i in range(10):
            spent.append(chat.submit(prompt_token_ids=[4, i], max_tokens=1, tier="P0", idempotency_key=f"p0-{i}"))
    assert job_ids(c) == before_jobs | {j.id for j in spent}
    assert len(list(r.scan_iter(match=idem))) == before_idem + len(spent)
    for job in spent:
        job.result(timeout=60)
    wait_for(lambda: not any(r.zcard(_k(c, n)) for n in LIVE_ONLY), 30, "an idle cluster")
    before = _snapshot(c)
    refusals = [
        (lambda: GatewayClient(c["gateway"], "not-a-key").submit("hi"), Unauthorized),
        (lambda: lab.submit("hi", tier="P0"), Forbidden),
        (lambda: lab.submit(prompt_token_ids=[1] * 3000, max_tokens=4), InvalidRequest),
        (lambda: lab.submit(prompt_token_ids=[10**6], max_tokens=4), InvalidRequest),
        (lambda: lab.submit("hi", max_tokens=0), InvalidRequest),
        (lambda: lab.submit("hi", idempotency_key="k", temperature=-1.0), InvalidRequest),
    ]
    for call, error in refusals:
        with pytest.raises(error):
            call()
    for b, tenant in [({"prompt": [5], "max_tokens": 0}, "api-co"), ({"prompt": [5], "temperature": -2}, "api-co"),
                      ({"prompt": [5], "max_tokens": 2}, None), ({"prompt": [5], "priority": 0}, "lab-co")]:
        assert post(c, "/v1/completions", b, tenant=tenant, headers={"Idempotency-Key": "h"}).status_code >= 400
    assert_unchanged(before, _snapshot(c))


def _gateway_killed(c, sdk, ended) -> None:
    lab = sdk["lab-co"]
    job = lab.submit(prompt_token_ids=[8, 8], max_tokens=600, ignore_eos=True)
    wait_for(lambda: job_hash(c, job.id)["state"] == "dispatched", 30, "dispatch")
    old = state_pids(c)["gw-0"]
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: state_pids(c)["gw-0"] != old and process_running(state_pids(c)["gw-0"]), 30,
             "the gateway's restart")
    assert len(lab.job(job.id).result(timeout=60).token_ids) == 600
    ended[job.id] = "done"


def _worker_killed_dead_expired_failed(c, sdk, ended, model_dir) -> None:
    lab, batch = sdk["lab-co"], sdk["batch-co"]
    redone = lab.submit(prompt_token_ids=[9, 1], max_tokens=500, ignore_eos=True, seed=1)
    dying = lab.submit(prompt_token_ids=[9, 2], max_tokens=2000, ignore_eos=True, seed=2)
    wait_for(lambda: all(job_hash(c, j.id).get("first_token_ms") for j in (redone, dying)), 30, "both to stream")
    old = state_pids(c)["wk-0"]
    os.kill(old, signal.SIGKILL)
    # Both leases run out; the restarted worker runs both again, and the short one ends.
    assert len(lab.job(redone.id).result(timeout=90).token_ids) == 500
    ended[redone.id] = "done"
    wk = state_pids(c)["wk-0"]
    assert wk != old and job_hash(c, dying.id)["state"] == "dispatched" and job_hash(c, dying.id)["attempt"] == "2"
    with frozen(wk):
        # Its last allowed attempt's lease runs out: dead-lettered.
        wait_for(lambda: job_hash(c, dying.id)["state"] == "dead", 30, "the dead-lettering")
        ended[dying.id] = "dead"
        # No worker: the wait estimate refuses nothing, and a P2 waits out its 1 s queue timeout.
        wait_for(lambda: not batch.info().workers, 30, "the frozen worker to time out")
        expiring = batch.submit(prompt_token_ids=[3], max_tokens=2, tier="P2")
        with pytest.raises(JobExpired):
            expiring.result(timeout=30)
        ended[expiring.id] = "expired"
        # Cancelled while still queued (no worker takes it), where the ones above were running.
        queued = lab.submit(prompt_token_ids=[3, 5], max_tokens=2)
        assert job_hash(c, queued.id)["state"] == "queued" and lab.cancel(queued.id) is True
        ended[queued.id] = "cancelled"
        ended[_failed_by_a_worker(c, batch, model_dir)] = "failed"


def _failed_by_a_worker(c, batch, model_dir) -> str:
    """A job a worker answers with failed: a raw CURVE peer under a new id, with the cluster's worker key."""
    digest = batch.info(tokenizer=True).tokenizer_digest
    sock = make_socket(zmq.Context.instance(), zmq.DEALER, identity=b"wk-failing")
    sock.setsockopt(zmq.LINGER, 0)
    curve_client(sock, c["keys"]["gateway_public"], c["keys"]["worker_secrets"]["wk-0"])
    sock.connect(c["gateways"][0]["worker_endpoint"])
    try:
        sock.send(P.encode(P.WorkerHello("wk-failing", str(model_dir), 512, 2048, 1, 1024,
                                         tokenizer_digest=digest, resumes=True, sampling_extras=True)))
        assert sock.poll(10_000), "no answer to the failing worker's hello"
        welcome = P.decode(sock.recv())
        assert isinstance(welcome, P.GatewayWelcome), welcome
        sock.send(P.encode(P.WorkerLoad("wk-failing", 1, 1024, {}, {}, [], 0.0)))
        wait_for(lambda: batch.info().workers == ["wk-failing"], 30, "the failing worker's registration")
        job = batch.submit(prompt_token_ids=[3, 4], max_tokens=2, tier="P3")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            sock.send(P.encode(P.WorkerLoad("wk-failing", 1, 1024, {}, {}, [], 0.0)))
            if sock.poll(200):
                msg = P.decode(sock.recv())
                if isinstance(msg, P.DispatchJob) and msg.job_id == job.id:
                    sock.send(P.encode(P.JobFinished(job.id, msg.attempt, "failed", None, 0, None, 0.0, 0,
                                                     "the worker says no", [])))
                    break
        else:
            raise AssertionError("the failing worker was never sent its job")
        with pytest.raises(JobFailed, match="the worker says no"):
            job.result(timeout=30)
        return job.id
    finally:
        sock.close()


# -- the audit ----------------------------------------------------------------------------------------------------


def _audit(c) -> None:
    r: redis.Redis = c["redis_client"]
    base = f"{c['key_prefix']}:{{c}}:"
    leaks, rows = [], []
    outside = [k for k in r.scan_iter(count=1000) if not k.decode().startswith(base)]
    assert outside == [], f"keys outside the cluster's prefix: {outside}"
    for raw in sorted(r.scan_iter(match=base.replace("{", "\\{").replace("}", "\\}") + "*", count=1000)):
        name = raw.decode()[len(base):]
        kind, ttl = r.type(raw).decode(), r.pttl(raw)
        size = {"hash": r.hlen, "zset": r.zcard, "stream": r.xlen, "string": r.strlen, "list": r.llen,
                "set": r.scard}[kind](raw)
        rows.append(f"{name:<48} {kind:<7} pttl={ttl:<10} size={size}")
        limit = next((ms for pattern, ms in EXPIRING if pattern.fullmatch(name)), None)
        if limit is not None:
            if ttl < 0:
                # A job's state names the path that forgot its expiry.
                of = f", state {r.hget(raw, 'state').decode()}" if name.startswith("job:") else ""
                leaks.append(f"{_pattern(name)} ({kind}{of}) has no TTL: one per job/request/worker, kept for ever")
            elif ttl > limit:
                leaks.append(f"{_pattern(name)} ({kind}) has a TTL of {ttl / 1000:.0f} s, over {limit / 1000:.0f} s")
        elif name not in FIXED:
            leaks.append(f"{_pattern(name)} ({kind}, pttl {ttl}) is no documented key (common/redis_keys.py)")
    for name in LIVE_ONLY:
        if n := r.zcard(base + name):
            leaks.append(f"{name} keeps {n} entries of ended jobs")
    # A promise of a job no longer queued is dropped when it falls due, so none may be overdue.
    now_ms = int(r.time()[0]) * 1000
    if overdue := r.zrangebyscore(base + "promises", "-inf", now_ms - 5_000):
        leaks.append(f"promises keeps {len(overdue)} overdue entries of ended jobs")
    drain_fields = {f.decode() for f in r.hkeys(base + "drain")}
    if extra := {f for f in drain_fields if not re.fullmatch(r"(completed|rate|ts):P[0-3]", f)}:
        leaks.append(f"drain holds fields that are not per tier: {sorted(extra)}")
    # Capped by configuration (dead_letter_max, tenant_max_jobs, defaults 10000): never more than the cap.
    for name, cap in [("dead", 10_000)] + [(f"tenant-jobs:{t}", 10_000) for t in TENANTS]:
        if r.zcard(base + name) > cap:
            leaks.append(f"{name} holds more than its cap of {cap}")
    print("\n".join(rows))
    assert not leaks, "Redis grows with traffic:\n  " + "\n  ".join(sorted(set(leaks)))


def _pattern(name: str) -> str:
    head, _, _ = name.partition(":")
    return f"{head}:*" if ":" in name else name


def _snapshot(c) -> dict[bytes, bytes]:
    """snapshot() less the promises index: a promise of an ended job is dropped when it falls due, at any time."""
    return {k: v for k, v in snapshot(c).items() if not k.endswith(b":promises")}


def _k(c, name: str) -> str:
    return f"{c['key_prefix']}:{{c}}:{name}"


def _state(c, job_id: str) -> str | None:
    return job_hash(c, job_id).get("state")
