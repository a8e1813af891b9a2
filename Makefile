# The two commands: `make run` and `make test`. Everything they need is installed by `setup`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_EXTRAS ?= dev
# The engine, llama.cpp's llama-server, is built from the llama.cpp tree this sdist vendors.
LLAMA_CPP_PYTHON := 0.3.36
ENGINE_DIR := $(VENV)/llama.cpp-$(LLAMA_CPP_PYTHON)

# LLMGW_ENGINE: which engine `make setup` builds and links as $(VENV)/bin/llama-server: cpu, cuda
# (in $(ENGINE_DIR)-cuda, about 20 minutes on 2 cores per GPU architecture), or auto (the
# default: cuda when a system nvcc is found and nvidia-smi lists a GPU, else cpu). See
# scripts/build-llama-server.
LLMGW_ENGINE ?= auto
export LLMGW_ENGINE

.PHONY: run setup engine engine-vllm test test-vllm coverage test-sqlite lint bench

run: setup
	@scripts/system-deps git-lfs
	$(PY) manage.py llmgw_run $(ARGS)

setup: $(VENV)/.installed engine

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(PIP_EXTRAS)]'
	touch $@

# The engine LLMGW_ENGINE asks for, built once per version and backend and kept (a second setup
# only checks that it runs), then linked as $(VENV)/bin/llama-server.
engine: | $(VENV)/.installed
	scripts/build-llama-server $(LLAMA_CPP_PYTHON) $(ENGINE_DIR) $(PY) $(VENV)/bin/llama-server

# vLLM, the second engine (docs/engines.md), in an environment of its own that node agents run
# (about 1.3 GB; the control plane's stays small): installed once per version and kept in
# ~/.cache/llmgw. `make setup` does not install it; `make test-vllm` does.
engine-vllm:
	scripts/install-vllm

# vLLM end to end (tests/llmgw/test_vllm_e2e.py: served, limited, traced, updated and rolled
# back under traffic): about 7 minutes of three vLLM starts, apart from `make test`, whose
# 25 minutes they would overrun. The rest of vLLM's tests need no vLLM and run in `make test`.
test-vllm: $(VENV)/.installed engine-vllm
	@scripts/system-deps git-lfs
	LLMGW_TEST_VLLM=1 $(PY) -m pytest -p no:cacheprovider tests/llmgw/test_vllm_e2e.py

# `make test` needs an engine, not a particular one: it keeps whichever setup linked, and builds
# one only when there is none (the CPU one unless LLMGW_ENGINE is given): a GPU machine's
# `make test` does not start a 20-minute CUDA build of its own.
$(VENV)/bin/llama-server: | $(VENV)/.installed
	LLMGW_ENGINE=$(if $(filter command line environment,$(origin LLMGW_ENGINE)),$(LLMGW_ENGINE),cpu) \
		scripts/build-llama-server $(LLAMA_CPP_PYTHON) $(ENGINE_DIR) $(PY) $@

# The whole suite on the database in DATABASE_URL (SQLite when unset), on TEST_WORKERS processes
# at once (pytest-xdist; most of a test's time is spent waiting on the processes it starts, so
# more workers than cores), then, when the first run used another database, the SQLite part:
# the tests marked `smoke` (what differs on the embedded default, and a sample of the rest), on
# SQLite as well. Each part ends with its 25 slowest tests.
TEST_WORKERS ?= 3
PYTEST_PARALLEL = -n $(TEST_WORKERS) --dist loadgroup --durations=25
# `make coverage`: the same runs, measuring the product's lines that the test processes run
# (not those of the processes they start), then the report.
PRODUCT = access accounts catalog console core fleet gateway llmgw llmgw_site registry
COVERAGE = $(addprefix --cov=,$(PRODUCT)) --cov-report=
test coverage: $(VENV)/.installed $(VENV)/bin/llama-server
	@scripts/system-deps git-lfs chromium clis oidc
	$(PY) -m pytest $(PYTEST_PARALLEL) $(if $(filter coverage,$@),$(COVERAGE))
	@if [ -n "$$DATABASE_URL" ] && [ "$${DATABASE_URL#sqlite}" = "$$DATABASE_URL" ]; then \
		echo "== the SQLite part =="; \
		env -u DATABASE_URL $(PY) -m pytest -m smoke -p no:cacheprovider $(PYTEST_PARALLEL) \
			$(if $(filter coverage,$@),$(COVERAGE) --cov-append); \
	fi
	$(if $(filter coverage,$@),$(PY) -m coverage report --skip-covered --sort=cover)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .

bench: setup
	$(PY) bench/catalog_list.py
	$(PY) bench/console_models.py
	$(PY) bench/placement.py
	$(PY) bench/reconcile.py
	$(PY) bench/update_check.py
	$(PY) bench/mirror_fetch.py
	$(PY) bench/gateway.py --quick
	$(PY) bench/gateway_floor.py
	$(PY) bench/access_log.py
	$(PY) bench/gateway_apis.py --quick
	$(PY) bench/validate.py
	$(PY) bench/gateway_keys.py
	$(PY) bench/gateway_frameworks.py
	$(PY) bench/front_door.py
	$(PY) bench/web_door.py
	$(PY) bench/traffic.py
	$(PY) bench/engine.py
	$(PY) bench/routing.py
	$(PY) bench/canary.py
	$(PY) bench/fairness.py
	$(PY) bench/autoscale.py
	$(PY) bench/limits.py
	$(PY) bench/faults.py
	$(PY) bench/fleet.py
