"""scripts/up.py run as its own process, for the tests of the launcher's life (signals, kill -9, what a dead run
leaves, its spans file): started, waited for, killed with its leftovers helper, and cleaned up after, so that a
failing test leaves no cluster running and no keys on a shared machine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path

from tests.cluster_helpers import ROOT, process_running, wait_for


def up(tmp_path: Path, model_dir: Path, *extra: str, name: str = "",
       env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    """up.py with one worker on ``model_dir`` and its state in tmp_path/cluster.json; its output in up.log and its
    logs in logs/ (up-NAME.log and logs-NAME/ with a ``name``: a second run in one test). ``extra`` flags come last,
    so they win over these."""
    state_file = tmp_path / "cluster.json"
    suffix = f"-{name}" if name else ""
    cmd = [sys.executable, str(ROOT / "scripts" / "up.py"), "--workers", "1", "--model", str(model_dir),
           "--state-file", str(state_file), "--max-running", "2", "--logs-dir", str(tmp_path / f"logs{suffix}"),
           *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=up_log(tmp_path, name).open("w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ) | (env or {})), state_file


def up_in(tmp_path: Path, model_dir: Path, tmpdir: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """up.py with its temporary folders (secrets, Redis's) under ``tmpdir``: what it finds there is this test's."""
    return up(tmp_path, model_dir, "--no-http", name=name, env={"TMPDIR": str(tmpdir)})


def up_log(tmp_path: Path, name: str = "") -> Path:
    return tmp_path / (f"up-{name}.log" if name else "up.log")


def wait_started(proc: subprocess.Popen, state_file: Path, log: Path, what: str = "the cluster to start",
                 replacing: Collection[int] = ()) -> dict:
    """The state file once up.py has written it (with ``replacing``: a state file whose Redis is none of those
    pids, a dead run's); up.py must still run."""
    def written() -> bool:
        if not replacing:
            return state_file.exists()
        return state_file.exists() and json.loads(state_file.read_text())["pids"]["redis"] not in replacing

    wait_for(lambda: written() or proc.poll() is not None, 120, what)
    assert proc.poll() is None, log.read_text()
    return json.loads(state_file.read_text())


def run_dirs(state: dict) -> list[Path]:
    """What a run keeps on disk with key material: its secrets folder (CURVE keys, API keys, the Redis password)
    and Redis's folder (its password, the jobs' AOF)."""
    return [Path(state["keys"]["dir"]).parent, Path(os.readlink(f"/proc/{state['pids']['redis']}/cwd"))]


def kill_with_helper(proc: subprocess.Popen, pids: list[int], what: str = "the first cluster to exit") -> int:
    """kill -9 up.py and its leftovers helper at once (as the OOM killer or a crash would), and wait for ``pids``
    (its cluster) to exit: nobody is left to remove what it kept on disk. The helper's pid."""
    helper = next(c for c in children(proc.pid) if "-m scripts.leftovers" in cmdline(c))
    os.kill(helper, signal.SIGKILL)
    proc.kill()
    proc.wait()
    wait_for(lambda: not any(process_running(p) for p in pids + [helper]), 30, what)
    return helper


def clean_up(procs: list[subprocess.Popen | None], pids: list[int], dirs: Collection[Path] = ()) -> None:
    """Kill the launchers and whatever of their clusters runs on, and remove ``dirs`` (a run's keys)."""
    for p in procs:
        if p is not None:
            p.kill()
            p.wait()
    reap_orphans(pids)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


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
