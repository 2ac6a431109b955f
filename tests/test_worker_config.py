"""Issue 10, item 7: one source of truth for a worker's configuration. Every EngineConfig key is
settable from the TOML file, TS_WORKER_<KEY> and the `python -m worker` command line, generated from
EngineConfig's fields (so keys added to the engine later are covered by the same test)."""

from __future__ import annotations

import pytest

from worker import EngineConfig


def _other_value(hint, default):
    """A value of type ``hint`` that differs from ``default`` (so that a key that is not applied shows)."""
    import typing

    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if type(None) in typing.get_args(hint) and len(args) == 1 else hint
    origin = typing.get_origin(base) or base
    if origin is bool:
        return not default
    if origin is int:
        return (default or 0) + 3
    if origin is float:
        return 0.5 if default != 0.5 else 0.25
    if origin is str:
        return f"{default}-x"
    if origin is dict:
        return {"P0": ["P3"]}
    if origin in (list, tuple):
        return origin([1, 2])
    raise AssertionError(f"no test value for {hint!r}: teach _other_value this type")


def _toml(value) -> str:
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items()) + " }"
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def _env(value) -> str:
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def test_every_engine_key_is_settable_from_toml_environment_and_command_line(tmp_path):
    import dataclasses
    import typing

    from common import settings
    from worker.__main__ import parser
    from worker.service_config import ENV_PREFIX, WorkerConfig

    # WorkerConfig holds no copy of an engine key: the engine's fields are its keys.
    engine_keys = {f.name for f in dataclasses.fields(EngineConfig)}
    assert not engine_keys & {f.name for f in dataclasses.fields(WorkerConfig)} - {"engine"}
    assert engine_keys <= set(settings.keys(WorkerConfig))
    hints = typing.get_type_hints(EngineConfig)
    defaults = WorkerConfig().engine
    for f in dataclasses.fields(EngineConfig):
        value = _other_value(hints[f.name], getattr(defaults, f.name))
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv = [flag if value else "--no-" + f.name.replace("_", "-")]
        else:
            argv = [flag, _env(value)]
        (tmp_path / "w.toml").write_text(f"{f.name} = {_toml(value)}\n")
        loaded = {
            "toml": settings.load(WorkerConfig, tmp_path / "w.toml", ENV_PREFIX, environ={}),
            "env": settings.load(WorkerConfig, None, ENV_PREFIX, environ={ENV_PREFIX + f.name.upper(): _env(value)}),
            "cli": settings.load(WorkerConfig, None, ENV_PREFIX, environ={},
                                 **settings.overrides(parser().parse_args(argv), WorkerConfig)),
        }
        for source, config in loaded.items():
            assert getattr(config.engine, f.name) == value, (f.name, source)
            assert getattr(config, f.name) == value  # read through the worker's config as before
            others = [g.name for g in dataclasses.fields(EngineConfig) if g.name != f.name
                      and getattr(config.engine, g.name) != getattr(defaults, g.name)]
            assert not others, (f.name, source, others)
    # Command line over environment over file.
    (tmp_path / "w.toml").write_text("max_num_seqs = 3\np0_reserve_blocks = 1\n")
    config = settings.load(WorkerConfig, tmp_path / "w.toml", ENV_PREFIX,
                           environ={"TS_WORKER_MAX_NUM_SEQS": "5", "TS_WORKER_P0_RESERVE_BLOCKS": "2"},
                           **settings.overrides(parser().parse_args(["--max-num-seqs", "7"]), WorkerConfig))
    assert (config.engine.max_num_seqs, config.engine.p0_reserve_blocks) == (7, 2)


@pytest.mark.parametrize("where, bad", [("toml", 'max_num_seqs = "many"'), ("toml", "no_such_key = 1"),
                                        ("env", ("TS_WORKER_LOW_TIER_KV_SHARE", "half")),
                                        ("env", ("TS_WORKER_PREEMPTION_MATRIX", "[1, 2]"))])
def test_a_bad_engine_key_is_a_config_error_naming_it(tmp_path, where, bad):
    from common import settings
    from worker.service_config import ENV_PREFIX, WorkerConfig

    if where == "toml":
        (tmp_path / "w.toml").write_text(bad + "\n")
        with pytest.raises(settings.ConfigError, match=bad.split()[0]):
            settings.load(WorkerConfig, tmp_path / "w.toml", ENV_PREFIX, environ={})
    else:
        with pytest.raises(settings.ConfigError, match=bad[0]):
            settings.load(WorkerConfig, None, ENV_PREFIX, environ=dict([bad]))


def test_the_worker_process_refuses_an_out_of_range_engine_key(tiny_model_dir):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "worker", "--model", str(tiny_model_dir), "--low-tier-kv-share", "2"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and "low_tier_kv_share" in done.stderr
    done = subprocess.run([sys.executable, "-m", "worker", "--model", str(tiny_model_dir), "--max-num-seqs", "x"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and "--max-num-seqs" in done.stderr


@pytest.mark.parametrize("matrix, pair", [({"P2": ["P0"]}, "P2 may not preempt P0"),
                                          ({"P0": ["P2"], "P1": ["P1"]}, "P1 may not preempt P1"),
                                          ({"P3": ["P3", "P2"]}, "P3 may not preempt P")])
def test_a_preemption_matrix_that_lets_a_tier_preempt_its_own_or_a_higher_one_is_refused(matrix, pair):
    """Such a matrix was taken as it came: a P2 preempting a P0 inverts the tiers, and a tier preempting itself lets
    two requests of one tier take each other's slot in turn (the anti-ping-pong guard only slows that down)."""
    from common.tiers import Tier
    from worker.preemption import PreemptionConfig

    with pytest.raises(ValueError, match=pair):
        EngineConfig(preemption_matrix=matrix).validate()  # before a model is loaded
    parsed = {Tier(k): frozenset(Tier(v) for v in vs) for k, vs in matrix.items()}
    with pytest.raises(ValueError, match=pair):
        PreemptionConfig(matrix=parsed).validate()
    with pytest.raises(ValueError, match="P9"):
        EngineConfig(preemption_matrix={"P0": ["P9"]}).validate()
    EngineConfig(preemption_matrix={"P0": ["P1", "P2", "P3"], "P1": ["P2", "P3"], "P2": ["P3"]}).validate()
    EngineConfig(preemption_matrix={}).validate()  # nothing preempts: allowed
