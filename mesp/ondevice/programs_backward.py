"""The block backward for `torch.export`: mesp.engines.mesp_block.block_backward with every
weight an argument (see programs.py for the naming of the dictionaries and the forward whose
saved tensors it reads). Same ops, same order, same dtypes as the engine's hand backward, so an
exported run reproduces the engine's gradients bit for bit."""

from __future__ import annotations

import torch
from torch import Tensor

from mesp.ondevice.programs import (
    BlockSpec,
    Tensors,
    act_kernel,
    attn_kw,
    base,
    branch,
    gated,
)
from mesp.ops import gated_kernel
from mesp.ops.attention import attention_bwd
from mesp.ops.lora_linear import lora_linear_backward
from mesp.ops.matmul import TracedBlocks
from mesp.ops.mlp import gated_act_backward
from mesp.ops.norm import rms_norm_backward, rms_norm_heads_backward
from mesp.ops.qmatmul import PackedKernel
from mesp.ops.rope import apply_rope_backward


def _lin_bwd(
    bs: BlockSpec, name: str, dy: Tensor, x: Tensor, w: Tensors, lora: Tensors, grads: Tensors
) -> Tensor:
    """dx of one linear; its adapter gradients (if any) go into `grads` (fresh zeros + addmm_,
    exactly the engine's first accumulation into a None .grad)."""
    ws = bs.lin(name)
    src = base(w, ws)
    if ws.lora_scale is None:
        return (
            src.matmul(dy) if isinstance(src, PackedKernel | TracedBlocks) else dy @ src(dy.dtype)
        )
    a, b = lora[f"{ws.prefix}.lora_A"], lora[f"{ws.prefix}.lora_B"]
    ga, gb = torch.zeros_like(a), torch.zeros_like(b)
    grads[f"{ws.prefix}.lora_A"], grads[f"{ws.prefix}.lora_B"] = ga, gb
    dx = lora_linear_backward(dy, x, src, a, b, ws.lora_scale, ga, gb)
    assert dx is not None
    return dx


def _mlp_backward(
    bs: BlockSpec,
    dd: Tensor,
    n2: Tensor,
    gate: Tensor,
    up: Tensor,
    w: Tensors,
    lora: Tensors,
    grads: Tensors,
) -> Tensor:
    """mesp_block._mlp_piece: dd at the MLP's output -> dn2 at its input; the LoRA gradients
    go into `grads`."""
    dm = _lin_bwd(bs, "down_proj", dd, gated(bs, gate, up), w, lora, grads)
    if act_kernel(bs, gate):
        dgate, dup = gated_kernel.gated_backward(dm, gate, up, bs.act)
    else:
        dgate, dup = gated_act_backward(dm, gate, up, bs.act)
    del dm, gate, up
    if bs.fused:  # the split's backward: [dgate | dup] into the fused linear
        dgu = torch.cat([dgate, dup], dim=-1)
        del dgate, dup
        return _lin_bwd(bs, "gate_up_proj", dgu, n2, w, lora, grads)
    dn2 = _lin_bwd(bs, "gate_proj", dgate, n2, w, lora, grads)
    del dgate
    dn2 += _lin_bwd(bs, "up_proj", dup, n2, w, lora, grads)
    return dn2


def block_backward(
    bs: BlockSpec, saved: Tensors, dy: Tensor, x: Tensor, w: Tensors, lora: Tensors, ctx: Tensors
) -> tuple[Tensor, Tensors]:
    """dy (B, S, hidden) at the block output -> (dx at its input, LoRA gradients)."""
    saved, grads = dict(saved), {}
    nb = lambda g, xx, name: rms_norm_backward(g, xx, w[f"{name}.weight"], bs.eps, bs.norm_offset)  # noqa: E731
    post = bs.sandwich or bs.post_norms
    dd = branch(bs, nb(dy, saved.pop("d"), "post_feedforward_layernorm") if post else dy)
    n2 = saved["x2"] if bs.post_norms else saved.pop("n2")
    dn2 = _mlp_backward(bs, dd, n2, saved.pop("gate"), saved.pop("up"), w, lora, grads)
    del dd, n2
    x2 = saved.pop("x2")
    if bs.post_norms:  # n2 = x2: no pre-MLP norm
        dx2 = dy + dn2
    else:
        norm2 = "pre_feedforward_layernorm" if bs.sandwich else "post_attention_layernorm"
        dx2 = dy + nb(dn2, x2, norm2)
    del dn2, dy, x2

    da = branch(bs, nb(dx2, saved.pop("a"), "post_attention_layernorm") if post else dx2)
    o = saved.pop("o")
    b, h, s, d = o.shape
    do = _lin_bwd(bs, "o_proj", da, o.transpose(1, 2).reshape(b, s, h * d), w, lora, grads)
    del da
    dq, dk, dv = attention_bwd(
        do.view(b, s, h, d).transpose(1, 2),
        saved.pop("q"),
        saved.pop("k"),
        saved.pop("v"),
        o,
        saved.pop("lse"),
        bs.attn_scale,
        ctx.get("mask"),
        **attn_kw(bs),
    )
    del do, o
    if bs.rope:
        dq = apply_rope_backward(dq, ctx["cos"], ctx["sin"])
        dk = apply_rope_backward(dk, ctx["cos"], ctx["sin"])
    if bs.qk_norm:
        qkb = nb
        if bs.qk_whole:  # mesp_block.norm_bwd of a HeadsRMSNorm
            qkb = lambda g, xx, name: rms_norm_heads_backward(g, xx, w[f"{name}.weight"], bs.eps)  # noqa: E731
        dq = qkb(dq, saved.pop("q_lin"), "self_attn.q_norm")
        dk = qkb(dk, saved.pop("k_lin"), "self_attn.k_norm")
    n1 = x if bs.post_norms else saved.pop("n1")

    def flat(g: Tensor) -> Tensor:  # (B, H, S, D) -> (B, S, H·D)
        return g.transpose(1, 2).reshape(b, s, -1)

    if bs.fused:  # the split's backward: [dq | dk | dv] into the fused linear
        dqkv = torch.cat([flat(dq), flat(dk), flat(dv)], dim=-1)
        del dq, dk, dv
        dn1 = _lin_bwd(bs, "qkv_proj", dqkv, n1, w, lora, grads)
        del dqkv, n1
    else:
        dn1 = _lin_bwd(bs, "q_proj", flat(dq), n1, w, lora, grads)
        del dq
        dk_in = _lin_bwd(bs, "k_proj", flat(dk), n1, w, lora, grads)
        del dk
        dv_in = _lin_bwd(bs, "v_proj", flat(dv), n1, w, lora, grads)
        del dv, n1
        dn1 += dk_in
        dn1 += dv_in
        del dk_in, dv_in
    return dx2.add_(dn1 if bs.post_norms else nb(dn1, x, "input_layernorm")), grads
