"""`mesp export --memory-report`: one warm step of the in-process engine beside the artifact
runner, measured tensor by tensor, and the table that compares them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def _mib(n: int) -> str:
    return f"{n / 2**20:9.1f}"


def memory_report(model: Any, art_dir: Path, opts: Any, seed: int = 0) -> dict[str, Any]:
    """One warm training step each (a first step makes the gradients, as in training), measured by
    the exact live-tensor tracker: the in-process mesp engine on `model`, then mesp.runner from
    the artifacts in art_dir, on the same random batch (every token trained). Frozen weights are
    the tensors read from the model or the artifact files; working is everything else the step
    allocates (activations, checkpoints, temporaries, dequantized weights)."""
    from mesp.batch import Example, collate
    from mesp.engines import make_engine
    from mesp.memory.tracker import LiveTensorTracker, adapter_tensors
    from mesp.ondevice import runner

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

    trk = LiveTensorTracker()
    art = runner.Artifacts(art_dir, on_load=lambda w: trk.register(w.values(), "weights"))
    trk.register([*art.embed_w.values(), *art.head_w.values()], "weights")
    trainer = runner.Trainer(art, art._read(art.conf["lora"]["init"]))
    ids, tgt, mask = runner.make_batch(rows, B, S)
    trainer.step(ids, tgt, mask)
    trk.register(adapter_tensors(trainer.parameters()), "adapter")
    trk.reset_peak()
    with trk:
        trainer.step(ids, tgt, mask)
    ran = trk.breakdown()
    art.on_load = None

    edge = sum(t.numel() * t.element_size() for w in (art.embed_w, art.head_w) for t in w.values())
    return {
        "seq_len": S,
        "batch_size": B,
        "engine": engine,
        "runner": ran,
        "resident": art.peak_resident_bytes,
        "edge": edge,
    }


def memory_lines(fig: dict[str, Any]) -> list[str]:
    """memory_report's figures as the table `mesp export --memory-report` prints."""
    cols = ("weights", "adapter", "working", "total")
    engine, ran, edge = fig["engine"], fig["runner"], fig["edge"]
    out = [
        f"one warm training step, seq {fig['seq_len']} x batch {fig['batch_size']}: MiB of live "
        "tensors at each one's peak (exact tracker)",
        f"{'':16}" + "".join(f"{c:>9}" for c in cols),
    ]
    for name, d in (("in-process mesp", engine), ("mesp.runner", ran)):
        out.append(f"{name:16}" + "".join(_mib(d[c]) for c in cols))
    out.append(
        f"runner frozen weights resident at most {fig['resident'] / 2**20:.1f} MiB "
        f"(embedding/norm/head {edge / 2**20:.1f} + one block "
        f"{(fig['resident'] - edge) / 2**20:.1f}); working memory "
        f"{ran['working'] / 2**20:.1f} vs engine {engine['working'] / 2**20:.1f} MiB"
    )
    return out
