"""Online shadow checks in `lossy`: forced drift triggers the automatic rollback to `off`.

The policy is honest about its evidence: it skips six layers only for prompts of under 8
tokens, so on its calibration prompts (long ones) it never fires and its measured
consistency is 1.0. Served on short prompts, where skipping six layers changes the output,
the shadow checks catch the drift and the shard rolls back. The monitor's own arithmetic is
checked in-process by tests/server/test_audit_units.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from text_generation_server.download import DEFAULT_MODEL_ID
from text_generation_server.layerskip import Calibration, Condition, IdentityMap, Policy, Rule, RuleTable, save_policy
from text_generation_server.models.loading import LoadConfig, load_model, load_tokenizer
from text_generation_server.pb import generate_pb2

from factories import make_batch, make_request
from policies import LONG_PROMPT, SIX_LAYERS
from prompt_sets import LONG, chat_text
from shard_process import ShardProcess

SHORT = ["Hi", "Hello", "Thanks", "Hey", "Yes", "Ok", "Why?", "Sure"]


@pytest.fixture(scope="module")
def drifting_policy(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = load_model(model_path, LoadConfig())
    tokenizer = load_tokenizer(model_path)
    calibration_prompts = [chat_text(tokenizer, p) for p in LONG]
    assert all(len(tokenizer(p)["input_ids"]) >= 8 for p in calibration_prompts)  # the rule never fires there
    identity = IdentityMap.from_model(model)
    table = RuleTable((Rule("tiny-prompts", (Condition("num_tokens", "<", 8),), SIX_LAYERS),), Rule("default"), 30)
    evidence = Calibration("tests/prompt_sets.py:LONG", "n/a", consistency=1.0, skip_rate=0.0, date="2026-11-29")
    return save_policy(Policy.from_table(identity, table, calibration=evidence),
                       tmp_path_factory.mktemp("drift") / "policy.json")


def test_forced_drift_rolls_back_to_off(drifting_policy: Path) -> None:
    process = ShardProcess(DEFAULT_MODEL_ID, ["--layer-skip-mode", "lossy", "--layer-skip-policy", str(drifting_policy),
                                              "--layer-skip-shadow-rate", "1.0", "--layer-skip-shadow-window", "4"])
    try:
        stub = process.wait_ready()
        assert stub.Info(generate_pb2.InfoRequest()).layer_skip_policy_state == "loaded"
        reports = []
        for i, word in enumerate(SHORT):
            batch = make_batch(i, [make_request(i, word, 12)])
            response = stub.Prefill(generate_pb2.PrefillRequest(batch=batch))
            cached = response.batch if response.HasField("batch") else None
            final = response.generations[0]
            while cached is not None:
                assert list(cached.request_ids) == [i]  # the audit twin never shows
                step = stub.Decode(generate_pb2.DecodeRequest(batches=[cached]))
                assert [g.request_id for g in step.generations] == [i]
                final = step.generations[0]
                cached = step.batch if step.HasField("batch") else None
            reports.append(final.layer_skip if final.HasField("layer_skip") else None)
            if stub.Info(generate_pb2.InfoRequest()).layer_skip_policy_state == "rolled_back":
                break
        info = stub.Info(generate_pb2.InfoRequest())
        assert (info.layer_skip_policy_state, info.layer_skip_mode) == ("rolled_back", "off")
        last = reports[-1]
        assert last is not None and last.stats["rollbacks"] == 1 and last.stats["shadow_consistency"] < 1.0
        after = stub.Prefill(generate_pb2.PrefillRequest(batch=make_batch(99, [make_request(99, "Hi", 1)])))
        assert not after.generations[0].HasField("layer_skip")  # served off now
        long = stub.Prefill(generate_pb2.PrefillRequest(batch=make_batch(98, [make_request(98, LONG_PROMPT, 1)])))
        assert not long.generations[0].HasField("layer_skip")
    finally:
        process.stop()
    assert "Layer-skip rollback: shadow consistency" in process.logs()
