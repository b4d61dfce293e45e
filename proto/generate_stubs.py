"""Generate (or check) the Python gRPC stubs of proto/v3/generate.proto.

The stubs are committed into both distributions so that a plain `pip install`
needs no code generation. `--check` regenerates into a temporary folder and fails
when the committed files differ from what the proto produces.

Usage: python proto/generate_stubs.py [--check]
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto" / "v3"
TARGETS = [
    ROOT / "server" / "text_generation_server" / "pb",
    ROOT / "router" / "text_generation_router" / "pb",
]
GENERATED = ["generate_pb2.py", "generate_pb2.pyi", "generate_pb2_grpc.py"]


def generate(out_dir: Path) -> None:
    """Run protoc into out_dir and make the grpc module import its sibling relatively."""
    from grpc_tools import protoc  # imported lazily: only the build needs grpcio-tools

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_DIR / "generate.proto"),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_DIR / 'generate.proto'}")
    grpc_file = out_dir / "generate_pb2_grpc.py"
    text = grpc_file.read_text()
    grpc_file.write_text(text.replace("import generate_pb2 as", "from . import generate_pb2 as"))
    (out_dir / "__init__.py").write_text('"""Generated gRPC stubs for generate.v3 (see proto/)."""\n')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    check = parser.parse_args().check
    if not check:
        for target in TARGETS:
            generate(target)
        print(f"generated stubs into {', '.join(str(t.relative_to(ROOT)) for t in TARGETS)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        stale = [
            str((target / name).relative_to(ROOT))
            for target in TARGETS
            for name in GENERATED
            if not (target / name).exists() or not filecmp.cmp(fresh / name, target / name, shallow=False)
        ]
    if stale:
        print("stale generated stubs (run `python proto/generate_stubs.py`): " + ", ".join(stale))
        return 1
    print("generated stubs match proto/v3/generate.proto")
    return 0


if __name__ == "__main__":
    sys.exit(main())
