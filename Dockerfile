# Our fork's image: the same entrypoint, port and cache folder as upstream TGI's image, with
# the default model (HuggingFaceTB/SmolLM2-135M-Instruct) converted at build time so the image
# serves offline out of the box. Build from the repository root:
#   docker build -t tgi-layerskip .
#   docker run -p 8080:80 -v $PWD/data:/data tgi-layerskip --model-id HuggingFaceTB/SmolLM2-135M-Instruct
FROM python:3.11-slim-bookworm

# torch release that scripts/install.sh installs; pip takes PyPI's default Linux wheel of it
# (CUDA-capable; it also runs on CPU-only hosts).
ARG TORCH_VERSION=2.13.0

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

# One install procedure for the image and the test suite (integration-tests/deploy/test_install_script.py).
# The default model is converted into /opt/tgi-models, outside /data, so a volume mounted at
# /data cannot hide it; download-weights looks there second (TGI_PREBUILT_HUB_CACHE).
# g++ is there only to compile the fast runner's CPU kernels (every ISA variant: the image runs
# on hosts with AVX2 or AVX-512, each importing the variant its CPU has) into /opt/tgi-kernels
# (install.sh runs `text-generation-server build-kernels`); the second build-kernels fails the
# image build when that did not work, and g++ is removed again. build-kernels also times the
# variants on the build host (choices.json, keyed by its CPU); a host with another CPU times them
# at each process start instead (~2 s; the folder is read-only, so nothing is remembered).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && HUGGINGFACE_HUB_CACHE=/opt/tgi-models ./scripts/install.sh --convert-default-model /opt/tgi \
    && text-generation-server build-kernels \
    && apt-get purge -y --auto-remove g++ \
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
