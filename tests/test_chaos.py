"""One seeded, randomized run that mixes the faults and checks the books at the end (tests/chaos_helpers.py).

Two gateways, two workers on the tiny model, redis-server with AOF. For about a minute sync and async clients of
every tenant submit jobs of every tier (sizes up to the tier's limits; waited for, streamed whole, abandoned
mid-stream, cancelled, resubmitted under their key) while gateways, a worker and Redis are kill -9'd and started
again and a process is frozen for a moment. Then, with every process back: each admitted job ended once, done
jobs are whole and what a fresh engine makes for the same request, streams equal results, nothing is both cancelled
and done, no queue or index holds an ended job, the gateways counted every admission, and the workers hold no KV.

CHAOS_SEED=N replays a run (the seed is in every failure's message).
"""

from __future__ import annotations

import os
import threading
import time

import msgpack
import pytest

from common.ports import free_port
from gateway.sdk import GatewayClient
from tests.chaos_helpers import TERMINAL, AsyncClients, Books, Faults, SubmitGate, SyncClient, scrape, summed
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster

pytestmark = pytest.mark.faults

SEED = int(os.environ.get("CHAOS_SEED", "20240607"))
SPAN_S = float(os.environ.get("CHAOS_SPAN_S", "45"))  # longer for a deeper run: CHAOS_SPAN_S=600
EOS = 1  # scripts/make_tiny_model.py: <|bos|>, <|eos|>, <|pad|>


def limits_of(c: DurableCluster) -> tuple[dict[str, dict[str, int]], int]:
    out, most = {}, 0
    for tenant in ("chat-co", "api-co", "batch-co", "lab-co"):
        with GatewayClient(c.endpoint("gw-0"), c.key(tenant), timeout_s=10) as cl:
            info = cl.info(limits=True)
        out[tenant], most = dict(info.tier_token_limits), info.max_tokens_limit
    return out, most


def fresh_tokens(model_dir, specs: list[dict]) -> list[list[int]]:
    """What one engine in this process makes for each spec, run alone."""
    from worker import Engine, EngineConfig, SamplingParams

    engine = Engine.from_pretrained(str(model_dir), EngineConfig(device="cpu", dtype="float32", max_num_seqs=8))
    out = []
    for i, s in enumerate(specs):
        engine.add_request(f"ref-{i}", s["prompt_token_ids"], SamplingParams(
            max_tokens=s["max_tokens"], temperature=s.get("temperature", 0.0), top_p=s.get("top_p", 1.0),
            top_k=s.get("top_k"), seed=s["seed"], ignore_eos=s["ignore_eos"]), tier="P3")
        tokens = []
        while engine.has_unfinished():
            for o in engine.step():
                tokens.extend(o.new_token_ids)
        out.append(tokens)
    return out


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_books(c: DurableCluster, books: Books, faults: Faults, gw_metrics: dict, wk_metrics: dict,
                model_dir) -> list[str]:
    bad = list(books.problems)
    jobs = books.jobs
    wait_for(lambda: all(c.state(j) in TERMINAL for j in jobs), 180,
             f"every admitted job to end: {sorted((c.state(j), j) for j in jobs if c.state(j) not in TERMINAL)}",
             interval=0.5)
    in_redis = {k.decode().rsplit(":", 1)[1] for k in c.redis.scan_iter(match="ts:{c}:job:*", count=1000)}
    if in_redis != set(jobs):
        bad.append(f"jobs in Redis no client was given: {sorted(in_redis - set(jobs))}; "
                   f"admitted jobs missing from Redis: {sorted(set(jobs) - in_redis)}")
    for j, rec in jobs.items():
        h = c.job(j)
        state, spec = h.get("state", b"").decode(), rec["spec"]
        reason = h.get("reason", b"").decode()
        stored = msgpack.unpackb(h["token_ids"]) if "token_ids" in h else None
        if state in ("failed", "dead"):
            bad.append(f"{j} ({rec['action']}, {spec['tier']}) ended {state}: {reason}")
        if rec.get("cancelled") and state != "cancelled":
            bad.append(f"{j}: cancel() said True, but the job is {state}")
        if rec.get("cancelled") is False and state == "cancelled":
            bad.append(f"{j}: cancel() said False, but the job is cancelled")
        if state == "cancelled" and "result" in rec:
            bad.append(f"{j}: cancelled, yet its client got a result of {len(rec['result'])} tokens")
        if rec.get("error") == "cancelled" and state != "cancelled":
            bad.append(f"{j}: its client was told cancelled, but the job is {state}")
        if state != "done":
            continue
        n, want_n = len(stored), spec["max_tokens"]
        if not (n == want_n or (n < want_n and not spec["ignore_eos"] and stored and stored[-1] == EOS)):
            bad.append(f"{j}: done with {n} of {want_n} tokens, last {stored[-1:]}, ignore_eos={spec['ignore_eos']}")
        if EOS in stored[:-1] and not spec["ignore_eos"]:
            bad.append(f"{j}: EOS inside its result at {stored.index(EOS)}")
        if "result" in rec and rec["result"] != stored:
            bad.append(f"{j}: the client's result differs from the stored one")
        if "error" in rec:
            bad.append(f"{j}: done, but its client was told {rec['error']}")
        if "streamed" in rec and rec["streamed"] != stored:
            bad.append(f"{j}: streamed {len(rec['streamed'])} tokens (indices {rec['indices'][:8]}...), "
                       f"result {len(stored)}; first difference at {first_difference(rec['streamed'], stored)}")
    # Queues and indices hold only jobs that may still run.
    for key, ok in [(f"q:P{t}", {"queued"}) for t in range(4)] + [("inflight", {"dispatched"}),
                                                                    ("aging", {"queued"}),
                                                                    ("deadlines", {"queued"})]:
        for m in c.redis.zrange(f"ts:{{c}}:{key}", 0, -1):
            st = c.state(m.decode())
            if st not in ok:
                bad.append(f"{key} holds {m.decode()}, which is {st}")
    # Every admission counted once, across the gateways' lives.
    counted = sum(faults.admitted_before_kill.values()) + sum(summed(scrape(u), "ts_admissions_total")
                                                                for u in gw_metrics.values())
    if counted != len(in_redis):
        bad.append(f"gateways counted {counted} admissions; Redis holds {len(in_redis)} jobs "
                   f"(clients were given {len(jobs)})")

    def idle() -> bool:
        pages = [scrape(u) for u in wk_metrics.values()]
        return all(summed(p, "ts_kv_cache_usage_ratio") == 0 and summed(p, "ts_num_requests_running") == 0
                   and summed(p, "ts_num_requests_waiting") == 0 for p in pages)
    try:
        wait_for(idle, 30, "idle workers to hold no KV block", interval=0.5)
    except AssertionError as e:
        held = {n: {k: v for k, v in scrape(u).items() if v and ("kv_cache_usage" in k or "num_requests" in k)}
                for n, u in wk_metrics.items()}
        bad.append(f"{e}: {held}")
    # A sample of done jobs against a fresh run of the same request (seeded sampling is reproducible too).
    done = sorted(j for j in jobs if c.state(j) == "done")
    sample = [j for j in done if jobs[j]["spec"]["max_tokens"] <= 256][:12]
    fresh = fresh_tokens(model_dir, [jobs[j]["spec"] for j in sample])
    for j, want in zip(sample, fresh):
        got = c.stored_tokens(j)
        if got != want:
            bad.append(f"{j}: result differs from a fresh run from index {first_difference(got, want)}"
                       f" ({len(got)} vs {len(want)} tokens; spec {jobs[j]['spec'] | {'prompt_token_ids': '...'}})")
    return bad


def test_chaos_seeded_run_keeps_the_books(tmp_path, tiny_model_dir):
    gw_metrics = {f"gw-{i}": f"127.0.0.1:{free_port()}" for i in range(2)}
    wk_metrics = {f"wk-{i}": f"127.0.0.1:{free_port()}" for i in range(2)}
    process_env = {g: {"TS_GATEWAY_METRICS_BIND": b} for g, b in gw_metrics.items()} | \
                  {w: {"TS_WORKER_METRICS_BIND": b} for w, b in wk_metrics.items()}
    gw_urls = {g: f"http://{b}/metrics" for g, b in gw_metrics.items()}
    wk_urls = {w: f"http://{b}/metrics" for w, b in wk_metrics.items()}
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=2, max_running=3, lease_s=4.0,
                        process_env=process_env) as c:
        limits, most = limits_of(c)
        books, gate, stop = Books(), SubmitGate(), threading.Event()
        faults = Faults(c, gate, SEED, SPAN_S, gw_urls)
        clients = [SyncClient(c, books, gate, stop, SEED * 10 + i, limits, most, f"sync-{i}") for i in range(3)]
        clients.append(AsyncClients(c, books, gate, stop, SEED, limits, most, n=3))
        t0 = time.monotonic()
        for t in [faults, *clients]:
            t.start()
        faults.join(timeout=SPAN_S + 120)
        time.sleep(max(0.0, t0 + SPAN_S - time.monotonic()))
        stop.set()
        for t in clients:
            t.join(timeout=300)
        where = f"seed {SEED}, faults {faults.log}"
        assert not faults.is_alive() and faults.crashed is None, f"{where}: the fault schedule: {faults.crashed!r}"
        for t in clients:
            assert not t.is_alive(), f"{where}: client {t.name} still waits (a job that never finished?)"
            assert t.crashed is None, f"{where}: client {t.name}: {t.crashed!r}"
        for name in c.procs:
            assert c.alive(name), f"{where}: {name} exited: {c.log_tail(name)}"
        for gw in c.gateways:
            c.wait_workers(gw)
        bad = check_books(c, books, faults, gw_urls, wk_urls, tiny_model_dir)
        summary = (f"{len(books.jobs)} jobs, {len(books.refused)} refused, states "
                   f"{sorted({s: sum(c.state(j) == s for j in books.jobs) for s in TERMINAL}.items())}")
        print(f"chaos {where}: {summary}")
        assert not bad, f"{where}: {summary}\n" + "\n".join(bad[:40])
