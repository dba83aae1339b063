# kvmesh: `make run` (the main job) and `make test` set themselves up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUN_ARGS ?=
TRACE ?=

.PHONY: run test proto proto-check setup deps clean

setup: $(STAMP) deps

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[test,bench]'
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

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

proto-check: $(STAMP)
	$(PY) scripts/gen_proto.py --check

run: setup
	$(VENV)/bin/kvmesh compare $(if $(TRACE),--trace $(TRACE),) $(RUN_ARGS)

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .run .pytest_cache
