"""Shared fixtures: real model directories built by scripts/make_tiny_model.py, and what they generate."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from common.ports import PORT_RANGE_ENV, split_range
from scripts.make_tiny_model import build
from tests import compose_helpers, zmq_watchdog

CONFIGS = Path(__file__).resolve().parent.parent / "models" / "configs"

# Under pytest-xdist (`make test JOBS=N` runs each suite on N processes) each process picks free ports for the
# clusters it starts without seeing the others' picks: a port picked by two before either's child binds it would
# fail one of them. Each gets a share of the range of its own, and every process it starts inherits it.
# And each of their clusters' workers gets one torch thread (scripts/up.py honours the variable): up.py splits the
# cores among one cluster's workers only, and the pools of clusters side by side spin on the same cores (a run with
# two workers' pools on them saw one short job's step take 20 s, past its lease).
if "PYTEST_XDIST_WORKER" in os.environ:
    if PORT_RANGE_ENV not in os.environ:
        os.environ[PORT_RANGE_ENV] = split_range(int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw")),
                                                 int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("TS_WORKER_TORCH_THREADS", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    """One torch thread in this process, before any fixture builds an engine: the tiny models' ops are far too
    small to split, and on a 2-core machine shared with the cluster processes a test starts (and other runs) torch's
    spinning thread pool made the in-process engine tests 3-5x slower. The workers a test starts set their own
    (TS_WORKER_TORCH_THREADS: 1 in tests/durable_cluster.py and, with 2 workers, in scripts/up.py), so the
    references computed here run with the thread count of the workers they are compared with."""
    if "torch" not in sys.modules and not MODEL_FIXTURES & set(item.fixturenames):
        return  # a test that never touches torch does not pay for importing it here
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After each test (its fixtures torn down): end the run if this process's ZeroMQ froze (tests/zmq_watchdog)."""
    yield
    if zmq_watchdog.frozen():
        import faulthandler

        faulthandler.dump_traceback(all_threads=True)
        zmq_watchdog.report()
        pytest.exit(f"this process's ZeroMQ context froze (a fresh socket pair exchanged nothing) during or after "
                    f"{item.nodeid}: every later ZeroMQ test would time out; thread stacks above", returncode=3)


MODEL_FIXTURES = {"tiny_model_dir", "bench_model_dir"}  # every model fixture below depends on one of these


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random-weight Llama built from models/configs/tiny-llama.json, loadable with from_pretrained."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return build(CONFIGS / "tiny-llama.json", tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def bench_model_dir(tmp_path_factory) -> Path:
    """models/configs/bench-llama-32m.json: big enough that the forward pass, not Python, sets a step's length
    (about 60 tokens/s per sequence on a 2-core machine)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return build(CONFIGS / "bench-llama-32m.json", tmp_path_factory.mktemp("models") / "bench-llama-32m")


@pytest.fixture(scope="session")
def hf_reference(tiny_model_dir):
    """The same weights through plain transformers (sdpa attention, DynamicCache): the ground truth."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """tokens(specs) -> the engine's output for each spec (prompt, max_tokens, temperature, seed), ignore_eos, run
    in this process: what a cluster must return for the same jobs."""
    from worker import Engine, EngineConfig, SamplingParams

    engine = Engine.from_pretrained(str(tiny_model_dir), EngineConfig(device="cpu", dtype="float32", max_num_seqs=16))

    def tokens(specs: list[tuple[list[int], int, float, int]]) -> list[list[int]]:
        out: dict[str, list[int]] = {}
        for i, (prompt, max_tokens, temperature, seed) in enumerate(specs):
            engine.add_request(f"ref-{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                                  seed=seed, ignore_eos=True), tier="P3")
            out[f"ref-{i}"] = []
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
        return [out[f"ref-{i}"] for i in range(len(specs))]

    return tokens


# The compose deployment as an operator fills in .env.example (tests/test_compose*.py).

@pytest.fixture(scope="module")
def raw_compose() -> dict:
    return compose_helpers.raw_compose_file()


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    return compose_helpers.filled_env_example()


@pytest.fixture(scope="module")
def compose(raw_compose, env_example) -> dict:
    return compose_helpers.interpolate(raw_compose, env_example, set())
