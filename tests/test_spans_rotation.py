"""up.py's spans file rotated by size (--spans-max-mb, --spans-keep): bounded on disk, every process writing on
into the new file, and explain reading the rotated ones. Real up.py, gateway and worker on the tiny model."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from common.spans_file import AppendStream, prune, rotate, rotated_files
from gateway.sdk import GatewayClient
from scripts import explain
from tests.cluster_helpers import wait_for
from tests.up_launch import clean_up, up, up_log, wait_started

pytestmark = pytest.mark.faults

MAX_MB = 0.01  # about 10 KB: a rotation every few jobs


def test_the_spans_file_is_rotated_and_explain_reads_the_rotated_ones(tmp_path, tiny_model_dir, capsys):
    # Every process appended to one file for as long as the cluster ran: a long run filled the disk.
    spans = tmp_path / "spans.jsonl"
    for n in (3, 4):  # a run before kept 4: more than this one keeps
        Path(f"{spans}.{n}").write_text("{}\n")
    proc, state_file = up(tmp_path, tiny_model_dir, "--no-http", "--spans-file", str(spans), "--spans-max-mb",
                          str(MAX_MB), "--spans-keep", "2",
                          env={"OTEL_BSP_SCHEDULE_DELAY": "100"})  # batches every 0.1 s: the test waits less
    pids: list[int] = []
    try:
        st = wait_started(proc, state_file, up_log(tmp_path))
        pids = list(st["pids"].values())
        assert not Path(f"{spans}.3").exists() and not Path(f"{spans}.4").exists()  # beyond --spans-keep 2
        ids: list[str] = []
        with GatewayClient(st["gateway"], st["tenants"]["lab-co"]["api_key"], timeout_s=10) as client:
            def one_job() -> str:
                job = client.submit(prompt_token_ids=[3, 4, 5], max_tokens=3, ignore_eos=True)
                job.result(timeout=60)
                ids.append(job.id)
                return job.id

            def on_disk(rid: str) -> bool:
                return any(json.dumps(rid) in p.read_text() for p in rotated_files(spans))

            first = one_job()
            wait_for(lambda: on_disk(first), 30, "the first job's spans")
            for _ in range(150):  # until the oldest spans are gone: the files' total is bounded
                one_job()
                if Path(f"{spans}.2").exists() and not on_disk(first):
                    break
            assert not on_disk(first), f"the first job's spans still kept after {len(ids)} jobs"
            last = one_job()
            # The gateway and the worker reopened the path after the rotations: the new job's spans are in it.
            wait_for(lambda: spans.exists() and spans.read_text().count(json.dumps(last)) >= 2, 30,
                     "the last job's gateway and worker spans in the new file")
        # --spans-keep 2: the oldest went. (A file may pass the limit by what the cluster writes in a 0.2 s tick.)
        assert Path(f"{spans}.2").exists() and not Path(f"{spans}.3").exists()
        # The newest job in FILE.1: none of its spans can have gone with the oldest file.
        older = next(i for i in reversed(ids) if json.dumps(i) in Path(f"{spans}.1").read_text())
        for rid in (older, last):
            rc = explain.main([rid, "--spans", str(spans), "--json"])
            out = capsys.readouterr()
            assert rc == 0, out.err
            assert json.loads(out.out)["request_id"] == rid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0
    finally:
        clean_up([proc], pids)


def test_a_writer_follows_the_rotation_and_nothing_is_lost(tmp_path):
    path = tmp_path / "spans.jsonl"
    writer = AppendStream(path)
    for n in range(10):
        writer.write(json.dumps({"n": n}) + "\n")
        writer.flush()
        rotate(path, 20, keep=100)  # every three lines
    writer.close()
    lines = [ln for p in rotated_files(path) for ln in p.read_text().splitlines()]
    assert [json.loads(ln)["n"] for ln in lines] == list(range(10))  # all of them, oldest file first
    assert len(rotated_files(path)) > 3 and all(p.stat().st_size < 60 for p in rotated_files(path))
    assert not rotate(tmp_path / "absent", 1, keep=1) and not rotate(os.devnull, 1, keep=1)


def test_a_lower_keep_removes_the_rotations_beyond_it(tmp_path):
    # --spans-keep lowered between two runs on one file: rotate removed FILE.keep alone, so FILE.3.. of the run
    # that kept more stayed on disk for ever (and explain read them as the newest run's).
    path = tmp_path / "spans.jsonl"
    for n in range(1, 6):
        Path(f"{path}.{n}").write_text(f"old {n}\n")
    (tmp_path / "spans.jsonl.x").write_text("not a rotation\n")
    (tmp_path / "spans.jsonl.9.tmp").write_text("not a rotation\n")
    path.write_text("x" * 30)
    assert rotate(path, 20, keep=2)
    assert [p.name for p in rotated_files(path)] == ["spans.jsonl.2", "spans.jsonl.1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        ["spans.jsonl.1", "spans.jsonl.2", "spans.jsonl.9.tmp", "spans.jsonl.x"]
    assert Path(f"{path}.2").read_text() == "old 1\n" and Path(f"{path}.1").read_text() == "x" * 30
    # Below the size, nothing rotates; prune alone removes what a lower keep leaves beyond it.
    Path(f"{path}.3").write_text("old\n")
    assert not rotate(path, 20, keep=1) and Path(f"{path}.3").exists()
    prune(path, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spans.jsonl.1", "spans.jsonl.9.tmp", "spans.jsonl.x"]
    prune(tmp_path / "absent", keep=1)  # nothing there: nothing to do
