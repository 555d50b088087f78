"""One block's hand backward for the mesp engine (see mesp/engines/mesp.py for what the tape
holds and why): the MLP half, then the attention half, each tensor popped at its last use."""

from __future__ import annotations

import torch
from torch import Tensor

from mesp.models.linear import Linear
from mesp.models.transformer import MLP, Block, HeadsRMSNorm, RMSNorm, SeqContext, Tape
from mesp.ops.attention import attention_bwd, fwd_matches_attention
from mesp.ops.lora_linear import lora_linear_backward
from mesp.ops.matmul import linear
from mesp.ops.mlp import gated_act, gated_act_backward
from mesp.ops.norm import rms_norm_backward, rms_norm_heads_backward
from mesp.ops.rope import apply_rope_backward

H_STRATEGIES = ("recompute", "store")


def _grad(p: torch.nn.Parameter) -> Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def norm_bwd(dy: Tensor, x: Tensor, norm: RMSNorm) -> Tensor:
    if isinstance(norm, HeadsRMSNorm):  # OLMo 2's q/k norm: one RMS over all heads of a token
        return rms_norm_heads_backward(dy, x, norm.weight, norm.eps)
    if norm.divisor != 1.0:  # y = rms_norm(x)/s (Granite's final norm): dy/s into the norm
        dy = dy / norm.divisor
    return rms_norm_backward(dy, x, norm.weight, norm.eps, norm.offset)


def _lin_bwd(
    mod: Linear,
    dy: Tensor,
    x: Tensor,
    need_dx: bool = True,
    h: Tensor | None = None,
    start: int = 0,
) -> Tensor | None:
    """dx of one linear (LoRA or plain frozen); adapter gradients accumulate in place (DP-SGD:
    per example, in the clipper; `start`: the first token's row when x is a tile of tokens)."""
    if mod.lora_A is None or mod.lora_B is None:
        return mod.matmul(dy) if need_dx else None
    if mod.per_example is not None:
        return mod.per_example.backward(mod, dy, x, need_dx, h, start)  # type: ignore[no-any-return]
    gA, gB = _grad(mod.lora_A), _grad(mod.lora_B)
    return lora_linear_backward(
        dy, x, mod, mod.lora_A, mod.lora_B, mod.lora_scale, gA, gB, need_dx, h
    )


def _store_h(block: Block, tape: Tape) -> dict[str, Tensor]:
    """The paper's 'store h' ablation: h = x Aᵀ for every adapter, taken at recompute time."""
    at, mlp = block.self_attn, block.mlp
    b, _, s, _ = tape["o"].shape
    o = tape["o"].transpose(1, 2).reshape(b, s, -1)
    names = ("qkv_proj",) if at.fused else ("q_proj", "k_proj", "v_proj")
    inputs = {n: tape["n1"] for n in names}
    inputs["o_proj"] = o
    for n in ("gate_up_proj",) if mlp.fused else ("gate_proj", "up_proj"):
        inputs[n] = tape["n2"]
    mods = {n: getattr(at if n in names or n == "o_proj" else mlp, n) for n in inputs}
    hs = {k: linear(x, mods[k].lora_A) for k, x in inputs.items() if mods[k].lora_A is not None}
    a_down = mlp.down_proj.lora_A
    if a_down is None:
        return hs
    if "gate" in tape:
        hs["down_proj"] = linear(gated_act(tape["gate"], tape["up"], mlp.act), a_down)
        return hs
    n2 = tape["n2"].reshape(-1, tape["n2"].shape[-1])  # tiled MLP: down's input per tile
    parts = [linear(mlp.inner(n2[sl]), a_down) for sl in mlp.tiles(n2.shape[0])]
    hs["down_proj"] = torch.cat(parts).view(b, s, -1)
    return hs


def _mlp_piece(
    mlp: MLP,
    dd: Tensor,
    n2: Tensor,
    gate: Tensor,
    up: Tensor,
    hs: dict[str, Tensor],
    start: int = 0,
) -> Tensor:
    """dn2 for tokens whose MLP input n2, gate/up and output gradient dd are given (all of a
    block's tokens, or one tile whose first token is row `start` of the flattened batch); hs:
    stored h per projection for these tokens, if any."""
    act = gated_act(gate, up, mlp.act)
    dm = _lin_bwd(mlp.down_proj, dd, act, h=hs.get("down_proj"), start=start)
    del act
    dgate, dup = gated_act_backward(dm, gate, up, mlp.act)
    del dm, gate, up
    if mlp.fused:  # the split's backward: [dgate | dup] is the fused output's gradient
        dgu = torch.cat([dgate, dup], dim=-1)
        del dgate, dup
        return _lin_bwd(mlp.gate_up_proj, dgu, n2, h=hs.get("gate_up_proj"), start=start)
    dn2 = _lin_bwd(mlp.gate_proj, dgate, n2, h=hs.get("gate_proj"), start=start)
    del dgate
    dn2 += _lin_bwd(mlp.up_proj, dup, n2, h=hs.get("up_proj"), start=start)
    return dn2


def _mlp_backward(mlp: MLP, dd: Tensor, tape: Tape, hs: dict[str, Tensor]) -> Tensor:
    """dd (B, S, hidden) at the MLP output -> dn2 at its input. With gate/up on the tape, in one
    piece; else (tiled forward) mlp.tile tokens at a time: gate/up recomputed from n2 for the
    tile, then the same backward: the MLP is per-token, so the tiles' dn2 rows are exact and
    the LoRA gradients (sums over tokens) accumulate tile by tile."""
    n2 = tape.pop("n2")
    if "gate" in tape:
        return _mlp_piece(mlp, dd, n2, tape.pop("gate"), tape.pop("up"), hs)
    shape = n2.shape
    n2, dd = n2.reshape(-1, shape[-1]), dd.reshape(-1, shape[-1])
    mlp_h = {
        k: v.reshape(n2.shape[0], -1)
        for k, v in hs.items()
        if k in ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
    }
    dn2 = torch.empty_like(n2)
    for sl in mlp.tiles(n2.shape[0]):
        t = n2[sl]
        tile_h = {k: v[sl] for k, v in mlp_h.items()}
        dn2[sl] = _mlp_piece(mlp, dd[sl], t, *mlp.gate_up(t), tile_h, sl.start)
    return dn2.view(shape)


def kept_forward(block: Block, x: Tensor, ctx: SeqContext) -> tuple[Tensor, Tape]:
    """The forward of a block whose tape is kept for its backward (budget-aware recompute):
    (output, tape). The tape is the one block_backward's recompute would record (the same call
    on the same input); the output must be the plain forward's, since the later blocks and the
    loss see it. With a tape, attention runs attention_fwd (it returns lse) where the plain
    forward runs SDPA; the rest of the block is the same ops either way (the MLP tiles, or not,
    by the same rule). Where the two attention calls are not provably one kernel call, the
    output comes from a plain forward, so the gradients stay plain mesp's bit for bit."""
    tape: Tape = {}
    y = block(x, ctx, tape=tape)
    if not fwd_matches_attention(tape["q"], tape["k"], tape["v"], ctx.mask[block.layer_type]):
        y = block(x, ctx)
    return y, tape


def block_backward(
    block: Block,
    x: Tensor,
    ctx: SeqContext,
    dy: Tensor,
    need_dx: bool,
    store_h: bool = False,
    tape: Tape | None = None,
) -> Tensor | None:
    """dy (B, S, hidden) at the block output -> dx at its input (None for block 0). `tape`: one
    kept from kept_forward; None: recompute it now."""
    if tape is None:
        tape = {}
        block(x, ctx, tape=tape)  # output dropped at once: only the tape survives
    hs = _store_h(block, tape) if store_h else {}
    at, mlp = block.self_attn, block.mlp
    t = block.layer_type

    # MLP half: y = x2 + [post_ff_norm](down(act(gate)·up)), gate/up = proj(n2); Granite
    # scales the branch by m before the add, so the branch sees m·dy
    post = block.sandwich or block.post_norms  # Gemma3, OLMo 2: a norm on each branch's output
    dd = norm_bwd(dy, tape.pop("d"), block.post_feedforward_layernorm) if post else dy
    dd = block.branch(dd)
    dn2 = _mlp_backward(mlp, dd, tape, hs)
    del dd
    x2 = tape.pop("x2")
    if block.post_norms:  # OLMo 2: n2 = x2, no pre-MLP norm
        dx2 = dy + dn2
    else:
        norm2 = (
            block.pre_feedforward_layernorm if block.sandwich else block.post_attention_layernorm
        )
        dx2 = dy + norm_bwd(dn2, x2, norm2)  # residual + through the norm
    del dn2, dy, x2

    # Attention half: x2 = x + [post_attn_norm](o_proj(attn(rope(q), rope(k), v)))
    da = norm_bwd(dx2, tape.pop("a"), block.post_attention_layernorm) if post else dx2
    da = block.branch(da)
    o = tape.pop("o")
    b, h, s, d = o.shape
    do = _lin_bwd(at.o_proj, da, o.transpose(1, 2).reshape(b, s, h * d), h=hs.get("o_proj"))
    del da
    dq, dk, dv = attention_bwd(
        do.view(b, s, h, d).transpose(1, 2),
        tape.pop("q"),
        tape.pop("k"),
        tape.pop("v"),
        o,
        tape.pop("lse"),
        at.scale,
        ctx.mask[t],
        softcap=at.softcap,  # Gemma 2: the chunked pair, through the tanh cap
    )
    del do, o
    if at.rope:  # the inverse rotation (NoPE layers, SmolLM3: none)
        dq = apply_rope_backward(dq, ctx.cos[t], ctx.sin[t])
        dk = apply_rope_backward(dk, ctx.cos[t], ctx.sin[t])
    if at.q_norm is not None and at.k_norm is not None:
        dq = norm_bwd(dq, tape.pop("q_lin"), at.q_norm)
        dk = norm_bwd(dk, tape.pop("k_lin"), at.k_norm)
    n1 = tape.pop("n1")

    def flat(g: Tensor) -> Tensor:  # (B, H, S, D) -> (B, S, H·D)
        return g.transpose(1, 2).reshape(b, s, -1)

    if at.fused:  # the split's backward: [dq | dk | dv] is the fused output's gradient
        dqkv = torch.cat([flat(dq), flat(dk), flat(dv)], dim=-1)
        del dq, dk, dv
        dn1 = _lin_bwd(at.qkv_proj, dqkv, n1, need_dx, hs.get("qkv_proj"))
        del dqkv, n1
    else:
        dn1 = _lin_bwd(at.q_proj, flat(dq), n1, need_dx, hs.get("q_proj"))
        del dq
        dk_in = _lin_bwd(at.k_proj, flat(dk), n1, need_dx, hs.get("k_proj"))
        del dk
        dv_in = _lin_bwd(at.v_proj, flat(dv), n1, need_dx, hs.get("v_proj"))
        del dv, n1
        if dn1 is not None and dk_in is not None and dv_in is not None:
            dn1 += dk_in
            dn1 += dv_in
        del dk_in, dv_in
    if not need_dx or dn1 is None:
        return None
    if block.input_layernorm is None:  # OLMo 2: n1 = x
        return dx2.add_(dn1)
    return dx2.add_(norm_bwd(dn1, x, block.input_layernorm))
