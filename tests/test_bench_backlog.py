"""scripts/bench_backlog.py: a real cluster whose queue only grows, an admission's cost per depth reached, and
bad flags refused before a cluster starts."""

from __future__ import annotations

import json

import pytest

from scripts import bench_backlog


@pytest.mark.parametrize("argv", [["--jobs", "0"], ["--every", "0"]])
def test_bad_flags_are_refused_before_a_cluster_starts(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench_backlog.main(argv)
    assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def test_it_reports_each_depth_with_a_growing_estimate(tmp_path, capsys):
    out = tmp_path / "backlog.json"
    assert bench_backlog.main(["--jobs", "40", "--every", "20", "--max-tokens", "400", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["queued"] for r in rows] == [20, 40]
    assert all(r["submit_ms"] > 0 and r["status_ms"] > 0 for r in rows)
    # One slot, 400-token jobs: the newest of 40 waits longer than the newest of 20.
    assert 0 < rows[0]["estimate_s"] < rows[1]["estimate_s"]
    assert "queued" in capsys.readouterr().out
