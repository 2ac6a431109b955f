"""HTTP front door against the SDK path, side by side in one run on one cluster.

Starts a real local cluster (scripts/up.py: redis-server, a gateway, workers on the tiny model, and
the HTTP front door), then sends the same requests (token-id prompts, ``max_tokens`` tokens with
ignore_eos) through both paths, held open in one event loop: the async SDK (one client per
concurrent caller) and ``POST /v1/completions`` (httpx, one connection per caller).

- Added latency: one caller, the paths alternating request by request; the median of the paired
  differences (HTTP minus SDK) and their interquartile range.
- Throughput: batches at each concurrency, the paths alternating within each round; requests/s and
  p50/p99 latency (median over rounds, min..max spread), and the HTTP/SDK throughput ratio.
Writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
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


class Paths:
    """Both ways in, opened once in one event loop (as a long-running application would hold them)."""

    def __init__(self, state: dict, key: str, callers: int, max_tokens: int) -> None:
        import httpx

        from gateway.sdk import AsyncGatewayClient

        self.max_tokens = max_tokens
        self.sdk = [AsyncGatewayClient(state["gateway"], key, timeout_s=120) for _ in range(callers)]
        self.http = [httpx.AsyncClient(base_url=state["http"], timeout=120,
                                       headers={"Authorization": f"Bearer {key}", "X-Priority": "P1"})
                     for _ in range(callers)]

    async def one(self, path: str, caller: int, i: int) -> float:
        prompt = [5, 6, 7, i % 50 + 8]
        t0 = time.perf_counter()
        if path == "sdk":
            job = await self.sdk[caller].submit(prompt_token_ids=prompt, max_tokens=self.max_tokens,
                                                ignore_eos=True, tier="P1")
            await job.result(timeout=120)
        else:
            r = await self.http[caller].post("/v1/completions", json={
                "prompt": prompt, "max_tokens": self.max_tokens, "ignore_eos": True})
            r.raise_for_status()
        return time.perf_counter() - t0

    async def batch(self, path: str, n: int, callers: int) -> dict:
        """``n`` requests from ``callers`` concurrent callers: requests/s and latency percentiles."""
        latencies: list[float] = []

        async def caller(c: int) -> None:
            for i in range(n // callers):
                latencies.append(await self.one(path, c, i))

        t0 = time.perf_counter()
        await asyncio.gather(*(caller(c) for c in range(callers)))
        wall = time.perf_counter() - t0
        return {"rps": len(latencies) / wall, "p50_ms": 1000 * percentile(latencies, 0.5),
                "p99_ms": 1000 * percentile(latencies, 0.99)}

    async def paired(self, n: int) -> dict:
        """One caller, the two paths alternating request by request: the added latency as the median of
        paired differences (each pair ran at nearly the same moment, so machine noise mostly cancels)."""
        diffs, sdk, http = [], [], []
        for i in range(n):
            order = ("sdk", "http") if i % 2 == 0 else ("http", "sdk")
            got = {p: await self.one(p, 0, i) for p in order}
            sdk.append(got["sdk"])
            http.append(got["http"])
            diffs.append(got["http"] - got["sdk"])
        return {"sdk_p50_ms": 1000 * statistics.median(sdk), "http_p50_ms": 1000 * statistics.median(http),
                "added_ms_median": 1000 * statistics.median(diffs),
                "added_ms_iqr": [1000 * percentile(diffs, 0.25), 1000 * percentile(diffs, 0.75)]}

    async def close(self) -> None:
        for c in self.sdk:
            c.close()
        for h in self.http:
            await h.aclose()


async def run(state: dict, key: str, args, levels: list[int]) -> dict:
    paths = Paths(state, key, max(levels), args.max_tokens)
    try:
        await paths.batch("sdk", 8, 1)  # warm-up: model caches, connections
        await paths.batch("http", 8, 1)
        paired = await paths.paired(args.requests)
        results: dict[str, dict[int, list[dict]]] = {"sdk": {c: [] for c in levels}, "http": {c: [] for c in levels}}
        for r in range(args.rounds):
            for c in levels:
                for path in (("sdk", "http") if r % 2 == 0 else ("http", "sdk")):
                    results[path][c].append(await paths.batch(path, args.requests, c))
        return {"paired": paired, "batches": results}
    finally:
        await paths.close()


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
                           "--model", args.model, "--state-file", str(state_file), "--max-running", "16",
                           "--logs-dir", str(tmp / "logs")],
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
        figures = asyncio.run(run(state, key, args, levels))
    finally:
        up.terminate()
        up.wait(timeout=60)
    shutil.rmtree(tmp, ignore_errors=True)  # it went well: the logs (kept on a failure) tell nothing more
    results, paired = figures["batches"], figures["paired"]
    print(f"one caller, paths alternating per request ({args.requests} pairs): SDK p50 {paired['sdk_p50_ms']:.1f} ms, "
          f"HTTP p50 {paired['http_p50_ms']:.1f} ms, added {paired['added_ms_median']:+.1f} ms "
          f"(IQR {paired['added_ms_iqr'][0]:+.1f}..{paired['added_ms_iqr'][1]:+.1f})")
    rows = []
    print(f"{'concurrency':>11} {'path':>5} {'req/s':>16} {'p50 ms':>16} {'p99 ms':>16}")
    for c in levels:
        summary = {}
        for path in ("sdk", "http"):
            runs = results[path][c]
            summary[path] = {k: statistics.median(x[k] for x in runs) for k in ("rps", "p50_ms", "p99_ms")}
            spread = {k: (min(x[k] for x in runs), max(x[k] for x in runs)) for k in ("rps", "p50_ms", "p99_ms")}
            summary[path]["spread"] = spread
            print(f"{c:>11} {path:>5} " + " ".join(f"{summary[path][k]:>7.1f} ({spread[k][0]:.0f}..{spread[k][1]:.0f})"
                                                   for k in ("rps", "p50_ms", "p99_ms")))
        added = summary["http"]["p50_ms"] - summary["sdk"]["p50_ms"]
        ratio = summary["http"]["rps"] / summary["sdk"]["rps"]
        print(f"{c:>11}  http/sdk throughput {ratio:.2f}x, added p50 latency {added:+.1f} ms")
        rows.append({"concurrency": c, "sdk": summary["sdk"], "http": summary["http"], "rps_ratio": ratio,
                     "added_p50_ms": added})
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "paired": paired,
                                         "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
