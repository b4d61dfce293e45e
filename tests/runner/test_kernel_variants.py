"""Choosing, building and importing the CPU kernels' ISA variants (cpu_kernels.py, kernel_build.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from text_generation_server.models.runner import cpu_kernels, kernel_build

AVX2 = {"avx2", "fma", "f16c", "sse4_2"}
ICE_LAKE = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}  # no avx512_bf16
SKYLAKE_X = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
ZEN_4 = ICE_LAKE | {"avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN_4 | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize(("flags", "expected"), [(AVX2, "avx2"), (SKYLAKE_X, "avx512"), (ICE_LAKE, "avx512_vnni"),
                                                 (ZEN_4, "avx512_bf16"), (SAPPHIRE_RAPIDS, "amx")])
def test_auto_picks_the_best_variant_the_flags_allow(flags: set[str], expected: str) -> None:
    choice = cpu_kernels.choose("auto", flags, "x86_64")
    assert isinstance(choice, cpu_kernels.Variant) and choice.name == expected


def test_a_forced_variant_is_used_where_the_cpu_has_it_and_refused_by_name_where_not() -> None:
    choice = cpu_kernels.choose("avx2", SAPPHIRE_RAPIDS, "x86_64")
    assert isinstance(choice, cpu_kernels.Variant) and choice.name == "avx2"
    assert cpu_kernels.choose("AVX512_BF16", ICE_LAKE, "x86_64") == (
        "TGI_CPU_KERNELS=avx512_bf16 but the CPU lacks avx512_bf16")
    assert cpu_kernels.choose("avx512", AVX2, "x86_64") == (
        "TGI_CPU_KERNELS=avx512 but the CPU lacks avx512f, avx512bw, avx512vl, avx512dq")


def test_other_cpus_and_off_fall_back_to_torch_saying_why() -> None:
    assert cpu_kernels.choose("auto", set(), "aarch64") == (
        "the CPU is aarch64, the kernels are written for x86-64 (AVX2 or AVX-512)")
    assert cpu_kernels.choose("auto", {"avx", "sse4_2"}, "x86_64") == (
        "the CPU lacks avx2, fma, f16c (the least the kernels need: AVX2, FMA, F16C)")
    assert cpu_kernels.choose("off", SAPPHIRE_RAPIDS, "x86_64") == "TGI_CPU_KERNELS=off"
    with pytest.raises(ValueError, match="TGI_CPU_KERNELS='sse2' is not one of auto, off, amx, avx512_bf16"):
        cpu_kernels.choose("sse2", AVX2, "x86_64")


def test_only_the_bf16_variants_use_bf16_instructions() -> None:
    """fp32 kernels never depend on a bf16 instruction: below avx512_bf16, bf16 is widened by shifts."""
    for variant in cpu_kernels.VARIANTS:
        uses_bf16 = any("bf16" in flag for flag in variant.compiler_flags)
        assert uses_bf16 == (variant.name in ("amx", "avx512_bf16")), variant
    assert cpu_kernels.BY_NAME["amx"].compiler_flags[-3:] == ("-mamx-tile", "-mamx-bf16", "-mamx-int8")  # GCC spells


def test_build_compiles_every_variant_and_imports_none(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The bindings once with baseline flags, each variant's kernels with its own; nothing is loaded."""
    commands: list[list[str]] = []

    def compile_or_link(command: list[str]) -> None:
        commands.append(command)
        Path(command[command.index("-o") + 1]).write_bytes(b"")

    monkeypatch.setattr(kernel_build, "_run", compile_or_link)
    monkeypatch.setattr(kernel_build, "compiler", lambda: "c++")
    monkeypatch.setattr(kernel_build, "accepts", lambda cxx, flags: None)
    modules_before = set(sys.modules)
    kernel_build.build(tmp_path / "k", {v.name: v.compiler_flags for v in cpu_kernels.VARIANTS})
    assert set(sys.modules) == modules_before
    bindings = [c for c in commands if str(kernel_build.BINDINGS) in c]
    assert len(bindings) == 1 and not any(flag.startswith("-mavx") for flag in bindings[0])
    for variant in cpu_kernels.VARIANTS:
        objects = [c for c in commands if f'-DTGI_VARIANT="{variant.name}"' in c]
        assert len(objects) == len(list(kernel_build.KERNEL_DIR.glob("*.cpp")))
        assert all(set(variant.compiler_flags) <= set(c) for c in objects)
        assert kernel_build.module_path(tmp_path / "k", variant.name).exists()


def _disassembly(paths: list[Path]) -> str:
    """The instructions (mnemonic and operands) of the objects, without symbol names or the targets
    of jumps and calls (symbols such as linear_bf16, and addresses: one was 0xbf16)."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", *map(str, paths)], capture_output=True, text=True,
                         check=True).stdout
    lines = [line.split("\t", 1)[1] for line in out.splitlines() if line.startswith(" ") and "\t" in line]
    lines = [re.sub(r"<[^>]*>|#.*", "", line) for line in lines]
    return "\n".join(re.sub(r"\b((?:j\w+|call\w*)\s+)[0-9a-f]+\s*$", r"\1", line) for line in lines)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
@pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None, reason="the kernels are not built here")
def test_no_variant_holds_instructions_above_its_level() -> None:
    """What the CPU executes is what it has: the shared bindings hold no vector extension at all,
    the avx2 variant no AVX-512 register, only avx512_bf16 and amx a bf16 instruction, and only
    amx a tile instruction."""
    folder = cpu_kernels.build()
    bindings = _disassembly([folder / "bindings.o"])
    assert "%ymm" not in bindings and "%zmm" not in bindings
    avx2 = _disassembly(sorted((folder / "avx2").glob("*.o")))
    assert "%ymm" in avx2 and "%zmm" not in avx2 and "%k1" not in avx2
    for name in ("avx512", "avx512_vnni", "avx512_bf16"):
        code = _disassembly(sorted((folder / name).glob("*.o")))
        assert "ldtilecfg" not in code and "tdpb" not in code and ("bf16" in code) == (name == "avx512_bf16")
    assert "vpdpbusd" in _disassembly(sorted((folder / "avx512_vnni").glob("*.o")))
    assert "vdpbf16ps" in _disassembly(sorted((folder / "avx512_bf16").glob("*.o")))
    if kernel_build.unsupported(folder, "amx") is None:  # a compiler without AMX's flags skips it
        code = _disassembly(sorted((folder / "amx").glob("*.o")))
        assert "tdpbf16ps" in code and "tdpbssd" in code


def test_amx_flags_count_only_where_the_os_grants_the_tile_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Linux's grant (arch_prctl) a tile instruction ends the process: the amx variants then
    count as missing their flags, and auto picks the next variant."""
    flags = cpu_kernels.cpu_flags()
    monkeypatch.setattr(cpu_kernels, "amx_permitted", lambda: False)
    refused = cpu_kernels.cpu_flags()
    assert not any(flag.startswith("amx") for flag in refused)
    assert refused == {flag for flag in flags if not flag.startswith("amx")}
    assert "amx" not in [v.name for v in cpu_kernels.runnable_variants()]


def test_a_variant_the_compiler_cannot_build_is_skipped_saying_why(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """An older compiler without AMX's flags still builds the other variants; the skipped one says
    why, and is built once the compiler takes its flags."""
    def compile_or_link(command: list[str]) -> None:
        Path(command[command.index("-o") + 1]).write_bytes(b"")

    monkeypatch.setattr(kernel_build, "_run", compile_or_link)
    monkeypatch.setattr(kernel_build, "compiler", lambda: "/usr/bin/g++-10")
    monkeypatch.setattr(kernel_build, "accepts", lambda cxx, flags: next(
        (f"error: unrecognized command-line option '{f}'" for f in flags if f.startswith("-mamx")), None))
    folder = tmp_path / "k"
    kernel_build.build(folder, {v.name: v.compiler_flags for v in cpu_kernels.VARIANTS})
    assert not kernel_build.module_path(folder, "amx").exists()
    assert kernel_build.unsupported(folder, "amx") == (
        "g++-10 does not take " + " ".join(cpu_kernels.BY_NAME["amx"].compiler_flags)
        + ": error: unrecognized command-line option '-mamx-tile'")
    for name in ("avx512_bf16", "avx512_vnni", "avx512", "avx2"):
        assert kernel_build.module_path(folder, name).exists() and kernel_build.unsupported(folder, name) is None
    monkeypatch.setattr(kernel_build, "accepts", lambda cxx, flags: None)  # a newer compiler
    kernel_build.build(folder, {"amx": cpu_kernels.BY_NAME["amx"].compiler_flags})
    assert kernel_build.module_path(folder, "amx").exists()
    assert kernel_build.unsupported(folder, "amx") is None


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler here")
def test_the_compiler_is_asked_whether_it_takes_a_variants_flags() -> None:
    assert kernel_build.accepts("c++", ["-mavx2", "-mfma"]) is None
    complaint = kernel_build.accepts("c++", ["-mno-such-extension"])
    assert complaint is not None and "no-such-extension" in complaint
