"""DP-SGD for `mesp train` / `mesp grad`: the flags, Poisson sampling, the noise, the accountant.

A step (Abadi et al. 2016, as Opacus runs it with Poisson sampling):
  1. every training row joins the step's batch independently with probability q = E / N, where
     E = --batch-size × --grad-accum is the *expected* batch size and N the training rows; the
     sampled rows run through the engine in micro-batches of at most --batch-size rows (so a
     step's memory is a plain micro-batch's; its time varies with the sample);
  2. each row's loss is the mean cross-entropy over its own trained tokens; its LoRA gradient
     is clipped where it is made (mesp/engines/clipping.py: per-layer or flat, bound C) and
     the clipped gradients are summed;
  3. Gaussian noise of std σ·C is added to every coordinate of the sum (a generator seeded by
     --seed and the step: a resumed run draws the same noise), and the result divided by E;
  4. the optimizer steps (--clip, the non-private global clip, is not applied: the per-example
     bound replaces it).
The sampled batch may be empty: the step is then noise alone (skipping it would depend on the
data). The accountant is Google's dp-accounting (RDP, Poisson-subsampled Gaussian): ε at δ for
the steps so far. δ defaults to min(1e-5, 1/N²), below 1/N as the guarantee needs.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mesp.accountant import epsilon, solve_noise
from mesp.atomic_io import atomic_write
from mesp.batch import Batch, Example, collate
from mesp.engines.clipping import CLIPPINGS
from mesp.errors import MespError


@dataclass
class PrivacyConfig:
    dp_clip: float | None = field(
        default=None,
        metadata={"help": "DP-SGD: each example's gradient norm bound C (turns DP-SGD on)"},
    )
    dp_noise: float | None = field(
        default=None,
        metadata={"help": "DP-SGD noise multiplier σ (noise std σ·C on the clipped sum)"},
    )
    dp_epsilon: float | None = field(
        default=None,
        metadata={"help": "DP-SGD target ε for the whole run (σ solved for --steps and q)"},
    )
    dp_delta: float | None = field(
        default=None, metadata={"help": "DP-SGD δ (default: min(1e-5, 1/N²), N training rows)"}
    )
    dp_clipping: str = field(
        default="per-layer",
        metadata={
            "help": "DP-SGD clipping: per-layer (each LoRA linear to C/√K) or flat (one norm)",
            "choices": CLIPPINGS,
        },
    )

    def __post_init__(self) -> None:
        c, s, e, d = self.dp_clip, self.dp_noise, self.dp_epsilon, self.dp_delta
        if c is None:
            if s is not None or e is not None or d is not None or self.dp_clipping != "per-layer":
                raise MespError("--dp-noise/--dp-epsilon/--dp-delta/--dp-clipping need --dp-clip")
            return
        if not (c > 0 and math.isfinite(c)):
            raise MespError(f"--dp-clip must be a positive number, got {c}")
        if s is not None and not (s >= 0 and math.isfinite(s)):
            raise MespError(f"--dp-noise must be 0 or more, got {s}")
        if e is not None and not (e > 0 and math.isfinite(e)):
            raise MespError(f"--dp-epsilon must be positive, got {e}")
        if d is not None and not 0 < d < 1:
            raise MespError(f"--dp-delta must be in (0, 1), got {d}")
        if (s is None) == (e is None):
            raise MespError("DP-SGD needs one of --dp-noise SIGMA or --dp-epsilon EPS")
        if self.dp_clipping not in CLIPPINGS:
            raise MespError(f"--dp-clipping must be one of {', '.join(CLIPPINGS)}")

    @property
    def on(self) -> bool:
        return self.dp_clip is not None


@dataclass
class DPSGD:
    """One run's DP-SGD: sampling rate, noise multiplier, bound and δ (resolved from the flags
    and the data), and the per-step sampling and noise."""

    clip: float
    sigma: float
    q: float
    delta: float
    clipping: str
    expected: float  # E = q·N, the denominator of the update
    seed: int

    @classmethod
    def resolve(
        cls, cfg: PrivacyConfig, n_rows: int, expected: int, steps: int, seed: int
    ) -> DPSGD:
        assert cfg.dp_clip is not None
        if n_rows < 1:
            raise MespError("DP-SGD needs training rows")
        q = min(1.0, expected / n_rows)
        delta = cfg.dp_delta if cfg.dp_delta is not None else min(1e-5, 1.0 / n_rows**2)
        sigma = cfg.dp_noise
        if sigma is None:
            assert cfg.dp_epsilon is not None
            sigma = solve_noise(cfg.dp_epsilon, q, steps, delta)
        else:
            epsilon(q, max(sigma, 1e-3), 1, delta)  # the accountant is there before the run
        return cls(cfg.dp_clip, sigma, q, delta, cfg.dp_clipping, q * n_rows, seed)

    def _generator(self, step: int, purpose: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + 2 * step + purpose) % 2**62)

    def sample(self, step: int, rows: list[Example], micro: int, pad_id: int) -> list[Batch]:
        """Step `step`'s Poisson sample of `rows`, in micro-batches of at most `micro` rows."""
        pick = torch.rand(len(rows), generator=self._generator(step, 0)) < self.q
        chosen = [rows[i] for i in pick.nonzero().flatten().tolist()]
        return [collate(chosen[i : i + micro], pad_id) for i in range(0, len(chosen), micro)]

    def privatize(self, params: list[torch.nn.Parameter], step: int) -> None:
        """grad <- (Σ clipped + N(0, σ²C²)) / E, every parameter (a missing grad is 0)."""
        g = self._generator(step, 1)
        std = self.sigma * self.clip
        for p in params:
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32) * std
            total = noise.to(p.device) if p.grad is None else p.grad.float() + noise.to(p.device)
            p.grad = (total / self.expected).to(p.dtype)

    def epsilon(self, steps: int) -> float:
        return epsilon(self.q, self.sigma, steps, self.delta)

    def record(self, steps: int) -> dict[str, Any]:
        """What summary.json and the adapter's privacy.json say of the guarantee."""
        eps = self.epsilon(steps)
        return {
            **{k: v for k, v in asdict(self).items() if k != "seed"},
            "steps": steps,
            "epsilon": eps if math.isfinite(eps) else None,  # noise 0: no guarantee
            "accountant": "dp-accounting RDP, Poisson-subsampled Gaussian",
            "unit": "one training row (sequence)",
        }

    def write(self, path: Path, steps: int) -> None:
        """privacy.json beside the adapter: the guarantee it was trained under."""
        text = json.dumps(self.record(steps), indent=2) + "\n"
        atomic_write(path, lambda p: Path(p).write_text(text))

    def fingerprint(self) -> dict[str, Any]:
        """What a resumed run must keep (the noise σ as solved: an --dp-epsilon run whose
        --steps changed would need another σ, so it cannot be resumed under the old one)."""
        keep = ("clip", "sigma", "q", "delta", "clipping")
        return json.loads(json.dumps({k: getattr(self, k) for k in keep}))

    def summary_line(self, steps: int) -> str:
        eps = self.epsilon(steps)
        spent = f"ε = {eps:.3f}" if math.isfinite(eps) else "no guarantee (noise 0)"
        return (
            f"mesp: DP-SGD {spent} at δ = {self.delta:.3g} after {steps} steps (noise σ = "
            f"{self.sigma:.4g}, bound C = {self.clip:g}, {self.clipping}, sampling rate "
            f"q = {self.q:.4g}); the guarantee is in privacy.json"
        )
