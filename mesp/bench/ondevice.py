"""`mesp bench ondevice`: the native ExecuTorch runner's footprint and step time, beside the
in-process engine, on the same shapes.

Exports random weights of a named shape (`mesp export --target executorch`, 4-bit, LoRA on the
seven projections, fp32), trains `steps` SGD steps with the native runner (build/ondevice/
mesp-runner: no Python, no libtorch) and reads its per-step JSON log: step time, VmHWM and the
peak RssAnon (anonymous memory: the Linux analogue of iOS phys_footprint, which also leaves the
clean, file-backed weight mappings out). Then the in-process mesp engine runs the same
configuration in its own process (mesp.bench.child). Both without glibc's return-every-free
setting (it turns temporaries into page faults and would slow both). One row per shape.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mesp.bench.ondevice_report import PAPER_MB, label, line, section
from mesp.bench.output import write_row
from mesp.errors import MespError
from mesp.memory.poll import run_polled


@dataclass
class OndeviceConfig:
    shape: str = "qwen2.5-0.5b"
    # a real model (named, e.g. qwen2.5-coder-0.5b, or a .gguf path) instead of random weights
    # at `shape`: its codes as stored (bits / group_size unused), rows of real Python source
    model: str | None = None
    seq: int = 256
    batch: int = 1
    rank: int = 8
    bits: int = 4
    group_size: int = 64
    steps: int = 4  # the first is a warm-up: medians over the rest
    lr: float = 1e-4
    weight_block_kb: int = 0  # mesp export --weight-block-kb (0: whole matrices)
    checkpoints_on_disk: bool = False  # the native runner's --checkpoints-dir (its work dir)
    # DP-SGD's clipping (per-layer, flat) on the native runner: C 1, σ 1, q = 1 (`batch` rows,
    # each step all of them, one at a time); None: plain SFT
    dp: str | None = None
    # the runner's --checkpoint-dtype: block inputs kept as computed, or float16 / bfloat16
    checkpoint_dtype: str = "float32"

    @property
    def export_name(self) -> str:
        """The export's (and its work directory's) name: the shape or model, its seq / rank
        where not the paper's 256 / 8, its weight blocks if any."""
        name = Path(self.model).name.removesuffix(".gguf") if self.model else self.shape
        name += (f"-s{self.seq}" if self.seq != 256 else "") + (
            f"-r{self.rank}" if self.rank != 8 else ""
        )
        return name + (f"-wb{self.weight_block_kb}" if self.weight_block_kb else "")

    @property
    def name(self) -> str:
        """The row's name: the export's, and where the block inputs go if not in memory."""
        name = self.export_name + ("-ckdisk" if self.checkpoints_on_disk else "")
        name += f"-ck{self.checkpoint_dtype}" if self.checkpoint_dtype != "float32" else ""
        return name + (f"-dp-{self.dp}" if self.dp else "")


def export_programs(c: OndeviceConfig, art: Path, timeout: float) -> float | None:
    """Export (minutes: lowering is single-threaded Python), or reuse the export of a previous
    run made by the same command (recorded beside it). -> seconds taken, None when reused."""
    if c.model:  # its codes as stored
        argv = ["-m", "mesp.cli", "export", "--model", c.model, "--dtype", "float32"]
    else:
        argv = ["-m", "mesp.cli", "export", "--model", f"random:{c.shape}", "--dtype", "float32"]
        argv += ["--quantize", str(c.bits), "--group-size", str(c.group_size)]
    argv += ["--rank", str(c.rank), "--seq-len", str(c.seq), "--batch-size", str(c.batch)]
    argv += ["--target", "executorch", "--out", str(art)]
    if c.weight_block_kb:
        argv += ["--weight-block-kb", str(c.weight_block_kb)]
    stamp = art.with_name(art.name + ".argv.json")
    made_by = {"argv": argv, "code": _program_code()}
    if (art / "run_config.json").is_file() and stamp.is_file():
        if json.loads(stamp.read_text()) == made_by:
            return None
    shutil.rmtree(art, ignore_errors=True)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise MespError(f"export failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    stamp.write_text(json.dumps(made_by))
    return time.perf_counter() - t0


def _program_code() -> str:
    """SHA-256 of the sources the exported programs are made of: an export made by other code
    is made again, not reused."""
    import hashlib

    root = Path(__file__).resolve().parents[1]
    files = [root / "quant.py", *sorted((root / "ondevice").glob("*.py"))]
    files += [f for d in ("ops", "models") for f in sorted((root / d).glob("*.py"))]
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


def rows_file(c: OndeviceConfig, vocab: int, path: Path) -> Path:
    n = c.batch if c.dp else c.steps * c.batch  # DP: q = 1, the same rows every step
    if c.model:
        ids = source_rows(c.model, n, c.seq + 1)
    else:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, vocab, (n, c.seq + 1), generator=g).tolist()
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in ids))
    return path


def source_rows(model: str, n: int, length: int) -> list[list[int]]:
    """n rows of `length` tokens of real Python source: the standard library's `email` package,
    file by file in name order, through the model's own tokenizer."""
    import email

    from mesp.loading.gguf import GGUFFile
    from mesp.loading.zoo import resolve

    path = Path(resolve(model) or model)
    if path.suffix != ".gguf":
        raise MespError(f"--models {model}: bench ondevice takes a GGUF model (its tokenizer)")
    with GGUFFile(path) as g:
        tok = g.tokenizer
    ids: list[int] = []
    for f in sorted(Path(email.__file__).parent.rglob("*.py")):
        ids += tok.encode(f.read_text())
        if len(ids) >= n * length:
            break
    if len(ids) < n * length:
        raise MespError(f"{n} rows of {length} tokens are more than the email package holds")
    return [ids[i * length : (i + 1) * length] for i in range(n)]


def native_argv(c: OndeviceConfig, art: Path, data: Path, out: Path, log: Path) -> list[str]:
    """The native runner's command line: c.steps SGD steps on data, a JSON line per step."""
    from mesp.ondevice.native import binary

    argv = [str(binary()), str(art), "--data", str(data), "--steps", str(c.steps)]
    if c.checkpoints_on_disk:  # a nameless scratch file in the work directory
        argv += ["--checkpoints-dir", str(out.parent)]
    if c.dp:  # q = 1: --dp-batch is the rows' count (rows_file)
        argv += ["--dp-clip", "1", "--dp-noise", "1", "--dp-batch", str(c.batch)]
        argv += ["--dp-clipping", c.dp, "--seed", "0"]
    if c.checkpoint_dtype != "float32":
        argv += ["--checkpoint-dtype", c.checkpoint_dtype]
    return argv + ["--lr", repr(c.lr), "--out", str(out), "--json-log", str(log), "--quiet"]


def _native(c: OndeviceConfig, art: Path, work: Path, timeout: float) -> dict[str, Any]:
    conf = json.loads((art / "run_config.json").read_text())
    data = rows_file(c, conf["model"]["vocab_size"], work / "rows.jsonl")
    log, out = work / "native.jsonl", work / f"adapter-{c.name}"
    shutil.rmtree(out, ignore_errors=True)
    argv = native_argv(c, art, data, out, log)
    r = run_polled(argv, timeout)  # RssAnon read from outside every 5 ms, beside its own figure
    if r.returncode != 0:
        raise MespError(f"native runner failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    memory = steps[0].get("memory", [])  # after load, around each program's first run
    timed = steps[1:] or steps[:1]
    times = [s["time_s"] for s in timed]
    progs = conf["executorch"]["programs"]
    names = sorted({k for s in timed for k in s.get("programs", {})})  # runners before: none
    return {
        "median_s": statistics.median(times),
        "steps_s": [s["time_s"] for s in steps],
        "losses": [s["loss"] for s in steps],
        "peak_rss_bytes": max(s["peak_rss_bytes"] for s in steps),
        "peak_anon_bytes": max(s["anon_bytes"] for s in steps),
        "polled_peak_anon_bytes": r.peak_anon_bytes,
        "poll_period_s": r.period_s,
        "poll_samples": r.samples,
        "memory_events": memory,
        "planned_bytes": {k: sum(v["planned_bytes"]) for k, v in progs.items()},
        "program_s": {  # seconds in each program, median over the timed steps
            k: statistics.median([s["programs"].get(k, {"s": 0.0})["s"] for s in timed])
            for k in names
        },
        "summary": r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "",
        "adapter": str(out / "adapter_model.safetensors"),
    }


def adapter_difference(got: str, plain: str, init: Path) -> float:
    """max |got - plain| / max |plain - init| over the adapter's tensors: how far a variant's
    adapter is from the plain run's, as a share of how far training moved it."""
    from safetensors.torch import load_file

    a, b, p0 = load_file(got), load_file(plain), load_file(str(init))
    diff = max(float((a[k] - b[k]).abs().max()) for k in b)
    return diff / max(float((b[k] - p0[k]).abs().max()) for k in b)


def _engine(c: OndeviceConfig, timeout: float) -> dict[str, Any]:
    from mesp.bench.variants import ChildConfig
    from mesp.memory.rss import run_child

    cc = ChildConfig(
        variant="mesp",
        engine="mesp",
        model=c.model,
        shape=c.shape,
        seq=c.seq,
        batch=c.batch,
        rank=c.rank,
        bits=c.bits,
        group_size=c.group_size,
        dtype="float32",
        warmup=1,
        steps=max(1, c.steps - 1),
    )
    res = {}
    for part in ("memory", "time"):  # both with glibc's default malloc, as the native runner
        argv = ["-m", "mesp.bench.child", json.dumps(asdict(replace(cc, part=part)))]
        res[part] = r = run_child(argv, timeout=timeout, faithful_malloc=False)
        if r.get("status") != "ok":
            raise MespError(f"engine {part} child: {r.get('reason', r.get('status'))}")
    t = res["time"]
    return {
        "median_s": t["time"]["median_s"],
        "steps_s": t["time"]["steps_s"],
        # the time child's GEMM probe beside its steps: how fast this machine was just then
        "gemm_gflops": (t.get("gemm") or {}).get("gflops"),
        "peak_rss_bytes": res["memory"]["rss"]["peak_bytes"],
        "exact": res["memory"]["exact"],
    }


def run_ondevice(
    out: Path,
    c: OndeviceConfig,
    cmd: str,
    timeout: float = 3600.0,
    dp: tuple[str, ...] = (),
    checkpoint_dtypes: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """The plain row, then one per DP-SGD clipping in `dp` and per block-input dtype in
    `checkpoint_dtypes` (the same export and engine run; each such row also holds the plain
    native run it is compared with, as "plain", and a dtype row its adapter's difference)."""
    if set(dp) - {"per-layer", "flat"} or set(checkpoint_dtypes) - {"float16", "bfloat16"}:
        raise MespError("--dp takes per-layer, flat; --checkpoint-dtype float16, bfloat16")
    work = out / "runs" / f"ondevice-{c.export_name}"
    work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    from mesp.bench.method import machine

    export_s = export_programs(c, work / "art", timeout)
    native = _native(c, work / "art", work, timeout)
    engine = _engine(c, timeout)
    variants = [c] + [replace(c, dp=x) for x in dp]
    variants += [replace(c, checkpoint_dtype=x) for x in checkpoint_dtypes]
    rows = []
    for cc in variants:
        n = native if cc is c else _native(cc, work / "art", work, timeout)
        row = {
            "table": "ondevice",
            "status": "ok",
            "config": asdict(cc),
            "export_s": export_s,
            "native": n,
            "engine": engine,
            "command": cmd,
            "cpu": machine(),
            "load_before": load,
        }
        if cc is not c:
            row["plain"] = native
        if cc.checkpoint_dtype != c.checkpoint_dtype:
            conf = json.loads((work / "art" / "run_config.json").read_text())
            init = work / "art" / conf["lora"]["init"]
            row["adapter_vs_plain"] = adapter_difference(n["adapter"], native["adapter"], init)
        path = out / "rows" / "ondevice" / f"{cc.name}.json"
        rows.append(write_row(path, row, line, "ondevice"))
    return rows


__all__ = ["PAPER_MB", "OndeviceConfig", "label", "line", "run_ondevice", "section"]
