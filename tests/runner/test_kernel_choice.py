"""The measured choice among runnable kernel variants (kernel_choice.py), on this CPU's real modules."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from text_generation_server.models.runner import cpu_kernels, kernel_choice
from text_generation_server.models.runner.kernel_choice import MARGIN

RUNNABLE = [v.name for v in cpu_kernels.runnable_variants()]
needs_two = pytest.mark.skipif(len(RUNNABLE) < 2, reason=f"this CPU runs {len(RUNNABLE)} kernel variant(s): "
                               "there is nothing to choose between")


def _loaders() -> dict[str, functools.partial]:
    return {name: functools.partial(cpu_kernels.load_variant, name) for name in RUNNABLE}


def test_a_narrower_variant_must_beat_the_wider_ones_by_the_margin() -> None:
    timings = {"a": {1: 1.0, 8: 4.0}, "b": {1: 0.9, 8: 8.0}}  # b: 10% faster at 1 row, 2x slower at 8
    assert kernel_choice.scores(timings) == {"a": pytest.approx((1 / 0.9 + 1) / 2), "b": pytest.approx(1.5)}
    widest_first = ["avx512_bf16", "avx512", "avx2"]
    assert kernel_choice.pick({"avx512_bf16": 1.0, "avx512": 0.99, "avx2": 0.98}, widest_first) == "avx512_bf16"
    assert kernel_choice.pick({"avx512_bf16": 1.0, "avx512": 0.96, "avx2": 0.95}, widest_first) == "avx512"
    assert kernel_choice.pick({"avx512_bf16": 1.0, "avx512": 0.99, "avx2": 0.90}, widest_first) == "avx2"
    assert kernel_choice.pick({"avx512_bf16": 0.5, "avx512": 0.99, "avx2": 0.90}, widest_first) == "avx512_bf16"


@needs_two
def test_measured_once_then_remembered_per_cpu(tmp_path: Path) -> None:
    name, why = kernel_choice.choose(tmp_path, "cpu A", "int8", _loaders())
    assert name in RUNNABLE and why.startswith("fastest on synthetic decode steps (1 / 8 rows), measured now")
    saved = json.loads((tmp_path / kernel_choice.CHOICES_FILE).read_text())
    entry = saved["cpu A"]["int8"]
    assert entry["variant"] == name and set(entry["ms"]) == set(RUNNABLE) == set(entry["score"])
    assert all(ms > 0 for by_rows in entry["ms"].values() for ms in by_rows.values())
    assert min(entry["score"].values()) >= 1.0 and entry["score"][name] <= min(entry["score"].values()) / MARGIN
    # What is remembered is read back as it is (here: made to name another variant).
    other = next(v for v in RUNNABLE if v != name)
    saved["cpu A"]["int8"]["variant"] = other
    (tmp_path / kernel_choice.CHOICES_FILE).write_text(json.dumps(saved))
    assert kernel_choice.choose(tmp_path, "cpu A", "int8", _loaders())[0] == other
    # Another CPU (an image built elsewhere) measures for itself and keeps the first CPU's entry.
    kernel_choice.choose(tmp_path, "cpu B", "int8", _loaders())
    assert set(json.loads((tmp_path / kernel_choice.CHOICES_FILE).read_text())) == {"cpu A", "cpu B"}


@needs_two
def test_a_folder_it_cannot_write_still_chooses(tmp_path: Path) -> None:
    """The choice cannot be remembered (here: the folder is not there): measured, used, logged."""
    name, why = kernel_choice.choose(tmp_path / "missing", "cpu A", "float32", _loaders())
    assert name in RUNNABLE and "measured now" in why
    (tmp_path / "a-file").write_text("")  # not even the lock can be taken (an image's read-only folder)
    name, why = kernel_choice.choose(tmp_path / "a-file" / "kernels", "cpu A", "float32", _loaders())
    assert name in RUNNABLE and "measured now" in why


def test_a_single_runnable_variant_is_taken_without_measuring(tmp_path: Path) -> None:
    name, why = kernel_choice.choose(tmp_path, "cpu A", "bfloat16", {"avx2": lambda: None})  # type: ignore[dict-item]
    assert (name, why) == ("avx2", "the only variant this CPU runs")
    assert not (tmp_path / kernel_choice.CHOICES_FILE).exists()


def test_an_unknown_kind_is_refused_by_name() -> None:
    kinds = "float32, bfloat16, 4bit, 4bit-bfloat16, 4bit-int8x, int8"
    with pytest.raises(ValueError, match=f"kernel weight kind 'fp8' is not one of {kinds}"):
        cpu_kernels.load(kind="fp8")


def test_only_variants_whose_code_differs_for_a_kind_are_timed() -> None:
    """An extension a kind's kernels do not use compiles the same code as the narrower variant,
    which is kept; the rest keep their order (widest first)."""
    def names(kind: str, variants: list[str]) -> list[str]:
        return [v.name for v in cpu_kernels.variants_for(kind, [cpu_kernels.BY_NAME[n] for n in variants])]

    sapphire_rapids = [v.name for v in cpu_kernels.VARIANTS]
    zen4 = sapphire_rapids[1:]
    assert names("float32", sapphire_rapids) == names("4bit", sapphire_rapids) == ["avx512", "avx2"]
    assert names("bfloat16", sapphire_rapids) == ["amx", "avx512_bf16", "avx512", "avx2"]
    assert names("4bit-bfloat16", sapphire_rapids) == ["amx", "avx512_bf16", "avx512", "avx2"]
    assert names("int8", sapphire_rapids) == ["amx", "avx512_vnni", "avx512", "avx2"]
    assert names("4bit-int8x", sapphire_rapids) == names("int8", sapphire_rapids)  # VNNI lanes, AMX int8 tiles
    assert names("float32", zen4) == names("4bit", zen4) == ["avx512", "avx2"]
    assert names("bfloat16", zen4) == names("4bit-bfloat16", zen4) == ["avx512_bf16", "avx512", "avx2"]
    assert names("int8", zen4) == names("4bit-int8x", zen4) == ["avx512_vnni", "avx512", "avx2"]
    ice_lake = ["avx512_vnni", "avx512", "avx2"]
    assert names("bfloat16", ice_lake) == ["avx512", "avx2"]
    assert names("int8", ice_lake) == ice_lake
    assert names("int8", ["avx2"]) == ["avx2"]
