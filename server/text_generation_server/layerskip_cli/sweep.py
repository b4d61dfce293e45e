"""`layerskip sweep`: a grid of detector thresholds x nested skip sets, and the detector's honesty.

Candidate skip sets are nested: S_k = the k layers ranked safest by the profile (protected
first and last layers excluded), k = 1..K. A cell (a, b, k) is the one-rule policy
"max_score < a and mean_score < b -> skip S_k, else skip nothing". Its figures follow from
per-prompt trials (each prompt measured once under every S_k): a prompt that the rule does
not select runs the full model and trivially matches `off`.

Detector honesty: per prompt, the safe skip depth is the largest k such that S_1..S_k all
keep the greedy output equal to off's. The report gives the Spearman rank correlation of
each detector feature with that depth, and says plainly when the scores do not predict it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .engine import Skip
from .output import read_csv, spearman
from .trials import PromptTrial

RANK_BY = ("kl_p95", "kl_mean", "block_influence", "tf_agreement")
PREDICTIVE_RHO = 0.3  # |rho| below this is reported as "does not predict"


@dataclass(frozen=True)
class Cell:
    """One grid cell's figures (see module docstring)."""

    max_score_below: float
    mean_score_below: float
    k: int
    share_selected: float
    mean_layers_skipped: float
    skip_rate: float
    consistency: float
    tf_agreement: float

    def to_row(self) -> dict[str, Any]:
        return dict(vars(self))


def skip_order(profile_csv: Path, rank_by: str, num_layers: int) -> list[int]:
    """Layers from safest to riskiest by a profile column, the first and last layer excluded."""
    if rank_by not in RANK_BY:
        raise ValueError(f"--rank-by {rank_by} is not known; use one of {', '.join(RANK_BY)}")
    rows = read_csv(profile_csv)
    if len(rows) != num_layers:
        raise ValueError(f"{profile_csv} has {len(rows)} rows, the model {num_layers} layers")
    sign = -1.0 if rank_by == "tf_agreement" else 1.0  # high agreement is safe, high drift is not
    usable = [r for r in rows if 0 < int(r["layer"]) < num_layers - 1]
    return [int(r["layer"]) for r in sorted(usable, key=lambda r: sign * float(r[rank_by]))]


def nested_sets(order: list[int], max_k: int) -> list[Skip]:
    return [frozenset(order[:k]) for k in range(1, min(max_k, len(order)) + 1)]


def thresholds(values: list[float], num: int) -> list[float]:
    """`num` thresholds: quantile cut points of `values`, the last one above every value."""
    qs = np.quantile(np.asarray(values), np.linspace(0.0, 1.0, num)[1:]) if len(values) > 1 else np.asarray(values)
    cuts = sorted({float(q) for q in qs})
    top = max(values) + 1e-9
    return sorted({*(c for c in cuts if c < top), top * (1 + 1e-9) + 1e-9})


def evaluate(trials: list[PromptTrial], a: float, b: float, k: int, num_layers: int) -> Cell:
    """The figures of cell (a, b, k) over `trials`."""
    selected = [t for t in trials if t.scores.max_score < a and t.scores.mean_score < b]
    chosen = {t.prompt.id for t in selected}
    exact = [t.outcomes[k].exact if t.prompt.id in chosen else True for t in trials]
    agree = [t.outcomes[k].tf_agreement if t.prompt.id in chosen else 1.0 for t in trials]
    share = len(selected) / len(trials)
    return Cell(a, b, k, share, share * k, share * k / num_layers, float(np.mean(exact)), float(np.mean(agree)))


def grid(trials: list[PromptTrial], num_thresholds: int, max_k: int, num_layers: int) -> list[Cell]:
    xs = thresholds([t.scores.max_score for t in trials], num_thresholds)
    ys = thresholds([t.scores.mean_score for t in trials], num_thresholds)
    return [evaluate(trials, a, b, k, num_layers) for k in range(1, max_k + 1) for a in xs for b in ys]


def choose(cells: list[Cell], target: float) -> Cell | None:
    """The cell with the most layers skipped on average whose consistency meets `target` (None: none skips)."""
    ok = [c for c in cells if c.consistency >= target and c.mean_layers_skipped > 0]
    if not ok:
        return None
    return max(ok, key=lambda c: (round(c.mean_layers_skipped, 9), c.consistency, c.tf_agreement,
                                  -c.max_score_below, -c.mean_score_below))


def honesty(trials: list[PromptTrial]) -> dict[str, Any]:
    """Spearman rho of each detector feature against the safe skip depth, and a plain verdict."""
    depths = [float(t.safe_depth) for t in trials]
    rhos = {name: spearman([t.scores.as_dict()[name] for t in trials], depths)
            for name in ("max_score", "mean_score", "num_tokens", "spectral_entropy", "kurtosis")}
    histogram = {str(d): depths.count(float(d)) for d in sorted(set(int(x) for x in depths))}
    finite = {k: v for k, v in rhos.items() if not math.isnan(v)}
    if not finite:
        verdict = (f"The safe skip depth is the same for every prompt ({histogram}), so no detector score can "
                   "predict it: the detector does not tell safe prompts from unsafe ones on this data.")
    elif max(abs(v) for v in finite.values()) < PREDICTIVE_RHO:
        verdict = (f"The detector scores do not predict the safe skip depth: every |rho| < {PREDICTIVE_RHO} "
                   f"(best {max(finite, key=lambda k: abs(finite[k]))} = "
                   f"{max(finite.values(), key=abs):+.2f}).")
    else:
        best = max(finite, key=lambda k: abs(finite[k]))
        verdict = (f"{best} has rank correlation {finite[best]:+.2f} with the safe skip depth "
                   f"({len(trials)} prompts); a weak-to-moderate signal, not a guarantee.")
    return {"spearman": rhos, "safe_depth_histogram": histogram, "verdict": verdict}


def distinct_labels(values: list[float]) -> list[str]:
    """Tick labels with just enough significant digits that no two thresholds read the same."""
    for digits in range(3, 10):
        labels = [f"{v:.{digits}g}" for v in values]
        if len(set(labels)) == len(labels):
            return labels
    return [repr(v) for v in values]


def heatmap(cells: list[Cell], chosen: Cell | None, target: float, path: Path) -> Path:
    """One panel per k: x max_score threshold, y mean_score threshold, colour consistency; each cell
    is annotated with its consistency, skip rate and mean layers skipped (a cell of 1.0 that skips
    nothing reads as such)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({c.k for c in cells})
    fig, axes = plt.subplots(1, len(ks), figsize=(4.2 * len(ks) + 1, 4.2), squeeze=False)
    image = None
    for ax, k in zip(axes[0], ks, strict=True):
        sub = [c for c in cells if c.k == k]
        xs = sorted({c.max_score_below for c in sub})
        ys = sorted({c.mean_score_below for c in sub})
        z = np.full((len(ys), len(xs)), np.nan)
        for c in sub:
            z[ys.index(c.mean_score_below), xs.index(c.max_score_below)] = c.consistency
        image = ax.imshow(z, origin="lower", vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        for c in sub:
            ax.text(xs.index(c.max_score_below), ys.index(c.mean_score_below),
                    f"{c.consistency:.2f}\n{100 * c.skip_rate:.0f}%\n{c.mean_layers_skipped:.1f}L",
                    ha="center", va="center", fontsize=4.5, color="white" if c.consistency < 0.6 else "black")
        for c in sub:
            if c.consistency >= target and c.mean_layers_skipped > 0:  # the plateau that meets the target
                ax.add_patch(plt.Rectangle((xs.index(c.max_score_below) - 0.5, ys.index(c.mean_score_below) - 0.5),
                                           1, 1, fill=False, edgecolor="white", linewidth=1.5))
        if chosen is not None and chosen.k == k:
            ax.plot(xs.index(chosen.max_score_below), ys.index(chosen.mean_score_below), "r*", markersize=14)
        ax.set_xticks(range(len(xs)), distinct_labels(xs), rotation=60, fontsize=7)
        ax.set_yticks(range(len(ys)), distinct_labels(ys) if k == ks[0] else [""] * len(ys), fontsize=7)
        ax.set_title(f"skip {k} layer{'s' if k > 1 else ''}", fontsize=9)
        ax.set_xlabel("max_score <", fontsize=8)
    axes[0][0].set_ylabel("mean_score <", fontsize=8)
    title = (f"greedy exact match vs off (cells: consistency, skip rate, mean layers skipped; white: >= "
             f"{target:g}; star: chosen)" if chosen is not None
             else f"greedy exact match vs off: no cell that skips reaches {target:g}")
    fig.suptitle(title, fontsize=10)
    if image is not None:
        fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="consistency")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def step_savings(profile_csv: Path, skip_sets: list[Skip]) -> dict[int, float]:
    """Per skip depth k, the profile's measured latency saving of S_k as a share of all layers' savings."""
    rows = {int(r["layer"]): max(float(r["latency_saving_ms"]), 0.0) for r in read_csv(profile_csv)}
    total = sum(rows.values()) or 1.0
    return {k: sum(rows.get(i, 0.0) for i in skip) / total for k, skip in enumerate(skip_sets, 1)}


def frontier(cells: list[Cell], layer_saving: dict[int, float], path: Path) -> Path:
    """Best consistency per skip depth against the decode-step share it saves (profile latency)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({c.k for c in cells})
    best = [max((c for c in cells if c.k == k and c.mean_layers_skipped > 0), key=lambda c: c.consistency,
                default=None) for k in ks]
    points = [(layer_saving.get(k, 0.0) * c.share_selected, c.consistency, k) for k, c in zip(ks, best, strict=True)
              if c is not None]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o")
    for x, y, k in points:
        ax.annotate(f"k={k}", (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("saved share of the layers' decode time (profile latency x share selected)")
    ax.set_ylabel("best greedy consistency")
    ax.set_title("lossy frontier: consistency vs saved step time", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
