"""The GPU check's harness and its tools, on CPU (CI has no GPU; scripts/gpu_check.sh runs them on one).

- without CUDA the check stops at once with status 2 and says why;
- a failing step does not stop the others, the summary names each step's status, and a spent budget skips
  steps instead of letting a lease's time limit kill the summary;
- profile_step.py reports a step's wall and host time per runner;
- bench_engine.py's divergence check tells rounding (no difference in float32) from a defect (a token the
  reference ranks near last).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "scripts" / "gpu_check.sh"


def run_check(tmp_path: Path, py: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CHECK), str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PY": py, **env})


def test_without_cuda_the_check_stops_at_once_and_says_why(tmp_path):
    r = run_check(tmp_path, sys.executable)
    assert r.returncode == 2
    assert "CUDA is not available" in r.stderr and "nothing was run" in r.stderr
    assert not any((tmp_path / "out").iterdir())


def pretend_cuda(tmp_path: Path) -> str:
    """An interpreter that answers the check's CUDA probe with yes and runs everything else for real (and fails
    where CUDA is needed): the harness, not the GPU, is what is tested."""
    fake = tmp_path / "py"
    fake.write_text(f'#!/bin/bash\nif [[ "$1" == "-c" && "$2" == *cuda.is_available* ]]; then exit 0; fi\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    return str(fake)


def summary(stdout: str) -> dict[str, str]:
    tail = stdout[stdout.rindex("=== done"):].splitlines()[1:]
    return {line.split()[0]: line for line in tail if line.strip()}


def test_a_failed_step_does_not_stop_the_next_and_the_summary_names_each(tmp_path):
    r = run_check(tmp_path, pretend_cuda(tmp_path), STEPS="3a 6", MODEL_DIR=str(tmp_path / "no-model"))
    assert r.returncode == 1
    steps = summary(r.stdout)
    assert set(steps) == {"3a.", "6."}, steps  # only the steps asked for, and both ran
    assert all("rc=1" in line for line in steps.values()), steps


def test_a_spent_budget_skips_steps_instead_of_running_them(tmp_path):
    r = run_check(tmp_path, pretend_cuda(tmp_path), STEPS="3a 6", BUDGET_S="5", MODEL_DIR=str(tmp_path / "none"))
    assert r.returncode == 1
    steps = summary(r.stdout)
    assert set(steps) == {"3a.", "6."}
    assert all("skipped: the budget is spent" in line for line in steps.values()), steps


def test_profile_step_reports_each_runner(tiny_model_dir, tmp_path):
    from scripts import profile_step

    out = tmp_path / "p.json"
    assert profile_step.main(["--model", str(tiny_model_dir), "--batch", "3", "--context", "20", "--steps", "4",
                              "--profiled", "2", "--hf", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for runner in ("engine", "hf"):
        r = result[runner]
        assert r["wall_ms"] > 0 and 0 < r["host_self_ms_per_step"]
        assert r["launches_per_step"] == 0  # nothing is launched on CPU
        assert r["top_host_ops_ms_per_step"]


def test_divergence_tells_a_defect_from_agreement(tiny_model_dir):
    from scripts import bench_engine
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    prompts = bench_engine.make_prompts(3, 12, vocab, seed=1)
    engine = bench_engine.engine_runner(str(tiny_model_dir), prompts, 8, "cpu", "float32")()
    hf = bench_engine.hf_generate_runner(str(tiny_model_dir), prompts, 8, "cpu", "float32")
    reference = hf()
    assert engine == reference  # float32 on CPU: token for token
    assert bench_engine.divergence(hf.model, prompts, engine, reference, "cpu") == []

    # A defect: request 1's third token replaced by the one the reference ranks last there.
    with torch.inference_mode():
        logits = hf.model(torch.tensor([prompts[1] + engine[1][:2]])).logits[0, -1]
    broken = [list(o) for o in engine]
    broken[1][2] = int(logits.argmin())
    rows = bench_engine.divergence(hf.model, prompts, broken, reference, "cpu")
    assert [(r["request"], r["index"]) for r in rows] == [(1, 2)]
    assert rows[0]["engine_token_rank"] == vocab - 1
    assert abs(rows[0]["logit_gap"] - float(logits.max() - logits.min())) < 1e-4
