"""Train LoRA adapters from `mesp export` artifacts, with no model code: torch + safetensors only.

This file imports nothing from mesp (it runs as a copy beside the artifacts, as the original's
Swift runner does). Everything a block computes comes from the exported programs; everything this
file knows is in run_config.json. One step:
  embed -> for each block: load its weights, forward, drop them (keep only the block input)
  -> loss and grad of the last hidden state
  -> for each block in reverse: load, recompute its saved tensors, hand backward, drop
Frozen weights resident at any moment: the embedding, the final norm (and an untied head), and
at most one block's. Adapters are saved in PEFT's format.

    python -m mesp.runner DIR --data train.jsonl --steps 100 --out adapter/
Data: jsonl rows {"input_ids": [...], "loss_mask": [...]}; loss_mask[i] = 1 trains token i
(predicted from the tokens before it); rows of at most seq_len + 1 tokens, right-padded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

FORMAT, VERSION = "mesp-artifacts", 1
PEFT_PREFIX = "base_model.model."
Tensors = dict[str, torch.Tensor]


class RunnerError(Exception):
    """Bad artifacts, data or flags: printed as one line, exit code 2."""


# ---- the artifact directory: checked up front, weights read lazily ----


class Artifacts:
    """run_config.json, and every file checked against it (export id, names, shapes, dtypes)
    before any training; `load_programs()` then deserializes the programs (seconds each: do it
    after the cheap checks). Block weights are read only inside `block(i)`."""

    def __init__(self, root: Path, on_load: Callable[[Tensors], None] | None = None) -> None:
        self.root, self.on_load = root, on_load
        conf_p = root / "run_config.json"
        if not root.is_dir():
            raise RunnerError(f"{root}: not an artifact directory")
        if not conf_p.is_file():
            raise RunnerError(f"{conf_p}: missing (not a `mesp export` directory?)")
        try:
            self.conf = json.loads(conf_p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RunnerError(f"{conf_p}: unreadable: {e}") from None
        c = self.conf
        if not isinstance(c, dict) or c.get("format") != FORMAT or c.get("version") != VERSION:
            raise RunnerError(f"{conf_p}: not a {FORMAT} v{VERSION} config")
        try:
            self.id = str(c["export_id"])
            self.seq_len, self.batch_size = int(c["seq_len"]), int(c["batch_size"])
            self.vocab = int(c["model"]["vocab_size"])
            for rel, spec in c["files"].items():
                self._check_file(rel, spec["tensors"])
            self.programs: dict[str, Any] = {}
            for row in self._program_rows().values():
                if not (root / row["pt2"]).is_file():
                    raise RunnerError(f"{root / row['pt2']}: missing (the export is incomplete)")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RunnerError(f"{conf_p}: malformed ({type(e).__name__}: {e})") from None
        self.resident_bytes = self.peak_resident_bytes = 0
        self.ctx = self._read("context.safetensors")
        self.embed_w = self._resident("embedding.safetensors")
        self.head_w = self._resident("head.safetensors")

    def _check_file(self, rel: str, table: dict[str, Any]) -> None:
        p = self.root / rel
        if not p.is_file():
            raise RunnerError(f"{p}: missing (the export is incomplete; run mesp export again)")
        try:
            with safe_open(str(p), framework="pt") as f:
                meta, names = f.metadata() or {}, set(f.keys())
                shapes = {
                    k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in names
                }
        except Exception as e:  # safetensors raises its own error types
            raise RunnerError(f"{p}: not a readable safetensors file ({e})") from None
        if meta.get("export_id") != self.id:
            raise RunnerError(
                f"{p}: made by export {meta.get('export_id')}, but run_config.json is from "
                f"export {self.id} (files of two exports mixed?)"
            )
        if names != set(table):
            extra = sorted(names ^ set(table))[0]
            raise RunnerError(f"{p}: tensor {extra!r} does not match run_config.json")
        for k, want in table.items():
            dt, shape = shapes[k]
            if dt != want["dtype"] or list(shape) != list(want["shape"]):
                raise RunnerError(
                    f"{p}: tensor {k!r} is {dt}{list(shape)}, run_config.json says "
                    f"{want['dtype']}{list(want['shape'])}"
                )

    def _program(self, row: dict[str, Any]) -> Callable[..., Any]:
        p = self.root / row["pt2"]
        why = pickled_member(p)
        if why is not None:  # torch.export.load would hand it to torch.load
            raise RunnerError(f"{p}: refused: {why} (programs carry no pickle and no tensor)")
        extra = {"export_id": ""}
        try:
            ep = torch.export.load(str(p), extra_files=extra)
        except Exception as e:  # deserialization errors come in many types
            raise RunnerError(f"{p}: not a loadable torch.export program ({e})") from None
        if extra["export_id"] != self.id:
            raise RunnerError(
                f"{p}: made by export {extra['export_id'] or '?'}, but run_config.json is from "
                f"export {self.id} (files of two exports mixed?)"
            )
        return ep.module()

    def _program_rows(self) -> dict[str, dict[str, Any]]:
        if "functions" not in self.conf:  # an ExecuTorch-only export: .pte programs
            return {}
        fns = self.conf["functions"]
        rows = {"embed": fns["embed"], "loss": fns["loss"]}
        for gid, g in fns["blocks"].items():
            rows.update({f"{gid}.{k}": g[k] for k in ("forward", "recompute", "backward")})
        return rows

    def load_programs(self) -> None:
        for name, row in self._program_rows().items():
            if name not in self.programs:
                self.programs[name] = self._program(row)

    def _read(self, rel: str) -> Tensors:
        try:
            return load_file(str(self.root / rel))
        except Exception as e:  # changed on disk since the check
            raise RunnerError(f"{self.root / rel}: unreadable ({e})") from None

    def _resident(self, rel: str) -> Tensors:
        w = self._read(rel)
        self._count(w, +1)
        return w

    def _count(self, w: Tensors, sign: int) -> None:
        self.resident_bytes += sign * sum(t.numel() * t.element_size() for t in w.values())
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        if sign > 0 and self.on_load is not None:
            self.on_load(w)

    @contextmanager
    def block(self, i: int) -> Iterator[Tensors]:
        """Block i's frozen weights, read from disk now and dropped on exit."""
        w = self._read(self.conf["blocks"][i]["file"])
        self._count(w, +1)
        try:
            yield w
        finally:
            self._count(w, -1)
            w.clear()


def pickled_member(path: Path) -> str | None:
    """Why a .pt2 archive could make torch.export.load unpickle something, or None. A mesp
    program is its graph as JSON only: a member named *.pkl, a nested zip (a torch.save file,
    such as the data/sample_inputs/model.pt torch.export writes for example inputs), a member
    that opens with a pickle protocol header, or any stored weight or constant payload (those
    may be pickled) is refused."""
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                name = info.filename
                if name.endswith(".pkl"):
                    return f"member {name} is a pickle"
                if info.file_size == 0:
                    continue
                with z.open(info) as f:
                    head = f.read(2)
                if head == b"PK":
                    return f"member {name} is a torch.save archive"
                if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
                    return f"member {name} is a pickle"
                parts = name.split("/")
                if "data" in parts and ("weights" in parts or "constants" in parts):
                    if not name.endswith("_config.json"):
                        return f"member {name} stores a tensor"
                    conf = json.loads(z.read(info))
                    if conf.get("config"):
                        return f"member {name} lists stored tensors"
    except (OSError, zipfile.BadZipFile, ValueError, AttributeError) as e:
        return f"not a readable .pt2 archive ({e})"
    return None


def _ordered(src: Tensors, names: list[str]) -> Tensors:
    """The dict a program was captured with: the same keys in the same order."""
    return {k: src[k] for k in names}


# ---- data ----


def read_rows(path: Path, seq_len: int, vocab: int) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) per jsonl row; mask[i] = 1 trains token i, mask[0] is never trained."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise RunnerError(f"{path}: unreadable ({getattr(e, 'strerror', None) or e})") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise RunnerError(f"{where}: not JSON ({e.msg})") from None
        except (ValueError, RecursionError):  # a 5000-digit number, nesting past the stack
            raise RunnerError(
                f"{where}: not JSON (a number too long or nesting too deep)"
            ) from None
        ids = row.get("input_ids") if isinstance(row, dict) else None
        if not isinstance(ids, list) or not all(type(x) is int and 0 <= x < vocab for x in ids):
            raise RunnerError(f'{where}: "input_ids" must be a list of token ids in 0..{vocab - 1}')
        if not 2 <= len(ids) <= seq_len + 1:
            raise RunnerError(
                f"{where}: {len(ids)} tokens; rows must have 2..{seq_len + 1} (the exported "
                f"sequence length {seq_len}, plus one)"
            )
        mask = row.get("loss_mask", [1] * len(ids))
        if (
            not isinstance(mask, list)
            or len(mask) != len(ids)
            or any(x not in (0, 1) for x in mask)
        ):
            raise RunnerError(f'{where}: "loss_mask" must be a list of 0/1, one per token')
        rows.append((ids, [0, *(int(x) for x in mask[1:])]))
    if not rows:
        raise RunnerError(f"{path}: no rows")
    return rows


def make_batch(
    rows: list[tuple[list[int], list[int]]], batch_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, targets, trained) (B, S): shifted by one, right-padded with id 0, untrained."""
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    tgt = torch.zeros(batch_size, seq_len, dtype=torch.long)
    mask = torch.zeros(batch_size, seq_len, dtype=torch.bool)
    for r, (toks, m) in enumerate(rows):
        k = len(toks) - 1
        ids[r, :k] = torch.tensor(toks[:-1])
        tgt[r, :k] = torch.tensor(toks[1:])
        mask[r, :k] = torch.tensor(m[1:], dtype=torch.bool)
    return ids, tgt, mask


def batches(rows: list[tuple[list[int], list[int]]], batch_size: int) -> Iterator[list[Any]]:
    """Consecutive rows in file order, wrapping around: step k uses rows kB .. kB + B - 1."""
    k = 0
    while True:
        yield [rows[(k * batch_size + j) % len(rows)] for j in range(batch_size)]
        k += 1


# ---- training ----


class Trainer:
    """LoRA tensors (one dict per block) and the step that computes their gradients."""

    def __init__(self, art: Artifacts, init: Tensors) -> None:
        self.art, conf = art, art.conf
        if "functions" not in conf:
            raise RunnerError(
                f"{art.root}: an ExecuTorch export (no .pt2 programs): run it with "
                "--runtime python or --runtime native"
            )
        art.load_programs()
        fns = conf["functions"]
        self.blocks = conf["blocks"]
        self.lora: list[dict[str, torch.nn.Parameter]] = []
        for i, b in enumerate(self.blocks):
            names = fns["blocks"][b["fn"]]["inputs"]["lora"]
            self.lora.append(
                {
                    k: torch.nn.Parameter(init[f"{PEFT_PREFIX}model.layers.{i}.{k}.weight"].clone())
                    for k in names
                }
            )
        self.ctx = {}
        for gid, g in fns["blocks"].items():
            t = g["layer_type"]
            self.ctx[gid] = {k: art.ctx[f"{t}.{k}"] for k in g["inputs"]["ctx"]}
        self.embed_w = _ordered(art.embed_w, fns["embed"]["inputs"]["weights"])
        self.loss_w = _ordered({**art.embed_w, **art.head_w}, fns["loss"]["inputs"]["weights"])

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for d in self.lora for p in d.values()]

    @torch.no_grad()
    def step(self, ids: torch.Tensor, tgt: torch.Tensor, mask: torch.Tensor) -> float | None:
        """Leave each adapter's gradient in .grad; return the mean token loss (None: no target)."""
        n = int(mask.sum())
        if n == 0:
            return None
        fn, art, blocks = self.art.programs, self.art, self.blocks
        names = {gid: g["inputs"] for gid, g in art.conf["functions"]["blocks"].items()}
        h = fn["embed"](self.embed_w, ids)
        checkpoints = []
        for i, b in enumerate(blocks):
            checkpoints.append(h)  # block input: the only activation kept across blocks
            with art.block(i) as w:
                h = fn[f"{b['fn']}.forward"](
                    _ordered(w, names[b["fn"]]["weights"]), self.lora[i], h, self.ctx[b["fn"]]
                )
        rows = mask.reshape(-1).nonzero().squeeze(1)
        loss, g = fn["loss"](
            self.loss_w, h, rows, tgt.reshape(-1).index_select(0, rows), torch.tensor(float(n))
        )
        del h
        loss_sum = float(loss.sum(dtype=torch.float64))  # row losses summed in fp64 (the engine's)
        for i in range(len(blocks) - 1, -1, -1):
            b, x = blocks[i], checkpoints.pop()
            with art.block(i) as w:
                wo = _ordered(w, names[b["fn"]]["weights"])
                saved = fn[f"{b['fn']}.recompute"](wo, self.lora[i], x, self.ctx[b["fn"]])[1]
                g, grads = fn[f"{b['fn']}.backward"](
                    saved, g, x, wo, self.lora[i], self.ctx[b["fn"]]
                )
                del saved, wo
            for k, t in grads.items():
                self.lora[i][k].grad = t
            del x, grads
        return loss_sum / n


@dataclass
class RunConfig:
    steps: int
    lr: float = 1e-4
    optimizer: str = "sgd"
    weight_decay: float = 0.0


def make_optimizer(params: list[torch.nn.Parameter], cfg: RunConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def train(
    art: Artifacts,
    rows: list[tuple[list[int], list[int]]],
    cfg: RunConfig,
    log: Callable[[int, float | None], None] | None = None,
) -> tuple[Trainer, list[float | None]]:
    """cfg.steps optimizer steps; returns the trainer (its adapters) and each step's loss."""
    init = art._read(art.conf["lora"]["init"])
    trainer = Trainer(art, init)
    del init
    opt = make_optimizer(trainer.parameters(), cfg)
    data, losses = batches(rows, art.batch_size), []
    for k in range(1, cfg.steps + 1):
        loss = trainer.step(*make_batch(next(data), art.batch_size, art.seq_len))
        if loss is not None:
            if not math.isfinite(loss):
                raise RunnerError(f"non-finite loss at step {k}; no adapter written (lower --lr?)")
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss)
        if log is not None:
            log(k, loss)
    return trainer, losses


def _atomic(path: Path, write: Callable[[str], object]) -> None:
    """Temp file, fsync, rename, fsync the directory. safetensors' writer raises
    SafetensorError (not OSError) when the disk is full: it becomes an OSError here."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        try:
            write(tmp)
        except SafetensorError as e:
            raise OSError(str(e).splitlines()[0]) from None
        mask = os.umask(0)  # mkstemp's 0600 would hide the adapter from other users: a plain
        os.umask(mask)  # open()'s mode instead
        os.chmod(tmp, 0o666 & ~mask)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def save_adapter(trainer: Trainer, out: Path) -> None:
    """PEFT format: adapter_model.safetensors first, adapter_config.json last."""
    conf = trainer.art.conf
    tensors = {
        f"{PEFT_PREFIX}model.layers.{i}.{k}.weight": p.detach().contiguous()
        for i, d in enumerate(trainer.lora)
        for k, p in d.items()
    }
    lora = conf["lora"]
    peft = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": lora["targets"],
        "base_model_name_or_path": conf["model"]["base_model"],
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    try:
        out.mkdir(parents=True, exist_ok=True)
        _atomic(out / "adapter_model.safetensors", lambda p: save_file(tensors, p))
        _atomic(
            out / "adapter_config.json", lambda p: Path(p).write_text(json.dumps(peft, indent=2))
        )
    except OSError as e:
        raise RunnerError(f"{out}: could not save the adapter ({e.strerror or e})") from None


# ---- CLI ----


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The runner's flags (also registered as `mesp run-artifacts`)."""
    p.add_argument("artifacts", metavar="DIR", help="directory written by `mesp export`")
    p.add_argument("--data", required=True, help="jsonl of {input_ids, loss_mask} rows")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate (default: 1e-4)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--out", required=True, help="adapter directory (PEFT format)")
    p.add_argument("--quiet", action="store_true", help="print only the summary")


def run(ns: argparse.Namespace, train_fn: Callable[..., Any] | None = None) -> int:
    """Check the flags, artifacts and rows, train with `train_fn` (default: the .pt2 programs'
    `train`; mesp.ondevice.et_driver passes its own), save the adapter."""
    if ns.steps < 1 or not (ns.lr > 0 and math.isfinite(ns.lr)):
        raise RunnerError("--steps and --lr must be positive")
    out = Path(ns.out)
    if out.exists() and not out.is_dir():
        raise RunnerError(f"{out}: exists and is not a directory")
    t0 = time.perf_counter()
    art = Artifacts(Path(ns.artifacts))
    rows = read_rows(Path(ns.data), art.seq_len, art.vocab)

    last = [time.perf_counter()]

    def log(k: int, loss: float | None) -> None:
        now = time.perf_counter()
        if not ns.quiet:
            shown = "skipped (no trained token)" if loss is None else f"{loss:.6f}"
            print(f"step {k} loss {shown} time {now - last[0]:.3f}s{_rss_note()}", flush=True)
        last[0] = now

    cfg = RunConfig(ns.steps, ns.lr, ns.optimizer, ns.weight_decay)
    trainer, _ = (train_fn or train)(art, rows, cfg, log)
    save_adapter(trainer, out)
    print(
        f"saved {out} after {ns.steps} steps in {time.perf_counter() - t0:.1f}s; frozen weights "
        f"resident at most {art.peak_resident_bytes / 2**20:.1f} MiB",
        flush=True,
    )
    return 0


def _rss_note() -> str:
    """' peak_rss X MiB anon Y MiB' from /proc/self/status where there is one (Linux)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return ""
    kb = {
        k: int(v.split()[0])
        for k, _, v in (line.partition(":") for line in text.splitlines())
        if k in ("VmHWM", "RssAnon")
    }
    if len(kb) < 2:
        return ""
    return f" peak_rss {kb['VmHWM'] / 1024:.1f}MiB anon {kb['RssAnon'] / 1024:.1f}MiB"


def run_cli(ns: argparse.Namespace, train_fn: Callable[..., Any] | None = None) -> int:
    """run(ns) with errors as one line and exit code 2 (130 when interrupted)."""
    try:
        return run(ns, train_fn)
    except RunnerError as e:
        print(f"mesp-runner: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mesp-runner: interrupted; no adapter written", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mesp-runner", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_cli(p.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
