"""The KEDA protocol's committed modules are what grpcio-tools makes of the vendored .proto now
(`make keda-proto` regenerates them), and the .proto keeps KEDA's licence header."""

from __future__ import annotations

import shutil
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path("router/scaling/keda")
GENERATED = ("externalscaler_pb2.py", "externalscaler_pb2.pyi", "externalscaler_pb2_grpc.py")


def test_generated_code_is_current(tmp_path: Path) -> None:
    (tmp_path / PACKAGE).mkdir(parents=True)
    shutil.copy(ROOT / PACKAGE / "externalscaler.proto", tmp_path / PACKAGE)
    proto = str(PACKAGE / "externalscaler.proto")
    args = ["protoc", f"-I{tmp_path}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}"]
    args += [f"--grpc_python_out={tmp_path}", str(tmp_path / proto)]
    assert protoc.main(args) == 0
    for name in GENERATED:
        fresh = (tmp_path / PACKAGE / name).read_text()
        committed = (ROOT / PACKAGE / name).read_text()
        assert fresh == committed, f"{name} is stale: run `make keda-proto` and commit it"


def test_the_vendored_proto_keeps_keda_licence_and_service() -> None:
    text = (ROOT / PACKAGE / "externalscaler.proto").read_text()
    assert "Copyright The KEDA Authors." in text and "Apache License, Version 2.0" in text
    for rpc in ("IsActive", "StreamIsActive", "GetMetricSpec", "GetMetrics"):
        assert f"rpc {rpc}(" in text
