"""Uploads and bodies held (issue 46, defects 1, 10, 21, 23), against real routers and mock
engines on loopback:

- a multipart part header is capped (8 KiB) and its `Content-Disposition` read in one pass:
  past the cap, or with hundreds of parameters, the form gets 400 in OpenAI's format;
- a form naming `model` (or `stream`) twice, or naming it so another parser could read it
  otherwise, gets 400; what the router accepts, the engine (the mock, which parses forms with
  the standard library's `email` parser, not the router's) reads the same way;
- bodies read and held count against `max_held_body_bytes`: past it, 503 with Retry-After; the
  count returns to 0 on every way out (answered, refused, too big, client gone mid-body or
  mid-stream, body timeout);
- `/v1/messages` answers its body timeout (408) and a wrong method (405) in Anthropic's shape.
"""

from __future__ import annotations

import ast
import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from router.request.wire.multipart import MAX_PART_HEADER, MAX_PARTS, BadForm, form_fields
from router.tools.mock.upstream import _form as mock_form
from tests.support.harness import ROOT, STARVED_S, Cluster, Proc, backend, metric, stats
from tests.support.wait import wait_for

BOUNDARY = "XyZzy"
FORM = f"multipart/form-data; boundary={BOUNDARY}"
AUDIO = b"RIFF" + bytes(range(256)) * 16
BODY_TIMEOUT = 1.0  # the forms router's: the 408 tests wait this long

MAX_BODY = 16 * 1024
BUDGET = 40 * 1024  # the budget router's: three held 12,000-byte bodies and no 8,000-byte one
HELD = 12_000
HELD_METRIC = "sluicegate_body_bytes_held"


@pytest.fixture(scope="module")
def forms(module_procs: Cluster) -> dict[str, Proc]:
    mock = module_procs.mock("forms", tokens=2)
    router = module_procs.router(
        {"backends": [backend("a", mock)], "server": {"body_timeout": BODY_TIMEOUT}}
    )
    return {"mock": mock, "router": router}


@pytest.fixture(scope="module")
def budget(module_procs: Cluster) -> dict[str, Proc]:
    # Tokens 50 ms apart: a stream of 200 lasts long enough for its client to leave mid-way.
    mock = module_procs.mock("budget", itl_ms=50, tokens=2)
    router = module_procs.router(
        {
            "backends": [backend("a", mock)],
            "max_body_bytes": MAX_BODY,
            "max_upload_bytes": MAX_BODY,
            "max_held_body_bytes": BUDGET,
        }
    )
    return {"mock": mock, "router": router}


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    try:
        yield held
    finally:
        for s in held:
            s.close()


def part(disposition: str, value: bytes, extra: bytes = b"") -> bytes:
    return (
        f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n".encode("latin-1")
        + extra
        + b"\r\n"
        + value
        + b"\r\n"
    )


def form(*parts: bytes) -> bytes:
    audio = part('form-data; name="file"; filename="a.wav"', AUDIO, b"Content-Type: audio/wav\r\n")
    return audio + b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def upload(router: Proc, body: bytes) -> httpx.Response:
    return httpx.post(
        router.url + "/v1/audio/transcriptions",
        content=body,
        headers={"content-type": FORM},
        timeout=20,
    )


def openai_error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["type"] and error["message"], error
    return dict(error)


def last_model(mock: Proc) -> str | None:
    rows = [r for r in stats(mock)["recent"] if r["path"] == "/v1/audio/transcriptions"]
    return rows[-1]["model"] if rows else None


def chat_body(size: int, **extra: Any) -> bytes:
    """A chat request of exactly `size` bytes."""
    head = {"model": "m", "max_tokens": 2, **extra, "messages": [{"role": "user", "content": ""}]}
    bare = json.dumps(head).encode()
    return json.dumps(
        {**head, "messages": [{"role": "user", "content": "x" * (size - len(bare))}]}
    ).encode()


def held(router: Proc) -> float:
    return metric(router, HELD_METRIC)


def held_is(router: Proc, value: float) -> None:
    wait_for(lambda: held(router) == value, f"{HELD_METRIC} == {value}")


# -- defect 1: part headers -------------------------------------------------------------------


def test_a_part_header_past_8_kib_gets_400(forms: dict[str, Proc]) -> None:
    # The shape: `content-disposition:;` repeated on one header line, here past the cap
    # (before: a regex over it, quadratic; and the part's first line still named the model).
    flood = b"X-Pad: " + b"content-disposition:;" * 600 + b"\r\n"
    r = upload(forms["router"], form(part('form-data; name="model"', b"m", flood)))
    error = openai_error(r, 400, "part_header_too_large")
    assert str(MAX_PART_HEADER) in error["message"]


def test_a_disposition_with_hundreds_of_parameters_gets_400(forms: dict[str, Proc]) -> None:
    disposition = "form-data" + ";" * 300 + ' name="model"'
    r = upload(forms["router"], form(part(disposition, b"m")))
    openai_error(r, 400, "invalid_form")


def test_a_part_header_of_many_lines_under_the_cap_is_read(forms: dict[str, Proc]) -> None:
    pad = b"X-Pad: a\r\n" * 700  # 7,000 bytes, the name after them
    r = upload(forms["router"], form(part('form-data; name="model"', b"m", pad)))
    assert r.status_code == 200, r.text
    assert last_model(forms["mock"]) == "mock-model"  # the alias spliced into the right span


def test_part_count_and_header_caps_in_the_parser() -> None:
    boundary = BOUNDARY.encode()
    many = form(*[part(f'form-data; name="f{i}"', b"v") for i in range(MAX_PARTS)])
    with pytest.raises(BadForm) as raised:
        form_fields(many, boundary, frozenset({"model"}))
    assert raised.value.code == "too_many_parts"
    # A header cut short by the body's end is not a form: no fields, no refusal.
    assert (
        form_fields(b"--XyZzy\r\nContent-Disposition: form", boundary, frozenset({"model"})) == {}
    )


# -- defect 23 and the parsers' agreement -----------------------------------------------------


@pytest.mark.parametrize(
    "parts",
    [
        (part('form-data; name="model"', b"m"), part('form-data; name="model"', b"other")),
        (
            part('form-data; name="model"; filename="m"', b"m"),
            part('form-data; name="model"', b"m"),
        ),
        (
            part('form-data; name="model"', b"m"),
            part('form-data; name="stream"', b"true"),
            part('form-data; name="stream"', b"false"),
        ),
    ],
    ids=["model twice", "a file named model", "stream twice"],
)
def test_a_field_the_router_reads_given_twice_gets_400(
    forms: dict[str, Proc], parts: tuple[bytes, ...]
) -> None:
    before = len(stats(forms["mock"])["recent"])
    r = upload(forms["router"], form(*parts))
    openai_error(r, 400, "duplicate_field")
    assert len(stats(forms["mock"])["recent"]) == before  # never reached the engine


# Content-Disposition values another parser could read otherwise than a plain one.
AMBIGUOUS = {
    "two names": 'form-data; name="note"; name="model"',
    "encoded name": "form-data; name*=utf-8''model",
    "continued name": 'form-data; name*0="mo"; name*1="del"',
}
# Odd but unambiguous: the router reads what the engine reads.
ODD = {
    "unquoted": "form-data; name=model",
    "angle brackets": "form-data; name=<model>",
    "spaced": 'form-data ;  NAME = "model" ',
    "quoted semicolon before": 'form-data; x="a;b"; name="model"',
}


@pytest.mark.parametrize("disposition", list(AMBIGUOUS.values()), ids=list(AMBIGUOUS))
def test_an_ambiguous_name_gets_400(forms: dict[str, Proc], disposition: str) -> None:
    r = upload(
        forms["router"], form(part('form-data; name="model"', b"m"), part(disposition, b"m"))
    )
    openai_error(r, 400, "invalid_form")


@pytest.mark.parametrize("disposition", list(ODD.values()), ids=list(ODD))
def test_what_the_router_reads_the_engine_reads(forms: dict[str, Proc], disposition: str) -> None:
    body = form(part(disposition, b"m"), part('form-data; name="stream"', b"false"))
    assert mock_form(body, FORM) == {"model": "m", "stream": False}  # the engine's reading
    r = upload(forms["router"], body)
    assert r.status_code == 200, r.text
    assert last_model(forms["mock"]) == "mock-model"  # the span the engine read got the alias


def test_hidden_names_are_not_read_by_either() -> None:
    hidden = [
        'form-data; x="; name=model"',  # inside a quoted string
        'name="model"',  # the first piece is the disposition type, not a parameter
        'form-data; filename="a;name=model"',
    ]
    for disposition in hidden:
        body = form(part(disposition, b"m"))
        assert form_fields(body, BOUNDARY.encode(), frozenset({"model"})) == {}, disposition
        assert "model" not in (mock_form(body, FORM) or {}), disposition


def test_the_mock_parses_forms_with_its_own_parser() -> None:
    """A fault in the router's parser must not pass on both sides."""
    files = sorted((ROOT / "router" / "tools" / "mock").glob("*.py"))
    assert any(p.name == "upstream.py" for p in files), "the mock moved: point this test at it"
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            assert "router.request.wire.multipart" not in names, path


# -- defect 21: Anthropic's shape for the edge's and the app's own answers --------------------


def anthropic_error(r: httpx.Response | bytes, status: int) -> dict[str, Any]:
    if isinstance(r, httpx.Response):
        assert r.status_code == status, r.text
        data = r.json()
    else:
        head, _, body = r.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 %d" % status), head
        data = json.loads(body)
    assert data["type"] == "error" and set(data["error"]) == {"type", "message"}, data
    return dict(data["error"])


def test_messages_answers_405_in_anthropics_shape(forms: dict[str, Proc]) -> None:
    url = forms["router"].url
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.get(url + path, timeout=STARVED_S)
        assert anthropic_error(r, 405)["type"] == "invalid_request_error"
        assert "POST" in r.headers["allow"]
    r = httpx.get(url + "/v1/chat/completions", timeout=STARVED_S)
    assert r.status_code == 405 and "error" in r.json() and "type" not in r.json()


def read_until_closed(s: socket.socket, within: float) -> bytes:
    s.settimeout(within)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def test_messages_answers_its_body_timeout_in_anthropics_shape(
    forms: dict[str, Proc], sockets: list[socket.socket]
) -> None:
    router = forms["router"]
    replies = {}
    for path in ("/v1/messages", "/v1/chat/completions"):
        s = socket.create_connection(("127.0.0.1", router.port), timeout=5)
        sockets.append(s)
        s.sendall(
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            "content-length: 4096\r\n\r\n{".encode()
        )
    for path, s in zip(("/v1/messages", "/v1/chat/completions"), sockets, strict=True):
        replies[path] = read_until_closed(s, BODY_TIMEOUT + 5)
    error = anthropic_error(replies["/v1/messages"], 408)
    assert error["type"] == "invalid_request_error" and "body_timeout" in error["message"]
    head, _, body = replies["/v1/chat/completions"].partition(b"\r\n\r\n")
    assert (
        head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == "request_timeout"
    )
    held_is(router, 0)  # the two bodies begun are no longer held


# -- defect 10: the body budget ---------------------------------------------------------------


def hold_body(
    router: Proc, sockets: list[socket.socket], path: str = "/v1/chat/completions"
) -> socket.socket:
    """A request whose body stops short: its declared length is held while it waits."""
    s = socket.create_connection(("127.0.0.1", router.port), timeout=5)
    sockets.append(s)
    s.sendall(
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {HELD}\r\n\r\n".encode()
        + b"{" * 1000
    )
    return s


def test_bodies_past_the_budget_get_503_with_retry_after(
    budget: dict[str, Proc], sockets: list[socket.socket]
) -> None:
    router = budget["router"]
    held_is(router, 0)
    stalled = [hold_body(router, sockets) for _ in range(3)]
    held_is(router, 3 * HELD)
    body = chat_body(8000)  # 3 x 12,000 + 8,000 > 40 KiB
    r = httpx.post(router.url + "/v1/chat/completions", content=body, timeout=10)
    error = openai_error(r, 503, "bodies_over_budget")
    assert error["type"] == "service_unavailable" and "max_held_body_bytes" in error["message"]
    assert int(r.headers["retry-after"]) >= 1
    r = httpx.post(router.url + "/v1/messages", content=body, timeout=10)
    assert anthropic_error(r, 503)["type"] == "overloaded_error"
    assert int(r.headers["retry-after"]) >= 1
    # A chunked body (no length declared) is held chunk by chunk: refused as it passes the budget.
    r = httpx.post(
        router.url + "/v1/chat/completions", content=iter([body[:4000], body[4000:]]), timeout=10
    )
    openai_error(r, 503, "bodies_over_budget")
    assert held(router) == 3 * HELD  # the refused ones hold nothing
    stalled[0].close()  # its client gone: its body is given back
    held_is(router, 2 * HELD)
    r = httpx.post(router.url + "/v1/chat/completions", content=body, timeout=10)
    assert r.status_code == 200, r.text
    for s in stalled[1:]:
        s.close()
    held_is(router, 0)


def test_every_way_out_gives_the_body_back(budget: dict[str, Proc]) -> None:
    router = budget["router"]
    url = router.url + "/v1/chat/completions"
    held_is(router, 0)
    answers = [
        httpx.post(url, content=chat_body(8000), timeout=10),  # answered
        httpx.post(url, content=chat_body(8000, stream=True), timeout=10),  # streamed
        httpx.post(url, content=b"{" * 8000, timeout=10),  # not JSON
        httpx.post(url, content=chat_body(8000, model="nope"), timeout=10),  # unknown model
        httpx.post(url, content=chat_body(8000, max_tokens="2"), timeout=10),  # bad limit
        httpx.post(url, content=chat_body(MAX_BODY + 1), timeout=10),  # declared too big
        httpx.post(url, content=iter([chat_body(MAX_BODY + 1)]), timeout=10),  # chunked too big
        upload(router, form(part('form-data; name="model"', b"m"))),  # an upload
        upload(
            router,
            form(part('form-data; name="model"', b"m"), part('form-data; name="model"', b"m")),
        ),
    ]
    assert [a.status_code for a in answers] == [200, 200, 400, 404, 400, 413, 413, 200, 400]
    held_is(router, 0)
    # A client that leaves mid-stream (the lifecycle is cancelled).
    with httpx.stream(
        "POST", url, content=chat_body(8000, stream=True, max_tokens=200), timeout=10
    ) as r:
        assert r.status_code == 200
        chunks = r.iter_bytes()  # kept: a generator dropped would close the stream itself
        next(chunks)
        assert held(router) == 8000
    held_is(router, 0)
    # One body as big as the whole budget allows still fits once the others are gone.
    assert httpx.post(url, content=chat_body(MAX_BODY), timeout=10).status_code == 200
    held_is(router, 0)
    assert any(r["path"] == "/v1/audio/transcriptions" for r in stats(budget["mock"])["recent"])
