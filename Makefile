# `make demo` and `make test` work on a fresh machine: they create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint install redis-server chromium system-deps bench bench-quick bench-hop nginx \
	engines test-engine engine-venv lock image-test docs keda-proto \
	picker-proto

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

# The console's browser tests (tests/web/test_console.py) drive the distribution's Chromium; where
# it cannot be installed they skip and say so.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing chromium (the console's browser tests)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    chromium >/dev/null; } || echo "chromium could not be installed: tests/web/test_console.py will skip"; }

# What the suite needs from the distribution, in one apt run (Chromium optional, see above).
system-deps:
	@missing=""; \
	for c in redis-server redis-cli openssl; do command -v $$c >/dev/null 2>&1 || missing=1; done; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  echo "installing redis-server, redis-tools, openssl, chromium (what is absent)"; \
	  apt-get update -qq; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools openssl \
	    >/dev/null; \
	  command -v chromium >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y \
	    -qq chromium >/dev/null || echo "chromium could not be installed: tests/web/test_console.py will skip"; \
	fi

# The venv and the distribution's packages install side by side (pip and apt wait on the network
# and the disk, not on each other); mypy runs beside the tests, which leave CPU idle while they
# wait on their servers, and so do four test processes on two cores (since routers fork from a
# process that imported them once, tests/support/zygote.py, the suite waits more than it
# computes: 4:04 against 4:46 with three, one quiet machine). Together that keeps `make test` on
# a fresh machine within its 6 minutes.
# The suite starts hundreds of router and mock processes, each importing ~130 of the project's
# modules: compiled once here, they are not compiled again by each process where the environment
# says not to write bytecode (PYTHONDONTWRITEBYTECODE), ~0.15 s of CPU saved per router start.
test:
	@$(MAKE) --no-print-directory -j2 install system-deps
	$(VENV)/bin/ruff check .
	@$(PY) -m compileall -q -j0 router balancers health tests >/dev/null
	@$(VENV)/bin/mypy > .mypy.out 2>&1 & mypy=$$!; \
	$(PY) -m pytest -q -p no:cacheprovider -n 4 --dist loadfile; tests=$$?; \
	wait $$mypy; typed=$$?; cat .mypy.out; rm -f .mypy.out; \
	[ $$tests -eq 0 ] && [ $$typed -eq 0 ]

$(VENV)/.bench: $(STAMP)
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(VENV)/.bench

# Starts its own mock upstreams, router(s), nginx (when installed) and redis-server on 127.0.0.1.
bench: $(VENV)/.bench redis-server
	$(PY) -m bench.run

bench-quick: $(VENV)/.bench redis-server
	$(PY) -m bench.run --quick

# nginx, the hop's reference (bench/scenarios/hop.py starts its own on loopback ports; none is
# served here).
nginx:
	@command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || { \
	  echo "installing nginx (the hop benchmark's reference)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light \
	    >/dev/null; }

# The hop's gate (issue #28): fails when router CPU per request, as a ratio to nginx's in the same
# run, grew more than 5 % over bench/hop_baseline.json. On a shared machine re-run a failure
# before believing it (docs/benchmarks.md).
bench-hop: $(VENV)/.bench nginx
	$(PY) -m bench.scenarios.hop --check

# docs/configuration.md from the settings model (tests/tools/test_settings_doc.py fails while it is
# stale).
docs: $(STAMP)
	$(PY) -m router.tools.settings_doc

# KEDA's external scaler protocol: the committed modules, regenerated from the vendored .proto.
keda-proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
		router/scaling/keda/externalscaler.proto

# The endpoint picker's messages: regenerated from xds-protos' descriptors of Envoy's API,
# installed into a temporary directory (needs the package index; router/tools/protos.py).
picker-proto: $(STAMP)
	$(PY) -m router.tools.protos

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Real vLLM engines (CPU build, a tiny model written locally) on 127.0.0.1 until Ctrl-C. vLLM gets a
# venv of its own under $${SLUICEGATE_ENGINE_HOME:-~/.cache/sluicegate} (pip, ~70 s, 3.4 GiB, once),
# and NIXL (prefill/decode KV handoff; `sluicegate engines --pd`) a directory beside it (~10 s).
engines: $(STAMP)
	$(VENV)/bin/sluicegate engines

# The vLLM venv installs beside the router's own .venv, not after it: its installer
# (router/tools/enginefleet/install.py) needs only the standard library, and both pips wait on
# the disk and the index more than on the CPU.
engine-venv:
	@$(PYTHON) -c 'from router.tools.enginefleet.install import engine_home, ensure_venv; \
	  ensure_venv(engine_home())' & vllm=$$!; \
	  $(MAKE) --no-print-directory $(STAMP) || { kill $$vllm; exit 1; }; \
	  wait $$vllm
	$(VENV)/bin/sluicegate engines --install-only

# The whole tier is bounded (SIGINT first, so pytest still prints what failed and stops the
# engines): a run that hangs fails in minutes, not at the CI's limit.
ENGINE_TIER_LIMIT_S ?= 1200

# The engine tier: tests against two real engines (tests_engine/, not part of `make test`). Direct
# load on the engines comes from curl processes; two router replicas share a redis-server.
test-engine: engine-venv redis-server
	@command -v curl >/dev/null 2>&1 || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq curl >/dev/null; }
	timeout -s INT -k 60 $(ENGINE_TIER_LIMIT_S) \
	  $(PY) -m pytest -q -p no:cacheprovider --timeout 300 --durations 12 tests_engine

# The container image's hash-pinned locks, from pyproject.toml (tools/lock.py says how and why).
# Run it after changing dependencies and commit both files; tests/project/test_lock.py notices a
# stale one.
lock: $(STAMP)
	$(PY) -m pip install -q 'uv==0.13.9'
	$(PY) tools/lock.py

# Builds the image and runs it (tests/image/run.py): installs docker.io and mmdebstrap when
# absent, starts its own dockerd, and stops and removes everything it started. Where the pinned
# base cannot be pulled it builds on a local stand-in, cached in ~/.cache/sluicegate/image-base.
image-test: $(STAMP)
	$(PY) -m tests.image.run
