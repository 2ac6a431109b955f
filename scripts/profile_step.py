"""Where a decode step's time goes: the host launching kernels, or the device running them.

Runs N sequences at context C through this engine (and, with --hf, through transformers' own
forward with its DynamicCache, the same weights), times decode steps, then profiles a few with
torch.profiler and cProfile and prints per step: wall time, device busy time (the sum of kernel
times), kernels launched, this machine's cost of one launch measured on a trivial kernel (eager,
and replayed from a CUDA graph), and the operators and Python functions the host spends the
step in (a wait for the device shows as the call that waits). A step far above its device time
is bound by the host, not by the device: near launches x launch cost, the cure is fewer launches
(CUDA graphs, fused kernels); well above it, the Python functions say where. Writes JSON with --json.

    scripts/profile_step.py --model DIR --device cuda --dtype bfloat16 --batch 16 --context 64 --hf
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.bench_decode_step import build  # noqa: E402

_LAUNCH_NAMES = ("LaunchKernel", "cudaMemcpyAsync", "cudaMemsetAsync", "cuLaunch", "cudaGraphLaunch")


def launch_cost_us(device: str, n: int = 2000) -> dict[str, float]:
    """Microseconds per launch of a one-element add: eager, and inside a replayed CUDA graph."""
    x = torch.zeros(1, device=device)
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    torch.cuda.synchronize()
    eager = (time.perf_counter() - t0) / n * 1e6
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            for _ in range(200):
                x.add_(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    return {"eager_us": eager, "graph_us": (time.perf_counter() - t0) / (10 * 200) * 1e6}


def measure(step: Callable[[], None], steps: int, profiled: int, cuda: bool) -> dict:
    for _ in range(5):
        step()
    wall = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()  # each step ends in a host read of the sampled tokens: the device has finished
        wall.append(time.perf_counter() - t0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(profiled):
            step()
    kernels: dict[str, float] = {}
    launches = 0
    for e in prof.events():
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] = kernels.get(e.name, 0.0) + e.time_range.elapsed_us()
        elif any(k in e.name for k in _LAUNCH_NAMES):
            launches += 1
    # Python's view: the functions that hold the host longest (a wait for the device shows as the call that waits).
    py = cProfile.Profile()
    py.enable()
    for _ in range(profiled):
        step()
    py.disable()
    stats = pstats.Stats(py).stats  # {(file, line, name): (calls, ncalls, tottime, cumtime, callers)}
    py_top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:10]
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:8]
    # Host side: the operators whose own CPU time (children excluded) is largest.
    host = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:8]
    return {"wall_ms": statistics.median(wall) * 1e3, "device_busy_ms": sum(kernels.values()) / profiled / 1e3,
            "launches_per_step": launches / profiled,
            "host_self_ms_per_step": sum(e.self_cpu_time_total for e in prof.key_averages()) / profiled / 1e3,
            "top_host_ops_ms_per_step": {a.key[:90]: [a.self_cpu_time_total / profiled / 1e3, a.count // profiled]
                                         for a in host},
            "top_kernels_ms_per_step": {k[:90]: v / profiled / 1e3 for k, v in top},
            "top_python_ms_per_step": {f"{Path(f).name}:{line}({name})": [t / profiled * 1e3, n // profiled]
                                       for (f, line, name), (_, n, t, _, _) in py_top}}


def engine_step(model: str, prompts: list[list[int]], device: str, dtype: str) -> Callable[[], None]:
    engine = build(model, prompts, device, dtype)
    return lambda: engine.step()


def hf_step(model_dir: str, prompts: list[list[int]], device: str, dtype: str) -> Callable[[], None]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        out = model(ids, use_cache=True)
    state = {"past": out.past_key_values, "next": out.logits[:, -1].argmax(-1, keepdim=True)}

    @torch.inference_mode()
    def step() -> None:
        out = model(state["next"], past_key_values=state["past"], use_cache=True)
        state["next"] = out.logits[:, -1].argmax(-1, keepdim=True)
        state["next"].tolist()
    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed (after 5 of warm-up)")
    ap.add_argument("--profiled", type=int, default=3, help="decode steps profiled")
    ap.add_argument("--hf", action="store_true", help="also transformers' own forward with its DynamicCache")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")  # printed once per step
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    rng = random.Random(0)
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.context)] for _ in range(args.batch)]
    cuda = args.device.startswith("cuda")
    result: dict = {"settings": {k: str(v) for k, v in vars(args).items() if k != "json"},
                    "torch": torch.__version__}
    if cuda:
        result["device_name"] = torch.cuda.get_device_name(args.device)
        result["launch_cost"] = launch_cost_us(args.device)
        print(f"{result['device_name']}: one kernel launch {result['launch_cost']['eager_us']:.1f} us eager, "
              f"{result['launch_cost']['graph_us']:.1f} us replayed from a CUDA graph")
    runners = {"engine": engine_step} | ({"hf": hf_step} if args.hf else {})
    print(f"{args.batch} sequences at context {args.context}, {args.dtype} on {args.device}")
    for name, factory in runners.items():
        r = measure(factory(args.model, prompts, args.device, args.dtype), args.steps, args.profiled, cuda)
        result[name] = r
        line = (f"  {name:<7} step {r['wall_ms']:7.2f} ms wall, {r['host_self_ms_per_step']:7.2f} ms in profiled "
                f"operators on the host, {r['launches_per_step']:5.0f} launches")
        if cuda:
            bound = r["launches_per_step"] * result["launch_cost"]["eager_us"] / 1e3
            line += f", device busy {r['device_busy_ms']:6.2f} ms, launches x launch cost {bound:6.2f} ms"
        print(line, flush=True)
        print("    host, own time per step (calls):")
        for k, (ms, calls) in r["top_host_ops_ms_per_step"].items():
            print(f"      {ms:7.3f} ms  ({calls:4d})  {k}")
        print("    Python functions, own time per step (calls):")
        for k, (ms, calls) in r["top_python_ms_per_step"].items():
            print(f"      {ms:7.3f} ms  ({calls:4d})  {k}")
        if cuda:
            print("    device kernels, time per step:")
        for k, v in r["top_kernels_ms_per_step"].items():
            print(f"      {v:7.3f} ms  {k}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
