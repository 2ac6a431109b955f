"""Decode step time when one long sequence joins short ones, side by side in one run.

Scenario "uniform": N sequences at context C. Scenario "one-long": N-1 at C and
one at L. Every sequence is prefilled first; then decode steps (every
sequence decodes one token per step) are timed, the scenarios taking turns
each round so machine noise hits both alike. Prints the median step times
(on CUDA also the bound set by reading every weight and cached K/V once at
``--hbm-gbps``) and their ratio (the paged attention's cost should follow the tokens in the
batch, not batch x longest context), and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch


_MAX_NEW = 256  # more than warm-up plus every timed step


def build(model: str, prompts: list[list[int]], device: str, dtype: str):
    from worker import Engine, EngineConfig, SamplingParams

    longest = max(len(p) for p in prompts)
    blocks = sum(-(-(len(p) + _MAX_NEW) // 16) for p in prompts) + 16
    cfg = EngineConfig(max_num_seqs=len(prompts), max_num_batched_tokens=max(2048, longest), device=device,
                       dtype=dtype, num_kv_blocks=blocks, swap_space_mb=0)
    engine = Engine.from_pretrained(model, cfg)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=_MAX_NEW, ignore_eos=True))
    while any(engine.get_request(f"r{i}").num_computed_tokens < len(p) for i, p in enumerate(prompts)):
        engine.step()
    return engine


def timed_steps(engine, n: int, clock=time.perf_counter) -> list[float]:
    out = []
    for _ in range(n):
        t0 = clock()
        engine.step()  # ends in the sampler's .tolist(): the device has finished the step
        out.append(clock() - t0)
    return out


def bandwidth_bound_s(engine, hbm_bytes_per_s: float) -> float:
    """A decode step reads every weight and every cached K/V at least once: its time at full HBM bandwidth."""
    r = engine.runner
    weights = sum(p.numel() * p.element_size() for p in r.model.parameters())
    context = sum(req.num_tokens for req in engine._requests.values())
    return (weights + context * r.bytes_per_block / r.block_size) / hbm_bytes_per_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64, help="context of the short sequences")
    ap.add_argument("--long-context", type=int, default=2048, help="context of the one long sequence")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per round and scenario")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--hbm-gbps", type=float, default=4800.0,
                    help="device memory bandwidth for the bound printed on CUDA (H200: 4800 GB/s)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time (steadier than wall time on a shared, oversubscribed CPU "
                         "machine; meaningless on CUDA)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    short = [prompt(args.context) for _ in range(args.batch)]
    engines = {"uniform": build(args.model, short, args.device, args.dtype),
               "one-long": build(args.model, short[:-1] + [prompt(args.long_context)], args.device, args.dtype)}
    for e in engines.values():
        timed_steps(e, 2)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(args.rounds):
        for k, e in engines.items():
            times[k] += timed_steps(e, args.steps, time.process_time if args.clock == "cpu" else time.perf_counter)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["one-long"] / med["uniform"]
    print(f"{args.batch} decoding sequences at context {args.context}; one-long: one of them at "
          f"{args.long_context}; {torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} steps, "
          f"{args.clock} clock")
    bound = {k: bandwidth_bound_s(e, args.hbm_gbps * 1e9) for k, e in engines.items()}
    for k, v in times.items():
        extra = (f"; bandwidth bound {bound[k] * 1e3:.2f} ms = {bound[k] / med[k]:.0%} of it"
                 if args.device.startswith("cuda") else "")
        print(f"  {k:<10} median step {med[k] * 1e3:8.1f} ms  (min {min(v) * 1e3:.1f}, max {max(v) * 1e3:.1f}){extra}")
    print(f"  one-long / uniform: {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"median_step_s": med, "ratio": ratio, "step_s": times,
                                         "bandwidth_bound_s": bound,
                                         "settings": {k: v for k, v in vars(args).items() if k != "json"}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
