# `make demo` and `make test` work on a fresh machine: they create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint install redis-server bench bench-quick engines test-engine engine-venv \
	lock image-test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,kubernetes]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sluicegate demo

# The tests start their own redis-server processes (and redis-cli, and openssl for a throwaway TLS
# certificate) on loopback ports; install what is absent.
redis-server:
	@command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 \
	  && command -v openssl >/dev/null 2>&1 || { \
	  echo "installing redis-server, redis-tools, openssl"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    redis-server redis-tools openssl >/dev/null; }

test: $(STAMP) redis-server
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile

$(VENV)/.bench: $(STAMP)
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(VENV)/.bench

# Starts its own mock upstreams, router(s), nginx (when installed) and redis-server on 127.0.0.1.
bench: $(VENV)/.bench redis-server
	$(PY) -m bench.run

bench-quick: $(VENV)/.bench redis-server
	$(PY) -m bench.run --quick

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Real vLLM engines (CPU build, a tiny model written locally) on 127.0.0.1 until Ctrl-C. vLLM gets a
# venv of its own under $${SLUICEGATE_ENGINE_HOME:-~/.cache/sluicegate} (pip, ~70 s, 3.4 GiB, once).
engines: $(STAMP)
	$(VENV)/bin/sluicegate engines

engine-venv: $(STAMP)
	$(VENV)/bin/sluicegate engines --install-only

# The engine tier: tests against two real engines (tests_engine/, not part of `make test`). Direct
# load on the engines comes from curl processes.
test-engine: engine-venv
	@command -v curl >/dev/null 2>&1 || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq curl >/dev/null; }
	$(PY) -m pytest -q -p no:cacheprovider --timeout 600 tests_engine

# The container image's hash-pinned locks, from pyproject.toml (tools/lock.py says how and why).
# Run it after changing dependencies and commit both files; tests/test_lock.py notices a stale one.
lock: $(STAMP)
	$(PY) -m pip install -q 'uv==0.13.9'
	$(PY) tools/lock.py

# Builds the image and runs it (tests/image/run.py): installs docker.io and mmdebstrap when
# absent, starts its own dockerd, and stops and removes everything it started.
image-test: $(STAMP)
	$(PY) -m tests.image.run
