"""scripts/up.py as a supervisor: a kill -9'd redis-server, gateway or worker comes back with the same
identity, ports and data, the state file's pids follow, and a crash loop backs off."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import ServingError
from gateway.sdk import GatewayClient
from scripts import supervisor as sv
from tests.cluster_helpers import local_cluster, process_running, state_pids, wait_for


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("supervised")
    with local_cluster(tmp, tiny_model_dir, workers=1, gateways=2) as state:
        state["up_log"] = tmp / "up.log"
        yield state


def serves_a_job(state: dict, endpoint: str) -> bool:
    """A job admitted, run and finished end to end through ``endpoint``."""
    try:
        with GatewayClient(endpoint, state["tenants"]["lab-co"]["api_key"], timeout_s=5, retries=0) as c:
            return len(c.submit(prompt_token_ids=[3, 4], max_tokens=3, ignore_eos=True).result(timeout=30)
                       .token_ids) == 3
    except (ServingError, TimeoutError):
        return False


def test_the_state_file_names_every_process(cluster):
    p = state_pids(cluster)
    assert set(p) == {"redis", "gw-0", "gw-1", "wk-0", "http"}  # http: the front door up.py starts
    assert all(process_running(pid) for pid in p.values())
    st = json.loads(cluster["state_file"].read_text())
    assert st["gateway_pids"] == [p["gw-0"], p["gw-1"]] and st["workers"] == [{"id": "wk-0", "pid": p["wk-0"]}]


def test_the_secrets_are_apart_from_the_logs_and_private(cluster):
    """Keys, the Redis password and the tenants' API keys sit in a folder of their own, readable by the owner
    only, which stop() removes (local_cluster checks that); the logs folder, kept, holds none of them."""
    secrets_dir = Path(cluster["keys"]["dir"]).parent
    assert secrets_dir.stat().st_mode & 0o777 == 0o700
    # leftovers.jsonl: the paths a later run removes should this one die with its leftovers helper
    assert {p.name for p in secrets_dir.iterdir()} == {"keys", "redis-password", "tenants.toml", "leftovers.jsonl"}
    logs = Path(cluster["logs"])
    assert secrets_dir != logs and not any(p.name in ("keys", "redis-password", "tenants.toml") for p in logs.iterdir())
    password = (secrets_dir / "redis-password").read_text()
    for log in logs.glob("*.log"):
        assert password not in log.read_text()


@pytest.mark.parametrize("name", ["gw-0", "wk-0", "redis"])
def test_a_kill_9d_process_comes_back_as_itself(cluster, name):
    r = cluster["redis_client"]
    marker = f"{cluster['key_prefix']}:test-marker:{name}"
    r.set(marker, name)  # in the AOF once SET has answered (appendfsync everysec writes before replying)
    old = state_pids(cluster)
    os.kill(old[name], signal.SIGKILL)
    new = wait_for(lambda: (p := state_pids(cluster))[name] != old[name] and p, 60, f"{name} to be restarted")
    assert process_running(new[name])
    log = cluster["up_log"].read_text()
    # Restarted at once (a first death gets no backoff pause), and said so.
    assert f"{name} (pid {old[name]}) exited with code -9; restarting\n" in log
    assert f"{name} restarted as pid {new[name]}" in log
    # Same ports and identity: gw-0 answers on its endpoint under its id, wk-0 registers under its id,
    # Redis answers on its URL with what it held.
    ep0 = cluster["gateways"][0]["endpoint"]
    wait_for(lambda: serves_a_job(cluster, ep0), 120, f"the cluster to serve through gw-0 after {name} restarted")
    # A restarted gateway learns its workers from their periodic hello (every few seconds), and gw-1
    # may have served the job meanwhile: wait for wk-0 to be registered at gw-0 again.
    with GatewayClient(ep0, cluster["tenants"]["lab-co"]["api_key"]) as c:
        info = wait_for(lambda: (i := c.info()).workers == ["wk-0"] and i, 60, "wk-0 to register at gw-0")
    assert info.gateway_id == "gw-0" and info.workers == ["wk-0"]
    assert r.get(marker) == name.encode()
    # Every other process kept running as it was.
    assert {k: v for k, v in new.items() if k != name} == {k: v for k, v in old.items() if k != name} or name == "redis"


def test_a_crash_loop_backs_off_and_a_stable_process_restarts_at_once(tmp_path):
    now = [0.0]
    starts: list[float] = []

    def crashing():
        p = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        p.wait()  # dead before the supervisor looks
        starts.append(now[0])
        return p

    log = io.StringIO()
    changes: list[dict] = []
    sup = sv.Supervisor(changes.append, log=log, clock=lambda: now[0])
    sup.add("crashy", crashing(), crashing)
    while now[0] < 120:
        sup.check()
        now[0] = round(now[0] + 0.1, 1)
    gaps = [round(b - a, 1) for a, b in zip(starts, starts[1:])]
    # At once, then 0.5 s doubling up to the 30 s cap (plus the 0.1 s tick that notices the exit): no spin.
    pauses = [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert len(gaps) >= len(pauses), gaps
    assert all(p <= g <= p + 0.1 for p, g in zip(pauses, gaps)), gaps
    assert len(changes) == len(starts) - 1 and sup.restarts()["crashy"] == len(starts) - 1
    assert "exited with code 3; restarting in 30.0s" in log.getvalue()

    # A process that ran for longer than STABLE_S before dying is restarted at once again.
    long_lived = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    spawned = []

    def start_long():
        spawned.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
        return spawned[-1]

    sup2 = sv.Supervisor(changes.append, log=log, clock=lambda: now[0])
    sup2.add("steady", long_lived, start_long)
    try:
        now[0] += sv.STABLE_S + 1
        long_lived.kill()
        long_lived.wait()
        sup2.check()
        assert len(spawned) == 1 and sup2.pids()["steady"] == spawned[0].pid
    finally:
        for p in spawned:
            p.kill()
            p.wait()
