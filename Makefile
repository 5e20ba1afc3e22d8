# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv on first use (torch pinned for development and CI; the package
# itself only states a range, so users keep their own torch).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0

.PHONY: venv demo test preflight lint typecheck bench gpu-check clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77" wheel
	$(PY) -m pip install -q "$(TORCH)" numpy
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: venv
	$(VENV)/bin/stepwatch demo

# Lint and type checks run inside the test suite (tests/test_quality.py). The preflight
# installs the system packages the tests need (root with apt-get) or stops at once with one
# line naming them (tools/preflight). Two phases: everything but real training whose
# assertions depend on the machine's timing runs on 4 workers (databases, HTTP,
# subprocesses, multi-process gloo checks of exact results: mostly waiting, so 4 keep 2
# cores busy), the longest dealt first to each worker; then the timing-dependent real-training tests (marked
# solo: detection, throughput) alone, one at a time, so that the only load they share the
# cores with is the CPU burner they start themselves. A solo test that fails is run once
# more, alone (--last-failed): on 2 shared cores a few of them fail about one run in five
# from the machine's own scheduling (a rank descheduled for seconds); a test that fails
# twice fails the suite, and the first failure stays in the log.
test: preflight venv
	$(PY) -m pytest -n 4 --dist worksteal -m "not solo"
	$(PY) -m pytest -m solo || $(PY) -m pytest -m solo --last-failed --last-failed-no-failures none

preflight:
	@tools/preflight

lint: venv
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

typecheck: venv
	$(PY) tools/typecheck.py

# Every benchmark, printing ratios against baselines measured in the same run: hot path
# vs Lightning's Throughput, profiler window, agent overhead on gloo training, ingest at
# 4,096 ranks, queries over 30 days, /metrics scrape; needs PostgreSQL like the tests.
bench: venv
	$(PY) -m benchmarks

# On a machine with CUDA: check the GPU path in < 5 minutes, one verdict line per check
# (tools/gpu_check.py). Without CUDA it says so and exits 0. The pinned venv has a CPU
# torch: run it with a CUDA build of torch, e.g. `make gpu-check GPU_PY=python`.
GPU_PY ?= $(PY)
gpu-check:
	$(GPU_PY) tools/gpu_check.py

clean:
	rm -rf build dist .pytest_cache .mypy_cache .ruff_cache
