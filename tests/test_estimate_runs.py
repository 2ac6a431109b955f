"""scripts/estimate_runs.py: repeated bench runs judged per run and pooled, with intervals that say how sure."""

from __future__ import annotations

import json
import random

import pytest

from scripts import estimate_runs
from scripts.estimate_runs import median_interval


def job(tier: str, estimate: float, wait: float, outcome: str = "done") -> dict:
    return {"tier": tier, "estimate_s": estimate, "wait_s": wait, "outcome": outcome}


def write(path, jobs, load=0.8):
    path.write_text(json.dumps({"measured_load": load, "jobs": jobs}))
    return path


def test_the_median_interval_is_the_binomial_order_statistics():
    xs = [float(x) for x in range(10, 0, -1)]  # any order
    # n = 10: P(B <= 1) = 11/1024 <= 2.5 %, P(B <= 2) = 56/1024 > 2.5 %: the 2nd and the 9th.
    assert median_interval(xs) == (2.0, 9.0)
    assert median_interval([1.0, 2, 3, 4, 5, 6]) == (1.0, 6.0)  # n = 6: 1/64 <= 2.5 %, 7/64 is not
    assert median_interval([1.0, 2, 3, 4, 5]) is None  # n = 5: even the extremes cover only 93.75 %
    assert median_interval([]) is None


def test_the_median_interval_of_thousands_holds_the_median_and_narrows():
    rng = random.Random(5)
    xs = [rng.lognormvariate(0, 1) for _ in range(4000)]  # 0.5 ** 4000 underflows: summed in logs
    lo, hi = median_interval(xs)
    small = median_interval(xs[:40])
    assert lo < sorted(xs)[2000] < hi and hi - lo < small[1] - small[0]
    assert 0.9 < lo < 1.0 < hi < 1.1  # the lognormal's median is 1


def test_runs_are_judged_each_and_pooled(tmp_path, capsys):
    # Run a: P1's two judged jobs are 5 % and 25 % off (median 15 %: meets); run b: 30 % and 40 % (misses).
    # P2 meets in both, P3 has a job outside 2x in run b, P0 has no judged job (a 0.1 s wait is not judged).
    a = write(tmp_path / "a.json", [job("P1", 1.05, 1.0), job("P1", 1.25, 1.0), job("P2", 2.0, 2.0),
                                    job("P3", 9.0, 10.0), job("P0", 0.3, 0.1), job("P3", 1.0, 0.2),
                                    job("P2", 50.0, 1.0, outcome="overloaded")])
    b = write(tmp_path / "b.json", [job("P1", 0.7, 1.0), job("P1", 1.4, 1.0), job("P2", 2.2, 2.0),
                                    job("P3", 1.0, 10.0)], load=0.83)
    out = tmp_path / "pooled.json"
    assert estimate_runs.main([str(a), str(b), "--json", str(out)]) == 0
    pooled = json.loads(out.read_text())["pooled"]
    assert pooled["P1"]["waited"] == 4 and pooled["P1"]["median_rel_error"] == pytest.approx(0.275)
    assert (pooled["P1"]["runs_meeting"], pooled["P1"]["runs_judged"], pooled["P1"]["meets"]) == (1, 2, False)
    assert pooled["P1"]["median_estimate_over_wait"] == pytest.approx(1.15)
    assert (pooled["P2"]["runs_meeting"], pooled["P2"]["within_2x"]) == (2, 1.0)
    assert pooled["P3"]["within_2x"] == 0.5 and pooled["P3"]["runs_meeting"] == 1
    assert pooled["P0"]["waited"] == 0 and pooled["P0"]["runs_judged"] == 0 and pooled["P0"]["meets"] is None
    text = capsys.readouterr().out
    assert "a.json" in text and "0.83" in text and "1 of 2" in text
    assert "15.0 / 100.0 (2) " in text and "35.0 / 100.0 (2) *" in text


def test_what_is_not_a_run_is_refused_with_the_reason(tmp_path):
    with pytest.raises(SystemExit, match="cannot read"):
        estimate_runs.main([str(tmp_path / "missing.json")])
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SystemExit, match="cannot read"):
        estimate_runs.main([str(tmp_path / "bad.json")])
    (tmp_path / "other.json").write_text(json.dumps({"summary": {}}))
    with pytest.raises(SystemExit, match="no 'jobs' list"):
        estimate_runs.main([str(tmp_path / "other.json")])
    with pytest.raises(SystemExit):
        estimate_runs.main([str(write(tmp_path / "a.json", [])), "--within-goal", "2"])
