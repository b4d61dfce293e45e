"""Verified mode over bitsandbytes weights: token for token what `off` gives, on many prompts.

For each `--quantize` format of the model: `--per-class` held-out prompts of each prompt class
(layerskip_cli/prompt_classes.py: code completion, code editing, chat, summarisation; 16 a class
by default: 64 prompts), decoded with the shipped policy and drafting forced on every step
(auto-off disabled), compared with mode `off`:
- alone: each prompt greedy, by itself, in both modes;
- mixed batches of `--batch` prompts: rows alternate verified / `off` / `shadow` modes and
  greedy / seeded sampling (temperature 0.7, seed = prompt number); the same batch in mode `off`
  is the reference (a row's arithmetic never depends on the other rows, but a prompt left-padded
  beside longer ones prefills over more attention columns, so its prefill alone can differ).
And against bitsandbytes' own modules (the transformers runner: dequantize-then-matmul for 4-bit,
its LLM.int8() with batch-wide outlier columns) on the first `--reference` prompts alone: max
|logits| difference of the prompt's last position, and greedy agreement.
With TGI_QUANTIZED_ACTIVATIONS=int8 in the environment the 4-bit formats run on int8 activations
(recorded in the results).

Usage: PYTHONPATH=benchmark:tests .venv/bin/python benchmark/quantized_exactness.py
       [--model ID] [--quantize bitsandbytes-nf4,bitsandbytes] [--per-class 16] [--batch 8]
       [--new-tokens 48] [--reference 8] [--out quantized_exactness]
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings
from typing import Any

import torch
from layerskip_modes import model_lms, prompt_texts

from text_generation_server.download import download_weights
from text_generation_server.engine.batch import CausalLMBatch
from text_generation_server.engine.causal_lm import CausalLM
from text_generation_server.engine.skip_planner import LayerSkipConfig, SkipPlanner
from text_generation_server.env import process_env
from text_generation_server.models.loading import LoadConfig, load_model
from text_generation_server.models.runner import build_runner
from text_generation_server.models.runner.base import ForwardInputs

from common import write_results
from factories import decode_in_process, make_batch, make_request


def decode(lm: CausalLM, requests: list[Any]) -> tuple[dict[int, list[int]], int, int]:
    """Tokens per request id, and the drafts made and accepted."""
    batch = CausalLMBatch.from_pb(make_batch(1, requests), lm.tokenizer, lm.runner.num_layers, lm.eos_token_ids,
                                  8192)
    out = decode_in_process(lm, batch)
    assert not out.errors, out.errors
    drafted = sum(int(r.stats.get("drafted", 0)) for r in out.reports.values())  # type: ignore[attr-defined]
    accepted = sum(int(r.stats.get("accepted", 0)) for r in out.reports.values())  # type: ignore[attr-defined]
    return out.tokens, drafted, accepted


def mixed_requests(prompts: dict[int, str], new_tokens: int) -> list[Any]:
    requests = []
    for n, (i, text) in enumerate(prompts.items()):
        sampling = {"do_sample": True, "temperature": 0.7, "seed": i} if n % 2 else {}
        r = make_request(i, text, new_tokens, **sampling)  # type: ignore[arg-type]
        r.layer_skip_mode = ("", "", "off", "shadow")[n % 4]  # "": the server's mode (verified)
        requests.append(r)
    return requests


def against_bitsandbytes(lm: CausalLM, model_id: str, quantize: str, prompts: dict[int, str],
                         new_tokens: int) -> dict[str, Any]:
    """Ours (mode off) against the model loaded again on the transformers runner, whose products
    are bitsandbytes' own."""
    model = load_model(download_weights(model_id), LoadConfig(quantize=quantize))
    reference = CausalLM(build_runner(model, "transformers"), lm.tokenizer, lm.eos_token_ids,
                         SkipPlanner(model, LayerSkipConfig("off", None)))
    differences, agree, tokens = [], 0, 0
    for i, text in prompts.items():
        ids = torch.tensor([lm.tokenizer(text)["input_ids"]])
        logits = [runner.forward(ForwardInputs.contiguous(ids), runner.new_cache(1))[0, -1]
                  for runner in (lm.runner, reference.runner)]
        differences.append(float((logits[0] - logits[1]).abs().max()))
        ours, _, _ = decode(lm, [make_request(i, text, new_tokens)])
        theirs, _, _ = decode(reference, [make_request(i, text, new_tokens)])
        same = next((n for n, (a, b) in enumerate(zip(ours[i], theirs[i], strict=False)) if a != b), len(ours[i]))
        agree += same
        tokens += len(ours[i])
    return {"prompts": len(prompts), "max_logit_difference": max(differences), "logit_differences": differences,
            "greedy_tokens_before_first_difference": agree, "greedy_tokens": tokens}


def run_format(model_id: str, quantize: str, args: argparse.Namespace) -> dict[str, Any]:
    lms, policy = model_lms(model_id, "float32", "auto", 6, quantize)
    if policy is None:
        raise SystemExit(f"no shipped policy aligns to {model_id}: verified mode would run as off")
    off, verified = lms["off"], lms["verified"]
    verified.auto_off = False  # every step a draft-verify cycle
    texts = prompt_texts(off.tokenizer, args.per_class)
    prompts = dict(enumerate(t for ts in texts.values() for t in ts))
    result: dict[str, Any] = {"policy": policy, "prompts": len(prompts), "new_tokens": args.new_tokens}
    start = time.perf_counter()
    alone_diverged, drafted, accepted = [], 0, 0
    for i, text in prompts.items():
        expected, _, _ = decode(off, [make_request(i, text, args.new_tokens)])
        got, d, a = decode(verified, [make_request(i, text, args.new_tokens)])
        drafted, accepted = drafted + d, accepted + a
        if got != expected:
            alone_diverged.append(i)
    result["alone"] = {"identical": len(prompts) - len(alone_diverged), "diverged": alone_diverged,
                       "drafted": drafted, "accepted": accepted}
    print(f"{model_id} {quantize} ({policy}): alone {len(prompts) - len(alone_diverged)}/{len(prompts)} identical, "
          f"{accepted} of {drafted} drafts accepted ({time.perf_counter() - start:.0f} s)", flush=True)
    batch_diverged, drafted, accepted = [], 0, 0
    ids = list(prompts)
    for b in range(0, len(ids), args.batch):
        requests = mixed_requests({i: prompts[i] for i in ids[b: b + args.batch]}, args.new_tokens)
        expected, _, _ = decode(off, requests)
        got, d, a = decode(verified, requests)
        drafted, accepted = drafted + d, accepted + a
        batch_diverged += [i for i in got if got[i] != expected[i]]
    result["mixed_batches"] = {"batch": args.batch, "identical": len(prompts) - len(batch_diverged),
                               "diverged": batch_diverged, "drafted": drafted, "accepted": accepted}
    print(f"  mixed batches of {args.batch}: {len(prompts) - len(batch_diverged)}/{len(prompts)} identical "
          f"(half seeded sampling), {accepted} of {drafted} drafts accepted "
          f"({time.perf_counter() - start:.0f} s)", flush=True)
    if args.reference:
        first = dict(list(prompts.items())[:: max(1, len(prompts) // args.reference)][: args.reference])
        result["against_bitsandbytes"] = r = against_bitsandbytes(off, model_id, quantize, first, args.new_tokens)
        print(f"  against bitsandbytes' own products ({r['prompts']} prompts alone): max |logit difference| "
              f"{r['max_logit_difference']:.2e}, greedy tokens before the first difference "
              f"{r['greedy_tokens_before_first_difference']} of {r['greedy_tokens']}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
    parser.add_argument("--quantize", default="bitsandbytes-nf4,bitsandbytes")
    parser.add_argument("--per-class", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--reference", type=int, default=8, help="prompts compared with bitsandbytes' own products")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="quantized_exactness",
                        help="results name (benchmark/results/NAME.json) or a path ending in .json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    warnings.filterwarnings("ignore", message="MatMul8bitLt")  # bitsandbytes' reference, each product
    results: dict[str, Any] = {"args": vars(args), "formats": {},
                               "quantized_activations": process_env().kernels.quantized_activations}
    for quantize in args.quantize.split(","):
        results["formats"][quantize] = run_format(args.model, quantize, args)
        gc.collect()
        write_results(args.out, results)


if __name__ == "__main__":
    main()
