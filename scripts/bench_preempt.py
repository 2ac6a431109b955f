"""Preemption benchmark: one scenario under policy fifo and priority, on the same engine and model, in one run.

Also runs the P0 requests alone on an idle engine, the baseline for P0 time to first
token. Requests arrive on the wall clock as the scenario says (or, with --clock cpu, on this
process's CPU time, which other processes on a shared machine cannot stretch); latency and TTFT
are measured from each request's scheduled arrival. Prints a table per tier and policy
and writes JSON (see --help of --json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Job:
    request_id: str
    tier: str
    arrive_s: float
    prompt: list[int]
    max_tokens: int
    first_s: float | None = None
    done_s: float | None = None
    tokens: int = 0


def make_jobs(scenario: dict, vocab: int, seed: int, tiers: set[str] | None = None) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for g in scenario["groups"]:
        for i in range(g["count"]):
            prompt = [rng.randrange(3, vocab) for _ in range(g["prompt_tokens"])]
            if tiers is None or g["tier"] in tiers:
                arrive = g["arrival"]["start_s"] + i * g["arrival"]["interval_s"]
                jobs.append(Job(f'{g["tier"]}-{i:03d}', g["tier"], arrive, prompt, g["max_tokens"]))
    return sorted(jobs, key=lambda j: (j.arrive_s, j.request_id))


class Clock:
    """The benchmark's time. ``wall``: time.monotonic(), waiting for arrivals in real time. ``cpu``: this
    process's CPU time, jumping ahead over idle gaps instead of sleeping: what a step costs the engine
    itself, so that other processes on a shared machine stretch the run but not its figures (run it
    with --threads 1, or spinning torch threads count too)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.skipped = 0.0
        self.t0 = self._raw()

    def _raw(self) -> float:
        return time.monotonic() if self.kind == "wall" else time.process_time()

    def __call__(self) -> float:
        return self._raw() - self.t0 + self.skipped

    def wait_until(self, t: float) -> None:
        if self.kind == "wall":
            time.sleep(max(0.0, t - self()))
        else:
            self.skipped += max(0.0, t - self())


def run(engine, jobs: list[Job], ignore_eos: bool, temperature: float, desc: str, clock_kind: str = "wall") -> dict:
    from worker import SamplingParams

    pending = list(jobs)
    by_id = {j.request_id: j for j in jobs}
    bar = tqdm(total=sum(j.max_tokens for j in jobs), desc=desc, unit="tok", file=sys.stderr, leave=False)
    step_s: list[float] = []
    clock = Clock(clock_kind)
    wall0 = time.monotonic()
    while pending or engine.has_unfinished():
        now = clock()
        while pending and pending[0].arrive_s <= now:
            j = pending.pop(0)
            engine.add_request(j.request_id, j.prompt, SamplingParams(
                max_tokens=j.max_tokens, temperature=temperature, seed=0, ignore_eos=ignore_eos), tier=j.tier)
        if not engine.has_unfinished():
            clock.wait_until(pending[0].arrive_s)
            continue
        s0 = clock()
        outs = engine.step()
        now = clock()
        step_s.append(now - s0)
        for o in outs:
            j = by_id[o.request_id]
            j.tokens += len(o.new_token_ids)
            bar.update(len(o.new_token_ids))
            if j.first_s is None:
                j.first_s = now
            if o.finished:
                j.done_s = now
    bar.close()
    stats = engine.stats()
    return {
        "tiers": tier_table(jobs),
        "preemptions": stats.by_mode(),
        "wasted_tokens": stats.wasted_tokens,
        "recomputed_tokens": stats.recomputed_tokens,
        "bytes_swapped": stats.bytes_swapped,
        "declined_decisions": stats.declined,
        "wall_s": time.monotonic() - wall0,
        "clock_s": clock(),
        "mean_step_s": statistics.fmean(step_s) if step_s else 0.0,
    }


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def tier_table(jobs: list[Job]) -> dict:
    out = {}
    for tier in sorted({j.tier for j in jobs}):
        js = [j for j in jobs if j.tier == tier]
        done = [j for j in js if j.done_s is not None and j.tokens == j.max_tokens]
        lat = [j.done_s - j.arrive_s for j in done]
        ttft = [j.first_s - j.arrive_s for j in js if j.first_s is not None]
        out[tier] = {
            "count": len(js), "completed": len(done),
            "latency_mean_s": statistics.fmean(lat) if lat else None,
            "latency_p50_s": _pct(lat, 0.5), "latency_p99_s": _pct(lat, 0.99),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else None, "ttft_p50_s": _pct(ttft, 0.5),
            "ttft_p99_s": _pct(ttft, 0.99),
        }
    return out


def prefill_seconds_per_token(engine, vocab: int, clock_kind: str = "wall") -> float:
    """Time to prefill one long prompt on the idle engine, per token: the price of recompute."""
    from worker import SamplingParams

    n = min(512, engine.max_model_len - 1)
    engine.add_request("prefill-probe", [5 + i % (vocab - 5) for i in range(n)], SamplingParams(max_tokens=1))
    clock = Clock(clock_kind)
    while engine.has_unfinished():
        engine.step()
    return clock() / n


def ensure_model(scenario: dict, model: Path | None) -> Path:
    from scripts.make_tiny_model import ensure

    return model if model is not None else ensure(scenario["model"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", type=Path, default=ROOT / "bench" / "seed-scenario.json",
                    help="scenario JSON (bench/seed-scenario.json, bench/memory-bound-scenario.json)")
    ap.add_argument("--model", type=Path, help="model directory (default: build the scenario's config in .models/)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mixed-p0-prefill", action="store_true",
                    help="batch a new P0's prefill with running decodes (EngineConfig.isolate_p0_prefill=False)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the whole comparison this many times on the same model; the report and the JSON "
                         "add each run's goals and their spread (min, median, max)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="measure on the wall clock, or on this process's CPU time (idle gaps skipped): figures "
                         "that other processes on a shared machine cannot stretch; use with --threads 1")
    ap.add_argument("--json", type=Path, help='write {"policies": {...}, "alone": {...}, "goals": {...}} here '
                                              '(the last run; with --repeat also "runs" and "spread")')
    args = ap.parse_args(argv)
    if not args.scenario.is_file():
        ap.error(f"scenario not found: {args.scenario}")
    scenario = json.loads(args.scenario.read_text())
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    from transformers.utils import logging as hf_logging

    from worker import EngineConfig
    from worker.engine import Engine
    from worker.model_runner import ModelRunner, load_model

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    eng_cfg = scenario.get("engine", {})
    # The scenario's other engine keys are EngineConfig's own (p0_reserve_slots, max_num_batched_tokens, ...).
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    extra = {k: v for k, v in eng_cfg.items() if k not in ("max_running_sequences", "isolate_p0_prefill")}
    if set(extra) - known:
        ap.error(f"scenario engine keys not in EngineConfig: {', '.join(sorted(set(extra) - known))}")
    cfg = EngineConfig(**{"block_size": 16, "swap_space_mb": 256, **extra}, device=args.device, dtype=args.dtype,
                       max_num_seqs=eng_cfg.get("max_running_sequences", 16),
                       isolate_p0_prefill=eng_cfg.get("isolate_p0_prefill", not args.mixed_p0_prefill))
    cfg.validate()
    model_dir = ensure_model(scenario, args.model)
    runner = ModelRunner(load_model(model_dir, cfg), cfg)  # one model and KV pool for every run
    vocab = runner.info.vocab_size
    sampling = scenario.get("sampling", {})
    ignore_eos, temperature = sampling.get("ignore_eos", True), sampling.get("temperature", 0.0)

    sec_per_prefill_token = prefill_seconds_per_token(Engine(runner, cfg), vocab, args.clock)  # also warms up
    runs = []
    for i in range(args.repeat):
        results = compare(scenario, runner, cfg, vocab, args.seed, ignore_eos, temperature, sec_per_prefill_token,
                          args.clock)
        results["settings"] = {"device": args.device, "dtype": args.dtype, "torch": torch.__version__,
                               "clock": args.clock, "threads": torch.get_num_threads(), "machine": platform.machine(),
                               "model": str(model_dir), "engine": eng_cfg}
        print_report(results, f" (run {i + 1} of {args.repeat})" if args.repeat > 1 else "")
        runs.append(results)
    if args.repeat > 1:
        results["runs"] = [r["goals"] for r in runs]
        results["spread"] = spread(results["runs"])
        print(f"\nspread over {args.repeat} runs (min / median / max):")
        for k, (lo, mid, hi) in results["spread"].items():
            print(f"  {k}: {lo:.3f} / {mid:.3f} / {hi:.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return 0


def compare(scenario: dict, runner, cfg, vocab: int, seed: int, ignore_eos: bool, temperature: float,
            sec_per_prefill_token: float, clock: str = "wall") -> dict:
    """One run of the scenario under every policy it compares, and its P0 requests alone on an idle engine."""
    from worker.engine import Engine

    results: dict = {"scenario": scenario["name"], "policies": {}}
    for policy in scenario.get("compare", ["fifo", "priority"]):
        engine = Engine(runner, replace(cfg, policy=policy))
        copies0, copy_s0 = runner.copy_events, runner.copy_seconds
        r = run(engine, make_jobs(scenario, vocab, seed), ignore_eos, temperature, policy, clock)
        # What one preemption event costs, in decode steps: keep is free; swap is the measured copy
        # time (out and back) per swapped victim; recompute is the re-prefill time of what it discarded.
        step = r["mean_step_s"] or float("inf")
        n_swap, n_rec = r["preemptions"]["swap"], r["preemptions"]["recompute"]
        copy_s = runner.copy_seconds - copy_s0
        r["copy_events"] = runner.copy_events - copies0
        r["event_cost_vs_decode_step"] = {
            "keep": 0.0,
            "swap": copy_s / n_swap / step if n_swap else None,
            "recompute": r["recomputed_tokens"] * sec_per_prefill_token / n_rec / step if n_rec else None,
        }
        events = sum(r["preemptions"].values())
        r["mean_event_cost_vs_decode_step"] = (
            (copy_s + r["recomputed_tokens"] * sec_per_prefill_token) / events / step if events else 0.0)
        results["policies"][policy] = r
    alone = run(Engine(runner, replace(cfg, policy="priority")),
                make_jobs(scenario, vocab, seed, tiers={"P0"}), ignore_eos, temperature, "P0 alone", clock)
    results["alone"] = alone["tiers"]
    results["goals"] = goals(results)
    return results


def spread(runs: list[dict]) -> dict[str, tuple[float, float, float]]:
    """Per goal: (min, median, max) over the runs."""
    return {k: (min(v), statistics.median(v), max(v)) for k in runs[0] for v in [[r[k] for r in runs]]}


def goals(res: dict) -> dict:
    pol = res["policies"]
    if "fifo" not in pol or "priority" not in pol:
        return {}
    f, p = pol["fifo"]["tiers"], pol["priority"]["tiers"]
    low = "P3" if "P3" in p else max(p)
    out = {
        "p0_latency_priority_over_fifo": p["P0"]["latency_mean_s"] / f["P0"]["latency_mean_s"],
        f"{low}_completed_share": p[low]["completed"] / p[low]["count"],
        f"{low}_latency_priority_over_fifo": p[low]["latency_mean_s"] / f[low]["latency_mean_s"],
        "p0_ttft_p99_loaded_over_alone": p["P0"]["ttft_p99_s"] / res["alone"]["P0"]["ttft_p99_s"],
        # The median moves less than the p99 (of 30 requests: the slowest) when the machine is shared.
        "p0_ttft_p50_loaded_over_alone": p["P0"]["ttft_p50_s"] / res["alone"]["P0"]["ttft_p50_s"],
        "wasted_tokens_priority": pol["priority"]["wasted_tokens"],
        "completed_share_every_tier": min(t["completed"] / t["count"] for t in p.values()),
    }
    return out


def print_report(res: dict, title: str = "") -> None:
    print(f"\nscenario {res['scenario']}{title}")
    head = (f"{'policy':<10}{'tier':<5}{'n':>4}{'done':>6}{'lat mean':>10}{'p50':>8}{'p99':>8}"
            f"{'ttft mean':>11}{'p99':>8}")
    print(head)
    rows = [(k, v["tiers"]) for k, v in res["policies"].items()] + [("alone", res["alone"])]
    for name, tiers in rows:
        for tier, t in tiers.items():
            print(f"{name:<10}{tier:<5}{t['count']:>4}{t['completed']:>6}{t['latency_mean_s'] or 0:>10.3f}"
                  f"{t['latency_p50_s']:>8.3f}{t['latency_p99_s']:>8.3f}{t['ttft_mean_s'] or 0:>11.3f}"
                  f"{t['ttft_p99_s']:>8.3f}")
    for name, r in res["policies"].items():
        costs = ", ".join(f"{m} {v:.3f}" for m, v in r["event_cost_vs_decode_step"].items() if v is not None)
        print(f"{name}: preemptions {r['preemptions']}, wasted {r['wasted_tokens']} tokens, recomputed "
              f"{r['recomputed_tokens']}, swapped {r['bytes_swapped'] / 2**20:.1f} MiB (both ways), "
              f"mean step {r['mean_step_s'] * 1e3:.1f} ms; one event in decode steps: {costs}")
    for k, v in res.get("goals", {}).items():
        print(f"  {k}: {v:.3f}")


if __name__ == "__main__":
    sys.exit(main())
