"""The shard driven as upstream v3's router drives a paged shard with prefix caching and
chunking on (Info, Warmup, Prefill with blocks, slots, cache_len and chunk_len, Prefill with
cached_batch, Decode, FilterBatch), through stubs generated here from the upstream wire
contract: our proto less every extension (fields numbered 100 and up, PrepareGrammar and the
messages only they use), so nothing of ours is sent or read on the way."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from text_generation_server.download import DEFAULT_MODEL_ID
from text_generation_server.pb import generate_pb2

from shard_process import ShardProcess

ROOT = Path(__file__).resolve().parents[2]
EXTENSION_MESSAGES = ("PrepareGrammarRequest", "PrepareGrammarResponse", "LayerSkipReport", "RequestError")


def upstream_proto(text: str) -> str:
    """Our proto without its extensions."""
    out, skipping = [], False
    for line in text.splitlines():
        if re.match(rf"message ({'|'.join(EXTENSION_MESSAGES)}) \{{", line):
            skipping = not line.rstrip().endswith("}")
            continue
        if skipping:
            skipping = line.strip() != "}"
            continue
        if re.search(r"=\s*1\d\d;", line) or "rpc PrepareGrammar" in line:
            continue
        out.append(line)
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from grpc_tools import protoc

    folder = tmp_path_factory.mktemp("upstream-stubs")
    (folder / "generate.proto").write_text(upstream_proto((ROOT / "proto" / "v3" / "generate.proto").read_text()))
    assert protoc.main(["protoc", f"-I{folder}", f"--python_out={folder}", f"--grpc_python_out={folder}",
                        str(folder / "generate.proto")]) == 0
    return folder


@pytest.fixture(scope="module")
def paged_shard(model_path: Path) -> Iterator[ShardProcess]:
    process = ShardProcess(DEFAULT_MODEL_ID, [], env={"ATTENTION": "flashdecoding-ipex", "PREFIX_CACHING": "1",
                                                      "PREFILL_CHUNK_TOKENS": "128"})
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def test_the_upstream_contract_has_no_extension_left(stubs: Path) -> None:
    text = (stubs / "generate.proto").read_text()
    assert "PrepareGrammar" not in text and "LayerSkipReport" not in text and "= 100;" not in text
    assert "cache_len = 12;" in text and "cached_batch = 2;" in text


def test_upstream_router_protocol_with_prefix_caching_and_chunks(stubs: Path, paged_shard: ShardProcess,
                                                                 model_path: Path) -> None:
    out = subprocess.run([sys.executable, str(Path(__file__).parent / "upstream_v3_driver.py"), str(stubs),
                          paged_shard.socket, str(model_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:] + paged_shard.logs()
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["info"] == {"requires_padding": False, "support_chunking": True, "use_prefix_caching": True,
                              "block_size": 64, "attention_impl": "flashdecoding-ipex"}
    joined = report["joined"]
    # B joined the running batch under its id; A took its step in the same call; B's prompt is
    # in chunks, its chunk_len (40) first, so no token of B yet; the next step runs A's token and
    # B's next chunk (at most PREFILL_CHUNK_TOKENS)
    assert joined["id"] == 1 and joined["request_ids"] == [1, 2] and joined["concat"]
    assert joined["a_stepped"] == 1 and not joined["b_first"]
    assert joined["current_tokens"] == 1 + min(joined["b_prompt"] - 40, 128)
    tokens = report["tokens"]
    assert all(len(tokens[r]) == 12 for r in "123456")
    # the cached runs answer as the uncached: A again (its whole prompt cached, the router says
    # so too), the diverging prompt against its own run asked for prompt logprobs (never
    # cached), B against the same
    assert tokens["3"] == tokens["1"] and tokens["4"] == tokens["5"] and tokens["2"] == tokens["6"]
    assert report["cache_len"]["3"] > 0 and report["cache_len"]["5"] == 0 and report["cache_len"]["6"] == 0

    def cached_tokens(rid: str) -> int:
        response = generate_pb2.PrefillResponse.FromString(bytes.fromhex(report["first"][rid]))
        return next(g.cached_tokens for g in response.generations if g.request_id == int(rid))

    # the shard reused what it held (our extension field, read from the raw answer)
    assert cached_tokens("3") > report["cache_len"]["3"] - 64 and cached_tokens("4") > 0
    assert cached_tokens("5") == 0
    assert report["blocks"]["used"] == 0 and report["blocks"]["cached"] > 0
