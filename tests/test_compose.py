"""The compose deployment (docker-compose.yml, docker/*, .env.example), checked without a Docker engine.

The compose file is parsed with PyYAML, interpolated the way Compose does from .env.example, validated
against the Compose Specification schema (data/compose-spec.json), and then held to the design: which
services exist, what Redis, Jaeger, the gateway and the workers are given, and that every TS_GATEWAY_* /
TS_WORKER_* variable is a real configuration field that parses. The Dockerfiles are read for their COPY
sources, base images and entry points. Where a check can run a real process it does: redis-server with
the compose file's flags and its healthcheck, a gateway with the compose environment and its
healthcheck, and both entry points' --help.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from jsonschema import Draft7Validator
from jsonschema.validators import validator_for

from common import settings
from common.redis_server import RedisServer, RedisServerError, find_redis_server
from common.ports import free_port
from gateway.config import ENV_PREFIX as GATEWAY_PREFIX
from tests.cluster_helpers import stop_process
from tests.compose_helpers import (COMPOSE_FILE, ENV_EXAMPLE, InterpolationError, interpolate, interpolate_str,
                                   parse_env_file, published_targets, service_env)
from gateway.config import GatewayConfig
from worker.service_config import ENV_PREFIX as WORKER_PREFIX
from worker.service_config import WorkerConfig

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_FILE = ROOT / "data" / "compose-spec.json"
DOCKERIGNORE = ROOT / ".dockerignore"

OTLP_ENDPOINT = "http://jaeger:4318"
WORKER_SERVICES = ("worker", "worker-cpu")
HF_CACHE = "/root/.cache/huggingface"


@pytest.fixture(scope="module")
def used_vars(raw_compose, env_example) -> set[str]:
    used: set[str] = set()
    interpolate(raw_compose, env_example, used)
    return used


def mounts(svc: dict) -> list[dict]:
    """Volumes in long form: type, source, target, read_only."""
    out = []
    for v in svc.get("volumes") or []:
        if isinstance(v, dict):
            out.append({"read_only": False, **v})
            continue
        parts = v.split(":")
        source, target = parts[0], parts[1]
        kind = "bind" if source.startswith((".", "/", "~")) else "volume"
        out.append({"type": kind, "source": source, "target": target,
                    "read_only": len(parts) > 2 and "ro" in parts[2].split(",")})
    return out


# --- the file as Compose sees it ------------------------------------------------------------------------

def test_compose_file_is_valid_against_the_compose_schema(compose):
    schema = json.loads(SCHEMA_FILE.read_text())
    cls = validator_for(schema, default=None)
    if cls is None:  # "$schema" written without the trailing "#", which jsonschema does not look up
        assert "draft-07" in schema["$schema"], schema["$schema"]
        cls = Draft7Validator
    cls.check_schema(schema)
    errors = sorted(cls(schema).iter_errors(compose), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_schema_copy_is_the_compose_spec():
    schema = json.loads(SCHEMA_FILE.read_text())
    assert schema["title"] == "Compose Specification" and "services" in schema["properties"]


def test_every_variable_is_defined_and_explained_in_env_example(raw_compose, used_vars):
    values, above = parse_env_file(ENV_EXAMPLE)
    assert used_vars, "the compose file uses no variable at all?"
    assert not used_vars - set(values), f"used in docker-compose.yml, missing in .env.example: " \
                                        f"{sorted(used_vars - set(values))}"
    # COMPOSE_* are read by the compose CLI itself (COMPOSE_PROFILES picks the default profiles).
    unused = {k for k in values if k not in used_vars and not k.startswith("COMPOSE_")}
    assert not unused, f"defined in .env.example but used nowhere: {sorted(unused)}"
    for key, line in above.items():
        assert line.startswith("#") and len(line) > 10, f".env.example: {key} has no comment line above it"
    # The secrets have no usable default in the compose file: a missing one stops `docker compose up`.
    for name in ("REDIS_PASSWORD", "MODEL"):
        broken = {k: v for k, v in values.items() if k != name}
        with pytest.raises(InterpolationError, match=name):
            interpolate(raw_compose, broken, set())


def test_interpolation_helper_follows_compose_rules():
    used: set[str] = set()
    env = {"A": "1", "E": ""}
    assert interpolate_str("$$A ${A} $A ${B:-x} ${E:-y} ${E-z} ${A:+on} ${B:+on}", env, used) == "$A 1 1 x y  on "
    assert used == {"A", "B", "E"}
    with pytest.raises(InterpolationError):
        interpolate_str("${E:?needed}", env, used)
    with pytest.raises(InterpolationError):
        interpolate_str("cost: 5$", env, used)


def test_design_services_and_profiles(compose, env_example):
    services = compose["services"]
    assert {"redis", "jaeger", "gateway", "worker", "worker-cpu"} <= set(services)
    for name in ("redis", "jaeger", "gateway"):
        assert not services[name].get("profiles"), f"{name} must run in every profile"
    assert services["worker-cpu"]["profiles"] == ["cpu"]
    # The GPU worker must not start when only the cpu profile is asked for: it is in the gpu profile,
    # which .env.example enables by default (a --profile flag replaces COMPOSE_PROFILES).
    assert services["worker"]["profiles"] == ["gpu"]
    assert "gpu" in env_example["COMPOSE_PROFILES"].split(",")
    assert "cpu" not in env_example["COMPOSE_PROFILES"].split(",")


def test_restart_policies_match_up_py_supervision(compose):
    """As scripts/up.py does for a local cluster: whatever dies is started again, as itself, on its data."""
    for name, svc in compose["services"].items():
        assert svc.get("restart") == "unless-stopped", f"{name}: restart policy {svc.get('restart')!r}"
    # Redis comes back on the same AOF: appendonly, and its /data in a named volume that outlives the container.
    redis = compose["services"]["redis"]
    assert _flags(redis["command"])["appendonly"] == "yes"
    assert any(m["type"] == "volume" and m["target"] == "/data" for m in mounts(redis))


def test_shared_blocks_are_extension_fields(raw_compose):
    text = COMPOSE_FILE.read_text()
    extensions = [k for k in raw_compose if k.startswith("x-")]
    assert {"x-otel-env", "x-worker-env", "x-worker"} <= set(extensions)
    for anchor in ("*otel-env", "*worker-env", "*worker"):
        assert text.count(anchor) >= 2, f"{anchor} should be shared, not repeated"
    # The merged result: both worker services got the shared block.
    for name in WORKER_SERVICES:
        assert raw_compose["services"][name]["environment"]["TS_WORKER_GATEWAYS"]


# --- redis ------------------------------------------------------------------------------------------------

def _flags(command: list[str]) -> dict[str, str]:
    args = command
    assert len(args) % 2 == 0 and all(a.startswith("--") for a in args[::2]), args
    return {k[2:]: v for k, v in zip(args[::2], args[1::2])}


def test_redis(compose, env_example):
    redis = compose["services"]["redis"]
    assert re.fullmatch(r"redis:(7|6\.2)\.\d+(\.\d+)?(-[a-z0-9.]+)?", redis["image"]), redis["image"]
    flags = _flags(redis["command"])
    assert flags["appendonly"] == "yes"
    assert flags["appendfsync"] == "everysec"
    assert flags["maxmemory-policy"] == "noeviction"
    assert "requirepass" not in flags, "the password must not be on redis-server's command line"
    # The entrypoint writes it to a configuration file and starts redis-server with that file first.
    script = redis["entrypoint"][2]
    assert redis["entrypoint"][:2] == ["sh", "-c"] and "requirepass" in script and "umask 077" in script
    assert "exec docker-entrypoint.sh redis-server /tmp/redis.conf \"$@\"" in script
    assert service_env(redis)["REDIS_PASSWORD"] == env_example["REDIS_PASSWORD"]
    assert "ports" not in redis, "Redis must not be published on the host"
    check = redis["healthcheck"]["test"]
    assert check[0] == "CMD-SHELL" and "redis-cli" in check[1] and " ping" in check[1]
    # The password reaches redis-cli through its environment ($$ -> $ for the shell), not its argv.
    assert 'REDISCLI_AUTH="$REDIS_PASSWORD"' in check[1] and " -a " not in check[1]
    assert any(m["target"] == "/data" and m["type"] == "volume" for m in mounts(redis)), "AOF needs a volume"


def test_redis_appendfsync_is_the_operator_s_choice(raw_compose, env_example):
    """everysec unless .env says always: a host crash then loses no admission Redis acknowledged."""
    from tests.compose_helpers import interpolate

    def fsync(env):
        return _flags(interpolate(raw_compose, env, set())["services"]["redis"]["command"])["appendfsync"]

    assert fsync(env_example | {"REDIS_APPENDFSYNC": "always"}) == "always"
    assert fsync({k: v for k, v in env_example.items() if k != "REDIS_APPENDFSYNC"}) == "everysec"
    try:
        binary = find_redis_server()
    except RedisServerError as e:
        pytest.skip(str(e))
    with RedisServer(appendonly=True, extra_args=["--appendfsync", "always"], binary=binary) as server:
        assert server.client().config_get("appendfsync") == {"appendfsync": "always"}


def test_redis_flags_and_healthcheck_on_a_real_redis_server(compose, env_example):
    """The compose command's flags on a real redis-server, and the healthcheck command with a real redis-cli."""
    redis_svc = compose["services"]["redis"]
    try:
        binary = find_redis_server()
    except RedisServerError as e:
        pytest.skip(str(e))
    cli = Path(binary).with_name("redis-cli")
    password = env_example["REDIS_PASSWORD"]
    with RedisServer(password=password, extra_args=redis_svc["command"], binary=binary) as server:
        raw = server.client().config_get("*")
        config = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                  for k, v in raw.items()}
        assert config["appendonly"] == "yes" and config["appendfsync"] == "everysec"
        assert config["maxmemory-policy"] == "noeviction"
        assert int(config["maxmemory"]) == 2 * 1024**3
        import redis as redis_py

        # Without the password Redis refuses (no client retries: the refusal is the answer).
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(host="127.0.0.1", port=server.port, retry=None, retry_on_error=[]).ping()
        if not cli.is_file():
            pytest.skip("no redis-cli next to redis-server")
        script = redis_svc["healthcheck"]["test"][1].replace("-p 6379", f"-p {server.port}")
        assert str(server.port) in script
        env = {"PATH": f"{cli.parent}{os.pathsep}{os.environ['PATH']}"}
        ok = subprocess.run(["sh", "-c", script], env=env | {"REDIS_PASSWORD": password}, timeout=10)
        assert ok.returncode == 0
        wrong = subprocess.run(["sh", "-c", script], env=env | {"REDIS_PASSWORD": "wrong"}, timeout=10)
        assert wrong.returncode != 0


# Quotes, backslashes, a newline (that once began a second directive), shell and redis.conf syntax: the password is
# the operator's, and reaches Redis byte for byte or the container does not start.
AWKWARD_PASSWORDS = ["plain-Pw_0", 'a"b\\c', "ends with \\", 'x"\nrequirepass ""', "tab\t'single' $HOME `id` #",
                     "\\x41 \\n \\\"", "p\u00e4ss\u2603"]


@pytest.mark.parametrize("password", AWKWARD_PASSWORDS)
def test_the_redis_entrypoint_hands_any_password_to_a_real_redis_server(compose, tmp_path, password):
    """The compose entrypoint script, run by sh as the container runs it, then a real redis-server. Stand-ins for the
    image's own parts only: chown (the test is not root) and docker-entrypoint.sh (which only drops privileges)."""
    try:
        binary = find_redis_server()
    except RedisServerError as e:
        pytest.skip(str(e))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "chown").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "docker-entrypoint.sh").write_text('#!/bin/sh\nexec "$@"\n')
    for stub in ("chown", "docker-entrypoint.sh"):
        (bin_dir / stub).chmod(0o755)
    (bin_dir / "redis-server").symlink_to(binary)
    conf = tmp_path / "redis.conf"
    script = compose["services"]["redis"]["entrypoint"][2].replace("/tmp/redis.conf", str(conf))
    port = free_port()
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "REDIS_PASSWORD": password, "HOME": str(tmp_path)}
    log = (tmp_path / "redis.out").open("w")
    proc = subprocess.Popen(["sh", "-c", script, "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(tmp_path), "--save", "", "--daemonize", "no"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    import redis as redis_py

    try:
        deadline = time.monotonic() + 15
        while True:
            assert proc.poll() is None, f"redis-server exited: {(tmp_path / 'redis.out').read_text()[-2000:]}"
            try:
                assert redis_py.Redis(port=port, password=password, retry=None, socket_timeout=2).ping()
                break
            except redis_py.AuthenticationError:
                raise AssertionError("redis-server took another password than the one given") from None
            except redis_py.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not answer"
                time.sleep(0.1)
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(port=port, password=password + "x", retry=None, socket_timeout=2).ping()
        assert conf.stat().st_mode & 0o077 == 0, "the password file must be its owner's only"
    finally:
        stop_process(proc, timeout=15)
        log.close()


@pytest.mark.parametrize("password", [" lead", "trail ", "trail\n"])
def test_the_redis_entrypoint_refuses_a_password_the_gateway_would_read_otherwise(compose, tmp_path, password):
    """The gateway strips white space from the ends of its secret file: Redis would get a password nobody sends."""
    script = compose["services"]["redis"]["entrypoint"][2].replace("/tmp/redis.conf", str(tmp_path / "redis.conf"))
    out = subprocess.run(["sh", "-c", script, "redis-server"], env={"PATH": os.environ["PATH"],
                         "REDIS_PASSWORD": password}, capture_output=True, text=True, timeout=10)
    assert out.returncode == 2 and "REDIS_PASSWORD begins or ends with white space" in out.stderr, out
    assert not (tmp_path / "redis.conf").exists()


# --- jaeger -----------------------------------------------------------------------------------------------

def test_jaeger(compose):
    jaeger = compose["services"]["jaeger"]
    assert re.fullmatch(r"jaegertracing/jaeger:2\.\d+\.\d+", jaeger["image"]), jaeger["image"]
    published = published_targets(jaeger)
    assert 16686 in published
    assert not published & {4317, 4318}, "OTLP receivers must stay on the compose network"
    assert {4317, 4318} <= {int(p) for p in jaeger.get("expose", [])}


# --- gateway ----------------------------------------------------------------------------------------------

def test_gateway(compose, env_example):
    gw = compose["services"]["gateway"]
    assert gw["build"]["dockerfile"] == "docker/gateway.Dockerfile"
    assert gw["depends_on"]["redis"]["condition"] == "service_healthy"
    assert 5555 in published_targets(gw) and 5556 not in published_targets(gw)
    env = service_env(gw)
    url = urlsplit(env["TS_GATEWAY_REDIS_URL"])
    assert (url.scheme, url.hostname, url.port) == ("redis", "redis", 6379)
    assert url.password is None, "the password comes from a secret file, not the URL"
    assert env["TS_GATEWAY_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_password"
    assert compose["secrets"]["redis_password"] == {"environment": "REDIS_PASSWORD"}
    assert {"redis_password", "gateway_key_secret"} <= set(gw["secrets"])
    # CURVE on both sockets: worker keys from an allow-list (public keys only), clients encrypted.
    assert env["TS_GATEWAY_CURVE_SECRET_KEY_FILE"] == "/run/secrets/gateway_key_secret"
    assert env["TS_GATEWAY_CLIENT_CURVE"] == "true"
    allow = [m for m in mounts(gw) if m["target"] == env["TS_GATEWAY_AUTHORIZED_WORKERS_DIR"]]
    assert len(allow) == 1 and allow[0]["read_only"] and allow[0]["source"].endswith("/authorized_workers")
    assert env["TS_GATEWAY_CLIENT_BIND"] == "tcp://0.0.0.0:5555"
    assert env["TS_GATEWAY_WORKER_BIND"] == "tcp://0.0.0.0:5556"
    assert env["TS_GATEWAY_TOKENIZER"] == env_example["MODEL"]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == OTLP_ENDPOINT
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
    assert env["OTEL_SERVICE_NAME"]
    tenants = [m for m in mounts(gw) if m["target"] == env["TS_GATEWAY_TENANTS_FILE"]]
    assert len(tenants) == 1 and tenants[0]["read_only"], "tenants file must be mounted read-only"
    assert (ROOT / tenants[0]["source"]).is_file()
    check = gw["healthcheck"]["test"]
    assert check[:3] == ["CMD", "python", "-c"] and "zmq" in check[3]
    for key in ("interval", "timeout", "retries", "start_period"):
        assert key in gw["healthcheck"]


def test_example_tenants_file_loads():
    from gateway.tenants import TenantDirectory

    tenants = TenantDirectory.from_file(ROOT / "docker" / "tenants.example.toml")
    chat = tenants.lookup("example-chat-co-key-change-me")
    assert chat is not None and chat.name == "chat-co" and chat.p0_rate_per_s == 2.0
    assert tenants.lookup("example-lab-co-key-change-me").name == "lab-co"  # the api_key_sha256 form


# --- workers ----------------------------------------------------------------------------------------------

def test_workers(compose, env_example):
    services = compose["services"]
    gateway_bind = service_env(services["gateway"])["TS_GATEWAY_WORKER_BIND"]
    named_volumes = set(compose.get("volumes") or {})
    for name in WORKER_SERVICES:
        svc = services[name]
        env = service_env(svc)
        gateways = json.loads(env["TS_WORKER_GATEWAYS"])
        assert gateways == ["tcp://gateway:5556"]
        assert gateways[0].rsplit(":", 1)[1] == gateway_bind.rsplit(":", 1)[1]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == OTLP_ENDPOINT
        assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
        assert env["OTEL_SERVICE_NAME"]
        assert env["TS_WORKER_MODEL"] == env_example["MODEL"]
        assert env["TS_WORKER_CURVE_SECRET_KEY_FILE"] == "/run/secrets/worker_key_secret"
        assert env["TS_WORKER_GATEWAY_PUBLIC_KEY"] == "/run/secrets/gateway_public_key"
        assert set(svc["secrets"]) == {"worker_key_secret", "gateway_public_key"}
        # Scalable with --scale: no fixed name, no host port.
        assert "container_name" not in svc and "ports" not in svc, name
        assert svc["build"]["dockerfile"] == "docker/worker.Dockerfile"
        assert svc["depends_on"]["gateway"]["condition"] == "service_healthy"
        vols = mounts(svc)
        cache = [m for m in vols if m["target"] == HF_CACHE]
        assert len(cache) == 1 and cache[0]["type"] == "volume" and cache[0]["source"] in named_volumes
        models = [m for m in vols if m["type"] == "bind" and m["target"] == "/models"]
        assert len(models) == 1 and models[0]["read_only"]
        assert models[0]["source"] == env_example["MODEL_DIR"]

    gpu = services["worker"]
    assert service_env(gpu)["TS_WORKER_DEVICE"] == "cuda"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["build"]["args"]["VARIANT"] == "gpu"

    cpu = services["worker-cpu"]
    cpu_env = service_env(cpu)
    assert cpu_env["TS_WORKER_DEVICE"] == "cpu"
    assert int(cpu_env["TS_WORKER_TORCH_THREADS"]) > 0
    assert "deploy" not in cpu, "the CPU worker must not reserve a GPU"
    assert cpu["build"]["args"]["VARIANT"] == "cpu"


def test_config_variables_are_real_fields_and_parse(compose):
    """Every TS_GATEWAY_<KEY> / TS_WORKER_<KEY> names a config field, and the values load as the processes
    load them (e.g. TS_WORKER_GATEWAYS as a JSON list, the integers as integers)."""
    known = {GATEWAY_PREFIX: (GatewayConfig, {f.name for f in dataclasses.fields(GatewayConfig)}),
             WORKER_PREFIX: (WorkerConfig, set(settings.keys(WorkerConfig)))}  # engine keys included
    seen = set()
    for name, svc in compose["services"].items():
        env = service_env(svc)
        for prefix, (cls, fields) in known.items():
            ours = {k: v for k, v in env.items() if k.startswith(prefix)}
            unknown = {k for k in ours if k[len(prefix):].lower() not in fields}
            assert not unknown, f"{name}: {sorted(unknown)} are not fields of {cls.__name__}"
            if ours:
                seen.add(prefix)
                config = settings.load(cls, None, prefix, environ=ours)
                for k, v in ours.items():
                    assert getattr(config, k[len(prefix):].lower()) is not None, k
    assert seen == set(known)


# --- Dockerfiles ------------------------------------------------------------------------------------------

def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        s = line.strip()
        if not pending and (not s or s.startswith("#")):
            continue
        if s.startswith("#"):
            continue
        if s.endswith("\\"):
            pending += s[:-1] + " "
            continue
        full = (pending + s).strip()
        pending = ""
        op, _, args = full.partition(" ")
        out.append((op.upper(), args.strip()))
    return out


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(x, str) for x in value), args
    return value


def _dockerignore_patterns() -> list[tuple[bool, re.Pattern]]:
    out = []
    for line in DOCKERIGNORE.read_text().splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        negate = s.startswith("!")
        s = s.lstrip("!").strip("/")
        rx = ""
        i = 0
        while i < len(s):
            if s.startswith("**/", i):
                rx, i = rx + "(?:.*/)?", i + 3
            elif s.startswith("**", i):
                rx, i = rx + ".*", i + 2
            elif s[i] == "*":
                rx, i = rx + "[^/]*", i + 1
            elif s[i] == "?":
                rx, i = rx + "[^/]", i + 1
            else:
                rx, i = rx + re.escape(s[i]), i + 1
        out.append((negate, re.compile(rx + r"\Z")))
    return out


def dockerignored(rel: str) -> bool:
    """Whether .dockerignore keeps ``rel`` (relative to the context) out: it, or a folder above it, matches."""
    parts = rel.split("/")
    patterns = _dockerignore_patterns()
    for n in range(1, len(parts) + 1):
        candidate, ignored = "/".join(parts[:n]), False
        for negate, rx in patterns:
            if rx.match(candidate):
                ignored = not negate
        if ignored:
            return True
    return False


def resolve_args(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: args.get(m.group(1), ""), text)


def final_stage_copies(path: Path, build_args: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
    """(base images of the stages that end up in the image, COPY sources, argv of ENTRYPOINT + CMD)."""
    global_args: dict[str, str] = {}
    stages: dict[str, dict] = {}
    current: dict | None = None
    for op, args in dockerfile_instructions(path):
        if op == "ARG" and current is None:
            name, _, default = args.partition("=")
            global_args[name] = build_args.get(name, default)
        elif op == "FROM":
            words = args.split()
            image = resolve_args(words[0], global_args)
            current = {"from": image, "copy": [], "entrypoint": [], "cmd": []}
            stage_name = words[2] if len(words) == 3 and words[1].upper() == "AS" else f"#{len(stages)}"
            stages[stage_name] = current
        elif op == "COPY":
            assert current is not None
            words = [w for w in args.split() if not w.startswith("--")]
            assert not any(w.startswith("--from") for w in args.split()), "no stage copies expected"
            current["copy"] += words[:-1]
        elif op in ("ENTRYPOINT", "CMD"):
            current[op.lower()] = exec_form(args)
    chain, stage = [], current
    while stage is not None:
        chain.append(stage)
        stage = stages.get(stage["from"])
    bases = [s["from"] for s in chain if s["from"] not in stages]
    copies = [c for s in chain for c in s["copy"]]
    argv = (current["entrypoint"] or chain[-1]["entrypoint"]) + (current["cmd"] or chain[-1]["cmd"])
    return bases, copies, argv


@pytest.mark.parametrize("service,module", [("gateway", "gateway"), ("worker", "worker"), ("worker-cpu", "worker")])
def test_dockerfile(compose, service, module):
    build = compose["services"][service]["build"]
    context = ROOT / build.get("context", ".")
    dockerfile = context / build["dockerfile"]
    assert dockerfile.is_file()
    bases, copies, argv = final_stage_copies(dockerfile, {k: str(v) for k, v in (build.get("args") or {}).items()})
    assert copies, "the image installs the project from the repository"
    for src in copies:
        path = context / src
        assert path.exists(), f"{dockerfile.name}: COPY source {src} does not exist"
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and
                                               "__pycache__" not in p.parts]
        for f in files:
            rel = f.relative_to(context).as_posix()
            assert not dockerignored(rel), f"{dockerfile.name}: COPY source {rel} is excluded by .dockerignore"
    assert {"pyproject.toml", "README.md"} <= {Path(c).name for c in copies}  # README: project.readme
    # The entry point is `python -m <module>` (the compose `command` only adds flags).
    assert argv[:3] == ["python", "-m", module], argv
    assert importlib.util.find_spec(module) is not None
    assert importlib.util.find_spec(f"{module}.__main__") is not None
    for base in bases:
        name, _, tag = base.rpartition(":")
        assert name and tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"unpinned base image {base}"
    text = dockerfile.read_text()
    if service == "gateway":
        assert all(b.startswith("python:3.11") and "slim" in b for b in bases), bases
        # No torch at all: the extras the gateway and the front door install do not pull it.
        assert "torch==" not in text and 'pip install "/src[gateway,http]"' in text
        assert "COPY worker" not in text
    elif service == "worker":
        assert any(b.startswith("pytorch/pytorch:") and "cuda" in b for b in bases), bases
        torch_version = re.search(r"pytorch/pytorch:(\d+)\.(\d+)", bases[0])
        # transformers 5.24 turns PyTorch < 2.6 off: the CUDA base must bring a newer one.
        assert (int(torch_version[1]), int(torch_version[2])) >= (2, 6), bases
    else:
        assert "download.pytorch.org/whl/cpu" in text and all("cuda" not in b for b in bases), bases


def test_dockerignore_keeps_secrets_and_bulk_out():
    for rel in (".env", ".venv/bin/python", ".models/tiny/model.safetensors", ".git/HEAD",
                "data/azure-2023/AzureLLMInferenceTrace_conv.csv", "common/__pycache__/x.pyc"):
        assert dockerignored(rel), rel
    for rel in ("pyproject.toml", "README.md", "common/lua/admit.lua", "gateway/server.py", "worker/engine.py"):
        assert not dockerignored(rel), rel


# --- the processes the images run ----------------------------------------------------------------------

def test_gateway_imports_neither_torch_nor_worker():
    code = ("import sys, gateway.__main__, gateway.server, gateway.sdk, gateway.tenants, gateway.http.__main__, "
            "gateway.http.app; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'worker')); "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_entry_points_run_with_the_compose_command(compose):
    """`python -m gateway` / `python -m worker` with the flags the compose file passes, plus --help."""
    procs = {}
    for service, module in (("gateway", "gateway"), ("worker", "worker"), ("worker-cpu", "worker")):
        argv = [sys.executable, "-m", module, *compose["services"][service]["command"], "--help"]
        procs[service] = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True)
    for service, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, f"{service}: {err}"
        prefix = "TS_GATEWAY_" if service == "gateway" else "TS_WORKER_"
        assert prefix in out
        for key in service_env(compose["services"][service]):
            if key.startswith(prefix):
                assert f"  {key[len(prefix):].lower()} = " in out, f"{key} is not listed by --help"


def _run_healthcheck(code: str, client_bind: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    env = dict(os.environ) | env | {"TS_GATEWAY_CLIENT_BIND": client_bind}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=30)


def test_gateway_healthcheck_against_a_real_gateway(compose, env_example, tmp_path):
    """The gateway started as the container starts it (its compose environment, with host paths, secrets
    and loopback ports swapped in), its healthcheck run verbatim: failing before, passing once it serves."""
    from common.keys import generate

    gw = compose["services"]["gateway"]
    code = gw["healthcheck"]["test"][3]
    assert "$" not in code and "\n" not in code
    env = service_env(gw)
    client_port, worker_port = free_port(), free_port()
    tenants_source = next(m["source"] for m in mounts(gw) if m["target"] == env["TS_GATEWAY_TENANTS_FILE"])
    # What compose would mount: the secrets at /run/secrets/<name>, the allow-list directory.
    keys = generate(tmp_path / "keys", ["worker"])
    password_file = tmp_path / "redis_password"
    password_file.write_text(env_example["REDIS_PASSWORD"])
    secrets = {"/run/secrets/redis_password": str(password_file),
               "/run/secrets/gateway_key_secret": str(keys["gateway_secret"]),
               env["TS_GATEWAY_AUTHORIZED_WORKERS_DIR"]: str(keys["allow_list"])}
    env = {k: secrets.get(v, v) for k, v in env.items()}
    assert env["TS_GATEWAY_CLIENT_CURVE"] == "true"

    # Nothing listening yet: the check must fail (within its 3 s poll), not hang or pass.
    failed = _run_healthcheck(code, f"tcp://0.0.0.0:{client_port}", env)
    assert failed.returncode != 0

    with RedisServer(password=env_example["REDIS_PASSWORD"]) as server:
        redis_url = urlsplit(env["TS_GATEWAY_REDIS_URL"])._replace(netloc=f"127.0.0.1:{server.port}").geturl()
        proc_env = dict(os.environ) | env | {
            "TS_GATEWAY_REDIS_URL": redis_url,
            "TS_GATEWAY_CLIENT_BIND": f"tcp://127.0.0.1:{client_port}",
            "TS_GATEWAY_WORKER_BIND": f"tcp://127.0.0.1:{worker_port}",
            "TS_GATEWAY_METRICS_BIND": f"127.0.0.1:{free_port()}",  # compose's fixed 9101 may be taken here
            "TS_GATEWAY_TENANTS_FILE": str(ROOT / tenants_source),
            "TS_GATEWAY_TOKENIZER": "",  # no hub access in tests
            "TS_GATEWAY_KEY_PREFIX": f"compose-test-{os.getpid()}",
            "OTEL_SDK_DISABLED": "true",  # no Jaeger here
        }
        log = (tmp_path / "gateway.log").open("w")
        proc = subprocess.Popen([sys.executable, "-m", "gateway", *gw["command"]], cwd=tmp_path, env=proc_env,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while True:
                assert proc.poll() is None, (tmp_path / "gateway.log").read_text()
                result = _run_healthcheck(code, f"tcp://0.0.0.0:{client_port}", env)
                if result.returncode == 0:
                    break
                assert time.monotonic() < deadline, f"healthcheck never passed: {result.stderr}"
            # The example tenants through the real gateway, over CURVE: both key forms authenticate.
            from gateway.sdk import GatewayClient

            for key in ("example-chat-co-key-change-me", "example-lab-co-key-change-me"):
                with GatewayClient(f"tcp://127.0.0.1:{client_port}", api_key=key, timeout_s=10,
                                   server_public_key=str(keys["gateway_public"])) as client:
                    info = client.info()
                assert info.gateway_id and set(info.queue_depths) >= {"P0", "P1", "P2", "P3"}
            # Without the gateway's public key a client gets no answer at all (the socket speaks only CURVE).
            with GatewayClient(f"tcp://127.0.0.1:{client_port}", api_key="example-chat-co-key-change-me",
                               timeout_s=2) as plain, pytest.raises(TimeoutError):
                plain.info()
        finally:
            rc = stop_process(proc, timeout=15)
            log.close()
        assert rc == 0, (tmp_path / "gateway.log").read_text()
        assert env_example["REDIS_PASSWORD"] not in (tmp_path / "gateway.log").read_text()


def test_compose_healthcheck_commands_are_shell_safe(compose):
    redis_check = compose["services"]["redis"]["healthcheck"]["test"][1]
    words = shlex.split(redis_check)
    assert words[0] == "REDISCLI_AUTH=$REDIS_PASSWORD" and words[1] == "redis-cli"
    # The entrypoint script is shell too: it parses, and hands the compose command's flags on intact.
    script = compose["services"]["redis"]["entrypoint"][2]
    assert shlex.split(script)[-2:] == ["/tmp/redis.conf", "$@"]
