"""bitsandbytes int8, nf4 and fp4 shards of the default model, each over its real socket."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from text_generation_server.download import DEFAULT_MODEL_ID
from text_generation_server.pb import generate_pb2

from factories import CHAT_FRANCE, make_request, run_to_completion
from shard_process import ShardProcess


@pytest.mark.parametrize("quantize", ["bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4"])
def test_quantized_shard_generates(model_path: Path, quantize: str) -> None:
    process = ShardProcess(DEFAULT_MODEL_ID, ["--quantize", quantize])
    try:
        stub = process.wait_ready()
        info = stub.Info(generate_pb2.InfoRequest())
        assert info.quantize == quantize and info.dtype == "torch.float32"
        out = run_to_completion(stub, 1, [make_request(1, CHAT_FRANCE, 8)])[1]
        assert out.final is not None and out.final.text.strip()
        assert all(math.isfinite(lp) for lp in out.logprobs)
    finally:
        process.stop()


def _server(*args: str) -> subprocess.CompletedProcess[str]:
    binary = Path(sys.executable).parent / "text-generation-server"
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=300,
                          env={"PATH": str(binary.parent), "HOME": str(Path.home()), "ATTENTION": "paged",
                               "PREFIX_CACHING": "0", "HF_HUB_OFFLINE": "1"})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--quantize", "gptq"], "--quantize gptq is an upstream TGI value that this CPU backend does not support"),
        (["--sharded"], "--sharded: this CPU backend runs one shard"),
        (["--speculate", "0"], "--speculate 0: use 1..16 draft tokens per step"),
        (["--runner", "warp"], "--runner warp is not a known runner; use one of auto, fast, transformers"),
    ],
)
def test_serve_refuses_unsupported_options(model_path: Path, args: list[str], message: str) -> None:
    result = _server("serve", DEFAULT_MODEL_ID, "--uds-path", "/tmp/tgi-refused", *args)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr


def test_download_weights_resolves_offline_and_passes_folders_through(model_path: Path, tmp_path: Path) -> None:
    again = _server("download-weights", DEFAULT_MODEL_ID, "--json-output")
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.strip().splitlines()[-1] == f'{{"local_path": "{model_path}"}}'
    assert (model_path / "model.safetensors").exists() and (model_path / "config.json").exists()
    local = _server("download-weights", str(model_path))
    assert local.returncode == 0 and str(model_path) in local.stdout
    unknown = _server("download-weights", "no-such-org/no-such-model")
    assert unknown.returncode != 0
    text = unknown.stdout + unknown.stderr
    assert "Ids that work offline: HuggingFaceTB/SmolLM2-135M-Instruct" in text
    assert "pass the path of a local folder" in text
