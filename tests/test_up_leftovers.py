"""What a dead launcher (scripts/up.py) left, found through the state file a new one is given: its secrets folder
and Redis's sit in the temporary folder of that run, which need not be this one's. Real processes: up.py,
redis-server, a gateway and a worker on the tiny model; real files and pids for the sweep itself."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from scripts import up
from scripts.leftovers import LEFTOVERS_FILE, identity
from tests.cluster_helpers import process_running
from tests.up_launch import clean_up, kill_with_helper, run_dirs, up_in, up_log, wait_started

pytestmark = pytest.mark.faults


def test_a_dead_run_of_another_temporary_folder_is_swept_through_its_state_file(tmp_path, tiny_model_dir):
    # The sweep looked in this run's temporary folder alone: a run started with another TMPDIR, killed with its
    # helper, kept its CURVE keys, API keys, Redis password and AOF on disk for ever, though the state file this
    # run was given named them.
    first_tmp, second_tmp = tmp_path / "tmp-first", tmp_path / "tmp-second"
    first_tmp.mkdir()
    second_tmp.mkdir()
    first, state_file = up_in(tmp_path, tiny_model_dir, first_tmp, "first")
    second: subprocess.Popen | None = None
    pids: list[int] = []
    left: list[Path] = []
    try:
        st = wait_started(first, state_file, up_log(tmp_path, "first"), "the first cluster to start")
        pids = list(st["pids"].values())
        left = run_dirs(st)
        assert all(p.parent == first_tmp for p in left)
        kill_with_helper(first, pids)
        assert all(p.is_dir() for p in left)

        second, _ = up_in(tmp_path, tiny_model_dir, second_tmp, "second")
        new = wait_started(second, state_file, up_log(tmp_path, "second"), "the second cluster to start", pids)
        assert not any(p.exists() for p in left), [str(p) for p in left if p.exists()]
        assert "left by a run that died" in up_log(tmp_path, "second").read_text()
        pids += list(new["pids"].values())
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=40) == 0
    finally:
        clean_up([first, second], pids, left)


def _run(tmpdir: Path, owner: list, state_file: Path) -> tuple[Path, Path]:
    """A run's leftovers as up.py records them: its secrets folder (keys, the record) and Redis's, beside it."""
    secrets = tmpdir / f"{up.SECRETS_PREFIX}{owner[0]}"
    redis_dir = tmpdir / f"redis-server-{owner[0]}"
    (secrets / "keys").mkdir(parents=True)
    redis_dir.mkdir()
    lines = [{"owner": owner, "helper": owner}, {"dir": str(secrets)}, {"dir": str(redis_dir)},
             {"state": str(state_file.resolve()), "keys_dir": str(secrets / "keys")}]
    (secrets / LEFTOVERS_FILE).write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    state_file.write_text(json.dumps({"keys": {"dir": str(secrets / "keys")}}))
    return secrets, redis_dir


def test_the_state_file_leads_to_a_dead_run_and_never_to_a_live_one(tmp_path, monkeypatch):
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # the sweep's own folder: this test's
    other = tmp_path / "elsewhere"
    other.mkdir()
    state_file = tmp_path / "cluster.json"
    live = _run(other, identity(os.getpid()), state_file)  # this process: alive
    up.sweep_leftovers(state_file)
    assert all(p.is_dir() for p in live) and state_file.exists()
    shutil.rmtree(live[0])
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = _run(other, [int(gone.stdout), "0"], state_file)  # exited (and a start time no process has)
    up.sweep_leftovers(state_file)
    assert not any(p.exists() for p in dead) and not state_file.exists()
    # Neither a state file that is not a file nor one naming no secrets folder of ours is read as a lead.
    up.sweep_leftovers(Path(os.devnull))
    (tmp_path / "plain.json").write_text(json.dumps({"keys": {"dir": str(tmp_path / "keys")}}))
    up.sweep_leftovers(tmp_path / "plain.json")
    assert (tmp_path / "plain.json").exists() and other.is_dir()


def test_a_second_launcher_on_a_live_clusters_state_file_is_refused(tmp_path, tiny_model_dir):
    # A second up.py given a running cluster's --state-file removed that file and wrote its own; the first one's
    # stop then removed the second's: a cluster up with no state file, and clients meanwhile read the wrong one's.
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    first, state_file = up_in(tmp_path, tiny_model_dir, tmpdir, "first")
    pids: list[int] = []
    try:
        wait_started(first, state_file, up_log(tmp_path, "first"), "the first cluster to start")
        before = state_file.read_text()
        pids = list(json.loads(before)["pids"].values())
        second, _ = up_in(tmp_path, tiny_model_dir, tmpdir, "second")
        try:
            assert second.wait(timeout=60) == 1
        finally:
            second.kill()
            second.wait()
        log = up_log(tmp_path, "second").read_text()
        assert f"running cluster (up.py pid {first.pid})" in log, log
        assert state_file.read_text() == before and all(process_running(p) for p in pids)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=40) == 0
        assert not state_file.exists()
    finally:
        clean_up([first], pids)
