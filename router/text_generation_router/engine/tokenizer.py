"""The router's tokenizer: counts prompt tokens, serves /tokenize and renders chat templates.

Light by design: a model's `tokenizer.json` runs on the `tokenizers` library and its chat
template on a jinja2 sandbox set up as transformers sets up its own (the same globals, filters
and whitespace rules), so the router imports neither transformers nor torch. A model whose
tokenizer needs transformers' own code (no `tokenizer.json`, or a config that makes
transformers rewrite the pipeline: `add_bos_token`, `add_eos_token`, `add_prefix_space`) is
loaded with transformers instead, and the log says so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from loguru import logger

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config keys with which transformers alters the tokenizer.json pipeline at load
ALTERING_KEYS = ("add_bos_token", "add_eos_token", "add_prefix_space")
FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]


@dataclass(frozen=True)
class TokenSpan:
    """One token of /tokenize: id, text and its character span in the input."""

    id: int
    text: str
    start: int
    stop: int


class Tokenizer:
    """A model's tokenizer, from a local folder or a hub id (resolved in the hub cache)."""

    def __init__(self, name: str) -> None:
        folder = _folder(name)
        config = _read_json(folder / "tokenizer_config.json") if folder else {}
        altering = [key for key in ALTERING_KEYS if config.get(key)]
        self._backend: _Backend
        if folder is not None and (folder / "tokenizer.json").is_file() and not altering:
            self._backend = _Fast(folder / "tokenizer.json", bool(config.get("clean_up_tokenization_spaces")))
            legacy = _read_json(folder / "special_tokens_map.json")
            self.special_tokens = {key: text for key in SPECIAL_TOKENS
                                   if (text := _token_text(config.get(key, legacy.get(key)))) is not None}
            self.chat_template = _chat_template(folder, config)
        else:
            why = f"its config sets {', '.join(altering)}" if altering else "it has no tokenizer.json"
            logger.info(f"Tokenizer of {name}: loaded with transformers ({why})")
            self._backend = transformers = _Transformers(name)
            self.special_tokens, self.chat_template = transformers.special_tokens, transformers.chat_template
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.template_uses_tools = self._uses(self.chat_template, "tools")

    @staticmethod
    def _uses(template: str | None, variable: str) -> bool:
        """Whether the chat template reads `variable` (upstream adds tools to the prompt otherwise)."""
        if not template:
            return False
        try:
            ast = _environment().parse(template)
        except jinja2.TemplateSyntaxError:
            return False  # rendering will report it
        return variable in jinja2.meta.find_undeclared_variables(ast)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included."""
        return self._backend.decode(ids)

    def spans(self, text: str, add_special_tokens: bool = True) -> list[TokenSpan]:
        """Tokens with offsets; slow tokenizers have none and report empty text at 0/0."""
        return self._backend.spans(text, add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """Render a conversation with the tokenizer's template, ready for the assistant turn.

        A trailing assistant message is continued, as upstream does (transformers' pipeline
        `continue_final_message`): the prompt ends with that message's text, not a new turn.
        """
        if not self.chat_template:
            raise TemplateError("This model does not have a chat template")
        # keys whose value is None are dropped, as transformers does (templates test for presence)
        chat = [{key: value for key, value in message.items() if value is not None} for message in messages]
        try:
            text = _compiled(self.chat_template).render(messages=chat, tools=tools, documents=None,
                                                        add_generation_prompt=True, **self.special_tokens)
        except Exception as err:  # a template raises many kinds; all are the request's errors
            raise TemplateError(str(err)) from err
        if messages and messages[-1].get("role") == "assistant":
            content = str(messages[-1].get("content") or "")
            index = text.rfind(content)
            if index >= 0:
                text = text[: index + len(content)].rstrip()
        return text


class TemplateError(ValueError):
    """The chat template could not render the request (HTTP 422 template_error)."""


class _Backend(Protocol):
    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def spans(self, text: str, add_special_tokens: bool) -> list[TokenSpan]: ...


class _Fast:
    """tokenizer.json on the `tokenizers` library."""

    def __init__(self, path: Path, clean_up_spaces: bool) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self._tok = RustTokenizer.from_file(str(path))
        # transformers skips this clean-up for BPE models (it would strip real spaces)
        self._clean_up = clean_up_spaces and type(self._tok.model).__name__ != "BPE"

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        text = str(self._tok.decode(ids, skip_special_tokens=False))
        return _clean_up_spaces(text) if self._clean_up else text

    def spans(self, text: str, add_special_tokens: bool) -> list[TokenSpan]:
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return [TokenSpan(int(i), text[start:stop], int(start), int(stop))
                for i, (start, stop) in zip(enc.ids, enc.offsets, strict=True)]


class _Transformers:
    """transformers' AutoTokenizer, for tokenizers the light path does not reproduce."""

    def __init__(self, name: str) -> None:
        from transformers import AutoTokenizer

        self._tok: Any = AutoTokenizer.from_pretrained(name)
        self.chat_template: str | None = getattr(self._tok, "chat_template", None)
        self.special_tokens: dict[str, str] = dict(self._tok.special_tokens_map)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self._tok(text, add_special_tokens=add_special_tokens)["input_ids"]
        return ids

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=False))

    def spans(self, text: str, add_special_tokens: bool) -> list[TokenSpan]:
        if not getattr(self._tok, "is_fast", False):
            return [TokenSpan(i, "", 0, 0) for i in self.encode(text, add_special_tokens)]
        enc = self._tok(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        return [TokenSpan(int(i), text[start:stop], int(start), int(stop))
                for i, (start, stop) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)]


def _folder(name: str) -> Path | None:
    """A local folder as is; a hub id as its snapshot in the hub cache (fetched if allowed)."""
    path = Path(name)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=FILES))
    except Exception as err:  # noqa: BLE001 - transformers gets its chance (and reports its own error)
        logger.warning(f"Tokenizer of {name}: no local files ({err}); trying transformers")
        return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as the config saves it: a string, or an AddedToken's fields."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja wins over the config's entry, as in transformers."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and contractions."""
    for spaced, tight in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, tight)
    return text


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-token masks in training templates): its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names (no way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja2's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)`, without the type's other attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_Dict(), namespace=_Namespace)
    return env


_TEMPLATES: dict[str, jinja2.Template] = {}


def _compiled(template: str) -> jinja2.Template:
    compiled = _TEMPLATES.get(template)
    if compiled is None:
        compiled = _TEMPLATES[template] = _environment().from_string(template)
    return compiled
