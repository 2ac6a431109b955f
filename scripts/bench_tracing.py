"""What tracing costs the engine: the same preempting workload with tracing off and on, in one run.

"On" is the configuration the cluster uses: the OpenTelemetry SDK with a BatchSpanProcessor
exporting OTLP-JSON lines to a file, every request, suspended-period and preemption-decision
span recorded. "Off" is the API's no-op tracer. Rounds alternate off/on on one model and KV
pool; the median tokens/s of each is reported, and their ratio (goal: at least 0.95).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def workload(vocab: int, seed: int) -> list[tuple[int, str, str, list[int], int]]:
    """(step to add at, request id, tier, prompt, max_tokens): a P3 flood and P0 turns arriving during it."""
    rng = random.Random(seed)
    out = [(0, f"p3-{i}", "P3", [rng.randrange(3, vocab) for _ in range(64)], 96) for i in range(20)]
    out += [(10 + 6 * i, f"p0-{i}", "P0", [rng.randrange(3, vocab) for _ in range(32)], 16) for i in range(12)]
    return out


def run(engine, jobs) -> tuple[float, int, int]:
    from worker import SamplingParams

    pending = sorted(jobs)
    step = tokens = 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, tier, prompt, n = pending.pop(0)
            engine.add_request(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True), tier=tier)
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        step += 1
    return time.perf_counter() - t0, tokens, sum(engine.stats().by_mode().values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / ".models" / "bench-llama-32m",
                    help="model directory (built from models/configs/bench-llama-32m.json when missing)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from opentelemetry.exporter.otlp.json.file import FileSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace import NoOpTracerProvider
    from transformers.utils import logging as hf_logging

    from worker import EngineConfig
    from worker.engine import Engine
    from worker.model_runner import ModelRunner, load_model
    from worker.tracing import EngineTracer

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    from scripts.make_tiny_model import ensure

    ensure("bench-llama-32m.json", args.model)
    cfg = EngineConfig(max_num_seqs=16)
    runner = ModelRunner(load_model(args.model, cfg), cfg)
    jobs = workload(runner.info.vocab_size, args.seed)
    spans_file = Path(tempfile.mkdtemp(prefix="ts-bench-tracing-")) / "spans.jsonl"
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(FileSpanExporter(spans_file)))
    tracers = {"off": NoOpTracerProvider().get_tracer("bench"), "on": provider.get_tracer("bench")}
    run(Engine(runner, cfg, EngineTracer(tracers["off"])), jobs[:4])  # warm-up
    results: dict[str, list[float]] = {"off": [], "on": []}
    preemptions = {}
    for r in range(args.rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            seconds, tokens, preemptions[mode] = run(Engine(runner, cfg, EngineTracer(tracers[mode])), jobs)
            results[mode].append(tokens / seconds)
            print(f"round {r + 1} tracing {mode:>3}: {tokens / seconds:8.1f} tokens/s, "
                  f"{preemptions[mode]} preemptions", flush=True)
    provider.shutdown()
    spans = sum(len(rs["scopeSpans"][0]["spans"]) for line in spans_file.read_text().splitlines()
                for rs in json.loads(line)["resourceSpans"])
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    print(f"\nmedian tokens/s: tracing off {off:.1f}, on {on:.1f}; on / off = {on / off:.3f} "
          f"({spans} spans exported to {spans_file})")
    if args.json:
        args.json.write_text(json.dumps({"off_tok_s": results["off"], "on_tok_s": results["on"],
                                         "ratio_on_over_off": on / off, "spans_exported": spans,
                                         "preemptions_per_run": preemptions}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
