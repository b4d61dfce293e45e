"""`layerskip calibrate --objective verified`: the skip set and draft head size that pay, per prompt class.

Design note. Verified mode is lossless, so its policy is chosen by speed alone, and speed is
arithmetic on acceptance (which is not noisy) and the cost model (speculative/cost_model.py):
1. per prompt, greedy decoding with the full model; at every position each candidate skip set
   runs one draft forward from the full model's cache (exactly what a cycle's first draft sees),
   and its top candidates are kept. A draft over the first V ranked ids is accepted when its
   argmax over those ids equals the full model's next token, so every head size is scored from
   the same forward. N-gram (prompt-lookup) proposals are scored on the same positions;
2. the draft vocabulary ranking counts the tokens of the calibration prompts and their greedy
   continuations (layerskip/draft.py);
3. per prompt and configuration (skip set S, head size V), the expected speed-up is the cost
   model's best over the draft length k given that prompt's acceptance;
4. rules: the default rule takes the configuration with the best mean speed over all
   calibration prompts; then, greedily (up to MAX_RULES), a class whose own best configuration
   differs gets a rule if one detector condition (feature op threshold) routes prompts to it
   and raises the mean speed by more than MIN_GAIN. A prompt takes the first rule it matches,
   and a new rule may go before the rules already chosen: a narrow rule then carves its class
   out of a wider one (were rules only appended, a wide rule chosen first could take another
   class's prompts and leave that class's own rule unreachable). So the detector earns rules
   only where its scores tell the classes apart, which is what the evidence reports.
The held-out split is measured the same way and reported beside the calibration figures.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from text_generation_server.layerskip import (
    Calibration,
    Condition,
    DraftSettings,
    DraftVocab,
    LayerSkipMode,
    Policy,
    Rule,
    RuleTable,
    detect,
)
from text_generation_server.layerskip.detector import FEATURES
from text_generation_server.models.runner.base import ForwardInputs
from text_generation_server.speculative.cost_model import CostModel
from text_generation_server.speculative.draft_head import DraftHeads
from text_generation_server.speculative.ngram import NgramIndex, agreeing

from .engine import Engine
from .output import progress, spearman
from .prompts import Prompt

TOP = 256  # draft candidates kept per position (a reduced head's argmax is the first of them it holds)
MAX_RULES = 3
MIN_GAIN = 0.01
NGRAM_DRAFTS = 6

Config = tuple[int, int]  # (index into the skip sets, head size; 0 = full head)


@dataclass
class PromptRun:
    """One prompt's positions: the full model's tokens and each skip set's draft candidates."""

    prompt: Prompt
    scores: dict[str, float]
    tokens: list[int]  # the full model's greedy continuation
    candidates: list[torch.Tensor] = field(default_factory=list)  # per skip set: [positions, TOP] ids
    ngram_hits: int = 0
    ngram_drafted: int = 0
    ngram_cycles: int = 0
    context: int = 0  # cached tokens halfway through the continuation (the cost model prices attention by it)

    def acceptance(self, skip_index: int, head_ids: set[int] | None) -> float:
        """Share of positions whose draft (head restricted to `head_ids`) equals the next token."""
        cands = self.candidates[skip_index]
        if not len(cands):
            return 0.0
        hits = 0
        for position, row in enumerate(cands.tolist()):
            pick = row[0] if head_ids is None else next((t for t in row if t in head_ids), -1)
            hits += int(pick == self.tokens[position + 1])
        return hits / len(cands)


def run_prompt(engine: Engine, prompt: Prompt, skip_sets: Sequence[frozenset[int]], new_tokens: int) -> PromptRun:
    """Greedy decoding with a draft forward per skip set at every position (see module docstring)."""
    runner = engine.runner
    assert runner is not None, "calibrate --objective verified needs the fast runner"
    ids = prompt.render(engine.tokenizer)
    n = int(ids.shape[0])
    cache = runner.new_cache(1)
    logits = runner.forward(ForwardInputs.contiguous(ids[None]), cache)[0, -1]
    tokens = [int(logits.argmax())]
    per_set: list[list[torch.Tensor]] = [[] for _ in skip_sets]
    while len(tokens) < new_tokens and tokens[-1] not in engine.eos_ids:
        length = cache.length
        step = ForwardInputs.contiguous(torch.tensor([[tokens[-1]]]), length)
        for i, skip in enumerate(skip_sets):
            draft = runner.draft_model(skip).forward(step, cache)[0, -1]
            per_set[i].append(draft.topk(TOP).indices)
            cache.crop(length)
        logits = runner.forward(step, cache)[0, -1]
        tokens.append(int(logits.argmax()))
    run = PromptRun(prompt, detect(engine.embed(ids), engine_detector()).as_dict(), tokens,
                    [torch.stack(c) if c else torch.zeros((0, TOP), dtype=torch.long) for c in per_set],
                    context=n + len(tokens) // 2)
    _score_ngrams(run, ids.tolist())
    return run


def engine_detector() -> Any:
    from text_generation_server.layerskip import DetectorConfig

    return DetectorConfig()


def _score_ngrams(run: PromptRun, prompt_ids: list[int]) -> None:
    """Cycles the n-gram drafter would run over this continuation: proposals, hits, cycles."""
    context, t, index = list(prompt_ids) + run.tokens[:1], 1, NgramIndex()
    while t < len(run.tokens):
        proposal = index.lookup(context, NGRAM_DRAFTS)
        kept = agreeing(proposal, run.tokens[t:])
        if proposal:
            run.ngram_cycles += 1
            run.ngram_drafted += len(proposal)
            run.ngram_hits += kept
        step = kept + 1
        context += run.tokens[t: t + step]
        t += step


def cross_fitted(runs: list[PromptRun], engine: Engine, vocab_size: int) -> list[DraftVocab]:
    """Per prompt, the vocabulary ranked on the other half of the prompts (alternate halves), so
    that a reduced head's acceptance on a calibration prompt is measured on text that did not
    rank it: ranked on every prompt, a head's calibration acceptance overstates its held-out one."""
    halves = [ranking(runs[1 - h::2], engine, vocab_size) for h in (0, 1)]
    return [halves[p % 2] for p in range(len(runs))]


def ranking(runs: list[PromptRun], engine: Engine, vocab_size: int) -> DraftVocab:
    """Token ids by count in the prompts and continuations, then the rest by id (draft.py)."""
    counts: dict[int, int] = {}
    for run in runs:
        for token in [*run.prompt.render(engine.tokenizer).tolist(), *run.tokens]:
            counts[token] = counts.get(token, 0) + 1
    first = sorted(engine.eos_ids) + sorted(counts, key=lambda t: (-counts[t], t))
    seen = list(dict.fromkeys(t for t in first if t < vocab_size))
    rest = sorted(set(range(vocab_size)) - set(seen))
    total = sum(counts.values())
    return DraftVocab(tuple(seen + rest), f"{len(runs)} calibration prompts + greedy continuations, {total} tokens, "
                                          f"{len(counts)} distinct; then the remaining ids in id order")


@dataclass(frozen=True)
class Scored:
    """Per prompt and configuration: acceptance and the cost model's best speed-up."""

    acceptance: dict[Config, list[float]]
    speed: dict[Config, list[float]]


def score(runs: list[PromptRun], skip_sets: Sequence[frozenset[int]], sizes: Sequence[int],
          vocabs: DraftVocab | Sequence[DraftVocab], cost: CostModel) -> Scored:
    """Acceptance and best speed-up (priced at the prompt's context) per prompt and configuration.
    `vocabs`: one ranking for every prompt (held-out prompts: ranked on the calibration split), or
    one per prompt (cross_fitted)."""
    acceptance: dict[Config, list[float]] = {}
    speed: dict[Config, list[float]] = {}
    per_run = [vocabs] * len(runs) if isinstance(vocabs, DraftVocab) else list(vocabs)
    for i, skip in enumerate(skip_sets):
        for size in sizes:
            values = [r.acceptance(i, None if size == 0 else set(v.token_ids[:size]))
                      for r, v in zip(runs, per_run, strict=True)]
            acceptance[(i, size)] = values
            speed[(i, size)] = [cost.best_k(a, skip, size, context=r.context)[1]
                                for a, r in zip(values, runs, strict=True)]
    return Scored(acceptance, speed)


def routed_speed(runs: list[PromptRun], scored: Scored, rules: list[tuple[Condition, Config]],
                 default: Config) -> float:
    """Mean speed-up when each prompt takes the first matching rule's configuration."""
    total = 0.0
    for p, run in enumerate(runs):
        config = next((c for cond, c in rules if cond.holds(run.scores)), default)
        total += max(scored.speed[config][p], 1.0) if config[0] >= 0 else 1.0
    return total / len(runs)


def choose_rules(runs: list[PromptRun], scored: Scored) -> tuple[Config, list[tuple[Condition, Config, str]]]:
    """The default configuration and the detector rules that pay (see module docstring)."""
    configs = list(scored.speed)
    default = max(configs, key=lambda c: float(np.mean(scored.speed[c])))
    rules: list[tuple[Condition, Config, str]] = []
    classes = sorted({r.prompt.category for r in runs})
    for _ in range(MAX_RULES):
        chosen = [(c, k) for c, k, _ in rules]
        base = routed_speed(runs, scored, chosen, default)
        best: tuple[float, int, Condition, Config, str] | None = None
        for name in classes:
            members = [p for p, r in enumerate(runs) if r.prompt.category == name]
            own = max(configs, key=lambda c: float(np.mean([scored.speed[c][p] for p in members])))
            if own == default or any(k == own for _, k, _ in rules):
                continue
            for feature in FEATURES:
                values = sorted({r.scores[feature] for r in runs})
                for low, high in zip(values, values[1:], strict=False):
                    for op in ("<", ">="):
                        cond = Condition(feature, op, (low + high) / 2)
                        for at in range(len(rules) + 1):
                            routes = chosen[:at] + [(cond, own)] + chosen[at:]
                            gain = routed_speed(runs, scored, routes, default) - base
                            if gain > MIN_GAIN and (best is None or gain > best[0]):
                                best = (gain, at, cond, own, name)
        if best is None:
            break
        rules.insert(best[1], best[2:])
    return default, rules


def policy_table(num_layers: int, skip_sets: Sequence[frozenset[int]], scored: Scored, default: Config,
                 rules: list[tuple[Condition, Config, str]]) -> RuleTable:
    def settings(config: Config) -> tuple[frozenset[int], DraftSettings]:
        accepted = float(np.mean(scored.acceptance[config]))
        return skip_sets[config[0]], DraftSettings(config[1], round(accepted, 4))

    made = [Rule(name, (cond,), *settings(config)) for cond, config, name in rules]
    return RuleTable(tuple(made), Rule("default", (), *settings(default)), num_layers)


def build_policy(engine: Engine, table: RuleTable, vocab: DraftVocab, dataset: str, sha256: str,
                 skip_rate: float) -> Policy:
    from text_generation_server.layerskip import DetectorConfig

    needed = max([r.draft.vocab for r in (*table.rules, table.default)] + [1])
    kept = DraftVocab(vocab.token_ids[:needed], vocab.source)
    calibration = Calibration(dataset=dataset, dataset_sha256=sha256, consistency=1.0, skip_rate=skip_rate,
                              date=datetime.date.today().isoformat(), dtype=engine.spec.dtype)
    return Policy.from_table(engine.identity, table, calibration=calibration, detector=DetectorConfig(),
                             objective=LayerSkipMode.VERIFIED, draft_vocab=kept)


def detector_value(runs: list[PromptRun], scored: Scored, config: Config) -> dict[str, Any]:
    """Spearman of each detector feature against per-prompt acceptance under `config`."""
    values = scored.acceptance[config]
    rhos = {f: spearman([r.scores[f] for r in runs], values) for f in FEATURES}
    finite = {k: v for k, v in rhos.items() if not np.isnan(v)}
    best = max(finite, key=lambda k: abs(finite[k])) if finite else None
    verdict = ("no detector feature varies with acceptance" if best is None else
               f"best |rho|: {best} {finite[best]:+.2f} over {len(runs)} prompts ("
               + ("predictive" if abs(finite[best]) >= 0.3 else "does not predict acceptance") + ")")
    return {"spearman": rhos, "verdict": verdict}


def heads_for(engine: Engine, vocab: DraftVocab, sizes: Sequence[int]) -> DraftHeads:
    heads = DraftHeads(vocab, engine.runner)
    for size in sizes:
        heads.reserve(size)
    return heads


def measure_runs(engine: Engine, prompts: list[Prompt], skip_sets: Sequence[frozenset[int]], new_tokens: int,
                 label: str) -> list[PromptRun]:
    return [run_prompt(engine, p, skip_sets, new_tokens) for p in progress(prompts, label)]
