#!/usr/bin/env bash
# Build a virtual environment that runs upstream TGI's Python shard from a checkout, with our
# layer-skip patch installed (inactive unless TGI_LAYER_SKIP_MODE is set).
#
#   patches/setup_upstream_venv.sh <upstream-checkout> <venv>
#
# Steps follow upstream's own server/Makefile: generate the generate.v3 stubs with grpcio-tools
# into server/text_generation_server/pb (with its import fix), then install server/. Upstream's
# lock (server/requirements_cuda.txt) is used as a constraints file, without its CUDA-only pins
# (torch, triton, nvidia-*): torch comes from TORCH_VERSION (default 2.13.0, the CPU build on
# this machine's disk), so upstream's shard runs on the CPU with its pinned transformers 4.x.
set -euo pipefail

UPSTREAM=${1:?usage: setup_upstream_venv.sh <upstream-checkout> <venv>}
VENV=${2:?usage: setup_upstream_venv.sh <upstream-checkout> <venv>}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
UPSTREAM=$(cd "$UPSTREAM" && pwd)
mkdir -p "$(dirname "$VENV")"
VENV="$(cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")"
SERVER="$UPSTREAM/server"

if [ ! -f "$SERVER/pyproject.toml" ] || [ ! -f "$UPSTREAM/proto/v3/generate.proto" ]; then
    echo "error: $UPSTREAM is not a TGI checkout (no server/pyproject.toml or proto/v3/generate.proto)" >&2
    exit 2
fi

"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" "torch==$TORCH_VERSION"

# Stubs, as upstream's `make gen-server` does (its pins from requirements_gen.txt).
"${PIP[@]}" grpcio-tools==1.71.0 mypy-protobuf==3.6.0
mkdir -p "$SERVER/text_generation_server/pb"
(cd "$SERVER" && PATH="$VENV/bin:$PATH" "$VENV/bin/python" -m grpc_tools.protoc -I../proto/v3 \
    --python_out=text_generation_server/pb --grpc_python_out=text_generation_server/pb \
    --mypy_out=text_generation_server/pb ../proto/v3/generate.proto)
find "$SERVER/text_generation_server/pb/" -type f -name "*.py" -print0 \
    | xargs -0 sed -i -e 's/^\(import.*pb2\)/from . \1/g'
touch "$SERVER/text_generation_server/pb/__init__.py"

constraints="$VENV/upstream-constraints.txt"
grep -v -E '^(torch|triton|nvidia-)' "$SERVER/requirements_cuda.txt" > "$constraints"
# The extras of upstream's `make install-server` (its CUDA-only `attention` and `bnb` are left out).
"${PIP[@]}" -c "$constraints" "$SERVER[accelerate,compressed-tensors,quantize,peft,outlines]"

"$HERE/install_patch.sh" "$VENV/bin/python"
echo "upstream shard environment ready: $VENV ($("$VENV/bin/python" -c 'import importlib.metadata as m; print("text-generation-server", m.version("text-generation-server"), "transformers", m.version("transformers"), "torch", m.version("torch"))'))"
