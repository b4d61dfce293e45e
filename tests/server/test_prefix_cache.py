"""The prefix cache: the radix store alone, then on the real default model, where a prompt
whose prefix was cached must give the tokens it gives with caching off (multi-turn chats,
a shared system prompt in one cold batch, prompts diverging inside an edge, an evicted
prefix, a prompt cached whole, seeded sampling, verified and lossy mode)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_layer_skip_shard import make_lm

from text_generation_server.engine.batch import CausalLMBatch
from text_generation_server.engine.causal_lm import CausalLM, shared_prefixes
from text_generation_server.engine.prefix_cache import PrefixCache
from text_generation_server.pb import generate_pb2

from factories import Decoded, decode_in_process, make_batch, make_request
from policies import SIX_LAYERS, write_policy
from prompt_sets import LONG, chat_text

NONE: frozenset[int] = frozenset()


def kv_of(tokens: list[int], layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Fake per-layer KV `[1 head, n, 2]` whose values encode (token, layer): checkable after splits."""
    t = torch.tensor(tokens, dtype=torch.float32)
    return [(torch.stack([t, t + i], -1)[None], -torch.stack([t, t + i], -1)[None]) for i in range(layers)]


def test_lookup_returns_the_longest_prefix_short_of_the_last_token() -> None:
    cache = PrefixCache(1 << 20)
    seq = list(range(100, 140))
    cache.insert(NONE, seq, kv_of(seq))
    hit = cache.lookup(NONE, seq)  # the whole prompt is cached: its last token runs again
    assert hit is not None and hit.length == 39
    assert torch.equal(hit.layers[1][0], kv_of(seq[:39])[1][0])  # type: ignore[index]
    assert cache.lookup(NONE, [1, 2, 3]) is None
    assert cache.lookup(frozenset({3}), seq) is None  # another skip set's tree
    longer = cache.lookup(NONE, seq + [7, 8])
    assert longer is not None and longer.length == 40


def test_divergence_inside_an_edge_splits_it_and_stores_the_shared_part_once() -> None:
    cache = PrefixCache(1 << 20)
    a = list(range(50))
    b = a[:37] + [999] * 20
    cache.insert(NONE, a, kv_of(a))
    cache.insert(NONE, b, kv_of(b))
    assert cache.tokens == 50 + 20  # 37 shared, 13 + 20 apart
    for seq in (a, b):
        hit = cache.lookup(NONE, seq + [0])
        assert hit is not None and hit.length == len(seq)
        assert torch.equal(hit.layers[0][1], kv_of(seq)[0][1])  # type: ignore[index]
    c = a[:20] + [5, 5, 5]
    hit = cache.lookup(NONE, c)
    assert hit is not None and hit.length == 20


def test_least_recently_used_leaves_are_evicted_first() -> None:
    per_token = kv_of([1])
    token_bytes = sum(t.numel() * t.element_size() for kv in per_token if kv is not None for t in kv)
    cache = PrefixCache(100 * token_bytes)
    shared = list(range(40))
    old, recent = shared + [1000 + i for i in range(30)], shared + [2000 + i for i in range(30)]
    cache.insert(NONE, old, kv_of(old))
    cache.insert(NONE, recent, kv_of(recent))
    assert cache.tokens == 100
    assert cache.lookup(NONE, old + [0]) is not None and cache.lookup(NONE, recent + [0]) is not None
    third = [3000 + i for i in range(30)]
    cache.insert(NONE, third, kv_of(third))  # over budget: `old`'s tail was used least recently
    assert cache.nbytes <= cache.max_bytes and cache.stats.evicted_tokens == 30
    hit = cache.lookup(NONE, old + [0])
    assert hit is not None and hit.length == 40  # the shared prefix stays
    assert cache.lookup(NONE, recent + [0]).length == 70  # type: ignore[union-attr]


def test_shared_prefixes_of_a_batch() -> None:
    doc = list(range(100))
    prompts = [doc + [1, 2], doc + [3], doc[:80] + [9] * 10, list(range(500, 520))]
    assert shared_prefixes(prompts) == [doc]  # doc[:80] is a prefix of doc
    assert shared_prefixes([doc, list(doc)]) == [doc[:99]]  # one prompt twice: all but its last token
    assert shared_prefixes([doc[:10] + [1], doc[:10] + [2]]) == []  # too short to be worth a forward


# --- on the real default model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(model_path: Path) -> torch.nn.Module:
    from text_generation_server.models.loading import LoadConfig, load_model

    return load_model(model_path, LoadConfig())


@pytest.fixture(scope="module")
def off_lm(model_path: Path, hf_model: torch.nn.Module) -> CausalLM:
    return make_lm(model_path, hf_model, "off", None)


def generate(lm: CausalLM, requests: list[generate_pb2.Request], prefixes: PrefixCache | None) -> Decoded:
    lm.prefixes = prefixes
    try:
        batch = CausalLMBatch.from_pb(make_batch(1, requests), lm.tokenizer, lm.runner.num_layers,
                                      lm.eos_token_ids, 4000)
        return decode_in_process(lm, batch)
    finally:
        lm.prefixes = None


def same_as_uncached(lm: CausalLM, requests: list[generate_pb2.Request], prefixes: PrefixCache) -> Decoded:
    """Run `requests` with the prefix cache and without; tokens must be equal."""
    cached = generate(lm, requests, prefixes)
    plain = generate(lm, requests, None)
    for rid, tokens in plain.tokens.items():
        assert cached.tokens[rid] == tokens, f"request {rid}: {cached.tokens[rid]} != {tokens}"
        assert max(abs(a - b) for a, b in zip(cached.logprobs[rid], plain.logprobs[rid], strict=True)) < 1e-4
    return cached


SYSTEM = "You are a careful assistant. Background notes: " + " ".join(LONG)


def test_a_chat_turn_reuses_the_previous_turn_prompt_and_answer(off_lm: CausalLM) -> None:
    prefixes = PrefixCache(256 << 20)
    history = [{"role": "system", "content": SYSTEM}]
    for turn, question in enumerate(["What is the story about?", "Who is in it?", "How does it end?"]):
        history.append({"role": "user", "content": question})
        prompt = str(off_lm.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True))
        before = prefixes.stats.hit_tokens
        out = same_as_uncached(off_lm, [make_request(turn, prompt, 16)], prefixes)
        answer = off_lm.tokenizer.decode(out.tokens[turn], skip_special_tokens=True)
        history.append({"role": "assistant", "content": answer})
        prompt_tokens = len(off_lm.tokenizer(prompt)["input_ids"])
        if turn:  # the whole earlier conversation came from the cache
            assert prefixes.stats.hit_tokens - before > prompt_tokens - 30, prefixes.stats


def test_a_cold_batch_sharing_a_system_prompt_runs_it_once(off_lm: CausalLM) -> None:
    prefixes = PrefixCache(256 << 20)
    questions = ["Name a colour.", "Name a city.", "Name a fruit.", "Name a planet."]
    requests = [make_request(i, chat_text(off_lm.tokenizer, q, system=SYSTEM), 10) for i, q in enumerate(questions)]
    requests.append(make_request(9, chat_text(off_lm.tokenizer, "Name a planet.", system=SYSTEM), 10,
                                 do_sample=True, seed=7, temperature=0.8))  # seeded sampling: same tokens too
    same_as_uncached(off_lm, requests, prefixes)
    system_tokens = len(off_lm.tokenizer(SYSTEM)["input_ids"])
    assert prefixes.stats.hits == len(requests) and prefixes.stats.hit_tokens > len(requests) * system_tokens
    assert prefixes.tokens < 2 * system_tokens + 200  # the shared prompt is held once


def test_eviction_recomputes_and_a_whole_cached_prompt_reruns_its_last_token(off_lm: CausalLM) -> None:
    prompt = chat_text(off_lm.tokenizer, "What is the capital of France?", system=SYSTEM)
    n = len(off_lm.tokenizer(prompt)["input_ids"])
    prefixes = PrefixCache(256 << 20)
    same_as_uncached(off_lm, [make_request(1, prompt, 8)], prefixes)
    same_as_uncached(off_lm, [make_request(2, prompt, 8)], prefixes)
    assert prefixes.stats.hit_tokens == n - 1
    tight = PrefixCache(prefixes.nbytes)  # room for that one sequence
    same_as_uncached(off_lm, [make_request(3, prompt, 8)], tight)
    other = chat_text(off_lm.tokenizer, "Something else entirely, please.")
    same_as_uncached(off_lm, [make_request(4, other, 8)], tight)  # evicts the first one
    assert tight.stats.evicted_tokens > 0 and tight.nbytes <= tight.max_bytes
    hits = tight.stats.hit_tokens
    same_as_uncached(off_lm, [make_request(5, prompt, 8)], tight)
    assert tight.stats.hit_tokens - hits < n // 2  # recomputed (the chat template's head may still match)


def test_prompt_logprobs_run_the_whole_prompt(off_lm: CausalLM) -> None:
    prompt = chat_text(off_lm.tokenizer, "Why is the sky blue?", system=SYSTEM)
    prefixes = PrefixCache(256 << 20)
    generate(off_lm, [make_request(1, prompt, 4)], prefixes)
    lm = off_lm
    lm.prefixes = prefixes
    batch = CausalLMBatch.from_pb(make_batch(2, [make_request(2, prompt, 4, prefill_logprobs=True)]), lm.tokenizer,
                                  lm.runner.num_layers, lm.eos_token_ids, 4000)
    generations, _, _ = lm.generate_token(batch)
    lm.prefixes = None
    prefill = generations[0].prefill_tokens
    assert prefill is not None and len(prefill.ids) == len(lm.tokenizer(prompt)["input_ids"])
    assert batch.requests[0].cached_tokens == 0


def test_verified_and_lossy_requests_reuse_their_own_keys_and_values(model_path: Path, hf_model: torch.nn.Module,
                                                                      off_lm: CausalLM, tmp_path: Path) -> None:
    policy = write_policy(hf_model, tmp_path / "policy.json", SIX_LAYERS)
    verified = make_lm(model_path, hf_model, "verified", policy)
    verified.auto_off = False  # every step drafts and verifies
    prefixes = PrefixCache(256 << 20)
    first = chat_text(off_lm.tokenizer, "Explain what a black hole is.", system=SYSTEM)
    expected = generate(off_lm, [make_request(1, first, 24)], None).tokens[1]
    assert generate(verified, [make_request(1, first, 24)], prefixes).tokens[1] == expected
    follow = first + off_lm.tokenizer.decode(expected) + "\nAnd a white dwarf?"
    expected = generate(off_lm, [make_request(2, follow, 24)], None).tokens[2]
    assert generate(verified, [make_request(2, follow, 24)], prefixes).tokens[2] == expected
    assert prefixes.stats.hit_tokens > len(off_lm.tokenizer(first)["input_ids"])

    lossy = make_lm(model_path, hf_model, "lossy", policy)
    same_as_uncached(lossy, [make_request(3, first, 12)], prefixes)
    assert set(prefixes.roots) == {NONE, SIX_LAYERS}  # the lossy keys and values live apart
    same_as_uncached(lossy, [make_request(4, first, 12)], prefixes)
