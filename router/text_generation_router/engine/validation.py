"""Request validation in upstream's order with its literal messages (docs/tgi-interface.md §2.2).

A failed check raises ValidationError(message); the HTTP layer prefixes
`Input validation error: ` and answers 422.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from text_generation_router.config import ServingLimits
from text_generation_router.engine.schemas import GenerateParameters, Grammar
from text_generation_router.layer_skip import LAYER_SKIP_MODES

GRAMMAR_TYPE_JSON, GRAMMAR_TYPE_REGEX = 1, 2  # proto GrammarType
GRAMMAR_INVALID = "grammar is not valid"  # how every refusal of a grammar's content starts (the shard's too)
ANY_JSON_OBJECT = {"type": "object"}  # OpenAI's JSON mode: {"type": "json_object"} without a schema
# Upstream serves at most this many new tokens per shard request and re-queues the rest.
DEFAULT_GENERATION_LENGTH = 1024


class ValidationError(ValueError):
    """A request rejected by validation; str(self) is upstream's literal message."""


@dataclass(frozen=True)
class Limits:
    """Per-request limits: the flags of the router and the limits agreed at warmup."""

    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    serving: ServingLimits
    disable_grammar_support: bool = False


@dataclass(frozen=True)
class ChooserParameters:
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    do_sample: bool
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    watermark: bool
    grammar: str = ""
    grammar_type: int = 0


@dataclass(frozen=True)
class ValidRequest:
    """A request ready for the queue: everything the shard needs, plus sizes for budgets."""

    inputs: str
    input_length: int
    truncate: int
    add_special_tokens: bool
    parameters: ChooserParameters
    max_new_tokens: int  # this chunk's (at most DEFAULT_GENERATION_LENGTH)
    stop_sequences: list[str] = field(default_factory=list)
    decoder_input_details: bool = False
    top_n_tokens: int = 0
    adapter_id: str | None = None
    layer_skip_mode: str = ""
    max_total_new_tokens: int = 0  # all chunks together (the request's max_new_tokens)
    input_ids: tuple[int, ...] = ()  # the prompt's tokens as the router counts them (prefix matching)


def validate_best_of(best_of: int, max_best_of: int) -> int:
    if max_best_of == 1 and best_of != 1:
        raise ValidationError("`best_of` != 1 is not allowed for this endpoint")
    if best_of == 0 or best_of > max_best_of:
        raise ValidationError(f"`best_of` must be > 0 and <= {max_best_of}. Given: {best_of}")
    return best_of


def check_sampling_parameters(p: GenerateParameters, limits: Limits) -> None:
    """Checks 1-11 of the upstream order, which need no tokenizer."""
    sampling = p.do_sample or any(
        v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p)
    )
    if (p.best_of or 1) > 1 and not sampling:
        raise ValidationError("you must use sampling when `best_of` is > 1")
    if p.temperature is not None and p.temperature <= 0:
        raise ValidationError("`temperature` must be strictly positive")
    if p.repetition_penalty is not None and p.repetition_penalty <= 0:
        raise ValidationError("`repetition_penalty` must be strictly positive")
    if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
        raise ValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
    if p.top_p is not None and not 0.0 < p.top_p < 1.0:
        raise ValidationError("`top_p` must be > 0.0 and < 1.0")
    if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
        raise ValidationError("`typical_p` must be > 0.0 and < 1.0")
    if p.top_k is not None and p.top_k <= 0:
        raise ValidationError("`top_k` must be strictly positive")
    if p.max_new_tokens == 0:
        raise ValidationError("`max_new_tokens` must be strictly positive")
    if len(p.stop) > limits.max_stop_sequences:
        raise ValidationError(
            f"`stop` supports up to {limits.max_stop_sequences} stop sequences. "
            f"Given: {len(p.stop)}"
        )
    if (p.best_of or 1) > 1 and p.seed is not None:
        raise ValidationError("`seed` must not be set when `best_of` > 1")
    top_n = p.top_n_tokens or 0
    if top_n > limits.max_top_n_tokens:
        raise ValidationError(
            f"`top_n_tokens` must be >= 0 and <= {limits.max_top_n_tokens}. Given: {top_n}"
        )


def check_lengths(
    inputs: str, p: GenerateParameters, num_tokens: int, serving: ServingLimits
) -> tuple[int, int, int]:
    """Checks 12-16; returns (truncate, input_length, max_new_tokens of the first chunk).

    As upstream, the total-token check uses the first chunk (at most 1024 new tokens), so a
    larger max_new_tokens is admitted and served in chunks while the total fits.

    Args:
        num_tokens: the prompt's token count before truncation (tokenization is check 14).
    """
    if not inputs:
        raise ValidationError("`inputs` cannot be empty")
    truncate = p.truncate if p.truncate is not None else serving.max_input_tokens
    if truncate == 0 or truncate > serving.max_input_tokens:
        raise ValidationError(
            f"`truncate` must be strictly positive and less than {serving.max_input_tokens}. "
            f"Given: {truncate}"
        )
    input_length = min(num_tokens, truncate) if p.truncate is not None else num_tokens
    max_new_tokens = min(requested_new_tokens(p, input_length, serving), DEFAULT_GENERATION_LENGTH)
    if input_length + max_new_tokens > serving.max_total_tokens:
        raise ValidationError(
            f"`inputs` tokens + `max_new_tokens` must be <= {serving.max_total_tokens}. "
            f"Given: {input_length} `inputs` tokens and {max_new_tokens} `max_new_tokens`"
        )
    if input_length > serving.max_input_tokens:
        raise ValidationError(
            f"`inputs` must have less than {serving.max_input_tokens} tokens. "
            f"Given: {input_length}"
        )
    return truncate, input_length, max_new_tokens


def requested_new_tokens(p: GenerateParameters, input_length: int, serving: ServingLimits) -> int:
    """All the new tokens asked for: max_new_tokens, else what max_total_tokens leaves."""
    if p.max_new_tokens is not None:
        return p.max_new_tokens
    return max(serving.max_total_tokens - input_length, 1)


class GrammarCheck(NamedTuple):
    """A request's grammar as the shard takes it, and the schema still to check (see check_grammar)."""

    text: str
    grammar_type: int
    schema: dict[str, Any] | None = None  # a user's JSON schema, for check_json_schema


def check_grammar(p: GenerateParameters, limits: Limits) -> GrammarCheck:
    """Check 17, its cheap part: the grammar as the shard takes it. A regex passes through as
    upstream's router does (the shard compiles it); a JSON schema is sent as GRAMMAR_TYPE_JSON,
    and its check against the draft 2020-12 meta-schema (`check_json_schema`) is left for after
    the shard measured it against its limits: that check takes seconds on a large schema."""
    if p.grammar is None:
        return GrammarCheck("", 0)
    if limits.disable_grammar_support:
        raise ValidationError("grammar is not supported")
    if p.grammar.type == "regex":
        if not isinstance(p.grammar.value, str):
            raise ValidationError("grammar is not valid: a regex grammar needs a string value")
        return GrammarCheck(p.grammar.value, GRAMMAR_TYPE_REGEX)
    schema = schema_of(p.grammar)
    text = json.dumps(schema if schema is not None else ANY_JSON_OBJECT, separators=(",", ":"))
    return GrammarCheck(text, GRAMMAR_TYPE_JSON, schema)


def schema_of(grammar: Grammar) -> dict[str, Any] | None:
    """The schema a json / json_schema grammar carries (None: json_object without one); a JSON
    text that does not parse, or a value that is no object, is refused."""
    if grammar.type == "json_schema":
        config = grammar.value if grammar.value is not None else grammar.json_schema
        assert isinstance(config, dict), "the Grammar model checks json_schema's shape"
        schema = config["schema"]
    elif grammar.value is None:  # {"type": "json_object"} alone
        return None
    else:
        schema = grammar.value
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise ValidationError(f"grammar is not valid: {err}") from err
        elif not isinstance(schema, dict):
            raise ValidationError("grammar is not supported")  # upstream's answer to a non-object value
    return schema  # type: ignore[no-any-return]


def check_json_schema(schema: Any) -> None:
    """A user's schema against the meta-schema, then upstream's own requirement."""
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as err:
        raise ValidationError(f"grammar is not valid: {err.message}") from err
    if not isinstance(schema, dict) or "properties" not in schema:
        raise ValidationError("grammar is not valid: Grammar must have a 'properties' field")


def check_layer_skip(mode: str | None) -> str:
    if mode is None:
        return ""
    if mode not in LAYER_SKIP_MODES:
        raise ValidationError(
            f"`layer_skip` must be one of {', '.join(LAYER_SKIP_MODES)}. Given: {mode}"
        )
    return mode


def build_valid_request(
    inputs: str,
    p: GenerateParameters,
    lengths: tuple[int, int, int],
    grammar: tuple[str, int],
    add_special_tokens: bool,
    max_total_new_tokens: int | None = None,
    input_ids: tuple[int, ...] = (),
) -> ValidRequest:
    truncate, input_length, max_new_tokens = lengths
    seed = p.seed if p.seed is not None else random.getrandbits(63)
    chooser = ChooserParameters(
        temperature=p.temperature if p.temperature is not None else 1.0,
        top_k=p.top_k or 0,
        top_p=p.top_p if p.top_p is not None else 1.0,
        typical_p=p.typical_p if p.typical_p is not None else 1.0,
        do_sample=p.do_sample,
        seed=seed,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty is not None else 1.0,
        frequency_penalty=p.frequency_penalty or 0.0,
        watermark=p.watermark,
        grammar=grammar[0],
        grammar_type=grammar[1],
    )
    return ValidRequest(
        inputs=inputs,
        input_length=input_length,
        truncate=truncate,
        add_special_tokens=add_special_tokens,
        parameters=chooser,
        max_new_tokens=max_new_tokens,
        stop_sequences=list(p.stop),
        decoder_input_details=p.decoder_input_details,
        top_n_tokens=p.top_n_tokens or 0,
        adapter_id=p.adapter_id,
        layer_skip_mode=check_layer_skip(p.layer_skip),
        max_total_new_tokens=max_total_new_tokens if max_total_new_tokens is not None else max_new_tokens,
        input_ids=input_ids,
    )
