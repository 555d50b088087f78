"""The Python driver of `mesp export`'s .pte programs, through `executorch.runtime`.

The reference for the native runner (runtime/): the same .pte files, the same inputs by name
(run_config.json "executorch"), the same loop, and the optimizer update through the exported
sgd / adamw programs, so that the two drivers differ only in who calls ExecuTorch. One step:
  embed -> for each block: read its weights file, forward, drop the weights (keep the input)
  -> the loss programs (trained rows only; start, one call per vocabulary slice, finish)
  -> for each block in reverse: read, recompute + hand
  backward in one program, drop, then the update program on that block's adapter tensors.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from mesp.ondevice import private
from mesp.ondevice.contract import ADAMW_SCALARS, ET_VERSION, adamw_scalars, fnv1a64
from mesp.ondevice.kernels import KernelError, load_kernels
from mesp.ondevice.runner import (
    PEFT_PREFIX,
    Artifacts,
    RunConfig,
    RunnerError,
    add_arguments,
    batches,
    make_batch,
    run_cli,
)

Tensors = dict[str, torch.Tensor]


class Programs:
    """Every .pte of the export, checked (size, digest) and loaded once; `run(name, src)` feeds
    a program its inputs by name and returns its outputs by name (copied out of its arena)."""

    def __init__(self, art: Artifacts) -> None:
        try:
            from executorch.runtime import Runtime, Verification
        except ImportError:
            raise RunnerError(
                "the ExecuTorch driver needs the executorch package (pip install "
                "executorch==1.5.1 torchao==0.18.0); or run the native runner"
            ) from None
        et = art.conf.get("executorch")
        if not isinstance(et, dict):
            raise RunnerError(
                f"{art.root}: no ExecuTorch programs (.pt2 programs of an older mesp?): "
                "export again with mesp export"
            )
        if et.get("version") != ET_VERSION:
            raise RunnerError(
                f"{art.root}: ExecuTorch programs of format {et.get('version')}, this mesp runs "
                f"{ET_VERSION}: export again with this mesp"
            )
        self.rows: dict[str, Any] = et["programs"]
        if et.get("kernels"):  # mesp::qlinear, qmatmul, gated_act*: registered before any load
            try:
                load_kernels()
            except KernelError as e:
                raise RunnerError(
                    f"{art.root}: its programs call mesp's kernels ({e}); export with "
                    "--aten-dequant for programs without them"
                ) from None
        rt = Runtime.get()
        self._programs, self._methods = {}, {}
        for name, row in self.rows.items():
            p = art.root / row["pte"]
            try:
                data = p.read_bytes()
            except OSError as e:
                raise RunnerError(f"{p}: missing or unreadable ({e.strerror or e})") from None
            if len(data) != row["size"]:
                raise RunnerError(f"{p}: truncated or changed ({len(data)} of {row['size']} bytes)")
            if fnv1a64(data) != row["fnv1a64"]:
                raise RunnerError(f"{p}: not the program of this export (digest differs)")
            try:
                prog = rt.load_program(data, verification=Verification.Minimal)
                self._methods[name] = prog.load_method(row["method"])
            except Exception as e:  # the runtime raises RuntimeError/ValueError with codes
                raise RunnerError(f"{p}: ExecuTorch refused it ({e})") from None
            self._programs[name] = prog  # a Method does not keep its Program alive

    def run(self, name: str, src: Callable[[str], torch.Tensor]) -> Tensors:
        row = self.rows[name]
        ins = [src(r["name"]).contiguous() for r in row["inputs"]]
        outs = self._methods[name].execute(ins)
        return {r["name"]: t.clone() for r, t in zip(row["outputs"], outs, strict=True)}


class Checkpoints:
    """The block inputs of one step: in memory, or (a directory given) in a nameless scratch
    file there, written in the forward and read back in the backward, as the native runner's
    --checkpoints-dir. Kept as computed, the bytes come back as they went, so the numbers are
    the same; `dtype` float16 / bfloat16 keeps each rounded to nearest even (the runner's
    --checkpoint-dtype, runtime/src/checkpoints.h) and widens it back for the backward."""

    def __init__(self, where: str | None, dtype: torch.dtype = torch.float32) -> None:
        self.kept: list[torch.Tensor] = []
        self.file: Any = None
        self.dtype = dtype
        if where is not None:
            try:
                self.file = tempfile.TemporaryFile(dir=where, prefix=".mesp-checkpoints-")
            except OSError as e:
                raise RunnerError(
                    f"--checkpoints-dir {where}: cannot create a scratch file there "
                    f"({e.strerror or e})"
                ) from None

    def put(self, i: int, h: torch.Tensor) -> None:
        full, h = h, h.to(self.dtype)
        if h.dtype != full.dtype and bool((h.isinf() & full.isfinite()).any()):
            name = str(self.dtype).removeprefix("torch.")
            top = float(full[full.isfinite()].abs().max())
            limit, use = {"float16": ("65504", "bfloat16 or float32")}.get(
                name, ("3.39e38", "float32")
            )
            raise RunnerError(
                f"--checkpoint-dtype {name}: block {i}'s input reaches {top:.4g}, past {name}'s "
                f"largest ({limit}); use {use}; no adapter written"
            )
        if self.file is None:
            if i == 0:
                self.kept.clear()
            self.kept.append(h)
            return
        self.file.seek(i * h.numel() * h.element_size())
        self.file.write(h.contiguous().view(torch.uint8).numpy().tobytes())

    def get(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """Block i's input (the backward asks last block first: each is dropped after)."""
        if self.file is None:
            assert len(self.kept) == i + 1
            return self.kept.pop().to(like.dtype)
        n = like.numel() * self.dtype.itemsize
        self.file.seek(i * n)
        data = bytearray(self.file.read(n))
        return torch.frombuffer(data, dtype=self.dtype).view(like.shape).to(like.dtype)


class EtTrainer:
    """Adapter tensors (per block, by key) and their optimizer state; the step and the update."""

    def __init__(self, art: Artifacts, cfg: RunConfig) -> None:
        self.art, self.cfg, conf = art, cfg, art.conf
        dtype = getattr(torch, cfg.checkpoint_dtype)
        self.checkpoints = Checkpoints(cfg.checkpoints_dir, dtype)  # refused before any program
        self.progs = Programs(art)
        self.loss_spec: dict[str, Any] = conf["executorch"]["loss"]
        init = art._read(conf["lora"]["init"])
        self.blocks = conf["blocks"]
        self.lora: list[Tensors] = []
        for i, b in enumerate(self.blocks):
            names = [
                r["name"][5:]
                for r in self.progs.rows[f"{b['fn']}.forward"]["inputs"]
                if r["name"].startswith("lora/")
            ]
            self.lora.append(
                {k: init[f"{PEFT_PREFIX}model.layers.{i}.{k}.weight"].clone() for k in names}
            )
        self.m = [{k: torch.zeros_like(t) for k, t in d.items()} for d in self.lora]
        self.v = [{k: torch.zeros_like(t) for k, t in d.items()} for d in self.lora]
        self.t = 0

    def _src(self, w: Tensors, i: int | None, extra: Tensors) -> Callable[[str], torch.Tensor]:
        lt = None if i is None else self.blocks[i]["layer_type"]

        def src(name: str) -> torch.Tensor:
            kind, _, key = name.partition("/")
            if kind == "weights":
                return w[key]
            if kind == "lora" and i is not None:
                return self.lora[i][key]
            if kind == "ctx":
                return self.art.ctx[f"{lt}.{key}"]
            return extra[name]

        return src

    @torch.no_grad()
    def step(
        self, ids: torch.Tensor, tgt: torch.Tensor, mask: torch.Tensor, k: int = 0
    ) -> float | None:
        """One step: forward, loss, then the blocks in reverse, each block's adapter updated
        right after its backward (its parameters are not read again this step, and no update
        depends on another block's gradient: exact, and only one block's gradients are held).
        A non-finite loss raises before anything is updated."""
        n = int(mask.sum())
        if n == 0:
            return None
        loss, g = self.forward_loss(ids, tgt, mask, k)
        scal = self._scalars()
        self.backward(g, lambda i, grads: self._update(i, grads, scal))
        return loss / n

    @torch.no_grad()
    def forward_loss(
        self, ids: torch.Tensor, tgt: torch.Tensor, mask: torch.Tensor, k: int
    ) -> tuple[float, torch.Tensor]:
        """The forward (block inputs kept) and the loss on the trained positions of `mask`
        (at least one): their summed loss and dL/dh of the last hidden state."""
        n = int(mask.sum())
        art, run = self.art, self.progs.run
        h = run("embed", self._src(art.embed_w, None, {"ids": ids}))["h"]
        for i, b in enumerate(self.blocks):
            self.checkpoints.put(i, h)
            with art.block(i) as w:
                h = run(f"{b['fn']}.forward", self._src(w, i, {"x": h}))["y"]
        rows = mask.reshape(-1).nonzero().squeeze(1)
        out = self.loss(h, rows, tgt.reshape(-1).index_select(0, rows), torch.tensor(float(n)))
        loss = float(out["loss"].sum(dtype=torch.float64))
        if not math.isfinite(loss):
            raise RunnerError(f"non-finite loss at step {k}; no adapter written (lower --lr?)")
        return loss, out["dh"]

    @torch.no_grad()
    def backward(self, g: torch.Tensor, take: Callable[[int, Tensors], None]) -> None:
        """The blocks in reverse from dL/dh = g; `take(i, grads)` gets block i's LoRA
        gradients (by adapter key) right after its backward."""
        for i in range(len(self.blocks) - 1, -1, -1):
            b = self.blocks[i]
            with self.art.block(i) as w:
                x = self.checkpoints.get(i, g)
                out = self.progs.run(f"{b['fn']}.backward", self._src(w, i, {"x": x, "dy": g}))
            g = out.pop("dx")
            take(i, {k[5:]: t for k, t in out.items()})

    def loss(
        self, h: torch.Tensor, rows: torch.Tensor, tgt: torch.Tensor, norm: torch.Tensor
    ) -> Tensors:
        """loss_start, loss_slice over the vocabulary (loss_tail for a shorter last slice, the
        state fed back by name), loss_finish: per-row losses and dh."""
        art, run, spec = self.art, self.progs.run, self.loss_spec
        w = {**art.embed_w, **art.head_w}
        extra = {"h": h, "rows": rows, "tgt": tgt, "norm": norm}
        st = run("loss_start", self._src(w, None, extra))
        vocab, chunk, p = spec["vocab"], spec["chunk"], spec["head_prefix"]
        for v0 in range(0, vocab, chunk):
            v1 = min(v0 + chunk, vocab)
            head = {
                "head/" + k.removeprefix(p + "."): t[v0:v1]
                for k, t in w.items()
                if k.startswith(p + ".")
            }
            ins = {**extra, **st, **head, "v0": torch.tensor(v0)}
            st.update(run("loss_slice" if v1 - v0 == chunk else "loss_tail", ins.__getitem__))
        return run("loss_finish", self._src(w, None, {**extra, **st}))

    def _scalars(self) -> Tensors:
        """The optimizer's inputs for the next optimizer step (t counts them, from 1)."""
        cfg, self.t = self.cfg, self.t + 1
        one = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
        if cfg.optimizer == "sgd":
            return {"lr": one(cfg.lr), "weight_decay": one(cfg.weight_decay)}
        s = adamw_scalars(cfg.lr, cfg.weight_decay, self.t)
        return {k: one(s[k]) for k in ADAMW_SCALARS}

    def _update(self, i: int, grads: Tensors, scal: Tensors) -> None:
        """Block i's adapter tensors through the exported update program."""
        opt, d = self.cfg.optimizer, self.lora[i]
        for k, p in d.items():
            vec = {"p": p.reshape(-1), "g": grads[k].reshape(-1)}
            if opt == "adamw":
                vec.update(m=self.m[i][k].reshape(-1), v=self.v[i][k].reshape(-1))
            out = self.progs.run(opt, {**vec, **scal}.__getitem__)
            d[k] = out["p"].view(p.shape)
            if opt == "adamw":
                self.m[i][k], self.v[i][k] = out["m"].view(p.shape), out["v"].view(p.shape)


def train(
    art: Artifacts,
    rows: list[tuple[list[int], list[int]]],
    cfg: RunConfig,
    log: Callable[[int, float | None, str], None] | None = None,
) -> tuple[EtTrainer, list[float | None]]:
    trainer = EtTrainer(art, cfg)
    data, losses = batches(rows, art.batch_size), []
    for k in range(1, cfg.steps + 1):
        note = ""
        if cfg.dp is not None:  # DP-SGD: the step's Poisson sample, one row at a time
            loss, sampled = private.step(trainer, rows, k, cfg.dp, make_batch)
            note = cfg.dp.note(k, sampled)
        else:
            loss = trainer.step(*make_batch(next(data), art.batch_size, art.seq_len), k)
        losses.append(loss)
        if log is not None:
            log(k, loss, note)
    return trainer, losses


def main(argv: list[str] | None = None) -> int:
    """`python -m mesp.runner DIR --data ROWS --steps N --out ADAPTER`: train from the .pte
    programs (errors: one line, exit code 2, no adapter)."""
    p = argparse.ArgumentParser(prog="mesp-runner", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_cli(p.parse_args(sys.argv[1:] if argv is None else argv), train)


__all__ = ["EtTrainer", "Programs", "main", "train"]
