"""How the report's rows were measured: the machine line, the preamble (the two children, the
malloc setting, the matmul floor, the bf16 path) and which dtype heads the report. Read by
mesp.bench.report; nothing here measures anything."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from mesp.bench.cells import Row, secs
from mesp.bench.tables import TABLES


def _machines_note(rows: list[Row]) -> str:
    """Rows from CPUs with and without a bf16 GEMM: the project's machines have changed, so say
    which is which (time ratios are only taken between rows of one kind)."""
    flags = {r["bf16_gemm"] for r in rows if "bf16_gemm" in r}
    if len(flags) < 2:
        return ""
    return (
        " Rows come from two kinds of machine: ones without a bf16 GEMM (AVX2 only) and ones "
        "with AVX512-BF16, where torch's native bf16 GEMM runs about 2.5x the fp32 rate; each "
        "row's JSON says which (`bf16_gemm`), and no time ratio pairs rows of the two kinds."
    )


def _matmul_note(rows: list[Row]) -> str:
    if not any(str(r.get("matmul", "")).startswith("fp32") for r in rows):
        return ""
    return (
        "On a CPU without a native bf16 GEMM (torch's fallback is 5-160x slower than fp32), "
        "mesp computes every bf16 matmul in fp32 and rounds the result once (bf16 storage, "
        "what a native bf16 kernel computes; mesp/ops/matmul.py): the rows time the path "
        "`mesp train --dtype bfloat16` runs, and the exact peak counts its transient fp32 "
        "copies (large operands upcast in blocks of about 4 MiB). The PEFT baseline's bf16 "
        "matmuls get the same fp32 GEMM through a benchmark-only substitute, so both sides time "
        "the same kernel."
    )


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )


def table_dtypes(rows: list[Row], headline: str) -> list[str]:
    """The headline dtype first, then every other dtype the paper's tables have rows in."""
    seen = {r["config"]["dtype"] for r in rows if r.get("table") in TABLES and "config" in r}
    return [headline, *sorted(seen - {headline})]


def preamble(rows: list[Row], headline: str) -> list[str]:
    """How every row is measured: the two children, the malloc setting, the matmul floor."""
    timed = [r for r in rows if r.get("table") in TABLES and secs(r) is not None]
    old = sorted({f"{r['table']} {r['config']['dtype']}" for r in timed if "children" not in r})
    split = (
        "Each configuration runs as two fresh processes. The memory child runs with glibc set "
        "to return every free to the kernel (`MALLOC_MMAP_THRESHOLD_=65536 "
        "MALLOC_TRIM_THRESHOLD_=0`, so RSS follows live memory) and measures the exact peak and "
        "RSS; the time child runs without those variables, since they turn every temporary "
        "into fresh page faults, and measures time (each row's JSON records the malloc "
        "variables of each child under `children`)."
    )
    if old:
        split += (
            f" Timed rows of {', '.join(old)} predate that split (no `children` record): their "
            "time was measured in the memory process, under the malloc setting."
        )
    return [
        split + " Random weights of the named shape, LoRA rank r on q,k,v,o,gate,up,down, one "
        "random sequence, all tokens trained, warm-up step(s) first. Exact peak: every live "
        "tensor storage during one step (engine step + SGD step). RSS: VmHWM reset right "
        "before each untracked step, the largest rise kept. Time: median of untracked steps. "
        "Rows marked '(meta)' were measured on PyTorch's meta device (`--device meta`): the "
        "same code on shapes and dtypes without arithmetic, so their exact peak is what a CPU "
        "run holds (tested rung by rung in tests/test_bench_ladder.py) but they have no RSS and "
        "no time; a CPU row of the same configuration takes precedence.",
        "",
        "Matmul floor: 6·N·T / R. N counts the base weights that take part in matmuls (every "
        "block's q, k, v, o, gate, up, down and the LM head), T the tokens of a step, and 6 is "
        "2 flops per multiply-add for each of the forward, the recompute and the input "
        "gradient (a frozen base has no weight gradient). R is the GEMM rate (GFLOP/s) the "
        "row's own time child measured right before its steps: the block's projection shapes "
        "at T rows, forward and input-gradient layouts, best of 5 passes, in the dtype the "
        "GEMMs really run in (fp32 for bf16 rows on a CPU without a bf16 GEMM). LoRA, "
        "attention and elementwise work are outside it, so no step beats its floor; a row "
        "keeping every tape skips the recompute, so its own bound is 2/3 of its floor column.",
        "",
        _matmul_note(rows),
        "",
        f"Headline dtype: {headline}. "
        + (
            "Rows here were measured on a CPU without a native bf16 GEMM (mesp.ops.matmul's "
            "check, recorded per row as `bf16_gemm`), so fp32 rows are the headline and the "
            "targets are evaluated on them; other dtypes' tables follow as secondary sections. "
            "No table mixes dtypes."
            if headline == "float32"
            else "Other dtypes' tables follow as secondary sections. No table mixes dtypes."
        )
        + _machines_note(rows),
        "",
    ]


__all__ = ["machine", "preamble", "table_dtypes"]
