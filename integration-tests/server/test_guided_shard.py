"""Grammar-constrained decoding and watermarking through the real shard (gRPC, default model).

The grammar guarantees the shape of the output, not its quality: every output here must match
its regex or parse and validate against its schema (jsonschema), whatever the 135M model writes.
Schemas bound their strings and numbers so that a document always ends within max_new_tokens.
"""

from __future__ import annotations

import json
import re

import jsonschema
from outlines_core.json_schema import build_regex_from_schema

from text_generation_server.pb import generate_pb2, generate_pb2_grpc
from text_generation_server.watermark import detect

from factories import PERSON, PHONE, make_request, run_to_completion

Stub = generate_pb2_grpc.TextGenerationServiceStub
VOCAB = 49152
JSON = generate_pb2.GRAMMAR_TYPE_JSON
REGEX = generate_pb2.GRAMMAR_TYPE_REGEX


def test_json_schema_and_regex_outputs_have_their_shape(shard: Stub) -> None:
    """Greedy and sampled, JSON and regex, next to an unconstrained request in one batch."""
    schema = json.dumps(PERSON)
    requests = [
        make_request(1, "Describe a person as JSON:", 60, grammar=schema, grammar_type=JSON),
        make_request(2, "Who lives in Tokyo?", 60, grammar=schema, grammar_type=JSON, do_sample=True, seed=7,
                     temperature=0.8),
        make_request(3, "Call me at", 24, grammar=PHONE, grammar_type=REGEX),
        make_request(4, "Hello", 6),
    ]
    out = run_to_completion(shard, 1100, requests)
    for rid in (1, 2):
        final = out[rid].final
        assert final is not None and final.finish_reason == generate_pb2.FINISH_REASON_EOS_TOKEN, final
        jsonschema.validate(json.loads(final.text), PERSON)
    final = out[3].final
    assert final is not None and re.fullmatch(PHONE, final.text), final
    assert out[4].final is not None and len(out[4].token_ids) == 6


def test_upstream_routers_regex_of_a_schema_compiles_and_holds(shard: Stub) -> None:
    """Upstream's router sends JSON schemas compiled to regexes by outlines-core: they work here."""
    regex = build_regex_from_schema(json.dumps(PERSON))
    out = run_to_completion(shard, 1110, [make_request(1, "A person as JSON:", 60, grammar=regex, grammar_type=REGEX)])
    final = out[1].final
    assert final is not None and final.finish_reason == generate_pb2.FINISH_REASON_EOS_TOKEN, final
    jsonschema.validate(json.loads(final.text), PERSON)


def test_top_tokens_stay_unmasked(shard: Stub) -> None:
    """As upstream's CausalLM: top-n alternatives come from the raw log-softmax, the chosen token
    from the masked one, so the grammar's token need not be among them."""
    out = run_to_completion(shard, 1120, [make_request(1, "The answer is", 3, grammar="[xyz]{3}", grammar_type=REGEX,
                                                       top_n_tokens=3)])[1]
    assert out.final is not None and re.fullmatch("[xyz]{3}", out.final.text)
    top_texts = {t for top in out.top_tokens for t in top.texts}
    assert not top_texts <= {"x", "y", "z"}, top_texts


def _pooled_z(texts: list[list[int]]) -> float:
    """One z-test over the tokens of all texts (each text scored after its first token)."""
    detections = [detect(t, VOCAB) for t in texts]
    scored = sum(d.num_scored for d in detections)
    green = sum(d.num_green for d in detections)
    return float((green - 0.5 * scored) / (scored * 0.25) ** 0.5)


def test_watermark_detector_on_real_output(shard: Stub) -> None:
    """Watermarked greedy text of the real model scores a high z; the same prompts unmarked do not
    (one batch: both kinds side by side)."""
    prompts = ["Once upon a time", "The history of Rome", "Here is a recipe for bread:", "My favourite animal is"]
    requests = [make_request(1400 + i, p, 32, ignore_eos=True, watermark=marked)
                for i, (p, marked) in enumerate([(p, True) for p in prompts] + [(p, False) for p in prompts])]
    out = run_to_completion(shard, 1400, requests)
    marked = [out[1400 + i].token_ids for i in range(len(prompts))]
    plain = [out[1400 + len(prompts) + i].token_ids for i in range(len(prompts))]
    z_marked, z_plain = _pooled_z(marked), _pooled_z(plain)
    print(f"watermark z over {len(prompts)} x 32 greedy tokens: marked {z_marked:.1f}, plain {z_plain:.1f}")
    assert z_marked >= 4.0 > z_plain, (z_marked, z_plain)
