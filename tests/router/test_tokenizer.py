"""The router's light tokenizer against transformers' AutoTokenizer on the same files: the same ids,
text, offsets and rendered chat templates, without importing transformers or torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from text_generation_router.engine.tokenizer import TemplateError, Tokenizer, _Fast, _Transformers

TEXTS = [
    "Hello world, it's  a test.",
    "  leading and trailing spaces  ",
    "def f(x):\n\treturn x ** 2  # tabs\n\n",
    "héllo wörld 😀 中文 مرحبا",
    "special tokens inside text: <|im_start|>user\nhi<|im_end|>",
    "don't , stop ! what ? ok .",
    "",
]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    [{"role": "user", "content": "Continue:"}, {"role": "assistant", "content": "Once upon a time"}],
    [{"role": "user", "content": "x", "name": None}],
]
# A template that uses what chat templates on the hub use: namespace, loop controls, tojson with
# options, dict(), raise_exception, the generation tag, tools and the special tokens.
TEMPLATE = (
    "{% set ns = namespace(n=0) %}{{ bos_token }}"
    "{% if tools %}{{ tools | tojson(indent=2, sort_keys=True) }}\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
    "{% if m['role'] not in ['user', 'assistant', 'system'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{% set d = dict(role=m['role']) %}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ d.role }}: {{ m['content'] }}{{ eos_token }}"
    "{% endgeneration %}{% else %}{{ d.role }}: {{ m['content'] | tojson }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant ({{ ns.n }} turns):{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, °C",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def _same(light: Tokenizer, reference: Any) -> None:
    for text in TEXTS:
        for special in (True, False):
            ids = reference(text, add_special_tokens=special)["input_ids"]
            assert light.encode(text, special) == ids, text
            offsets = reference(text, add_special_tokens=special, return_offsets_mapping=True)["offset_mapping"]
            assert [(s.id, s.start, s.stop) for s in light.spans(text, special)] == [
                (i, a, b) for i, (a, b) in zip(ids, offsets, strict=True)], text
        ids = reference(text)["input_ids"]
        assert light.decode(ids) == reference.decode(ids, skip_special_tokens=False), text
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        got = light.apply_chat_template(messages)
        if messages[-1]["role"] == "assistant":  # continued: the prompt ends with that message's text
            assert expected.startswith(got) and got.endswith(messages[-1]["content"])
        else:
            assert got == expected


def test_the_default_models_tokenizer_equals_transformers(model_path: Path) -> None:
    light = Tokenizer(str(model_path))
    assert isinstance(light._backend, _Fast)
    reference = AutoTokenizer.from_pretrained(str(model_path))
    _same(light, reference)
    assert (light.bos_token, light.eos_token) == (reference.bos_token, reference.eos_token)
    assert light.special_tokens == reference.special_tokens_map


def _folder(tmp_path: Path, model_path: Path, special_map: dict[str, Any] | None = None, **config: Any) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir(parents=True)
    shutil.copy(model_path / "tokenizer.json", folder / "tokenizer.json")
    base = json.loads((model_path / "tokenizer_config.json").read_text())
    base.pop("chat_template", None)
    for key in special_map or {}:
        base.pop(key, None)
    (folder / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    if special_map is not None:  # the legacy file, its tokens saved as AddedToken fields
        (folder / "special_tokens_map.json").write_text(json.dumps(special_map))
    return folder


def test_a_template_with_the_hubs_constructs_renders_as_transformers(tmp_path: Path, model_path: Path) -> None:
    added = {"content": "<|im_start|>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    folder = _folder(tmp_path, model_path, {"bos_token": added}, chat_template=TEMPLATE)
    light = Tokenizer(str(folder))
    reference = AutoTokenizer.from_pretrained(str(folder))
    assert light.template_uses_tools
    for messages in CONVERSATIONS[:3] + [[{"role": "skip", "content": "-"}, {"role": "user", "content": "ü"}]]:
        for tools in (None, TOOLS):
            expected = reference.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            assert light.apply_chat_template(messages, tools=tools) == expected
    with pytest.raises(TemplateError, match="bad role tool"):
        light.apply_chat_template([{"role": "tool", "content": "x"}])


def test_the_template_file_wins_over_the_configs(tmp_path: Path, model_path: Path) -> None:
    folder = _folder(tmp_path, model_path, chat_template="config {{ messages[0]['content'] }}")
    (folder / "chat_template.jinja").write_text("file {{ messages[0]['content'] }}")
    assert Tokenizer(str(folder)).apply_chat_template([{"role": "user", "content": "x"}]) == "file x"


def test_the_sandbox_refuses_what_transformers_refuses(tmp_path: Path, model_path: Path) -> None:
    folder = _folder(tmp_path, model_path, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(TemplateError):
        Tokenizer(str(folder)).apply_chat_template([{"role": "user", "content": "x"}])
    folder = _folder(tmp_path / "b", model_path, chat_template="{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(TemplateError, match="_x"):
        Tokenizer(str(folder)).apply_chat_template([{"role": "user", "content": "x"}])
    assert not Tokenizer(str(folder)).template_uses_tools


def test_a_config_that_alters_the_pipeline_loads_with_transformers(tmp_path: Path, model_path: Path) -> None:
    folder = _folder(tmp_path, model_path, add_bos_token=True, bos_token="<|im_start|>", chat_template=TEMPLATE)
    light = Tokenizer(str(folder))
    assert isinstance(light._backend, _Transformers)
    reference = AutoTokenizer.from_pretrained(str(folder))
    assert light.encode("hi") == reference("hi")["input_ids"]
    assert light.apply_chat_template(CONVERSATIONS[0]) == reference.apply_chat_template(
        CONVERSATIONS[0], tokenize=False, add_generation_prompt=True)


def test_a_model_without_a_template_is_refused_by_name(tmp_path: Path, model_path: Path) -> None:
    with pytest.raises(TemplateError, match="does not have a chat template"):
        Tokenizer(str(_folder(tmp_path, model_path))).apply_chat_template(CONVERSATIONS[0])


def test_the_router_imports_neither_transformers_nor_torch(model_path: Path) -> None:
    code = ("import sys, text_generation_router.cli, text_generation_router.launcher.launcher\n"
            "from text_generation_router.engine.tokenizer import Tokenizer\n"
            f"Tokenizer({str(model_path)!r}).apply_chat_template([{{'role': 'user', 'content': 'x'}}])\n"
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
