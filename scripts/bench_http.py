"""HTTP front door against the SDK path, side by side in one run on one cluster.

Starts a real local cluster (scripts/up.py: redis-server, a gateway, workers on the tiny model, and
the HTTP front door), then sends the same requests (token-id prompts, ``max_tokens`` tokens with
ignore_eos) through both paths at each concurrency: the async SDK (one client per concurrent
caller) and ``POST /v1/completions`` (httpx, one connection per caller). Paths alternate within
each round, so machine noise falls on both alike. Reports requests/s and the latency of whole
requests (p50 and p99, median over rounds with the min..max spread), and the front door's added
latency (HTTP p50 minus SDK p50) and throughput ratio. Writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run_sdk(state: dict, key: str, n: int, concurrency: int, max_tokens: int) -> list[float]:
    from gateway.sdk import AsyncGatewayClient

    clients = [AsyncGatewayClient(state["gateway"], key, timeout_s=120) for _ in range(concurrency)]
    latencies: list[float] = []

    async def caller(client, count: int) -> None:
        for i in range(count):
            t0 = time.perf_counter()
            job = await client.submit(prompt_token_ids=[5, 6, 7, i % 50 + 8], max_tokens=max_tokens,
                                      ignore_eos=True, tier="P1")
            await job.result(timeout=120)
            latencies.append(time.perf_counter() - t0)

    try:
        await asyncio.gather(*(caller(c, n // concurrency) for c in clients))
    finally:
        for c in clients:
            c.close()
    return latencies


async def run_http(state: dict, key: str, n: int, concurrency: int, max_tokens: int) -> list[float]:
    import httpx

    latencies: list[float] = []
    headers = {"Authorization": f"Bearer {key}", "X-Priority": "P1"}

    async def caller(count: int) -> None:
        async with httpx.AsyncClient(base_url=state["http"], timeout=120) as h:
            for i in range(count):
                t0 = time.perf_counter()
                r = await h.post("/v1/completions", headers=headers, json={
                    "prompt": [5, 6, 7, i % 50 + 8], "max_tokens": max_tokens, "ignore_eos": True})
                r.raise_for_status()
                latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(caller(n // concurrency) for _ in range(concurrency)))
    return latencies


def measure(state: dict, key: str, path: str, n: int, concurrency: int, max_tokens: int) -> dict:
    fn = run_sdk if path == "sdk" else run_http
    t0 = time.perf_counter()
    lat = asyncio.run(fn(state, key, n, concurrency, max_tokens))
    wall = time.perf_counter() - t0
    return {"rps": len(lat) / wall, "p50_ms": 1000 * percentile(lat, 0.5), "p99_ms": 1000 * percentile(lat, 0.99)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64, help="requests per path, concurrency and round")
    ap.add_argument("--concurrency", default="1,8", help="comma-separated concurrent callers")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--model", default="tiny", help="tiny | bench | a model directory (as up.py)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-http-"))
    state_file = tmp / "cluster.json"
    up = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "up.py"), "--workers", str(args.workers),
                           "--model", args.model, "--state-file", str(state_file), "--max-running", "16"],
                          cwd=ROOT, stdout=(tmp / "up.log").open("w"), stderr=subprocess.STDOUT,
                          env=dict(os.environ, OTEL_TRACES_EXPORTER="none"))
    try:
        deadline = time.monotonic() + 300
        while not state_file.exists():
            if up.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"cluster did not start; see {tmp / 'up.log'}")
            time.sleep(0.2)  # waiting for the launcher's state file, bounded
        state = json.loads(state_file.read_text())
        key = state["tenants"]["api-co"]["api_key"]
        measure(state, key, "sdk", 8, 1, args.max_tokens)  # warm-up: model caches, connections
        measure(state, key, "http", 8, 1, args.max_tokens)
        results: dict[str, dict[int, list[dict]]] = {"sdk": {c: [] for c in levels}, "http": {c: [] for c in levels}}
        for r in range(args.rounds):
            for c in levels:
                for path in (("sdk", "http") if r % 2 == 0 else ("http", "sdk")):
                    results[path][c].append(measure(state, key, path, args.requests, c, args.max_tokens))
    finally:
        up.terminate()
        up.wait(timeout=60)
    rows = []
    print(f"{'concurrency':>11} {'path':>5} {'req/s':>16} {'p50 ms':>16} {'p99 ms':>16}")
    for c in levels:
        summary = {}
        for path in ("sdk", "http"):
            runs = results[path][c]
            summary[path] = {k: statistics.median(x[k] for x in runs) for k in ("rps", "p50_ms", "p99_ms")}
            spread = {k: (min(x[k] for x in runs), max(x[k] for x in runs)) for k in ("rps", "p50_ms", "p99_ms")}
            summary[path]["spread"] = spread
            print(f"{c:>11} {path:>5} " + " ".join(
                f"{summary[path][k]:>7.1f} ({spread[k][0]:.0f}..{spread[k][1]:.0f})" for k in ("rps", "p50_ms", "p99_ms")))
        added = summary["http"]["p50_ms"] - summary["sdk"]["p50_ms"]
        ratio = summary["http"]["rps"] / summary["sdk"]["rps"]
        print(f"{c:>11}  http/sdk throughput {ratio:.2f}x, added p50 latency {added:+.1f} ms")
        rows.append({"concurrency": c, "sdk": summary["sdk"], "http": summary["http"], "rps_ratio": ratio,
                     "added_p50_ms": added})
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
