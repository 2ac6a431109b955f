"""The local cluster scripts/up.py runs, as a class a script can start in-process too (the demo, benchmarks): its
processes (redis-server, gateways, workers, the HTTP front door), launched on free loopback ports with their keys,
secrets and development tenants, restarted as they were when they die, and stopped with their secrets removed."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import keys as curve_keys
from common.process import die_with_parent
from common.ports import free_port
from common.redis_server import RedisServer
from common.tracing import SPANS_FILE_ENV
from scripts.leftovers import LEFTOVERS_FILE, LeftoversGuard
from scripts.readiness import port_free, wait_gateway, wait_http
from scripts.supervisor import Supervisor
from scripts.up_files import SECRETS_PREFIX, sweep_leftovers

ROOT = Path(__file__).resolve().parent.parent

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
        self.procs: dict[str, subprocess.Popen] = {}  # "gw-0", "wk-0", ...: the current process of each
        self.commands: dict[str, tuple[list[str], dict, Path]] = {}  # how to start each one again
        self.redis: RedisServer | None = None
        self.metrics: list[str] = []  # every process's /metrics URL
        if args.logs_dir:
            args.logs_dir.mkdir(parents=True, exist_ok=True)
        self.tmp = args.logs_dir or Path(tempfile.mkdtemp(prefix="ts-cluster-"))  # logs and spans: kept
        sweep_leftovers(args.state_file)
        self.secrets = Path(tempfile.mkdtemp(prefix=SECRETS_PREFIX))  # removed by stop()
        # Removes it (and Redis's folder, the state file) if we are killed outright; its record in the folder lets
        # a later run's sweep do it if the guard dies with us.
        self.guard = LeftoversGuard(self.secrets / LEFTOVERS_FILE)
        self.guard.remove_dir(self.secrets)

    def start(self) -> dict:
        a = self.args
        if a.http and a.http_port and not port_free(a.http_port):
            # Its front door would die at once, and the probe could take the other server's answer for its own.
            raise RuntimeError(f"--http-port {a.http_port} is in use (another server listens on it); "
                               "pick another, or 0 for a free one")
        model = resolve_model(a.model)
        self.redis = RedisServer(appendonly=True, password=secrets.token_hex(24))
        self.redis.start()
        self.guard.remove_dir(self.redis.dir)  # redis.conf holds its password, the AOF the jobs
        password_file = self.secrets / "redis-password"
        password_file.touch(mode=0o600)
        password_file.write_text(self.redis.password)
        # At least one worker key: a gateway refuses to start with an empty allow-list (--workers 0 starts one).
        key_paths = curve_keys.generate(self.secrets / "keys", [f"wk-{i}" for i in range(max(1, a.workers))])
        tenants = write_tenants(self.secrets / "tenants.toml")
        # CPU workers split the cores; each torch pool spinning on all of them would thrash. A count set in the
        # environment wins: the cores may be shared beyond this cluster (test runs side by side: tests/conftest.py).
        threads = os.environ.get("TS_WORKER_TORCH_THREADS") or max(1, (os.cpu_count() or 1) // max(1, a.workers))
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
            self._spawn(f"gw-{g}", [sys.executable, "-m", "gateway", "--client-bind", client_ep, "--worker-bind",
                                    worker_ep, "--tenants-file",
                                    str(self.secrets / "tenants.toml"), "--gateway-id", f"gw-{g}"],
                        env | self._metrics_env("TS_GATEWAY_"), self.tmp / f"gateway-{g}.log")
        for i in range(a.workers):
            cmd = [sys.executable, "-m", "worker", "--worker-id", f"wk-{i}", "--model", str(model),
                   "--max-num-seqs", str(a.max_running)]
            for g in gateways:
                cmd += ["--gateway", g["worker_endpoint"]]
            if a.kv_blocks:
                cmd += ["--num-kv-blocks", str(a.kv_blocks)]
            cmd += ["--drain-timeout-s", str(a.drain_s)]
            self._spawn(f"wk-{i}", cmd, env | self._metrics_env("TS_WORKER_")
                        | {"TS_WORKER_CURVE_SECRET_KEY_FILE": str(key_paths[f"worker:wk-{i}"])},
                        self.tmp / f"worker-{i}.log")
        http = self._spawn_http(env, model, gateways, tenants["lab-co"]["api_key"]) if a.http else None
        state = {"gateway": gateways[0]["endpoint"], "gateways": gateways, "redis": self.redis.url,
                 "key_prefix": "ts", "tenants": tenants, "spans_file": spans_file, "logs": str(self.tmp),
                 "http": http, "metrics": self.metrics,
                 "keys": {"dir": str(self.secrets / "keys"), "gateway_public": str(key_paths["gateway_public"]),
                          "worker_secrets": {f"wk-{i}": str(key_paths[f"worker:wk-{i}"])
                                             for i in range(max(1, a.workers))}}}
        for g in gateways:
            wait_gateway(g["endpoint"], tenants["lab-co"]["api_key"], a.workers, a.ready_timeout,
                         self._raise_if_one_exited, self.tmp)
        if http:
            wait_http(http, a.ready_timeout, self._raise_if_one_exited, self.tmp / "http.log")
        return self.with_pids(state, self.pids())

    def _spawn_http(self, env: dict, model: Path, gateways: list[dict], health_key: str) -> str:
        """The OpenAI-compatible front door; its base URL (without /v1)."""
        port = self.args.http_port or free_port()
        cmd = [sys.executable, "-m", "gateway.http", "--port", str(port), "--tokenizer", str(model)]
        for g in gateways:
            cmd += ["--gateway", g["endpoint"]]
        self._spawn("http", cmd, env | {"TS_HTTP_HEALTH_API_KEY": health_key}, self.tmp / "http.log")
        self.metrics.append(f"http://127.0.0.1:{port}/metrics")  # the front door serves its own
        return f"http://127.0.0.1:{port}"

    def _metrics_env(self, prefix: str) -> dict[str, str]:
        """A free port for one more process's /metrics (its URL goes to the state file's `metrics`)."""
        port = free_port()
        self.metrics.append(f"http://127.0.0.1:{port}/metrics")
        return {prefix + "METRICS_BIND": f"127.0.0.1:{port}"}

    def pids(self) -> dict[str, int]:
        return {"redis": self.redis.pid} | {name: p.pid for name, p in self.procs.items()}

    @staticmethod
    def with_pids(state: dict, pids: dict[str, int]) -> dict:
        """The state with current pids: the "pids" map, and the older "workers" and "gateway_pids" keys."""
        workers = [{"id": name, "pid": pid} for name, pid in pids.items() if name.startswith("wk-")]
        gateway_pids = [pid for name, pid in pids.items() if name.startswith("gw-")]
        return state | {"workers": workers, "gateway_pids": gateway_pids, "pids": dict(pids)}

    def _spawn(self, name: str, cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
        self.commands[name] = (cmd, env, log)
        # Appending: a restarted process's log follows its predecessor's.
        with log.open("a") as out:
            # A session of its own (a Ctrl-C reaches up.py alone, which stops the processes in order), and a death
            # with up.py: killed outright, it would leave them running, holding their ports and CPU.
            self.procs[name] = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                                start_new_session=True, preexec_fn=die_with_parent())
        return self.procs[name]

    def restart(self, name: str):
        """Start ``name`` again exactly as it was started (same id, ports, data directory)."""
        if name == "redis":
            self.redis.restart()
            return self.redis
        return self._spawn(name, *self.commands[name])

    def supervise(self, on_change) -> Supervisor:
        sup = Supervisor(on_change)
        sup.add("redis", self.redis, lambda: self.restart("redis"))
        for name, proc in self.procs.items():
            sup.add(name, proc, lambda name=name: self.restart(name))
        return sup

    def _raise_if_one_exited(self) -> None:
        dead = [name for name, p in self.procs.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{dead} exited early; see the logs in {self.tmp}")

    def stop(self, remove_logs: bool = False) -> None:
        """Stop every process and remove the secrets; the logs too if ``remove_logs`` (a script that started the
        cluster for itself and finished well), else say where they are kept."""
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.redis is not None:
            self.redis.stop()
        shutil.rmtree(self.secrets, ignore_errors=True)
        self.guard.forget()
        if remove_logs:
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            print(f"cluster stopped; logs kept in {self.tmp}", file=sys.stderr, flush=True)


def exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit in a script that starts a Cluster, so its ``finally`` stops it: by default
    SIGTERM ends Python on the spot, and redis-server, the gateways and the workers run on, orphaned.

    A signal that lands while a ``__del__`` or weakref callback runs raises there, and Python swallows that
    exception ("Exception ignored in ..."): the script would run on to the end. So a swallowed exit of ours is
    delivered again a moment later, from a helper thread, when the finalizer is most likely done."""
    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    previous = sys.unraisablehook

    def on_unraisable(unraisable) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, SystemExit) and exc.code == 128 + signal.SIGTERM:
            resend = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM))
            resend.daemon = True
            resend.start()
            return
        previous(unraisable)

    sys.unraisablehook = on_unraisable
    signal.signal(signal.SIGTERM, on_term)
