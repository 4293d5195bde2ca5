"""Backends behind TLS with a private CA: traffic, health probes and scrapes share one policy.

A private CA, server certificates (for localhost, and for a name the URL does not carry) and a
client certificate are made with the `openssl` command; mock engines serve https with them
(`mock-upstream --ssl-*`, one of them requiring a client certificate). One real router holds a
backend per TLS setting, each serving its own model, and the official openai SDK asks each model:
with the right policy the request answers, the backend is healthy in /admin/backends and its
engine reading is fresh; with a wrong one all three fail alike, and the request gets an error in
the OpenAI format. Bad files fail startup and the admin call with the field named.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from dnslib import QTYPE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from tests.support.harness import ROOT, STARVED_S, Cluster, Proc, free_port
from tests.support.wait import wait_for

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")

TOKEN = "admin-token-for-tls-tests"
AUTH = {"authorization": f"Bearer {TOKEN}"}
HEALTH = {
    "interval": 0.5,
    "unhealthy_interval": 0.25,
    "timeout": 2.0,
    "unhealthy_threshold": 1,
    "healthy_threshold": 1,
}
ENGINE = {"interval": 0.25, "timeout": 2.0, "stale_after": 2.0}
# Long enough for a probe and a scrape after the router is up, on a loaded host.
SETTLE = 10 * (HEALTH["interval"] + HEALTH["timeout"] + ENGINE["interval"] + ENGINE["timeout"])


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _issue(d: Path, name: str, subject: str, ext: str) -> None:
    """`name`.key and `name`.pem, signed by the CA in `d`."""
    (d / f"{name}.ext").write_text(
        ext + "\nbasicConstraints=CA:FALSE\nsubjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid,issuer\n"
    )
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=d,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=d,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=sluicegate test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d,
    )  # fmt: skip
    _issue(
        d,
        "server",
        "/CN=localhost",
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth",
    )
    _issue(d, "other", "/CN=engine.internal", "subjectAltName=DNS:engine.internal")
    _issue(d, "client", "/CN=sluicegate-router", "extendedKeyUsage=clientAuth")
    (d / "not-pem.txt").write_text("this is not a certificate\n")
    # A "key" whose text must never appear in an error.
    (d / "bad.key").write_text("-----BEGIN PRIVATE KEY-----\nSECRETMARKER123\n")
    return d


def tls_mock(c: Cluster, pki: Path, name: str, cert: str, client_ca: bool = False) -> Proc:
    """A mock engine serving https with `cert`; with `client_ca`, clients need a certificate."""
    port = free_port()
    extra = ["--ssl-ca-certs", str(pki / "ca.pem")] if client_ca else []
    proc = c._spawn(
        [
            sys.executable, "-m", "router.cli", "mock-upstream", "--host", "127.0.0.1",
            "--port", str(port), "--name", name, "--tokens", "4", "--engine",
            "--ssl-certfile", str(pki / f"{cert}.pem"), "--ssl-keyfile", str(pki / f"{cert}.key"),
            *extra,
        ],
        port,
        f"mock-{name}",
        None,
    )  # fmt: skip
    proc.url = f"https://127.0.0.1:{port}"
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    ctx.check_hostname = False  # `other` is issued to a name, not this address
    ctx.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))

    def serving() -> bool:
        assert proc.popen.poll() is None, proc.log()
        try:
            return httpx.get(proc.url + "/health", verify=ctx, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(serving, f"{proc.url} serving TLS", 30, 0.05)
    return proc


class _Engines(BaseResolver):  # type: ignore[misc]
    """engines.test is 127.0.0.1; AAAA and other names are empty."""

    def resolve(self, request: DNSRecord, handler: Any) -> DNSRecord:
        reply = request.reply()
        qname = str(request.q.qname).rstrip(".")
        if qname == "engines.test" and request.q.qtype == QTYPE.A:
            reply.add_answer(RR(qname, QTYPE.A, rdata=A("127.0.0.1"), ttl=1))
        return reply


@pytest.fixture(scope="module")
def dns_port() -> Iterator[int]:
    port = free_port()
    server = DNSServer(
        _Engines(), address="127.0.0.1", port=port, logger=DNSLogger(log="-request,-reply")
    )
    server.start_thread()
    try:
        yield port
    finally:
        server.stop()


def entry(name: str, url: str, **tls: Any) -> dict[str, Any]:
    return {
        "name": name,
        "url": url,
        "models": {name: "mock-model"},
        **({"tls": tls} if tls else {}),
    }


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster, pki: Path, dns_port: int) -> Iterator[dict[str, Any]]:
    c = module_procs
    plain = tls_mock(c, pki, "plain", "server")
    mtls = tls_mock(c, pki, "mtls", "server", client_ca=True)
    other = tls_mock(c, pki, "other", "other")
    ca = str(pki / "ca.pem")
    cert, key = str(pki / "client.pem"), str(pki / "client.key")
    localhost = plain.url.replace("127.0.0.1", "localhost")
    mtls_url = mtls.url.replace("127.0.0.1", "localhost")
    backends = [
        entry("trusted", localhost, ca_file=ca),
        {"name": "system-store", "url": localhost, "models": {"system-store": "mock-model"}},
        entry("no-verify", plain.url, verify=False),
        entry("mtls", mtls_url, ca_file=ca, cert_file=cert, key_file=key),
        entry("mtls-no-cert", mtls_url, ca_file=ca),
        entry("renamed", other.url, ca_file=ca, server_name="engine.internal"),
        entry("renamed-not-said", other.url, ca_file=ca),
    ]
    router = c.router(
        {
            "backends": backends,
            "health": HEALTH,
            "engine_metrics": ENGINE,
            "retries": {"attempts": 1},
            "admin": {"allowed_backend_networks": ["127.0.0.0/8"], "denied_backend_networks": []},
            # The mock by a name: its address is discovered, so the certificate's name is given.
            "discovery": [
                {
                    "kind": "dns",
                    "name": "engines.test",
                    "nameserver": f"127.0.0.1:{dns_port}",
                    "port": plain.port,
                    "interval": HEALTH["interval"],
                    "scheme": "https",
                    "prefix": "found",
                    "backend": {"tls": {"ca_file": ca, "server_name": "localhost"}},
                }
            ],
        },
        env={"SLUICEGATE_ADMIN_TOKEN": TOKEN},
    )
    yield {"router": router, "plain": plain, "pki": pki}


def rows(router: Proc) -> dict[str, dict[str, Any]]:
    r = httpx.get(router.url + "/admin/backends", headers=AUTH, timeout=STARVED_S)
    r.raise_for_status()
    return {b["name"]: b for b in r.json()}


def works(router: Proc, name: str, model: str | None = None) -> None:
    """Traffic, the probe and the scrape of backend `name` all succeed."""

    def probed_and_scraped() -> bool:
        row = rows(router)[name]
        engine = row["engine"] or {}
        return (
            row["healthy"]
            and row["last_probe_latency_ms"] is not None
            and engine.get("scraped_at") is not None
            and engine.get("scrape_error") is None
        )

    wait_for(probed_and_scraped, f"{name}: healthy and scraped", SETTLE)
    sdk = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    out = sdk.chat.completions.create(
        model=model or name, messages=[{"role": "user", "content": "hi"}]
    )
    assert (out.choices[0].message.content or "").split() == ["tok0", "tok1", "tok2", "tok3"]


def fails(router: Proc, name: str, why: str, scrape_why: str) -> str:
    """Traffic, the probe and the scrape of backend `name` all fail; the request's message."""

    def failing() -> bool:
        row = rows(router)[name]
        engine = row["engine"] or {}
        return not row["healthy"] and str(engine.get("scrape_error", "")).startswith("unreachable")

    wait_for(failing, f"{name}: unhealthy and unscraped", SETTLE)
    row = rows(router)[name]
    assert row["reason"].startswith(f"probe failed ({why}"), row
    assert row["engine"]["scrape_error"].startswith(f"unreachable: {scrape_why}"), row
    assert row["engine"]["scraped_at"] is None, row  # never read, not an old reading
    sdk = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        sdk.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code in (502, 503), info.value
    body = info.value.response.json()
    assert set(body["error"]) == {"message", "type", "code"}, body
    return str(body["error"]["message"])


def test_a_private_ca_given_as_ca_file_serves_traffic_probes_and_scrapes(
    fleet: dict[str, Any],
) -> None:
    works(fleet["router"], "trusted")


def test_without_the_ca_traffic_probes_and_scrapes_all_fail(fleet: dict[str, Any]) -> None:
    message = fails(
        fleet["router"],
        "system-store",
        "tls: the backend's TLS certificate was refused: unable to get local issuer",
        "the backend's TLS certificate was refused",
    )
    assert message == "Could not connect to backend `system-store`.", message


def test_verify_false_connects_to_an_unknown_certificate(fleet: dict[str, Any]) -> None:
    works(fleet["router"], "no-verify")


def test_a_client_certificate_is_presented_when_required(fleet: dict[str, Any]) -> None:
    works(fleet["router"], "mtls")
    # TLS 1.3: the server refuses the missing certificate after the client's handshake ends,
    # so the refusal arrives as the connection closing at the request.
    fails(fleet["router"], "mtls-no-cert", "connect", "")


def test_server_name_checks_a_certificate_issued_to_another_name(fleet: dict[str, Any]) -> None:
    works(fleet["router"], "renamed")
    fails(
        fleet["router"],
        "renamed-not-said",
        "tls: the backend's TLS certificate was refused: IP address mismatch",
        "the backend's TLS certificate was refused: IP address mismatch",
    )


def test_discovery_templates_carry_tls_to_models_auto_probes_and_scrapes(
    fleet: dict[str, Any],
) -> None:
    router = fleet["router"]
    wait_for(
        lambda: any(n.startswith("found-") for n in rows(router)), "a discovered backend", SETTLE
    )
    name = next(n for n in rows(router) if n.startswith("found-"))
    assert rows(router)[name]["url"].startswith("https://127.0.0.1:"), rows(router)[name]
    works(router, name, "mock-model")  # the model came from its /v1/models, over TLS


def test_the_admin_api_takes_tls_and_names_a_bad_file(fleet: dict[str, Any]) -> None:
    router, pki = fleet["router"], fleet["pki"]
    url = fleet["plain"].url.replace("127.0.0.1", "localhost")

    def register(**tls: Any) -> httpx.Response:
        return httpx.post(
            router.url + "/admin/backends",
            json=entry("added", url, **tls),
            headers=AUTH,
            timeout=10,
        )

    missing = register(ca_file=str(pki / "absent.pem"))
    assert missing.status_code == 400, missing.text
    assert "tls" in missing.text and "ca_file" in missing.text, missing.text
    secret = register(ca_file=str(pki / "ca.pem"), cert_file=str(pki / "client.pem"),
                      key_file=str(pki / "bad.key"))  # fmt: skip
    assert secret.status_code == 400, secret.text
    assert "key_file" in secret.text and "SECRETMARKER" not in secret.text, secret.text
    good = register(ca_file=str(pki / "ca.pem"))
    assert good.status_code == 201, good.text
    assert good.json()["tls"]["ca_file"] == str(pki / "ca.pem")
    works(router, "added")


BAD = [
    ({"ca_file": "not-pem.txt"}, "ca_file"),
    ({"ca_file": "absent.pem"}, "ca_file"),
    ({"cert_file": "client.pem", "key_file": "bad.key"}, "key_file"),
    ({"cert_file": "not-pem.txt"}, "cert_file"),
    ({"key_file": "client.key"}, "key_file"),
    ({"verify": False, "ca_file": "ca.pem"}, "ca_file"),
]


def _config(pki: Path, tls: dict[str, Any]) -> dict[str, Any]:
    tls = {k: str(pki / v) if isinstance(v, str) else v for k, v in tls.items()}
    return {
        "backends": [entry("gpu-a", "https://localhost:1", **tls)],
        "health": {"enabled": False},
    }


@pytest.mark.parametrize(("tls", "field"), BAD)
def test_a_bad_tls_setting_is_refused_naming_the_backend_and_field(
    tmp_path: Path, pki: Path, tls: dict[str, Any], field: str
) -> None:
    from router.core.settings import ConfigError, load_settings

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_config(pki, tls)))
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    message = str(info.value)
    assert "(gpu-a).tls" in message and f"Value error, {field}" in message, message
    assert "SECRETMARKER" not in message


def test_a_bad_tls_file_fails_startup(procs: Cluster, pki: Path) -> None:
    path = procs.write_config(_config(pki, {"cert_file": "client.pem", "key_file": "bad.key"}))
    run = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(path), "--port", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert "(gpu-a).tls: Value error, key_file" in run.stderr, run.stderr
    assert "SECRETMARKER" not in run.stderr


def test_one_context_per_distinct_policy_shared_and_rebuilt_when_a_file_changes(
    pki: Path, tmp_path: Path
) -> None:
    from router.core.backend import Backend
    from router.core.settings import BackendConfig
    from router.core.tls import default_context

    ca = tmp_path / "ca.pem"
    shutil.copy(pki / "ca.pem", ca)

    def build(name: str, **tls: Any) -> Backend:
        return Backend.from_config(
            BackendConfig.model_validate(entry(name, "https://localhost:1", **tls))
        )

    a, b = build("a", ca_file=str(ca)), build("b", ca_file=str(ca), server_name="x.internal")
    assert a.ssl_context is not None and a.ssl_context is b.ssl_context  # SNI is not the context
    assert build("c", verify=False).ssl_context is not a.ssl_context
    plain = build("d")
    assert plain.ssl_context is None  # the shared default, made at the first https connect
    assert default_context() is default_context()
    shutil.copy(pki / "other.pem", ca)  # replaced: a backend built now reads it again
    assert build("a", ca_file=str(ca)).ssl_context is not a.ssl_context
    assert "ssl_context" not in repr(a)


@pytest.mark.parametrize(
    ("base", "query", "path"),
    [
        ("http://h:1", {}, "/v1/chat/completions"),
        ("https://h/pre/x", {"k": "v w"}, "/v1/responses/resp_1"),
        ("http://[::1]:8", {}, "/a/b?c=1"),
    ],
)
def test_urls_are_joined_as_an_httpx_client_with_base_url_would(
    base: str, query: dict[str, str], path: str
) -> None:
    from urllib.parse import urlencode

    from router.upstream.pools import join_url

    client = httpx.AsyncClient(base_url=base, params=query or None)
    want = client.build_request("POST", path).url
    assert join_url(httpx.URL(base + "/"), urlencode(query).encode(), path) == want


def test_a_backend_query_is_added_to_the_clients_own() -> None:
    from router.upstream.pools import join_url

    url = join_url(httpx.URL("http://h:1/pre/"), b"api-version=2", "/v1/x?a=1&b=%20")
    assert url.raw_path == b"/pre/v1/x?a=1&b=%20&api-version=2"
