"""Layer-skip modes against `off` on the default 135M model (lossy step time, verified drafting),
side by side in one process (interleaved, median of repeats).

- lossy: decode step time and KV-cache bytes with the policy's layers bypassed vs off;
- verified: decode tokens/s vs off at batch 1 and batch 4 for each prompt class, with the
  acceptance rate, mean draft length and auto-off count (auto-off on, as served), plus the
  measured cost model that explains the result.

Usage: PYTHONPATH=benchmark:tests .venv/bin/python benchmark/layerskip_smollm.py [--repeats 5]
       [--new-tokens 64] [--threads 2] [--skip 4,7,14,18,21,24]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from common import write_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from text_generation_server.download import DEFAULT_MODEL_ID, download_weights  # noqa: E402
from text_generation_server.engine.batch import CausalLMBatch  # noqa: E402
from text_generation_server.engine.causal_lm import CausalLM  # noqa: E402
from text_generation_server.engine.skip_planner import LayerSkipConfig, SkipPlanner  # noqa: E402
from text_generation_server.models.loading import LoadConfig, load_model, load_tokenizer  # noqa: E402
from text_generation_server.models.runner import build_runner  # noqa: E402

from factories import make_batch, make_request  # noqa: E402
from policies import write_policy  # noqa: E402
from prompt_sets import CLASSES, chat_text  # noqa: E402


def make_lm(path: Path, model: torch.nn.Module, mode: str, policy: Path | None) -> CausalLM:
    tokenizer = load_tokenizer(path)
    planner = SkipPlanner(model, LayerSkipConfig(mode, str(policy) if policy else None))
    return CausalLM(build_runner(model, "fast"), tokenizer, frozenset({tokenizer.eos_token_id}), planner)


def decode(lm: CausalLM, prompts: list[str], new_tokens: int) -> dict[str, float]:
    """Prefill, then decode to the end (EOS ignored); decode tokens/s, step ms, KV bytes, drafting stats."""
    requests = [make_request(i, p, new_tokens, ignore_eos=True) for i, p in enumerate(prompts)]
    batch = CausalLMBatch.from_pb(make_batch(1, requests), lm.tokenizer, lm.runner.num_layers, lm.eos_token_ids, 4096)
    _, current, _ = lm.generate_token(batch)
    start, steps, tokens, kv_bytes = time.perf_counter(), 0, 0, 0
    while current is not None:
        kv_bytes = max(kv_bytes, sum(g.cache.nbytes() for g in current.groups))
        generations, current, _ = lm.generate_token(current)
        steps += 1
        tokens += sum(len(g.tokens.ids) for g in generations)
    seconds = time.perf_counter() - start
    specs = [s.spec for s in batch.requests if s.spec is not None]
    drafted = sum(s.drafted for s in specs)
    return {"tokens_per_s": tokens / seconds, "step_ms": 1000 * seconds / max(steps, 1), "kv_bytes": kv_bytes,
            "acceptance": sum(s.accepted for s in specs) / drafted if drafted else 0.0,
            "mean_draft_length": drafted / max(sum(s.cycles for s in specs), 1),
            "auto_off": sum(s.auto_off for s in specs)}


def side_by_side(runs: dict[str, CausalLM], prompts: list[str], new_tokens: int, repeats: int) -> dict[str, dict]:
    figures: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, lm in runs.items():
            figures[name].append(decode(lm, prompts, new_tokens))
    return {name: {key: statistics.median(f[key] for f in runs_) for key in runs_[0]}
            for name, runs_ in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", default="4,7,14,18,21,24")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    skip = frozenset(int(i) for i in args.skip.split(","))
    path = download_weights(DEFAULT_MODEL_ID)
    model = load_model(path, LoadConfig())
    policy = write_policy(model, Path("/tmp/layerskip-bench-policy.json"), skip)
    off, lossy, verified = (make_lm(path, model, m, p) for m, p in (("off", None), ("lossy", policy),
                                                                     ("verified", policy)))
    forced = make_lm(path, model, "verified", policy)
    forced.auto_off = False
    cost = verified.costs()
    forced.costs.model = cost
    results: dict[str, object] = {"skip": sorted(skip), "threads": args.threads, "new_tokens": args.new_tokens,
                                  "cost_model": {"step_ms": cost.step_s * 1000,
                                                 "verify_ms": [t * 1000 for t in cost.verify_s],
                                                 "layer_ms": cost.layer_s * 1000}}
    prompt = chat_text(off.tokenizer, CLASSES["chat"][0])
    lossy_vs_off = side_by_side({"off": off, "lossy": lossy}, [prompt], args.new_tokens, args.repeats)
    step_ratio = lossy_vs_off["lossy"]["step_ms"] / lossy_vs_off["off"]["step_ms"]
    kv_ratio = lossy_vs_off["lossy"]["kv_bytes"] / lossy_vs_off["off"]["kv_bytes"]
    results["lossy"] = {**lossy_vs_off, "step_time_ratio": step_ratio, "kv_bytes_ratio": kv_ratio}
    print(f"lossy ({len(skip)} of 30 layers): step {step_ratio:.2f}x off, KV bytes {kv_ratio:.2f}x off", flush=True)
    verified_rows = {}
    for name, prompts in CLASSES.items():
        for batch in (1, 4):
            texts = [chat_text(off.tokenizer, p) for p in (prompts * 4)[:batch]]
            r = side_by_side({"off": off, "verified": verified, "verified_forced": forced}, texts,
                             args.new_tokens, args.repeats)
            row = {"off_tps": r["off"]["tokens_per_s"], "verified_tps": r["verified"]["tokens_per_s"],
                   "ratio": r["verified"]["tokens_per_s"] / r["off"]["tokens_per_s"],
                   "forced_ratio": r["verified_forced"]["tokens_per_s"] / r["off"]["tokens_per_s"],
                   "acceptance": r["verified_forced"]["acceptance"],
                   "mean_draft_length": r["verified_forced"]["mean_draft_length"],
                   "auto_off": r["verified"]["auto_off"]}
            verified_rows[f"{name}/b{batch}"] = row
            print(f"verified {name:<9} b{batch}: {row['ratio']:.2f}x off (forced drafting {row['forced_ratio']:.2f}x), "
                  f"acceptance {row['acceptance']:.2f}, mean k {row['mean_draft_length']:.1f}, "
                  f"auto-off {row['auto_off']:.0f}", flush=True)
    results["verified"] = verified_rows
    write_results("layerskip_smollm", results)


if __name__ == "__main__":
    main()
