"""`mesp bench dropin`: an HF + PEFT training step, as is and after `mesp.patch`, checkpointing
off and on, at a named model shape with random weights (default Qwen2.5-0.5B).

Each configuration runs in a fresh child process (`python -m mesp.bench.dropin JSON`, through
memory_rss.run_child) so one run's allocator state and caches stay out of the next. Measured
after one warm-up step: the exact live-tensor peak of one optimizer step (weights / adapter +
optimizer / working), and the median wall and process-CPU time of `steps` untracked steps.
CPU time is the one to compare on a shared machine: wall time also counts other processes'
turns on the cores. The step is what a user's loop does: `model(input_ids=…, labels=…).loss
.backward()`, then AdamW.

device="meta" builds the model on PyTorch's meta device: the same step on shapes without
arithmetic, so the exact peak of a long sequence takes seconds (no time is measured). Two shims
keep it the CPU run's peak, tensor for tensor (the tests compare them): attention goes to the
kernel CPU's SDPA picks (flash, which saves a log-sum-exp, not the attention weights; the meta
dispatcher would take the math path), and HF's packed-sequence check, which reads values, gets
the answer it gives for one unpacked row (none).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mesp.bench.output import write_row
from mesp.errors import MespError
from mesp.memory.rss import report, run_child
from mesp.models.transformer import LORA_TARGETS

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
    device: str = "cpu"  # or "meta": exact peak only, no arithmetic, no time


def _meta_shims() -> None:
    """On the meta device, take the paths a CPU run takes (see the module docstring)."""
    import torch
    import torch.nn.functional as F
    import transformers.masking_utils as mu

    mu.find_packed_sequence_indices = lambda position_ids: None  # one row: never packed
    sdpa = F.scaled_dot_product_attention

    def cpu_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):  # type: ignore[no-untyped-def]
        if not q.is_meta or attn_mask is not None or dropout_p:
            kw.update(
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
            )
            return sdpa(q, k, v, **kw)
        # CPU's flash kernel takes grouped k/v heads as they are (enable_gqa)
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return out(q, k, v, 0.0, is_causal, scale=scale)[0]

    F.scaled_dot_product_attention = cpu_sdpa


def _measure(c: DropinConfig) -> dict[str, Any]:
    """Child side: build, warm up, one tracked step, `steps` timed steps."""
    import torch
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    from mesp.bench.variants import shape_dict
    from mesp.memory.tracker import adapter_tensors, measure_peak
    from mesp.nn.patch import patch, patch_record

    if c.threads:
        torch.set_num_threads(c.threads)
    if c.device not in ("cpu", "meta"):
        raise MespError(f"device must be cpu or meta, not {c.device!r}")
    meta = c.device == "meta"
    if meta:
        _meta_shims()
    dtype = getattr(torch, c.dtype)
    d = shape_dict(c.shape)
    if d.pop("model_type") != "qwen2":
        raise MespError(f"the drop-in benchmark builds Qwen2 shapes only, not {c.shape!r}")
    torch.manual_seed(c.seed)
    lcfg = LoraConfig(
        r=c.rank, lora_alpha=2 * c.rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS)
    )
    with torch.device(c.device):
        hf = tf.AutoModelForCausalLM.from_config(tf.Qwen2Config(**d), dtype=dtype)
        model = get_peft_model(hf, lcfg).train()  # HF checkpoints only in training mode
    if c.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    swapped = 0
    if c.patched:
        patch(model, mlp_recompute=c.mlp_recompute)
        rec = patch_record(model)
        if rec is None or not rec.loss or rec.skipped:
            raise MespError(f"mesp.patch did not take: {rec}")
        swapped = len(rec.names)  # 7 LoRA linears + 1 MLP per layer
    params = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(c.seed + 1)
    ids = torch.randint(0, d["vocab_size"], (c.batch, c.seq), generator=g)
    inputs = ids.to(c.device)  # labels stay on the host: both losses move them as needed

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=inputs, labels=ids, use_cache=False).loss  # HF shifts labels
        loss.backward()
        opt.step()
        return float("nan") if meta else float(loss.detach())

    losses = [step() for _ in range(c.warmup)]
    gc.collect()
    t = time.perf_counter()
    peak = measure_peak(
        lambda: losses.append(step()),
        weights=frozen,
        adapter=lambda: adapter_tensors(params, opt),
    )
    tracked_s = time.perf_counter() - t
    times, cpu = [], []
    for _ in range(0 if meta else max(1, c.steps)):
        gc.collect()
        t, t_cpu = time.perf_counter(), time.process_time()
        losses.append(step())
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - t_cpu)
    return {
        "config": asdict(c),
        "exact": peak,
        "time_s": statistics.median(times) if times else None,
        "times_s": times,
        "cpu_s": statistics.median(cpu) if cpu else None,
        "cpus_s": cpu,
        "tracked_s": tracked_s,
        "losses": losses,
        "threads": torch.get_num_threads(),
        "patched_modules": swapped,
    }


CONFIG_NAMES = {
    (False, False): "unpatched",
    (False, True): "unpatched+gc",
    (True, False): "patched",
    (True, True): "patched+gc",
}
MEMORY_TARGET, TIME_TARGET = 0.5, 1.1  # patched / unpatched, same checkpointing setting


def config_name(c: dict[str, Any]) -> str:
    return CONFIG_NAMES[(bool(c["patched"]), bool(c["checkpointing"]))]


def row_path(out: Path, c: DropinConfig) -> Path:
    gc_ = "gc" if c.checkpointing else "nogc"
    dev = "" if c.device == "cpu" else f"_{c.device}"
    name = f"{'patched' if c.patched else 'unpatched'}_{gc_}_{c.shape}_s{c.seq}_{c.dtype}{dev}.json"
    return out / "rows" / "dropin" / name


def _skipped(skip: tuple[str, ...], c: DropinConfig) -> bool:
    """skip entries: a configuration name (patched+gc), optionally @seq (unpatched@1024)."""
    name = CONFIG_NAMES[(c.patched, c.checkpointing)]
    return any(s == name or s == f"{name}@{c.seq}" for s in skip)


def run(
    seq_lens: tuple[int, ...] = (256, 1024),
    shape: str = "qwen2.5-0.5b",
    dtype: str = "float32",
    steps: int = 2,
    threads: int | None = None,
    mlp_recompute: bool = False,
    timeout: float = 3600.0,
    *,
    rank: int = 8,
    warmup: int = 1,
    device: str = "cpu",
    out: Path | None = None,
    command: str = "",
    skip: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """One row per (seq, patched, checkpointing), each measured in its own child process; with
    `out`, each row is also written to OUT/rows/dropin/ as soon as it is measured. A child that
    fails or times out becomes a row with status "failed" and the reason; `skip` ones "skipped"."""
    rows = []
    for seq in seq_lens:
        for patched, ckpt in CONFIGS:
            c = DropinConfig(patched, ckpt, shape, seq, rank=rank, dtype=dtype, steps=steps)
            c.warmup, c.threads, c.mlp_recompute = warmup, threads, mlp_recompute
            c.device = device
            load = os.getloadavg()[0]
            if _skipped(skip, c):
                res: dict[str, Any] = {
                    "status": "skipped",
                    "reason": "--skip",
                    "config": asdict(c),
                }
            else:
                try:
                    res = run_child(
                        ["-m", "mesp.bench.dropin", json.dumps(asdict(c))],
                        timeout=timeout,
                    )
                except MespError as e:
                    res = {"status": "failed", "reason": str(e), "config": asdict(c)}
            row = {"table": "dropin", **res, "command": command, "load_before": load}
            if out is not None:
                write_row(row_path(out, c), row, indent=1)
            rows.append(row)
            print(line(row), file=sys.stderr, flush=True)
    return rows


def line(row: dict[str, Any]) -> str:
    c = row["config"]
    head = f"seq {c['seq']:5d}  {config_name(c):<12}"
    if row.get("status") != "ok":
        return f"{head}  {row.get('status')}: {row.get('reason', '')}"
    e = row["exact"]
    mem = f"{head}  working {e['working'] / MIB:8.1f} MiB  total {e['total'] / MIB:8.1f} MiB"
    if row.get("time_s") is None:
        return f"{mem}  ({c.get('device', 'cpu')}: no time)"
    return f"{mem}  step {row['cpu_s']:7.2f} s CPU, {row['time_s']:7.2f} s wall"


def _child(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m mesp.bench.dropin '<json config>'", file=sys.stderr)
        return 2
    c = DropinConfig(**json.loads(argv[0]))
    try:
        report(status="ok", **_measure(c))
    except MespError as e:
        report(status="failed", reason=str(e), config=asdict(c))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
