"""scripts/up.py's torch threads a worker: the cores split among the cluster's workers, unless the environment sets
TS_WORKER_TORCH_THREADS (clusters side by side on the same cores: `make test JOBS=N`). Real processes: up.py,
redis-server, a gateway and a worker on the tiny model; the count read from the worker's own environment."""

from __future__ import annotations

import os
from pathlib import Path

from tests.cluster_helpers import local_cluster


def worker_threads(pid: int) -> str:
    env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
    return env["TS_WORKER_TORCH_THREADS"]


def test_a_torch_thread_count_in_the_environment_reaches_the_workers(tmp_path, tiny_model_dir, monkeypatch):
    # More than the cores: never what the split gives, on any machine.
    asked = str((os.cpu_count() or 1) + 1)
    monkeypatch.setenv("TS_WORKER_TORCH_THREADS", asked)
    with local_cluster(tmp_path, tiny_model_dir, workers=1, http=False) as c:
        assert worker_threads(c["workers"][0]["pid"]) == asked


def test_without_one_the_workers_split_the_cores(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("TS_WORKER_TORCH_THREADS", raising=False)
    with local_cluster(tmp_path, tiny_model_dir, workers=2, http=False) as c:
        assert {worker_threads(w["pid"]) for w in c["workers"]} == {str(max(1, (os.cpu_count() or 1) // 2))}
