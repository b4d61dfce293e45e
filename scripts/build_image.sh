#!/usr/bin/env bash
# Build the server's image (`make image`): buildah where no Docker engine answers, docker otherwise.
#
# Environment:
#   IMAGE        tag of the result (default localhost/tgi-layerskip:latest)
#   BASE_IMAGE   the Dockerfile's base (default localhost/debian-python:3.11-bookworm). That
#                default is made here from Debian's packages with mmdebstrap (python3,
#                python3-venv, ca-certificates) when the image store lacks it, for machines that
#                cannot pull images; elsewhere any Debian-based Python 3.11 image will do, e.g.
#                BASE_IMAGE=python:3.11-slim-bookworm.
#   IMAGE_CACHE  folder keeping that base's tarball between runs (default ~/.cache/tgi-image)
#
# torch's CPU build: where pip's configuration (or PIP_FIND_LINKS) names a folder holding the CPU
# wheel of the pinned release, that folder is mounted into the build and used; otherwise the
# Dockerfile's default, PyTorch's CPU index, is. The CA bundle pip is configured with is mounted
# and named too, so pip inside the build trusts what pip on the host trusts.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
IMAGE=${IMAGE:-localhost/tgi-layerskip:latest}
LOCAL_BASE=localhost/debian-python:3.11-bookworm
BASE_IMAGE=${BASE_IMAGE:-$LOCAL_BASE}
IMAGE_CACHE=${IMAGE_CACHE:-$HOME/.cache/tgi-image}
TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' "$ROOT/Dockerfile")
started=$(date +%s)

if command -v docker > /dev/null && docker info > /dev/null 2>&1; then
    engine=docker
else
    engine=buildah
    need=()
    command -v buildah > /dev/null || need+=(buildah)
    if [ "$BASE_IMAGE" = "$LOCAL_BASE" ] && ! command -v mmdebstrap > /dev/null; then
        need+=(mmdebstrap)
    fi
    if [ ${#need[@]} -gt 0 ]; then
        [ "$(id -u)" = 0 ] || { echo "build_image: install ${need[*]} (apt-get install ${need[*]})" >&2; exit 1; }
        echo "build_image: installing ${need[*]} with apt-get"
        apt-get update -q > /dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" > /dev/null
    fi
fi

image_exists() {
    if [ "$engine" = docker ]; then docker image inspect "$1" > /dev/null 2>&1
    else buildah inspect --type image "$1" > /dev/null 2>&1; fi
}

if [ "$BASE_IMAGE" = "$LOCAL_BASE" ] && ! image_exists "$LOCAL_BASE"; then
    tarball=$IMAGE_CACHE/debian-python-3.11-bookworm.tar
    if [ ! -s "$tarball" ]; then
        command -v mmdebstrap > /dev/null || { echo "build_image: mmdebstrap is needed to make $LOCAL_BASE" >&2; exit 1; }
        echo "build_image: making $LOCAL_BASE from Debian bookworm packages (mmdebstrap) into $tarball"
        mkdir -p "$IMAGE_CACHE"
        mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
            --aptopt='Acquire::Retries "3"' bookworm "$tarball.tmp"
        mv "$tarball.tmp" "$tarball"
    fi
    echo "build_image: importing $tarball as $LOCAL_BASE"
    if [ "$engine" = docker ]; then
        docker import --change 'CMD ["/bin/bash"]' "$tarball" "$LOCAL_BASE" > /dev/null
    else
        container=$(buildah from scratch)
        buildah add --quiet "$container" "$tarball" / > /dev/null
        buildah config --cmd /bin/bash \
            --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$container"
        buildah commit --quiet "$container" "$LOCAL_BASE" > /dev/null
        buildah rm "$container" > /dev/null
    fi
fi

# pip's own settings on this host: PIP_* variables first, then its configuration files.
pip_setting() {
    local env_name=$1 key=$2 value
    value=${!env_name:-}
    if [ -z "$value" ]; then
        value=$(python3 -m pip config list 2>/dev/null | sed -n "s/^[a-z:]*\.$key='\(.*\)'\$/\1/p" | head -n1)
    fi
    echo "$value"
}

args=(--build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$IMAGE" -f "$ROOT/Dockerfile")
echo "build_image: building $IMAGE from $BASE_IMAGE with $engine"
if [ "$engine" = docker ]; then
    # docker build mounts no host folder: torch comes from the Dockerfile's index there.
    docker build "${args[@]}" "$ROOT"
    size=$(docker image inspect --format '{{.Size}}' "$IMAGE")
else
    wheels=$(pip_setting PIP_FIND_LINKS find-links)
    if [ -n "$wheels" ] && compgen -G "$wheels/torch-$TORCH_VERSION+cpu-*.whl" > /dev/null; then
        echo "build_image: torch $TORCH_VERSION's CPU wheel from $wheels"
        args+=(-v "$wheels:/run/host-wheels:ro" --build-arg PIP_FIND_LINKS=/run/host-wheels
               --build-arg TORCH_INDEX_URL=)
    fi
    cert=$(pip_setting PIP_CERT cert)
    if [ -n "$cert" ] && [ -f "$cert" ]; then
        args+=(-v "$cert:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt)
    fi
    # Docker's format: OCI image configs have no HEALTHCHECK.
    buildah bud --isolation chroot --layers --format docker "${args[@]}" "$ROOT"
    size=$(buildah images --noheading --format '{{.Size}}' "$IMAGE")
fi
echo "build_image: $IMAGE built in $(( $(date +%s) - started )) s, $size"
