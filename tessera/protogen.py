"""Regenerate the committed gRPC/protobuf Python code from proto/.

Usage: ``python -m tessera.protogen [--out DIR]`` (default: the repository root, so
files land in tessera/api/v1/). Needs grpcio-tools (dev extra). ``generate(out)``
is also used by the test that fails when the committed code is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_DIR = PROTO_ROOT / "tessera" / "api" / "v1"


def proto_files() -> list[Path]:
    """The .proto files of the API, sorted."""
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) on every proto into ``out``; return the files written."""
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *files,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    gen = out / "tessera" / "api" / "v1"
    return sorted(p for p in gen.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT, help="output root (default: repository root)")
    ns = ap.parse_args(argv)
    for p in generate(ns.out):
        print(p.relative_to(ns.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
