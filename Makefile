# The two commands: `make run` and `make test`. Everything they need is installed by `setup`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_EXTRAS ?= dev
# The engine, llama.cpp's llama-server, is built from the llama.cpp tree this sdist vendors.
LLAMA_CPP_PYTHON := 0.3.36
ENGINE_DIR := $(VENV)/llama.cpp-$(LLAMA_CPP_PYTHON)

.PHONY: run setup test test-sqlite lint bench

run: setup
	@scripts/system-deps git-lfs
	$(PY) manage.py llmgw_run $(ARGS)

setup: $(VENV)/.installed $(VENV)/bin/llama-server

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(PIP_EXTRAS)]'
	touch $@

# Built once per version (about 4 minutes on 2 cores) and kept: a second setup does not rebuild.
$(VENV)/bin/llama-server: | $(VENV)/.installed
	scripts/build-llama-server $(LLAMA_CPP_PYTHON) $(ENGINE_DIR) $(PY)
	ln -sfn ../llama.cpp-$(LLAMA_CPP_PYTHON)/bin/llama-server $@

# The whole suite on the database in DATABASE_URL (SQLite when unset), then the smoke part on
# SQLite as well when the first run used another database.
test: setup
	@scripts/system-deps git-lfs chromium
	$(PY) -m pytest
	@if [ -n "$$DATABASE_URL" ] && [ "$${DATABASE_URL#sqlite}" = "$$DATABASE_URL" ]; then \
		echo "== smoke tests on SQLite =="; \
		env -u DATABASE_URL $(PY) -m pytest -m smoke -p no:cacheprovider; \
	fi

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
	$(PY) bench/gateway_keys.py
	$(PY) bench/gateway_frameworks.py
	$(PY) bench/front_door.py
	$(PY) bench/traffic.py
	$(PY) bench/engine.py
	$(PY) bench/routing.py
	$(PY) bench/canary.py
	$(PY) bench/fairness.py
	$(PY) bench/limits.py
	$(PY) bench/faults.py
