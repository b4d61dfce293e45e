"""Layer skipping in real shard processes: Info and per-request reports over gRPC, and the refusal
of a bad policy file (stop, or serve with skipping off). The in-process layer-skip tests are in
tests/server/test_layer_skip_shard.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from text_generation_server.download import DEFAULT_MODEL_ID
from text_generation_server.models.loading import LoadConfig, load_model
from text_generation_server.pb import generate_pb2

from factories import make_batch, make_request
from policies import LONG_PROMPT, SIX_LAYERS, TWO_LAYERS, write_policy
from shard_process import ShardProcess


@pytest.fixture(scope="module")
def policy_path(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_policy(load_model(model_path, LoadConfig()), tmp_path_factory.mktemp("policy") / "policy.json",
                        SIX_LAYERS, TWO_LAYERS)


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    binary = Path(sys.executable).parent / "text-generation-server"
    return subprocess.run([str(binary), "serve", DEFAULT_MODEL_ID, "--uds-path", "/tmp/tgi-refused", *args],
                          capture_output=True, text=True, timeout=300)


def test_bad_policy_stops_the_shard_or_serves_with_skipping_off(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 99}')
    refused = _serve("--layer-skip-mode", "lossy", "--layer-skip-policy", str(bad))
    assert refused.returncode != 0
    assert f"policy file {bad} is refused" in refused.stdout + refused.stderr

    process = ShardProcess(DEFAULT_MODEL_ID, ["--layer-skip-mode", "lossy", "--layer-skip-policy", str(bad),
                                              "--layer-skip-on-bad-policy", "off"])
    try:
        stub = process.wait_ready()
        info = stub.Info(generate_pb2.InfoRequest())
        assert (info.layer_skip_policy_state, info.layer_skip_mode) == ("refused", "off")
        prefill = stub.Prefill(generate_pb2.PrefillRequest(batch=make_batch(1, [make_request(1, LONG_PROMPT, 1)])))
        assert not prefill.generations[0].HasField("layer_skip")
    finally:
        process.stop()
    assert "Serving with layer skipping OFF" in process.logs()


def test_shard_reports_plans_over_grpc(policy_path: Path) -> None:
    process = ShardProcess(DEFAULT_MODEL_ID, ["--layer-skip-mode", "shadow", "--layer-skip-policy", str(policy_path)])
    try:
        stub = process.wait_ready()
        info = stub.Info(generate_pb2.InfoRequest())
        assert (info.layer_skip_mode, info.layer_skip_policy_state, info.num_layers) == ("shadow", "loaded", 30)
        lossy = make_request(2, LONG_PROMPT, 1)
        lossy.layer_skip_mode = "lossy"
        bogus = make_request(3, LONG_PROMPT, 1)
        bogus.layer_skip_mode = "fastest"
        batch = make_batch(1, [make_request(1, LONG_PROMPT, 1), lossy])
        prefill = stub.Prefill(generate_pb2.PrefillRequest(batch=batch))
        reports = {g.request_id: g.layer_skip for g in prefill.generations}
        assert reports[1].mode == "shadow" and list(reports[1].skipped_layers) == sorted(SIX_LAYERS)
        assert reports[2].mode == "lossy" and reports[2].rule == "default"
        assert reports[1].stats["decision_ms"] > 0 and "num_tokens" in reports[1].stats
        with pytest.raises(Exception, match="layer_skip mode 'fastest' is not one of off, shadow, lossy, verified"):
            stub.Prefill(generate_pb2.PrefillRequest(batch=make_batch(2, [bogus])))
    finally:
        process.stop()
