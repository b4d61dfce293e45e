"""Compiling the CPU kernels' variants with the C++ compiler directly (no import while building).

Design note: a variant is the kernels (kernels/*.cpp) compiled with its own -m flags and linked
with the bindings (cpu_kernels.cpp, compiled once with baseline flags: it holds no vector code)
into its own module `<folder>/<variant>/tgi_cpu_kernels.so`. Compiling never executes what it
compiles, so one machine builds every variant (an image built on one host serves on another),
and importing is left to cpu_kernels.load, which imports only a variant the CPU can run (a
build that imported what it compiled would die with "Illegal instruction" on a CPU without
the variant's ISA). Objects are compiled in parallel; a module appears under its final name
only when complete (written to a temporary name, then renamed), and a file lock keeps two
processes from building the same folder at once.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import subprocess
import sysconfig
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils import cpp_extension

from ...env import process_env

NAME = "tgi_cpu_kernels"  # each variant's .so defines the Python module NAME_<variant> (module_name)
HERE = Path(__file__).parent
BINDINGS = HERE / "cpu_kernels.cpp"
KERNEL_DIR = HERE / "kernels"


def sources() -> list[Path]:
    """Every file whose text goes into a build (and into the build folder's hash)."""
    return [BINDINGS, *sorted(KERNEL_DIR.glob("*.cpp")), *sorted(KERNEL_DIR.glob("*.h"))]


def compiler() -> str:
    """The C++ compiler ($CXX, else c++), or a RuntimeError that says how to get one."""
    name = process_env().kernels.cxx
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"no C++ compiler: {name!r} (from $CXX, default c++) is not on PATH; install g++ "
                           "or set CXX")
    return path


def common_flags() -> list[str]:
    """Flags of every object: torch's headers and ABI, the module name, fp32 rounding as torch's."""
    includes = [*cpp_extension.include_paths(), sysconfig.get_path("include")]
    # -fvisibility=hidden: a variant's module exports its PyInit alone, none of the kernels'
    # symbols, which every variant defines under the same names.
    return ["-O3", "-fPIC", "-fvisibility=hidden", "-std=c++20", "-fopenmp", "-ffp-contract=off",
            "-DTORCH_API_INCLUDE_EXTENSION_H", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-isystem{path}" for path in includes)]


def link_flags() -> list[str]:
    # torch's libgomp (same soname as the one torch loaded): one OpenMP runtime, one thread team.
    torch_lib = Path(torch.__file__).parent / "lib"
    return ["-shared", f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python", "-lgomp",
            f"-Wl,-rpath,{torch_lib}"]


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-20:])
        raise RuntimeError(f"{shlex.join(command[:1] + command[-3:])} failed ({result.returncode}):\n{tail}")


@contextmanager
def locked(folder: Path) -> Iterator[None]:
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def module_name(variant: str) -> str:
    return f"{NAME}_{variant}"


def module_path(folder: Path, variant: str) -> Path:
    return folder / variant / f"{NAME}.so"


UNSUPPORTED = "unsupported.txt"  # in a variant's folder: why the compiler could not build it


def accepts(cxx: str, flags: Sequence[str]) -> str | None:
    """None when the compiler takes these -m flags, else its complaint (an older GCC or Clang lacks
    newer ISA extensions' flags, e.g. AMX's before GCC 11)."""
    result = subprocess.run([cxx, "-x", "c++", "-fsyntax-only", *flags, "-"], input="int main() { return 0; }\n",
                            capture_output=True, text=True)
    text = (result.stderr or result.stdout).strip()
    return None if result.returncode == 0 else text.splitlines()[-1] if text else f"exit status {result.returncode}"


def unsupported(folder: Path, variant: str) -> str | None:
    """Why `variant` was not built in `folder` (the compiler does not take its flags), or None."""
    marker = folder / variant / UNSUPPORTED
    return marker.read_text().strip() if marker.exists() else None


def build(folder: Path, variants: dict[str, Sequence[str]], jobs: int | None = None) -> None:
    """Compile each missing variant (name -> its -m flags) into `folder`; raises on failure. A
    variant whose flags the compiler does not take is skipped, the reason written to
    `<variant>/unsupported.txt` (unsupported(); asked again at the next build, so a newer compiler
    builds it); the others are built."""
    cxx = compiler()
    with locked(folder):
        missing = {name: flags for name, flags in variants.items() if not module_path(folder, name).exists()}
        for name, variant_flags in list(missing.items()):
            (folder / name).mkdir(parents=True, exist_ok=True)
            marker = folder / name / UNSUPPORTED
            complaint = accepts(cxx, variant_flags)
            if complaint is None:
                marker.unlink(missing_ok=True)
            else:
                marker.write_text(f"{Path(cxx).name} does not take {' '.join(variant_flags)}: {complaint}\n")
                del missing[name]
        if not missing:
            return
        flags = common_flags()
        bindings = folder / "bindings.o"
        commands: list[list[str]] = []
        if not bindings.exists():
            commands.append([cxx, *flags, "-c", str(BINDINGS), "-o", str(bindings)])
        for name, variant_flags in missing.items():
            (folder / name).mkdir(parents=True, exist_ok=True)
            for source in sorted(KERNEL_DIR.glob("*.cpp")):
                commands.append([cxx, *flags, *variant_flags, f'-DTGI_VARIANT="{name}"',
                                 f"-DTORCH_EXTENSION_NAME={module_name(name)}", "-c", str(source),
                                 "-o", str(folder / name / f"{source.stem}.o")])
        with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as pool:
            list(pool.map(_run, commands))  # re-raises the first failure
        for name in missing:
            objects = [str(bindings), *(str(path) for path in sorted((folder / name).glob("*.o")))]
            partial = folder / name / f"{NAME}.so.partial"
            _run([cxx, *objects, "-o", str(partial), *link_flags()])
            os.replace(partial, module_path(folder, name))
