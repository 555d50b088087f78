"""`mesp train` as a library function: `run(TrainJob(...))` checks the setup, loads the model,
trains, and writes the adapter with its run_args.json, baseline and summary."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from mesp.atomic_io import atomic_write
from mesp.data import DataConfig, load_splits, pad_id_of
from mesp.data.preference import load_pair_splits
from mesp.engines import make_engine
from mesp.engines.options import EngineOptions, engine_kwargs
from mesp.engines.private import PrivateEngine
from mesp.engines.ref_cache import attach_ref_cache
from mesp.errors import MespError
from mesp.loading.build import held
from mesp.loading.session import ModelOptions, open_model
from mesp.lora import LoraConfig, apply_lora, check_output_dir
from mesp.training.budget import budget_tapes, check_budget
from mesp.training.checkpoint import check_fingerprint, fingerprint, load_state
from mesp.training.config import TrainConfig
from mesp.training.distributed import from_env, launch_torchrun, shutdown
from mesp.training.evaluate import evaluate
from mesp.training.loop import train
from mesp.training.privacy import DPSGD, PrivacyConfig
from mesp.training.summary import finish_run
from mesp.training.tensorboard import TensorBoardLog, require_tensorboard


@dataclass
class RunOptions:
    config: str | None = field(
        default=None, metadata={"help": "YAML/TOML file of flag values (flags given here win)"}
    )
    adapter_out: str = field(
        default="adapters", metadata={"help": "directory for the adapter, state and logs"}
    )
    resume: str | None = field(
        default=None,
        metadata={
            "help": "continue the run saved in DIR (its flags are the defaults)",
            "metavar": "DIR",
        },
    )
    max_memory: str | None = field(
        default=None,
        metadata={
            "help": "memory budget, e.g. 500MB: refuse a setup the planner says won't fit, "
            "stop and save if the measured peak crosses it"
        },
    )
    ref_cache: str | None = field(
        default=None,
        metadata={
            "help": "dpo: keep the reference log-probs per row in DIR and reuse them across "
            "epochs and resumes (checked against the model on the first hit)",
            "metavar": "DIR",
        },
    )
    tensorboard: str | None = field(
        default=None,
        metadata={
            "help": "also write log.jsonl's numbers as TensorBoard scalars in DIR "
            "(needs the tensorboard package)",
            "metavar": "DIR",
        },
    )
    nproc: int = field(
        default=1, metadata={"help": "data-parallel processes on this machine (launches torchrun)"}
    )
    master_port: int = field(
        default=0, metadata={"help": "torchrun rendezvous port (default 0: a free one per launch)"}
    )
    dist_timeout: float = field(
        default=120.0, metadata={"help": "seconds before surviving ranks give up on a dead one"}
    )


@dataclass
class TrainJob:
    """Everything `mesp train` was given, as the dataclasses its flags fill."""

    run: RunOptions
    model: ModelOptions
    engine: EngineOptions
    data: DataConfig  # data.seed is train.seed: one --seed orders the data and seeds LoRA
    lora: LoraConfig
    train: TrainConfig
    argv: list[str] = field(default_factory=list)  # the command line, for the torchrun launcher
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)  # DP-SGD, off by default

    @property
    def out(self) -> Path:
        return Path(self.run.resume or self.run.adapter_out)

    def flags(self) -> dict[str, Any]:
        """The flag values a resume restores (run_args.json), in the parser's order."""
        skip = {"config", "resume"}
        run = {k: v for k, v in asdict(self.run).items() if k not in skip}
        data = {k: v for k, v in asdict(self.data).items() if k != "seed"}
        parts = (asdict(self.model), asdict(self.engine), data, asdict(self.lora))
        parts += (asdict(self.privacy),)
        return {**run, **{k: v for p in parts for k, v in p.items()}, **asdict(self.train)}


def _warn_if_schedule_changes(job: TrainJob) -> None:
    """--steps is not part of the fingerprint (a run may be extended), but a cosine schedule
    stretches with it: say that the result will differ from an uninterrupted run."""
    f = job.out / "run_args.json"
    try:
        old = json.loads(f.read_text()).get("steps")
    except (OSError, json.JSONDecodeError):
        return
    if old is not None and old != job.train.steps and job.train.schedule == "cosine":
        print(
            f"mesp: warning: --steps {job.train.steps} differs from the run's {old}: the cosine "
            "schedule stretches, so the result differs from an uninterrupted run",
            file=sys.stderr,
        )


def run(job: TrainJob) -> int:
    """Train as `mesp train` does; returns the exit code (0, or torchrun's for --nproc N)."""
    if job.privacy.on and (job.run.nproc > 1 or "WORLD_SIZE" in os.environ):
        raise MespError("DP-SGD runs in one process (no --nproc): the noise is drawn once")
    if job.run.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return launch_torchrun(job.argv, job.run.nproc, job.run.master_port, job.out)
    if job.run.resume:
        _warn_if_schedule_changes(job)
    if job.run.tensorboard:
        require_tensorboard(Path(job.run.tensorboard))
    if job.model.device.startswith("cuda") and "LOCAL_RANK" in os.environ:
        job.model.device = f"cuda:{os.environ['LOCAL_RANK']}"  # one GPU per data-parallel rank
    job.data.validate()
    kw = engine_kwargs(job.engine, job.model.quantize, job.train.seed, job.train.weight_decay)
    pairs = "objective" in kw  # a preference objective: the data are pairs, two rows each
    if pairs:
        _check_preference(job)
    out = job.out
    check_output_dir(out)
    resume = load_state(out) if job.run.resume else None
    # the planner sees a preference batch as what it trains: two rows per pair (its extra
    # no-tape forwards keep no activations past one block)
    rows = replace(job.train, batch_size=2 * job.train.batch_size) if pairs else job.train
    obj = job.engine.objective if pairs else "sft"  # the planner adds its buffers and passes
    budget = check_budget(
        job.run.max_memory, job.model, job.engine.engine, job.data, job.lora, rows, obj
    )
    # budget-aware recompute: not in `kw`, whose items are the fingerprint, since kept tapes
    # give the same gradient bits and a resumed run may have another budget
    tapes = budget_tapes(budget, job.model, job.engine.engine, job.data, job.lora, rows, obj)
    seed, wd = job.train.seed, job.train.weight_decay
    engine = make_engine(
        job.engine.engine, **engine_kwargs(job.engine, job.model.quantize, seed, wd, tapes)
    )
    if job.privacy.on:
        assert job.privacy.dp_clip is not None
        engine = PrivateEngine(engine, job.privacy.dp_clip, job.privacy.dp_clipping)
    attach_ref_cache(engine, job.run.ref_cache, obj)
    dp = from_env(job.run.dist_timeout, job.model.device)
    main = dp is None or dp.is_main
    say = print if main else (lambda *a, **k: None)
    tb: TensorBoardLog | None = None
    try:
        loaded = open_model(job.model, seed=job.train.seed)
        model, tok = loaded.model, loaded.tokenizer  # pre-tokenized rows need none
        job.data.check_positions(model.config.max_position_embeddings)
        engine.loss.check(model.config.vocab_size)  # type: ignore[attr-defined]
        fp = fingerprint(loaded, job.model, job.engine.engine, kw, job.data, job.lora, job.train)
        if resume is not None:  # before the data are read; DP-SGD's part needs them
            check_fingerprint(resume, fp, out, skip=("privacy",))
        if pairs:
            splits = load_pair_splits(job.data, tok, model.config.vocab_size)
        else:
            splits = load_splits(job.data, tok, vocab_size=model.config.vocab_size)
        cfg = job.train
        privacy = None
        if job.privacy.on:  # the sampling rate needs the rows; the noise, maybe the accountant
            e = cfg.batch_size * cfg.grad_accum
            privacy = DPSGD.resolve(job.privacy, len(splits["train"]), e, cfg.steps, cfg.seed)
            fp["privacy"] = privacy.fingerprint()
        if resume is not None:
            check_fingerprint(resume, fp, out)  # DP-SGD on or off, and its resolved σ, q, δ
        objective = kw.get("objective")
        pad = pad_id_of(tok, model.config)
        n_params = apply_lora(model, job.lora, seed=job.train.seed)
        if job.engine.zo_full:
            _full_model_dir(model, tok, out, resume is not None, main)
        ranks = f", {dp.world} ranks" if dp is not None else ""
        say(
            f"mesp: {loaded.source} ({model.config.family}, base {loaded.base or held(model)}, "
            f"{job.model.dtype}), {n_params:,} LoRA parameters, engine {engine.name}{ranks}, "
            f"{len(splits['train'])} train / {len(splits['valid'])} valid "
            f"{'pairs, objective ' + job.engine.objective if pairs else 'rows'}"
        )
        base_f = out / "baseline.json"  # the untrained adapter's score, kept across resumes
        before: dict = {}
        reuse = resume is not None and base_f.exists()
        if splits["valid"] and not reuse:  # every rank scores its share
            before = evaluate(
                model,
                splits["valid"],
                cfg.batch_size,
                pad,
                cfg.eval_batches,
                dp,
                objective,
                getattr(engine, "ref_cache", None),
            )
        if main:
            flags = {**job.flags(), "nproc": dp.world if dp is not None else 1}
            atomic_write(out / "run_args.json", lambda p: Path(p).write_text(json.dumps(flags)))
            if reuse:
                before = json.loads(base_f.read_text())
            elif before:
                atomic_write(base_f, lambda p: Path(p).write_text(json.dumps(before)))
        if job.run.tensorboard and main:  # the other ranks' numbers are rank 0's
            tb = TensorBoardLog(Path(job.run.tensorboard), (resume.step if resume else 0) + 1)
        res = train(
            model,
            engine,
            splits["train"],
            splits["valid"],
            cfg,
            job.lora,
            out,
            pad_id=pad,
            base_name=loaded.source,
            fingerprint=fp,
            resume=resume,
            dp=dp,
            max_memory=budget,
            tensorboard=tb,
            baseline=before or None,  # loss.png's step 0
            privacy=privacy,
        )
    except BaseException:
        shutdown()
        raise
    finally:
        if tb is not None:
            tb.close()
    shutdown(clean=True)  # every rank ended its run: leave together, not while one still saves
    if not main:
        return 0
    finish_run(out, before, res, pairs, privacy)
    return 0


def _check_preference(job: TrainJob) -> None:
    """What preference training does not do (yet): refused in one line, before any work."""
    if job.run.nproc > 1 or "WORLD_SIZE" in os.environ:
        raise MespError(f"--objective {job.engine.objective} runs in one process (no --nproc)")
    if job.train.loss_fraction < 1.0:
        raise MespError(
            "--loss-fraction applies to --objective sft (pairs score every completion token)"
        )


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
