"""A real local cluster whose parts a test can kill -9 and restart with the same identity.

redis-server (AOF, appendfsync everysec, fixed port and data directory), gateways and workers are
separate processes on loopback ports; ``kill``/``restart`` act on one of them by name ("redis",
"gw-0", "wk-1", ...). Used by the durability tests (issue 9), which need to restart what they kill
whether or not a supervisor is running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import redis

from common.redis_server import find_redis_server
from common.ports import free_port
from gateway.sdk import GatewayClient
from scripts.up import write_tenants
from tests.cluster_helpers import stop_process, stop_processes, wait_for

ROOT = Path(__file__).resolve().parent.parent


class DurableCluster:
    def __init__(self, tmp: Path, model_dir: Path, *, gateways: int = 2, workers: int = 2, max_running: int = 2,
                 lease_s: float = 10.0, aging_interval_s: float = 60.0, gateway_env: dict | None = None,
                 clock_skew_s: dict[str, float] | None = None,
                 clock_jump: dict[str, tuple[Path, float]] | None = None, worker_env: dict | None = None,
                 process_env: dict[str, dict] | None = None) -> None:
        self.tmp, self.model_dir = tmp, model_dir
        self.redis_port, self.redis_dir = free_port(), tmp / "redis"
        self.redis_dir.mkdir()
        self.tenants = write_tenants(tmp / "tenants.toml")
        self.gateways = {f"gw-{g}": (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
                         for g in range(gateways)}
        self.worker_ids = [f"wk-{i}" for i in range(workers)]
        self.max_running = max_running
        self.clock_skew_s = clock_skew_s or {}
        # gateway -> (flag file, seconds): its wall clock steps by that much once the test creates the file
        self.clock_jump = clock_jump or {}
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), TS_GATEWAY_LEASE_S=str(lease_s),
                        TS_GATEWAY_AGING_INTERVAL_S=str(aging_interval_s), TS_GATEWAY_TOKENIZER=str(model_dir),
                        TS_WORKER_TORCH_THREADS="1", OTEL_TRACES_EXPORTER="none",
                        # Durability, not authentication, is under test here: loopback workers without CURVE keys.
                        TS_GATEWAY_INSECURE_WORKERS="true",
                        # A stopped worker hands its jobs back at once (worker/drain.py): the teardown does not
                        # wait for jobs a test left running. The drain tests set their own.
                        TS_WORKER_DRAIN_TIMEOUT_S="0")
        self.env.update({**(gateway_env or {}), **(worker_env or {})})
        self.process_env = process_env or {}  # process name -> its own settings (a metrics port, say)
        self.procs: dict[str, subprocess.Popen] = {}
        self.redis = redis.Redis(port=self.redis_port, socket_timeout=5)

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def endpoint(self, gw: str = "gw-0") -> str:
        return self.gateways[gw][0]

    def client(self, tenant: str, gw: str = "gw-0", timeout_s: float = 120.0) -> GatewayClient:
        return GatewayClient(self.endpoint(gw), self.tenants[tenant]["api_key"], timeout_s=timeout_s)

    def key(self, tenant: str) -> str:
        return self.tenants[tenant]["api_key"]

    # -- processes ------------------------------------------------------------------------------------------------

    def _cmd(self, name: str) -> list[str]:
        if name == "redis":
            return [find_redis_server(), "--port", str(self.redis_port), "--bind", "127.0.0.1", "--dir",
                    str(self.redis_dir), "--appendonly", "yes", "--appendfsync", "everysec", "--save", ""]
        if name in self.gateways:
            client_ep, worker_ep = self.gateways[name]
            args = ["--client-bind", client_ep, "--worker-bind", worker_ep, "--redis-url", self.redis_url,
                    "--tenants-file", str(self.tmp / "tenants.toml"), "--gateway-id", name]
            skew = self.clock_skew_s.get(name, 0.0)
            flag, jump = self.clock_jump.get(name, (None, 0.0))
            if skew or jump:  # this gateway's wall clock runs `skew` seconds off (and steps); everything else is real
                step = f" + ({jump!r} if os.path.exists({str(flag)!r}) else 0.0)" if jump else ""
                # time_ns too: span times are read from it (a host's wall clock is off for both).
                code = (f"import os, sys, time, runpy; _t = time.time; time.time = lambda: _t() + {skew!r}{step}; "
                        f"_n = time.time_ns; time.time_ns = lambda: _n() + int(1e9 * ({skew!r}{step})); "
                        f"sys.argv = ['gateway'] + sys.argv[1:]; runpy.run_module('gateway', run_name='__main__')")
                return [sys.executable, "-c", code, *args]
            return [sys.executable, "-m", "gateway", *args]
        cmd = [sys.executable, "-m", "worker", "--worker-id", name, "--model", str(self.model_dir),
               "--max-num-seqs", str(self.max_running)]
        for _, worker_ep in self.gateways.values():
            cmd += ["--gateway", worker_ep]
        return cmd

    def start_process(self, name: str) -> None:
        log = (self.tmp / f"{name}.log").open("a")
        env = self.env | self.process_env.get(name, {})
        self.procs[name] = subprocess.Popen(self._cmd(name), cwd=ROOT, env=env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        if name == "redis":
            wait_for(self._redis_up, 30, "redis-server to answer")

    def _redis_up(self) -> bool:
        try:
            return bool(self.redis.ping())
        except redis.RedisError:
            return False

    def kill(self, name: str) -> None:
        """kill -9, and reap."""
        p = self.procs[name]
        os.kill(p.pid, signal.SIGKILL)
        p.wait()

    def restart(self, name: str) -> None:
        self.start_process(name)

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def __enter__(self) -> DurableCluster:
        try:
            self.start_process("redis")
            for name in [*self.gateways, *self.worker_ids]:
                self.start_process(name)
            for gw in self.gateways:
                self.wait_workers(gw)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def wait_workers(self, gw: str, timeout: float = 120.0) -> None:
        # retries=0: a probe (as up.py's); a gateway still starting is this loop's business, not a warning.
        c = GatewayClient(self.endpoint(gw), self.key("lab-co"), timeout_s=2.0, retries=0)
        try:
            def ready() -> bool:
                for name, p in self.procs.items():
                    assert p.poll() is None, f"{name} exited {p.returncode}: {self.log_tail(name)}"
                try:
                    return len(c.info().workers) >= len(self.worker_ids)
                except Exception:
                    return False
            try:
                wait_for(ready, timeout, f"{gw} to see every worker", interval=0.2)
            except AssertionError as e:  # what each process said, read once the wait is over
                logs = "\n".join(f"--- {name}:\n{self.log_tail(name, 1500)}" for name in [gw, *self.worker_ids])
                raise AssertionError(f"{e}\n{logs}") from None
        finally:
            c.close()

    def __exit__(self, *exc) -> None:
        # All at once: each one's exit is mostly the interpreter's own teardown (~1.5 s of CPU with transformers
        # loaded), which one after another cost a 2-gateway, 2-worker cluster 4-5 s. Redis last, as before.
        stop_processes([p for name, p in self.procs.items() if name != "redis"], timeout=15)
        if "redis" in self.procs:
            stop_process(self.procs["redis"], timeout=15)
        self.redis.close()

    def log_tail(self, name: str, n: int = 3000) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    # -- Redis views ----------------------------------------------------------------------------------------------

    def job(self, job_id: str) -> dict[str, bytes]:
        return {k.decode(): v for k, v in self.redis.hgetall(f"ts:{{c}}:job:{job_id}").items()}

    def state(self, job_id: str) -> str | None:
        v = self.redis.hget(f"ts:{{c}}:job:{job_id}", "state")
        return v.decode() if v else None

    def stored_tokens(self, job_id: str) -> list[int]:
        raw = self.redis.hget(f"ts:{{c}}:job:{job_id}", "token_ids")
        return msgpack.unpackb(raw) if raw else []


def wait_states(cluster: DurableCluster, job_ids: list[str], states: set[str], timeout: float) -> None:
    wait_for(lambda: all(cluster.state(j) in states for j in job_ids), timeout,
             f"jobs to reach {sorted(states)}: {[cluster.state(j) for j in job_ids]}", interval=0.2)


def settle(deadline_s: float) -> None:
    """Sleep in small steps (used only to let a fault last a while, never to wait for a result)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        time.sleep(0.05)
