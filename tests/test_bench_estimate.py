"""scripts/bench_estimate.py's load setting: it sizes the replay from the rates the workers log at start-up."""

from __future__ import annotations

import logging

import pytest

from scripts import bench_estimate
from worker import Engine, EngineConfig


def test_the_worker_logs_its_calibration_in_the_form_the_bench_reads(tiny_model_dir, tmp_path, caplog):
    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=3))
    service = WorkerService(WorkerConfig(worker_id="wk-c", gateways=["tcp://127.0.0.1:9"], model="tiny"), engine)
    try:
        with caplog.at_level(logging.INFO, logger="worker"):
            service.connect()
    finally:
        service.close()
    lines = [r.getMessage() for r in caplog.records if "calibrated" in r.getMessage()]
    assert len(lines) == 1
    (tmp_path / "worker-0.log").write_text(f"2026-12-01 10:00:00 worker INFO {lines[0]}\n")
    [(prefill, decode, slots)] = bench_estimate.calibrated_rates(tmp_path, 1, timeout_s=1)
    measured = service.rates.rates()
    assert slots == 3
    assert prefill == pytest.approx(measured[0], abs=0.1) and decode == pytest.approx(measured[1], abs=0.1)
    assert prefill > 0 and decode > 0


def test_a_worker_without_a_calibration_line_is_an_error_not_a_guess(tmp_path):
    (tmp_path / "worker-0.log").write_text("worker INFO calibrated: prefill 100.0 tokens/s, decode 10.0 tokens/s "
                                           "per sequence, 2 slots\n")
    (tmp_path / "worker-1.log").write_text("worker INFO starting\n")
    with pytest.raises(SystemExit, match="no calibration line"):
        bench_estimate.calibrated_rates(tmp_path, 2, timeout_s=0.3)


def test_offered_load_is_slot_seconds_of_work_per_second_per_slot():
    jobs = [{"at": 0.0, "prompt_tokens": 100, "max_tokens": 10}, {"at": 10.0, "prompt_tokens": 300, "max_tokens": 30}]
    rates = [(100.0, 10.0, 2), (300.0, 30.0, 2)]  # mean prefill 200/s, decode 20/s, 4 slots
    work = (100 / 200 + 10 / 20) + (300 / 200 + 30 / 20)  # 4 slot-seconds
    assert bench_estimate.offered_load(jobs, rates) == pytest.approx(work / 10.0 / 4)


@pytest.mark.parametrize("argv", [["--load", "0.8", "--speedup", "2"], ["--load", "0"], ["--speedup", "-1"]])
def test_contradictory_or_empty_pacing_is_refused_before_a_cluster_starts(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_estimate.main(["--trace", str(tmp_path / "none.csv"), *argv])
    assert e.value.code == 2 and ("--load" in capsys.readouterr().err)
