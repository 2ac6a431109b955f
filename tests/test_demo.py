"""`make demo`, one of the two commands a newcomer runs, end to end: scripts/demo.py starts real clusters
through scripts/up.py's Cluster (it once broke when up.py gained an option the demo did not pass)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from scripts.up import cluster_args
from tests.cluster_helpers import ROOT


def test_cluster_args_fill_up_py_defaults_and_refuse_unknown_options():
    args = cluster_args(workers=3, http=False)
    assert args.workers == 3 and args.http is False and args.gateways == 1 and args.lease_s == 10.0
    with pytest.raises(TypeError, match="no option 'wokers'"):
        cluster_args(wokers=3)


def test_the_demo_runs_and_explains_its_slowest_p0(tmp_path):
    done = subprocess.run([sys.executable, "scripts/demo.py", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=400)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    for policy in ("priority", "fifo"):
        for tier in ("P0", "P2", "P3"):
            assert re.search(rf"^{policy}\s+{tier}\s+\d+\s+\d+", done.stdout, re.M), (policy, tier, done.stdout)
    assert "why was the slowest P0 request" in done.stdout
    assert (tmp_path / "slowest-p0-timeline.png").stat().st_size > 0
    assert not re.search(r"redis://:[^*@\s]+@", out), "the demo printed the Redis password"
