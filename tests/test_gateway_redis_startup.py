"""A gateway started while its Redis does not answer yet waits for it (redis_startup_wait_s), as a serving gateway
waits out an outage; a refused password still exits at once.

It exited at its first refused connection or timed-out read: a gateway restarted while Redis stood still for a moment
or restarted itself (the chaos run's kill of a gateway, then a freeze of Redis during the new one's start; a
supervisor restarting both) was gone for good. Real processes: `python -m gateway`, a real redis-server stopped
(SIGSTOP) or not yet started, the SDK's client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.ports import free_port
from common.redis_server import RedisServer
from common.settings import ConfigError
from gateway.config import GatewayConfig
from gateway.sdk import GatewayClient
from scripts.up_cluster import write_tenants
from tests.cluster_helpers import ROOT, wait_for

pytestmark = pytest.mark.faults  # stops Redis


class StartingGateway:
    """`python -m gateway` on free ports, its output in ``tmp_path``/gw.log."""

    def __init__(self, tmp_path: Path, redis_url: str, env: dict | None = None) -> None:
        self.tenants = write_tenants(tmp_path / "tenants.toml")
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.log_path = tmp_path / "gw.log"
        cmd = [sys.executable, "-m", "gateway", "--tenants-file", str(tmp_path / "tenants.toml"), "--insecure-workers",
               "--client-bind", self.endpoint, "--worker-bind", f"tcp://127.0.0.1:{free_port()}",
               "--redis-url", redis_url]
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, PYTHONPATH=str(ROOT), OTEL_SDK_DISABLED="true") | (env or {}))

    def log(self) -> str:
        return self.log_path.read_text()

    def waiting(self) -> bool:
        assert self.proc.poll() is None, f"the gateway exited {self.proc.returncode}: {self.log()[-2000:]}"
        return "trying again" in self.log()

    def serves(self) -> str:
        """The id of a job it admitted, once it answers."""
        def admitted():
            assert self.proc.poll() is None, f"the gateway exited {self.proc.returncode}: {self.log()[-2000:]}"
            with GatewayClient(self.endpoint, self.tenants["lab-co"]["api_key"], timeout_s=2.0, retries=0) as c:
                try:
                    return c.submit(prompt_token_ids=[5, 6], max_tokens=2).id
                except TimeoutError:
                    return None
        return wait_for(admitted, 60, "the gateway to admit a job")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def test_a_gateway_started_while_redis_stands_still_waits_for_it_and_serves(tmp_path):
    with RedisServer() as server:
        os.kill(server.pid, signal.SIGSTOP)
        gw = None
        try:
            gw = StartingGateway(tmp_path, server.url)
            wait_for(gw.waiting, 60, "the gateway to say it waits for Redis")
        finally:
            os.kill(server.pid, signal.SIGCONT)
        try:
            job_id = gw.serves()
            assert list(server.client().scan_iter(match=f"*{job_id}*")), "the admitted job is not in Redis"
        finally:
            gw.stop()


def test_a_gateway_started_before_its_redis_waits_for_it_and_serves(tmp_path):
    port = free_port()
    gw = StartingGateway(tmp_path, f"redis://127.0.0.1:{port}/0")
    try:
        wait_for(gw.waiting, 60, "the gateway to say it waits for Redis")
        with RedisServer(port=port) as server:
            job_id = gw.serves()
            assert list(server.client().scan_iter(match=f"*{job_id}*")), "the admitted job is not in Redis"
            gw.stop()
    finally:
        gw.stop()


def test_a_gateway_whose_redis_never_answers_exits_2_after_its_wait(tmp_path):
    gw = StartingGateway(tmp_path, f"redis://127.0.0.1:{free_port()}/0", env={"TS_GATEWAY_REDIS_STARTUP_WAIT_S": "1"})
    try:
        assert gw.proc.wait(60) == 2
    finally:
        gw.stop()
    out = gw.log()
    assert "cannot reach Redis" in out and "(waited 1 s)" in out and "Traceback" not in out, out[-2000:]


def test_a_refused_password_exits_at_once_without_waiting(tmp_path):
    with RedisServer(password="right-password-1234") as server:
        gw = StartingGateway(tmp_path, f"redis://:wrong-password-5678@127.0.0.1:{server.port}/0")
        try:
            assert gw.proc.wait(60) == 2
        finally:
            gw.stop()
    out = gw.log()
    assert "cannot reach Redis" in out and "trying again" not in out and "waited" not in out, out[-2000:]
    assert "wrong-password-5678" not in out


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), True, "30"])
def test_a_startup_wait_that_is_no_duration_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match="redis_startup_wait_s"):
        GatewayConfig(redis_startup_wait_s=value)


def test_a_redis_that_answers_with_an_error_is_a_config_error_at_once_not_a_traceback(tmp_path):
    """An answer is no blip: the cluster's tokenizer key holding another type (WRONGTYPE) exits 2 naming it, as
    before the start-up wait, not with a traceback and not after waiting."""
    from common.redis_keys import KeySpace

    with RedisServer() as server:
        server.client().hset(KeySpace(prefix="ts").tokenizer, "not", "a string")
        gw = StartingGateway(tmp_path, server.url)
        try:
            assert gw.proc.wait(60) == 2
        finally:
            gw.stop()
    out = gw.log()
    assert "cannot read the cluster's tokenizer from Redis" in out and "WRONGTYPE" in out, out[-2000:]
    assert "Traceback" not in out and "trying again" not in out, out[-2000:]
