"""scripts/up.py's own life: what a signal or a kill -9 of the launcher leaves behind. Real processes: up.py,
redis-server, a gateway, a worker and the front door on the tiny model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster_helpers import ROOT, process_running, wait_for

pytestmark = pytest.mark.faults


def up(tmp_path: Path, model_dir: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    state_file = tmp_path / "cluster.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "up.py"), "--workers", "1", "--model", str(model_dir),
           "--state-file", str(state_file), "--max-running", "2", "--logs-dir", str(tmp_path / "logs"), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=(tmp_path / "up.log").open("w"), stderr=subprocess.STDOUT), state_file


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def reap_orphans(pids: list[int]) -> None:
    """A failing run must not leave its cluster running on a shared machine."""
    for pid in pids:
        if process_running(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_kill_9d_launcher_takes_its_cluster_with_it(tmp_path, tiny_model_dir):
    # The children run in sessions of their own (a Ctrl-C reaches up.py alone, which stops them in order), so
    # nothing stopped them when up.py itself died: redis-server, the gateway, the worker and the front door ran
    # on, orphaned, holding their ports and CPU.
    proc, state_file = up(tmp_path, tiny_model_dir)
    pids: list[int] = []
    leftovers: list[Path] = []
    try:
        wait_for(lambda: state_file.exists() or proc.poll() is not None, 120, "the cluster to start")
        assert proc.poll() is None, (tmp_path / "up.log").read_text()
        st = json.loads(state_file.read_text())
        pids = list(st["pids"].values())
        assert len(pids) == 4 and all(process_running(p) for p in pids)
        # Key material on disk: the CURVE keys and API keys, and Redis's folder (its password, the jobs' AOF).
        leftovers += [Path(st["keys"]["dir"]).parent, Path(os.readlink(f"/proc/{st['pids']['redis']}/cwd"))]
        assert all(p.is_dir() for p in leftovers) and any(leftovers[0].rglob("*.key_secret"))
        proc.kill()
        proc.wait()
        wait_for(lambda: not any(process_running(p) for p in pids), 30, "every process of the cluster to exit")
        # up.py could remove nothing itself: its secrets stayed readable on disk, and its state file passed
        # for a running cluster's.
        wait_for(lambda: not state_file.exists() and not any(p.exists() for p in leftovers), 30,
                 f"the state file and {leftovers} to be removed")
    finally:
        proc.kill()
        proc.wait()
        reap_orphans(pids)
        for d in leftovers:  # a failing run must not leave keys behind
            shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_start_up_stops_the_launcher_at_once(tmp_path, tiny_model_dir, signum):
    # A signal only set a flag that the supervision loop reads, and start-up waits for every worker to register
    # first: a Ctrl-C while a worker could not register (here: stopped) was ignored for --ready-timeout.
    state_file = tmp_path / "cluster.json"
    state_file.write_text(json.dumps({"gateway": "tcp://127.0.0.1:9", "pids": {}}))  # a killed run's leftover
    proc, _ = up(tmp_path, tiny_model_dir, "--ready-timeout", "300")
    seen: list[int] = []
    try:
        def worker() -> int | None:
            seen[:] = sorted(set(seen) | set(children(proc.pid)))
            return next((c for c in seen if " -m worker " in cmdline(c)), None)

        wk = wait_for(worker, 60, "up.py to start its worker", interval=0.01)
        os.kill(wk, signal.SIGSTOP)  # before it can say hello: the cluster never gets ready
        # The state file means "this cluster is up": a dead cluster's must not be read while a new one starts.
        assert not state_file.exists()
        time.sleep(1.0)  # up.py well inside its readiness wait
        seen[:] = sorted(set(seen) | set(children(proc.pid)))
        proc.send_signal(signum)
        start = time.monotonic()
        try:
            proc.wait(timeout=40)  # stop() gives a stopped child 10 s before SIGKILL
        except subprocess.TimeoutExpired:
            pytest.fail(f"up.py still starting {time.monotonic() - start:.0f} s after signal {signum!r}")
        assert proc.returncode == 128 + signum, (tmp_path / "up.log").read_text()
        assert not any(process_running(p) for p in seen), [cmdline(p) for p in seen if process_running(p)]
        assert not state_file.exists()
        assert "cluster stopped; logs kept in" in (tmp_path / "up.log").read_text()
    finally:
        proc.kill()
        proc.wait()
        reap_orphans(seen)
