"""The committed generated code must match the protos (run `python -m tessera.protogen`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera import protogen


def test_committed_generated_code_is_fresh(tmp_path: Path):
    pytest.importorskip("grpc_tools")
    generated = protogen.generate(tmp_path)
    assert generated, "protoc produced nothing"
    committed = protogen.ROOT / "tessera" / "api" / "v1"
    for g in generated:
        c = committed / g.name
        assert c.exists(), f"{g.name} is not committed: run python -m tessera.protogen"
        assert c.read_text() == g.read_text(), f"{g.name} is stale: run python -m tessera.protogen"
    expected = {p.name for p in generated}
    extra = {p.name for p in committed.glob("*_pb2*.py*")} - expected
    assert not extra, f"generated files without a proto: {sorted(extra)}"


def test_every_rpc_and_message_field_is_commented():
    """The protos are the contract: each rpc carries a comment line above it."""
    for proto in protogen.proto_files():
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith("rpc "):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} rpc without a contract comment"
