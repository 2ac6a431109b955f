"""Engine throughput against transformers, side by side in one run.

Runs the same greedy requests (random prompt tokens, fixed seed) through:
this engine; transformers' static-batch ``generate``; transformers' continuous
batching ``generate_batch``. Prints a table and writes JSON with
``engine_tok_s``, ``hf_generate_tok_s``, ``hf_generate_batch_tok_s`` and
``outputs_match`` (engine vs ``generate``, token for token). One untimed round of each runner at
full size comes first (the first round on a GPU pays for kernel selection and memory growth).

Where greedy outputs differ (expected in bf16: two correct implementations round differently, and a
random-weight model's best two logits are often a rounding apart), ``divergence`` says whether the
difference is rounding or a defect: at the first differing token, transformers' own forward over
the prompt and the engine's tokens so far ranks the engine's token (0: its best) and gives the
logit gap to its best. Rounding gives rank 0 or 1 and a gap near bf16's resolution; a defect
gives high ranks.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the first ids: the tiny tokenizers put special tokens there.
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def engine_runner(model_dir: str, prompts, new_tokens: int, device: str, dtype: str,
                  gpu_memory_utilization: float = 0.9) -> Callable[[], list[list[int]]]:
    from worker import Engine, EngineConfig, SamplingParams

    batch = len(prompts)
    cfg = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(1024, batch * len(prompts[0])),
                       device=device, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization)
    engine = Engine.from_pretrained(model_dir, cfg)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    _drain(engine, [("warmup", prompts[0][:8])], SamplingParams(max_tokens=4, ignore_eos=True))

    def run() -> list[list[int]]:
        out = _drain(engine, [(f"r{i}", p) for i, p in enumerate(prompts)], params)
        return [out[f"r{i}"] for i in range(batch)]
    return run


def _drain(engine, named_prompts, params) -> dict[str, list[int]]:
    for rid, p in named_prompts:
        engine.add_request(rid, p, params)
    out: dict[str, list[int]] = {rid: [] for rid, _ in named_prompts}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


def _load_hf(model_dir: str, device: str, dtype: str, attn: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation=attn)
    return model.to(device).eval()


def _gen_config(new_tokens: int, model):
    from transformers import GenerationConfig

    # No EOS: every request generates exactly new_tokens, like the engine's ignore_eos.
    return GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                            pad_token_id=model.generation_config.pad_token_id)


def hf_generate_runner(model_dir, prompts, new_tokens, device, dtype) -> Callable[[], list[list[int]]]:
    model = _load_hf(model_dir, device, dtype, "sdpa")
    ids = torch.tensor(prompts, device=device)
    gc = _gen_config(new_tokens, model)
    with torch.inference_mode():
        model.generate(ids[:1, :8], attention_mask=torch.ones_like(ids[:1, :8]),
                       generation_config=_gen_config(4, model))

    @torch.inference_mode()
    def run() -> list[list[int]]:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
        return out[:, ids.shape[1]:].tolist()
    run.model = model  # for divergence()
    return run


def divergence(model, prompts, engine_out, reference_out, device: str) -> list[dict]:
    """For each request whose outputs differ: the first differing index, and the reference model's rank of and
    logit gap to the engine's token there, given the engine's own tokens before it."""
    rows = []
    for i, (prompt, mine, ref) in enumerate(zip(prompts, engine_out, reference_out)):
        at = next((j for j, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
        if at is None:
            continue
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + mine[:at]], device=device)).logits[0, -1].float()
        chosen = logits[mine[at]]
        rows.append({"request": i, "index": at, "engine_token_rank": int((logits > chosen).sum()),
                     "logit_gap": float(logits.max() - chosen)})
    return rows


def hf_generate_batch_runner(model_dir, prompts, new_tokens, device, dtype) -> Callable[[], list[list[int]]]:
    model = _load_hf(model_dir, device, dtype, "sdpa")
    gc = _gen_config(new_tokens, model)
    with torch.inference_mode():
        model.generate_batch([prompts[0][:8]], generation_config=_gen_config(4, model))

    @torch.inference_mode()
    def run() -> list[list[int]]:
        res = model.generate_batch(prompts, generation_config=gc)
        return [list(r.generated_tokens) for r in res.values()]
    return run


def timed(fn: Callable[[], list[list[int]]]) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="model directory (e.g. built by make_tiny_model.py)")
    ap.add_argument("--batch", type=int, default=16, help="number of requests, all submitted at once")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed rounds; the runners take turns each round and the median is reported")
    ap.add_argument("--warmup-rounds", type=int, default=1, help="untimed full-size rounds first")
    ap.add_argument("--skip-generate-batch", action="store_true", help="skip transformers' generate_batch")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                    help="the engine's share of GPU memory (CUDA only; leave room for the transformers runners)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    prompts = make_prompts(args.batch, args.prompt_tokens, vocab, args.seed)
    total = args.batch * args.new_tokens

    print(f"{args.batch} requests x ({args.prompt_tokens} prompt + {args.new_tokens} new tokens), greedy, "
          f"{args.dtype} on {args.device}, {torch.get_num_threads()} threads, median of {args.repeats}", flush=True)
    factories = {"hf_generate": hf_generate_runner}
    if not args.skip_generate_batch:
        factories["hf_generate_batch"] = hf_generate_batch_runner
    runners = {"engine": engine_runner(args.model, prompts, args.new_tokens, args.device, args.dtype,
                                       args.gpu_memory_utilization)}
    runners.update({k: f(args.model, prompts, args.new_tokens, args.device, args.dtype) for k, f in factories.items()})
    times: dict[str, list[float]] = {k: [] for k in runners}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.warmup_rounds):
        for fn in runners.values():
            fn()
    # Take turns each round so machine noise hits every runner alike.
    for _ in tqdm(range(args.repeats), desc="rounds", file=sys.stderr):
        for k, fn in runners.items():
            sec, outputs[k] = timed(fn)
            times[k].append(sec)
    runs = {k: (statistics.median(v), outputs[k]) for k, v in times.items()}

    tok_s = {k: total / v[0] for k, v in runs.items()}
    eng_out, gen_out = runs["engine"][1], runs["hf_generate"][1]
    matching = sum(a == b for a, b in zip(eng_out, gen_out))
    print(f"\n{'runner':<22}{'seconds':>10}{'tokens/s':>12}{'engine / this':>16}")
    for k, (sec, _) in runs.items():
        print(f"{k:<22}{sec:>10.2f}{tok_s[k]:>12.1f}{tok_s['engine'] / tok_s[k]:>15.2f}x")
    print(f"\noutputs match generate (greedy): {matching}/{len(eng_out)} requests")
    diverged = divergence(runners["hf_generate"].model, prompts, eng_out, gen_out, args.device)
    if diverged:
        ranks = [d["engine_token_rank"] for d in diverged]
        gaps = [d["logit_gap"] for d in diverged]
        print(f"where they differ, first at token {min(d['index'] for d in diverged)} (median "
              f"{statistics.median(d['index'] for d in diverged):.0f}): transformers ranks the engine's token "
              f"{max(ranks)} at worst (0: its best; {sum(r <= 1 for r in ranks)}/{len(ranks)} within its best two), "
              f"logit gap at most {max(gaps):.3g} (median {statistics.median(gaps):.3g})")

    result = {
        "engine_tok_s": tok_s["engine"],
        "hf_generate_tok_s": tok_s["hf_generate"],
        "hf_generate_batch_tok_s": tok_s.get("hf_generate_batch"),
        "engine_vs_generate": tok_s["engine"] / tok_s["hf_generate"],
        "engine_vs_generate_batch": (tok_s["engine"] / tok_s["hf_generate_batch"]
                                     if "hf_generate_batch" in tok_s else None),
        "outputs_match": matching == len(eng_out),
        "requests_matching": matching,
        "divergence": diverged,
        "seconds": times,
        "settings": {**{k: v for k, v in vars(args).items() if k != "json"},
                     "torch": torch.__version__, "threads": torch.get_num_threads(),
                     "machine": platform.machine(), "python": platform.python_version()},
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
