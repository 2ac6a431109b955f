# The two commands a newcomer needs: `make test` and `make demo`. Both set up
# everything from a clean clone: a virtualenv in .venv, the CPU build of torch,
# this project and its dependencies.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
MODELS := .models
TORCH_SPEC ?= torch==2.13.0

.PHONY: test test-faults demo demo-engine bench install clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: an unpinned resolve would fetch a multi-GB CUDA build.
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[all,dev]'
	touch $(STAMP)

install: $(STAMP)

# JOBS=N runs each suite on N pytest-xdist processes, each picking ports from a range of its own and giving its
# clusters' workers one torch thread (tests/conftest.py): on 2 cores about 1.7x faster (BENCHMARKS.md). Two by
# default where there are 2 cores or more; JOBS=1 runs one test at a time.
JOBS ?= $(if $(filter 0 1,$(shell nproc 2>/dev/null || echo 1)),1,2)
XDIST := $(if $(filter-out 1,$(JOBS)),-n $(JOBS) --dist loadfile)

# --durations: each run's slowest tests in its log, to keep `make test` near its 15-minute budget.
test: $(STAMP)
	$(PY) -m pytest -q -m "not faults" --durations=25 $(XDIST)
	$(MAKE) test-faults

# Real clusters broken on purpose (issue 9): kill -9 of a worker, Redis or a gateway under load, a Redis
# outage, adversarial worker frames, a skewed gateway clock. Slow (a cluster per scenario); `make test` runs it.
test-faults: $(STAMP)
	$(PY) -m pytest -q -m faults --durations=15 $(XDIST)

$(MODELS)/bench-llama-32m/config.json: models/configs/bench-llama-32m.json | $(STAMP)
	$(PY) scripts/make_tiny_model.py --config $< --out $(MODELS)/bench-llama-32m

# The main job: a local cluster (redis-server, gateway, two workers) under a mixed workload,
# priority against FIFO, and the explanation of the slowest P0 request (builds the tiny model if missing).
demo: $(STAMP)
	$(PY) scripts/demo.py

# The engine alone: mixed requests through one in-process engine.
demo-engine: $(STAMP) $(MODELS)/bench-llama-32m/config.json
	$(PY) scripts/demo_engine.py --model $(MODELS)/bench-llama-32m

bench: $(STAMP) $(MODELS)/bench-llama-32m/config.json
	$(PY) scripts/bench_engine.py --model $(MODELS)/bench-llama-32m --batch 16 --prompt-tokens 64 \
		--new-tokens 128 --json bench-engine.json

clean:
	rm -rf $(VENV) $(MODELS) .pytest_cache demo-output
