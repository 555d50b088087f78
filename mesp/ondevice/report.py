"""`mesp export --memory-report`: one warm step of the in-process engine, measured tensor by
tensor, beside what the exported .pte programs' own plan says a step of the runners holds.

The plan side reads only the export's run_config.json (its file tables and program rows):
  weights  the embedding / final norm / head file plus the largest block file (both drivers read
           a block's weights just before it runs and drop them after; the native runner maps
           them from the files, so on the device they are page cache, not anonymous memory);
  adapter  the LoRA tensors plus one block's gradients (each block's update runs right after its
           backward, so no whole-model gradient is held); AdamW adds two more adapters of state;
  working  the memory-planned arenas (one per planned-buffer index, each the largest any program
           plans: the native runner allocates exactly these) plus the block-input checkpoints.
Not in the plan: the runtime and its libraries, and XNNPACK's own workspace, which only a run
shows (`mesp bench ondevice`, the native runner's RssAnon / Private_Dirty log).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from mesp.errors import MespError
from mesp.ondevice.artifact_files import ST_DTYPES


def _mib(n: int) -> str:
    return f"{n / 2**20:9.1f}"


_DTYPES = {name: dt for dt, name in ST_DTYPES.items()}


def _bytes(table: dict[str, Any]) -> int:
    """Bytes of the tensors a run_config.json table lists (dtype names and shapes)."""
    return sum(
        torch.empty(0, dtype=_DTYPES[t["dtype"]]).element_size() * math.prod(t["shape"])
        for t in table.values()
    )


def planned_step(art_dir: Path) -> dict[str, Any]:
    """What one step of the .pte programs holds, by the export's plan (see the module doc)."""
    conf = json.loads((art_dir / "run_config.json").read_text())
    et = conf.get("executorch")
    if not isinstance(et, dict):
        raise MespError(f"{art_dir}: no ExecuTorch programs (an export of an older mesp?)")
    progs = et["programs"]
    arenas: list[int] = []
    for row in progs.values():
        for i, n in enumerate(row["planned_bytes"]):
            arenas += [0] * (i + 1 - len(arenas))
            arenas[i] = max(arenas[i], int(n))
    largest = max(progs, key=lambda k: sum(progs[k]["planned_bytes"]))
    files = {rel: f["tensors"] for rel, f in conf["files"].items()}
    edge = _bytes(files["embedding.safetensors"]) + _bytes(files["head.safetensors"])
    one_block = max(_bytes(b["tensors"]) for b in conf["blocks"])
    adapter = _bytes(files[conf["lora"]["init"]])
    grads = max(_bytes(b["lora"]) for b in conf["blocks"])  # one block's, at most
    m, act = conf["model"], torch.empty(0, dtype=getattr(torch, conf["dtype"])).element_size()
    checkpoints = act * m["num_hidden_layers"] * conf["batch_size"] * conf["seq_len"]
    checkpoints *= m["hidden_size"]
    return {
        "weights": edge + one_block,
        "adapter": adapter + grads,
        "working": sum(arenas) + checkpoints,
        "total": edge + one_block + adapter + grads + sum(arenas) + checkpoints,
        "edge": edge,
        "one_block": one_block,
        "lora": adapter,
        "grads": grads,
        "arena": sum(arenas),
        "checkpoints": checkpoints,
        "largest": largest,
        "programs": {k: sum(r["planned_bytes"]) for k, r in progs.items()},
        "backend": et.get("backend", "?"),
        "kernels": "mesp::qlinear.out" in et.get("kernels", []),  # the products' block buffers
    }


def memory_report(model: Any, art_dir: Path, opts: Any, seed: int = 0) -> dict[str, Any]:
    """One warm training step of the in-process mesp engine on `model` (a first step makes the
    gradients, as in training), measured by the exact live-tensor tracker on a random batch (every
    token trained); beside it, the plan of the export in art_dir."""
    from mesp.batch import Example, collate
    from mesp.engines import make_engine
    from mesp.memory.tracker import LiveTensorTracker, adapter_tensors

    B, S = opts.batch_size, opts.seq_len
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    rows = [
        (torch.randint(0, vocab, (S + 1,), generator=g).tolist(), [1] * (S + 1)) for _ in range(B)
    ]
    batch = collate([Example(ids, mask) for ids, mask in rows])
    eng = make_engine("mesp", vocab_chunk=opts.vocab_chunk)
    eng.step(model, batch, batch.n_tokens)
    ref = LiveTensorTracker()
    ref.register(model.buffers(), "weights")
    ref.register(adapter_tensors(model.lora_parameters()), "adapter")
    with ref:
        eng.step(model, batch, batch.n_tokens)
    engine = ref.breakdown()
    for p in model.lora_parameters():
        p.grad = None
    return {"seq_len": S, "batch_size": B, "engine": engine, "plan": planned_step(art_dir)}


def memory_lines(fig: dict[str, Any]) -> list[str]:
    """memory_report's figures as the table `mesp export --memory-report` prints."""
    cols = ("weights", "adapter", "working", "total")
    engine, plan = fig["engine"], fig["plan"]
    top = sorted(plan["programs"].items(), key=lambda kv: -kv[1])[:4]
    return [
        f"one training step, seq {fig['seq_len']} x batch {fig['batch_size']}, MiB: the engine "
        "measured (exact tracker, at its peak), the .pte programs by their plan",
        f"{'':16}" + "".join(f"{c:>9}" for c in cols),
        f"{'in-process mesp':16}" + "".join(_mib(engine[c]) for c in cols),
        f"{'.pte plan':16}" + "".join(_mib(plan[c]) for c in cols),
        f".pte weights: embedding/norm/head {plan['edge'] / 2**20:.1f} + one block "
        f"{plan['one_block'] / 2**20:.1f} (read per block); adapter: LoRA "
        f"{plan['lora'] / 2**20:.1f} + one block's gradients {plan['grads'] / 2**20:.1f} "
        f"(AdamW adds {2 * plan['lora'] / 2**20:.1f} of state)",
        f".pte working: planned arenas {plan['arena'] / 2**20:.1f} (the largest program, "
        f"{plan['largest']}, sizes them) + block-input checkpoints "
        f"{plan['checkpoints'] / 2**20:.1f}; programs' planned MiB: "
        + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in top),
        f"not planned: the runtime, its libraries, the {plan['backend']} workspace"
        + (" and mesp's kernels' block buffers (2 x 640 KiB a thread)" if plan["kernels"] else "")
        + " (measured by `mesp bench ondevice`)",
    ]
