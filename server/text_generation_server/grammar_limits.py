"""What a grammar may be before it is compiled, and how long its compile may take.

Design note. xgrammar's compile time grows faster than linearly with a JSON schema's size
(figures: docs/tuning.md), and a compile cannot be interrupted. So a grammar is measured
first, in one walk of its schema, and refused when it passes a limit below which compiles stay
around a second; the deadline catches what the limits miss. Regexes compile fast for their size
and are bounded by their length alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GrammarLimits:
    """Limits on a request's grammar; a grammar past one is refused, naming it.

    Attributes:
        max_bytes: length of the schema or regex text, in bytes.
        max_nodes: JSON objects in a schema document (its subschemas, `properties` maps, ...).
        max_properties: properties of one object schema.
        max_depth: nesting of a schema document's JSON objects (an object property adds two:
            its `properties` map and its schema).
        compile_timeout_s: a compile that takes longer refuses the requests waiting for it; it
            goes on in the background (it cannot be interrupted) and its result is kept.
        max_pending: distinct grammars compiling or waiting to compile at once.
    """

    max_bytes: int = 64 * 1024
    max_nodes: int = 1024
    max_properties: int = 256
    max_depth: int = 32
    compile_timeout_s: float = 5.0
    max_pending: int = 4

    def __post_init__(self) -> None:
        if not self.compile_timeout_s > 0:
            raise ValueError(f"--grammar-compile-timeout must be positive, got {self.compile_timeout_s}")
        for name in ("max_bytes", "max_nodes", "max_properties", "max_depth", "max_pending"):
            if getattr(self, name) <= 0:
                raise ValueError(f"grammar limit {name} must be positive, got {getattr(self, name)}")

    def check_text(self, kind: str, text: str) -> None:
        size = len(text.encode())
        if size > self.max_bytes:
            raise ValueError(f"grammar is too large: the {kind} grammar has {size} bytes; "
                             f"this server compiles at most {self.max_bytes}")

    def check_schema(self, schema: Any) -> None:
        """Walk the parsed schema once (no recursion): objects, properties per object, depth."""
        nodes = 0
        stack: list[tuple[Any, int]] = [(schema, 1)]
        while stack:
            value, depth = stack.pop()
            if isinstance(value, list):
                stack.extend((item, depth) for item in value)
                continue
            if not isinstance(value, dict):
                continue
            nodes += 1
            if nodes > self.max_nodes:
                raise ValueError(f"grammar is too complex: the JSON schema has more than {self.max_nodes} "
                                 "JSON objects; this server compiles at most that many")
            if depth > self.max_depth:
                raise ValueError(f"grammar is too complex: the JSON schema nests deeper than {self.max_depth} "
                                 "levels of JSON objects; this server compiles at most that depth")
            properties = value.get("properties")
            if isinstance(properties, dict) and len(properties) > self.max_properties:
                raise ValueError(f"grammar is too complex: an object of the JSON schema has {len(properties)} "
                                 f"properties; this server compiles at most {self.max_properties} per object")
            stack.extend((item, depth + 1) for item in value.values())

