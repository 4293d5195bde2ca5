"""The engine tier's fixtures: two real vLLM engines for the whole session, routers per test.

`engine_fleet` starts the engines once (about 33 s; the venv is installed first if absent) and
stops them at the end of the session, whatever happened: a finalizer stops every process group,
and the engines die with this process if it is killed (PR_SET_PDEATHSIG). `fleet` hands the
same fleet to a test after making sure every engine is up again (a test that kills one and fails
before restarting it does not take the next tests down). `procs` starts routers per test.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.tools.enginefleet.fleet import Engine, EngineOptions, Fleet
from router.tools.enginefleet.install import engine_home, ensure_venv, nixl_dir
from router.tools.enginefleet.model import write_model
from tests.support.harness import Cluster
from tests_engine.support import ensure_healthy, wait_idle

# One engine per core, 64 KV blocks of 128 tokens each (8,192 tokens): small enough that a trace
# of a few long conversations evicts, big enough for prompts up to max_model_len. Every module's
# flags are on from the start, so that no module restarts the engines with others (a restart of
# both costs about 35 s): LoRA (two slots, adapters loaded at run time; no adapter is loaded
# unless a test loads one, and the base model is served as without it) and NIXL as `kv_both`
# (an engine hands KV over only for a request that asks with `kv_transfer_params`).
LORA_ARGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
FLEET_OPTIONS = EngineOptions(
    kv_blocks=64,
    max_model_len=2048,
    extra_args=LORA_ARGS,
    extra_env={
        # /v1/responses with previous_response_id needs the engine's response store.
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
    },
)


# Modules that leave an engine restarting (they kill one mid-answer) run last, so that no later
# test waits for the restart (about 30 s on these machines).
LAST = ("test_migration.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name in LAST)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def engine_fleet(request: pytest.FixtureRequest) -> Fleet:
    home = engine_home()
    python = ensure_venv(home)
    model = write_model(home / "models")
    keep = os.environ.get("SLUICEGATE_ENGINE_RUN_DIR")  # engine logs kept there, for a post-mortem
    run_dir = Path(keep) if keep else None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
    options = dataclasses.replace(FLEET_OPTIONS, nixl=nixl_dir(home))
    fleet = Fleet(python, model, count=2, options=options, run_dir=run_dir)
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
def procs(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """Routers (and other processes) started by one test, stopped when it ends; with
    SLUICEGATE_ENGINE_RUN_DIR set their logs are kept there too, one folder per test."""
    c = Cluster()
    try:
        yield c
    finally:
        for proc in c.procs:
            proc.stop(grace=5)
        keep = os.environ.get("SLUICEGATE_ENGINE_RUN_DIR")
        if keep:
            where = Path(keep) / re.sub(r"[^\w.-]+", "_", request.node.name)
            where.mkdir(parents=True, exist_ok=True)
            for log in c.tmp.glob("*.log"):
                shutil.copy(log, where / log.name)
        c.close()
