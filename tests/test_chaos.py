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

import pytest

from tests.chaos_books import TERMINAL, Books, check_books, first_difference, jobs_in_redis, scrape, summed
from tests.chaos_helpers import AsyncClients, Faults, SubmitGate, SyncClient, limits_of, metrics_env
from tests.durable_cluster import DurableCluster

pytestmark = pytest.mark.faults

SEED = int(os.environ.get("CHAOS_SEED", "20240607"))
SPAN_S = float(os.environ.get("CHAOS_SPAN_S", "45"))  # longer for a deeper run: CHAOS_SPAN_S=600


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


def chaos_problems(c: DurableCluster, books: Books, faults: Faults, gw_metrics: dict, model_dir) -> list[str]:
    """Beyond the books every faulted run keeps (check_books): the gateways counted every admission, across their
    lives, and a sample of done jobs is what a fresh engine makes for the same request."""
    bad = []
    in_redis = jobs_in_redis(c)
    counted = sum(faults.admitted_before_kill.values()) + sum(summed(scrape(u), "ts_admissions_total")
                                                                for u in gw_metrics.values())
    if counted != len(in_redis):
        bad.append(f"gateways counted {counted} admissions; Redis holds {len(in_redis)} jobs "
                   f"(clients were given {len(books.jobs)})")
    # Seeded sampling is reproducible too.
    jobs = books.jobs
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
    gw_env, gw_urls = metrics_env(["gw-0", "gw-1"])
    wk_env, wk_urls = metrics_env(["wk-0", "wk-1"])
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=2, max_running=3, lease_s=4.0,
                        process_env=gw_env | wk_env) as c:
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
        # Clients cancel, and P0/P1 jobs have queue timeouts: cancelled and expired are rightful ends here.
        bad = check_books(c, books, wait_s=180, ends=("done", "cancelled", "expired"), wk_metrics=wk_urls)
        bad += chaos_problems(c, books, faults, gw_urls, tiny_model_dir)
        summary = (f"{len(books.jobs)} jobs, {len(books.refused)} refused, states "
                   f"{sorted({s: sum(c.state(j) == s for j in books.jobs) for s in TERMINAL}.items())}")
        print(f"chaos {where}: {summary}")
        assert not bad, f"{where}: {summary}\n" + "\n".join(bad[:40])
