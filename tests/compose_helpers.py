"""Reading the compose deployment as Compose would, without a Docker engine: its interpolation of
variables, the .env file format, and the services' environments and published ports."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
TEST_REDIS_PASSWORD = "test-password-0123456789abcdef"


# --- Compose-style interpolation ------------------------------------------------------------------------

class InterpolationError(ValueError):
    pass


# $$ | ${NAME} | ${NAME<op>arg} with op one of :- - :? ? :+ + | $NAME
_VAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
                  r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*)|(?P<invalid>))")


def interpolate_str(text: str, env: dict[str, str], used: set[str]) -> str:
    def repl(m: re.Match) -> str:
        if m.group("escaped"):
            return "$"
        if m.group("invalid") is not None and not (m.group("braced") or m.group("bare")):
            raise InterpolationError(f"invalid interpolation format in {text!r}")
        name = m.group("braced") or m.group("bare")
        used.add(name)
        op, arg = m.group("op"), m.group("arg") or ""
        value = env.get(name)
        present = value is not None if op in ("-", "?", "+") else bool(value)
        if op in (":-", "-"):
            return value if present else interpolate_str(arg, env, used)
        if op in (":?", "?"):
            if not present:
                raise InterpolationError(f"required variable {name} is missing a value: {arg}")
            return value
        if op in (":+", "+"):
            return interpolate_str(arg, env, used) if present else ""
        return value or ""

    return _VAR.sub(repl, text)


def interpolate(node, env: dict[str, str], used: set[str]):
    """Compose interpolates every string value (not keys) of the parsed file."""
    if isinstance(node, dict):
        return {k: interpolate(v, env, used) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env, used) for v in node]
    if isinstance(node, str):
        return interpolate_str(node, env, used)
    return node


def parse_env_file(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """KEY=VALUE lines (dotenv as Compose reads it, unquoted here) -> values, and the line above each."""
    values: dict[str, str] = {}
    above: dict[str, str] = {}
    previous = ""
    for line in path.read_text().splitlines():
        s = line.strip()
        if s and not s.startswith("#"):
            key, sep, value = s.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), f"{path.name}: bad name {key!r}"
            assert key not in values, f"{path.name}: {key} defined twice"
            values[key] = value
            above[key] = previous
        previous = s
    return values, above


def service_env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return {k: ("" if v is None else str(v)) for k, v in env.items()}


def published_targets(svc: dict) -> set[int]:
    """Container ports published on the host (short or long syntax)."""
    out = set()
    for p in svc.get("ports") or []:
        if isinstance(p, dict):
            out.add(int(p["target"]))
        else:
            target = str(p).split("/")[0].rsplit(":", 1)[-1]
            out.update(range(int(target.split("-")[0]), int(target.split("-")[-1]) + 1))
    return out


def raw_compose_file() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())  # SafeLoader resolves the << merge keys


def filled_env_example() -> dict[str, str]:
    """.env.example as an operator fills it in: the one value it must not ship, the password, set."""
    values = parse_env_file(ENV_EXAMPLE)[0]
    assert values["REDIS_PASSWORD"] == "", ".env.example must ship no usable Redis password"
    return values | {"REDIS_PASSWORD": TEST_REDIS_PASSWORD}
