"""Verified mode and n-gram speculation against `off`, side by side in one process.

For each model and dtype: per prompt class (HumanEval completion, code editing with the code in
the prompt, chat, long-context summarisation; layerskip_cli/prompt_classes.py) and batch size,
greedy decoding (or, with `--temperature T` [`--top-p P`], seeded sampling, each prompt its own seed) with
- off: plain decoding;
- verified: the shipped policy (`--policy auto`, or a file) with its drafting adapted as served
  (per-cycle draft length, per-rule switch-off, per-request auto-off), n-gram drafts included;
- speculate: upstream's `--speculate N` meaning: n-gram drafts only, every request;
interleaved step by step (each round advances every mode's batch by one decode step; the mode
that goes first rotates per repeat), medians of `--repeats`. Each row reports the
tokens/s ratios, acceptance per drafter and mean draft length and auto-off count (summed over the
repeats), the rules switched off by then, and the cost model
(draft / step and verify(k+1) / step) that explains the ratio. Every run checks that the
tokens equal off's (greedy, and seeded sampling too: speculative/accept.py). JSON in
benchmark/results/layerskip_modes.json.

Usage: PYTHONPATH=benchmark:tests .venv/bin/python benchmark/layerskip_modes.py
       [--models ID,ID] [--dtypes float32,bfloat16] [--quantize FORMAT] [--batches 1,4] [--classes a,b]
       [--repeats 3] [--new-tokens 64] [--prompts-per-class 2] [--threads 2] [--policy auto|FILE] [--speculate 6]
       [--temperature T] [--top-p P]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from common import write_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from text_generation_server.download import download_weights  # noqa: E402
from text_generation_server.engine.batch import CausalLMBatch  # noqa: E402
from text_generation_server.engine.causal_lm import CausalLM  # noqa: E402
from text_generation_server.engine.skip_planner import LayerSkipConfig, SkipPlanner  # noqa: E402
from text_generation_server.layerskip_cli.prompt_classes import CLASSES, build  # noqa: E402
from text_generation_server.layerskip_cli.prompts import _parse_line  # noqa: E402
from text_generation_server.models.loading import LoadConfig, load_model, load_tokenizer  # noqa: E402
from text_generation_server.models.runner import build_runner  # noqa: E402
from text_generation_server.models.shipped_policies import find_shipped_policy  # noqa: E402
from text_generation_server.speculative.controller import SpeculateConfig  # noqa: E402

from factories import make_batch, make_request  # noqa: E402

MODELS = "Qwen/Qwen2.5-Coder-0.5B-Instruct,Qwen/Qwen2.5-Coder-1.5B-Instruct"


def prompt_texts(tokenizer: Any, per_class: int) -> dict[str, list[str]]:
    """Per class, the first `per_class` prompts of the held-out split, as the text a request sends."""
    import json

    out: dict[str, list[str]] = {c: [] for c in CLASSES}
    for n, row in enumerate(build(max(16, 2 * per_class))):  # half of them held out
        prompt = _parse_line(n, json.dumps(row), Path("prompt_classes"))
        if prompt.split != "heldout" or len(out[prompt.category]) >= per_class:
            continue
        if prompt.messages is not None:
            out[prompt.category].append(tokenizer.apply_chat_template(list(prompt.messages), tokenize=False,
                                                                      add_generation_prompt=True))
        else:
            out[prompt.category].append(str(prompt.text))
    return out


class Decoding:
    """One mode's decode of the prompts to the end (EOS ignored), advanced one step at a time;
    its tokens/s counts the time of its own decode steps only (the prefill is not timed).
    Greedy, or with `sampling` (request parameters) seeded sampling (request i has seed i)."""

    def __init__(self, lm: CausalLM, prompts: list[str], new_tokens: int, sampling: dict[str, Any]) -> None:
        requests = [make_request(i, p, new_tokens, ignore_eos=True, seed=i, **sampling)
                    for i, p in enumerate(prompts)]
        self.lm = lm
        self.batch = CausalLMBatch.from_pb(make_batch(1, requests), lm.tokenizer, lm.runner.num_layers,
                                           lm.eos_token_ids, 8192)
        generations, self.current, _ = lm.generate_token(self.batch)
        self.tokens = {g.request_id: list(g.tokens.ids) for g in generations}
        self.seconds, self.steps, self.generated = 0.0, 0, 0

    def step(self) -> None:
        assert self.current is not None
        start = time.perf_counter()
        generations, self.current, _ = self.lm.generate_token(self.current)
        self.seconds += time.perf_counter() - start
        self.steps += 1
        for g in generations:
            self.generated += len(g.tokens.ids)
            self.tokens[g.request_id].extend(g.tokens.ids)

    def result(self) -> dict[str, Any]:
        specs = [s.spec for s in self.batch.requests if s.spec is not None]
        model_drafted, ngram_drafted = sum(s.model.drafted for s in specs), sum(s.ngram.drafted for s in specs)
        return {"tokens_per_s": self.generated / self.seconds, "steps": self.steps, "tokens": self.tokens,
                "generated": self.generated, "model_drafted": model_drafted,
                "model_accepted": sum(s.model.accepted for s in specs), "ngram_drafted": ngram_drafted,
                "ngram_accepted": sum(s.ngram.accepted for s in specs), "cycles": sum(s.cycles for s in specs),
                "auto_off": sum(s.auto_off for s in specs)}


def decode_interleaved(runs: dict[str, CausalLM], order: list[str], prompts: list[str],
                       new_tokens: int, sampling: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every mode's decode of the same prompts, step by step in turn (a round advances each live
    mode by one step, in `order`): a slow phase of the shared machine falls on every mode alike.
    Whole runs one after another spread by +-25% between repeats here, more than the effects
    measured (0.5B code completion at batch 4, nothing drafted: 0.68x, 0.98x and 1.19x off)."""
    decodings = {name: Decoding(runs[name], prompts, new_tokens, sampling) for name in order}
    while any(d.current is not None for d in decodings.values()):
        for d in decodings.values():
            if d.current is not None:
                d.step()
    return {name: d.result() for name, d in decodings.items()}


COUNTS = ("steps", "generated", "model_drafted", "model_accepted", "ngram_drafted", "ngram_accepted", "cycles",
          "auto_off")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of tokens/s; drafting counts summed over the repeats (a rule switched off after the
    first repeat drafts nothing in the last, so the last alone would hide its drafts)."""
    out: dict[str, Any] = {k: sum(r[k] for r in rows) for k in COUNTS}
    out["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in rows)
    out["tokens_per_s_runs"] = [r["tokens_per_s"] for r in rows]
    out["model_drafted_runs"] = [r["model_drafted"] for r in rows]
    for drafter in ("model", "ngram"):
        drafted = out[f"{drafter}_drafted"]
        out[f"{drafter}_acceptance"] = out[f"{drafter}_accepted"] / drafted if drafted else None
    out["mean_draft_length"] = (out["model_drafted"] + out["ngram_drafted"]) / out["cycles"] if out["cycles"] else 0.0
    out["tokens_per_step"] = out["generated"] / max(out["steps"], 1)
    return out


def side_by_side(runs: dict[str, CausalLM], prompts: list[str], new_tokens: int, repeats: int,
                 sampling: dict[str, Any]) -> dict[str, Any]:
    figures: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    names = list(runs)
    for repeat in range(repeats):  # each mode takes each place in a round in turn (no place's bias)
        shift = repeat % len(names)
        for name, result in decode_interleaved(runs, names[shift:] + names[:shift], prompts, new_tokens,
                                               sampling).items():
            figures[name].append(result)
    out: dict[str, Any] = {}
    for name, rows in figures.items():
        summary = summarize(rows)
        summary["identical_to_off"] = all(r["tokens"] == figures["off"][0]["tokens"] for r in rows)
        out[name] = summary
    return out


def model_lms(model_id: str, dtype: str, policy: str, speculate: int,
              quantize: str | None = None) -> tuple[dict[str, CausalLM], str | None]:
    path = download_weights(model_id)
    model = load_model(path, LoadConfig(dtype=dtype, quantize=quantize))
    tokenizer = load_tokenizer(path)
    runner = build_runner(model, "fast")
    found = find_shipped_policy(model) if policy == "auto" else Path(policy)
    eos = frozenset({tokenizer.eos_token_id})

    def lm(mode: str, policy_path: Path | None, speculation: SpeculateConfig | None = None) -> CausalLM:
        planner = SkipPlanner(model, LayerSkipConfig(mode, str(policy_path) if policy_path else None))
        return CausalLM(runner, tokenizer, eos, planner, speculation=speculation)

    lms = {"off": lm("off", None), "verified": lm("verified", found) if found else lm("off", None),
           "speculate": lm("off", None, SpeculateConfig(speculate))}
    cost = lms["verified"].costs()
    for other in ("off", "speculate"):
        lms[other].costs.model = cost  # one measurement serves all (same runner)
    return lms, str(found) if found else None


def _share(figures: dict[str, Any], drafter: str) -> str:
    a = figures[f"{drafter}_acceptance"]
    return f"{'-' if a is None else f'{a:.2f}'} of {figures[f'{drafter}_drafted']}"


def run_model(model_id: str, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    lms, policy = model_lms(model_id, dtype, args.policy, args.speculate, args.quantize)
    cost = lms["verified"].costs()
    texts = prompt_texts(lms["off"].tokenizer, args.prompts_per_class)
    sampling: dict[str, Any] = {}
    if args.temperature is not None:
        sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
    result: dict[str, Any] = {"policy": policy, "cost_model": cost.to_json(), "rows": {}}
    print(f"{model_id} {dtype} {args.quantize or ''}: policy {policy}; verify(k+1)/step "
          f"{[round(v, 2) for v in cost.to_json()['verify_over_step']]}", flush=True)  # type: ignore[union-attr]
    for name in args.classes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = (texts[name] * batch)[:batch]
            r = side_by_side(lms, prompts, args.new_tokens, args.repeats, sampling)
            row = {"off_tps": r["off"]["tokens_per_s"],
                   "verified_ratio": r["verified"]["tokens_per_s"] / r["off"]["tokens_per_s"],
                   "speculate_ratio": r["speculate"]["tokens_per_s"] / r["off"]["tokens_per_s"],
                   "verified": r["verified"], "speculate": r["speculate"], "off": r["off"],
                   "rules_switched_off": sorted(n for n, rec in lms["verified"].controller.rules.items()
                                                if rec.disabled)}
            result["rows"][f"{name}/b{batch}"] = row
            v = r["verified"]
            print(f"  {name:<15} b{batch}: verified {row['verified_ratio']:.2f}x off, speculate "
                  f"{row['speculate_ratio']:.2f}x; model drafts accepted {_share(v, 'model')} (per repeat "
                  f"{v['model_drafted_runs']}), n-gram {_share(v, 'ngram')}, mean draft {v['mean_draft_length']:.1f}, "
                  f"auto-off {v['auto_off']}, rules off {row['rules_switched_off']}, "
                  f"identical {v['identical_to_off'] and r['speculate']['identical_to_off']}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--quantize", default=None, help="bitsandbytes, bitsandbytes-nf4 or bitsandbytes-fp4")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--classes", default=",".join(CLASSES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts-per-class", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--policy", default="auto")
    parser.add_argument("--speculate", type=int, default=6)
    parser.add_argument("--temperature", type=float, default=None,
                        help="sample at this temperature (request i seeded with i) instead of greedy decoding")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling")
    parser.add_argument("--out", default="layerskip_modes",
                        help="results name (benchmark/results/NAME.json) or a path ending in .json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    results: dict[str, Any] = {"args": vars(args), "runs": {}}
    for model_id in args.models.split(","):
        for dtype in args.dtypes.split(","):
            key = f"{model_id}/{dtype}" + (f"/{args.quantize}" if args.quantize else "")
            results["runs"][key] = run_model(model_id, dtype, args)
            gc.collect()  # one model copy at a time (the 1.5B is 7 GB in float32)
            write_results(args.out, results)


if __name__ == "__main__":
    main()
