"""What the sampling extras cost the sampler: one step's pick for a batch, with no request penalised, one, or all
(presence + frequency + repetition penalties), and with every request held back by min_tokens.

The sampler alone, on random logits of a Llama-3-sized vocabulary, as decode steps: each pick's token joins its
request's output, as in the engine (a penalised request's counts are kept between steps and take only the new
tokens: worker/logit_extras.py). The configurations take turns each round, so that machine noise hits them alike.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def requests(batch: int, prompt: int, output: int, vocab: int, penalised: int, min_tokens: bool, greedy: bool,
             picks: int):
    from common.tiers import Tier
    from worker.request import Request, SamplingParams

    rng = random.Random(0)
    out = []
    for i in range(batch):
        pen = i < penalised
        params = SamplingParams(max_tokens=output + picks + 16, temperature=0.0 if greedy else 0.8, top_p=1.0,
                                presence_penalty=0.5 if pen else 0.0, frequency_penalty=0.3 if pen else 0.0,
                                repetition_penalty=1.2 if pen else 1.0, stop_token_ids=(1, 2, 3),
                                min_tokens=output + picks + 8 if min_tokens else 0)
        r = Request(f"r{i}", [rng.randrange(vocab) for _ in range(prompt)], params, Tier.P3, arrival_seq=i, seed=i)
        r.output_token_ids.extend(rng.randrange(vocab) for _ in range(output))
        out.append(r)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--output", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=10, help="picks timed per round and configuration")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    import torch

    from worker.sampler import Sampler

    torch.set_num_threads(a.threads)
    sampler = Sampler(torch.device("cpu"), (0,))
    logits = torch.randn(a.batch, a.vocab)
    configs = {
        "plain": dict(penalised=0, min_tokens=False), "one penalised": dict(penalised=1, min_tokens=False),
        "all penalised": dict(penalised=a.batch, min_tokens=False),
        "all min_tokens": dict(penalised=0, min_tokens=True),
    }
    out = []
    for greedy in (True, False):
        batches = {name: requests(a.batch, a.prompt, a.output, a.vocab, greedy=greedy, picks=a.rounds * a.steps, **c)
                   for name, c in configs.items()}
        times: dict[str, list[float]] = {name: [] for name in batches}
        for _ in range(a.rounds):
            for name, reqs in batches.items():
                for _ in range(a.steps):
                    t = time.perf_counter()
                    picked = sampler.sample(logits, reqs)
                    times[name].append(time.perf_counter() - t)
                    for r, token in zip(reqs, picked):
                        r.output_token_ids.append(token)
        plain = statistics.median(times["plain"])
        for name, ts in times.items():
            ms = 1e3 * statistics.median(ts)
            row = {"greedy": greedy, "config": name, "batch": a.batch, "vocab": a.vocab, "prompt": a.prompt,
                   "output": a.output, "median_ms": ms, "p90_ms": 1e3 * statistics.quantiles(ts, n=10)[-1],
                   "over_plain": ms / (1e3 * plain)}
            out.append(row)
            print(f"{'greedy' if greedy else 'sampled'} {name:15s} {ms:7.2f} ms a pick of {a.batch} "
                  f"(p90 {row['p90_ms']:.2f}); x{row['over_plain']:.2f} of plain")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
