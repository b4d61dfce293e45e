"""The python block of layerskip/README.md runs verbatim against the real default model."""

from __future__ import annotations

import re
from pathlib import Path

import huggingface_hub.constants
import pytest

import text_generation_server.layerskip as layerskip
from text_generation_server.download import DEFAULT_MODEL_ID, download_weights

README = Path(layerskip.__file__).with_name("README.md")


def test_readme_example_runs(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1, "the README has exactly one python example"
    download_weights(DEFAULT_MODEL_ID)  # puts the checkpoint in the hub cache, offline
    # No machine here reaches the hub: resolve the id from the cache (the hub reads the
    # HF_HUB_OFFLINE variable at import, so the constant is set too).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    exec(compile(blocks[0], str(README), "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    assert "short-prompts [9, 17]" in out and "greedy tokens equal" in out
