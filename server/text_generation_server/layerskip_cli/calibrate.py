"""`layerskip calibrate` and `layerskip verify`: choose a policy on one split, measure it on another.

Calibrate (lossy objective): from the sweep's grid on the calibration split, take the cell that
skips the most layers on average while its greedy exact-match consistency meets the target.
Measure that one-rule policy on the held-out split, which played no part in the choice. When
the held-out figures miss the target (or no cell skips anything), the written policy skips
nothing and its evidence says so; the rejected candidate's figures stay in the evidence file.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from text_generation_server.layerskip import (
    Calibration,
    Condition,
    DetectorConfig,
    LayerSkipMode,
    Policy,
    Rule,
    RuleTable,
    Scheduler,
    detect,
    save_policy,
)

from .engine import NO_SKIP, Engine
from .output import progress, write_csv, write_json
from .prompts import Prompt, PromptSet
from .sweep import Cell
from .trials import Outcome, compare


def rule_table(cell: Cell | None, skip: frozenset[int], num_layers: int) -> RuleTable:
    """The one-rule table of a sweep cell (or the empty table)."""
    if cell is None or not skip:
        return RuleTable.empty(num_layers)
    when = (Condition("max_score", "<", cell.max_score_below), Condition("mean_score", "<", cell.mean_score_below))
    return RuleTable((Rule("calm", when, skip),), Rule("default"), num_layers)


@dataclass(frozen=True)
class VerifyRow:
    """One prompt of a verify run."""

    id: str
    category: str
    rule: str
    skipped: tuple[int, ...]
    outcome: Outcome
    off_text: str
    skip_text: str

    def to_row(self) -> dict[str, Any]:
        return {"id": self.id, "category": self.category, "rule": self.rule,
                "skipped": " ".join(map(str, self.skipped)), "exact": self.outcome.exact,
                "first_divergence": self.outcome.first_divergence, "tf_agreement": self.outcome.tf_agreement,
                "off_text": self.off_text, "skip_text": self.skip_text}


def run_policy(engine: Engine, scheduler: Scheduler | None, table: RuleTable | None, prompts: list[Prompt],
               new_tokens: int, label: str) -> list[VerifyRow]:
    """Each prompt's plan (scheduler, or a bare table with default detector settings) against off."""
    rows = []
    for prompt in progress(prompts, label):
        ids = prompt.render(engine.tokenizer)
        if scheduler is not None:
            plan = scheduler.plan(ids, LayerSkipMode.LOSSY)
        else:
            assert table is not None, "run_policy needs a scheduler or a rule table"
            plan = table.decide(detect(engine.embed(ids), DetectorConfig()), LayerSkipMode.LOSSY)
        off = engine.greedy(ids, NO_SKIP, new_tokens)
        outcome = compare(engine, ids, off, plan.skipped)
        skip_tokens = off if not plan.skipped else engine.greedy(ids, plan.skipped, new_tokens)
        rows.append(VerifyRow(prompt.id, prompt.category, plan.rule, tuple(sorted(plan.skipped)), outcome,
                              engine.tokenizer.decode(off), engine.tokenizer.decode(skip_tokens)))
    return rows


def summary(rows: list[VerifyRow], num_layers: int) -> dict[str, float]:
    return {"num_prompts": len(rows), "consistency": float(np.mean([r.outcome.exact for r in rows])),
            "skip_rate": float(np.mean([len(r.skipped) for r in rows])) / num_layers,
            "mean_layers_skipped": float(np.mean([len(r.skipped) for r in rows])),
            "tf_agreement": float(np.mean([r.outcome.tf_agreement for r in rows]))}


def calibrate(engine: Engine, prompt_set: PromptSet, heldout: list[Prompt], sweep: dict[str, Any],
              target: float, new_tokens: int, out: Path) -> dict[str, Any]:
    """Write the policy `out` and `<out stem>.evidence.json`; returns the evidence."""
    num_layers = engine.num_layers
    chosen = None if sweep["chosen"] is None else Cell(**sweep["chosen"])
    skip = frozenset(sweep["skip_sets"][chosen.k - 1]) if chosen is not None else NO_SKIP
    candidate = rule_table(chosen, skip, num_layers)
    evidence: dict[str, Any] = {"target": target, "calibration_split": sweep["split"], "heldout_split": "heldout",
                                "dataset": str(prompt_set.path), "dataset_sha256": prompt_set.sha256,
                                "new_tokens": new_tokens, "sweep_choice": sweep["chosen"],
                                "candidate_skip": sorted(skip)}
    final = candidate
    if chosen is None:
        evidence["decision"] = (f"no sweep cell that skips any layer reached consistency {target} on the "
                                "calibration split; the policy skips nothing")
        rows = run_policy(engine, None, final, heldout, new_tokens, "calibrate: held-out")
    else:
        rows = run_policy(engine, None, candidate, heldout, new_tokens, "calibrate: held-out")
        evidence["candidate_heldout"] = summary(rows, num_layers)
        if evidence["candidate_heldout"]["consistency"] < target:
            final = RuleTable.empty(num_layers)
            evidence["decision"] = (f"the chosen cell reached {chosen.consistency:.3f} on the calibration split but "
                                    f"{evidence['candidate_heldout']['consistency']:.3f} < {target} on the held-out "
                                    "split; the policy skips nothing")
            rows = [VerifyRow(r.id, r.category, "default", (), Outcome.same(), r.off_text, r.off_text) for r in rows]
        else:
            evidence["decision"] = "the chosen cell meets the target on the held-out split"
    evidence["heldout"] = summary(rows, num_layers)
    evidence["heldout_prompts"] = [r.to_row() for r in rows]
    calibration = Calibration(
        dataset=f"{prompt_set.path.name} (rules chosen on split '{sweep['split']}', figures on split 'heldout', "
                f"{len(rows)} prompts, {new_tokens} greedy tokens, target {target})",
        dataset_sha256=prompt_set.sha256, consistency=evidence["heldout"]["consistency"],
        skip_rate=evidence["heldout"]["skip_rate"], date=datetime.date.today().isoformat())
    policy = Policy.from_table(engine.identity, final, calibration=calibration, detector=DetectorConfig())
    save_policy(policy, out)
    write_json(out.with_suffix(".evidence.json"), evidence)
    write_csv(out.with_suffix(".heldout.csv"), evidence["heldout_prompts"])
    return evidence
