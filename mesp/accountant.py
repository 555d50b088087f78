"""DP-SGD's accountant: Google's dp-accounting (RDP, Poisson-subsampled Gaussian), for
`mesp train` / `mesp grad` (mesp/training/privacy.py) and the Python driver of the on-device
programs (mesp/ondevice/private.py). A leaf: math and dp-accounting only, no model code."""

from __future__ import annotations

import math
from typing import Any

from mesp.errors import MespError

MAX_NOISE = 1000.0  # --dp-epsilon: a noise multiplier above this trains nothing; refused
MIN_NOISE = 1e-3


def _accountant() -> Any:
    try:
        import dp_accounting
    except ImportError:
        raise MespError(
            "DP-SGD's accountant needs Google's dp-accounting: pip install 'mesp[privacy]'"
        ) from None
    return dp_accounting


def epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    """ε at δ after `steps` Poisson-subsampled Gaussian steps (RDP accountant)."""
    if steps == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    dpa = _accountant()
    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
    return float(acc.get_epsilon(delta))


def _refuse(eps: float, q: float, steps: int, delta: float, batch_flag: str) -> MespError:
    return MespError(
        f"--dp-epsilon {eps} cannot be met at δ={delta:g} over {steps} steps at sampling "
        f"rate {q:.4g}: it needs a noise multiplier above {MAX_NOISE:g} (fewer --steps, a "
        f"smaller {batch_flag} or a larger ε)"
    )


def solve_noise(eps: float, q: float, steps: int, delta: float) -> float:
    """The smallest σ whose run of `steps` steps at rate q spends at most ε at δ
    (dp-accounting's calibration)."""
    dpa = _accountant()

    def event(sigma: float) -> Any:
        return dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps
        )

    if epsilon(q, MAX_NOISE, steps, delta) > eps:
        raise _refuse(eps, q, steps, delta, "--batch-size")
    bracket = dpa.ExplicitBracketInterval(MIN_NOISE, MAX_NOISE)
    sigma = dpa.calibrate_dp_mechanism(dpa.rdp.RdpAccountant, event, eps, delta, bracket)
    return float(sigma)


def bisect_noise(eps: float, q: float, steps: int, delta: float) -> float:
    """The smallest σ in [1e-3, 1000], to 1e-6 relative, whose run spends at most ε: the
    native runner's search (runtime/src/private.cpp's solve_sigma), step for step, so both
    on-device drivers train under the same σ."""
    if epsilon(q, MAX_NOISE, steps, delta) > eps:
        raise _refuse(eps, q, steps, delta, "--dp-batch")
    lo, hi = MIN_NOISE, MAX_NOISE
    if epsilon(q, lo, steps, delta) <= eps:
        return lo
    while hi / lo > 1 + 1e-6:
        mid = math.sqrt(lo * hi)
        if epsilon(q, mid, steps, delta) <= eps:
            hi = mid
        else:
            lo = mid
    return hi
