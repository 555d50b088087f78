"""Data-parallel training on torch.distributed (gloo on CPU, NCCL on GPU), launched by torchrun.

Every rank builds the same global batch (same data, same seed) and keeps a disjoint slice of its
rows. The loss is normalised by the GLOBAL number of trained tokens, which every rank can count
from the global batch without talking to the others; so each rank's gradient is its share of
the global mean-loss gradient, and one SUM all-reduce gives exactly the single-process gradient.
Adapters are small: the gradients travel as one flattened buffer (one bucket), with the loss
appended as one more element. What does not scale: per-rank memory stays the single-device
figure (each rank holds the whole model), only throughput and the global batch grow.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mesp.batch import Batch
from mesp.errors import MespError


@dataclass
class DataParallel:
    rank: int
    world: int

    def shard(self, batch: Batch) -> Batch:
        """This rank's rows of a global batch. A rank left without rows (a short last batch)
        gets one row with nothing trained, so it still takes part in every collective."""
        n = batch.input_ids.shape[0]
        lo, hi = self.rank * n // self.world, (self.rank + 1) * n // self.world
        if hi <= lo:
            return Batch(batch.input_ids[:1], batch.targets[:1], torch.zeros_like(batch.mask[:1]))
        return Batch(batch.input_ids[lo:hi], batch.targets[lo:hi], batch.mask[lo:hi])

    def sum_scalars(self, values: list[float]) -> list[float]:
        """All-reduce a few floats. MeZO's data parallelism needs only this: every rank draws
        the same seeds, so the projected gradients (one scalar per probe) are all it shares."""
        t = torch.tensor(values, dtype=torch.float64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        except Exception as e:
            raise MespError(
                f"rank {self.rank}: lost contact with another rank ({str(e).splitlines()[0]})"
            ) from None
        return t.tolist()

    def all_reduce(
        self, params: list[torch.nn.Parameter], loss_sum: float, stop: int = 0
    ) -> tuple[float, int]:
        """Sum gradients, the loss and the stop flags over ranks in one flattened buffer, so
        every rank takes the same step and stops (on a signal to any rank) at the same step."""
        ref = params[0]
        parts = [
            p.grad.reshape(-1)
            if p.grad is not None
            else torch.zeros(p.numel(), dtype=ref.dtype, device=ref.device)
            for p in params
        ]
        tail = torch.tensor([loss_sum, float(stop)], dtype=ref.dtype, device=ref.device)
        flat = torch.cat([*parts, tail])
        if flat.dtype != torch.float32 and ref.device.type == "cpu":
            flat = flat.float()  # gloo's sum is exact enough in fp32; keep bf16 grads honest
        try:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        except Exception as e:  # gloo/NCCL raise their own types when a peer dies
            raise MespError(
                f"rank {self.rank}: lost contact with another rank ({str(e).splitlines()[0]}); "
                "resume from the last saved state with --resume"
            ) from None
        i = 0
        for p in params:
            chunk = flat[i : i + p.numel()].view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = chunk.clone()
            else:
                p.grad.copy_(chunk)
            i += p.numel()
        return float(flat[-2]), int(flat[-1] > 0)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_env(timeout_s: float = 120.0, device: str = "cpu") -> DataParallel | None:
    """Join the process group torchrun describes (WORLD_SIZE > 1); None for a single process.
    The backend follows where the adapters live: NCCL for a model on CUDA (`--device cuda`,
    one GPU per rank), gloo on the CPU. A finite timeout makes the survivors fail within
    `timeout_s` when a rank dies."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if not dist.is_initialized():
        join(backend, timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return DataParallel(dist.get_rank(), dist.get_world_size())


def join(backend: str, timeout_s: float) -> None:
    """init_process_group from torchrun's environment, torch.distributed.nn imported first.

    That module binds `group.WORLD` as a default argument of its collectives when it is
    imported; torch._dynamo imports it, and the first optimizer imports dynamo. Imported after
    init, it pins the default group: destroy_process_group() can no longer free it, so its gloo
    threads and sockets outlive shutdown() and are torn down only at interpreter exit, in
    whatever order the interpreter and the C++ static destructors happen to take."""
    import torch.distributed.nn  # noqa: F401

    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:
        raise MespError(f"could not join the process group: {str(e).splitlines()[0]}") from None


def shutdown(clean: bool = False) -> None:
    """Leave the process group. `clean` (a run that ended normally on every rank): first wait
    at a barrier, so that no rank closes its connections while another one still works."""
    if dist.is_initialized():
        if clean:
            try:
                dist.barrier()
            except Exception:  # a rank that failed after its last step reports that itself
                pass
        dist.destroy_process_group()


def launch_torchrun(argv: list[str], nproc: int, master_port: int, out: Path) -> int:
    """`mesp train --nproc N …` = `torchrun --nproc-per-node N -m mesp train …` (through
    mesp.training.launch); `out` is where the ranks save and log, named in the one line a
    failed run ends with."""
    from mesp.training.launch import run_ranks

    argv = list(argv)
    if "--nproc" in argv:  # absent when the count came from a resumed run's flags
        i = argv.index("--nproc")
        del argv[i : i + 2]
    rc, failed = run_ranks(nproc, master_port, out / "logs", argv)
    if rc not in (0, 130, 143):  # torchrun's own report is long; end with the one line to act on
        raise MespError(
            f"a data-parallel rank failed ({failed or f'torchrun exit {rc}'}); the last saved "
            f"state is in {out}: resume with mesp train --resume {out}"
        )
    return rc
