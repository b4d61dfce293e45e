"""`serve --speculate N` (upstream's n-gram speculation) and `--layer-skip-policy auto` on a real
shard process: Info.speculate reports N, greedy output over gRPC equals the plain shard's, and a
step may carry several tokens; `auto` finds the shipped policy of the served model or serves off."""

from __future__ import annotations

from text_generation_server.download import DEFAULT_MODEL_ID
from text_generation_server.pb import generate_pb2, generate_pb2_grpc

from factories import make_request, run_to_completion
from shard_process import ShardProcess

# The answer repeats the prompt's code: n-gram drafts find matches.
CODE_EDIT = ("<|im_start|>user\nRepeat this code exactly:\ndef add(a, b):\n    total = a + b\n    return total\n"
             "<|im_end|>\n<|im_start|>assistant\n")


def test_speculate_reports_n_and_keeps_greedy_output(shard: generate_pb2_grpc.TextGenerationServiceStub) -> None:
    expected = run_to_completion(shard, 1, [make_request(1, CODE_EDIT, 32)])[1]
    process = ShardProcess(DEFAULT_MODEL_ID, ["--speculate", "3"])
    try:
        stub = process.wait_ready()
        assert stub.Info(generate_pb2.InfoRequest()).speculate == 3
        got = run_to_completion(stub, 1, [make_request(1, CODE_EDIT, 32)])[1]
        assert got.token_ids == expected.token_ids
        assert got.final is not None and expected.final is not None and got.final.text == expected.final.text
    finally:
        process.stop()


def test_auto_policy_without_a_matching_shipped_policy_serves_off(tmp_path: object) -> None:
    process = ShardProcess(DEFAULT_MODEL_ID, ["--layer-skip-mode", "verified", "--layer-skip-policy", "auto"],
                           env={"TGI_POLICY_DIR": str(tmp_path)})
    try:
        stub = process.wait_ready()
        info = stub.Info(generate_pb2.InfoRequest())
        assert (info.layer_skip_mode, info.layer_skip_policy_state, info.speculate) == ("off", "none", 0)
    finally:
        process.stop()
    assert "--layer-skip-policy auto: no policy in" in process.logs()
