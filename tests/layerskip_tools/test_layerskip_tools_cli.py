"""`text-generation-server layerskip ...` on the real default model with a small prompt set.

One pipeline runs once per module (profile -> sweep -> calibrate -> verify -> consistency with
int8 and nf4); each test checks one command's invariants, recomputing figures independently
with plain transformers and the library's reference executor (`bypassed`,
`Scheduler.verify_consistency`) where the tools used the fast runner. Sizes are tiny (4
prompts, 4 new tokens) so that the module stays near 3 minutes on 2 cores; no timing is asserted.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from text_generation_server.cli import app as shard_app
from text_generation_server.download import DEFAULT_MODEL_ID, download_weights
from text_generation_server.layerskip import (
    IdentityMap,
    Policy,
    Rule,
    RuleTable,
    Scheduler,
    SkipPlan,
    bypassed,
    find_decoder_layers,
    load_policy,
    read_policy,
    save_policy,
)
from text_generation_server.layerskip_cli.prompts import read_prompts
from text_generation_server.models.loading import LoadConfig, load_model, load_tokenizer

NEW_TOKENS = 4
PROMPTS: list[dict[str, Any]] = [
    {"id": "cs-0", "category": "customer_service", "split": "calibration",
     "messages": [{"role": "user", "content": "My parcel is late. What can I do?"}]},
    {"id": "greet-0", "category": "greeting", "split": "calibration", "messages": [{"role": "user", "content": "Hi!"}]},
    {"id": "code-0", "category": "code", "split": "calibration", "prompt": "def add(a, b):\n    return"},
    {"id": "fact-0", "category": "factual", "split": "heldout",
     "messages": [{"role": "user", "content": "What is the capital of Italy?"}]},
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cli(*args: str, expect: int = 0) -> str:
    result = CliRunner().invoke(shard_app, ["layerskip", *args, "--threads", "1"])
    assert result.exit_code == expect, f"exit {result.exit_code} != {expect}: {result.output}\n{result.exception!r}"
    return result.output


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Runs the whole pipeline once; yields the paths the tests read."""
    root = tmp_path_factory.mktemp("layerskip_tools")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS), encoding="utf-8")
    out = root / "reports"
    common = ["--prompts", str(prompts), "--new-tokens", str(NEW_TOKENS)]
    cli("profile", DEFAULT_MODEL_ID, "--out", str(out), "--max-prompts", "2", "--latency-repeats", "2", *common)
    cli("sweep", DEFAULT_MODEL_ID, "--profile", str(out / "profile.csv"), "--out", str(out), "--max-k", "2",
        "--num-thresholds", "3", *common)
    cli("calibrate", DEFAULT_MODEL_ID, "--sweep-dir", str(out), "--out", str(out / "policy.json"), *common)
    yield {"root": root, "prompts": prompts, "out": out}


@pytest.fixture(scope="module")
def fp32() -> tuple[Any, Any]:
    path = download_weights(DEFAULT_MODEL_ID)
    return load_model(path, LoadConfig()), load_tokenizer(path)


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def render(tokenizer: Any, prompt: dict[str, Any]) -> torch.Tensor:
    """The prompt's ids as the tools render them (chat template or plain), via the prompt-file reader."""
    line = json.dumps(prompt) + "\n"
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False, encoding="utf-8") as handle:
        handle.write(line)
    try:
        return read_prompts(handle.name).prompts[0].render(tokenizer)
    finally:
        Path(handle.name).unlink()


def test_profile_one_row_per_layer_in_range(work: dict[str, Path], fp32: tuple[Any, Any]) -> None:
    model, _ = fp32
    rows = read_rows(work["out"] / "profile.csv")
    assert [int(r["layer"]) for r in rows] == list(range(30))
    identity = IdentityMap.from_model(model)
    for row, layer in zip(rows, identity.layers, strict=True):
        assert row["class"] == "LlamaDecoderLayer" and row["fingerprint"] == layer.fingerprint
        assert 0.0 <= float(row["zero_ratio"]) <= 1.0
        assert 0.0 <= float(row["block_influence"]) <= 2.0
        assert float(row["relative_update_norm"]) > 0.0
        assert float(row["kl_p95"]) >= 0.0 and float(row["kl_mean"]) >= 0.0
        assert 0.0 <= float(row["tf_agreement"]) <= 1.0
        assert row["latency_saving_ms"] != ""  # measured, sign not asserted (no timing asserts)
    # Layer 0 turns embeddings into hidden states: by far the most influential.
    assert float(rows[0]["block_influence"]) == max(float(r["block_influence"]) for r in rows)


def test_profile_matches_independent_recomputation(work: dict[str, Path], fp32: tuple[Any, Any]) -> None:
    """Block influence from transformers' hidden states; one layer's drift/agreement via `bypassed`."""
    model, tokenizer = fp32
    rows = read_rows(work["out"] / "profile.csv")
    sweep = json.loads((work["out"] / "sweep.json").read_text())
    layers = find_decoder_layers(model).modules
    cos_sum, positions, agree, last_kl = torch.zeros(29, dtype=torch.float64), 0, 0, []
    layer = 15
    for prompt, trial in zip(PROMPTS[:2], sweep["prompts"][:2], strict=True):
        ids = render(tokenizer, prompt)
        full = torch.cat([ids, torch.tensor(trial["off_tokens"])])
        start, end = len(ids) - 1, len(ids) - 1 + len(trial["off_tokens"])
        with torch.no_grad():
            out = model(input_ids=full[None], output_hidden_states=True, use_cache=False)
            with bypassed(layers, [layer]):
                skipped = model(input_ids=full[None], use_cache=False).logits[0, start:end]
        hidden = out.hidden_states  # hidden[i] is the input of layer i; the last one is normed
        for i in range(29):
            cos_sum[i] += torch.nn.functional.cosine_similarity(hidden[i][0], hidden[i + 1][0], dim=-1).double().sum()
        positions += full.shape[0]
        reference = out.logits[0, start:end]
        assert reference.argmax(-1).tolist() == trial["off_tokens"][: end - start], "greedy off tokens agree"
        agree += int((skipped.argmax(-1) == reference.argmax(-1)).sum())
        log_p, log_q = torch.log_softmax(reference[0].double(), -1), torch.log_softmax(skipped[0].double(), -1)
        last_kl.append(float((log_p.exp() * (log_p - log_q)).sum()))
    influence = 1.0 - cos_sum / positions
    for i in range(29):
        assert float(rows[i]["block_influence"]) == pytest.approx(float(influence[i]), abs=2e-3), f"layer {i}"
    count = sum(len(t["off_tokens"]) for t in sweep["prompts"][:2])
    assert abs(float(rows[layer]["tf_agreement"]) * count - agree) <= 1, "agreement counts differ by > 1 position"
    import numpy as np

    assert float(rows[layer]["kl_p95"]) == pytest.approx(float(np.percentile(last_kl, 95)), rel=0.05, abs=1e-3)


def test_sweep_grid_heatmap_and_honesty(work: dict[str, Path], fp32: tuple[Any, Any]) -> None:
    model, tokenizer = fp32
    sweep = json.loads((work["out"] / "sweep.json").read_text())
    rows = read_rows(work["out"] / "sweep.csv")
    assert (work["out"] / "sweep_heatmap.png").read_bytes()[:8] == PNG_MAGIC
    assert len(sweep["skip_sets"]) == 2 and set(sweep["skip_sets"][0]) < set(sweep["skip_sets"][1])
    assert not {0, 29} & set(sweep["skip_sets"][1]), "protected layers never enter a candidate set"
    assert len(rows) == len(sweep["cells"]) and {int(r["k"]) for r in rows} == {1, 2}
    trials = sweep["prompts"]
    assert [t["id"] for t in trials] == ["cs-0", "greet-0", "code-0"], "the sweep reads the calibration split only"
    for row in rows:
        selected = [t for t in trials if t["scores"]["max_score"] < float(row["max_score_below"])
                    and t["scores"]["mean_score"] < float(row["mean_score_below"])]
        exact = [t["outcomes"][row["k"]]["exact"] if t in selected else True for t in trials]
        assert float(row["consistency"]) == pytest.approx(sum(exact) / len(trials))
        assert float(row["mean_layers_skipped"]) == pytest.approx(len(selected) * int(row["k"]) / len(trials))
        assert 0.0 <= float(row["tf_agreement"]) <= 1.0
    # The largest thresholds select every prompt: that cell's consistency is the plain skip-set consistency.
    scheduler = Scheduler.from_model(model, None, "lossy")
    for prompt, trial in zip(PROMPTS[:3], trials, strict=True):
        n = len(trial["off_tokens"])
        report = scheduler.verify_consistency(render(tokenizer, prompt),
                                              SkipPlan("lossy", frozenset(sweep["skip_sets"][0])), max_new_tokens=n)
        assert list(report.full_tokens) == trial["off_tokens"]
        assert (report.skip_tokens == report.full_tokens) == trial["outcomes"]["1"]["exact"], trial["id"]
    honesty = sweep["detector_honesty"]
    assert set(honesty["spearman"]) >= {"max_score", "mean_score"} and honesty["verdict"]
    assert all(v is None or -1.0 <= v <= 1.0 for v in honesty["spearman"].values())
    for trial in trials:  # safe depth = largest k with all of 1..k exact
        depth = 0
        while str(depth + 1) in trial["outcomes"] and trial["outcomes"][str(depth + 1)]["exact"]:
            depth += 1
        assert trial["safe_depth"] == depth


def test_calibrate_writes_policy_with_heldout_evidence(work: dict[str, Path], fp32: tuple[Any, Any]) -> None:
    model, _ = fp32
    policy = read_policy(work["out"] / "policy.json")
    evidence = json.loads((work["out"] / "policy.evidence.json").read_text())
    assert policy.calibration is not None
    assert policy.calibration.dataset_sha256 == hashlib.sha256(work["prompts"].read_bytes()).hexdigest()
    assert "heldout" in policy.calibration.dataset and "calibration" in policy.calibration.dataset
    assert [r["id"] for r in evidence["heldout_prompts"]] == ["fact-0"], "figures come from the held-out split"
    assert policy.calibration.consistency == pytest.approx(evidence["heldout"]["consistency"])
    assert policy.calibration.skip_rate == pytest.approx(evidence["heldout"]["skip_rate"])
    if policy.calibration.consistency < evidence["target"]:
        pytest.fail("a written policy must meet the target on the held-out split (else it skips nothing)")
    aligned = load_policy(work["out"] / "policy.json", IdentityMap.from_model(model))
    assert dict(aligned.layer_map) == {i: i for i in range(30)}


def test_calibrate_verified_writes_draft_rules_with_evidence(work: dict[str, Path], fp32: tuple[Any, Any]) -> None:
    """--objective verified: acceptance per class x skip depth x head size, the cost model, a policy
    whose rules carry draft settings and a ranked draft vocabulary, and the frontier plot."""
    model, _ = fp32
    out = work["root"] / "verified" / "policy.json"
    cli("calibrate", DEFAULT_MODEL_ID, "--objective", "verified", "--prompts", str(work["prompts"]), "--out", str(out),
        "--per-class", "1", "--new-tokens", "4", "--skip-depths", "2,4", "--vocab-sizes", "0,1024",
        "--profile", str(work["out"] / "profile.csv"))
    policy = read_policy(out)
    evidence = json.loads(out.with_name("policy.evidence.json").read_text())
    assert policy.objective == "verified" and policy.draft_vocab is not None
    assert policy.default.draft.acceptance is not None and 0.0 <= policy.default.draft.acceptance <= 1.0
    assert len(policy.draft_vocab.token_ids) >= policy.default.draft.vocab
    classes = {p["category"] for p in PROMPTS if p.get("split", "calibration") == "calibration"}
    table = evidence["acceptance_table"]
    assert {r["class"] for r in table} == classes and len(table) == len(classes) * 2 * 2
    assert all(0.0 <= r["acceptance"] <= 1.0 and r["speedup"] > 0 for r in table)
    assert [len(s) for s in evidence["skip_sets"]] == [2, 4] and evidence["cost_model"]["step_ms"] > 0
    assert set(evidence["cost_model"]["batched_ms"]) == {"2", "4"}  # verification priced per row count
    ladders = [evidence["cost_model"]["forward_ms"], *evidence["cost_model"]["batched_ms"].values()]
    assert all(list(ms.values()) == sorted(ms.values()) for ms in ladders)  # kept as monotone fits
    # Four draft configurations (2 depths x 2 heads) pin the plane the choice reads; the measured beside it.
    assert len(evidence["drafts_measured"]) == len(evidence["cost_model"]["drafts"]) == 4
    assert "cross-fitted" in evidence["draft_vocab_scoring"]
    assert out.with_name("policy.frontier.png").stat().st_size > 1000
    aligned = load_policy(out, IdentityMap.from_model(model))
    assert aligned.table.default.skip == frozenset(evidence["default"]["skip"])


def test_verify_table_and_exit_code(work: dict[str, Path], fp32: tuple[Any, Any]) -> None:
    model, tokenizer = fp32
    out = work["root"] / "verify_ok"
    cli("verify", str(work["out"] / "policy.json"), "--prompts", str(work["prompts"]), "--out", str(out),
        "--new-tokens", str(NEW_TOKENS))
    assert json.loads((out / "verify.json").read_text())["passed"] is True
    # A policy that always skips 6 middle layers: lossy, and verify must say so with exit code 1.
    identity = IdentityMap.from_model(model)
    skip = frozenset({3, 5, 7, 13, 17, 25})
    table = RuleTable((), Rule("always", (), skip), 30)
    save_policy(Policy.from_table(identity, table), work["root"] / "lossy.json")
    bad = work["root"] / "verify_bad"
    output = cli("verify", str(work["root"] / "lossy.json"), "--prompts", str(work["prompts"]), "--out", str(bad),
                 "--new-tokens", str(NEW_TOKENS), expect=1)
    assert "| id |" in output and "FAIL" in output
    result = json.loads((bad / "verify.json").read_text())
    assert result["passed"] is False and len(result["rows"]) == 4
    scheduler = Scheduler.from_model(model, work["root"] / "lossy.json", "lossy")
    for prompt, row in zip(PROMPTS, result["rows"], strict=True):
        assert row["skipped"] == "3 5 7 13 17 25"
        ids = render(tokenizer, prompt)
        report = scheduler.verify_consistency(ids, scheduler.plan(ids), max_new_tokens=NEW_TOKENS)
        n = len(tokenizer(row["off_text"], add_special_tokens=False)["input_ids"])
        equal = report.skip_tokens[:n] == report.full_tokens[:n]
        assert equal == row["exact"], prompt["id"]


def test_consistency_suite_int8_nf4(work: dict[str, Path]) -> None:
    """Reference float32 against int8 and nf4, each with and without the (lossy) policy."""
    out = work["root"] / "consistency"
    cli("consistency", DEFAULT_MODEL_ID, "--prompts", str(work["prompts"]), "--candidates", "int8,nf4",
        "--policy", str(work["root"] / "lossy.json"), "--split", "all", "--max-prompts", "2",
        "--new-tokens", str(NEW_TOKENS), "--out", str(out), "--reference", "float32")
    result = json.loads((out / "consistency.json").read_text())
    names = [r["variant"] for r in result["variants"]]
    assert names == ["float32+policy", "int8", "int8+policy", "nf4", "nf4+policy"]
    for row in result["variants"]:
        assert row["alignment"]["aligned"], f"{row['variant']}: {row['alignment']['error']}"
        assert all(d <= row["alignment"]["max_distance"] for d in row["alignment"]["distances"])
        assert 0.0 <= row["exact_match"] <= 1.0 and 0.0 <= row["tf_agreement"] <= 1.0
        assert row["mean_kl"] >= 0.0 and row["ppl"] > 0.0
        assert row["num_diverged"] == round((1.0 - row["exact_match"]) * 2)
        assert row["decode_tokens_per_s"] > 0.0 and row["speed_vs_reference"] == pytest.approx(
            row["decode_tokens_per_s"] / result["reference_tokens_per_s"])
        if row["policy"] is not None:  # the policy aligns to every quantization, through fingerprints
            assert row["policy_aligned"] and row["policy_layer_map"] == {str(i): i for i in range(30)}
            assert row["mean_layers_skipped"] == 6.0
        else:
            assert row["mean_layers_skipped"] == 0.0
    markdown = (out / "consistency.md").read_text()
    assert "decode_tokens_per_s" in markdown and "speed_vs_reference" in markdown
    assert "| variant |" in markdown and "| layer |" in markdown and markdown.count("\n| ") >= 35
    for name in ("consistency_metrics.png", "consistency_alignment.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC


def test_consistency_reference_is_a_float_precision(work: dict[str, Path]) -> None:
    """--reference takes float16 | bfloat16 | float32; the default is float16 where fp16 runs."""
    from text_generation_server.layerskip_cli import consistency

    assert consistency.default_reference() == ("float16" if consistency.fp16_runs() else "float32")
    output = cli("consistency", DEFAULT_MODEL_ID, "--prompts", str(work["prompts"]), "--reference", "nf4",
                 "--out", str(work["root"] / "refused"), expect=2)
    assert "--reference nf4: use one of float16, bfloat16, float32" in output


def test_verified_rules_carve_a_class_out_of_a_wider_rule() -> None:
    """A prompt takes the first rule it matches, so a narrow rule chosen after a wide one goes
    before it: here the code-editing rule (num_tokens >= ~98) is chosen first and also takes the
    long summarisation prompts, which its configuration slows; the summarisation rule then
    goes in front of it (appended after it, it would never match, and was never chosen)."""
    from text_generation_server.layerskip_cli.prompts import Prompt
    from text_generation_server.layerskip_cli.verified import PromptRun, Scored, choose_rules

    plain, deep, shallow = (0, 0), (1, 0), (2, 0)  # configurations: (skip set, head size)
    classes = {  # num_tokens per prompt; speed-up of each configuration
        "chat": ([45, 46, 47], {plain: 1.5, deep: 0.3, shallow: 1.0}),
        "code_edit": ([150, 200, 300], {plain: 1.2, deep: 2.5, shallow: 1.3}),
        "summarise": ([1190, 1200, 1210], {plain: 1.1, deep: 0.8, shallow: 1.3}),
    }
    runs: list[PromptRun] = []
    speed: dict[tuple[int, int], list[float]] = {c: [] for c in (plain, deep, shallow)}
    for name, (lengths, speeds) in classes.items():
        for i, n in enumerate(lengths):
            prompt = Prompt(f"{name}-{i}", name, "calibration", None, "x")
            runs.append(PromptRun(prompt, {"num_tokens": float(n), "max_score": 1.0, "mean_score": 1.0,
                                           "spectral_entropy": 1.0, "kurtosis": 0.0}, []))
            for config, value in speeds.items():
                speed[config].append(value)
    default, rules = choose_rules(runs, Scored({c: [0.5] * len(runs) for c in speed}, speed))
    assert default == plain
    assert [(name, config, cond.feature, cond.op) for cond, config, name in rules] == [
        ("summarise", shallow, "num_tokens", ">="), ("code_edit", deep, "num_tokens", ">=")]
    assert 300 < rules[0][0].value < 1190 and 47 < rules[1][0].value < 150
