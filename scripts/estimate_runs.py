"""Judge repeated runs of scripts/bench_estimate.py together: each run's figures per tier, the runs pooled, and
how sure each figure is.

A run judges the jobs that waited at least --min-wait; on the conversation trace that is 100-160 P2 and P3 jobs
but 10-20 P1 and 0-1 P0 jobs, so one run's median for P1 lands either side of a goal that the pooled jobs meet
with room (BENCHMARKS.md, issue 12, nineteenth session: P1 at 9.9-24.6 % over five runs, 15.5 % pooled). This
script prints every run's median relative error and share within 2x per tier, with the runs that meet the goal;
then the runs' jobs pooled per tier, with 95 % intervals: for the median error the distribution-free one (order
statistics of the binomial), for the share within 2x Wilson's; and the median of estimate / wait, which says
whether the estimates lean high or low.

  scripts/estimate_runs.py conv-1.json conv-2.json conv-3.json conv-4.json conv-5.json [--json pooled.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.estimate_report import TIERS, judged, summarize  # noqa: E402


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of ``values``' population: the order statistics j and n+1-j
    (1-based) with at least ``level`` binomial(n, 1/2) mass between them; None where n is too small for one."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return None
    # P(Binomial(n, 1/2) <= k), summed in logs: 0.5 ** n underflows for the thousands of jobs of pooled runs.
    log_half_n = -n * math.log(2)
    cdf, j = 0.0, 0
    for k in range(n // 2 + 1):
        cdf += math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + log_half_n)
        if cdf > (1 - level) / 2:
            break
        j = k + 1  # the interval [x_(j), x_(n+1-j)] (1-based) still covers at least ``level``
    if j == 0:
        return None
    return xs[j - 1], xs[n - j]


def meets(stats: dict, median_goal: float, within_goal: float) -> bool | None:
    """Does a tier's summary meet the goal? None: no judged job, nothing to say."""
    if not stats["waited"]:
        return None
    return stats["median_rel_error"] <= median_goal and stats["within_2x"] >= within_goal


def pooled(runs: list[dict], per_run: list[dict], min_wait: float, median_goal: float, within_goal: float) -> dict:
    """Per tier, the runs' judged jobs pooled; ``per_run``: each run's summarize()."""
    records = [r for run in runs for r in run["jobs"]]
    summary = summarize(records, min_wait)
    out = {}
    for tier in TIERS:
        s = summary[tier]
        ps = [(r["estimate_s"], r["wait_s"]) for r in judged([r for r in records if r["tier"] == tier], min_wait)]
        met = [meets(run[tier], median_goal, within_goal) for run in per_run]
        out[tier] = {
            "waited": s["waited"],
            "median_rel_error": s["median_rel_error"],
            "median_rel_error_95ci": median_interval([abs(e - w) / w for e, w in ps]),
            "within_2x": s["within_2x"],
            "within_2x_95ci": s["within_2x_95ci"],
            "median_estimate_over_wait": statistics.median(e / w for e, w in ps) if ps else None,
            "runs_judged": sum(m is not None for m in met),
            "runs_meeting": sum(m is True for m in met),
            "meets": meets(s, median_goal, within_goal),
        }
    return out


def load(path: Path) -> dict:
    """A bench run's --json; SystemExit with the reason for anything else."""
    try:
        run = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"estimate_runs: cannot read {path}: {e}") from None
    if not isinstance(run, dict) or not isinstance(run.get("jobs"), list):
        raise SystemExit(f"estimate_runs: {path} is not a scripts/bench_estimate.py --json output (no 'jobs' list)")
    return run


def _cell(stats: dict, median_goal: float, within_goal: float) -> str:
    if not stats["waited"]:
        return "- (0)"
    mark = "" if meets(stats, median_goal, within_goal) else " *"
    return f"{100 * stats['median_rel_error']:.1f} / {100 * stats['within_2x']:.1f} ({stats['waited']}){mark}"


def report(paths: list[Path], runs: list[dict], per_run: list[dict], pool: dict, min_wait: float,
           median_goal: float, within_goal: float) -> str:
    goal = f"median error <= {100 * median_goal:g} %, within 2x >= {100 * within_goal:g} %"
    lines = [f"per run: median relative error % / within 2x % (jobs that waited >= {min_wait:g} s); * misses the "
             f"goal ({goal})",
             f"{'run':<28}{'load':>6}" + "".join(f"{t:>24}" for t in TIERS)]
    for path, run, s in zip(paths, runs, per_run):
        load_ = run.get("measured_load")
        lines.append(f"{path.name[:27]:<28}{'-' if load_ is None else f'{load_:.2f}':>6}"
                     + "".join(f"{_cell(s[t], median_goal, within_goal):>24}" for t in TIERS))
    lines += ["", f"pooled over {len(runs)} runs, 95 % intervals:",
              f"{'tier':<6}{'judged':>8}{'median rel err':>16}{'(95 % CI)':>14}{'within 2x':>11}{'(95 % CI)':>12}"
              f"{'est/wait':>10}{'runs meeting':>14}"]
    for tier, p in pool.items():
        if not p["waited"]:
            lines.append(f"{tier:<6}{0:>8}{'-':>16}")
            continue
        mci, wci = p["median_rel_error_95ci"], p["within_2x_95ci"]
        runs_meeting = f"{p['runs_meeting']} of {p['runs_judged']}"
        lines.append(f"{tier:<6}{p['waited']:>8}{100 * p['median_rel_error']:>14.1f} %"
                     f"{'-' if mci is None else f'{100 * mci[0]:.0f}-{100 * mci[1]:.0f} %':>14}"
                     f"{100 * p['within_2x']:>9.1f} %{f'{100 * wci[0]:.0f}-{100 * wci[1]:.0f} %':>12}"
                     f"{p['median_estimate_over_wait']:>10.2f}{runs_meeting:>14}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="scripts/bench_estimate.py --json outputs")
    ap.add_argument("--min-wait", type=float, default=0.5, help="judge jobs that waited at least this (default 0.5 s)")
    ap.add_argument("--median-goal", type=float, default=0.2, help="the goal's median relative error (default 0.2)")
    ap.add_argument("--within-goal", type=float, default=0.9, help="the goal's share within 2x (default 0.9)")
    ap.add_argument("--json", type=Path, help="write the pooled figures here")
    args = ap.parse_args(argv)
    if not (args.min_wait >= 0 and 0 <= args.median_goal and 0 <= args.within_goal <= 1):
        ap.error("need --min-wait >= 0, --median-goal >= 0 and --within-goal in [0, 1]")
    runs = [load(p) for p in args.runs]
    per_run = [summarize(run["jobs"], args.min_wait) for run in runs]
    pool = pooled(runs, per_run, args.min_wait, args.median_goal, args.within_goal)
    print(report(args.runs, runs, per_run, pool, args.min_wait, args.median_goal, args.within_goal))
    if args.json:
        args.json.write_text(json.dumps({"runs": [str(p) for p in args.runs], "min_wait_s": args.min_wait,
                                         "pooled": pool}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
