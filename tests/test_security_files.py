"""Secrets on disk: what scripts/up.py writes beside its processes is readable by its owner only, whatever was
at the path before."""

from __future__ import annotations

import json
import os
import stat

from scripts.up_files import write_state

STATE = {"redis": "redis://:s3cret@127.0.0.1:1/0", "tenants": {"chat-co": {"api_key": "dev-chat-co-0123"}}}


def test_a_stale_temporary_file_cannot_make_the_state_file_world_readable(tmp_path):
    # Left by an older run, a copy, or another local user in a shared folder: the state file (the Redis password in
    # its URL, every API key) was written into it and renamed with its mode, 0644.
    path = tmp_path / "cluster.json"
    stale = tmp_path / "cluster.json.tmp"
    stale.write_text("old")
    os.chmod(stale, 0o644)
    write_state(path, STATE)
    assert json.loads(path.read_text()) == STATE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(stale.stat().st_mode) == 0o644 and stale.read_text() == "old", "another's file is not used"


def test_the_state_file_is_never_written_through_a_link(tmp_path):
    # A link planted where the temporary file goes would have the secrets written to wherever it points.
    target = tmp_path / "elsewhere.txt"
    target.write_text("")
    os.chmod(target, 0o666)
    (tmp_path / "cluster.json.tmp").symlink_to(target)
    write_state(tmp_path / "cluster.json", STATE)
    assert target.read_text() == ""
    assert stat.S_IMODE((tmp_path / "cluster.json").stat().st_mode) == 0o600


def test_writing_the_state_again_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "cluster.json"
    for pid in range(3):
        write_state(path, STATE | {"pids": {"redis": pid}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.json"]
    assert json.loads(path.read_text())["pids"] == {"redis": 2}
