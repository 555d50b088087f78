"""The body of each CLI command; the same functions the tests call."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from mesp.atomic_io import atomic_write
from mesp.cli_args import from_args
from mesp.errors import MespError
from mesp.loading.session import ModelOptions, open_model
from mesp.training.checkpoint import check_fingerprint, load_state


def _engine_opts(ns: argparse.Namespace) -> dict[str, object]:
    from mesp.engines.loss import LossSpec

    opts: dict[str, object] = {
        "loss": LossSpec(ns.loss, ns.vocab_subset, ns.logits_masking, seed=getattr(ns, "seed", 0))
    }
    if ns.engine in ("mesp", "mebp") and ns.offload != "none":
        opts.update(
            offload=ns.offload, offload_dir=ns.offload_dir, offload_fallback=ns.offload_fallback
        )
    if ns.engine == "mesp":
        opts["h_strategy"] = ns.h_strategy
        if ns.stream_weights:
            opts.update(stream_weights=True, offload_dir=ns.offload_dir)
    elif ns.stream_weights:
        raise MespError("--stream-weights needs --engine mesp")
    if ns.zo_full and (ns.engine != "mezo" or ns.quantize != "none"):
        raise MespError("--zo-full needs --engine mezo and --quantize none (an unquantized base)")
    if ns.stream_weights or (ns.offload == "disk" and not ns.offload_fallback):
        _check_spill_dir(ns)
    if ns.engine == "mezo":  # lr comes from the trainer's schedule each step (set_lr)
        opts.update(
            eps=ns.zo_eps,
            samples=ns.zo_samples,
            perturb_all=ns.zo_full,
            seed=getattr(ns, "seed", 0),
            weight_decay=getattr(ns, "weight_decay", 0.0),
        )
    return opts


def _check_spill_dir(ns: argparse.Namespace) -> None:
    """The spill files (disk checkpoints, streamed weights) go here: fail now, before any
    output is written, not at the first step."""
    import tempfile

    d = ns.offload_dir or tempfile.gettempdir()
    flag = "--stream-weights" if ns.stream_weights else "--offload disk"
    try:
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as e:
        raise MespError(f"{flag}: cannot write spill files in {d} ({e.strerror or e})") from None


def _tokenizer(loaded):  # type: ignore[no-untyped-def]
    if loaded.tokenizer is None:
        raise MespError(f"{loaded.source}: no tokenizer found (tokenizer.json or GGUF metadata)")
    return loaded.tokenizer


def _check_seq_len(model, seq_len: int) -> None:  # type: ignore[no-untyped-def]
    mx = model.config.max_position_embeddings
    if seq_len > mx:
        raise MespError(f"--seq-len {seq_len} is over the model's maximum of {mx} positions")


def cmd_info(ns: argparse.Namespace) -> int:
    from mesp.loading.info import model_info

    if ns.model_arg:  # `mesp info MODEL`
        ns.model = ns.model_arg
    opts = from_args(ModelOptions, ns)
    print(model_info(opts, rank=ns.rank, targets=ns.targets))
    return 0


def cmd_train(ns: argparse.Namespace) -> int:
    from mesp.data import DataConfig, load_splits, pad_id_of
    from mesp.engines import make_engine
    from mesp.lora import LoraConfig, apply_lora, check_output_dir
    from mesp.training import TrainConfig, train
    from mesp.training.distributed import from_env, shutdown
    from mesp.training.evaluate import evaluate

    if ns.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch_torchrun(ns)
    _engine_defaults(ns)
    if ns.resume:
        _warn_if_schedule_changes(ns)
    if ns.device.startswith("cuda") and "LOCAL_RANK" in os.environ:
        ns.device = f"cuda:{os.environ['LOCAL_RANK']}"  # one GPU per data-parallel rank
    opts = from_args(ModelOptions, ns)
    data_cfg = from_args(DataConfig, ns, seed=ns.seed)
    data_cfg.validate()
    lora_cfg = from_args(LoraConfig, ns)
    train_cfg = from_args(TrainConfig, ns)
    engine = make_engine(ns.engine, **_engine_opts(ns))
    out = Path(ns.resume or ns.adapter_out)
    check_output_dir(out)
    resume = load_state(out) if ns.resume else None
    budget = _check_budget(ns, opts, data_cfg, lora_cfg, train_cfg)
    dp = from_env(ns.dist_timeout, opts.device)
    main = dp is None or dp.is_main
    say = print if main else (lambda *a, **k: None)
    try:
        loaded = open_model(opts, seed=ns.seed)
        model, tok = loaded.model, _tokenizer(loaded)
        _check_seq_len(model, data_cfg.seq_len)
        engine.loss.check(model.config.vocab_size)  # type: ignore[attr-defined]
        fp = _fingerprint(ns, loaded, data_cfg, lora_cfg, train_cfg)
        if resume is not None:
            check_fingerprint(resume, fp, out)
        splits = load_splits(data_cfg, tok)
        pad = pad_id_of(tok)
        n_params = apply_lora(model, lora_cfg, seed=ns.seed)
        if ns.zo_full:
            _full_model_dir(model, tok, out, resume is not None, main)
        ranks = f", {dp.world} ranks" if dp is not None else ""
        say(
            f"mesp: {loaded.source} ({model.config.family}, {opts.quantize}-bit base, "
            f"{opts.dtype}), {n_params:,} LoRA parameters, engine {engine.name}{ranks}, "
            f"{len(splits['train'])} train / {len(splits['valid'])} valid rows"
        )
        base_f = out / "baseline.json"  # the untrained adapter's score, kept across resumes
        before: dict = {}
        reuse = resume is not None and base_f.exists()
        if splits["valid"] and not reuse:  # every rank scores its share
            before = evaluate(
                model, splits["valid"], train_cfg.batch_size, pad, train_cfg.eval_batches, dp
            )
        if main:
            run_args = {
                k: v for k, v in vars(ns).items() if k not in ("cmd", "config", "resume", "argv")
            }
            run_args["nproc"] = dp.world if dp is not None else 1  # a resume keeps the ranks
            atomic_write(out / "run_args.json", lambda p: Path(p).write_text(json.dumps(run_args)))
            if reuse:
                before = json.loads(base_f.read_text())
            elif before:
                atomic_write(base_f, lambda p: Path(p).write_text(json.dumps(before)))
        res = train(
            model,
            engine,
            splits["train"],
            splits["valid"],
            train_cfg,
            lora_cfg,
            out,
            pad_id=pad,
            base_name=loaded.source,
            fingerprint=fp,
            resume=resume,
            dp=dp,
            max_memory=budget,
        )
    finally:
        shutdown()
    if not main:
        return 0
    after = res.valid[-1] if res.valid else {}
    summary = {
        "valid_ppl_before": before.get("ppl"),
        "valid_ppl_after": after.get("ppl"),
        "peak_rss_mb": (res.peak_rss_bytes or 0) / 2**20,
        "seconds": res.seconds,
        "adapter": str(out),
    }
    atomic_write(
        out / "summary.json", lambda p: Path(p).write_text(json.dumps(summary, indent=2) + "\n")
    )
    ppl = (
        f"valid perplexity {before['ppl']:.2f} -> {after['ppl']:.2f}"
        if before and after
        else "no validation set"
    )
    print(
        f"mesp: {ppl}; peak RSS {summary['peak_rss_mb']:.0f} MB; {res.seconds:.0f} s; "
        f"adapter in {out}"
    )
    return 0


def _full_model_dir(model, tok, out: Path, resuming: bool, main: bool) -> None:  # type: ignore[no-untyped-def]
    """--zo-full trains the base weights too: they are saved (beside the adapter) as a model
    directory in OUT/model at every checkpoint; a resume reads them back from there."""
    from mesp.convert.merge import write_tokenizer

    d = out / "model"
    if resuming:
        from safetensors.torch import load_file

        f = d / "model.safetensors"
        if not f.exists():
            raise MespError(f"{f}: missing; --zo-full resumes its trained weights from there")
        modules = dict(model.named_modules())
        for name, t in load_file(str(f)).items():
            mod_name, attr = name.rsplit(".", 1)
            if mod_name not in modules:
                raise MespError(f"{f}: tensor {name} does not belong to this model")
            getattr(modules[mod_name], attr).copy_(t)
    elif main:
        d.mkdir(parents=True, exist_ok=True)
        if tok is not None:
            write_tokenizer(tok, d)


def _engine_defaults(ns: argparse.Namespace) -> None:
    """Flags whose default depends on the engine (None = not given): mezo takes the MeZO
    paper's lr 1e-4 and a constant schedule; the others 2e-4 with cosine decay."""
    mezo = ns.engine == "mezo"
    if ns.lr is None:
        ns.lr = 1e-4 if mezo else 2e-4
    if ns.schedule is None:
        ns.schedule = "constant" if mezo else "cosine"


def _warn_if_schedule_changes(ns: argparse.Namespace) -> None:
    """--steps is not part of the fingerprint (a run may be extended), but a cosine schedule
    stretches with it: say that the result will differ from an uninterrupted run."""
    f = Path(ns.resume) / "run_args.json"
    try:
        old = json.loads(f.read_text()).get("steps")
    except (OSError, json.JSONDecodeError):
        return
    if old is not None and old != ns.steps and ns.schedule == "cosine":
        print(
            f"mesp: warning: --steps {ns.steps} differs from the run's {old}: the cosine "
            "schedule stretches, so the result differs from an uninterrupted run",
            file=sys.stderr,
        )


def _check_budget(ns, opts, data_cfg, lora_cfg, train_cfg) -> int | None:  # type: ignore[no-untyped-def]
    """--max-memory: refuse, before any weight is loaded, a setup the planner says won't fit,
    naming a change that would; returns the budget in bytes for the trainer to watch."""
    if not ns.max_memory:
        return None
    from mesp.loading.info import config_of
    from mesp.memory.model import predict
    from mesp.memory.plan import parse_bytes

    budget = parse_bytes(ns.max_memory)
    cfg = config_of(opts)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # a data-parallel rank holds its slice
    rows = -(-train_cfg.batch_size // world)

    def need(engine: str, seq: int, rank: int) -> int:
        return int(
            predict(
                cfg,
                engine,
                seq,
                rows,
                rank,
                lora_cfg.targets,
                opts.quant,
                opts.torch_dtype,
                train_cfg.optimizer,
            )["total"]
        )

    seq, rank = data_cfg.seq_len, lora_cfg.rank
    have = need(ns.engine, seq, rank)
    if have <= budget:
        return budget
    hints = [
        f"--engine {e}" for e in ("mesp", "mezo") if e != ns.engine and need(e, seq, rank) <= budget
    ]
    fits = [
        s for s in (2**k for k in range(4, 20)) if s < seq and need(ns.engine, s, rank) <= budget
    ]
    if fits:
        hints.append(f"--seq-len {fits[-1]}")
    ranks = [r for r in (32, 16, 8, 4, 2, 1) if r < rank and need(ns.engine, seq, r) <= budget]
    if ranks:
        hints.append(f"--rank {ranks[0]}")
    raise MespError(
        f"--max-memory {ns.max_memory}: engine {ns.engine} at --seq-len {seq}, rank {rank} "
        f"needs about {have / 2**20:.0f} MiB; "
        + (" or ".join(hints) + " would fit" if hints else "no engine fits; try a smaller model")
    )


def _launch_torchrun(ns: argparse.Namespace) -> int:
    """`mesp train --nproc N …` = `torchrun --nproc-per-node N -m mesp train …`."""
    argv = list(ns.argv)
    if "--nproc" in argv:  # absent when the count came from a resumed run's flags
        i = argv.index("--nproc")
        del argv[i : i + 2]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ns.nproc),
        "--master-port",
        str(ns.master_port),
        "-m",
        "mesp",
        *argv,
    ]
    rc = subprocess.call(cmd)
    if rc not in (0, 130, 143):  # torchrun's own report is long; end with the one line to act on
        out = ns.resume or ns.adapter_out
        raise MespError(
            f"a data-parallel rank failed (torchrun exit {rc}); the last saved state is in "
            f"{out}: resume with mesp train --resume {out}"
        )
    return rc


def _fingerprint(ns, loaded, data_cfg, lora_cfg, train_cfg) -> dict:  # type: ignore[no-untyped-def]
    """What must stay the same for a resumed run to equal an uninterrupted one."""
    from dataclasses import asdict, is_dataclass

    skip = {"steps", "eval_every", "eval_batches", "save_every", "progress"}
    fp = {
        "model": loaded.source,
        "model_config": loaded.model.config.to_hf(),
        "quantize": ns.quantize,
        "group_size": ns.group_size,
        "dtype": ns.dtype,
        "engine": ns.engine,
        **{k: asdict(v) if is_dataclass(v) else v for k, v in _engine_opts(ns).items()},
        "data": asdict(data_cfg),
        "lora": asdict(lora_cfg),
        "train": {k: v for k, v in asdict(train_cfg).items() if k not in skip},
    }
    return json.loads(json.dumps(fp))  # tuples -> lists, as they come back from the file


def _model_with_adapter(ns: argparse.Namespace):  # type: ignore[no-untyped-def]
    from mesp.lora import load_adapter

    loaded = open_model(from_args(ModelOptions, ns))
    if ns.adapter:
        load_adapter(loaded.model, Path(ns.adapter))
    return loaded


def cmd_eval(ns: argparse.Namespace) -> int:
    from mesp.data import DataConfig, load_splits, pad_id_of
    from mesp.training.evaluate import evaluate

    is_file = ns.path is not None and Path(ns.path).is_file()
    # a file is scored whole; a directory (or the built-in set) by its validation split
    cfg = from_args(DataConfig, ns, valid_fraction=0.0 if is_file else 0.05)
    cfg.validate()
    loaded = _model_with_adapter(ns)
    tok = _tokenizer(loaded)
    _check_seq_len(loaded.model, cfg.seq_len)
    splits = load_splits(cfg, tok)
    rows = splits["train"] if is_file else splits["valid"]
    t0 = time.perf_counter()
    res = evaluate(loaded.model, rows, ns.batch_size, pad_id_of(tok), ns.max_batches)
    res["seconds"] = time.perf_counter() - t0
    if ns.json:
        print(json.dumps(res))
    else:
        print(f"loss {res['loss']:.4f}  perplexity {res['ppl']:.2f}  ({res['tokens']} tokens)")
    return 0


def cmd_generate(ns: argparse.Namespace) -> int:
    from mesp.inference.generate import generate

    if not ns.prompt:
        raise MespError("--prompt is empty; give the text to continue")
    if not 0.0 < ns.top_p <= 1.0:
        raise MespError(f"--top-p must be in (0, 1], got {ns.top_p}")
    if not ns.temperature >= 0.0:
        raise MespError(f"--temperature must be >= 0 (0 = greedy), got {ns.temperature}")
    if ns.max_tokens < 1:
        raise MespError(f"--max-tokens must be at least 1, got {ns.max_tokens}")
    loaded = _model_with_adapter(ns)
    tok = _tokenizer(loaded)
    text = ns.prompt
    if ns.chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], True)
    ids = tok.encode(text)
    room = loaded.model.config.max_position_embeddings - len(ids)
    if room < 1:
        raise MespError(
            f"the prompt is {len(ids)} tokens; the model takes at most "
            f"{loaded.model.config.max_position_embeddings} positions"
        )
    if ns.max_tokens > room:
        print(
            f"mesp: note: stopping after {room} tokens, at the model's "
            f"{loaded.model.config.max_position_embeddings} positions",
            file=sys.stderr,
        )
    out = generate(
        loaded.model,
        ids,
        min(ns.max_tokens, room),
        ns.temperature,
        ns.top_p,
        tok.stop_ids,
        ns.seed,
    )
    print(tok.decode(out))
    return 0


def cmd_merge(ns: argparse.Namespace) -> int:
    from mesp.convert.merge import merge_into_base, write_model_dir
    from mesp.lora import check_output_dir, load_adapter

    out = Path(ns.out)
    src = Path(ns.model)
    if src.is_dir() and out.resolve() == src.resolve():
        raise MespError(f"{out}: is the base model's directory; give a new --out")
    opts = from_args(ModelOptions, ns)
    check_output_dir(out)
    # the base is read at full precision; --quantize applies to the merged weights
    loaded = open_model(ModelOptions(model=opts.model, quantize="none", dtype=opts.dtype))
    cfg = load_adapter(loaded.model, Path(ns.adapter))
    merge_into_base(loaded.model, opts.quant)
    write_model_dir(loaded.model, loaded.tokenizer, out)
    how = f"{opts.quantize}-bit (MLX layout)" if opts.quant else opts.dtype
    print(f"mesp: merged rank-{cfg.rank} adapter {ns.adapter} into {loaded.source}; {how} in {out}")
    return 0


def cmd_grad(ns: argparse.Namespace) -> int:
    from mesp.batch import collate
    from mesp.data import DataConfig, load_splits, pad_id_of
    from mesp.engines import make_engine
    from mesp.lora import LoraConfig, adapter_state, apply_lora, check_output_dir

    out = Path(ns.out)
    if out.is_dir():
        raise MespError(f"{out}: is a directory; give a .safetensors file path")
    if ns.engine == "mezo":
        raise MespError(
            "mesp grad: mezo computes no gradient (one projected scalar per probe); "
            "use --engine bp, mebp or mesp"
        )
    if ns.adapter and ns.init_b:
        raise MespError("--init-b applies to a fresh adapter; drop it or drop --adapter")
    if ns.batch_size < 1:
        raise MespError(f"--batch-size must be at least 1, got {ns.batch_size}")
    is_file = ns.path is not None and Path(ns.path).is_file()
    cfg = from_args(DataConfig, ns, valid_fraction=0.0 if is_file else 0.05)
    cfg.validate()
    lora_cfg = from_args(LoraConfig, ns)
    check_output_dir(out.parent)  # fail before the work, not after
    engine = make_engine(ns.engine, **_engine_opts(ns))
    loaded = _model_with_adapter(ns)
    model, tok = loaded.model, _tokenizer(loaded)
    _check_seq_len(model, cfg.seq_len)
    engine.loss.check(model.config.vocab_size)  # type: ignore[attr-defined]
    if not ns.adapter:
        apply_lora(model, lora_cfg, seed=ns.seed)
        if ns.init_b:
            g = torch.Generator().manual_seed(ns.seed + 1)
            for mod in model.lora_modules().values():
                b = torch.randn(mod.lora_B.shape, generator=g) * ns.init_b
                mod.lora_B.data.copy_(b.to(mod.lora_B.dtype))
        else:
            print(
                "mesp: note: a fresh adapter has lora_B = 0, so every lora_A gradient is 0 "
                "(give --adapter or --init-b 0.01 to compare engines on both)",
                file=sys.stderr,
            )
    rows = load_splits(cfg, tok)["train"][: ns.batch_size]
    batch = collate(rows, pad_id_of(tok)).to(model.device)
    loss = engine.step(model, batch, batch.n_tokens)
    grads = {
        k: p.grad.contiguous()
        for k, p in zip(adapter_state(model), _lora_params(model), strict=True)
    }
    meta = {
        "engine": engine.name,
        "loss": f"{loss / batch.n_tokens:.8f}",
        "tokens": str(batch.n_tokens),
    }
    atomic_write(out, lambda p: save_file(grads, p, metadata=meta))
    print(f"mesp: wrote {len(grads)} gradients (loss {loss / batch.n_tokens:.4f}) to {out}")
    return 0


def _lora_params(model) -> list[torch.nn.Parameter]:  # type: ignore[no-untyped-def]
    """A then B for each adapted module, in adapter_state's key order."""
    out = []
    for mod in model.lora_modules().values():
        out += [mod.lora_A, mod.lora_B]
    return out
