"""Start a real local cluster (scripts/up.py: redis-server, gateways, workers) for integration tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` passes (then fail naming ``what``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@contextmanager
def local_cluster(tmp_path: Path, model_dir: Path, *, workers: int = 2, gateways: int = 1, max_running: int = 2,
                  aging_interval: float = 60.0, lease_s: float = 10.0, kv_blocks: int = 0,
                  env: dict[str, str] | None = None, http: bool = True):
    """``http=False``: no OpenAI-compatible front door (state["http"] is None), for tests that never use it: its
    process loads transformers and a tokenizer, about 3 s of CPU per cluster on a 2-core machine."""
    state_file = tmp_path / "cluster.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "up.py"), "--workers", str(workers), "--gateways", str(gateways),
           "--model", str(model_dir), "--state-file", str(state_file), "--max-running", str(max_running),
           "--aging-interval", str(aging_interval), "--lease-s", str(lease_s), "--ready-timeout", "90",
           "--logs-dir", str(tmp_path / "logs")]
    if kv_blocks:
        cmd += ["--kv-blocks", str(kv_blocks)]
    if not http:
        cmd.append("--no-http")
    log = (tmp_path / "up.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ) | (env or {}))
    try:
        wait_for(lambda: state_file.exists() or proc.poll() is not None, 120, "the cluster to start")
        if proc.poll() is not None:
            raise AssertionError(f"up.py exited {proc.returncode}: {(tmp_path / 'up.log').read_text()[-3000:]}")
        state = json.loads(state_file.read_text())
        state["redis_client"] = redis.Redis.from_url(state["redis"])
        state["state_file"] = state_file
        yield state
    finally:
        # The pids as they are now (the supervisor may have restarted some): up.py removes the file as it stops.
        st = json.loads(state_file.read_text()) if state_file.exists() else None
        stop_process(proc, timeout=30)
        log.close()
        if st is not None:
            assert not state_file.exists(), "a stopped cluster's state file was left to pass for a live one"
            for pid in [w["pid"] for w in st["workers"]] + st["gateway_pids"]:
                assert not process_running(pid), f"process {pid} left behind"
            # The keys, the Redis password and the tenants' API keys outlive no cluster; its logs stay for reading.
            assert not Path(st["keys"]["dir"]).parent.exists(), "the cluster's secrets were left behind"
            assert Path(st["logs"]) == tmp_path / "logs" and any(Path(st["logs"]).glob("gateway-*.log"))


@contextmanager
def frozen(*pids: int):
    """The processes stand still inside the block (SIGSTOP: a hung gateway, a long GC, a paused VM) and go on
    (SIGCONT) after it, however it ends: a failing test leaves none frozen for the cluster's stop to wait on."""
    stopped: list[int] = []
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        yield
    finally:
        for pid in reversed(stopped):
            os.kill(pid, signal.SIGCONT)


def stop_process(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout``; always reaped. Its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def stop_processes(procs: list[subprocess.Popen], timeout: float) -> None:
    """``stop_process`` for several at once: SIGTERM to all, then each gets what is left of one shared
    ``timeout`` before its SIGKILL; all reaped."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def process_running(pid: int) -> bool:
    """The process exists and is not a zombie (a dead child not yet reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        # The state follows the command name, which may hold spaces and parentheses.
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def job_hash(state: dict, job_id: str) -> dict[str, str]:
    raw = state["redis_client"].hgetall(f"{state['key_prefix']}:{{c}}:job:{job_id}")
    return {k.decode(): v.decode(errors="replace") for k, v in raw.items()}


def job_ids(state: dict) -> set[str]:
    """The ids of every job hash in Redis (a refusal adds none)."""
    prefix = f"{state['key_prefix']}:{{c}}:job:"
    return {k.decode()[len(prefix):] for k in state["redis_client"].scan_iter(match=prefix + "*", count=1000)}


def state_pids(state: dict) -> dict[str, int]:
    """up.py's current pids, as its supervisor rewrites them in the state file."""
    return json.loads(state["state_file"].read_text())["pids"]


def snapshot(state: dict) -> dict[bytes, bytes]:
    """Every key of the cluster with a dump of its value: to prove a refusal changed nothing.

    The lease set is left out: worker heartbeats move running jobs' lease expiries all the time.
    """
    r = state["redis_client"]
    keys = sorted(r.scan_iter(match=f"{state['key_prefix']}:*".encode(), count=1000))
    return {k: r.dump(k) for k in keys if not k.endswith(b":inflight")}


def assert_unchanged(before: dict[bytes, bytes], after: dict[bytes, bytes]) -> None:
    """``after`` is ``before``, except that a P0 quota bucket may have expired meanwhile: its TTL is the time
    it takes to refill, so an expired bucket is a full one, never a charge."""
    expired = {k for k in before.keys() - after.keys() if b":quota:" in k}
    assert after == {k: v for k, v in before.items() if k not in expired}
