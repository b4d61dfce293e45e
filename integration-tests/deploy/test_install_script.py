"""scripts/install.sh, the image's install procedure, run into a fresh venv: the launcher it
installs serves the default model (converted by the script, then found offline)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx

from service_process import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT_S = 900
STARTUP_TIMEOUT_S = 300


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_install_script_yields_a_launcher_that_serves_the_default_model(tmp_path: Path) -> None:
    venv, hub = tmp_path / "venv", tmp_path / "hub"
    # The hub cache lives in tmp_path: the script's conversion must be what the launcher finds.
    env = {**os.environ, "HUGGINGFACE_HUB_CACHE": str(hub), "PIP_FLAGS": "--no-compile",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    env.pop("VIRTUAL_ENV", None)
    install = subprocess.run([str(ROOT / "scripts" / "install.sh"), "--convert-default-model", str(venv)],
                             env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    assert "installed into" in install.stdout
    assert any(hub.glob("models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/*/model.safetensors"))

    port, log = free_port(), tmp_path / "launcher.log"
    argv = [str(venv / "bin" / "text-generation-launcher"), "--port", str(port), "--hostname", "127.0.0.1",
            "--shard-uds-path", str(tmp_path / "shard"), "--max-input-tokens", "64",
            "--max-total-tokens", "96", "--max-batch-prefill-tokens", "64"]
    # Offline: a hub lookup would fail here, so serving proves the converted checkpoint is used.
    serve_env = {**env, "HF_HUB_OFFLINE": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=serve_env,
                                start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, log, STARTUP_TIMEOUT_S)
        response = httpx.post(f"{url}/generate", timeout=120, json={
            "inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}})
        assert response.status_code == 200, response.text
        assert response.json()["generated_text"].strip()
    finally:
        stop(proc)
    assert "Converting" not in log.read_text(errors="replace"), "the launcher re-converted the model"
