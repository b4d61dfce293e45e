"""Start upstream's `text-generation-server serve` from the upstream venv and drive it over
gRPC with our generate.v3 stubs (wire-compatible with upstream's)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from text_generation_server.pb import generate_pb2 as pb
from text_generation_server.pb import generate_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300
POLICY_LAYERS = [8, 20]  # not among SmolLM2-135M's critical layers (0, 1, 11, 28, 29)
LAYER_SKIP_VARIABLES = ("TGI_LAYER_SKIP_MODE", "TGI_LAYER_SKIP_POLICY", "TGI_LAYER_SKIP_REPORT")


@dataclass
class UpstreamShard:
    proc: subprocess.Popen[bytes]
    uds_base: Path
    log_path: Path
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(f"unix://{self.socket}")

    @property
    def socket(self) -> Path:
        return Path(f"{self.uds_base}-0")

    @property
    def stub(self) -> generate_pb2_grpc.TextGenerationServiceStub:
        return generate_pb2_grpc.TextGenerationServiceStub(self.channel)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def shard_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAYER_SKIP_VARIABLES and k != "VIRTUAL_ENV"}
    # Upstream's server reads ATTENTION and PREFIX_CACHING at import (its launcher sets them).
    env.update({"ATTENTION": "paged", "PREFIX_CACHING": "0", "OMP_NUM_THREADS": "2", **extra})
    return env


def launch(python: Path, model_path: str, base: Path, extra: dict[str, str]) -> UpstreamShard:
    base.parent.mkdir(parents=True, exist_ok=True)
    exe = python.parent / "text-generation-server"
    log_path = base.with_suffix(".log")
    with log_path.open("wb") as out:
        proc = subprocess.Popen([str(exe), "serve", model_path, "--uds-path", str(base)], stdout=out,
                                stderr=subprocess.STDOUT, env=shard_env(extra), start_new_session=True)
    return UpstreamShard(proc, base, log_path)


def start_shard(python: Path, model_path: str, base: Path, extra: dict[str, str]) -> UpstreamShard:
    """Start a shard and wait until its socket exists (how upstream's launcher sees readiness)."""
    shard = launch(python, model_path, base, extra)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if shard.proc.poll() is not None:
            raise RuntimeError(f"upstream shard exited with {shard.proc.returncode}:\n{shard.log()[-4000:]}")
        if shard.socket.exists():
            return shard
        time.sleep(0.5)
    shard.stop()
    raise RuntimeError(f"upstream shard not ready after {STARTUP_TIMEOUT_S} s:\n{shard.log()[-4000:]}")


def greedy_request(request_id: int, prompt: str, max_new_tokens: int) -> pb.Request:
    return pb.Request(
        id=request_id, inputs=prompt, input_chunks=pb.Input(chunks=[pb.InputChunk(text=prompt)]), truncate=64,
        parameters=pb.NextTokenChooserParameters(temperature=1.0, top_k=0, top_p=1.0, typical_p=1.0,
                                                 do_sample=False, seed=0, repetition_penalty=1.0,
                                                 frequency_penalty=0.0),
        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=max_new_tokens, ignore_eos_token=True),
        add_special_tokens=True)


def generate(shard: UpstreamShard, prompts: list[str], max_new_tokens: int, first_id: int = 0,
             batch_id: int = 1) -> dict[int, list[int]]:
    """One batch: Prefill, then Decode until every request stopped; token ids per request id."""
    requests = [greedy_request(first_id + i, p, max_new_tokens) for i, p in enumerate(prompts)]
    batch = pb.Batch(id=batch_id, requests=requests, size=len(requests),
                     max_tokens=len(requests) * (64 + max_new_tokens))
    tokens: dict[int, list[int]] = {r.id: [] for r in requests}
    response = shard.stub.Prefill(pb.PrefillRequest(batch=batch), timeout=300)
    while True:
        for generation in response.generations:
            tokens[generation.request_id].extend(generation.tokens.ids)
        if not response.HasField("batch"):
            return tokens
        response = shard.stub.Decode(pb.DecodeRequest(batches=[response.batch]), timeout=300)
