"""`mesp bench dropin`: an HF + PEFT training step, as is and after `mesp.patch`, checkpointing
off and on, at a named model shape with random weights (default Qwen2.5-0.5B).

Each configuration runs in a fresh child process (`python -m mesp.dropin_bench JSON`, through
memory_rss.run_child) so one run's allocator state and caches stay out of the next. Measured
after one warm-up step: the exact live-tensor peak of one optimizer step (weights / adapter +
optimizer / working), and the median wall and process-CPU time of `steps` untracked steps.
CPU time is the one to compare on a shared machine: wall time also counts other processes'
turns on the cores. The step is what a user's loop does: `model(input_ids=…, labels=…).loss
.backward()`, then AdamW.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from mesp.errors import MespError
from mesp.memory_rss import report, run_child

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (patched, checkpointing) in table order: each patched run right after its baseline.
CONFIGS = ((False, False), (True, False), (False, True), (True, True))
MIB = 1 << 20


@dataclass
class DropinConfig:
    patched: bool
    checkpointing: bool
    shape: str = "qwen2.5-0.5b"
    seq: int = 256
    batch: int = 1
    rank: int = 8
    dtype: str = "float32"
    steps: int = 2
    warmup: int = 1
    seed: int = 0
    threads: int | None = None  # torch threads; None: torch's default
    mlp_recompute: bool = False


def _measure(c: DropinConfig) -> dict[str, Any]:
    """Child side: build, warm up, one tracked step, `steps` timed steps."""
    import torch
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    from mesp.bench_child import shape_dict
    from mesp.memory_tracker import adapter_tensors, measure_peak
    from mesp.patch import patch

    if c.threads:
        torch.set_num_threads(c.threads)
    dtype = getattr(torch, c.dtype)
    d = shape_dict(c.shape)
    if d.pop("model_type") != "qwen2":
        raise MespError(f"the drop-in benchmark builds Qwen2 shapes only, not {c.shape!r}")
    torch.manual_seed(c.seed)
    hf = tf.AutoModelForCausalLM.from_config(tf.Qwen2Config(**d), dtype=dtype)
    lcfg = LoraConfig(
        r=c.rank, lora_alpha=2 * c.rank, lora_dropout=0.0, target_modules=LORA_TARGETS
    )
    model = get_peft_model(hf, lcfg).train()  # HF checkpoints only in training mode
    if c.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if c.patched:
        patch(model, mlp_recompute=c.mlp_recompute)
    params = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(c.seed + 1)
    ids = torch.randint(0, d["vocab_size"], (c.batch, c.seq), generator=g)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # HF shifts the labels
        loss.backward()
        opt.step()
        return float(loss.detach())

    losses = [step() for _ in range(c.warmup)]
    gc.collect()
    t = time.perf_counter()
    peak = measure_peak(
        lambda: losses.append(step()), weights=frozen, adapter=lambda: adapter_tensors(params, opt)
    )
    tracked_s = time.perf_counter() - t
    times, cpu = [], []
    for _ in range(max(1, c.steps)):
        gc.collect()
        t, t_cpu = time.perf_counter(), time.process_time()
        losses.append(step())
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - t_cpu)
    return {
        "config": asdict(c),
        "exact": peak,
        "time_s": statistics.median(times),
        "times_s": times,
        "cpu_s": statistics.median(cpu),
        "cpus_s": cpu,
        "tracked_s": tracked_s,
        "losses": losses,
        "threads": torch.get_num_threads(),
    }


def run(
    seq_lens: tuple[int, ...] = (256, 1024),
    shape: str = "qwen2.5-0.5b",
    dtype: str = "float32",
    steps: int = 2,
    threads: int | None = None,
    mlp_recompute: bool = False,
    timeout: float = 3600.0,
) -> list[dict[str, Any]]:
    """One row per (seq, patched, checkpointing), each measured in its own child process."""
    rows = []
    for seq in seq_lens:
        for patched, ckpt in CONFIGS:
            c = DropinConfig(patched, ckpt, shape, seq, dtype=dtype, steps=steps, threads=threads)
            c.mlp_recompute = mlp_recompute
            out = run_child(["-m", "mesp.dropin_bench", json.dumps(asdict(c))], timeout=timeout)
            if out.get("status") != "ok":
                raise MespError(f"drop-in benchmark child failed: {out.get('reason')}")
            rows.append(out)
            print(_line(out), file=sys.stderr, flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    c, e = row["config"], row["exact"]
    return (
        f"seq {c['seq']:5d}  ckpt {'on ' if c['checkpointing'] else 'off'}  "
        f"{'patched  ' if c['patched'] else 'unpatched'}  working {e['working'] / MIB:8.1f} MiB  "
        f"total {e['total'] / MIB:8.1f} MiB  step {row['cpu_s']:7.2f} s CPU, {row['time_s']:7.2f} s"
    )


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table: per seq and checkpointing setting, unpatched vs patched and the ratios."""
    by = {
        (r["config"]["seq"], r["config"]["checkpointing"], r["config"]["patched"]): r for r in rows
    }
    head = (
        "| seq | ckpt | working MiB unpatched → patched (×) | total MiB unpatched → patched (×)"
        " | step CPU s unpatched → patched (×) | step wall s unpatched → patched (×) |"
        "\n|---|---|---|---|---|---|"
    )
    lines = [head]
    for seq, ckpt in sorted({(s, k) for s, k, _ in by}):
        u, p = by.get((seq, ckpt, False)), by.get((seq, ckpt, True))
        if u is None or p is None:
            continue
        cells = []
        for key, fmt in (("working", ".0f"), ("total", ".0f"), ("cpu_s", ".1f"), ("time_s", ".1f")):
            a, b = (r[key] if key.endswith("_s") else r["exact"][key] / MIB for r in (u, p))
            cells.append(f"{a:{fmt}} → {b:{fmt}} ({b / a:.2f})")
        lines.append(f"| {seq} | {'on' if ckpt else 'off'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="mesp bench dropin",
        description="HF + PEFT step memory and time, unpatched vs mesp.patch, checkpointing off/on",
    )
    p.add_argument("--seq", type=int, nargs="+", default=[256, 1024], help="sequence lengths")
    p.add_argument("--shape", default="qwen2.5-0.5b", help="a Qwen2 shape, or tiny-qwen2")
    p.add_argument("--dtype", default="float32", help="float32 (fastest on CPU) or bfloat16")
    p.add_argument("--steps", type=int, default=2, help="timed steps per configuration")
    p.add_argument("--threads", type=int, default=None, help="torch threads in each child")
    p.add_argument("--mlp-recompute", action="store_true", help="fused MLP keeps only x")
    p.add_argument("--out", default=None, help="also write the rows to this JSON file")
    ns = p.parse_args(argv)
    rows = run(tuple(ns.seq), ns.shape, ns.dtype, ns.steps, ns.threads, ns.mlp_recompute)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{ns.shape}, {ns.dtype}, batch 1, LoRA r=8 on all 7 projections, AdamW\n")
    print(table(rows))
    return 0


def _child(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m mesp.dropin_bench '<json config>'", file=sys.stderr)
        return 2
    c = DropinConfig(**json.loads(argv[0]))
    try:
        report(status="ok", **_measure(c))
    except MespError as e:
        report(status="skipped", reason=str(e), config=asdict(c))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
