#!/usr/bin/env bash
# Install our layer-skip feature into a Python environment that runs upstream TGI's shard
# (the official image's /opt/conda, or a venv made by setup_upstream_venv.sh).
#
#   patches/install_patch.sh <python>
#
# It copies, into that interpreter's site-packages:
#   tgi_layerskip/        our server/text_generation_server/layerskip package, unchanged (it
#                         imports only torch, numpy and safetensors, by relative imports);
#   tgi_layerskip_patch/  the runtime patch (our code; see its __init__ docstring);
#   tgi_layerskip_patch.pth, whose one line runs at interpreter start and installs an import
#                         hook only when TGI_LAYER_SKIP_MODE is set to something other than off.
# Nothing of upstream's code is copied or rewritten; running it twice gives the same result.
set -euo pipefail

PY=${1:?usage: install_patch.sh <python>}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
LAYERSKIP=${LAYERSKIP_SRC:-$ROOT/server/text_generation_server/layerskip}
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

if [ ! -f "$LAYERSKIP/__init__.py" ]; then
    echo "error: layerskip package not found at $LAYERSKIP (set LAYERSKIP_SRC)" >&2
    exit 2
fi
rm -rf "$SITE/tgi_layerskip" "$SITE/tgi_layerskip_patch"
mkdir -p "$SITE/tgi_layerskip" "$SITE/tgi_layerskip_patch"
cp "$LAYERSKIP"/*.py "$SITE/tgi_layerskip/"
cp "$HERE"/tgi_layerskip_patch/*.py "$SITE/tgi_layerskip_patch/"
echo "import tgi_layerskip_patch.boot; tgi_layerskip_patch.boot.install()" > "$SITE/tgi_layerskip_patch.pth"
"$PY" -c "import tgi_layerskip, tgi_layerskip_patch.boot" 
echo "layer-skip patch installed into $SITE"
