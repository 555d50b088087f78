"""mezo: zeroth-order SPSA (MeZO, arXiv 2305.17333) with in-place perturbation; memory ≈ inference.

One probe with seed σ, z ~ N(0, I) regenerated from σ whenever it is needed (never stored):
    θ += ε·z; ℓ₊ = L(θ);  θ −= 2ε·z; ℓ₋ = L(θ);  θ += ε·z;  g = (ℓ₊ − ℓ₋) / (2ε)
and the update, z regenerated once more:  θ −= lr·(g·z + wd·θ).
g·z is an unbiased estimate of the gradient smoothed at scale ε: E[z zᵀ] ∇L = ∇L.
n-SPSA (`samples` = n) averages g_k·z_k over n seeds; the variance falls as 1/n, but the
estimate still lives in an n-dimensional subspace of the d adapter dimensions, so its cosine
with the true gradient stays near √(n/d) while n ≪ d (Qwen2.5-0.5B, d ≈ 4.4M: 0.0004 → 0.004
from n = 1 to 64; see mesp/bench/grads.py).

L is the summed token loss of the batch divided by `normalizer` (the trainer's count of trained
tokens in the accumulation group), formed without autograd by a chunked cross-entropy, so no
activation outlives its block and no (tokens × vocab) logits exist.

With grad_accum > 1 the trainer calls `step` once per micro-batch; each call probes and updates
on its own seeds, so a group is n·k sequential SPSA steps on slices of the loss (each unbiased
for its slice), not one estimate of the group's gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from mesp.batch import Batch
from mesp.engines.loss import LossSpec, loss_value
from mesp.errors import MespError
from mesp.models.transformer import CausalLM
from mesp.ops.cross_entropy import chunked_ce_loss


def perturbed_tensors(model: CausalLM, perturb_all: bool) -> list[tuple[str, Tensor]]:
    """What SPSA perturbs, in a fixed order (the order z is drawn in): the LoRA parameters, or,
    with `perturb_all`, every floating tensor of the model (adapters, frozen weights, norms and
    biases). A packed 4/8-bit base has no continuous values to nudge, so it is refused."""
    if not perturb_all:
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if any(getattr(m, "quant", None) is not None for m in model.modules()):
        raise MespError("mezo perturb_all needs an unquantized base (use --quantize none)")
    named = [*model.named_parameters(), *model.named_buffers()]
    return [(n, t) for n, t in named if t is not None and t.is_floating_point()]


class MeZOEngine:
    name = "mezo"
    updates_params = True  # the trainer must not call opt.step(): `step` has already updated

    def __init__(
        self,
        lr: float = 1e-4,
        eps: float = 1e-2,
        samples: int = 1,
        weight_decay: float = 0.0,
        seed: int = 0,
        perturb_all: bool = False,
        chunk_rows: int = 512,
        vocab_chunk: int = 8192,
        loss: LossSpec | None = None,
    ) -> None:
        if samples < 1:
            raise MespError(f"mezo samples must be at least 1, got {samples}")
        if not (eps > 0 and math.isfinite(eps)):
            raise MespError(f"mezo eps must be a positive finite number, got {eps}")
        self.lr, self.eps, self.samples, self.weight_decay = lr, eps, samples, weight_decay
        self.perturb_all = perturb_all
        self.chunk_rows, self.vocab_chunk = chunk_rows, vocab_chunk
        self.loss = loss or LossSpec()
        self._seeds = torch.Generator().manual_seed(seed)  # draws one seed per probe
        self._last: list[tuple[float, int]] = []
        # set by the trainer under data parallelism: sums a list of floats over all ranks
        self.reduce: Callable[[list[float]], list[float]] | None = None

    def set_lr(self, lr: float) -> None:
        """The trainer owns the schedule; it hands the current rate in before each step."""
        self.lr = lr

    def state_dict(self) -> dict[str, Tensor]:
        """The seed stream's position, so a resumed run draws the seeds it would have drawn."""
        return {"seeds": self._seeds.get_state()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self._seeds.set_state(state["seeds"])

    # -- the pieces -------------------------------------------------------------------------
    def next_seed(self) -> int:
        return int(torch.randint(0, 2**62, (), generator=self._seeds))

    @torch.no_grad()
    def loss_sum(self, model: CausalLM, batch: Batch) -> float:
        """Summed token loss, forward only: one block's activations and one CE chunk at a time."""
        h = model.hidden(batch.input_ids)
        self.loss.check(model.config.vocab_size)
        head, cap = model.head_weight(), model.config.final_logit_softcapping
        opts = self.loss.ce_options(self.chunk_rows, self.vocab_chunk)
        loss, _ = chunked_ce_loss(h, batch.targets, batch.mask, head, cap, opts=opts)
        return loss_value(loss)

    def directions(self, model: CausalLM, seed: int) -> Iterator[tuple[str, Tensor, Tensor]]:
        """(name, tensor, z) for each perturbed tensor: z drawn tensor by tensor, in a fixed
        order, from one generator seeded with `seed`, so one seed always gives the same z.
        Only one tensor's z exists at a time."""
        named = perturbed_tensors(model, self.perturb_all)
        dev = named[0][1].device if named else torch.device("cpu")
        g = torch.Generator(device="cpu" if dev.type == "meta" else dev).manual_seed(seed)
        for name, t in named:
            if t.is_meta:  # memory accounting: the direction's size, no values
                yield name, t, torch.empty_like(t)
                continue
            yield name, t, torch.randn(t.shape, generator=g, dtype=t.dtype, device=t.device)

    @torch.no_grad()
    def _add_z(self, model: CausalLM, seed: int, alpha: float) -> None:
        """θ += alpha·z(seed), in place."""
        for _, t, z in self.directions(model, seed):
            t.add_(z, alpha=alpha)

    def probe(
        self, model: CausalLM, batch: Batch, normalizer: int, seed: int
    ) -> tuple[float, float, float]:
        """Two-sided difference along z(seed); θ is restored (to rounding) on return.
        Returns (projected gradient g of loss_sum / normalizer, ℓ₊, ℓ₋) with ℓ summed losses."""
        self._add_z(model, seed, self.eps)
        plus = self.loss_sum(model, batch)
        self._add_z(model, seed, -2 * self.eps)
        minus = self.loss_sum(model, batch)
        self._add_z(model, seed, self.eps)
        return (plus - minus) / (2 * self.eps * normalizer), plus, minus

    @torch.no_grad()
    def update(self, model: CausalLM, probes: list[tuple[float, int]]) -> None:
        """θ −= lr·(mean_k g_k·z_k + wd·θ). Decay is taken first, on θ before the step, as in
        MeZO; each z_k is regenerated from its seed."""
        if self.weight_decay:
            for _, t in perturbed_tensors(model, self.perturb_all):
                t.mul_(1 - self.lr * self.weight_decay)
        for g, seed in probes:
            self._add_z(model, seed, -self.lr * g / len(probes))

    # -- the Engine protocol ------------------------------------------------------------------
    def step(self, model: CausalLM, batch: Batch, normalizer: int) -> float:
        """Probe `samples` seeds, then update in place. Returns the batch's summed loss as the
        mean of ℓ₊ and ℓ₋ over the probes: L(θ) + O(ε²) since the odd terms cancel (MeZO logs
        ℓ₊ alone, which is off by ε·zᵀ∇L), at no third forward."""
        probes, total = [], 0.0
        for _ in range(self.samples):
            seed = self.next_seed()
            g, plus, minus = self.probe(model, batch, normalizer, seed)
            probes.append((g, seed))
            total += (plus + minus) / 2
        if self.reduce is not None:  # data parallel: each g was this rank's share of the sum
            probes = list(
                zip(self.reduce([g for g, _ in probes]), [s for _, s in probes], strict=True)
            )
        self._last = probes
        if math.isfinite(total) and all(math.isfinite(g) for g, _ in probes):
            self.update(model, probes)  # a NaN g would poison every weight: leave θ for the
        return total / self.samples  # trainer, which stops on the non-finite loss

    def projected_grad_and_seed(self) -> list[tuple[float, int]]:
        """(g, seed) of each probe of the last step. Data parallel needs only this: ranks agree
        on seeds (same engine seed), all-reduce the scalar g's mean, then call `update` with it;
        no gradient tensor ever crosses ranks."""
        return list(self._last)

    def estimate(
        self,
        model: CausalLM,
        batch: Batch,
        normalizer: int,
        seed: int,
        samples: int | None = None,
    ) -> dict[str, Tensor]:
        """The n-SPSA gradient estimate mean_k g_k·z_k per tensor name, θ left unchanged (for
        analysis; it materialises a gradient-sized dict, which training never does). Seeds are
        drawn from `seed`, so the same arguments give the same estimate."""
        n = self.samples if samples is None else samples
        seeds = torch.Generator().manual_seed(seed)
        named = perturbed_tensors(model, self.perturb_all)
        wide = [torch.promote_types(t.dtype, torch.float32) for _, t in named]
        est = {name: torch.zeros_like(t, dtype=w) for (name, t), w in zip(named, wide, strict=True)}
        for _ in range(n):
            s = int(torch.randint(0, 2**62, (), generator=seeds))
            g, _, _ = self.probe(model, batch, normalizer, s)
            for name, _, z in self.directions(model, s):
                est[name].add_(z.to(est[name].dtype), alpha=g / n)
        return est
