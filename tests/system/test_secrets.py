"""Secrets: a backend's key reaches that backend (in the header it asks for), the client's key
never does, and no secret appears in any response body, response header or router log line."""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import openai
import pytest

from tests.support.harness import Cluster, Proc, backend, control, stats

ADMIN = "adm-7f3c9e1d2b5a"
CLIENT = "cli-4d8e2a6f0c3b"
FILE_KEY = "sk-file-9a1b2c3d4e5f"
API_KEY = "sk-api-1f2e3d4c5b6a"
ENV_KEY = "az-env-6e5d4c3b2a19"
HEADER_SECRET = "hdr-0a9b8c7d6e5f"
OTHER_KEYS = ("sk-dup-2b3c4d5e6f7a", "sk-bad-3c4d5e6f7a8b", "sk-patch-4d5e6f7a8b9c")
SECRETS = (ADMIN, CLIENT, FILE_KEY, API_KEY, ENV_KEY, HEADER_SECRET, *OTHER_KEYS)


class Seen:
    """Every response the test got, to search for secrets at the end."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def add(self, r: httpx.Response) -> httpx.Response:
        self.texts.append(r.text)
        self.texts.append(repr(list(r.headers.items())))
        return r


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    file_mock = module_procs.mock("file", tokens=3)
    api_mock = module_procs.mock("api", tokens=3)
    azure_mock = module_procs.mock("azure", tokens=3)
    router = module_procs.router(
        {
            "backends": [
                backend("file", file_mock, {"m-file": "mock-model"}, api_key=FILE_KEY),
                {
                    **backend("azure", azure_mock, {"m-azure": "gpt-4o-deployment"}),
                    "kind": "openai",
                    "api_key_env": "AZURE_TEST_KEY",
                    "key_header": "api-key",
                    "query": {"api-version": "2024-10-21"},
                    "headers": {"x-ms-client": "sluicegate", "x-tenant-secret": HEADER_SECRET},
                },
            ],
            "api_keys": [hashlib.sha256(CLIENT.encode()).hexdigest()],
        },
        env={
            "SLUICEGATE_ADMIN_TOKEN": ADMIN,
            "AZURE_TEST_KEY": ENV_KEY,
            "SLUICEGATE_LOG_LEVEL": "debug",
        },
    )
    return {"file": file_mock, "api": api_mock, "azure": azure_mock, "router": router}


def sdk(router: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=CLIENT, max_retries=0)


def test_keys_go_where_they_belong_and_nowhere_else(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    seen = Seen()
    auth = {"authorization": f"Bearer {ADMIN}"}
    url = router.url + "/admin/backends"

    registered = seen.add(
        httpx.post(url, headers=auth, json=backend("api", fleet["api"], ["m-api"], api_key=API_KEY))
    )
    assert registered.status_code == 201
    assert registered.json()["api_key"] == "***"

    for model in ("m-file", "m-azure", "m-api"):
        for control_mock in ("file", "api", "azure"):
            control(fleet[control_mock], reset_stats=True)
        stream = sdk(router).chat.completions.create(model=model, messages=[], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        whole = sdk(router).chat.completions.create(model=model, messages=[])
        assert whole.choices[0].message.content == "tok0 tok1 tok2 "
        name = model.removeprefix("m-")
        recs = stats(fleet[name])["recent"]
        assert len(recs) == 2
        for rec in recs:
            headers: dict[str, Any] = rec["headers"]
            assert CLIENT not in repr(rec)
            if name == "azure":
                # Azure-style: its own key header, the api-version query, extra headers.
                assert headers["api-key"] == ENV_KEY
                assert "authorization" not in headers
                assert rec["query"] == "api-version=2024-10-21"
                assert headers["x-ms-client"] == "sluicegate"
                assert headers["x-tenant-secret"] == HEADER_SECRET
                assert rec["model"] == "gpt-4o-deployment"
            else:
                assert (
                    headers["authorization"] == f"Bearer {FILE_KEY if name == 'file' else API_KEY}"
                )
                assert "api-key" not in headers and rec["query"] == ""

    # Every admin answer, success or failure, with secrets in the requests that caused them.
    seen.add(httpx.get(url, headers=auth))
    for name in ("file", "azure", "api"):
        body = seen.add(httpx.get(f"{url}/{name}", headers=auth)).json()
        assert body["api_key"] == "***"
    assert seen.add(httpx.get(f"{url}/azure", headers=auth)).json()["headers"] == {
        "x-ms-client": "***",
        "x-tenant-secret": "***",
    }
    dup = backend("api", fleet["api"], api_key=OTHER_KEYS[0])
    assert seen.add(httpx.post(url, headers=auth, json=dup)).status_code == 409
    for bad in (
        {**backend("bad", fleet["api"], api_key=OTHER_KEYS[1]), "url": "nope"},
        {**backend("bad", fleet["api"]), "api_key": OTHER_KEYS[1], "api_key_env": "X"},
        {**backend("bad", fleet["api"]), "api_key": {"nested": OTHER_KEYS[1]}},
        {**backend("bad", fleet["api"]), "api_key_env": "SLUICEGATE_ADMIN_TOKEN"},
        {**backend("bad", fleet["api"]), "headers": {"x": OTHER_KEYS[1], "y": 5}},
    ):
        assert seen.add(httpx.post(url, headers=auth, json=bad)).status_code == 400
    patch = {"weight": 2, "api_key": OTHER_KEYS[2]}
    assert seen.add(httpx.patch(f"{url}/api", headers=auth, json=patch)).status_code == 400
    assert (
        seen.add(httpx.get(url, headers={"authorization": f"Bearer {ADMIN}x"})).status_code == 401
    )
    assert (
        seen.add(httpx.get(url, headers={"authorization": f"Bearer {CLIENT}"})).status_code == 401
    )
    wrong = {"authorization": f"Bearer {ADMIN}", "content-type": "application/json"}
    r = httpx.post(router.url + "/v1/chat/completions", headers=wrong, json={"model": "m-file"})
    assert seen.add(r).status_code == 401
    control(fleet["file"], fail_status=500)
    r = httpx.post(
        router.url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {CLIENT}"},
        json={"model": "m-file", "messages": []},
    )
    assert seen.add(r).status_code == 500
    control(fleet["file"], fail_status=0)
    assert seen.add(httpx.delete(f"{url}/api", headers=auth)).status_code == 200

    everything = "\n".join(seen.texts)
    for secret in SECRETS:
        assert secret not in everything, f"a secret leaked into a response: {secret[:6]}..."

    router.stop()  # flush and close the log
    log = router.log()
    assert '"msg": "request"' in log and '"msg": "registry changed"' in log  # it did log
    for secret in SECRETS:
        assert secret not in log, f"a secret leaked into the log: {secret[:6]}..."
