"""mesp's ExecuTorch kernels (qmatmul.cpp: mesp::qlinear.out, qmatmul.out and their _add forms;
gated_act.cpp: the gated activation's mesp::gated_act*.out) for the Python driver: built once per
machine with the C++ compiler against the executorch package, cached, and loaded into the
process before any program (its static initializer registers the kernels in the libexecutorch.so
that the executorch pybindings share). The native runner compiles the same files in
(runtime/CMakeLists.txt).

Light on purpose: the Python driver imports this, and it loads no model code. The library sits
under ``$MESP_CACHE_DIR`` (default ``~/.cache/mesp``) in ``kernels/``, named by a hash of the
sources, the compiler and the executorch package it links, so an edited kernel builds anew.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

from mesp.ondevice.run_files import write_atomic

SOURCES = tuple(Path(__file__).with_name(n) for n in ("qmatmul.cpp", "gated_act.cpp"))
HEADERS = (Path(__file__).with_name("packed_rows.h"),)  # included by qmatmul.cpp
# as the wheel's CMake package asks (runtime/CMakeLists.txt: MESP_ET_DEFINITIONS)
DEFINES = ("C10_USING_CUSTOM_GENERATED_MACROS", "ET_EVENT_TRACER_ENABLED", "ET_USE_THREADPOOL")
LIBS = ("executorch", "executorch_backend_xnnpack", "executorch_threadpool")


class KernelError(RuntimeError):
    """The kernels cannot be built or loaded here (one line, for the driver's refusal)."""


def executorch_root() -> Path:
    """The executorch package directory that has the C++ headers and lib/."""
    spec = importlib.util.find_spec("executorch")
    for d in (spec.submodule_search_locations or []) if spec else []:
        if (Path(d) / "include/executorch/runtime/executor/program.h").is_file():
            return Path(d)
    raise KernelError("the executorch package (with its C++ headers) is not installed")


def compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        path = name and shutil.which(name)
        if path:
            return path
    raise KernelError("no C++ compiler found (set CXX) to build mesp's kernels")


def _command(cxx: str, root: Path, out: str) -> list[str]:
    inc = root / "include"
    return [
        cxx, "-std=c++17", "-O3", "-fPIC", "-shared", "-ffp-contract=off",
        *(f"-D{d}" for d in DEFINES),
        f"-I{inc}", f"-I{inc}/executorch/runtime/core/portable_type/c10",
        *map(str, SOURCES), f"-L{root / 'lib'}", *(f"-l{lib}" for lib in LIBS),
        f"-Wl,-rpath,{root / 'lib'}", "-o", out,
    ]  # fmt: skip


def library_path(root: Path, cxx: str) -> Path:
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS))
    key.update(" ".join(_command(cxx, root, "")).encode())
    key.update(importlib.metadata.version("executorch").encode())
    base = os.environ.get("MESP_CACHE_DIR") or str(Path.home() / ".cache" / "mesp")
    return Path(base) / "kernels" / f"mesp_kernels-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """The library, compiled first if this machine has none for this source and executorch.
    The compiler writes a temp file that write_atomic renames over the target (the adapter
    writer's rename: concurrent builders each land a whole library)."""
    root, cxx = executorch_root(), compiler()
    target = library_path(root, cxx)
    if target.exists():
        return target

    def compile_into(tmp: str) -> None:
        try:
            done = subprocess.run(
                _command(cxx, root, tmp), capture_output=True, text=True, timeout=300
            )
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelError(f"building mesp's kernels failed: {e}") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise KernelError(f"building mesp's kernels failed: {last}")

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, compile_into)
    except OSError as e:  # the cache directory cannot be written
        raise KernelError(f"building mesp's kernels failed: {e}") from None
    return target


@functools.cache
def load_kernels() -> Path:
    """Build (once) and load the kernels into this process; returns the library's path."""
    path = build()
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise KernelError(f"cannot load {path}: {e}") from None
    return path


def main() -> int:
    """`python -m mesp.ondevice.kernels`: build (or find) the library and say where it is."""
    try:
        print(f"mesp: ExecuTorch kernels ready ({load_kernels()})")
    except KernelError as e:
        print(f"mesp: {e}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
