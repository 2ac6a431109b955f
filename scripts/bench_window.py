"""Decode step time of a sliding-window model against the same weights attending to the whole context.

The bench model's shapes (models/configs/bench-llama-32m.json) as a Mistral, built twice from one seed: with a
``--window``-token sliding window on every layer, and without one. N sequences are prefilled to each
``--context``, then decode steps are timed, the two models taking turns each round so that machine noise hits
both alike. A windowed layer's decode should cost what its window holds, not what the context does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_NEW = 256  # more than every timed step


def model_dir(window: int | None, out: Path) -> Path:
    from scripts.make_tiny_model import build

    name = f"bench-mistral-w{window}" if window else "bench-mistral-full"
    if not (out / name / "config.json").exists():
        cfg = json.loads((ROOT / "models" / "configs" / "bench-llama-32m.json").read_text())
        cfg.update(model_type="mistral", sliding_window=window, max_position_embeddings=16384)
        cfg.pop("architectures", None)
        (out / f"{name}.json").write_text(json.dumps(cfg))
        build(out / f"{name}.json", out / name)
    return out / name


def prefilled(path: Path, batch: int, context: int):
    from worker import Engine, EngineConfig, SamplingParams

    engine = Engine.from_pretrained(str(path), EngineConfig(
        device="cpu", dtype="float32", max_num_seqs=batch, max_num_batched_tokens=2048, max_model_len=16384,
        num_kv_blocks=batch * -(-(context + _NEW) // 16) + 16, swap_space_mb=0))
    for i in range(batch):
        engine.add_request(f"r{i}", [3 + (i * 7 + j) % 8000 for j in range(context)],
                           SamplingParams(max_tokens=_NEW, ignore_eos=True))
    while any(engine.get_request(f"r{i}").num_computed_tokens < context for i in range(batch)):
        engine.step()
    engine.step()  # the first decode, which may still build groups
    return engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--context", type=int, nargs="+", default=[2048, 6000])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="decode steps timed per round and model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", type=Path, default=ROOT / ".models", help="where the two models are built")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    a.models.mkdir(parents=True, exist_ok=True)
    dirs = {"windowed": model_dir(a.window, a.models), "full": model_dir(None, a.models)}
    out = []
    for context in a.context:
        engines = {name: prefilled(path, a.batch, context) for name, path in dirs.items()}
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(a.rounds):
            for name, engine in engines.items():
                for _ in range(a.steps):
                    t = time.perf_counter()
                    engine.step()
                    times[name].append(time.perf_counter() - t)
        row = {"context": context, "window": a.window, "batch": a.batch,
               **{f"{name}_ms": 1e3 * statistics.median(ts) for name, ts in times.items()}}
        row["full_over_windowed"] = row["full_ms"] / row["windowed_ms"]
        out.append(row)
        print(f"context {context}: windowed ({a.window}) {row['windowed_ms']:.1f} ms, full {row['full_ms']:.1f} ms "
              f"a decode step of {a.batch}; full / windowed {row['full_over_windowed']:.2f}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
