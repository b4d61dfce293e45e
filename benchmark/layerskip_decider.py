"""Cost of planning (detector + decider) against the prefill it rides on, and fingerprint cost.

For prompts of 16, 128 and 512 tokens of the default model (float32, fixed threads):
- decider: RuleTable.decide on precomputed scores (a 4-rule table plus default), p50/p99;
- detector: detect() on the prompt's input embeddings, p50/p99;
- embed: the input-embedding lookup (the shard does it anyway; reported separately);
- prefill: one full forward over the prompt, median; measured interleaved with the planning
  runs (A B A B), so the ratio compares like with like on a shared machine.
Goals (issue 8): decider p99 < 0.1 ms; detector + decider < 1% of the same prompt's prefill.

Also: identity-map (fingerprint) cost per quantization, and the fingerprint distances within
a layer across quantizations and between layers, which justify the matching tolerance.

Usage: python benchmark/layerskip_decider.py [--threads 2] [--repeats 5] [--quantizations float32,nf4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np
import torch

from text_generation_server.download import DEFAULT_MODEL_ID, download_weights
from text_generation_server.layerskip import Condition, DetectorConfig, IdentityMap, Rule, RuleTable, detect
from text_generation_server.layerskip.fingerprint import distance_matrix
from text_generation_server.models.loading import LoadConfig, load_model, load_tokenizer

from common import write_results

LENGTHS = (16, 128, 512)
QUANTIZATIONS = {"float32": LoadConfig(), "bfloat16": LoadConfig(dtype="bfloat16"),
                 "int8": LoadConfig(quantize="bitsandbytes"), "nf4": LoadConfig(quantize="bitsandbytes-nf4"),
                 "fp4": LoadConfig(quantize="bitsandbytes-fp4")}
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps aloud. "
        "Ships passed in the dark, and the lamp turned, and the sea kept its own time. ") * 40


def rule_table(num_layers: int) -> RuleTable:
    """A table like a calibrated one: four rules of one or two conditions, then the default."""
    return RuleTable((
        Rule("long", (Condition("num_tokens", ">=", 1024),), frozenset({12})),
        Rule("spiky", (Condition("kurtosis", ">", 6.0), Condition("max_score", ">", 1.4)), frozenset()),
        Rule("calm", (Condition("max_score", "<", 1.2), Condition("spectral_entropy", ">", 0.5)),
             frozenset({9, 17})),
        Rule("flat", (Condition("mean_score", "<", 0.3),), frozenset({9, 12, 17})),
    ), Rule("default", (), frozenset({17})), num_layers)


def percentiles_ms(samples_ns: list[int]) -> dict[str, float]:
    values = np.array(samples_ns) / 1e6
    return {"p50_ms": float(np.percentile(values, 50)), "p99_ms": float(np.percentile(values, 99)),
            "n": int(len(values))}


def time_ns(fn: Any, count: int) -> list[int]:
    out = []
    for _ in range(count):
        start = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - start)
    return out


def measure_length(model: Any, ids: torch.Tensor, table: RuleTable, repeats: int) -> dict[str, Any]:
    embedding = model.get_input_embeddings()
    config = DetectorConfig()
    with torch.no_grad():
        embeds = embedding(ids.unsqueeze(0))[0]  # [seq, hidden]
    scores = detect(embeds, config)
    decider_ns: list[int] = []
    detector_ns: list[int] = []
    embed_ns: list[int] = []
    plan_ns: list[int] = []
    prefill_s: list[float] = []
    with torch.no_grad():
        model(input_ids=ids.unsqueeze(0), use_cache=False)  # warm-up
        for _ in range(repeats):  # A B A B: prefill, then the planning runs
            start = time.perf_counter()
            model(input_ids=ids.unsqueeze(0), use_cache=False)
            prefill_s.append(time.perf_counter() - start)
            decider_ns += time_ns(lambda: table.decide(scores, "lossy"), 400)
            detector_ns += time_ns(lambda: detect(embeds, config), 40)
            embed_ns += time_ns(lambda: embedding(ids.unsqueeze(0)), 40)
            plan_ns += time_ns(lambda: table.decide(detect(embeds, config), "lossy"), 40)
    prefill_ms = statistics.median(prefill_s) * 1e3
    plan = percentiles_ms(plan_ns)
    return {"tokens": int(ids.shape[0]), "prefill_ms_median": prefill_ms,
            "prefill_ms_runs": [s * 1e3 for s in prefill_s],
            "decider": percentiles_ms(decider_ns), "detector": percentiles_ms(detector_ns),
            "embed": percentiles_ms(embed_ns), "detector_plus_decider": plan,
            "plan_p50_pct_of_prefill": 100 * plan["p50_ms"] / prefill_ms,
            "plan_p99_pct_of_prefill": 100 * plan["p99_ms"] / prefill_ms,
            "rule": table.decide(scores, "lossy").rule, "scores": scores.as_dict()}


def fingerprints(names: list[str]) -> dict[str, Any]:
    path = download_weights(DEFAULT_MODEL_ID)
    identities: dict[str, IdentityMap] = {}
    cost: dict[str, float] = {}
    for name in names:
        model = load_model(path, QUANTIZATIONS[name])
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            identities[name] = IdentityMap.from_model(model)
            runs.append(time.perf_counter() - start)
        cost[name] = statistics.median(runs)
        del model
    reference = [layer.fingerprint for layer in identities[names[0]].layers]
    distances = {}
    for name, identity in identities.items():
        dist = distance_matrix(reference, [layer.fingerprint for layer in identity.layers])
        off = dist[~np.eye(len(reference), dtype=bool)]
        distances[name] = {"same_layer_max": float(np.diag(dist).max()), "same_layer_mean": float(np.diag(dist).mean()),
                           "other_layers_min": float(off.min()), "other_layers_mean": float(off.mean())}
    return {"reference": names[0], "identity_map_seconds_median": cost, "distances_to_reference": distances,
            "max_distance": identities[names[0]].fingerprint.max_distance,
            "bits_per_layer": len(bytes.fromhex(reference[0].split(":")[1])) * 8}


def print_table(rows: list[dict[str, Any]], prints: dict[str, Any]) -> None:
    print(f"\n{'tokens':>6} {'prefill ms':>10} {'decider p50/p99 ms':>20} {'detector p50/p99 ms':>21} "
          f"{'det+dec p99 ms':>14} {'% of prefill p50/p99':>21}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['prefill_ms_median']:>10.1f} "
              f"{r['decider']['p50_ms']:>9.4f}/{r['decider']['p99_ms']:<10.4f} "
              f"{r['detector']['p50_ms']:>9.3f}/{r['detector']['p99_ms']:<11.3f} "
              f"{r['detector_plus_decider']['p99_ms']:>14.3f} "
              f"{r['plan_p50_pct_of_prefill']:>9.3f}/{r['plan_p99_pct_of_prefill']:<9.3f}")
    print(f"\nfingerprints ({prints['bits_per_layer']} bits/layer, match if distance <= {prints['max_distance']}):")
    for name, d in prints["distances_to_reference"].items():
        print(f"  {name:9s} identity map {prints['identity_map_seconds_median'][name]:.3f} s | same layer max "
              f"{d['same_layer_max']:.4f} | other layers min {d['other_layers_min']:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quantizations", default=",".join(QUANTIZATIONS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    path = download_weights(DEFAULT_MODEL_ID)
    model = load_model(path, LoadConfig())
    all_ids = load_tokenizer(path)(TEXT, return_tensors="pt").input_ids[0]
    table = rule_table(int(model.config.num_hidden_layers))
    rows = [measure_length(model, all_ids[:n], table, args.repeats) for n in LENGTHS]
    del model
    prints = fingerprints(args.quantizations.split(","))
    print_table(rows, prints)
    # A shared machine: the 1-minute load average says how far absolute times are inflated.
    load = {"before": load_before, "after": os.getloadavg()[0], "cpus": os.cpu_count()}
    print(f"load average before/after: {load['before']:.1f}/{load['after']:.1f} on {load['cpus']} cpus")
    write_results("layerskip_decider", {"model": DEFAULT_MODEL_ID, "threads": args.threads, "dtype": "float32",
                                        "load_average": load, "lengths": rows, "fingerprints": prints})


if __name__ == "__main__":
    main()
