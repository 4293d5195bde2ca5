"""Client keys on /v1/*: hashes in config or in a mounted file, per-key model limits, through the
official openai SDK against a real router."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from starlette.requests import Request

from router.core.errors import Unauthorized, answer
from router.web.auth import ClientKey, ClientKeys
from tests.support.harness import Cluster, Proc, backend, sha, stats
from tests.support.wait import wait_for

FULL = "sk-client-full-0123456789"
LIMITED = "sk-client-limited-0123456789"


def sdk(router: Proc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    a = module_procs.mock("a", tokens=3)
    router = module_procs.router(
        {
            "backends": [backend("a", a, {"m1": "mock-model", "m2": "mock-model"})],
            "api_keys": [
                sha(FULL),
                {"sha256": sha(LIMITED).upper(), "name": "t", "models": ["m1"]},
            ],
        }
    )
    return {"a": a, "router": router}


def test_a_valid_key_reaches_every_model(fleet: dict[str, Proc]) -> None:
    c = sdk(fleet["router"], FULL)
    for model in ("m1", "m2"):
        assert c.completions.create(model=model, prompt="x").choices[0].text == "tok0 tok1 tok2 "
    assert sorted(m.id for m in c.models.list()) == ["m1", "m2"]


@pytest.mark.parametrize("key", ["wrong-key", FULL + "x", FULL[:-1]])
def test_missing_or_wrong_keys_are_401(fleet: dict[str, Proc], key: str) -> None:
    before = stats(fleet["a"])["requests"]
    with pytest.raises(openai.AuthenticationError) as info:
        sdk(fleet["router"], key).chat.completions.create(model="m1", messages=[])
    assert info.value.status_code == 401
    err = info.value.body
    assert isinstance(err, dict) and err["type"] == "invalid_request_error"
    assert err["code"] in ("invalid_api_key", "missing_api_key")
    with pytest.raises(openai.AuthenticationError):
        sdk(fleet["router"], key).models.list()
    assert stats(fleet["a"])["requests"] == before  # refused before anything went upstream


def test_no_authorization_header_and_other_schemes_are_401(fleet: dict[str, Proc]) -> None:
    url = fleet["router"].url
    for headers in ({}, {"authorization": f"Basic {FULL}"}, {"authorization": "Bearer"}):
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
            r = httpx.post(url + path, json={"model": "m1"}, headers=headers)
            assert r.status_code == 401
            assert set(r.json()["error"]) == {"message", "type", "code"}
            assert FULL not in r.text
        assert httpx.get(url + "/v1/models", headers=headers).status_code == 401
    # Health endpoints stay open for probes.
    assert httpx.get(url + "/healthz").status_code == 200


def test_a_limited_key_sees_and_reaches_only_its_models(fleet: dict[str, Proc]) -> None:
    c = sdk(fleet["router"], LIMITED)
    assert c.completions.create(model="m1", prompt="x").choices[0].text == "tok0 tok1 tok2 "
    assert [m.id for m in c.models.list()] == ["m1"]
    before = stats(fleet["a"])["requests"]
    for model in ("m2", "no-such-model"):
        with pytest.raises(openai.PermissionDeniedError) as info:
            c.chat.completions.create(model=model, messages=[])
        assert info.value.status_code == 403
        assert isinstance(info.value.body, dict) and info.value.body["code"] == "model_not_allowed"
    assert stats(fleet["a"])["requests"] == before


def test_the_client_key_never_reaches_the_backend(fleet: dict[str, Proc]) -> None:
    sdk(fleet["router"], FULL).chat.completions.create(model="m1", messages=[], stream=True)
    for rec in stats(fleet["a"])["recent"]:
        assert "authorization" not in rec["headers"]
        assert FULL not in str(rec) and LIMITED not in str(rec)


def _write_keys(path: Path, keys: list[str]) -> None:
    # Written aside and renamed in, as a Secret volume update appears to the pod.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"api_keys": [sha(k) for k in keys]}))
    tmp.replace(path)


def test_a_key_file_is_used_and_reread_when_it_changes(procs: Cluster) -> None:
    a = procs.mock("a", tokens=1)
    keys = procs.tmp / "keys.yaml"
    _write_keys(keys, ["sk-file-one"])
    reload = 0.1
    router = procs.router(
        {"backends": [backend("a", a)], "api_keys_reload": reload},
        env={"SLUICEGATE_API_KEYS_FILE": str(keys)},
    )
    assert sdk(router, "sk-file-one").completions.create(model="m", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        sdk(router, "sk-file-two").completions.create(model="m", prompt="x")
    _write_keys(keys, ["sk-file-two"])

    def rotated() -> bool:
        try:
            return bool(sdk(router, "sk-file-two").completions.create(model="m", prompt="x"))
        except openai.AuthenticationError:
            return False

    wait_for(rotated, "the rotated key file in force", every=2 * reload)
    with pytest.raises(openai.AuthenticationError):
        sdk(router, "sk-file-one").completions.create(model="m", prompt="x")
    # A broken update keeps the keys in force rather than locking everyone out.
    keys.write_text("api_keys: [not-a-hash")
    # It was read, and refused.
    wait_for(lambda: "client key file unreadable" in router.log(), "the broken file read", 10, 0.1)
    assert sdk(router, "sk-file-two").completions.create(model="m", prompt="x")
    assert "sk-file" not in router.log()


def test_a_raw_key_pasted_as_a_hash_stops_startup_without_echoing_it(procs: Cluster) -> None:
    a = procs.mock("a")
    router = procs.router(
        {"backends": [backend("a", a)], "api_keys": ["sk-pasted-raw-secret"]}, wait=False
    )
    assert router.popen.wait(30) == 2
    out = router.log()
    assert "api_keys" in out and "sha256" in out
    assert "sk-pasted-raw-secret" not in out


def test_a_key_file_caught_mid_write_keeps_the_keys_and_an_explicit_empty_list_revokes(
    tmp_path: Path,
) -> None:
    """A reload that finds the file truncated (an editor between truncate and write) is not an
    update: everyone keeps working. `api_keys: []` written on purpose does revoke every key."""
    path = tmp_path / "keys.yaml"
    _write_keys(path, ["sk-kept"])
    keys = ClientKeys([], str(path))
    request = Request({"type": "http", "headers": [(b"authorization", b"Bearer sk-kept")]})
    assert isinstance(keys.check(request), ClientKey)
    path.write_text("")
    os.utime(path, ns=(1, 1))  # a new stamp even where the clock is coarse
    assert keys.reload_if_changed() is False
    assert isinstance(keys.check(request), ClientKey)
    path.write_text("api_keys: []\n")
    assert keys.reload_if_changed() is True
    with pytest.raises(Unauthorized) as refused:
        keys.check(request)
    assert answer(refused.value).status_code == 401
