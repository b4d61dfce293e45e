"""Run by the upstream venv's python (transformers 4.x, tgi_layerskip installed by the patch):

    upstream_tool.py policy <model> <out.json> <layer> [<layer> ...]
        a policy whose one rule (no conditions) bypasses the given layers, with the loaded
        model's fingerprints, so it aligns to the shard's model
    upstream_tool.py reference <model> <policy.json> <max_new_tokens> <prompt> [<prompt> ...]
        per prompt, greedy tokens without and with the policy's plan bypassed (the library's
        own Scheduler.verify_consistency, no KV cache): the lossy shard must match the latter
"""

from __future__ import annotations

import json
import sys

import torch
from tgi_layerskip import IdentityMap, LayerRef, Policy, PolicyRule, Scheduler, save_policy
from transformers import AutoModelForCausalLM, AutoTokenizer


def load(model_path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()


def make_policy(model_path: str, out: str, layers: list[int]) -> None:
    identity = IdentityMap.from_model(load(model_path))
    rule = PolicyRule("mid-layers", (), tuple(LayerRef(i, identity.layers[i].fingerprint) for i in layers))
    save_policy(Policy(identity, (rule,)), out)


def reference(model_path: str, policy: str, max_new_tokens: int, prompts: list[str]) -> None:
    model, tokenizer = load(model_path), AutoTokenizer.from_pretrained(model_path)
    scheduler = Scheduler.from_model(model, policy, "lossy")
    results = []
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        plan = scheduler.plan(ids)
        report = scheduler.verify_consistency(ids, plan, max_new_tokens)
        results.append({"skipped": sorted(plan.skipped), "rule": plan.rule,
                        "full_tokens": list(report.full_tokens), "skip_tokens": list(report.skip_tokens)})
    print(json.dumps(results))


if __name__ == "__main__":
    torch.set_num_threads(2)
    command, args = sys.argv[1], sys.argv[2:]
    if command == "policy":
        make_policy(args[0], args[1], [int(a) for a in args[2:]])
    elif command == "reference":
        reference(args[0], args[1], int(args[2]), args[3:])
    else:
        raise SystemExit(f"unknown command {command!r}")
