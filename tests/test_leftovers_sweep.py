"""scripts/leftovers.py's sweep: what a new launcher removes of the runs before it (real processes stand for the
launchers and helpers, alive or dead)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from scripts.leftovers import LEFTOVERS_FILE, identity, sweep_dead_runs

PREFIX = "ts-cluster-secrets-"


def a_run(tmp: Path, name: str, owner: list, helper: list, state: Path | None = None) -> list[Path]:
    """A run's folders as up.py leaves them: its secrets (with the record) and Redis's."""
    secrets_dir, redis_dir = tmp / (PREFIX + name), tmp / f"redis-server-{name}"
    (secrets_dir / "keys").mkdir(parents=True)
    redis_dir.mkdir()
    (redis_dir / "appendonly.aof").write_text("*1\r\n")
    lines = [{"owner": owner, "helper": helper}, {"dir": str(secrets_dir)}, {"dir": str(redis_dir)}]
    if state is not None:
        state.write_text(json.dumps({"keys": {"dir": str(secrets_dir / "keys")}}))
        lines.append({"state": str(state), "keys_dir": str(secrets_dir / "keys")})
    (secrets_dir / LEFTOVERS_FILE).write_text("".join(json.dumps(x) + "\n" for x in lines))
    return [secrets_dir, redis_dir]


def dead() -> list:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    ident = identity(p.pid)
    p.wait()
    return ident


def test_a_dead_runs_leftovers_go_and_a_live_runs_stay(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        gone = a_run(tmp_path, "dead", dead(), dead(), state=tmp_path / "cluster.json")
        # Either process alive: the run is up (its launcher), or its helper is removing the same things right now.
        kept = a_run(tmp_path, "live", identity(live.pid), dead()) + a_run(tmp_path, "helping", dead(),
                                                                             identity(live.pid))
        # A pid now worn by another process (its start time differs) is a dead run's.
        reused = a_run(tmp_path, "reused", [live.pid, "1"], dead())
        starting = tmp_path / (PREFIX + "starting")  # no record yet: a run between its mkdtemp and its first line
        starting.mkdir()
        removed = sweep_dead_runs(tmp_path, PREFIX)
        assert not any(p.exists() for p in gone + reused) and not (tmp_path / "cluster.json").exists()
        assert set(removed) == set(gone + reused)
        assert all(p.is_dir() for p in kept) and starting.is_dir()
    finally:
        live.kill()
        live.wait()


def test_a_record_removes_nothing_outside_the_temporary_folder(tmp_path):
    tmp, elsewhere = tmp_path / "tmp", tmp_path / "elsewhere"
    tmp.mkdir()
    elsewhere.mkdir()
    secrets_dir, _ = a_run(tmp, "dead", dead(), dead())
    with (secrets_dir / LEFTOVERS_FILE).open("a") as f:
        f.write(json.dumps({"dir": str(elsewhere)}) + "\n" + '{"dir": "/tm')  # and a line cut short by the kill
    sweep_dead_runs(tmp, PREFIX)
    assert elsewhere.is_dir() and not secrets_dir.exists()
