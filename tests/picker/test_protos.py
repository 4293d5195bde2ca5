"""The endpoint picker's protocol messages: the committed Python is what protoc generates from the
descriptors it carries (router/tools/protos.py; regenerating from xds-protos needs the package
registry, so that is `make picker-proto`, not the suite), the trimming keeps what the stream
carries and drops the annotations, the protobuf floor admits the code, and the messages keep
Envoy's wire names (package, message names, field numbers and types the gateway relies on)."""

from __future__ import annotations

import re
from pathlib import Path

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor

from router.picker.proto import external_processor_pb2 as pb
from router.tools.protos import HEADER, SOURCE, committed_descriptors, generate_from, trim

ROOT = Path(__file__).resolve().parents[2]

EXT = "envoy.service.ext_proc.v3"
CORE = "envoy.config.core.v3"
MODE = "envoy.extensions.filters.http.ext_proc.v3.ProcessingMode"
B, BOOL, STR = FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_BOOL, FieldDescriptor.TYPE_STRING
# message -> field -> (number, message/enum type or scalar type): what the picker reads and writes.
WIRE: dict[str, dict[str, tuple[int, str | int]]] = {
    f"{EXT}.ProcessingRequest": {
        "request_headers": (2, f"{EXT}.HttpHeaders"),
        "response_headers": (3, f"{EXT}.HttpHeaders"),
        "request_body": (4, f"{EXT}.HttpBody"),
        "response_body": (5, f"{EXT}.HttpBody"),
        "metadata_context": (8, f"{CORE}.Metadata"),
    },
    f"{EXT}.ProcessingResponse": {
        "request_headers": (1, f"{EXT}.HeadersResponse"),
        "response_headers": (2, f"{EXT}.HeadersResponse"),
        "request_body": (3, f"{EXT}.BodyResponse"),
        "response_body": (4, f"{EXT}.BodyResponse"),
        "request_trailers": (5, f"{EXT}.TrailersResponse"),
        "response_trailers": (6, f"{EXT}.TrailersResponse"),
        "immediate_response": (7, f"{EXT}.ImmediateResponse"),
        "mode_override": (9, MODE),
    },
    f"{EXT}.HttpHeaders": {"headers": (1, f"{CORE}.HeaderMap"), "end_of_stream": (3, BOOL)},
    f"{EXT}.HttpBody": {"body": (1, B), "end_of_stream": (2, BOOL)},
    f"{EXT}.HeadersResponse": {"response": (1, f"{EXT}.CommonResponse")},
    f"{EXT}.BodyResponse": {"response": (1, f"{EXT}.CommonResponse")},
    f"{EXT}.CommonResponse": {
        "header_mutation": (2, f"{EXT}.HeaderMutation"),
        "body_mutation": (3, f"{EXT}.BodyMutation"),
        "clear_route_cache": (5, BOOL),
    },
    f"{EXT}.HeaderMutation": {
        "set_headers": (1, f"{CORE}.HeaderValueOption"),
        "remove_headers": (2, STR),
    },
    f"{EXT}.BodyMutation": {
        "body": (1, B),
        "streamed_response": (3, f"{EXT}.StreamedBodyResponse"),
    },
    f"{EXT}.StreamedBodyResponse": {"body": (1, B), "end_of_stream": (2, BOOL)},
    f"{EXT}.ImmediateResponse": {
        "status": (1, "envoy.type.v3.HttpStatus"),
        "headers": (2, f"{EXT}.HeaderMutation"),
        "body": (3, B),
        "details": (5, STR),
    },
    "envoy.type.v3.HttpStatus": {"code": (1, "envoy.type.v3.StatusCode")},
    f"{CORE}.Metadata": {"filter_metadata": (1, f"{CORE}.Metadata.FilterMetadataEntry")},
    f"{CORE}.HeaderMap": {"headers": (1, f"{CORE}.HeaderValue")},
    f"{CORE}.HeaderValue": {"key": (1, STR), "value": (2, STR), "raw_value": (3, B)},
    f"{CORE}.HeaderValueOption": {
        "header": (1, f"{CORE}.HeaderValue"),
        "append_action": (3, f"{CORE}.HeaderValueOption.HeaderAppendAction"),
    },
    MODE: {
        "request_header_mode": (1, f"{MODE}.HeaderSendMode"),
        "request_body_mode": (3, f"{MODE}.BodySendMode"),
        "response_body_mode": (4, f"{MODE}.BodySendMode"),
    },
}


def test_the_committed_code_is_what_protoc_generates_from_its_descriptors(tmp_path: Path) -> None:
    written = generate_from(committed_descriptors(), tmp_path)
    stale = [
        str(rel) for rel in written if (SOURCE / rel).read_bytes() != (tmp_path / rel).read_bytes()
    ]
    assert stale == [], "run `make picker-proto` and commit the result"
    assert {p.relative_to(SOURCE) for p in SOURCE.rglob("*_pb2.py*")} == set(written)
    assert (SOURCE / "external_processor_pb2.py").read_text().splitlines()[2] == HEADER.strip()
    # No vendored .proto text: the descriptors are the source.
    assert list(SOURCE.rglob("*.proto")) == []


def test_the_committed_descriptors_are_trimmed() -> None:
    """Trimming the committed set again changes nothing: only what the stream's messages reach,
    no annotation imports, no options beyond `deprecated`."""
    committed = committed_descriptors()
    assert trim(committed) == committed
    envoy = [f for f in committed.file if f.name.startswith("envoy/")]
    assert {d for f in envoy for d in f.dependency} <= {f.name for f in committed.file}
    assert all(
        not d.startswith(("udpa/", "validate/", "xds/")) for f in envoy for d in f.dependency
    )
    assert all(not f.HasField("options") for f in envoy)


def test_trimming_drops_unreached_messages_and_annotations() -> None:
    full = descriptor_pb2.FileDescriptorSet()
    full.file.add(name="validate/validate.proto", package="validate", syntax="proto3")
    lib = full.file.add(name="envoy/lib.proto", package="lib", syntax="proto3")
    lib.dependency.append("validate/validate.proto")
    lib.options.java_package = "io.lib"
    used = lib.message_type.add(name="Used")
    kept = used.field.add(name="old", number=1, type=BOOL, label=1)
    kept.options.deprecated = True
    kept.options.MergeFromString(b"\xd8\xde\x3f\x01")  # an annotation extension, unknown here
    lib.message_type.add(name="Unused").field.add(name="x", number=1, type=BOOL, label=1)
    svc = full.file.add(name="envoy/svc.proto", package="svc", syntax="proto3")
    svc.dependency.extend(["envoy/lib.proto", "validate/validate.proto"])
    root = svc.message_type.add(name="Root")
    root.field.add(name="u", number=7, type=FieldDescriptor.TYPE_MESSAGE, type_name=".lib.Used")

    slim = trim(full, roots=["svc.Root"])

    assert [f.name for f in slim.file] == ["envoy/lib.proto", "envoy/svc.proto"]
    lib_out, svc_out = slim.file
    assert [m.name for m in lib_out.message_type] == ["Used"]
    assert list(lib_out.dependency) == [] and not lib_out.HasField("options")
    assert lib_out.message_type[0].field[0].options.SerializeToString() == (
        descriptor_pb2.FieldOptions(deprecated=True).SerializeToString()
    )
    assert list(svc_out.dependency) == ["envoy/lib.proto"]
    assert svc_out.message_type[0].field[0].number == 7


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
    assert service.full_name == f"{EXT}.ExternalProcessor"
    (method,) = service.methods
    assert method.name == "Process"
    assert method.input_type.full_name == f"{EXT}.ProcessingRequest"
    assert method.output_type.full_name == f"{EXT}.ProcessingResponse"
    pool = pb.DESCRIPTOR.pool
    found: dict[str, dict[str, tuple[int, str | int]]] = {}
    for message, fields in WIRE.items():
        desc = pool.FindMessageTypeByName(message)
        found[message] = {}
        for name in fields:
            f = desc.fields_by_name[name]
            typ = f.message_type or f.enum_type
            found[message][name] = (f.number, typ.full_name if typ else f.type)
    assert found == WIRE
    body_mode = pool.FindEnumTypeByName(f"{MODE}.BodySendMode").values_by_name
    assert {n: body_mode[n].number for n in ("NONE", "STREAMED", "FULL_DUPLEX_STREAMED")} == {
        "NONE": 0,
        "STREAMED": 1,
        "FULL_DUPLEX_STREAMED": 4,
    }
    overwrite = pool.FindEnumTypeByName(f"{CORE}.HeaderValueOption.HeaderAppendAction")
    assert overwrite.values_by_name["OVERWRITE_IF_EXISTS_OR_ADD"].number == 2
