"""The LoRA linear y = x Wᵀ + b + s·(x Aᵀ) Bᵀ as pure functions, forward and hand backward.

W and b are frozen, so backward yields only dx and the adapter gradients. The rank-r activation
h = x Aᵀ is (tokens × r), small enough to recompute rather than keep; a store-h engine may pass
it in instead. The base weight is dequantized for the one product that needs it, then dropped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mesp.models.linear import FrozenWeight
from mesp.ops.matmul import TracedBlocks, add_product, addmm_, linear, matmul
from mesp.ops.qmatmul import PackedKernel

# A frozen (out, in) base: a FrozenWeight (dense or packed), a plain tensor, dtype -> tensor, or
# a traced program's weight in blocks or behind mesp's kernel ops.
WeightSource = FrozenWeight | Tensor | Callable[[torch.dtype], Tensor] | TracedBlocks | PackedKernel
_OWN_PRODUCTS = (FrozenWeight, TracedBlocks, PackedKernel)  # bases with their own linear/matmul


def dense_weight(base: WeightSource, dtype: torch.dtype) -> Tensor:
    """The (out, in) base weight in dtype; a fresh temporary when the base is quantized."""
    if isinstance(base, FrozenWeight | PackedKernel):
        return base.dense(dtype)
    if isinstance(base, TracedBlocks):
        every = slice(0, None)
        return base.block(every, every, dtype)
    if isinstance(base, Tensor):
        return base.to(dtype)
    return base(dtype).to(dtype)


def base_linear(x: Tensor, base: WeightSource, bias: Tensor | None = None) -> Tensor:
    """x (..., in) Wᵀ (+ bias), in x.dtype: a FrozenWeight's own (blocked) matmul."""
    if isinstance(base, _OWN_PRODUCTS):
        return base.linear(x, bias)
    return linear(x, dense_weight(base, x.dtype), bias)


def base_matmul(dy: Tensor, base: WeightSource) -> Tensor:
    """dy (..., out) W, in dy.dtype: a FrozenWeight's own (blocked) matmul."""
    if isinstance(base, _OWN_PRODUCTS):
        return base.matmul(dy)
    return matmul(dy, dense_weight(base, dy.dtype))


def lora_linear_with_h(
    x: Tensor, base: WeightSource, bias: Tensor | None, A: Tensor, B: Tensor, s: float
) -> tuple[Tensor, Tensor]:
    """x (..., in), A (r, in), B (out, r), bias (out,) | None -> y (..., out), h (..., r).
    Everything in x.dtype, as `Linear.forward` computes it."""
    h = linear(x, A.to(x.dtype))
    y = base_linear(x, base, None if bias is None else bias.to(x.dtype))
    return add_product(y, h, B.to(x.dtype).t(), s), h


def lora_linear(
    x: Tensor, base: WeightSource, bias: Tensor | None, A: Tensor, B: Tensor, s: float
) -> Tensor:
    """x (..., in) -> y (..., out) = x Wᵀ + b + s·(x Aᵀ) Bᵀ."""
    return lora_linear_with_h(x, base, bias, A, B, s)[0]


def lora_linear_backward(
    dy: Tensor,
    x: Tensor,
    base: WeightSource,
    A: Tensor,
    B: Tensor,
    s: float,
    gA_acc: Tensor,
    gB_acc: Tensor,
    need_dx: bool = True,
    h: Tensor | None = None,
) -> Tensor | None:
    """Accumulate the adapter gradients in place and return dx (or None when not needed).
    With h = x Aᵀ and y = … + s·h Bᵀ:  ∂L/∂B = s·dyᵀ h,  gh = s·dy B,  ∂L/∂A = ghᵀ x,
    dx = dy W + gh A  (W's own gradient is never formed: the base is frozen).
    Shapes: dy (..., out), x (..., in), h (..., r) | None, gA_acc (r, in), gB_acc (out, r);
    batch/sequence dims are flattened into the matmul so one addmm_ sums over all tokens.
    Gradients are accumulated in gA_acc/gB_acc's (common) dtype; dx comes back in x.dtype."""
    gd = gA_acc.dtype
    if gB_acc.dtype != gd:
        raise ValueError(f"gA_acc is {gd} but gB_acc is {gB_acc.dtype}; use one dtype")
    dy_g, x_g, h2, gh = _lora_terms(dy, x, A, B, s, gd, h)
    addmm_(gB_acc, dy_g.t(), h2, alpha=s)  # (out, N)(N, r)
    addmm_(gA_acc, gh.t(), x_g)  # (r, N)(N, in)
    return _lora_dx(dy, x, base, A, gh) if need_dx else None


def _lora_terms(
    dy: Tensor, x: Tensor, A: Tensor, B: Tensor, s: float, gd: torch.dtype, h: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Tokens flattened, in the gradients' dtype gd: dy (N, out), x (N, in), h = x Aᵀ (N, r)
    (recomputed unless given) and gh = s·dy B (N, r)."""
    n_out, n_in, r = B.shape[0], A.shape[1], A.shape[0]
    dy_g, x_g = dy.reshape(-1, n_out).to(gd), x.reshape(-1, n_in).to(gd)
    h2 = matmul(x_g, A.to(gd).t()) if h is None else h.reshape(-1, r).to(gd)  # (N, r)
    return dy_g, x_g, h2, matmul(dy_g, B.to(gd)).mul_(s)


def _lora_dx(dy: Tensor, x: Tensor, base: WeightSource, A: Tensor, gh: Tensor) -> Tensor:
    """dx = dy W + gh A, in x.dtype (W dropped after its one product)."""
    cd = x.dtype
    dy2 = dy.reshape(-1, dy.shape[-1]).to(cd)
    if isinstance(base, PackedKernel):  # a program's kernel op: the addmm_ inside the product
        return base.matmul_add(dy2, gh.to(cd), A.to(cd)).view(x.shape)
    dx = base_matmul(dy2, base)  # (N, out)(out, in)
    addmm_(dx, gh.to(cd), A.to(cd))  # (N, r)(r, in)
    return dx.view(x.shape)


def lora_example_backward(
    dy: Tensor,
    x: Tensor,
    base: WeightSource,
    A: Tensor,
    B: Tensor,
    s: float,
    seq: int,
    start: int = 0,
    need_dx: bool = True,
    h: Tensor | None = None,
) -> tuple[Tensor | None, Tensor, Tensor, Tensor]:
    """lora_linear_backward with each example's adapter gradients kept apart (DP-SGD clips them
    one by one): (dx | None, ids (k,), gA (k, r, in), gB (k, out, r)) in fp32, where the tokens
    of dy/x, flattened, are the rows start … start+N-1 of a batch whose examples are `seq`
    tokens each (a tiled pass hands a slice of them), and ids are the examples they touch.
    Example e's gradients are the same sums over its own tokens t only:
        gB_e = s·Σ_t dy_tᵀ h_t,   gA_e = Σ_t gh_tᵀ x_t,   gh = s·dy B."""
    dy_g, x_g, h2, gh = _lora_terms(dy, x, A, B, s, torch.float32, h)
    n = dy_g.shape[0]
    first, last = start // seq, (start + n - 1) // seq
    ids = torch.arange(first, last + 1)
    gA = torch.empty(len(ids), *A.shape, dtype=torch.float32, device=x.device)
    gB = torch.empty(len(ids), *B.shape, dtype=torch.float32, device=x.device)
    for k, e in enumerate(range(first, last + 1)):
        rows = slice(max(e * seq - start, 0), min((e + 1) * seq - start, n))
        torch.mm(dy_g[rows].t(), h2[rows], out=gB[k]).mul_(s)  # (out, n_e)(n_e, r)
        torch.mm(gh[rows].t(), x_g[rows], out=gA[k])  # (r, n_e)(n_e, in)
    dx = _lora_dx(dy, x, base, A, gh) if need_dx else None
    return dx, ids, gA, gB
