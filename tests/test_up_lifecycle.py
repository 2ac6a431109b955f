"""scripts/up.py's own life: what a signal or a kill -9 of the launcher leaves behind. Real processes: up.py,
redis-server, a gateway, a worker and the front door on the tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.cluster_helpers import process_running, wait_for
from tests.up_launch import (children, clean_up, cmdline, kill_with_helper, reap_orphans, run_dirs, up, up_in,
                             up_log, wait_started)

pytestmark = pytest.mark.faults


def test_a_kill_9d_launcher_takes_its_cluster_with_it(tmp_path, tiny_model_dir):
    # The children run in sessions of their own (a Ctrl-C reaches up.py alone, which stops them in order), so
    # nothing stopped them when up.py itself died: redis-server, the gateway, the worker and the front door ran
    # on, orphaned, holding their ports and CPU.
    proc, state_file = up(tmp_path, tiny_model_dir)
    pids: list[int] = []
    leftovers: list[Path] = []
    try:
        st = wait_started(proc, state_file, up_log(tmp_path))
        pids = list(st["pids"].values())
        assert len(pids) == 4 and all(process_running(p) for p in pids)
        # Key material on disk: the CURVE keys and API keys, and Redis's folder (its password, the jobs' AOF).
        leftovers += run_dirs(st)
        assert all(p.is_dir() for p in leftovers) and any(leftovers[0].rglob("*.key_secret"))
        proc.kill()
        proc.wait()
        wait_for(lambda: not any(process_running(p) for p in pids), 30, "every process of the cluster to exit")
        # up.py could remove nothing itself: its secrets stayed readable on disk, and its state file passed
        # for a running cluster's.
        wait_for(lambda: not state_file.exists() and not any(p.exists() for p in leftovers), 30,
                 f"the state file and {leftovers} to be removed")
    finally:
        clean_up([proc], pids, leftovers)  # a failing run must not leave keys behind


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


def test_a_new_launcher_removes_what_a_dead_one_left(tmp_path, tiny_model_dir):
    # The helper that cleans up after a kill -9'd launcher can be killed too (kill -9 of the process group, the
    # OOM killer, a crash of the machine): the CURVE keys, the tenants' API keys and the Redis password, and
    # Redis's folder (its password, the jobs' AOF) stayed in the temporary folder for ever; no later run knew them.
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    first, state_file = up_in(tmp_path, tiny_model_dir, tmpdir, "first")
    second: subprocess.Popen | None = None
    pids: list[int] = []
    left: list[Path] = []
    try:
        st = wait_started(first, state_file, up_log(tmp_path, "first"), "the first cluster to start")
        pids = list(st["pids"].values())
        left = run_dirs(st)
        kill_with_helper(first, pids)
        assert all(p.is_dir() for p in left) and state_file.exists()  # nobody was left to remove them

        second, _ = up_in(tmp_path, tiny_model_dir, tmpdir, "second")
        new = wait_started(second, state_file, up_log(tmp_path, "second"), "the second cluster to start", pids)
        assert not any(p.exists() for p in left), [str(p) for p in left if p.exists()]
        new_left = run_dirs(new)
        assert all(p.is_dir() for p in new_left)  # the live run's own are untouched
        pids += list(new["pids"].values())
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=40) == 0
        assert not any(p.exists() for p in new_left) and not state_file.exists()
    finally:
        clean_up([first, second], pids, left)


def test_a_taken_http_port_is_refused_not_passed_for_the_front_door(tmp_path, tiny_model_dir):
    # The front door died at once on a --http-port another server held, and the readiness probe asked the port,
    # not the process: the other server's 200 passed for the front door, the state file's http named it, and the
    # supervisor restarted the dying front door for ever (a server that did not answer: a --ready-timeout wait).
    import http.server
    import threading

    class Anything(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Anything)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    # No worker to wait for (--workers 0, the last --workers wins): the front door is all the readiness left.
    proc, state_file = up(tmp_path, tiny_model_dir, "--http-port", str(other.server_address[1]),
                          "--ready-timeout", "100", "--workers", "0")
    seen: list[int] = []
    try:
        def ended():
            seen[:] = sorted(set(seen) | set(children(proc.pid)))
            return proc.poll() is not None or state_file.exists()

        wait_for(ended, 100, "up.py to start or refuse", interval=0.01)
        log = (tmp_path / "up.log").read_text()
        assert not state_file.exists(), f"another server passed for the front door:\n{log}"
        assert proc.wait(timeout=30) == 1 and f"--http-port {other.server_address[1]}" in log, log
        assert not any(process_running(p) for p in seen), [cmdline(p) for p in seen if process_running(p)]
    finally:
        other.shutdown()
        proc.kill()
        proc.wait()
        reap_orphans(seen)
