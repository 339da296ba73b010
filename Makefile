# pdgate: every target installs what it needs into .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.pdgate-dev-installed
PYTEST_ARGS ?=

.PHONY: install run test test-slow lint format redis-server clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

install: $(STAMP)

## run: the embedded cluster (gateway + 2 prefill + 2 decode sim shims) on http://127.0.0.1:8000/v1
run: install
	$(BIN)/pdgate up

## redis-server: the tests start a private Redis when none answers; make sure the binary exists
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing Debian's redis-server (tests start private Redis servers)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server >/dev/null; \
	  command -v redis-server >/dev/null 2>&1 || { [ -x /usr/bin/redis-server ] && exit 0; }; }

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

## test: lint + the default suite (real sockets, real Redis, real subprocesses); < 10 minutes
test: install redis-server lint
	$(BIN)/python -m pytest -m "not slow and not vllm" $(PYTEST_ARGS)

## test-slow: the longer end-to-end suites
test-slow: install redis-server
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
