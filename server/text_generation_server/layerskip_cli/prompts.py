"""Prompt sets: JSON Lines of `{"prompt": ...}` or `{"messages": [...]}` with optional id/category/split.

A line without "split" belongs to every split. Chat messages are rendered with the model's
chat template (with the generation prompt); plain prompts are tokenized as they are.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

SPLITS = ("calibration", "heldout", "all")


def default_prompts_path() -> Path:
    """The prompt set that ships with the package (layerskip/data/prompts.jsonl)."""
    return Path(str(resources.files("text_generation_server.layerskip") / "data" / "prompts.jsonl"))


@dataclass(frozen=True)
class Prompt:
    """One line of a prompt set.

    Attributes:
        id: the line's "id", else "line-<n>".
        category: the line's "category", else "uncategorized".
        split: "calibration", "heldout" or "" (belongs to every split).
        messages: the chat, when the line has one.
        text: the plain prompt, when the line has one.
    """

    id: str
    category: str
    split: str
    messages: tuple[dict[str, str], ...] | None
    text: str | None

    def in_split(self, split: str) -> bool:
        return split == "all" or not self.split or self.split == split

    def render(self, tokenizer: Any) -> torch.Tensor:
        """[seq] int64 token ids of the prompt as the model sees it."""
        if self.messages is not None:
            text = tokenizer.apply_chat_template(list(self.messages), tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(self.text)["input_ids"]
        if not ids:
            raise ValueError(f"prompt {self.id} renders to no tokens")
        return torch.tensor(ids, dtype=torch.long)


@dataclass(frozen=True)
class PromptSet:
    """The prompts of one file (all splits), its path and the sha256 of its exact bytes."""

    path: Path
    sha256: str
    prompts: tuple[Prompt, ...]

    def split(self, name: str) -> list[Prompt]:
        if name not in SPLITS:
            raise ValueError(f"--split {name} is not known; use one of {', '.join(SPLITS)}")
        return [p for p in self.prompts if p.in_split(name)]


def _parse_line(number: int, line: str, path: Path) -> Prompt:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} line {number}: not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} line {number}: expected a JSON object")
    messages, text = data.get("messages"), data.get("prompt")
    if (messages is None) == (text is None):
        raise ValueError(f"{path} line {number}: give exactly one of 'prompt' or 'messages'")
    if messages is not None and not (isinstance(messages, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages) and messages):
        raise ValueError(f"{path} line {number}: 'messages' must be a non-empty list of "
                         "{\"role\": str, \"content\": str}")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{path} line {number}: 'prompt' must be a string")
    split = str(data.get("split", ""))
    if split and split not in ("calibration", "heldout"):
        raise ValueError(f"{path} line {number}: split {split!r} is not 'calibration' or 'heldout'")
    return Prompt(id=str(data.get("id", f"line-{number}")), category=str(data.get("category", "uncategorized")),
                  split=split, messages=None if messages is None else tuple(dict(m) for m in messages),
                  text=text)


def read_prompts(path: str | Path) -> PromptSet:
    """Read a JSONL prompt set; ValueError names the file and line of any bad entry."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ValueError(f"prompt file {path} cannot be read: {err.strerror}") from err
    lines = raw.decode("utf-8").splitlines()
    prompts = tuple(_parse_line(n, line, path) for n, line in enumerate(lines, 1) if line.strip())
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    ids = [p.id for p in prompts]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValueError(f"prompt file {path} uses ids {duplicates[:5]} more than once")
    return PromptSet(path, hashlib.sha256(raw).hexdigest(), prompts)


def select(prompt_set: PromptSet, split: str, max_prompts: int | None = None) -> list[Prompt]:
    """The prompts of `split`, the first `max_prompts` of them (in file order) if given."""
    chosen = prompt_set.split(split)
    if not chosen:
        raise ValueError(f"prompt file {prompt_set.path} has no prompts in split {split!r}")
    return chosen[:max_prompts] if max_prompts else chosen
