"""The compose deployment's HTTP front door, Prometheus and Grafana, checked without a Docker engine:
the services and their settings, the scrape configuration (docker/prometheus/prometheus.yml, also run
for real by tests/test_prometheus.py) and the provisioned dashboard (docker/grafana/)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from common import settings
from gateway.http.config import ENV_PREFIX as HTTP_PREFIX
from gateway.http.config import HttpConfig
from tests.compose_helpers import published_targets, service_env

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS_FILE = ROOT / "docker" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "docker" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "tiered-serve.json"

# What serves /metrics where, on the compose network: job name -> (services, port).
SCRAPED = {"gateway": (("gateway",), 9101), "http": (("http",), 8000), "worker": (("worker", "worker-cpu"), 9102)}


def scrape_config() -> dict:
    return yaml.safe_load(PROMETHEUS_FILE.read_text())


def defined_metric_names() -> set[str]:
    """Every ts_* family the processes define (as written in their metrics modules)."""
    names = set()
    for module in ("gateway/metrics.py", "worker/metrics.py", "gateway/http/metrics.py"):
        names |= set(re.findall(r'"(ts_[a-z0-9_]+)"', (ROOT / module).read_text()))
    return {n.removesuffix("_total") for n in names}


def test_http_service(compose, env_example):
    services = compose["services"]
    http = services["http"]
    assert http["image"] == services["gateway"]["image"], "the front door runs in the gateway's image"
    assert http["entrypoint"] == ["python", "-m", "gateway.http"]
    assert http["depends_on"]["gateway"]["condition"] == "service_healthy"
    assert 8000 in published_targets(http)
    env = service_env(http)
    ours = {k: v for k, v in env.items() if k.startswith(HTTP_PREFIX)}
    fields = set(HttpConfig.__dataclass_fields__)
    assert {k[len(HTTP_PREFIX):].lower() for k in ours} <= fields
    config = settings.load(HttpConfig, None, HTTP_PREFIX, environ=ours)
    assert (config.host, config.port) == ("0.0.0.0", 8000)
    assert config.gateways == ["tcp://gateway:5555"]
    assert config.tokenizer == env_example["MODEL"] == service_env(services["gateway"])["TS_GATEWAY_TOKENIZER"]
    assert http["healthcheck"]["test"][:3] == ["CMD", "python", "-c"]


def test_every_process_serves_metrics_where_prometheus_scrapes(compose):
    services = compose["services"]
    binds = {"gateway": service_env(services["gateway"])["TS_GATEWAY_METRICS_BIND"],
             "worker": service_env(services["worker"])["TS_WORKER_METRICS_BIND"],
             "worker-cpu": service_env(services["worker-cpu"])["TS_WORKER_METRICS_BIND"],
             "http": "0.0.0.0:" + service_env(services["http"])["TS_HTTP_PORT"]}
    jobs = {j["job_name"]: j for j in scrape_config()["scrape_configs"]}
    assert set(jobs) == set(SCRAPED)
    for job, (names, port) in SCRAPED.items():
        for name in names:
            assert binds[name] == f"0.0.0.0:{port}", name  # on all interfaces: scraped from another container
        cfg = jobs[job]
        targets = [t for s in cfg.get("static_configs", []) for t in s["targets"]]
        targets += [f"{n}:{d['port']}" for d in cfg.get("dns_sd_configs", []) for n in d["names"]]
        assert sorted(targets) == sorted(f"{n}:{port}" for n in names), (job, targets)
    # Scaled workers have no fixed address: found by DNS, every container of the service.
    assert jobs["worker"]["dns_sd_configs"][0]["type"] == "A"


def test_prometheus_and_grafana_services(compose):
    services = compose["services"]
    prom, graf = services["prometheus"], services["grafana"]
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", prom["image"]), prom["image"]
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", graf["image"]), graf["image"]
    prom_mounts = {m["target"]: m for m in _mounts(prom)}
    assert (ROOT / prom_mounts["/etc/prometheus/prometheus.yml"]["source"]).resolve() == PROMETHEUS_FILE
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    graf_mounts = {m["target"]: m for m in _mounts(graf)}
    assert (ROOT / graf_mounts["/etc/grafana/provisioning"]["source"]).resolve() == GRAFANA / "provisioning"
    dashboards_dir = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "tiered-serve.yml").read_text())
    path = dashboards_dir["providers"][0]["options"]["path"]
    assert (ROOT / graf_mounts[path]["source"]).resolve() == DASHBOARD.parent
    # Both UIs lack authentication by default or hold an admin password: loopback unless opened.
    assert all(str(p).startswith("127.0.0.1:") for p in prom["ports"] + graf["ports"]), prom["ports"] + graf["ports"]
    assert service_env(graf)["GF_SECURITY_ADMIN_PASSWORD"]


def test_scrape_config_passes_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    done = subprocess.run([promtool, "check", "config", str(PROMETHEUS_FILE)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dashboard_shows_what_operators_asked_for():
    dash = json.loads(DASHBOARD.read_text())
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (ds,) = datasource["datasources"]
    assert ds["url"] == "http://prometheus:9090" and ds["type"] == "prometheus"
    exprs = {}
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == ds["uid"]
        for t in panel["targets"]:
            assert t["datasource"]["uid"] == ds["uid"]
            exprs.setdefault(panel["title"], []).append(t["expr"])
    joined = {title: " ".join(e) for title, e in exprs.items()}

    def panel_with(*needles: str) -> str:
        hits = [t for t, e in joined.items() if all(n in e for n in needles)]
        assert hits, needles
        return hits[0]

    panel_with("ts_queue_depth", "by (tier)")
    panel_with("histogram_quantile(0.99", "ts_time_to_first_token_seconds_bucket", "tier")
    panel_with("ts_preemptions_total", "by (mode)")
    panel_with("ts_preempt_wasted_tokens_total")
    panel_with("ts_kv_cache_usage_ratio")
    panel_with("ts_dispatch_handoff_seconds_bucket", "worker_state")
    panel_with("ts_dispatch_linger_total", "by (outcome)")
    # Every metric a panel reads is one the processes define.
    used = {re.sub(r"_(bucket|count|sum|total)$", "", n) for e in joined.values() for n in re.findall(r"ts_\w+", e)}
    assert used <= defined_metric_names(), used - defined_metric_names()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def _mounts(svc: dict) -> list[dict]:
    out = []
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            source, target, *mode = v.split(":")
            out.append({"source": source, "target": target, "read_only": mode == ["ro"]})
        else:
            out.append(v)
    return out
