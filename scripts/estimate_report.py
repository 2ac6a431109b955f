"""What scripts/bench_estimate.py reports of a replay: per tier, the median relative error of the wait
estimates and the share within 2x (over jobs that waited at least --min-wait), as a table, and the
estimates against the actual waits as a picture."""

from __future__ import annotations

import math
import statistics
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

TIERS = ("P0", "P1", "P2", "P3")


def _families(metrics_url: str, timeout_s: float):
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as r:
        return list(text_string_to_metric_families(r.read().decode()))


def promotions(metrics_url: str, timeout_s: float = 5.0) -> dict[str, int]:
    """Jobs the gateway moved to P2 when their promised start fell due (ts_promotions_total), by the tier left."""
    return {s.labels["tier"]: int(s.value) for f in _families(metrics_url, timeout_s) if f.name == "ts_promotions"
            for s in f.samples if s.name == "ts_promotions_total"}


def mean_handoff(metrics_url: str, timeout_s: float = 5.0) -> tuple[float, int] | None:
    """The gateway's mean hand-off (dispatch until the first prefill started, ts_dispatch_handoff_seconds) over
    every worker, and how many jobs it covers; None if it has seen none."""
    total = count = 0.0
    for family in _families(metrics_url, timeout_s):
        if family.name == "ts_dispatch_handoff_seconds":
            for s in family.samples:
                total += s.value if s.name.endswith("_sum") else 0.0
                count += s.value if s.name.endswith("_count") else 0.0
    return (total / count, int(count)) if count else None


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """The 95 % (Wilson) interval of a share of k in n: what a tier's within-2x says with as few jobs as P0 and P1
    have a run (10 jobs at 80 % is anything from 49 % to 94 %)."""
    if n <= 0:
        return None
    p, z2 = k / n, z * z
    centre, half = (p + z2 / (2 * n)) / (1 + z2 / n), z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def judged(records: list[dict], min_wait: float) -> list[dict]:
    """The jobs the goal judges: those that finished after waiting at least ``min_wait``."""
    return [r for r in records if r.get("outcome") == "done" and r["wait_s"] >= min_wait]


def within_2x(record: dict) -> bool:
    """Was the job told a wait within 2x of the one it had (the issue's second measure)?"""
    return record["wait_s"] / 2 <= record["estimate_s"] <= 2 * record["wait_s"]


def summarize(records: list[dict], min_wait: float) -> dict:
    def stats(rs: list[dict]) -> dict:
        waited = judged(rs, min_wait)
        rel = [abs(r["estimate_s"] - r["wait_s"]) / r["wait_s"] for r in waited]
        within = [r for r in waited if within_2x(r)]
        outcomes = {o: sum(1 for r in rs if r.get("outcome") == o) for o in ("done", "overloaded", "quota", "failed")}
        waits = sorted(r["wait_s"] for r in rs if r.get("outcome") == "done")
        return {"jobs": len(rs), **outcomes, "waited": len(waited),
                "median_rel_error": statistics.median(rel) if rel else None,
                "within_2x": len(within) / len(waited) if waited else None,
                "within_2x_95ci": wilson(len(within), len(waited)),
                # What each tier waited, all jobs: what promised starts cost the higher tiers (BENCHMARKS.md).
                "mean_wait_s": statistics.fmean(waits) if waits else None,
                "p90_wait_s": waits[int(0.9 * (len(waits) - 1))] if waits else None}

    return {"all": stats(records), **{t: stats([r for r in records if r["tier"] == t]) for t in TIERS}}


def slipped_promises(records: list[dict], min_wait: float, aging_s: float) -> dict[str, dict[str, int]]:
    """Per tier admitted, the judged jobs whose promise moved them (``promoted_s``, from where_they_ran), those of
    them that started half an aging interval or more after it (``slipped``: the queue they moved to did not move,
    and aging took them on; BENCHMARKS.md, issue 12, twenty-fifth session), and how many of those were told a wait
    within 2x of theirs."""
    promoted = [r for r in judged(records, min_wait) if r.get("promoted_s") is not None]
    out = {}
    for tier in TIERS:
        moved = [r for r in promoted if r["tier"] == tier]
        if not moved:
            continue
        slipped = [r for r in moved if r["wait_s"] - r["promoted_s"] >= aging_s / 2]
        out[tier] = {"promoted": len(moved), "slipped": len(slipped),
                     "slipped_within_2x": sum(map(within_2x, slipped))}
    return out


def table(summary: dict, min_wait: float) -> str:
    lines = [f"{'tier':<6}{'jobs':>6}{'done':>6}{'overload':>9}{'quota':>7}{'failed':>7}"
             f"{f'waited>={min_wait:g}s':>14}{'median rel err':>16}{'within 2x':>11}{'(95 % CI)':>11}{'mean wait':>11}"
             f"{'p90 wait':>10}"]
    for name, s in summary.items():
        err = "-" if s["median_rel_error"] is None else f"{100 * s['median_rel_error']:.1f} %"
        ci = s.get("within_2x_95ci")
        w2 = "-" if s["within_2x"] is None else f"{100 * s['within_2x']:.1f} %"
        w2ci = "-" if ci is None else f"{100 * ci[0]:.0f}-{100 * ci[1]:.0f} %"
        mean = "-" if s.get("mean_wait_s") is None else f"{s['mean_wait_s']:.2f} s"
        p90 = "-" if s.get("p90_wait_s") is None else f"{s['p90_wait_s']:.2f} s"
        lines.append(f"{name:<6}{s['jobs']:>6}{s['done']:>6}{s['overloaded']:>9}{s['quota']:>7}{s['failed']:>7}"
                     f"{s['waited']:>14}{err:>16}{w2:>11}{w2ci:>11}{mean:>11}{p90:>10}")
    return "\n".join(lines)


def draw(records: list[dict], min_wait: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    done = [r for r in records if r.get("outcome") == "done"]
    top = max([r["wait_s"] for r in done] + [r["estimate_s"] for r in done] + [1.0]) * 1.3
    lo = 0.05
    for tier, colour in zip(TIERS, ("tab:red", "tab:orange", "tab:blue", "tab:green")):
        rs = [r for r in done if r["tier"] == tier]
        ax.scatter([max(lo, r["wait_s"]) for r in rs], [max(lo, r["estimate_s"]) for r in rs], s=10, alpha=0.6,
                   color=colour, label=f"{tier} ({len(rs)})")
    ax.plot([lo, top], [lo, top], color="black", lw=1, label="estimate = wait")
    ax.fill_between([lo, top], [lo / 2, top / 2], [2 * lo, 2 * top], color="grey", alpha=0.15, label="within 2x")
    ax.axvline(min_wait, color="grey", ls=":", lw=1)
    ax.set(xscale="log", yscale="log", xlim=(lo, top), ylim=(lo, top), xlabel="actual wait (s)",
           ylabel="estimate at admission (s)", title="wait estimate vs actual wait")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
