"""DP-SGD in the Python driver of the on-device programs: the twin of the native runner's
(runtime/src/private.h, train_private.cpp), the same flags, generator and step, so the two
drivers train the same adapter; the engine's DP-SGD (mesp/training/privacy.py) is the reference
at noise 0.

A step at sampling rate q = E / N (E = --dp-batch, the expected rows per step, default the
export's batch size; N the rows of --data):
  * every row joins with probability q (uniform u_r < q from the stream (seed, step, 0));
  * each sampled row runs alone (slot 0 of the exported batch; the other slots are padded and
    untrained, so their gradients are exactly zero), its loss the mean over its own trained
    tokens; each LoRA linear's (gA, gB) is clipped to C/√K (per-layer, K the adapted linears)
    or the whole adapter's gradient to C (flat) and added to the step's sum;
  * the sum plus N(0, (σC)²) per coordinate (stream (seed, step, 1 + t), t the tensor's index:
    blocks in order, each block's tensors in its forward program's order), divided by E, goes
    to the optimizer. An empty sample is a noise-only step.
The generator is counter-based (SplitMix64's mixer at key + (i + 1)·γ): uniforms with 53 bits,
normals by Box-Muller on the pairs (2m, 2m + 1). The accountant is dp-accounting's RDP
(mesp/accountant.py); the native runner carries its own port of it.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mesp.accountant import bisect_noise, epsilon
from mesp.errors import MespError

MASK, GOLDEN = 2**64 - 1, 0x9E3779B97F4A7C15
Rows = list[tuple[list[int], list[int]]]


def _mix(z: Any) -> Any:
    """SplitMix64's finalizer on a uint64 array (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _mix1(z: int) -> int:
    return int(_mix(np.array([z & MASK], dtype=np.uint64))[0])


class DpStream:
    """Values 0..n-1 of the stream keyed by (seed, step, purpose)."""

    def __init__(self, seed: int, step: int, purpose: int) -> None:
        self.key = _mix1(_mix1(_mix1(seed) + step) + purpose)

    def uniform(self, n: int) -> np.ndarray:
        i = np.arange(1, n + 1, dtype=np.uint64)
        with np.errstate(over="ignore"):
            z = _mix(np.uint64(self.key) + i * np.uint64(GOLDEN))
        return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53

    def normal(self, n: int) -> np.ndarray:
        u = self.uniform(2 * ((n + 1) // 2))
        r, t = np.sqrt(-2.0 * np.log(1.0 - u[0::2])), 2.0 * math.pi * u[1::2]
        out = np.empty(u.shape[0])
        out[0::2], out[1::2] = r * np.cos(t), r * np.sin(t)
        return out[:n]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The runner's DP-SGD flags (the native runner takes the same)."""
    g = p.add_argument_group("DP-SGD (each row's gradient clipped, Gaussian noise, ε per step)")
    g.add_argument("--dp-clip", type=float, metavar="C", help="per-row gradient norm bound")
    g.add_argument("--dp-noise", type=float, metavar="SIGMA", help="noise multiplier σ")
    g.add_argument("--dp-epsilon", type=float, metavar="EPS", help="target ε (σ solved)")
    g.add_argument("--dp-delta", type=float, metavar="D", help="δ (default min(1e-5, 1/N²))")
    g.add_argument(
        "--dp-batch",
        type=float,
        metavar="E",
        help="expected rows per step (Poisson; default the export's batch size)",
    )
    g.add_argument("--dp-clipping", choices=("per-layer", "flat"), default=None)
    g.add_argument("--seed", type=int, default=None, help="DP-SGD's generator (default 0)")


@dataclass
class DpPlan:
    clip: float
    sigma: float
    q: float
    delta: float
    expected: float
    flat: bool
    seed: int

    @classmethod
    def resolve(cls, ns: argparse.Namespace, n_rows: int, steps: int, batch: int) -> DpPlan | None:
        """The flags checked against the data (n_rows) and --steps; None without --dp-*."""
        c, s, e, d, b = ns.dp_clip, ns.dp_noise, ns.dp_epsilon, ns.dp_delta, ns.dp_batch
        if all(v is None for v in (c, s, e, d, b, ns.dp_clipping)):
            if ns.seed is not None:
                raise MespError("--seed needs --dp-clip (only DP-SGD draws random numbers)")
            return None
        if c is None:
            raise MespError(
                "--dp-noise/--dp-epsilon/--dp-delta/--dp-clipping/--dp-batch need --dp-clip"
            )
        if not (c > 0 and math.isfinite(c)):
            raise MespError("--dp-clip must be a positive number")
        if s is not None and not (s >= 0 and math.isfinite(s)):
            raise MespError("--dp-noise must be 0 or more")
        if e is not None and not (e > 0 and math.isfinite(e)):
            raise MespError("--dp-epsilon must be positive")
        if d is not None and not 0 < d < 1:
            raise MespError("--dp-delta must be in (0, 1)")
        if (s is None) == (e is None):
            raise MespError("DP-SGD needs one of --dp-noise SIGMA or --dp-epsilon EPS")
        expected = float(batch if b is None else b)
        if not (expected > 0 and math.isfinite(expected)):
            raise MespError("--dp-batch must be a positive number")
        seed = 0 if ns.seed is None else ns.seed
        if seed < 0:
            raise MespError("--seed: expected an integer >= 0")
        q = min(1.0, expected / n_rows)
        delta = d if d is not None else min(1e-5, 1.0 / n_rows**2)
        sigma = s if s is not None else bisect_noise(e, q, steps, delta)
        return cls(c, sigma, q, delta, q * n_rows, ns.dp_clipping == "flat", seed)

    def epsilon(self, steps: int) -> float:
        return epsilon(self.q, self.sigma, steps, self.delta)

    def privacy_json(self, steps: int) -> str:
        eps = self.epsilon(steps)
        rec = {
            "clip": self.clip,
            "sigma": self.sigma,
            "q": self.q,
            "delta": self.delta,
            "clipping": "flat" if self.flat else "per-layer",
            "expected": self.expected,
            "steps": steps,
            "epsilon": eps if math.isfinite(eps) else None,
            "accountant": "RDP, Poisson-subsampled Gaussian (dp-accounting's orders)",
            "unit": "one training row (sequence)",
        }
        return json.dumps(rec, indent=2) + "\n"

    def note(self, steps: int, sampled: int) -> str:
        """The step line's tail: the sample's size and the ε spent so far."""
        eps = self.epsilon(steps)
        return f" rows {sampled} epsilon " + (f"{eps:.6f}" if math.isfinite(eps) else "inf")

    def summary(self, steps: int) -> str:
        eps = self.epsilon(steps)
        spent = f"epsilon = {eps:.3f}" if math.isfinite(eps) else "no guarantee (noise 0)"
        return (
            f"DP-SGD: {spent} at delta = {self.delta:.3g} after {steps} steps (noise sigma = "
            f"{self.sigma:.4g}, bound C = {self.clip:g}, "
            f"{'flat' if self.flat else 'per-layer'}, sampling rate q = {self.q:.4g}); the "
            "guarantee is in privacy.json"
        )


def _linear(key: str) -> str:
    return key.rsplit(".lora_", 1)[0]


def _sq(g: torch.Tensor) -> float:
    return float(g.double().square().sum())


def _scale(sq: float, bound: float) -> torch.Tensor:
    norm = math.sqrt(sq)
    return torch.tensor(bound / norm if norm > bound else 1.0, dtype=torch.float32)


class _Sum:
    """The step's sum of clipped per-row gradients, block by block (`take`, the backward's
    callback); flat keeps a row's gradients until `row_done` knows its norm."""

    def __init__(self, lora: list[dict[str, torch.Tensor]], plan: DpPlan) -> None:
        self.acc = [{key: torch.zeros_like(p) for key, p in d.items()} for d in lora]
        self.flat, self.clip = plan.flat, plan.clip
        self.bound = plan.clip / math.sqrt(sum(len({_linear(key) for key in d}) for d in lora))
        self.held: dict[int, dict[str, torch.Tensor]] = {}

    def take(self, i: int, grads: dict[str, torch.Tensor]) -> None:
        if self.flat:  # the programs' output buffers are reused: keep copies
            self.held[i] = {key: t.clone() for key, t in grads.items()}
            return
        sq: dict[str, float] = {}
        for key, t in grads.items():
            sq[_linear(key)] = sq.get(_linear(key), 0.0) + _sq(t)
        for key, t in grads.items():
            self.acc[i][key] += _scale(sq[_linear(key)], self.bound) * t

    def row_done(self) -> None:
        if self.flat:
            s = _scale(sum(_sq(t) for d in self.held.values() for t in d.values()), self.clip)
            for i, d in self.held.items():
                for key, t in d.items():
                    self.acc[i][key] += s * t
            self.held.clear()


def step(
    trainer: Any, rows: Rows, k: int, plan: DpPlan, batch: Callable[..., Any]
) -> tuple[float | None, int]:
    """Step k (an EtTrainer's programs): (the mean of the sampled rows' own mean losses, or
    None when no sampled row has a trained token; the sample's size)."""
    pick = DpStream(plan.seed, k, 0).uniform(len(rows)) < plan.q
    total, losses = _Sum(trainer.lora, plan), []
    for r in np.flatnonzero(pick).tolist():
        ids, tgt, mask = batch([rows[r]], trainer.art.batch_size, trainer.art.seq_len)
        n = int(mask.sum())
        if n == 0:
            continue  # no trained token: a zero gradient
        loss, g = trainer.forward_loss(ids, tgt, mask, k)
        losses.append(loss / n)
        trainer.backward(g, total.take)
        total.row_done()
    scal, t, e = trainer._scalars(), 0, torch.tensor(plan.expected, dtype=torch.float32)
    std = plan.sigma * plan.clip
    for i, d in enumerate(total.acc):
        grads = {}
        for key, a in d.items():
            z = DpStream(plan.seed, k, 1 + t).normal(a.numel()) * std if std else 0 * a.numpy()
            noise = torch.from_numpy(np.asarray(z, dtype=np.float32)).view(a.shape)
            grads[key] = (a + noise) / e
            t += 1
        trainer._update(i, grads, scal)
    return (sum(losses) / len(losses) if losses else None), int(pick.sum())
