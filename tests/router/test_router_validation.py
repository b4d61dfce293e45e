"""Validation order and upstream's literal messages (docs/tgi-interface.md §2.2), on the pure check functions."""

from __future__ import annotations

import pytest

from text_generation_router.config import ServingLimits
from text_generation_router.engine.schemas import GenerateParameters, Grammar
from text_generation_router.engine.validation import (
    Limits,
    ValidationError,
    check_grammar,
    check_json_schema,
    check_layer_skip,
    check_lengths,
    check_sampling_parameters,
    schema_of,
    validate_best_of,
)

SERVING = ServingLimits(max_input_tokens=256, max_total_tokens=512, max_batch_prefill_tokens=512,
                        max_batch_total_tokens=16000)
LIMITS = Limits(max_best_of=2, max_stop_sequences=4, max_top_n_tokens=5, serving=SERVING)


def message(params: dict[str, object]) -> str:
    with pytest.raises(ValidationError) as info:
        check_sampling_parameters(GenerateParameters.model_validate(params), LIMITS)
    return str(info.value)


@pytest.mark.parametrize(("params", "expected"), [
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"temperature": 0}, "`temperature` must be strictly positive"),
    ({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_p": 0.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 1.0}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
    ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
])
def test_sampling_messages_are_literal(params: dict[str, object], expected: str) -> None:
    assert message(params) == expected


def test_first_failure_wins_in_upstream_order() -> None:
    assert message({"temperature": -1, "top_p": 2.0, "top_k": 0}) == (
        "`temperature` must be strictly positive"
    )
    assert message({"top_p": 2.0, "typical_p": 2.0}) == "`top_p` must be > 0.0 and < 1.0"


def lengths_message(inputs: str, params: dict[str, object], num_tokens: int) -> str:
    with pytest.raises(ValidationError) as info:
        check_lengths(inputs, GenerateParameters.model_validate(params), num_tokens, SERVING)
    return str(info.value)


def test_length_messages_are_literal() -> None:
    assert lengths_message("", {}, 0) == "`inputs` cannot be empty"
    assert lengths_message("x", {"truncate": 300}, 1) == (
        "`truncate` must be strictly positive and less than 256. Given: 300"
    )
    assert lengths_message("x", {"max_new_tokens": 500}, 20) == (
        "`inputs` tokens + `max_new_tokens` must be <= 512. Given: 20 `inputs` tokens and 500 "
        "`max_new_tokens`"
    )
    assert lengths_message("x", {"max_new_tokens": 10}, 300) == (
        "`inputs` must have less than 256 tokens. Given: 300"
    )


def test_lengths_default_max_new_tokens_and_truncate() -> None:
    p = GenerateParameters()
    assert check_lengths("x", p, 12, SERVING) == (256, 12, 500)
    p = GenerateParameters(truncate=5, max_new_tokens=3)
    assert check_lengths("x", p, 12, SERVING) == (5, 5, 3)


def test_best_of_range_and_layer_skip() -> None:
    with pytest.raises(ValidationError, match=r"^`best_of` must be > 0 and <= 2. Given: 3$"):
        validate_best_of(3, 2)
    assert check_layer_skip("shadow") == "shadow"
    assert check_layer_skip(None) == ""
    with pytest.raises(ValidationError) as info:
        check_layer_skip("fast")
    assert str(info.value) == "`layer_skip` must be one of off, shadow, lossy, verified. Given: fast"


def test_grammar_checks() -> None:
    regex = GenerateParameters(grammar=Grammar(type="regex", value="[0-9]+"))
    assert check_grammar(regex, LIMITS) == ("[0-9]+", 2, None)
    schema = GenerateParameters(grammar=Grammar(type="json", value={"properties": {"a": {}}}))
    assert check_grammar(schema, LIMITS) == ('{"properties":{"a":{}}}', 1, {"properties": {"a": {}}})
    json_object = GenerateParameters(grammar=Grammar(type="json_object"))
    assert check_grammar(json_object, LIMITS) == ('{"type":"object"}', 1, None)  # nothing left to check
    off = Limits(2, 4, 5, SERVING, disable_grammar_support=True)
    with pytest.raises(ValidationError, match="^grammar is not supported$"):
        check_grammar(regex, off)
    no_props = check_grammar(GenerateParameters(grammar=Grammar(type="json", value={"type": "object"})), LIMITS)
    with pytest.raises(ValidationError, match="^grammar is not valid: "):
        check_json_schema(no_props.schema)


def test_max_new_tokens_over_1024_is_admitted_in_chunks() -> None:
    """As upstream: the total check uses the first chunk (1024 tokens); the rest is re-queued."""
    big = ServingLimits(max_input_tokens=1024, max_total_tokens=4096, max_batch_prefill_tokens=4096,
                        max_batch_total_tokens=16000)
    assert check_lengths("x", GenerateParameters(max_new_tokens=3000), 12, big) == (1024, 12, 1024)
    assert check_lengths("x", GenerateParameters(max_new_tokens=5000), 12, big)[2] == 1024
    with pytest.raises(ValidationError, match="`max_new_tokens` must be <= 4096"):
        check_lengths("x", GenerateParameters(max_new_tokens=3000), 3100, ServingLimits(
            max_input_tokens=4000, max_total_tokens=4096, max_batch_prefill_tokens=4096,
            max_batch_total_tokens=16000))


def test_best_of_disabled_message() -> None:
    with pytest.raises(ValidationError, match=r"^`best_of` != 1 is not allowed for this endpoint$"):
        validate_best_of(2, 1)
    assert validate_best_of(1, 1) == 1


def test_json_schemas_are_checked_against_the_meta_schema() -> None:
    with pytest.raises(ValidationError, match=r"^grammar is not valid: 'nonsense' is not valid under any"):
        check_json_schema(schema_of(Grammar(type="json", value={"properties": {"a": {"type": "nonsense"}}})))
    with pytest.raises(ValidationError, match=r"^grammar is not valid: Expecting property name"):
        schema_of(Grammar(type="json", value="{not json"))
    assert schema_of(Grammar(type="json", value='{"properties": {"a": {}}}')) == {"properties": {"a": {}}}
    assert schema_of(Grammar(type="json_object")) is None  # any object: nothing to check
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert schema_of(Grammar(type="json_schema", json_schema={"name": "x", "schema": schema})) == schema
    assert schema_of(Grammar(type="json_schema", value={"schema": schema})) == schema
    check_json_schema(schema)
    with pytest.raises(ValueError, match="missing field `schema`"):
        Grammar(type="json_schema", json_schema={"name": "x"})
