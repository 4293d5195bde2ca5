"""The engine tier's fixtures: two real vLLM engines for the whole session, routers per test.

`engine_fleet` starts the engines once (about 30 s; the venv is installed first if absent) and
stops them at the end of the session, whatever happened: a finalizer stops every process group,
and the engines die with this process if it is killed (PR_SET_PDEATHSIG). `fleet` hands the
same fleet to a test after making sure every engine is up again (a test that kills one and fails
before restarting it does not take the next tests down). `procs` starts routers per test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from router.enginefleet.fleet import Engine, EngineOptions, Fleet
from router.enginefleet.install import engine_home, ensure_venv
from router.enginefleet.model import write_model
from tests.harness import Cluster
from tests_engine.support import ensure_healthy, wait_idle

# One engine per core, 64 KV blocks of 128 tokens each (8,192 tokens): small enough that a trace
# of a few long conversations evicts, big enough for prompts up to max_model_len.
FLEET_OPTIONS = EngineOptions(
    kv_blocks=64,
    max_model_len=2048,
    # /v1/responses with previous_response_id needs the engine's response store.
    extra_env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"},
)


@pytest.fixture(scope="session")
def engine_fleet(request: pytest.FixtureRequest) -> Fleet:
    home = engine_home()
    python = ensure_venv(home)
    model = write_model(home / "models")
    fleet = Fleet(python, model, count=2, options=FLEET_OPTIONS)
    request.addfinalizer(fleet.stop)  # registered before the start: a failed start stops too
    fleet.start()
    return fleet


@pytest.fixture
def fleet(engine_fleet: Fleet) -> Fleet:
    """The session's engines, all healthy and idle when the test starts."""
    ensure_healthy(engine_fleet)
    wait_idle(engine_fleet.engines)
    return engine_fleet


@pytest.fixture
def engines(fleet: Fleet) -> list[Engine]:
    return fleet.engines


@pytest.fixture
def procs() -> Iterator[Cluster]:
    """Routers (and other processes) started by one test, stopped when it ends."""
    c = Cluster()
    try:
        yield c
    finally:
        c.close()
