"""Typed configuration: dataclass defaults, then a TOML file, then environment variables.

``load(GatewayConfig, path, env_prefix="TS_GATEWAY_")`` reads ``path`` (if given)
and lets ``TS_GATEWAY_<FIELD>`` override any field; values are parsed by the
field's type (JSON for lists and dicts). Unknown keys and unparsable values
raise ``ConfigError`` naming the key, before anything starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration file or variable that cannot be used."""


def load(cls: type[T], path: str | Path | None = None, env_prefix: str = "",
         environ: typing.Mapping[str, str] | None = None, **overrides: Any) -> T:
    values: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read configuration {path}: {e}") from None
        unknown = set(data) - names
        if unknown:
            raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(names)}")
        values.update(data)
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    for name in names:
        raw = env.get(env_prefix + name.upper())
        if raw is not None:
            values[name] = _parse(raw, hints[name], env_prefix + name.upper())
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(str(e)) from None


def _parse(raw: str, hint: Any, where: str) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType")) and \
        len(args) == 1 else hint
    if raw == "" and base is not hint:
        return None
    try:
        if base is bool:
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if base in (int, float, str):
            return base(raw)
        return json.loads(raw)
    except ValueError:
        raise ConfigError(f"{where}={raw!r} is not a valid {getattr(base, '__name__', base)}") from None


def describe(cls: type) -> str:
    """One line per field: name, default, and the comment above it in the source (for --help)."""
    import inspect

    src = inspect.getsource(cls).splitlines()
    notes: dict[str, str] = {}
    pending: list[str] = []
    for line in src:
        s = line.strip()
        if s.startswith("#"):
            pending.append(s.lstrip("# "))
        elif ":" in s and not s.startswith(("def ", "class ", '"""', "@")):
            notes[s.split(":")[0]] = " ".join(pending)
            pending = []
        else:
            pending = []
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)")
        out.append(f"  {f.name} = {default!r}\n      {notes.get(f.name, '')}")
    return "\n".join(out)
