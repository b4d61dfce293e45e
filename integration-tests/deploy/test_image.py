"""The image `make image` builds (scripts/build_image.sh, which runs scripts/install.sh inside it),
run as a user runs it: its own entrypoint, command and user (uid 1000), a read-only /data, offline
(a network namespace holding nothing but a loopback), answering /generate, /v1/chat/completions and
/metrics, and its HEALTHCHECK passing. The build reuses cached layers when the sources did not
change; on a fresh machine it builds everything (~6 min on 2 cores)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest
from image_container import BUILD_TIMEOUT_S, PORT, ImageServer, build_image, image_config

STARTUP_TIMEOUT_S = 300

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + STARTUP_TIMEOUT_S + 600)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ImageServer]:
    print(build_image())
    data = tmp_path_factory.mktemp("data")  # empty: the image's own converted model must be found
    data.chmod(0o755)  # pytest makes it 0700, which uid 1000 could not even look into
    log = tmp_path_factory.mktemp("image-log") / "launcher.log"
    server = ImageServer(data, ["--hostname", "127.0.0.1", "--max-input-tokens", "64",
                                "--max-total-tokens", "96", "--max-batch-prefill-tokens", "64"], log)
    try:
        server.wait_healthy(STARTUP_TIMEOUT_S)
        yield server
    finally:
        server.stop()


def test_image_serves_offline_as_uid_1000_with_a_read_only_data(served: ImageServer) -> None:
    processes = served.processes()
    assert {uid for _, uid, _ in processes} == {1000}, f"processes in the container: {processes}"

    status, text = served.http("POST", "/generate", {"inputs": "The capital of France is",
                                                    "parameters": {"max_new_tokens": 8}})
    assert status == 200, text
    assert json.loads(text)["generated_text"].strip()

    status, text = served.http("POST", "/v1/chat/completions", {
        "model": "tgi", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hello."}]})
    assert status == 200, text
    choice = json.loads(text)["choices"][0]
    assert choice["message"]["content"].strip() and choice["finish_reason"] in ("stop", "length")

    status, text = served.http("GET", "/metrics")
    assert status == 200, text
    success = [line for line in text.splitlines() if line.startswith("tgi_request_success")]
    assert success and float(success[0].split()[-1]) >= 2, success

    # The image's HEALTHCHECK command, run beside the server in the same container and namespace.
    healthcheck = image_config("Docker")["Healthcheck"]["Test"]
    assert healthcheck[0] == "CMD", healthcheck
    probe = subprocess.run([*served.run_argv("--env", f"PORT={PORT}"), *healthcheck[1:]],
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stdout + probe.stderr

    # Served from /opt/tgi-models, converted at build time: nothing converted at start.
    assert "Converting" not in served.log.read_text(errors="replace"), served.tail()
