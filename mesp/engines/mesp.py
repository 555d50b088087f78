"""mesp: structured backpropagation (MeSP) with hand-derived block backward.

Forward keeps only block inputs (checkpoints). The loss is a chunked cross-entropy that returns
d(final hidden) without full logits. Backward walks blocks in reverse: one no-grad recompute of
the block records on a tape exactly what the hand backward needs, then the hand backward pops
each tensor at its last use. LoRA's h = x Aᵀ is recomputed from x (or stored, `h_strategy`).

What each block keeps on the tape, and why (S tokens, F intermediate, H·D attention width):
  n1, n2      inputs of the q/k/v and gate/up LoRA linears (their dA needs x)       S×hidden
  q, k, v, o, lse   the flash-attention backward (no S×S matrix ever)               S×H·D
  q_lin, k_lin      inputs of the q/k norms (Qwen3, Gemma3)                         S×H·D
  gate, up    the gated activation's backward; act(gate)·up (down's input) is recomputed
  x2          input of the second norm                                              S×hidden
  a, d        inputs of Gemma3's post-attention / post-MLP norms                    S×hidden
"""

from __future__ import annotations

import torch
from torch import Tensor

from mesp.data_batches import Batch
from mesp.engines.loss import LossSpec
from mesp.engines.offload import CheckpointStore
from mesp.errors import MespError
from mesp.models.linear import Linear
from mesp.models.transformer import Block, CausalLM, RMSNorm, SeqContext, Tape
from mesp.ops.attention import attention_bwd
from mesp.ops.cross_entropy import chunked_ce_loss_and_grad
from mesp.ops.lora_linear import lora_linear_backward
from mesp.ops.mlp import gated_act, gated_act_backward
from mesp.ops.norm import rms_norm_backward
from mesp.ops.rope import apply_rope_backward

H_STRATEGIES = ("recompute", "store")


def _grad(p: torch.nn.Parameter) -> Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def _norm_bwd(dy: Tensor, x: Tensor, norm: RMSNorm) -> Tensor:
    return rms_norm_backward(dy, x, norm.weight, norm.eps, norm.offset)


def _lin_bwd(
    mod: Linear, dy: Tensor, x: Tensor, need_dx: bool = True, h: Tensor | None = None
) -> Tensor | None:
    """dx of one linear (LoRA or plain frozen); adapter gradients accumulate in place."""
    if mod.lora_A is None or mod.lora_B is None:
        return dy @ mod.dense(dy.dtype) if need_dx else None
    gA, gB = _grad(mod.lora_A), _grad(mod.lora_B)
    return lora_linear_backward(
        dy, x, mod, mod.lora_A, mod.lora_B, mod.lora_scale, gA, gB, need_dx, h
    )


def _store_h(block: Block, tape: Tape) -> dict[str, Tensor]:
    """The paper's 'store h' ablation: h = x Aᵀ for every adapter, taken at recompute time."""
    at, mlp = block.self_attn, block.mlp
    b, _, s, _ = tape["o"].shape
    o_flat = tape["o"].transpose(1, 2).reshape(b, s, -1)
    m = gated_act(tape["gate"], tape["up"], mlp.act)
    inputs = {
        "q_proj": tape["n1"],
        "k_proj": tape["n1"],
        "v_proj": tape["n1"],
        "o_proj": o_flat,
        "gate_proj": tape["n2"],
        "up_proj": tape["n2"],
        "down_proj": m,
    }
    mods = {
        "q_proj": at.q_proj,
        "k_proj": at.k_proj,
        "v_proj": at.v_proj,
        "o_proj": at.o_proj,
        "gate_proj": mlp.gate_proj,
        "up_proj": mlp.up_proj,
        "down_proj": mlp.down_proj,
    }
    return {k: x @ mods[k].lora_A.t() for k, x in inputs.items() if mods[k].lora_A is not None}


def block_backward(
    block: Block, x: Tensor, ctx: SeqContext, dy: Tensor, need_dx: bool, store_h: bool = False
) -> Tensor | None:
    """dy (B, S, hidden) at the block output -> dx at its input (None for block 0)."""
    tape: Tape = {}
    block(x, ctx, tape=tape)  # output dropped at once: only the tape survives
    hs = _store_h(block, tape) if store_h else {}
    at, mlp = block.self_attn, block.mlp
    t = block.layer_type

    # MLP half: y = x2 + [post_ff_norm](down(act(gate)·up)), gate/up = proj(n2)
    dd = _norm_bwd(dy, tape.pop("d"), block.post_feedforward_layernorm) if block.sandwich else dy
    gate, up = tape.pop("gate"), tape.pop("up")
    dm = _lin_bwd(mlp.down_proj, dd, gated_act(gate, up, mlp.act), h=hs.get("down_proj"))
    del dd
    dgate, dup = gated_act_backward(dm, gate, up, mlp.act)
    del dm, gate, up
    n2 = tape.pop("n2")
    dn2 = _lin_bwd(mlp.gate_proj, dgate, n2, h=hs.get("gate_proj"))
    del dgate
    dn2 += _lin_bwd(mlp.up_proj, dup, n2, h=hs.get("up_proj"))
    del dup, n2
    norm2 = block.pre_feedforward_layernorm if block.sandwich else block.post_attention_layernorm
    dx2 = dy + _norm_bwd(dn2, tape.pop("x2"), norm2)  # residual + through the norm
    del dn2, dy

    # Attention half: x2 = x + [post_attn_norm](o_proj(attn(rope(q), rope(k), v)))
    da = _norm_bwd(dx2, tape.pop("a"), block.post_attention_layernorm) if block.sandwich else dx2
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
    )
    del do, o
    dq = apply_rope_backward(dq, ctx.cos[t], ctx.sin[t])  # the inverse rotation
    dk = apply_rope_backward(dk, ctx.cos[t], ctx.sin[t])
    if at.q_norm is not None and at.k_norm is not None:
        dq = _norm_bwd(dq, tape.pop("q_lin"), at.q_norm)
        dk = _norm_bwd(dk, tape.pop("k_lin"), at.k_norm)
    n1 = tape.pop("n1")

    def flat(g: Tensor) -> Tensor:  # (B, H, S, D) -> (B, S, H·D)
        return g.transpose(1, 2).reshape(b, s, -1)

    dn1 = _lin_bwd(at.q_proj, flat(dq), n1, need_dx, hs.get("q_proj"))
    del dq
    dk_in = _lin_bwd(at.k_proj, flat(dk), n1, need_dx, hs.get("k_proj"))
    del dk
    dv_in = _lin_bwd(at.v_proj, flat(dv), n1, need_dx, hs.get("v_proj"))
    del dv, n1
    if not need_dx or dn1 is None or dk_in is None or dv_in is None:
        return None
    dn1 += dk_in
    dn1 += dv_in
    del dk_in, dv_in
    return dx2.add_(_norm_bwd(dn1, x, block.input_layernorm))


class MeSPEngine:
    name = "mesp"

    def __init__(
        self,
        h_strategy: str = "recompute",
        chunk_rows: int | None = 512,
        vocab_chunk: int | None = 8192,
        offload: str = "none",
        offload_dir: str | None = None,
        offload_fallback: bool = False,
        loss: LossSpec | None = None,
    ) -> None:
        """chunk_rows None: all trained rows in one logits block; vocab_chunk 0 or None: the
        head in one piece (with chunk_rows None, the full-logits baseline of the ladder)."""
        if h_strategy not in H_STRATEGIES:
            raise MespError(f"--h-strategy must be one of {', '.join(H_STRATEGIES)}")
        self.store_h = h_strategy == "store"
        self.chunk_rows, self.vocab_chunk = chunk_rows, vocab_chunk
        self.offload = (offload, offload_dir, offload_fallback)
        self.loss = loss or LossSpec()

    @torch.no_grad()
    def step(self, model: CausalLM, batch: Batch, normalizer: int) -> float:
        with CheckpointStore(*self.offload) as store:
            return self._run(model, batch, normalizer, store)

    def _run(self, model: CausalLM, batch: Batch, normalizer: int, store: CheckpointStore) -> float:
        ids = batch.input_ids
        ctx = model.context(ids.shape[1], ids.device)
        h = model.embed(ids)
        for i, block in enumerate(model.layers):
            store.put(i, h)  # block input: the only activation kept across blocks
            h = block(h, ctx)
        n_layers = len(model.layers)
        store.prefetch(n_layers - 1)  # read the last checkpoint back while the loss runs
        norm = model.model.norm
        hn = norm(h)
        self.loss.check(model.config.vocab_size)
        loss, _, dhn = chunked_ce_loss_and_grad(
            hn,
            batch.targets,
            batch.mask,
            model.head_weight(),
            model.config.final_logit_softcapping,
            normalizer=normalizer,
            opts=self.loss.ce_options(self.chunk_rows, self.vocab_chunk),
        )
        del hn
        g = _norm_bwd(dhn, h, norm)
        del dhn, h
        for i in range(n_layers - 1, -1, -1):
            x = store.pop(i)
            store.prefetch(i - 1)
            g = block_backward(model.layers[i], x, ctx, g, need_dx=i > 0, store_h=self.store_h)
            del x
        return loss.item()
