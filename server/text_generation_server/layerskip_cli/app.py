"""Typer app of `text-generation-server layerskip` (mounted by the shard CLI with add_typer).

Each command reads a JSONL prompt set, shows progress on stderr and writes machine-readable
files (CSV/JSON, and PNG/Markdown where a report is meant for people) into its output folder.
"""

from __future__ import annotations

import datetime
import os
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

from ..download import DEFAULT_MODEL_ID
from ..layerskip import LayerSkipMode
from ..layerskip.policy import OBJECTIVES
from .engine import Engine, ModelSpec
from .output import note
from .prompts import Prompt, PromptSet, default_prompts_path, read_prompts, select

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Offline layer-skip tools: profile, sweep, calibrate, verify, consistency.")


class Quantize(str, Enum):
    bitsandbytes = "bitsandbytes"
    bitsandbytes_nf4 = "bitsandbytes-nf4"
    bitsandbytes_fp4 = "bitsandbytes-fp4"


class Dtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class Split(str, Enum):
    calibration = "calibration"
    heldout = "heldout"
    all = "all"


ModelArg = Annotated[str, typer.Argument(help="Model id or local checkpoint folder.")]
PromptsOpt = Annotated[Path | None, typer.Option("--prompts", help="JSONL prompt set (default: the "
                                                 "repository's layerskip/data/prompts.jsonl).")]
QuantizeOpt = Annotated[Quantize | None, typer.Option("--quantize", help="bitsandbytes quantization.")]
DtypeOpt = Annotated[Dtype, typer.Option("--dtype", help="Compute dtype.")]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", help="torch threads (default: torch's).")]
MaxPromptsOpt = Annotated[int | None, typer.Option("--max-prompts", help="Use only the first N prompts.")]
NewTokensOpt = Annotated[int, typer.Option("--new-tokens", help="Greedy tokens per prompt.")]


@app.callback()
def main() -> None:
    """Offline layer-skip tools (profile -> sweep -> calibrate -> verify, and the consistency suite)."""


def _setup(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _prompts(path: Path | None) -> PromptSet:
    try:
        return read_prompts(path or default_prompts_path())
    except ValueError as err:
        note(f"error: {err}")
        raise typer.Exit(2) from err


def _meta(spec: ModelSpec, prompt_set: PromptSet, split: str, command: str) -> dict[str, Any]:
    return {"command": command, "model_id": spec.model_id, "quantize": spec.quantize, "dtype": spec.dtype,
            "prompts": str(prompt_set.path), "prompts_sha256": prompt_set.sha256, "split": split,
            "threads": torch.get_num_threads(), "date": datetime.datetime.now().isoformat(timespec="seconds")}


def _load(spec: ModelSpec) -> Engine:
    note(f"loading {spec.model_id} ({spec.label}) ...")
    engine = Engine.load(spec)
    note(f"loaded: {engine.num_layers} layers, backend {engine.backend}")
    return engine


@app.command()
def profile(model_id: ModelArg = DEFAULT_MODEL_ID,
            out: Annotated[Path, typer.Option("--out", help="Output folder.")] = Path("reports/calibration"),
            prompts: PromptsOpt = None, quantize: QuantizeOpt = None, dtype: DtypeOpt = Dtype.float32,
            split: Annotated[Split, typer.Option("--split")] = Split.calibration,
            max_prompts: MaxPromptsOpt = None, new_tokens: NewTokensOpt = 16,
            latency_repeats: Annotated[int, typer.Option("--latency-repeats")] = 7,
            threads: ThreadsOpt = None) -> None:
    """One CSV row per decoder layer: identity, residual statistics, latency saving, drift, agreement."""
    from .profile import ProfileConfig, run_profile

    _setup(threads)
    config = ProfileConfig(new_tokens=new_tokens, latency_repeats=latency_repeats)
    prompt_set = _prompts(prompts)
    chosen = select(prompt_set, split.value, max_prompts)
    spec = ModelSpec(model_id, quantize.value if quantize else None, dtype.value)
    engine = _load(spec)
    rows = run_profile(engine, chosen, config, out, _meta(spec, prompt_set, split.value, "profile"))
    ranked = sorted(rows, key=lambda r: r["kl_p95"])[:5]
    note(f"wrote {out / 'profile.csv'}; lowest output drift: "
         + ", ".join(f"layer {r['layer']} (KL p95 {r['kl_p95']:.3f}, agreement {r['tf_agreement']:.2f})"
                     for r in ranked))


TargetOpt = Annotated[float, typer.Option("--target", help="Greedy exact-match consistency target (0..1).")]


@app.command()
def sweep(model_id: ModelArg = DEFAULT_MODEL_ID,
          profile_csv: Annotated[Path, typer.Option("--profile", help="profile.csv that ranks the layers.")] = Path(
              "reports/calibration/profile.csv"),
          out: Annotated[Path, typer.Option("--out", help="Output folder.")] = Path("reports/calibration"),
          prompts: PromptsOpt = None, quantize: QuantizeOpt = None, dtype: DtypeOpt = Dtype.float32,
          split: Annotated[Split, typer.Option("--split")] = Split.calibration,
          rank_by: Annotated[str, typer.Option("--rank-by", help="Profile column ranking the layers.")] = "kl_p95",
          max_k: Annotated[int, typer.Option("--max-k", help="Largest skip set size.")] = 4,
          num_thresholds: Annotated[int, typer.Option("--num-thresholds", help="Thresholds per score.")] = 6,
          target: TargetOpt = 0.999, max_prompts: MaxPromptsOpt = None, new_tokens: NewTokensOpt = 16,
          threads: ThreadsOpt = None) -> None:
    """Grid of detector thresholds x nested skip sets; CSV, JSON, heat map and detector honesty."""
    from text_generation_server.layerskip import DetectorConfig

    from .output import write_csv, write_json
    from .sweep import choose, frontier, grid, heatmap, honesty, nested_sets, skip_order, step_savings
    from .trials import run_trials

    _setup(threads)
    if max_k < 1 or num_thresholds < 2:
        raise typer.BadParameter("use --max-k >= 1 and --num-thresholds >= 2")
    prompt_set = _prompts(prompts)
    chosen_prompts = select(prompt_set, split.value, max_prompts)
    spec = ModelSpec(model_id, quantize.value if quantize else None, dtype.value)
    engine = _load(spec)
    order = skip_order(profile_csv, rank_by, engine.num_layers)
    skip_sets = nested_sets(order, max_k)
    trials = run_trials(engine, chosen_prompts, skip_sets, new_tokens, DetectorConfig(), "sweep: prompts")
    cells = grid(trials, num_thresholds, len(skip_sets), engine.num_layers)
    best = choose(cells, target)
    report = honesty(trials)
    write_csv(out / "sweep.csv", [c.to_row() for c in cells])
    heatmap(cells, best, target, out / "sweep_heatmap.png")
    frontier(cells, step_savings(profile_csv, skip_sets), out / "sweep_frontier.png")
    write_json(out / "sweep.json", {**_meta(spec, prompt_set, split.value, "sweep"), "profile": str(profile_csv),
                                    "rank_by": rank_by, "target": target, "new_tokens": new_tokens,
                                    "skip_sets": [sorted(s) for s in skip_sets],
                                    "chosen": None if best is None else best.to_row(), "detector_honesty": report,
                                    "cells": [c.to_row() for c in cells], "prompts": [t.to_json() for t in trials]})
    note(f"wrote {out / 'sweep.csv'}, {out / 'sweep_heatmap.png'}, {out / 'sweep_frontier.png'}, {out / 'sweep.json'}")
    note(f"chosen cell: {best.to_row() if best else 'none (no cell that skips meets the target)'}")
    note(f"detector honesty: {report['verdict']}")


@app.command()
def calibrate(model_id: ModelArg = DEFAULT_MODEL_ID,
              out: Annotated[Path, typer.Option("--out", help="Policy file to write.")] = Path(
                  "reports/calibration/policy.json"),
              sweep_dir: Annotated[Path, typer.Option("--sweep-dir", help="Folder with sweep.json (lossy).")] = Path(
                  "reports/calibration"),
              prompts: PromptsOpt = None, quantize: QuantizeOpt = None, dtype: DtypeOpt = Dtype.float32,
              objective: Annotated[str, typer.Option("--objective",
                                                     help="lossy or verified.")] = LayerSkipMode.LOSSY.value,
              target: TargetOpt = 0.999, max_prompts: MaxPromptsOpt = None, new_tokens: NewTokensOpt = 16,
              threads: ThreadsOpt = None,
              profile_csv: Annotated[Path | None, typer.Option("--profile", help="verified: profile.csv ranking the "
                                                               "layers (default: measured here).")] = None,
              skip_depths: Annotated[str, typer.Option("--skip-depths", help="verified: skip set sizes.")] = (
                  "2,4,6,8,10,12"),
              vocab_sizes: Annotated[str, typer.Option("--vocab-sizes", help="verified: draft head sizes "
                                                       "(0: full).")] = "0,32768,16384,8192,4096",
              per_class: Annotated[int | None, typer.Option("--per-class", help="verified: prompts per class and "
                                                            "split.")] = None,
              verify_cost: Annotated[str, typer.Option("--verify-cost", help="verified: measured, or flat (a forward "
                                                       "of up to 8 tokens costs one step).")] = "measured",
              layer_order: Annotated[str, typer.Option("--layer-order", help="verified: layers safest first "
                                                       "(default: ranked here).")] = "",
              heldout_per_class: Annotated[int | None, typer.Option("--heldout-per-class", help="verified: held-out "
                                                                    "prompts per class (default --per-class).")] = None,
              ) -> None:
    """Write a policy: lossy, the cell skipping most layers at the target; verified, the fastest drafts per class."""
    import json

    from .calibrate import calibrate as run_calibrate

    _setup(threads)
    if objective not in OBJECTIVES:
        raise typer.BadParameter(f"--objective {objective} is not known; use lossy or verified")
    prompt_set = _prompts(prompts)
    if objective == LayerSkipMode.VERIFIED:
        _calibrate_verified(model_id, out, prompt_set, quantize, dtype, profile_csv, skip_depths, vocab_sizes,
                            (per_class, per_class if heldout_per_class is None else heldout_per_class), new_tokens,
                            verify_cost, layer_order)
        return
    sweep_path = sweep_dir / "sweep.json"
    if not sweep_path.is_file():
        note(f"error: {sweep_path} is missing; run `text-generation-server layerskip sweep` first")
        raise typer.Exit(2)
    sweep_result = json.loads(sweep_path.read_text(encoding="utf-8"))
    if sweep_result["prompts_sha256"] != prompt_set.sha256 or sweep_result["model_id"] != model_id:
        note(f"error: {sweep_path} was made with another prompt set or model; rerun the sweep")
        raise typer.Exit(2)
    if sweep_result["split"] == "heldout" or sweep_result["split"] == "all":
        note(f"error: {sweep_path} used split {sweep_result['split']!r}; calibrate on the calibration split so "
             "that the held-out split stays apart")
        raise typer.Exit(2)
    heldout = select(prompt_set, "heldout", max_prompts)
    spec = ModelSpec(model_id, quantize.value if quantize else None, dtype.value)
    engine = _load(spec)
    evidence = run_calibrate(engine, prompt_set, heldout, sweep_result, target, new_tokens, out)
    note(f"wrote {out}: {evidence['decision']}; held-out consistency {evidence['heldout']['consistency']:.3f}, "
         f"skip rate {evidence['heldout']['skip_rate']:.3f}")


def _per_class(prompts: list[Prompt], limit: int | None) -> list[Prompt]:
    if limit is None:
        return prompts
    taken: dict[str, int] = {}
    kept = []
    for p in prompts:
        if taken.get(p.category, 0) < limit:
            taken[p.category] = taken.get(p.category, 0) + 1
            kept.append(p)
    return kept


def _calibrate_verified(model_id: str, out: Path, prompt_set: PromptSet, quantize: Quantize | None, dtype: Dtype,
                        profile_csv: Path | None, skip_depths: str, vocab_sizes: str,
                        per_class: tuple[int | None, int | None], new_tokens: int, verify_cost: str,
                        layer_order: str) -> None:
    from .calibrate_verified import VerifiedConfig, calibrate_verified

    try:
        config = VerifiedConfig(tuple(int(d) for d in skip_depths.split(",")),
                                tuple(int(v) for v in vocab_sizes.split(",")), new_tokens, verify_cost,
                                tuple(int(i) for i in layer_order.split(",") if i.strip()))
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    spec = ModelSpec(model_id, quantize.value if quantize else None, dtype.value)
    engine = _load(spec)
    calibration = _per_class(prompt_set.split("calibration"), per_class[0])
    heldout = _per_class(prompt_set.split("heldout"), per_class[1]) if per_class[1] != 0 else []
    evidence = calibrate_verified(engine, prompt_set, calibration, heldout, profile_csv, config, out)
    note(f"wrote {out}: default drafts skip {evidence['default']['skip']} with head {evidence['default']['vocab']}, "
         f"{len(evidence['rules'])} detector rules; predicted speed-up {evidence['predicted_speedup']}")


@app.command("prompt-classes")
def prompt_classes(out: Annotated[Path, typer.Option("--out", help="JSONL file to write.")] = Path(
                       "reports/verified/prompts.jsonl"),
                   per_class: Annotated[int, typer.Option("--per-class", help="Prompts per class.")] = 16) -> None:
    """Write verified mode's four prompt classes (HumanEval completion, code editing, chat, summarisation)."""
    from .prompt_classes import write

    try:
        note(f"wrote {write(out, per_class)}")
    except ValueError as err:
        note(f"error: {err}")
        raise typer.Exit(2) from err


@app.command()
def verify(policy: Annotated[Path, typer.Argument(help="Policy file.")],
           model_id: Annotated[str, typer.Option("--model-id")] = DEFAULT_MODEL_ID,
           prompts: PromptsOpt = None, quantize: QuantizeOpt = None, dtype: DtypeOpt = Dtype.float32,
           split: Annotated[Split, typer.Option("--split")] = Split.all,
           out: Annotated[Path | None, typer.Option("--out", help="Folder for verify.csv / verify.json.")] = None,
           target: TargetOpt = 0.999, max_prompts: MaxPromptsOpt = None, new_tokens: NewTokensOpt = 16,
           threads: ThreadsOpt = None) -> None:
    """Run a policy (lossy) against off; per-prompt table; exit 1 when consistency < target."""
    from text_generation_server.layerskip import Scheduler

    from .calibrate import run_policy, summary
    from .output import markdown_table, write_csv, write_json

    _setup(threads)
    prompt_set = _prompts(prompts)
    chosen = select(prompt_set, split.value, max_prompts)
    spec = ModelSpec(model_id, quantize.value if quantize else None, dtype.value)
    engine = _load(spec)
    try:
        scheduler = Scheduler.from_model(engine.model, policy, LayerSkipMode.LOSSY)
    except ValueError as err:
        note(f"error: {err}")
        raise typer.Exit(2) from err
    rows = run_policy(engine, scheduler, None, chosen, new_tokens, "verify: prompts")
    result = summary(rows, engine.num_layers)
    table = [{k: v for k, v in r.to_row().items() if not k.endswith("_text")} for r in rows]
    typer.echo(markdown_table(table))
    passed = result["consistency"] >= target
    typer.echo(f"consistency {result['consistency']:.3f} (target {target}), skip rate {result['skip_rate']:.3f}, "
               f"{'PASS' if passed else 'FAIL'}")
    if out is not None:
        write_csv(out / "verify.csv", [r.to_row() for r in rows])
        write_json(out / "verify.json", {**_meta(spec, prompt_set, split.value, "verify"), "policy": str(policy),
                                         "target": target, "passed": passed, **result,
                                         "rows": [r.to_row() for r in rows]})
    if not passed:
        raise typer.Exit(1)


@app.command()
def consistency(model_id: ModelArg = DEFAULT_MODEL_ID,
                out: Annotated[Path, typer.Option("--out", help="Output folder.")] = Path(
                    "reports/calibration/consistency"),
                prompts: PromptsOpt = None,
                reference: Annotated[str | None, typer.Option(
                    "--reference", help="float16, bfloat16 or float32 (default: float16 where fp16 runs on this "
                    "CPU, else float32).")] = None,
                candidates: Annotated[str, typer.Option("--candidates", help="Comma-separated, of int8, nf4, fp4"
                                                        ", nf4-bfloat16, bfloat16, float16.")] = "int8,nf4,fp4",
                policy: Annotated[Path | None, typer.Option("--policy", help="Policy (lossy) to apply too.")] = None,
                split: Annotated[Split, typer.Option("--split")] = Split.heldout,
                max_prompts: MaxPromptsOpt = 8, new_tokens: NewTokensOpt = 16, threads: ThreadsOpt = None) -> None:
    """Quantized-versus-full-precision suite: JSON, Markdown report and PNG plots."""
    from .consistency import default_reference, run_consistency

    _setup(threads)
    prompt_set = _prompts(prompts)
    chosen = select(prompt_set, split.value, max_prompts)
    names = [c.strip() for c in candidates.split(",") if c.strip()]
    reference = reference or default_reference()
    spec = ModelSpec(model_id, None, reference)
    try:
        result = run_consistency(model_id, reference, names, policy, chosen, new_tokens, out,
                                 _meta(spec, prompt_set, split.value, "consistency"))
    except ValueError as err:
        note(f"error: {err}")
        raise typer.Exit(2) from err
    for row in result["variants"]:
        note(f"{row['variant']:>16}: exact {row.get('exact_match', float('nan')):.3f}, "
             f"agreement {row.get('tf_agreement', float('nan')):.3f}, KL {row.get('mean_kl', float('nan')):.4f}, "
             f"{row.get('decode_tokens_per_s', float('nan')):.1f} tok/s "
             f"({row.get('speed_vs_reference', float('nan')):.2f}x {reference}), aligned {row['alignment']['aligned']}")
    note(f"wrote {out / 'consistency.json'}, {out / 'consistency.md'} and plots")
