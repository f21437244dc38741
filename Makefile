# The newcomer's targets. `make up` starts proxy + prefill + decode on the default model (SmolLM2-135M-Instruct,
# fetched once);
# `make test` runs the test suite (what CI runs).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PDSERVE := $(VENV)/bin/pdserve
# Written after a successful install: `make up`/`make test` reinstall only when pyproject.toml
# is newer (the editable install picks up code changes by itself).
STAMP := $(VENV)/.pdserve-installed

.PHONY: install up down test bench clean gpu-check

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	# torch is pinned first so pip resolves it before the rest: where a local wheel folder holds this
	# version's CPU build, pip takes it; from PyPI alone the same pin is the CUDA build (several GB)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(STAMP)

up: install
	$(PDSERVE) up

down:
	$(PDSERVE) down

# two workers (pytest-xdist), a test file (or the files sharing one cluster, tests/helpers/xdist_units.py)
# each at a time: most of the suite waits on the processes it starts, and each worker forks them from a
# zygote that imported torch once (tests/helpers/zygote.py), so two at once take 7-8 min on 2 cores
# (7:15-7:33 in fresh clones for 2,169 tests; 7:58 for 2,031 with a fresh python -m per node)
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

bench: install
	$(PY) bench/engine_throughput.py
	$(PY) bench/kv_transfer.py
	$(PY) bench/proxy_overhead.py

# The GPU acceptance (issue 18): runs with any $(PYTHON) that has torch + CUDA, on a machine with no
# network, so it neither makes the venv nor installs (README, "GPU acceptance"). Without CUDA every
# step is SKIP. Writes $(OUT)/gpu-check.md and $(OUT)/gpu-check.json.
OUT ?= gpu-check-out
gpu-check:
	$(PYTHON) bench/gpu_check.py $(OUT)

clean:
	rm -rf $(VENV) .pdserve
