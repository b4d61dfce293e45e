"""`layerskip profile`: what each decoder layer does, and what skipping it alone costs and saves.

Per layer, over the prompts: zero_ratio (share of residual-update elements below 1e-5 in
magnitude), block influence (1 - cosine of the layer's input and output hidden states, mean
over positions), relative update norm (||out - in|| / ||in||, mean over positions), the decode
step time saved when only this layer is skipped (interleaved full/skip pairs, medians), output
drift (KL of the next-token distribution after the prompt, full || skipped, 95th percentile
over prompts; plus the mean KL over the teacher-forced positions) and teacher-forced token
agreement (share of positions predicting the greedy continuation whose argmax is unchanged).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .engine import NO_SKIP, Engine, kl_divergence
from .output import progress, write_csv, write_json
from .prompts import Prompt

ZERO_EPS = 1e-5
COLUMNS = ("layer", "class", "fingerprint", "zero_ratio", "block_influence", "relative_update_norm",
           "latency_saving_ms", "kl_p95", "kl_mean", "tf_agreement")


@dataclass(frozen=True)
class ProfileConfig:
    """Profile settings.

    Attributes:
        new_tokens: length of the greedy continuation the teacher-forced metrics run over.
        latency_repeats: interleaved full/skip decode-step pairs per layer.
    """

    new_tokens: int = 16
    latency_repeats: int = 7

    def __post_init__(self) -> None:
        if self.new_tokens < 1:
            raise ValueError(f"--new-tokens {self.new_tokens}: use at least 1")
        if self.latency_repeats < 1:
            raise ValueError(f"--latency-repeats {self.latency_repeats}: use at least 1")


class _Sums:
    def __init__(self, num_layers: int) -> None:
        self.zeros = np.zeros(num_layers)
        self.elements = np.zeros(num_layers)
        self.cos = np.zeros(num_layers)
        self.rel = np.zeros(num_layers)
        self.positions = 0

    def add(self, io: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for i, (h_in, h_out) in enumerate(io):  # [seq, hidden] each
            update = h_out - h_in
            self.zeros[i] += float((update.abs() < ZERO_EPS).sum())
            self.elements[i] += update.numel()
            self.cos[i] += float(torch.nn.functional.cosine_similarity(h_in, h_out, dim=-1).sum())
            self.rel[i] += float((update.norm(dim=-1) / h_in.norm(dim=-1).clamp(min=1e-12)).sum())
        self.positions += io[0][0].shape[0]


def layer_effects(engine: Engine, prompts: list[Prompt], new_tokens: int) -> dict[str, Any]:
    """Per-layer statistics and single-layer skip effects over `prompts` (see module docstring)."""
    n = engine.num_layers
    sums = _Sums(n)
    last_kl: list[list[float]] = [[] for _ in range(n)]
    mean_kl: list[list[float]] = [[] for _ in range(n)]
    agree = np.zeros(n)
    positions = 0
    for prompt in progress(prompts, "profile: prompts x layers"):
        ids = prompt.render(engine.tokenizer)
        continuation = engine.greedy(ids, NO_SKIP, new_tokens)
        full_ids = torch.cat([ids, torch.tensor(continuation, dtype=torch.long)])
        start, end = ids.shape[0] - 1, ids.shape[0] - 1 + len(continuation)
        sums.add(engine.layer_io(full_ids))
        reference = engine.logits(full_ids)[start:end]  # [new, vocab]
        positions += end - start
        for i in range(n):
            skipped = engine.logits(full_ids, frozenset({i}))[start:end]
            kl = kl_divergence(reference, skipped)  # [new]
            last_kl[i].append(float(kl[0]))
            mean_kl[i].append(float(kl.mean()))
            agree[i] += float((skipped.argmax(-1) == reference.argmax(-1)).sum())
    return {"zero_ratio": sums.zeros / sums.elements, "block_influence": 1.0 - sums.cos / sums.positions,
            "relative_update_norm": sums.rel / sums.positions,
            "kl_p95": np.array([np.percentile(k, 95) for k in last_kl]),
            "kl_mean": np.array([np.mean(k) for k in mean_kl]), "tf_agreement": agree / positions}


def latency_savings(engine: Engine, ids: torch.Tensor, repeats: int) -> tuple[list[float], float]:
    """Per layer, median decode-step ms with all layers minus median with that layer skipped."""
    if engine.runner is None:
        return [float("nan")] * engine.num_layers, float("nan")
    full = engine.decode_step_timer(ids, NO_SKIP)
    for _ in range(3):
        full()  # warm-up
    savings, all_full = [], []
    for i in progress(list(range(engine.num_layers)), "profile: latency"):
        skip = engine.decode_step_timer(ids, frozenset({i}))
        skip()
        pairs = [(full(), skip()) for _ in range(repeats)]
        all_full += [a for a, _ in pairs]
        savings.append(statistics.median(a for a, _ in pairs) - statistics.median(b for _, b in pairs))
    return savings, statistics.median(all_full)


def run_profile(engine: Engine, prompts: list[Prompt], config: ProfileConfig, out: Path,
                meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Write profile.csv (one row per layer) and profile.json (settings and rows) into `out`."""
    effects = layer_effects(engine, prompts, config.new_tokens)
    savings, decode_ms = latency_savings(engine, prompts[0].render(engine.tokenizer), config.latency_repeats)
    identity = engine.identity
    rows = []
    for i in range(engine.num_layers):
        row: dict[str, Any] = {"layer": i, "class": identity.layers[i].class_name,
                               "fingerprint": identity.layers[i].fingerprint}
        for key in COLUMNS[3:]:
            row[key] = savings[i] if key == "latency_saving_ms" else float(effects[key][i])
        rows.append(row)
    write_csv(out / "profile.csv", rows)
    write_json(out / "profile.json", {**meta, "backend": engine.backend, "num_prompts": len(prompts),
                                       "new_tokens": config.new_tokens, "latency_repeats": config.latency_repeats,
                                       "decode_step_ms_full": decode_ms, "layers": rows})
    return rows
