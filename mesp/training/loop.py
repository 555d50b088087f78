"""One training loop for every engine; the engine is the only plug point."""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path
from typing import Any

import torch

from mesp.batch import Example, keep_last_fraction
from mesp.data.batches import BatchStream
from mesp.data.preference import PairStream
from mesp.engines import Engine
from mesp.errors import MespError
from mesp.lora import LoraConfig, save_adapter
from mesp.models.transformer import CausalLM
from mesp.training import best
from mesp.training.checkpoint import TrainState, restore, save_state
from mesp.training.config import TrainConfig, TrainResult
from mesp.training.distributed import DataParallel
from mesp.training.evaluate import evaluate
from mesp.training.plot import plot_losses
from mesp.training.privacy import DPSGD
from mesp.training.schedule import lr_factor, make_optimizer
from mesp.training.signals import Interrupted, SignalFlag, progress_bar
from mesp.training.tensorboard import TensorBoardLog


def train(
    model: CausalLM,
    engine: Engine,
    train_examples: list[Example],
    valid_examples: list[Example],
    cfg: TrainConfig,
    lora: LoraConfig,
    out_dir: Path,
    pad_id: int = 0,
    base_name: str = "",
    fingerprint: dict[str, Any] | None = None,
    resume: TrainState | None = None,
    dp: DataParallel | None = None,
    max_memory: int | None = None,
    tensorboard: TensorBoardLog | None = None,
    baseline: dict[str, float] | None = None,
    privacy: DPSGD | None = None,
) -> TrainResult:
    """Train the model's adapters with `engine`; with `dp`, this process is one data-parallel
    rank: it computes its slice of each global batch, every rank scores its share of the
    validation batches, and only rank 0 logs and saves.

    `max_memory`: stop (saving first) when the frozen weights plus what training adds to the
    process's peak RSS (or the CUDA peak) cross it. Measured from the RSS just before the first
    step less the weights' bytes, with the high-water mark reset there: the interpreter, torch,
    one-time imports and a loading spike are not the run's memory; the weights are.

    `tensorboard`: rank 0's writer, given every row log.jsonl gets; the caller closes it.
    `baseline`: the validation before training, loss.png's step 0.
    `privacy`: DP-SGD (training/privacy.py): each step's rows a Poisson sample, the engine (a
    PrivateEngine) clips per example, the loop adds the noise and logs ε.
    `cfg.keep_best` / `cfg.early_stop`: see training/best.py."""
    from mesp.memory.rss import cuda_peak_bytes, current_rss_bytes, peak_rss_bytes, reset_peak_rss

    params = model.lora_parameters()
    opt = make_optimizer(params, cfg.optimizer, cfg.lr, cfg.weight_decay)
    objective = getattr(engine, "objective", None)  # a preference objective: pairs of rows
    stream_cls = PairStream if objective is not None else BatchStream
    stream = stream_cls(train_examples, cfg.batch_size, seed=cfg.seed, pad_id=pad_id)
    st = resume or TrainState(fingerprint=fingerprint or {})
    best.check_setup(cfg, bool(valid_examples))
    if resume is not None:
        restore(model, opt, resume)
        stream.load_state_dict(resume.stream)
        if resume.engine and hasattr(engine, "load_state_dict"):
            engine.load_state_dict(resume.engine)
    main = dp is None or dp.is_main
    if dp is not None and hasattr(engine, "reduce"):  # mezo: ranks share scalars, not tensors
        engine.reduce = dp.sum_scalars
    out_dir.mkdir(parents=True, exist_ok=True)
    if resume is None and main:
        best.clear_stale(out_dir)
    # a resumed run continues its log; a fresh run into an old directory starts a new one
    log_f = (out_dir / "log.jsonl").open("a" if resume is not None else "w") if main else None
    bar = progress_bar(cfg, st.step) if main else None
    t_start = time.perf_counter()
    stop = SignalFlag()
    weights = sum(t.numel() * t.element_size() for t in model.buffers())
    base_rss = current_rss_bytes() - weights
    if max_memory is not None:
        reset_peak_rss()
    dev = model.device
    updates_itself = getattr(engine, "updates_params", False)  # mezo: no gradient tensors

    def log(row: dict[str, Any]) -> None:
        if log_f is not None:
            log_f.write(json.dumps(row) + "\n")
            log_f.flush()
        if tensorboard is not None:
            tensorboard.add(row)

    def validate(step: int) -> None:
        if not valid_examples:  # --valid-fraction 0 and no valid.jsonl
            return
        model.eval()
        v = evaluate(
            model,
            valid_examples,
            cfg.batch_size,
            pad_id,
            cfg.eval_batches,
            dp,
            objective,
            getattr(engine, "ref_cache", None),  # DPO's cached reference: valid rows too
        )
        better = best.record(st, step, v["loss"])  # on every rank: all stop at one step
        if not main:
            return
        st.valid.append({"step": step, **v})
        row = {"step": step, "valid_loss": v["loss"], "valid_ppl": v["ppl"]}
        for k in ("accuracy", "margin"):  # preference objectives (TensorBoard: valid/…)
            if k in v:
                row[f"valid_{k}"] = v[k]
        if better and (cfg.keep_best or cfg.early_stop):
            row["valid_best_loss"] = v["loss"]  # TensorBoard: valid/best_loss
        log(row)
        if better and cfg.keep_best:  # before this step's checkpoint can record it
            best.save_best(out_dir, step, v, lambda d: save_adapter(model, d, lora, base_name))

    def checkpoint() -> None:
        """Adapter and full state together: what a crash right after this line resumes from."""
        if not main:
            return
        st.stream = stream.state_dict()
        st.engine = engine.state_dict() if hasattr(engine, "state_dict") else {}
        save_adapter(model, out_dir, lora, base_name)
        if privacy is not None:  # the guarantee of the adapter just saved
            privacy.write(out_dir / "privacy.json", st.step)
        if getattr(engine, "perturb_all", False):  # mezo --zo-full: the base is trained too
            from mesp.convert.merge import write_model_dir

            write_model_dir(model, None, out_dir / "model")
        save_state(out_dir, model, opt, st)

    # data parallel: a rank stops only where the all-reduce said some rank had a signal. Its own
    # flag alone is not enough: a signal landing on one rank just after a step's all-reduce, on
    # the other just before, stopped one at that step and sent the other into the next
    # all-reduce, alone (it died there, and rank 0 saved nothing)
    agreed = 0
    with stop:
        while st.step < cfg.steps and not best.stopped(st, cfg):
            step = st.step + 1
            t0 = time.perf_counter()
            lr = cfg.lr * lr_factor(st.step, cfg.steps, cfg.warmup, cfg.schedule)
            for g in opt.param_groups:
                g["lr"] = lr
            if hasattr(engine, "set_lr"):  # engines that update parameters themselves (mezo)
                engine.set_lr(lr)
            if privacy is not None:  # a Poisson sample, in micro-batches; maybe none
                drawn = privacy.sample(step, train_examples, cfg.batch_size, pad_id)
            else:
                drawn = [next(stream) for _ in range(cfg.grad_accum)]
            micro = [keep_last_fraction(b, cfg.loss_fraction) for b in drawn]
            trained = sum(b.n_tokens for b in micro)
            # a preference engine's step returns its micro-batch's mean pair loss: the group's
            # loss is their mean (TRL's gradient accumulation); SFT's is the mean token loss;
            # DP-SGD's the mean over rows of each row's mean token loss
            normalizer = len(micro) if getattr(engine, "batch_mean", False) else trained
            if privacy is not None:
                normalizer = max(sum(b.mask.shape[0] for b in micro), 1)
            skipped = ""
            if trained == 0 and privacy is None:  # e.g. every target masked: never a NaN
                skipped = "no trained tokens in batch"
            else:
                local = [dp.shard(b) for b in micro] if dp is not None else micro
                loss_sum = sum(engine.step(model, b.to(dev), normalizer) for b in local)
                if dp is not None:
                    if updates_itself:  # mezo shared its scalars already
                        loss_sum, any_stop = dp.sum_scalars([loss_sum, float(stop.signum)])
                    else:
                        loss_sum, any_stop = dp.all_reduce(params, loss_sum, stop.signum)
                    agreed = (stop.signum or signal.SIGTERM) if any_stop else 0
                if privacy is not None:  # an empty sample still steps: noise alone
                    privacy.privatize(params, step)
                loss = loss_sum / normalizer
                finite = math.isfinite(loss) and all(
                    p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params
                )
                if not finite:
                    opt.zero_grad(set_to_none=True)
                    if not cfg.skip_nonfinite:
                        if main:
                            save_adapter(model, out_dir, lora, base_name)  # the last good one
                        raise MespError(
                            f"non-finite loss or gradient at step {step}; the last good adapter "
                            f"is in {out_dir} (use --skip-nonfinite to skip such batches)"
                        )
                    skipped = "non-finite loss or gradient"
            if skipped:  # nothing learned; the save, signal and memory checks below still run
                log({"step": step, "skipped": skipped})
                st.step = step
                if bar is not None:
                    bar.update(1)
            else:
                if cfg.clip > 0 and privacy is None:  # DP-SGD: the per-example bound instead
                    torch.nn.utils.clip_grad_norm_(params, cfg.clip)
                if not updates_itself:
                    opt.step()
                opt.zero_grad(set_to_none=True)
                st.step = step
                dt = time.perf_counter() - t0
                tokens = sum(b.input_ids.numel() for b in micro)  # positions, padding included
                row = {
                    "step": step,
                    "loss": loss,
                    "lr": lr,
                    "tokens_per_s": tokens / dt,
                    "trained_tokens_per_s": trained / dt,
                    "step_s": dt,
                    "peak_rss_mb": peak_rss_bytes() / 2**20,
                }
                if privacy is not None:
                    row["dp_rows"] = sum(b.mask.shape[0] for b in micro)
                    eps = privacy.epsilon(step)
                    row["epsilon"] = eps if math.isfinite(eps) else None  # noise 0: none
                cuda_peak = cuda_peak_bytes()
                if cuda_peak is not None:
                    row["cuda_peak_mb"] = cuda_peak / 2**20
                st.losses.append(loss)
                log(row)
                if bar is not None:
                    bar.set_postfix(
                        loss=f"{loss:.3f}",
                        tok_s=f"{tokens / dt:.0f}",
                        peak=f"{row['peak_rss_mb']:.0f}MB",
                        refresh=False,
                    )
                    bar.update(1)
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                validate(step)
            halt = agreed if dp is not None else stop.signum
            if (cfg.save_every and step % cfg.save_every == 0) or halt:
                checkpoint()
            if max_memory is not None:
                grown = max(peak_rss_bytes() - base_rss, cuda_peak_bytes() or 0)
                if dp is not None:  # the largest rank's peak: all stop at one step, rank 0 saves
                    slots = [0.0] * dp.world
                    slots[dp.rank] = float(grown)
                    grown = int(max(dp.sum_scalars(slots)))
                if grown > max_memory:
                    checkpoint()
                    raise MespError(
                        f"measured peak {grown / 2**20:.0f} MiB crossed --max-memory "
                        f"({max_memory / 2**20:.0f} MiB) at step {step}; adapter and state "
                        f"saved in {out_dir}"
                    )
            if halt:
                if bar is not None:
                    bar.close()
                code = 128 + halt
                raise Interrupted(
                    code,
                    f"interrupted at step {step}; adapter and training "
                    f"state saved in {out_dir} (resume: mesp train "
                    f"--resume {out_dir})",
                )
        if bar is not None:
            bar.close()
        # still under the flag: a signal during the last validation or save lets both finish
        early = best.stopped(st, cfg)  # it validated at its last step already
        if not early and (not st.valid or st.valid[-1]["step"] != cfg.steps):
            validate(cfg.steps)
        checkpoint()
        if stop.signum:
            raise Interrupted(
                128 + stop.signum,
                f"interrupted after the last step ({st.step}); the run is complete, its "
                f"adapter and training state saved in {out_dir}",
            )
    if log_f is not None:
        log_f.close()
        plot_losses(out_dir / "loss.png", st.losses, st.valid, baseline)
        line = best.final_line(st, cfg, out_dir, early)
        if line:
            print(line, flush=True)
    return TrainResult(
        st.step, st.losses, st.valid, out_dir, peak_rss_bytes(), time.perf_counter() - t_start
    )
