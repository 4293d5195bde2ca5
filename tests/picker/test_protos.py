"""The endpoint picker's protocol messages: the committed Python is what the vendored .proto files
generate now (router/tools/protos.py), the protobuf floor in pyproject.toml admits it, and the
messages keep Envoy's wire names (package, message and field numbers the gateway relies on)."""

from __future__ import annotations

import re
from pathlib import Path

from router.picker.proto import external_processor_pb2 as pb
from router.tools.protos import SOURCE, generate

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_code_is_what_the_protos_generate(tmp_path: Path) -> None:
    written = generate(tmp_path)
    assert written, "nothing generated"
    stale = [
        str(rel) for rel in written if (SOURCE / rel).read_bytes() != (tmp_path / rel).read_bytes()
    ]
    assert stale == [], "run `python -m router.tools.protos` and commit the result"
    committed = {p.relative_to(SOURCE) for p in SOURCE.rglob("*_pb2.py*")}
    assert committed == set(written)


def test_the_protobuf_floor_admits_the_generated_code() -> None:
    text = (SOURCE / "external_processor_pb2.py").read_text()
    made = re.search(r"Protobuf Python Version: (\d+)\.(\d+)\.(\d+)", text)
    assert made is not None
    floor = re.search(
        r'"protobuf>=(\d+)\.(\d+)(?:\.(\d+))?"', (ROOT / "pyproject.toml").read_text()
    )
    assert floor is not None
    # The generated module refuses an older runtime (or another major) at import.
    made_v = tuple(int(x) for x in made.groups())
    floor_v = tuple(int(x or 0) for x in floor.groups())
    assert floor_v >= made_v and floor_v[0] == made_v[0]


def test_the_wire_names_are_envoys() -> None:
    service = pb.DESCRIPTOR.services_by_name["ExternalProcessor"]
    assert service.full_name == "envoy.service.ext_proc.v3.ExternalProcessor"
    request = pb.ProcessingRequest.DESCRIPTOR.fields_by_name
    assert {
        n: request[n].number for n in ("request_headers", "request_body", "metadata_context")
    } == {
        "request_headers": 2,
        "request_body": 4,
        "metadata_context": 8,
    }
    common = pb.CommonResponse.DESCRIPTOR.fields_by_name
    assert common["clear_route_cache"].number == 5
    streamed = pb.BodyMutation.DESCRIPTOR.fields_by_name["streamed_response"]
    assert streamed.number == 3
    assert streamed.message_type.full_name == "envoy.service.ext_proc.v3.StreamedBodyResponse"
