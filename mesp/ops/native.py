"""The native dequantizer (dequant.c): built once per machine with the C compiler, loaded by ctypes.

`mesp.quant` calls :func:`dequantize_into` first and keeps its pure-torch path for everything this
kernel does not serve (other dtypes or devices, exported graphs) and for machines without a
compiler, where one log line says so. Both paths give bit-identical weights
(tests/test_native_dequant.py).

The library is cached under ``$MESP_CACHE_DIR`` (default ``~/.cache/mesp``) with a name that
hashes the source, the compiler and its flags, so an edited kernel or another CPU level builds
anew; `scripts/setup` builds it ahead (``python -m mesp.ops.native``). ``MESP_NATIVE=off`` turns
the kernel off (the torch path is then used everywhere).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger("mesp")

SOURCE = Path(__file__).with_name("dequant.c")
ENV = "MESP_NATIVE"
_SCALES = {torch.float32: 0, torch.bfloat16: 1}


def cache_dir() -> Path:
    root = os.environ.get("MESP_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME")
    base = Path(root) if root else Path.home() / ".cache"
    return (base if os.environ.get("MESP_CACHE_DIR") else base / "mesp") / "native"


def compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)


def _isa_flags() -> list[str]:
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if x86 and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return ["-mavx2"]
    return []


def _compile(cc: str, target: Path, openmp: bool) -> bool:
    flags = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", *_isa_flags()]
    if openmp:
        flags.append("-fopenmp")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.part")
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            return False
        os.replace(tmp, target)  # atomic: concurrent builders each land a whole file
        return True
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_path(cc: str) -> Path:
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(" ".join([cc, *_isa_flags(), sys.platform]).encode())
    return cache_dir() / f"dequant-{key.hexdigest()[:16]}.so"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, building it first when needed; None (logged once) where it cannot be."""
    if os.environ.get(ENV, "auto").lower() in ("0", "off", "no", "false"):
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found (set CC): dequantizing with the slower pure-torch path")
        return None
    target = library_path(cc)
    if not target.exists() and not (_compile(cc, target, True) or _compile(cc, target, False)):
        log.warning("could not build %s with %s: dequantizing with the pure-torch path", SOURCE, cc)
        return None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        log.warning("could not load %s (%s): dequantizing with the pure-torch path", target, e)
        return None
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.mesp_dequantize.argtypes = [ptr] * 4 + [i64] * 6 + [i32] * 6
    lib.mesp_dequantize.restype = i32
    return lib


def serves(wq: Tensor, scales: Tensor, biases: Tensor) -> bool:
    """Whether the kernel takes these packed tensors (CPU, contiguous, fp32/bf16 scales). Meta
    tensors (a model for memory accounting) count as the CPU they stand for."""
    return (
        wq.device.type in ("cpu", "meta")
        and scales.dtype in _SCALES
        and biases.dtype == scales.dtype
        and all(t.is_contiguous() for t in (wq, scales, biases))
    )


class Packed:
    """One packed weight, checked once, whose blocks the kernel then writes with one C call
    each (matmuls dequantize a weight block by block: mesp.ops.matmul.linear_blocks)."""

    def __init__(self, wq: Tensor, scales: Tensor, biases: Tensor, bits: int, group: int) -> None:
        self.rows, self.groups, self.group, self.bits = wq.shape[0], scales.shape[1], group, bits
        self.meta = wq.is_meta
        self.head = (
            (0, 0, 0) if self.meta else (wq.data_ptr(), scales.data_ptr(), biases.data_ptr())
        )
        self.scale_bf16 = _SCALES[scales.dtype]

    def into(
        self, out: Tensor, rows: tuple[int, int], groups: tuple[int, int], bf16_math: bool
    ) -> bool:
        """W[r0:r1, groups g0:g1] into out (r1 - r0, (g1 - g0)·group), rows out.stride(0) apart,
        each value rounded as bf16 arithmetic would when `bf16_math`. False where not served."""
        (r0, r1), (g0, g1) = rows, groups
        if (
            out.dtype not in _SCALES
            or out.ndim != 2
            or out.shape != (r1 - r0, (g1 - g0) * self.group)
            or out.stride(-1) != 1
            or not (0 <= r0 <= r1 <= self.rows and 0 <= g0 <= g1 <= self.groups)
            or out.device.type != ("meta" if self.meta else "cpu")
        ):
            return False
        if self.meta or out.numel() == 0:  # no values; like the kernel, no memory beyond out
            return True
        lib = library()
        return lib is not None and 0 == lib.mesp_dequantize(
            *self.head, out.data_ptr(), r0, r1, self.groups, g0, g1, out.stride(0), self.group,
            self.bits, self.scale_bf16, int(bf16_math), _SCALES[out.dtype], torch.get_num_threads(),
        )  # fmt: skip


def packed(wq: Tensor, scales: Tensor, biases: Tensor, bits: int, group: int) -> Packed | None:
    """The kernel's view of a packed weight; None where the kernel is not built or declines."""
    if not serves(wq, scales, biases) or library() is None:
        return None
    return Packed(wq, scales, biases, bits, group)


def dequantize_into(
    wq: Tensor, scales: Tensor, biases: Tensor, bits: int, group: int, out: Tensor,
    bf16_math: bool | None = None, groups: tuple[int, int] | None = None,
) -> bool:  # fmt: skip
    """Write every row of the weight (groups g0:g1 of each; all by default) into out, rounding
    like `bf16_math` (default: like out's dtype). False, writing nothing, where the kernel does
    not serve the tensors or is not built."""
    p = packed(wq, scales, biases, bits, group)
    if p is None:
        return False
    math16 = out.dtype == torch.bfloat16 if bf16_math is None else bf16_math
    return p.into(out, (0, p.rows), groups or (0, p.groups), math16)


def main() -> int:
    """`python -m mesp.ops.native`: build (or find) the kernel and say where it is."""
    logging.basicConfig(level=logging.INFO, format="mesp: %(message)s")
    lib = library()
    if lib is None:
        return 1
    print(f"mesp: native dequantizer ready ({lib._name})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
