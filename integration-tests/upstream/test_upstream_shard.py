"""Against upstream TGI's own Python shard (from UPSTREAM_TGI, CPU, transformers 4.x):
our router drives it unpatched; our patch's shadow mode leaves its tokens unchanged, lossy
mode bypasses the policy's layers (counted, plan reported), and an unknown upstream version
is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from upstream_shard import POLICY_LAYERS, UpstreamShard, generate, launch, start_shard

from text_generation_server.pb import generate_pb2 as pb

from service_process import free_port, wait_healthy

PROMPTS = ["The capital of France is", "Once upon a time, in a small village"]
MAX_NEW_TOKENS = 8


def read_report(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_our_router_drives_upstreams_unpatched_shard(unpatched_shard: UpstreamShard, model_path: str,
                                                      work_dir: Path) -> None:
    info = unpatched_shard.stub.Info(pb.InfoRequest(), timeout=60)
    assert (info.requires_padding, info.device_type, info.dtype) == (True, "cpu", "torch.float32")
    port, log = free_port(), work_dir / "router.log"
    argv = [str(Path(sys.executable).parent / "text-generation-router"), "--master-shard-uds-path",
            str(unpatched_shard.socket), "--tokenizer-name", model_path, "--hostname", "127.0.0.1",
            "--port", str(port), "--max-input-tokens", "64", "--max-total-tokens", "96",
            "--max-batch-prefill-tokens", "64"]
    with log.open("wb") as out:
        router = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(router, url, log, 300)  # ServiceDiscovery, ClearCache, Info, Warmup happen before /health answers
        body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "details": True}}
        response = httpx.post(f"{url}/generate", json=body, timeout=300)  # Prefill + Decode
        assert response.status_code == 200, response.text
        details = response.json()["details"]
        assert details["generated_tokens"] == MAX_NEW_TOKENS and details["finish_reason"] == "length"
        assert response.json()["generated_text"].strip()
        # Same tokens as driving the shard directly over gRPC.
        direct = generate(unpatched_shard, PROMPTS[:1], MAX_NEW_TOKENS, first_id=1000, batch_id=1000)
        assert [t["id"] for t in details["tokens"]] == direct[1000]
    finally:
        os.killpg(router.pid, signal.SIGTERM)
        router.wait(timeout=60)


def generate_patched(upstream_python: Path, model_path: str, policy: Path, work_dir: Path,
                     mode: str) -> tuple[dict[int, list[int]], list[dict[str, object]], UpstreamShard]:
    """PROMPTS on a patched shard in `mode` with `policy`: greedy tokens, its report's records, the
    (stopped) shard."""
    report = work_dir / f"{mode}.jsonl"
    shard = start_shard(upstream_python, model_path, work_dir / mode, {
        "TGI_LAYER_SKIP_MODE": mode, "TGI_LAYER_SKIP_POLICY": str(policy), "TGI_LAYER_SKIP_REPORT": str(report)})
    try:
        tokens = generate(shard, PROMPTS, MAX_NEW_TOKENS)
    finally:
        shard.stop()
    return tokens, read_report(report), shard


def test_shadow_plans_and_reports_but_tokens_equal_unpatched(unpatched_shard: UpstreamShard, upstream_python: Path,
                                                             model_path: str, policy: Path, work_dir: Path) -> None:
    shadow, records, shard = generate_patched(upstream_python, model_path, policy, work_dir, "shadow")
    unpatched = generate(unpatched_shard, PROMPTS, MAX_NEW_TOKENS)
    assert shadow == unpatched
    plans = [r for r in records if r["event"] == "plan"]
    assert [(r["mode"], r["skipped_layers"], r["applied_layers"]) for r in plans] == [("shadow", POLICY_LAYERS, [])] * 2
    finished = [r for r in records if r["event"] == "finished"]
    assert [(r["num_layers_bypassed"], r["num_steps"]) for r in finished] == [(0, MAX_NEW_TOKENS)] * 2
    assert "tgi_layerskip_patch applied" in shard.log()


def test_lossy_bypasses_the_policys_layers(unpatched_shard: UpstreamShard, upstream_python: Path, model_path: str,
                                           policy: Path, work_dir: Path) -> None:
    lossy, records, _ = generate_patched(upstream_python, model_path, policy, work_dir, "lossy")
    plans = [r for r in records if r["event"] == "plan"]
    assert [(r["mode"], r["rule"], r["applied_layers"]) for r in plans] == [("lossy", "mid-layers", POLICY_LAYERS)] * 2
    finished = {r["request_id"]: r for r in records if r["event"] == "finished"}
    for request_id in (0, 1):  # every step bypassed each planned layer once for the request
        assert finished[request_id]["num_steps"] == MAX_NEW_TOKENS
        assert finished[request_id]["num_layers_bypassed"] == MAX_NEW_TOKENS * len(POLICY_LAYERS)
    # The tokens are those of the library's reference bypass (no KV cache, one prompt at a time).
    out = subprocess.run([str(upstream_python), str(Path(__file__).parent / "upstream_tool.py"), "reference",
                          model_path, str(policy), str(MAX_NEW_TOKENS), *PROMPTS],
                         capture_output=True, text=True, timeout=900, check=True)
    reference = json.loads(out.stdout.strip().splitlines()[-1])
    assert [lossy[i] for i in (0, 1)] == [r["skip_tokens"] for r in reference]
    unpatched = generate(unpatched_shard, PROMPTS, MAX_NEW_TOKENS)
    assert [unpatched[i] for i in (0, 1)] == [r["full_tokens"] for r in reference]
    assert lossy != unpatched, "bypassing layers 8 and 20 changes these greedy continuations"


def test_an_unknown_upstream_version_is_refused(upstream_python: Path, model_path: str, policy: Path,
                                               work_dir: Path) -> None:
    # Metadata of another release, found first on sys.path: what a different image would carry.
    fake = work_dir / "other-release"
    dist_info = fake / "text_generation_server-9.9.9.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: text-generation-server\nVersion: 9.9.9\n")
    shard = launch(upstream_python, model_path, work_dir / "unknown", {
        "PYTHONPATH": str(fake), "TGI_LAYER_SKIP_MODE": "lossy", "TGI_LAYER_SKIP_POLICY": str(policy)})
    try:
        returncode = shard.proc.wait(timeout=300)
    finally:
        shard.stop()
    log = shard.log()
    assert returncode != 0 and not shard.socket.exists()
    assert "tgi_layerskip_patch refuses to patch this TGI" in log and "text-generation-server 9.9.9" in log


@pytest.mark.parametrize("mode,message", [("verified", "is not provided by the patch"),
                                          ("lossy", "needs TGI_LAYER_SKIP_POLICY")])
def test_unsupported_configuration_is_refused(upstream_python: Path, model_path: str, work_dir: Path,
                                             mode: str, message: str) -> None:
    shard = launch(upstream_python, model_path, work_dir / f"refused-{mode}", {"TGI_LAYER_SKIP_MODE": mode})
    try:
        returncode = shard.proc.wait(timeout=300)
    finally:
        shard.stop()
    assert returncode != 0 and message in shard.log()
