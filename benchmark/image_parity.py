"""The image against the same server outside it: one model, converted once on the host into a hub
folder that the image mounts read-only as /data, served by both with the same flags (by default
Qwen2.5-Coder-0.5B in bfloat16, verified mode with its shipped policy); the same greedy /generate
requests to each, one at a time; their token ids must be identical.

    PYTHONPATH=benchmark:tests .venv/bin/python benchmark/image_parity.py

Needs root (buildah, `ip netns`); builds the image first (scripts/build_image.sh, cached layers
reused). Writes benchmark/results/image_parity.json."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "integration-tests" / "deploy"), str(ROOT / "integration-tests" / "router"),
                str(ROOT / "integration-tests")]

from image_container import IMAGE, ImageServer, build_image  # noqa: E402
from router_launcher import start_launcher  # noqa: E402

from text_generation_server.download import QWEN_CODER_05B_ID  # noqa: E402

from common import write_results  # noqa: E402
from prompt_sets import CLASSES  # noqa: E402

STARTUP_TIMEOUT_S = 900
LIMITS = ["--max-input-tokens", "1024", "--max-total-tokens", "1280", "--max-batch-prefill-tokens", "1280"]


def prompts(per_class: int) -> list[tuple[str, str]]:
    return [(name, prompt) for name, items in CLASSES.items() for prompt in items[:per_class]]


def body(prompt: str, max_new_tokens: int) -> dict[str, Any]:
    return {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "details": True,
                                             "decoder_input_details": False}}


def answer(status: int, text: str) -> dict[str, Any]:
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {text[:500]}")
    reply: dict[str, Any] = json.loads(text)
    return reply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", default=QWEN_CODER_05B_ID)
    parser.add_argument("--server-args", default="--dtype bfloat16 --layer-skip-mode verified "
                        "--layer-skip-policy auto", help="launcher flags given to both servers")
    parser.add_argument("--per-class", type=int, default=2, help="prompts per prompt_sets class")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--data", type=Path, help="hub folder to convert the model into (default: a temporary one)")
    args = parser.parse_args()

    print(build_image(), flush=True)
    data = args.data or Path(tempfile.mkdtemp(prefix="image-parity-data-"))
    data.mkdir(parents=True, exist_ok=True)
    data.chmod(0o755)
    os.environ["HUGGINGFACE_HUB_CACHE"] = str(data)
    subprocess.run([str(Path(sys.executable).parent / "text-generation-server"), "download-weights", args.model_id],
                   check=True)
    subprocess.run(["chmod", "-R", "a+rX", str(data)], check=True)  # the image's uid 1000 reads it
    os.environ["HF_HUB_OFFLINE"] = "1"
    flags = ["--model-id", args.model_id, *LIMITS, *args.server_args.split()]
    cases = prompts(args.per_class)

    def ask(post: Callable[[dict[str, Any]], tuple[int, str]]) -> list[dict[str, Any]]:
        """Each case's reply (status checked) with its seconds, one request at a time."""
        replies = []
        for _, prompt in cases:
            started = time.perf_counter()
            replies.append({**answer(*post(body(prompt, args.max_new_tokens))),
                            "seconds": time.perf_counter() - started})
        return replies

    results: dict[str, list[dict[str, Any]]] = {}
    launcher = start_launcher(flags, "image-parity")
    try:
        def post_host(payload: dict[str, Any]) -> tuple[int, str]:
            reply = httpx.post(f"{launcher.url}/generate", json=payload, timeout=600)
            return reply.status_code, reply.text

        results["host"] = ask(post_host)
    finally:
        launcher.stop()

    log = Path(tempfile.mkstemp(prefix="image-parity-", suffix=".log")[1])
    server = ImageServer(data, ["--hostname", "127.0.0.1", *flags], log, env={"HF_HUB_OFFLINE": "1"})
    try:
        server.wait_healthy(STARTUP_TIMEOUT_S)
        results["image"] = ask(lambda payload: server.http("POST", "/generate", payload))
    finally:
        server.stop()

    rows = []
    for (kind, prompt), host, image in zip(cases, results["host"], results["image"], strict=True):
        host_ids = [t["id"] for t in host["details"]["tokens"]]
        image_ids = [t["id"] for t in image["details"]["tokens"]]
        rows.append({"class": kind, "prompt": prompt[:60], "tokens": len(host_ids), "identical": host_ids == image_ids,
                     "host_s": round(host["seconds"], 2), "image_s": round(image["seconds"], 2)})
        print(f"{kind:10s} {len(host_ids):3d} tokens  identical={host_ids == image_ids}  "
              f"host {host['seconds']:.2f} s  image {image['seconds']:.2f} s  {prompt[:40]!r}")
    identical = sum(row["identical"] for row in rows)
    print(f"{identical}/{len(rows)} identical ({IMAGE}, {args.model_id}, {args.server_args})")
    write_results("image_parity", {"image": IMAGE, "model_id": args.model_id, "server_args": args.server_args,
                                   "max_new_tokens": args.max_new_tokens, "identical": identical,
                                   "requests": len(rows), "rows": rows})
    if identical != len(rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
