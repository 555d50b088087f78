"""`mesp bench ladder`: the Qualcomm paper's peak-memory ladder (arXiv 2606.19528) on our stack.

Each rung adds one technique to the one above, at Qwen2.5-3B shapes (random weights), fp32
compute as in the paper, LoRA rank 8 on the seven projections, 30% of positions trained (the
paper's setup; the rungs before logits masking still form logits for every position):

  fp32 + LoRA        bp, unquantized base, full logits
  + 4-bit            base quantized (MLX layout, group 64), dequantized on the fly
  + mebp             block checkpoints, autograd recompute per block (MeBP)
  + mesp             hand backward per block (MeSP); loss still on full logits in one block
  + chunked CE       the loss in 512-row x 8192-token tiles
  + logits masking   logits only for trained positions
  + sampled softmax  softmax over targets + 1000 tokens (approximate)
  + disk offload     block checkpoints on disk, prefetched in backward
  + weight streaming frozen block weights on disk too, one block (+ the next) in memory

Every rung is measured in its own process with the exact live-tensor tracker: total bytes of
every tensor alive at the step's peak (weights + adapter + everything else). By default on the
meta device: the same code runs with shapes and dtypes but no arithmetic, so 3B at 16k tokens
is measured in seconds on any machine; a test holds the meta peak equal to the CPU peak on
every rung, up to the host copies of the index vectors (bytes of order 16 per token).
`--device cpu` measures with real arithmetic instead (and adds RSS and time).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesp.bench.output import pyplot, write_row
from mesp.bench.variants import ChildConfig

GB = 1e9
_CHUNKED = {"chunk_rows": 512, "vocab_chunk": 8192}
_SAMPLED = {"loss": "sampled-softmax", "vocab_subset": 1000}
RUNGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("lora", "fp32 + LoRA", {"engine": "bp", "bits": None, "mask_logits": False}),
    ("4bit", "+ 4-bit", {"engine": "bp", "mask_logits": False}),
    ("mebp", "+ mebp (checkpointing)", {"engine": "mebp", "mask_logits": False}),
    (
        "mesp",
        "+ mesp",
        {"engine": "mesp", "chunk_rows": None, "vocab_chunk": None, "mask_logits": False},
    ),
    ("chunked", "+ chunked CE", {"engine": "mesp", **_CHUNKED, "mask_logits": False}),
    ("masking", "+ logits masking", {"engine": "mesp", **_CHUNKED}),
    ("sampled", "+ sampled softmax (K=1000)", {"engine": "mesp", **_CHUNKED, **_SAMPLED}),
    ("offload", "+ disk offload", {"engine": "mesp", **_CHUNKED, **_SAMPLED, "offload": "disk"}),
    (
        "stream",
        "+ weight streaming",
        {"engine": "mesp", **_CHUNKED, **_SAMPLED, "offload": "disk", "stream_weights": True},
    ),
)
# FACTS.md: the paper's ladder, Llama-3.2-3B, A100, fp32, GB (OOM: None).
PAPER_LLAMA = {
    "fp32 + LoRA": {1024: 19.10, 2048: 26.20, 4096: 40.41, 8192: 68.83},
    "+ 4-bit": {1024: 8.80, 2048: 14.68, 4096: 27.48, 8192: 53.07},
    "+ checkpointing": {1024: 2.37, 2048: 3.33, 4096: 6.29, 8192: 12.21, 16384: 24.05},
    "+ softmax approx": {1024: 1.30, 2048: 2.43, 4096: 5.41, 8192: 11.58, 16384: 23.79},
    "+ logits masking": {1024: 0.70, 2048: 1.02, 4096: 1.59, 8192: 3.24, 16384: 6.95},
}
PAPER_QWEN_MASKING_4096 = 1.71  # GB, Qwen-2.5-3B, the paper's last rung at 4096 (the issue)


@dataclass
class LadderOptions:
    shape: str = "qwen2.5-3b"
    seqs: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    device: str = "meta"
    dtype: str = "float32"
    fraction: float = 0.3
    rungs: tuple[str, ...] | None = None  # keys of RUNGS; None: all
    timeout: float = 3600.0
    threads: int | None = None
    out: Path = Path("bench_results")
    command: str = ""


def ladder_configs(o: LadderOptions) -> list[ChildConfig]:
    keys = [k for k, _, _ in RUNGS]
    bad = [r for r in o.rungs or () if r not in keys]
    if bad:
        from mesp.errors import MespError

        raise MespError(f"unknown rung(s) {bad}; choose from {', '.join(keys)}")
    return [
        ChildConfig(
            variant=key,
            shape=o.shape,
            seq=seq,
            dtype=o.dtype,
            device=o.device,
            loss_fraction=o.fraction,
            warmup=1,
            steps=1,
            threads=o.threads,
            matmul="native",
            **over,
        )
        for seq in o.seqs
        for key, _, over in RUNGS
        if o.rungs is None or key in o.rungs
    ]


def row_path(out: Path, c: ChildConfig) -> Path:
    return out / "rows" / "ladder" / f"{c.variant}_{c.shape}_s{c.seq}_{c.dtype}_{c.device}.json"


def run_ladder(o: LadderOptions) -> list[dict[str, Any]]:
    from mesp.bench.tables import run_config

    env = {"OMP_NUM_THREADS": str(o.threads)} if o.threads else {}
    rows = []
    for c in ladder_configs(o):
        row = run_config(c, o.timeout, env)
        row.update(table="ladder", command=o.command)
        rows.append(write_row(row_path(o.out, c), row, line, "ladder"))
    return rows


def label(key: str) -> str:
    return next(lab for k, lab, _ in RUNGS if k == key)


def line(row: dict[str, Any]) -> str:
    c = row["config"]
    head = f"{label(c['variant']):<28} {c['shape']} s{c['seq']} {c['device']}:"
    if row["status"] != "ok":
        return f"{head} {row['status']} ({row.get('reason', '')})"
    return f"{head} peak {row['exact']['total'] / GB:.3f} GB"


def _index(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    return {
        (r["config"]["variant"], r["config"]["seq"]): r
        for r in rows
        if r.get("table") == "ladder" and r.get("status") == "ok"
    }


def section(rows: list[dict[str, Any]]) -> list[str]:
    """The ladder as a markdown table (GB = 1e9 bytes, as the paper), with the paper's rungs."""
    idx = _index(rows)
    if not idx:
        return []
    seqs = sorted({s for _, s in idx})
    c = next(iter(idx.values()))["config"]
    lines = [
        "## The peak-memory ladder (Qualcomm, arXiv 2606.19528)",
        "",
        f"{c['shape']} shapes, random weights, {c['dtype']}, LoRA rank {c['rank']} on q,k,v,o,"
        f"gate,up,down, batch 1, {c['loss_fraction']:.0%} of positions trained. Peak = exact "
        f"live-tensor total (weights + adapter + working), GB = 1e9 bytes, measured on the "
        f"{c['device']} device (see mesp/bench/ladder.py). Paper rows: Llama-3.2-3B on an A100.",
        "",
        "| rung | " + " | ".join(f"seq {s}" for s in seqs) + " |",
        "|---|" + "---|" * len(seqs),
    ]
    for key, lab, _ in RUNGS:
        cells = [
            f"{idx[(key, s)]['exact']['total'] / GB:.3f}" if (key, s) in idx else "–" for s in seqs
        ]
        lines.append(f"| {lab} | " + " | ".join(cells) + " |")
    for lab, vals in PAPER_LLAMA.items():
        cells = [f"{vals[s]:.2f}" if s in vals else "OOM" for s in seqs]
        lines.append(f"| paper: {lab} | " + " | ".join(cells) + " |")
    masking, stream = idx.get(("masking", 4096)), idx.get(("stream", 4096))

    def vs_paper(row: dict[str, Any]) -> str:
        gb = row["exact"]["total"] / GB
        r = PAPER_QWEN_MASKING_4096 / gb
        return f"{gb:.3f} GB ({r:.1f}x lower)" if r >= 1 else f"{gb:.3f} GB ({1 / r:.1f}x higher)"

    if masking is not None:
        lines += [
            "",
            f"At 4096 tokens the paper's last rung (logits masking) is {PAPER_QWEN_MASKING_4096}"
            f" GB for Qwen-2.5-3B. Ours at that rung: {vs_paper(masking)}; with every rung: "
            + (vs_paper(stream) if stream is not None else "not measured")
            + ". Once the loss is chunked, the peak sits in a block's backward, not in the "
            "loss: logits masking and the sampled softmax then cut the loss's time, not the "
            "peak (see the sampled-softmax table); what remains is the resident 4-bit "
            "weights (streamed in the last rung), the checkpoints (offloaded) and one block's "
            "working set (its MLP in 512-token tiles).",
        ]
    return [*lines, ""]


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    idx = _index(rows)
    if not idx:
        return None
    plt = pyplot()
    seqs = sorted({s for _, s in idx})
    fig, ax = plt.subplots(figsize=(9, 5))
    for key, lab, _ in RUNGS:
        pts = [(s, idx[(key, s)]["exact"]["total"] / GB) for s in seqs if (key, s) in idx]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=lab)
    for lab in ("+ checkpointing", "+ logits masking"):
        pts = sorted(PAPER_LLAMA[lab].items())
        ax.plot(*zip(*pts, strict=True), ls="--", color="gray", marker="x", label=f"paper {lab}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak memory (GB)")
    ax.set_title("Peak-memory ladder, Qwen2.5-3B shapes, fp32")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["RUNGS", "LadderOptions", "ladder_configs", "plot", "run_ladder", "section"]
