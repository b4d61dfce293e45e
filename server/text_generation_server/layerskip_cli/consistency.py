"""`layerskip consistency`: quantized candidates against a full-precision reference, with and without a policy.

The reference precision is the user's choice (`--reference float16|bfloat16|float32`; by default
float16 where fp16 runs on this CPU, as bitsandbytes' int8 is usually judged, else float32).
Beside the consistency figures each row reports its greedy decode speed (tokens/s over the
prompts' continuations, prefill included) and its ratio to the reference's, so the trade is
visible: measured one variant after another, not interleaved, so a guide rather than a benchmark
(benchmark/runner_decode.py measures speed properly).

For each variant (a candidate quantization, or the reference itself with the policy) and each
prompt: greedy exact match against the reference's greedy continuation and the first divergence
position; teacher-forced over the reference continuation: argmax agreement, mean KL(reference ||
variant) and the perplexity of that continuation (drift = variant / reference - 1). The identity
map of every loaded variant is aligned to the reference's (per-layer fingerprint distance and
whether `align` maps each layer to the same index), and a given policy must align to each one.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from text_generation_server.layerskip import IdentityMap, LayerSkipMode, Scheduler, align, distance

from .engine import NO_SKIP, Engine, ModelSpec, Skip, kl_divergence, teacher_forced
from .output import markdown_table, note, progress, write_json
from .prompts import Prompt

CANDIDATES = {"int8": ("bitsandbytes", "float32"), "nf4": ("bitsandbytes-nf4", "float32"),
              "fp4": ("bitsandbytes-fp4", "float32"), "nf4-bfloat16": ("bitsandbytes-nf4", "bfloat16"),
              "bfloat16": (None, "bfloat16"), "float16": (None, "float16"), "float32": (None, "float32")}
REFERENCES = ("float16", "bfloat16", "float32")


def fp16_runs() -> bool:
    """Whether this CPU's torch runs the fp16 ops a forward needs (a tiny probe)."""
    try:
        x, weight = torch.ones(1, 2, 4, 8, dtype=torch.float16), torch.ones(8, 8, dtype=torch.float16)
        out = torch.nn.functional.scaled_dot_product_attention(x, x, x) + torch.nn.functional.linear(x, weight)
        return bool(torch.isfinite(torch.nn.functional.rms_norm(out, (8,))).all())
    except (RuntimeError, NotImplementedError):
        return False


def default_reference() -> str:
    return "float16" if fp16_runs() else "float32"


@dataclass
class Reference:
    """The reference model's outputs per prompt (kept after the model itself is freed)."""

    label: str
    ids: list[torch.Tensor] = field(default_factory=list)
    tokens: list[tuple[int, ...]] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # [new, vocab] per prompt
    identity: IdentityMap | None = None
    tokens_per_s: float = 0.0  # greedy decode speed over the prompts


def nll(logits: torch.Tensor, tokens: tuple[int, ...]) -> float:
    """Summed negative log-likelihood of `tokens` under [len(tokens), vocab] logits."""
    log_p = torch.log_softmax(logits.double(), dim=-1)
    return -float(log_p[torch.arange(len(tokens)), torch.tensor(tokens)].sum())


def measure(engine: Engine, ref: Reference, skips: list[Skip]) -> dict[str, Any]:
    """The variant's figures against the reference, one skip set per prompt."""
    exact, first, agree, kls, nll_ref, nll_var, count = [], [], [], [], 0.0, 0.0, 0
    greedy_s, greedy_tokens = 0.0, 0
    for i, (ids, tokens, ref_logits) in enumerate(zip(ref.ids, ref.tokens, ref.logits, strict=True)):
        start = time.perf_counter()
        got = engine.greedy(ids, skips[i], len(tokens), reference=tokens)
        greedy_s += time.perf_counter() - start
        greedy_tokens += len(got)
        diverged = next((j for j, (a, b) in enumerate(zip(got, tokens, strict=False)) if a != b), None)
        if diverged is None and len(got) != len(tokens):
            diverged = min(len(got), len(tokens))
        exact.append(diverged is None)
        if diverged is not None:
            first.append(diverged)
        logits, _ = teacher_forced(engine, ids, tokens, ref_logits, skips[i])
        agree.append(float((logits.argmax(-1) == ref_logits.argmax(-1)).double().mean()))
        kls.append(float(kl_divergence(ref_logits, logits).mean()))
        nll_ref += nll(ref_logits, tokens)
        nll_var += nll(logits, tokens)
        count += len(tokens)
    ppl_ref, ppl_var = math.exp(nll_ref / count), math.exp(nll_var / count)
    return {"exact_match": float(np.mean(exact)), "num_diverged": len(first),
            "mean_first_divergence": float(np.mean(first)) if first else None,
            "min_first_divergence": min(first) if first else None, "tf_agreement": float(np.mean(agree)),
            "mean_kl": float(np.mean(kls)), "ppl_reference": ppl_ref, "ppl": ppl_var,
            "ppl_drift": ppl_var / ppl_ref - 1.0,
            "mean_layers_skipped": float(np.mean([len(s) for s in skips])),
            "decode_tokens_per_s": greedy_tokens / greedy_s,
            "speed_vs_reference": greedy_tokens / greedy_s / ref.tokens_per_s}


def alignment(reference: IdentityMap, loaded: IdentityMap) -> dict[str, Any]:
    """Per-layer fingerprint distance to the same reference layer, and align()'s verdict."""
    distances = [distance(r.fingerprint, g.fingerprint) for r, g in zip(reference.layers, loaded.layers, strict=True)]
    try:
        mapping = align(reference, loaded)
        same = [mapping.get(i) == i for i in range(reference.num_layers)]
        error = None
    except ValueError as err:
        same, error = [False] * reference.num_layers, str(err)
    return {"distances": distances, "same_index": same, "aligned": error is None and all(same), "error": error,
            "max_distance": loaded.fingerprint.max_distance}


def run_reference(spec: ModelSpec, prompts: list[Prompt], new_tokens: int) -> Reference:
    engine = Engine.load(spec)
    ref = Reference(spec.label, identity=engine.identity)
    greedy_s, greedy_tokens = 0.0, 0
    for prompt in progress(prompts, f"consistency: reference {spec.label}"):
        ids = prompt.render(engine.tokenizer)
        start = time.perf_counter()
        tokens = engine.greedy(ids, NO_SKIP, new_tokens)
        greedy_s += time.perf_counter() - start
        greedy_tokens += len(tokens)
        _, logits = teacher_forced(engine, ids, tokens, None, NO_SKIP)
        ref.ids.append(ids)
        ref.tokens.append(tokens)
        ref.logits.append(logits)
    ref.tokens_per_s = greedy_tokens / greedy_s
    return ref


def run_variant(spec: ModelSpec, ref: Reference, policy: Path | None, include_plain: bool) -> list[dict[str, Any]]:
    """Rows for one loaded model: without policy (unless it is the reference) and with the policy."""
    engine = Engine.load(spec)
    assert ref.identity is not None, "the reference identity is computed first"
    aligned = alignment(ref.identity, engine.identity)
    # Align the policy before the first forward, as the shard does: on the CPU, bitsandbytes
    # repacks 4-bit weights at their first matmul, and fingerprints read after that do not match.
    scheduler: Scheduler | None = None
    policy_error = None
    if policy is not None:
        try:
            scheduler = Scheduler.from_model(engine.model, policy, LayerSkipMode.LOSSY)
        except ValueError as err:
            policy_error = str(err)
    rows = []
    if include_plain:
        note(f"consistency: {spec.label} without policy")
        rows.append({"variant": spec.label, "policy": None, **measure(engine, ref, [NO_SKIP] * len(ref.ids)),
                     "alignment": aligned})
    if policy is not None:
        row: dict[str, Any] = {"variant": f"{spec.label}+policy", "policy": str(policy), "alignment": aligned}
        if scheduler is None:
            row.update({"policy_aligned": False, "policy_error": policy_error})
        else:
            skips = [scheduler.plan(ids, LayerSkipMode.LOSSY).skipped for ids in ref.ids]
            row["policy_aligned"] = True
            row["policy_layer_map"] = {str(k): v for k, v in scheduler.policy.layer_map.items()}
            note(f"consistency: {spec.label} with policy "
                 f"({sum(map(len, skips))} layer skips over {len(skips)} prompts)")
            if include_plain and not any(skips):  # the plans skip nothing: the run would repeat the plain one
                row.update({k: v for k, v in rows[0].items() if k not in ("variant", "policy", "alignment")})
                row["note"] = "the policy skipped no layer on these prompts; figures equal the run without it"
            else:
                row.update(measure(engine, ref, skips))
        rows.append(row)
    del engine
    gc.collect()
    return rows


SUMMARY_COLUMNS = ("variant", "mean_layers_skipped", "exact_match", "mean_first_divergence", "tf_agreement",
                   "mean_kl", "ppl", "ppl_drift", "decode_tokens_per_s", "speed_vs_reference", "policy_aligned")


def report_markdown(result: dict[str, Any]) -> str:
    rows = result["variants"]
    lines = [f"# Consistency: candidates against {result['reference']}", "",
             f"Prompts: {result['num_prompts']} ({result['prompts']}, split {result['split']}), "
             f"{result['new_tokens']} greedy tokens, policy: {result['policy'] or 'none'}. "
             f"Reference perplexity of its own continuation: {result['ppl_reference']:.3f}.", "",
             "## Output consistency", "", markdown_table(rows, SUMMARY_COLUMNS), "",
             "## Identity-map alignment (fingerprint distance to the reference layer; * = not aligned)", ""]
    labels = [r["variant"] for r in rows if r["policy"] is None] or [rows[0]["variant"]]
    by_label = {r["variant"]: r["alignment"] for r in rows}
    table = []
    for i in range(result["num_layers"]):
        line: dict[str, Any] = {"layer": i}
        for label in labels:
            a = by_label[label]
            line[label] = f"{a['distances'][i]:.3f}" + ("" if a["same_index"][i] else " *")
        table.append(line)
    lines += [markdown_table(table), "",
              "Aligned: " + ", ".join(f"{lb} {'yes' if by_label[lb]['aligned'] else 'NO'}" for lb in labels)
              + f" (tolerance {rows[0]['alignment']['max_distance']:.3f})", ""]
    return "\n".join(lines)


def plots(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["variants"] if "exact_match" in r]
    names = [r["variant"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, title in zip(axes, ("exact_match", "tf_agreement", "mean_kl"),
                              ("greedy exact match", "teacher-forced agreement", "mean KL (nats)"), strict=True):
        ax.bar(range(len(rows)), [r[key] for r in rows], color="tab:blue")
        ax.set_xticks(range(len(rows)), names, rotation=45, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"against {result['reference']} ({result['num_prompts']} prompts)", fontsize=10)
    first = out / "consistency_metrics.png"
    fig.savefig(first, dpi=110, bbox_inches="tight")
    plt.close(fig)
    plain = [r for r in result["variants"] if r["policy"] is None] or result["variants"][:1]
    z = np.array([r["alignment"]["distances"] for r in plain])  # [variants, layers]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(plain) + 1.5))
    image = ax.imshow(z, aspect="auto", cmap="magma_r", vmin=0.0, vmax=max(0.5, float(z.max())))
    ax.set_yticks(range(len(plain)), [r["variant"] for r in plain], fontsize=8)
    ax.set_xlabel("layer")
    ax.set_title(f"fingerprint distance to the {result['reference']} layer "
                 f"(tolerance {plain[0]['alignment']['max_distance']:.3f})", fontsize=10)
    fig.colorbar(image, ax=ax)
    second = out / "consistency_alignment.png"
    fig.savefig(second, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [first, second]


def run_consistency(model_id: str, reference: str, candidates: list[str], policy: Path | None,
                    prompts: list[Prompt], new_tokens: int, out: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Reference first, then one candidate at a time (each freed before the next loads)."""
    for name in (reference, *candidates):
        if name not in CANDIDATES:
            raise ValueError(f"variant {name!r} is not known; use one of {', '.join(CANDIDATES)}")
    if reference not in REFERENCES:
        raise ValueError(f"--reference {reference}: use one of {', '.join(REFERENCES)}")
    _, dtype = CANDIDATES[reference]
    ref_spec = ModelSpec(model_id, None, dtype)
    ref = run_reference(ref_spec, prompts, new_tokens)
    rows = run_variant(ref_spec, ref, policy, include_plain=False) if policy is not None else []
    if policy is None:  # the reference row still reports its own alignment (trivially exact)
        assert ref.identity is not None
        rows.append({"variant": ref.label, "policy": None, "alignment": alignment(ref.identity, ref.identity),
                     "exact_match": 1.0, "tf_agreement": 1.0, "mean_kl": 0.0, "num_diverged": 0,
                     "mean_first_divergence": None, "min_first_divergence": None, "ppl": None,
                     "ppl_reference": None, "ppl_drift": 0.0, "mean_layers_skipped": 0.0,
                     "decode_tokens_per_s": ref.tokens_per_s, "speed_vs_reference": 1.0})
    for name in candidates:
        quantize, dtype = CANDIDATES[name]
        rows += run_variant(ModelSpec(model_id, quantize, dtype), ref, policy, include_plain=True)
    ppl_ref = math.exp(sum(nll(lg, t) for lg, t in zip(ref.logits, ref.tokens, strict=True))
                       / sum(len(t) for t in ref.tokens))
    result = {**meta, "reference": ref.label, "reference_tokens_per_s": ref.tokens_per_s, "candidates": candidates,
              "policy": None if policy is None else str(policy), "num_prompts": len(prompts),
              "new_tokens": new_tokens, "num_layers": len(rows[0]["alignment"]["distances"]),
              "ppl_reference": ppl_ref, "variants": rows}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "consistency.json", result)
    (out / "consistency.md").write_text(report_markdown(result), encoding="utf-8")
    result["plots"] = [str(p) for p in plots(result, out)]
    return result
