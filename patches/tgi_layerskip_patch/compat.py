"""Which upstream code the patch knows, and a clear refusal for any other.

The patch wraps methods by name and reads fields of upstream's batch, so it checks both the
installed distribution's version and the shapes it relies on before touching anything.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from types import ModuleType

# text-generation-server as shipped by TGI 3.3.x (checked against commit db931fcf, 3.3.6-dev0;
# upstream's server/pyproject.toml has said 2.0.5-dev0 throughout the 3.x line).
KNOWN_VERSIONS = ("2.0.5.dev0", "2.0.5-dev0")
GENERATE_TOKEN_PARAMS = ["self", "batch"]
FORWARD_PARAMS = ["self", "input_ids", "attention_mask", "position_ids", "past_key_values"]
BATCH_FIELDS = ("requests", "input_ids", "attention_mask", "past_key_values", "max_input_length")


class UnknownUpstreamError(RuntimeError):
    """The installed upstream server is not one this patch was written against."""


def _params(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


def check_upstream(causal_lm: ModuleType) -> str:
    """Return the upstream version, or raise UnknownUpstreamError naming what differs."""
    try:
        version = importlib.metadata.version("text-generation-server")
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    problems = []
    if version not in KNOWN_VERSIONS:
        problems.append(f"text-generation-server {version} (known: {', '.join(KNOWN_VERSIONS)})")
    model_class = getattr(causal_lm, "CausalLM", None)
    batch_class = getattr(causal_lm, "CausalLMBatch", None)
    if model_class is None or batch_class is None:
        problems.append("causal_lm has no CausalLM / CausalLMBatch")
    else:
        for name, expected in (("generate_token", GENERATE_TOKEN_PARAMS), ("forward", FORWARD_PARAMS)):
            method = getattr(model_class, name, None)
            if method is None:
                problems.append(f"CausalLM has no {name}")
            elif _params(method) != expected:
                problems.append(f"CausalLM.{name}{inspect.signature(method)}")
        annotations = getattr(batch_class, "__annotations__", {})
        missing = [f for f in BATCH_FIELDS if f not in annotations]
        if missing:
            problems.append(f"CausalLMBatch lacks fields {missing}")
    if problems:
        raise UnknownUpstreamError(
            "tgi_layerskip_patch refuses to patch this TGI: it does not recognise "
            + "; ".join(problems)
            + ". The patch was written for TGI 3.3.x (text-generation-server 2.0.5-dev0, commit "
            "db931fcf). Unset TGI_LAYER_SKIP_MODE to run upstream unpatched.")
    return version
