"""Prometheus metrics of every process of a real local cluster, parsed with prometheus_client's own
parser, moving as a workload runs: counted things are counted exactly (admissions per tier, tokens,
refusals), and a preempting workload raises ts_preemptions_total."""

from __future__ import annotations

import json
import shutil
import subprocess
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.ports import free_port
from gateway.sdk import GatewayClient
from tests.cluster_helpers import ROOT, local_cluster, wait_for

GATEWAY_NAMES = {"ts_queue_depth": "gauge", "ts_admissions": "counter", "ts_refusals": "counter",
                 "ts_queue_wait_seconds": "histogram", "ts_time_to_first_token_seconds": "histogram",
                 "ts_request_e2e_latency_seconds": "histogram"}
WORKER_NAMES = {"ts_preemptions": "counter", "ts_preempt_recover": "counter", "ts_preempt_wasted_tokens": "counter",
                "ts_request_preempt_wait_seconds": "histogram", "ts_kv_cache_usage_ratio": "gauge",
                "ts_num_requests_running": "gauge", "ts_num_requests_waiting": "gauge",
                "ts_prompt_tokens": "counter", "ts_generation_tokens": "counter"}


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}} for one /metrics page, and the families' types."""
    r = httpx.get(url, timeout=30)
    assert r.status_code == 200
    out: dict[str, dict[tuple, float]] = {"__types__": {}}
    for family in text_string_to_metric_families(r.text):
        out["__types__"][(family.name,)] = family.type
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(page: dict, name: str, **labels) -> float:
    return page.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


def total(page: dict, name: str, **labels) -> float:
    """Summed over the samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for k, v in page.get(name, {}).items() if want <= set(k))


@pytest.fixture(scope="module")
def cluster(bench_model_dir, tmp_path_factory):
    # One worker, two batch slots, a small KV pool: urgent work must preempt. The bench model, not the tiny one:
    # the tiny one runs two 120-token jobs in about 0.15 s when nothing scrapes it, so a poll could miss them both
    # running (it did, in CI) and the P0 jobs could arrive after them and preempt nothing.
    with local_cluster(tmp_path_factory.mktemp("metrics"), bench_model_dir, workers=1, max_running=2,
                       kv_blocks=24) as c:
        yield c


def pages(c: dict) -> tuple[dict, dict, dict]:
    gateway, worker, http = c["metrics"]
    return scrape(gateway), scrape(worker), scrape(http)


def test_every_process_serves_the_named_metrics(cluster):
    assert len(cluster["metrics"]) == 3  # gateway, worker, front door
    gw, wk, http = pages(cluster)
    for page, names in ((gw, GATEWAY_NAMES), (wk, WORKER_NAMES)):
        for name, kind in names.items():
            assert page["__types__"].get((name,)) == kind, (name, page["__types__"].get((name,)))
    for tier in ("P0", "P1", "P2", "P3"):
        assert ("tier", tier) in {k[0] for k in gw["ts_queue_depth"]}
        assert ("tier", tier) in {k[0] for k in wk["ts_num_requests_running"]}
    assert value(gw, "ts_workers_registered") == 1
    assert "ts_http_requests_total" in http
    assert "process_cpu_seconds_total" in wk  # the standard process metrics come with every endpoint


def test_counts_move_exactly_with_the_workload(cluster):
    gw0, wk0, _ = pages(cluster)
    preempting_workload(cluster)
    from common.errors import Unauthorized

    with pytest.raises(Unauthorized), GatewayClient(cluster["gateway"], "stranger") as stranger:
        stranger.submit(prompt_token_ids=[1], max_tokens=1)
    gw1, wk1, _ = pages(cluster)

    def delta(before, after, name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta(gw0, gw1, "ts_admissions_total", tier="P0") == 2
    assert delta(gw0, gw1, "ts_admissions_total", tier="P3") == 2
    assert delta(gw0, gw1, "ts_refusals_total", code="unauthorized") == 1
    for name in ("ts_queue_wait_seconds_count", "ts_time_to_first_token_seconds_count",
                 "ts_request_e2e_latency_seconds_count"):
        assert delta(gw0, gw1, name, tier="P0") == 2, name
        assert delta(gw0, gw1, name, tier="P3") == 2, name
    # Each job's first prefill start is reported once, whichever worker ran it.
    assert delta(gw0, gw1, "ts_dispatch_handoff_seconds_count") == 4
    # Every token is counted once, preempted or not: ignore_eos makes each job produce exactly max_tokens.
    assert delta(wk0, wk1, "ts_generation_tokens_total") == 2 * 120 + 2 * 10
    assert delta(wk0, wk1, "ts_prompt_tokens_total") == 2 * 3 + 2 * 2
    assert delta(wk0, wk1, "ts_requests_finished_total", tier="P0", reason="length") == 2
    # The P0 jobs found both slots taken by P3 work: they preempted it, and the victims came back.
    preempted = delta(wk0, wk1, "ts_preemptions_total", victim_tier="P3")
    assert preempted >= 1
    # Every suspension ended in a resume (a kept request that later gave its blocks up counts as a second
    # preemption of the same suspension, so resumes may be fewer).
    assert 1 <= delta(wk0, wk1, "ts_preempt_recover_total") <= preempted
    assert delta(wk0, wk1, "ts_request_preempt_wait_seconds_count", tier="P3") == delta(
        wk0, wk1, "ts_preempt_recover_total")
    # Everything ended: nothing runs, nothing waits, no KV block is held.
    wait_for(lambda: value(scrape(cluster["metrics"][1]), "ts_kv_cache_usage_ratio") == 0, 30, "KV blocks freed")
    wk2 = scrape(cluster["metrics"][1])
    assert total(wk2, "ts_num_requests_running") == 0 and total(wk2, "ts_num_requests_waiting") == 0
    assert total(gw1, "ts_queue_depth") == 0



def test_queue_wait_is_the_wait_in_redis(cluster):
    """ts_queue_wait_seconds observes each dispatch's wait since admission. It was fed the gateway's monotonic
    loop clock less a Unix time (negative, floored to 0): every wait was observed as 0 s."""
    from tests.cluster_helpers import job_hash

    gw0 = scrape(cluster["metrics"][0])
    with GatewayClient(cluster["gateway"], cluster["tenants"]["lab-co"]["api_key"]) as lab:
        # Two slots, three jobs: the third waits in Redis until one of the first two ends.
        jobs = [lab.submit(prompt_token_ids=[3, 4, i], max_tokens=120, ignore_eos=True, seed=i) for i in range(3)]
        for j in jobs:
            j.result(timeout=120)
    gw1 = scrape(cluster["metrics"][0])
    waits = []
    for j in jobs:
        h = job_hash(cluster, j.id)
        assert h["attempt"] == "1", h
        waits.append((int(h["dispatched_at_ms"]) - int(h["enqueued_at_ms"])) / 1e3)
    assert max(waits) > 0.05, waits  # one really waited, or nothing was tested
    observed = total(gw1, "ts_queue_wait_seconds_sum", tier="P3") - total(gw0, "ts_queue_wait_seconds_sum", tier="P3")
    assert observed == pytest.approx(sum(waits), abs=0.005), (observed, waits)

# -- a real Prometheus server with the compose deployment's scrape configuration ---------------------------------


def local_scrape_config(c: dict, storage) -> dict:
    """docker/prometheus/prometheus.yml with each job's targets replaced by this cluster's processes."""
    import yaml

    config = yaml.safe_load((ROOT / "docker" / "prometheus" / "prometheus.yml").read_text())
    urls = [urlsplit(u) for u in c["metrics"]]
    n_gw, n_wk = len(c["gateways"]), len(c["workers"])
    local = {"gateway": urls[:n_gw], "worker": urls[n_gw:n_gw + n_wk], "http": urls[n_gw + n_wk:]}
    assert {j["job_name"] for j in config["scrape_configs"]} == set(local)
    for job in config["scrape_configs"]:
        for key in ("static_configs", "dns_sd_configs"):
            job.pop(key, None)
        job["static_configs"] = [{"targets": [u.netloc for u in local[job["job_name"]]]}]
        assert {u.path for u in local[job["job_name"]]} == {job.get("metrics_path", "/metrics")}
    return config


def test_a_real_prometheus_scrapes_every_process(cluster, tmp_path):
    import yaml

    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary (Debian: apt-get install prometheus; .ci/run installs it)")
    config = local_scrape_config(cluster, tmp_path)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api/v1"

    def query(promql: str) -> list:
        r = httpx.get(api + "/query", params={"query": promql}, timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "success", r.text
        return r.json()["data"]["result"]

    def ready() -> bool:
        assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
        try:
            return httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, 60, "prometheus to start", interval=0.2)
        # Every target of every job is up.
        expected = {j["job_name"]: len(j["static_configs"][0]["targets"]) for j in config["scrape_configs"]}

        def all_up() -> bool:
            up = query("up")
            by_job = {}
            for s in up:
                if s["value"][1] == "1":
                    by_job[s["metric"]["job"]] = by_job.get(s["metric"]["job"], 0) + 1
            return by_job == expected

        wait_for(all_up, 90, "every target up", interval=1)
        wait_for(lambda: query("ts_preemptions_total"), 60, "a first scrape of the worker", interval=1)
        before = sum(float(s["value"][1]) for s in query("sum(ts_preemptions_total)"))
        preempting_workload(cluster)
        wait_for(lambda: sum(float(s["value"][1]) for s in query("sum(ts_preemptions_total)")) > before, 90,
                 "PromQL to see the preemption counter move", interval=1)
        # Every query of the provisioned Grafana dashboard is valid PromQL with data behind it.
        dash = json.loads((ROOT / "docker" / "grafana" / "dashboards" / "tiered-serve.json").read_text())
        for panel in dash["panels"]:
            for t in panel["targets"]:
                query(t["expr"].replace("$__rate_interval", "1m"))
        assert query("max by (tier) (ts_queue_depth)")
        assert query("ts_kv_cache_usage_ratio")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def preempting_workload(c: dict) -> None:
    """Two long P3 jobs fill both slots, then two P0 jobs must preempt them; all run to the end."""
    chat, lab = (GatewayClient(c["gateway"], c["tenants"][t]["api_key"]) for t in ("chat-co", "lab-co"))
    try:
        low = [lab.submit(prompt_token_ids=[3, 4, 5], max_tokens=120, ignore_eos=True, seed=i) for i in range(2)]

        def both_running() -> bool:
            if total(scrape(c["metrics"][1]), "ts_num_requests_running", tier="P3") == 2:
                return True
            # Ended before they were seen together: the workload preempts nothing; say so now, not in 60 s.
            ended = [j.id for j in low if j.status().state not in ("queued", "dispatched")]
            assert not ended, f"P3 jobs {ended} ended before both were seen running: the model is too fast"
            return False

        wait_for(both_running, 60, "the worker to run both P3 jobs")
        urgent = [chat.submit(prompt_token_ids=[6, 7], max_tokens=10, ignore_eos=True, tier="P0", seed=i)
                  for i in range(2)]
        for j in urgent + low:
            j.result(timeout=120)
    finally:
        chat.close()
        lab.close()
