"""Engine demo: mixed requests join a running batch; prints per-request latency and tokens/s.

Requests of every tier, short and long prompts, greedy and sampled, arrive
while earlier ones are still decoding; the engine schedules them by tier and
preempts lower tiers for higher ones at step boundaries.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass

from tqdm import tqdm


@dataclass
class Planned:
    request_id: str
    tier: str
    arrive_s: float
    prompt: str
    max_tokens: int
    temperature: float


PROMPTS = [
    "Summarise the following document in three sentences.",
    "Hello, world! What is the weather like today?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Translate this paragraph into French. " * 6,
    "A priority-tiered serving cluster admits jobs from many tenants. " * 10,
]


def plan(n: int, seed: int) -> list[Planned]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tier = rng.choice(["P0", "P1", "P2", "P3"])
        out.append(Planned(f"req-{i:02d}", tier, arrive_s=round(i * 0.15, 2), prompt=rng.choice(PROMPTS),
                           max_tokens=rng.choice([16, 32, 64, 96]), temperature=rng.choice([0.0, 0.0, 0.8])))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="model directory (make_tiny_model.py output or any HF causal LM)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from worker import Engine, EngineConfig, SamplingParams

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(args.model)
    engine = Engine.from_pretrained(args.model, EngineConfig(device=args.device, max_num_seqs=8,
                                                             max_num_batched_tokens=256))
    pending = plan(args.requests, args.seed)
    tokens: dict[str, list[int]] = {p.request_id: [] for p in pending}
    prompt_len: dict[str, int] = {}
    first: dict[str, float] = {}  # seconds from start to the first token
    done: dict[str, float] = {}  # seconds from start to the last token
    start = time.monotonic()
    bar = tqdm(total=sum(p.max_tokens for p in pending), unit="tok", desc="generating", file=sys.stderr)
    queue = list(pending)
    while queue or engine.has_unfinished():
        now = time.monotonic() - start
        while queue and queue[0].arrive_s <= now:
            p = queue.pop(0)
            ids = tok(p.prompt).input_ids
            prompt_len[p.request_id] = len(ids)
            engine.add_request(p.request_id, ids, SamplingParams(max_tokens=p.max_tokens,
                               temperature=p.temperature, seed=args.seed, ignore_eos=True), tier=p.tier)
        if not engine.has_unfinished():
            time.sleep(max(0.0, queue[0].arrive_s - now))  # idle until the next arrival
            continue
        outs = engine.step()
        now = time.monotonic() - start
        for out in outs:
            tokens[out.request_id].extend(out.new_token_ids)
            first.setdefault(out.request_id, now)
            bar.update(len(out.new_token_ids))
            if out.finished:
                done[out.request_id] = now
    bar.close()
    wall = time.monotonic() - start

    print(f"\n{'request':<8}{'tier':>5}{'prompt':>8}{'output':>8}{'arrive s':>10}{'TTFT s':>8}{'latency s':>11}"
          f"{'tok/s':>8}  text")
    total = 0
    for p in pending:
        n = len(tokens[p.request_id])
        total += n
        latency = done[p.request_id] - p.arrive_s
        ttft = first[p.request_id] - p.arrive_s
        # A random-weight model mostly emits ids its small tokenizer cannot spell; show ids then.
        text = tok.decode(tokens[p.request_id][:12], skip_special_tokens=True).strip()[:28] or str(
            tokens[p.request_id][:4])[:-1] + ", ...]"
        print(f"{p.request_id:<8}{p.tier:>5}{prompt_len[p.request_id]:>8}{n:>8}{p.arrive_s:>10.2f}{ttft:>8.2f}"
              f"{latency:>11.2f}{n / latency:>8.1f}  {text}")
    print(f"\n{len(pending)} requests, {total} tokens in {wall:.2f} s: {total / wall:.1f} tokens/s overall; "
          f"KV blocks in use at the end: {engine.kv_usage().num_used}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
