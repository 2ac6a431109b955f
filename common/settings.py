"""Typed configuration: dataclass defaults, then a TOML file, then environment variables.

``load(GatewayConfig, path, env_prefix="TS_GATEWAY_")`` reads ``path`` (if given)
and lets ``TS_GATEWAY_<FIELD>`` override any field; values are parsed by the
field's type (JSON for lists and dicts). Unknown keys, unparsable values and
values of the wrong type raise ``ConfigError`` naming the key, before anything
starts. A field marked ``FLATTEN`` embeds another configuration dataclass whose
fields are keys at the top level; ``add_arguments`` makes a flag of every key.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration file or variable that cannot be used."""


def require(config: Any, *, positive: typing.Iterable[str] = (), at_least: typing.Mapping[str, int] | None = None,
            non_negative: typing.Mapping[str, str] | None = None) -> None:
    """Raise ConfigError naming the first of ``config``'s keys out of bounds: those in ``positive`` must be finite
    numbers > 0 (a process divides by them, or waits them out), those in ``at_least`` integers >= their bound, those
    in ``non_negative`` finite numbers >= 0 (key -> what 0 means, said in the error)."""
    for key in positive:
        value = getattr(config, key)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ConfigError(f"{key} must be a finite number > 0, got {value!r}")
    for key, zero in (non_negative or {}).items():
        value = getattr(config, key)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and value >= 0):
            raise ConfigError(f"{key} must be a finite number >= 0 (0: {zero}), got {value!r}")
    for key, least in (at_least or {}).items():
        value = getattr(config, key)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
            raise ConfigError(f"{key} must be an integer >= {least}, got {value!r}")


# Field metadata: a dataclass-typed field whose own fields are keys at the top level (in the TOML file,
# as <PREFIX><KEY> variables and as command-line flags), so that a process configuration can embed a
# library's configuration class without copying its fields.
FLATTEN = {"flatten": True}


def flat_fields(cls: type) -> dict[str, tuple[str | None, Any]]:
    """Every key of ``cls``: name -> (the flattened field it lives in, or None; its type hint)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[str | None, Any]] = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("flatten"):
            inner = typing.get_type_hints(hints[f.name])
            out.update({g.name: (f.name, inner[g.name]) for g in dataclasses.fields(hints[f.name])})
        else:
            out[f.name] = (None, hints[f.name])
    return out


def keys(cls: type) -> list[str]:
    """The configuration keys of ``cls``, flattened fields included."""
    return list(flat_fields(cls))


def load(cls: type[T], path: str | Path | None = None, env_prefix: str = "",
         environ: typing.Mapping[str, str] | None = None, **overrides: Any) -> T:
    fields = flat_fields(cls)
    values: dict[str, Any] = {}
    if path is not None:
        try:
            # TOML is UTF-8 whatever the locale; a file in another encoding is named, not a traceback.
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read configuration {path}: {e}") from None
        unknown = set(data) - set(fields)
        if unknown:
            raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(fields)}")
        values.update({k: _check(v, fields[k][1], f"{path}: {k}") for k, v in data.items()})
    env = os.environ if environ is None else environ
    for name, (_, hint) in fields.items():
        raw = env.get(env_prefix + name.upper())
        if raw is not None:
            values[name] = _parse(raw, hint, env_prefix + name.upper())
    unknown = set(overrides) - set(fields)
    if unknown:
        raise ConfigError(f"unknown keys {sorted(unknown)}")
    values.update({k: _check(v, fields[k][1], k) for k, v in overrides.items() if v is not None})
    top = {k: v for k, v in values.items() if fields[k][0] is None}
    for f in dataclasses.fields(cls):
        if f.metadata.get("flatten"):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            top[f.name] = dataclasses.replace(default, **{k: v for k, v in values.items() if fields[k][0] == f.name})
    try:
        return cls(**top)
    except TypeError as e:
        raise ConfigError(str(e)) from None


def add_arguments(ap: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """A ``--key`` flag for every key of ``cls`` (``--flag/--no-flag`` for booleans), values parsed as the
    <PREFIX><KEY> variables are; ``overrides(args, cls)`` collects the ones given."""
    notes = _notes(cls)
    for name, (_, hint) in flat_fields(cls).items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        if _base(hint) is bool:
            ap.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=notes.get(name))
        else:
            def parse(raw: str, hint: Any = hint, flag: str = flag) -> Any:
                return _parse(raw, hint, flag)

            parse.__name__ = getattr(_base(hint), "__name__", "value")  # argparse names it in its errors
            ap.add_argument(flag, dest=name, type=parse, default=None, metavar=name.upper(), help=notes.get(name))


def overrides(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The keys of ``cls`` given on the command line (flags added by ``add_arguments``)."""
    return {k: getattr(args, k) for k in flat_fields(cls) if getattr(args, k, None) is not None}


def _base(hint: Any) -> Any:
    """``X`` for ``X | None``, else the hint itself."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1
    return args[0] if optional else hint


def _check(value: Any, hint: Any, where: str) -> Any:
    """``value`` (from TOML or a caller) if it has the key's type (an int for a float is widened)."""
    base = _base(hint)
    if value is None and base is not hint:
        return None
    origin = typing.get_origin(base) or base
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str),
          list: lambda v: isinstance(v, (list, tuple)),
          tuple: lambda v: isinstance(v, (list, tuple)),
          dict: lambda v: isinstance(v, dict)}.get(origin)
    if ok is not None and not ok(value):
        raise ConfigError(f"{where}={value!r} is not a valid {getattr(base, '__name__', base)}")
    if origin is float:
        return float(value)
    if origin is tuple:
        return tuple(value)
    return value


def _parse(raw: str, hint: Any, where: str) -> Any:
    base = _base(hint)
    if raw == "" and base is not hint:
        return None
    try:
        if base is bool:
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if base in (int, float, str):
            return base(raw)
        value = json.loads(raw)
    except ValueError:
        raise ConfigError(f"{where}={raw!r} is not a valid {getattr(base, '__name__', base)}") from None
    return _check(value, hint, where)


def _notes(cls: type) -> dict[str, str]:
    """The comment above each field in the source of ``cls`` (and of the classes it flattens)."""
    import inspect

    classes = [cls] + [typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls) if f.metadata.get("flatten")]
    notes: dict[str, str] = {}
    for c in classes:
        pending: list[str] = []
        for line in inspect.getsource(c).splitlines():
            s = line.strip()
            if s.startswith("#"):
                pending.append(s.lstrip("# "))
            elif ":" in s and not s.startswith(("def ", "class ", '"""', "@")):
                notes.setdefault(s.split(":")[0], " ".join(pending))
                pending = []
            else:
                pending = []
    return notes


def describe(cls: type) -> str:
    """One line per key: name, default, and the comment above it in the source (for --help)."""
    notes = _notes(cls)
    defaults: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)")
        if f.metadata.get("flatten"):
            defaults.update({g.name: getattr(default, g.name) for g in dataclasses.fields(default)})
        else:
            defaults[f.name] = default
    return "\n".join(f"  {name} = {defaults[name]!r}\n      {notes.get(name, '')}" for name in flat_fields(cls))
