"""The gateways' counts checked against the books (the jobs' records in Redis, the refusals the clients were told),
after a mixed run on a real two-gateway cluster: every tier, jobs done, cancelled queued and running, expired in
their queue, refused for quota, for a tier not entitled and for an unknown key, a worker killed -9 mid-job (its job
re-dispatched) and a gateway killed -9 and started again. Summed over the gateways (the killed one's last page
before its death added: a dashboard's increase() sees its restart as a counter reset), per tier:
admitted == finished by state + still unfinished, each refusal counted once by its code, one queue wait per
dispatch attempt, one time to first token per job that produced one, one end-to-end latency per job done."""

from __future__ import annotations

import collections
import os
import signal
import time

import pytest

from common.errors import Forbidden, Overloaded, QuotaExceeded, ServingError, Unauthorized
from common.ports import free_port
from gateway.sdk import GatewayClient
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster, wait_states
from tests.test_metrics import scrape, total

pytestmark = pytest.mark.faults  # kills a gateway and a worker (kill -9)

FINAL = {"done", "failed", "expired", "cancelled", "dead"}
CODES = {QuotaExceeded: "quota_exceeded", Overloaded: "overloaded", Unauthorized: "unauthorized",
         Forbidden: "forbidden"}
NAMES = ("ts_admissions_total", "ts_refusals_total", "ts_jobs_finished_total", "ts_queue_wait_seconds_count",
         "ts_time_to_first_token_seconds_count", "ts_request_e2e_latency_seconds_count")


def books(pages: list[dict]) -> collections.Counter:
    """Every sample of NAMES, summed over ``pages``: {(name, sorted labels): value}."""
    out: collections.Counter = collections.Counter()
    for page in pages:
        for name in NAMES:
            for labels, v in page.get(name, {}).items():
                out[(name, labels)] += v
    return out


class Run:
    """The jobs submitted and the refusals told, as the clients saw them."""

    def __init__(self, c: DurableCluster) -> None:
        self.c, self.jobs, self.refused = c, [], collections.Counter()

    def submit(self, client: GatewayClient, **kw):
        try:
            job = client.submit(**kw)
        except ServingError as e:
            self.refused[CODES[type(e)]] += 1
            return None
        self.jobs.append(job.id)
        return job


def test_the_counts_match_the_books_after_a_mixed_run(tmp_path, tiny_model_dir):
    binds = {g: f"127.0.0.1:{free_port()}" for g in ("gw-0", "gw-1")}
    env = {"TS_GATEWAY_TIER_TIMEOUTS_S": '{"P0": 30, "P1": 60, "P2": 3}', "TS_GATEWAY_MAX_ATTEMPTS": "3"}
    urls = {g: f"http://{b}/metrics" for g, b in binds.items()}
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=1, max_running=2, lease_s=2.0,
                        gateway_env=env, process_env={g: {"TS_GATEWAY_METRICS_BIND": b}
                                                      for g, b in binds.items()}) as c:
        run = Run(c)
        start = books([scrape(u) for u in urls.values()])
        ends = [c.endpoint("gw-0"), c.endpoint("gw-1")]
        tenants = {t: GatewayClient(ends, c.key(t), timeout_s=30.0, retries=0)
                   for t in ("chat-co", "api-co", "batch-co", "lab-co")}
        chat, api, batch, lab = tenants.values()
        stranger = GatewayClient(ends, "nobody-knows-this-key", timeout_s=30.0, retries=0)
        try:
            # Every tier, a P0 burst past its quota (burst 4), a tier not entitled, an unknown key.
            for i in range(6):
                run.submit(chat, prompt_token_ids=[3, i + 4], max_tokens=4, tier="P0", seed=i)
            run.submit(api, prompt_token_ids=[5, 6], max_tokens=4, tier="P1")
            run.submit(api, prompt_token_ids=[5, 6], max_tokens=4, tier="P0")
            run.submit(batch, prompt_token_ids=[7, 8], max_tokens=4, tier="P2")
            run.submit(stranger, prompt_token_ids=[1], max_tokens=1, tier="P3")
            cancelled = run.submit(lab, prompt_token_ids=[9, 10], max_tokens=200, ignore_eos=True, tier="P3")
            cancelled.cancel()
            wait_states(c, list(run.jobs), FINAL, 120)
            # Two long jobs hold both slots, and the worker stands still: their leases run out meanwhile (a
            # re-dispatch), and a P2 job waits out its timeout. Long: 400 tokens ran in about a second, and a test
            # process held up that long between seeing them stream and stopping the worker stopped an idle one.
            long = [run.submit(lab, prompt_token_ids=[11, i], max_tokens=2000, ignore_eos=True, tier="P3", seed=i)
                    for i in range(2)]

            def both_streaming() -> bool:
                states = [c.state(j.id) for j in long]
                assert not FINAL & set(states), f"a long job ended before both were seen streaming: {states}"
                return all(s == "dispatched" and c.job(j.id).get("first_token_ms") for s, j in zip(states, long))

            wait_for(both_streaming, 60, "both long jobs to stream")
            os.kill(c.procs["wk-0"].pid, signal.SIGSTOP)
            try:
                # The P2 job comes once both gateways have timed the worker out: then none can send it there (a
                # slot its last report left free, were it a job short), and no wait estimate refuses it (one of
                # the long jobs' rest passed its timeout on a loaded machine).
                with c.client("batch-co", "gw-1", timeout_s=30.0) as via_gw1:
                    wait_for(lambda: not batch.info().workers and not via_gw1.info().workers, 30,
                             "both gateways to time the stopped worker out")
                expiring = run.submit(batch, prompt_token_ids=[12], max_tokens=2, tier="P2")
                queued = run.submit(batch, prompt_token_ids=[13], max_tokens=3, tier="P3")
                assert expiring is not None, f"the P2 job was refused: {dict(run.refused)}"

                def p2_expired() -> bool:
                    state = c.state(expiring.id)
                    assert state in ("queued", "expired"), f"the P2 job left its queue otherwise: {c.job(expiring.id)}"
                    return state == "expired"

                wait_for(p2_expired, 30, "the P2 job to wait out its queue timeout")
                # gw-0 killed -9 and started again while the worker stands still: nothing is in flight there.
                last = scrape(urls["gw-0"])
                c.kill("gw-0")
                c.restart("gw-0")
            finally:
                os.kill(c.procs["wk-0"].pid, signal.SIGCONT)
            c.wait_workers("gw-0")
            # The worker killed -9 mid-job: its jobs' leases run out, and they run again on its next process.
            c.kill("wk-0")
            c.restart("wk-0")
            long[0].cancel()
            wait_states(c, list(run.jobs), FINAL, 180)
            assert c.state(queued.id) == "done"
            time.sleep(1.0)  # a token-log flush: every first token claimed
            now = books([last] + [scrape(u) for u in urls.values()])
        finally:
            for cl in [*tenants.values(), stranger]:
                cl.close()
        records = {j: c.job(j) for j in run.jobs}
    got = now - start
    got = collections.Counter({k: v for k, v in got.items() if v})
    want: collections.Counter = collections.Counter()
    for rec in records.values():
        tier, state = rec["tier_granted"].decode(), rec["state"].decode()
        want[("ts_admissions_total", (("tier", tier),))] += 1
        want[("ts_jobs_finished_total", (("state", state), ("tier", tier)))] += 1
        want[("ts_queue_wait_seconds_count", (("tier", tier),))] += int(rec.get("attempt", b"0"))
        if rec.get("first_token_ms") or float(rec.get("ttft_s", b"-1")) >= 0:
            want[("ts_time_to_first_token_seconds_count", (("tier", tier),))] += 1
        if state == "done":
            want[("ts_request_e2e_latency_seconds_count", (("tier", tier),))] += 1
    for code, n in run.refused.items():
        want[("ts_refusals_total", (("code", code),))] += n
    assert run.refused["quota_exceeded"] >= 1 and run.refused["forbidden"] == 1
    assert {r["state"] for r in records.values()} >= {b"done", b"cancelled", b"expired"}
    assert max(int(r["attempt"]) for r in records.values()) >= 2, "nothing was re-dispatched"
    assert got == want, {"counted": dict(got - want), "not counted": dict(want - got)}
