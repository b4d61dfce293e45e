"""The `calibrate --objective verified` run: rank layers, measure acceptance, choose, write the policy.

Writes `<out>` (the policy), `<out stem>.evidence.json` (acceptance per class x skip depth x
head size, the cost model with its drafts fitted to a plane and as measured, predicted
speed-ups on both splits, n-gram acceptance per class, the detector's value) and
`<out stem>.frontier.png` (acceptance against the draft's saved step time). See verified.py for
the method.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from text_generation_server.layerskip import LayerSkipMode, save_policy
from text_generation_server.speculative.cost_model import CostModel

from .engine import NO_SKIP, Engine
from .output import note, progress, read_csv, write_json
from .prompts import Prompt, PromptSet
from .verified import (
    PromptRun,
    Scored,
    build_policy,
    choose_rules,
    cross_fitted,
    detector_value,
    heads_for,
    measure_runs,
    policy_table,
    ranking,
    routed_speed,
    score,
)


@dataclass(frozen=True)
class VerifiedConfig:
    """Settings of one run.

    Attributes:
        depths: skip set sizes tried (nested sets of the safest layers).
        sizes: draft head sizes tried (0 = the full head).
        new_tokens: greedy tokens per prompt.
        verify_cost: "measured" (the runner as it is) or "flat" (a forward of up to 8 tokens costs
            one step: the multi-token fast path's target; draft costs stay measured).
        layer_order: layers from safest to riskiest, when known (else ranked by a measurement).
    """

    depths: tuple[int, ...] = (2, 4, 6, 8, 10, 12)
    sizes: tuple[int, ...] = (0, 32768, 16384, 8192, 4096)
    new_tokens: int = 32
    verify_cost: str = "measured"
    layer_order: tuple[int, ...] = ()  # given: skip sets are its prefixes (no ranking pass)

    def __post_init__(self) -> None:
        if self.verify_cost not in ("measured", "flat"):
            raise ValueError(f"--verify-cost {self.verify_cost}: use measured or flat")
        if not self.depths or min(self.depths) < 1:
            raise ValueError(f"--skip-depths {self.depths}: use positive layer counts")


def layer_order(engine: Engine, profile_csv: Path | None, prompts: list[Prompt], new_tokens: int) -> list[int]:
    """Layers from safest to riskiest: a profile's teacher-forced agreement, else measured here."""
    usable = range(1, engine.num_layers - 1)
    if profile_csv is not None:
        rows = {int(r["layer"]): float(r["tf_agreement"]) for r in read_csv(profile_csv)}
        return sorted(usable, key=lambda i: -rows[i])
    agreement = dict.fromkeys(usable, 0.0)
    for prompt in progress(prompts, "calibrate: layer ranking"):
        ids = prompt.render(engine.tokenizer)
        full_ids = torch.cat([ids, torch.tensor(engine.greedy(ids, NO_SKIP, new_tokens), dtype=torch.long)])
        reference = engine.logits(full_ids)[ids.shape[0] - 1:].argmax(-1)
        for i in usable:
            skipped = engine.logits(full_ids, frozenset({i}))[ids.shape[0] - 1:].argmax(-1)
            agreement[i] += float((skipped == reference).double().mean())
    return sorted(usable, key=lambda i: -agreement[i])


def _cost(engine: Engine, skip_sets: list[frozenset[int]], config: VerifiedConfig,
          vocab: Any) -> tuple[CostModel, CostModel]:
    """The cost model the choice uses (drafts fitted to a plane), and the one measured."""
    heads = heads_for(engine, vocab, [s for s in config.sizes if s])
    assert engine.runner is not None
    configs = [(skip, size) for skip in skip_sets for size in config.sizes]
    measured = CostModel.measure(engine.runner, configs, heads)
    cost = measured.fitted_drafts()
    if config.verify_cost == "flat":
        step = cost.forward_s[0]
        flat = tuple(step if t <= 8 else step * t / 8 for t in cost.tokens)
        cost = CostModel(cost.tokens, flat, cost.layer_s, cost.head_s, cost.vocab_size, cost.drafts)
    return cost, measured


def _table(runs: list[PromptRun], scored: Scored, skip_sets: list[frozenset[int]]) -> list[dict[str, Any]]:
    rows = []
    for name in sorted({r.prompt.category for r in runs}):
        members = [p for p, r in enumerate(runs) if r.prompt.category == name]
        for (i, size), values in scored.acceptance.items():
            rows.append({"class": name, "skip": sorted(skip_sets[i]), "num_skipped": len(skip_sets[i]), "vocab": size,
                         "acceptance": float(np.mean([values[p] for p in members])),
                         "speedup": float(np.mean([scored.speed[(i, size)][p] for p in members]))})
    return rows


def _ngram(runs: list[PromptRun]) -> dict[str, Any]:
    out = {}
    for name in sorted({r.prompt.category for r in runs}):
        members = [r for r in runs if r.prompt.category == name]
        drafted = sum(r.ngram_drafted for r in members)
        positions = sum(len(r.tokens) - 1 for r in members)
        out[name] = {"acceptance": sum(r.ngram_hits for r in members) / drafted if drafted else 0.0,
                     "cycles_with_a_match_per_token": sum(r.ngram_cycles for r in members) / max(positions, 1)}
    return out


def frontier(rows: list[dict[str, Any]], cost: CostModel, path: Path) -> Path:
    """Acceptance against the draft's saved share of a step, one line per class and head size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (name, size) in sorted({(r["class"], r["vocab"]) for r in rows}):
        sub = sorted((r for r in rows if r["class"] == name and r["vocab"] == size), key=lambda r: r["num_skipped"])
        saved = [1 - cost.draft_s(1, frozenset(r["skip"]), size) / cost.step_s for r in sub]
        ax.plot(saved, [r["acceptance"] for r in sub], marker="o", markersize=3,
                label=f"{name}, head {size or 'full'}")
    ax.set_xlabel("saved share of a step by the draft (1 - draft / step)")
    ax.set_ylabel("per-draft acceptance")
    ax.set_title("verified-mode frontier: acceptance vs draft cost", fontsize=10)
    ax.legend(fontsize=6, ncol=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def calibrate_verified(engine: Engine, prompt_set: PromptSet, calibration: list[Prompt], heldout: list[Prompt],
                       profile_csv: Path | None, config: VerifiedConfig, out: Path) -> dict[str, Any]:
    """Run the whole calibration (module docstring); returns the evidence."""
    # The ranking runs one teacher-forced forward per layer and prompt: the two shortest prompts keep it cheap.
    shortest = sorted(calibration, key=lambda p: len(p.render(engine.tokenizer)))[:2]
    order = list(config.layer_order) or layer_order(engine, profile_csv, shortest, config.new_tokens)
    skip_sets = [frozenset(order[:d]) for d in config.depths if d <= len(order)]
    runs = measure_runs(engine, calibration, skip_sets, config.new_tokens, "calibrate: acceptance")
    vocab_size = int(engine.model.get_input_embeddings().weight.shape[0])
    vocab = ranking(runs, engine, vocab_size)
    note("calibrate: measuring the cost model on the runner ...")
    cost, measured = _cost(engine, skip_sets, config, vocab)
    scored = score(runs, skip_sets, config.sizes, cross_fitted(runs, engine, vocab_size), cost)
    default, rules = choose_rules(runs, scored)
    table = policy_table(engine.num_layers, skip_sets, scored, default, rules)
    held = measure_runs(engine, heldout, skip_sets, config.new_tokens, "calibrate: held-out") if heldout else []
    held_scored = score(held, skip_sets, config.sizes, vocab, cost) if held else None
    route = [(c, k) for c, k, _ in rules]
    evidence: dict[str, Any] = {
        "objective": LayerSkipMode.VERIFIED.value, "verify_cost": config.verify_cost, "layer_order": order,
        "skip_sets": [sorted(s) for s in skip_sets], "vocab_sizes": list(config.sizes),
        "new_tokens": config.new_tokens, "cost_model": cost.to_json(),
        "drafts_measured": measured.to_json()["drafts"], "draft_vocab_source": vocab.source,
        "draft_vocab_scoring": "calibration split: each prompt's reduced head ranked on the other half of the "
                               "prompts (cross-fitted); held-out: ranked on the whole calibration split",
        "default": {"skip": sorted(skip_sets[default[0]]), "vocab": default[1]},
        "rules": [{"name": n, "when": c.to_json(), "skip": sorted(skip_sets[k[0]]), "vocab": k[1]}
                  for c, k, n in rules],
        "predicted_speedup": {"calibration": routed_speed(runs, scored, route, default),
                              "heldout": routed_speed(held, held_scored, route, default) if held_scored else None},
        "acceptance_table": _table(runs, scored, skip_sets),
        "heldout_acceptance_table": _table(held, held_scored, skip_sets) if held_scored else [],
        "ngram": _ngram(runs + held), "detector_value": detector_value(runs + held, _merge(scored, held_scored),
                                                                        default),
        "prompts": [{"id": r.prompt.id, "category": r.prompt.category, "split": r.prompt.split, "scores": r.scores,
                     "tokens": len(r.tokens)} for r in runs + held]}
    skip_rate = len(table.default.skip) / engine.num_layers
    policy = build_policy(engine, table, vocab, f"{prompt_set.path.name} ({len(runs)} calibration / {len(held)} "
                          f"held-out prompts, {config.new_tokens} greedy tokens, verify cost {config.verify_cost})",
                          prompt_set.sha256, skip_rate)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_policy(policy, out)
    write_json(out.with_name(out.stem + ".evidence.json"), evidence)
    frontier(evidence["acceptance_table"], cost, out.with_name(out.stem + ".frontier.png"))
    return evidence


def _merge(a: Scored, b: Scored | None) -> Scored:
    if b is None:
        return a
    return Scored({k: a.acceptance[k] + b.acceptance[k] for k in a.acceptance},
                  {k: a.speed[k] + b.speed[k] for k in a.speed})
