"""The committed gRPC stubs are current, importable as `tether_api.v1`, and staleness is detected."""

from __future__ import annotations

import shutil
from pathlib import Path

from tether_contracts import protogen


def test_committed_stubs_are_current() -> None:
    assert protogen.stale() == [], "run: python -m tether_contracts.protogen"


def test_stubs_import_from_the_installed_package_with_proto_names_intact() -> None:
    from tether_api.v1 import approval_service_pb2, run_service_pb2, run_service_pb2_grpc

    assert run_service_pb2.DESCRIPTOR.package == "tether.v1"
    assert run_service_pb2.DESCRIPTOR.name == "tether/v1/run_service.proto"
    assert run_service_pb2.Run.__module__ == "tether_api.v1.run_service_pb2"
    assert set(run_service_pb2.DESCRIPTOR.services_by_name) == {"RunService"}
    assert hasattr(run_service_pb2_grpc, "RunServiceStub")
    assert "DecideApproval" in approval_service_pb2.DESCRIPTOR.services_by_name["ApprovalService"].methods_by_name


def test_an_edited_proto_makes_the_stubs_stale(tmp_path: Path) -> None:
    root = tmp_path / "proto"
    shutil.copytree(protogen.PROTO_ROOT, root)
    out = tmp_path / "out"
    protogen.write(root, out)
    assert protogen.stale(root, out) == []

    types = root / "tether" / "v1" / "types.proto"
    types.write_text(types.read_text() + "\n// A new message.\nmessage Extra {\n  string x = 1;\n}\n")
    assert "v1/types_pb2.py" in protogen.stale(root, out)


def test_removed_proto_stubs_are_deleted_on_write(tmp_path: Path) -> None:
    root = tmp_path / "proto"
    shutil.copytree(protogen.PROTO_ROOT, root)
    out = tmp_path / "out"
    protogen.write(root, out)
    (root / "tether" / "v1" / "approval_service.proto").unlink()
    assert "v1/approval_service_pb2.py" in protogen.stale(root, out)
    protogen.write(root, out)
    assert not (out / "v1" / "approval_service_pb2.py").exists()
    assert protogen.stale(root, out) == []
