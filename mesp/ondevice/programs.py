"""Pure functions of one block for `torch.export` (see export.py; the embedding and the loss
are in edge_programs.py).

Every tensor is an argument: frozen weights, LoRA weights, activations, RoPE tables and the mask.
Only shapes, dtypes and family flags are baked in, so one captured graph serves every block of
the same layer type. Each function replays exactly the ops of the in-process path (Block.forward,
Linear.forward, mesp.engines.mesp_block.block_backward, mesp.ops.cross_entropy), in the same
order and dtypes, so an exported run reproduces the engine bit for bit. Dictionaries map names
to tensors:
  weights  the block's state-dict keys without the `model.layers.{i}.` prefix and without LoRA
  lora     "{linear}.lora_A" (r, in), "{linear}.lora_B" (out, r)
  ctx      "cos", "sin" (S, D) and, for sliding-window layers shorter than S, "mask" (S, S) additive
  saved    what the hand backward needs (mesp/engines/mesp.py's tape): n1 q k v o lse gate up x2
           n2, plus q_lin k_lin (q/k norms) and a d (sandwich and post norms); with post norms
           (OLMo 2) n1 is x and n2 is x2, so neither is saved (an output aliasing another)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mesp.models.transformer import LORA_TARGETS, Block, CausalLM
from mesp.ops import gated_kernel
from mesp.ops.attention import attention, attention_fwd
from mesp.ops.matmul import TracedBlocks, add_product
from mesp.ops.mlp import gated_act
from mesp.ops.norm import rms_norm, rms_norm_heads
from mesp.ops.qmatmul import PackedKernel
from mesp.ops.rope import apply_rope
from mesp.quant import QuantSpec, dequantize, dequantize_core_aten

Tensors = dict[str, Tensor]
PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
    "qkv_proj": "self_attn",  # Phi-3's fused linears
    "gate_up_proj": "mlp",
}
FUSED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True)
class WeightSpec:
    """How one frozen (out, in) matrix is stored: dense, or packed words + scales + biases."""

    prefix: str  # "self_attn.q_proj", "embed_tokens", …
    quant: QuantSpec | None
    bias: bool = False
    lora_scale: float | None = None  # None: no adapter on this linear
    core_aten: bool = False  # unpack with core ATen ops only (edge runtimes: no `>>`)
    # a quantized weight dequantized in blocks of at most this many fp32 bytes (row blocks for
    # x Wᵀ, column blocks for dy W: mesp.ops.matmul.TracedBlocks); None: whole, at once
    block_bytes: int | None = None
    # a quantized weight's products as mesp's kernel ops (mesp.ops.qmatmul: mesp::qlinear and
    # mesp::qmatmul, which dequantize in blocks inside the runtime); overrides block_bytes
    kernel: bool = False


def dequantizer(ws: WeightSpec) -> Callable[..., Tensor]:
    return dequantize_core_aten if ws.core_aten else dequantize


def dense(w: Tensors, ws: WeightSpec, dtype: torch.dtype | None) -> Tensor:
    """The (out, in) matrix in dtype, as FrozenWeight.dense: a fresh temporary when packed."""
    p = ws.prefix
    if ws.quant is None:
        return w[f"{p}.weight"] if dtype is None else w[f"{p}.weight"].to(dtype)
    return dequantizer(ws)(w[f"{p}.weight"], w[f"{p}.scales"], w[f"{p}.biases"], ws.quant, dtype)


def base(
    w: Tensors, ws: WeightSpec
) -> PackedKernel | TracedBlocks | Callable[[torch.dtype], Tensor]:
    """The frozen matrix for ops.lora_linear: kernel ops or blocks where ws says so, else whole."""
    p = ws.prefix
    if ws.quant is not None and ws.kernel:
        return PackedKernel(w[f"{p}.weight"], w[f"{p}.scales"], w[f"{p}.biases"], ws.quant)
    if ws.quant is None or ws.block_bytes is None:
        return lambda dt: dense(w, ws, dt)
    g = ws.quant.group_size
    wq, sc, bi = w[f"{p}.weight"], w[f"{p}.scales"], w[f"{p}.biases"]
    in_f = sc.shape[1] * g
    per = wq.shape[1] // (in_f // g)  # packed units per group (words or bytes)

    def block(r: slice, c: slice, dt: torch.dtype) -> Tensor:
        c0, c1 = (0, in_f) if c.stop is None else (c.start, c.stop)
        gs = slice(c0 // g, c1 // g)
        q = wq[r, gs.start * per : gs.stop * per]
        return dequantizer(ws)(q, sc[r, gs], bi[r, gs], ws.quant, dt)

    return TracedBlocks(block, (sc.shape[0], in_f), g, ws.block_bytes)


def rows(w: Tensors, ws: WeightSpec, start: int, stop: int, dtype: torch.dtype) -> Tensor:
    """Rows start:stop (a vocabulary slice of the head), as FrozenWeight.rows."""
    p = ws.prefix
    if ws.quant is None:
        return w[f"{p}.weight"][start:stop]
    sl = [w[f"{p}.{k}"][start:stop] for k in ("weight", "scales", "biases")]
    return dequantizer(ws)(sl[0], sl[1], sl[2], ws.quant, dtype)


@dataclass(frozen=True)
class BlockSpec:
    """Everything about a block that is not a tensor: the constants of its captured graphs."""

    n_heads: int
    n_kv: int
    head_dim: int
    attn_scale: float
    eps: float
    norm_offset: float
    act: str
    sandwich: bool
    qk_norm: bool
    masked: bool  # ctx carries an explicit (sliding-window) mask; else plain causal
    linears: tuple[tuple[str, WeightSpec], ...]  # ("q_proj", spec) for the 7 projections
    # None: the engine's attention kernels. A tile size: the exact query-tiled core-ATen path
    # (mesp.ops.attention's chunked impl), at most (tile × S) scores per head at a time.
    attn_tile: int | None = None
    rope: bool = True  # False: a NoPE layer (SmolLM3), q/k not rotated
    residual: float | None = None  # Granite: each residual branch × it before the add
    post_norms: bool = False  # OLMo 2: no input norm, a norm on each branch before its add
    qk_whole: bool = False  # OLMo 2: q/k norms over the whole projection (rms_norm_heads)
    softcap: float | None = None  # Gemma 2: attention scores cap·tanh(s/cap), chunked path only
    fused: bool = False  # Phi-3: one qkv_proj (q | k | v), one gate_up_proj (gate | up)
    # the gated activation and its backward as mesp's kernel ops (mesp.ops.gated_kernel: one
    # pass each, no (tokens × intermediate) temporaries; fp32); else written out in ATen ops
    act_kernel: bool = False

    def lin(self, name: str) -> WeightSpec:
        return dict(self.linears)[name]

    @classmethod
    def of(cls, model: CausalLM, block: Block, masked: bool) -> BlockSpec:
        cfg, spec, at = model.config, model.spec, block.self_attn
        lins = []
        for name in FUSED_LINEARS if spec.fused_proj else LORA_TARGETS:
            mod = getattr(at if PARENT[name] == "self_attn" else block.mlp, name)
            scale = mod.lora_scale if mod.lora_A is not None else None
            ws = WeightSpec(f"{PARENT[name]}.{name}", mod.quant, mod.bias is not None, scale)
            lins.append((name, ws))
        return cls(
            at.n_heads,
            at.n_kv,
            at.head_dim,
            at.scale,
            cfg.rms_norm_eps,
            spec.norm_offset,
            spec.activation,
            spec.sandwich_norms,
            spec.qk_norm,
            masked,
            tuple(lins),
            rope=at.rope,
            residual=block.residual,
            post_norms=spec.post_norms,
            qk_whole=spec.qk_norm_whole,
            softcap=at.softcap or None,
            fused=spec.fused_proj,
        )


def frozen_tensors(module: torch.nn.Module, prefix: str = "") -> dict[str, Tensor]:
    """A module's frozen tensors (buffers) under their state-dict names."""
    return {f"{prefix}{k}": v.contiguous() for k, v in module.named_buffers() if v is not None}


def block_parts(block: torch.nn.Module) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(frozen weights, LoRA weights) of a block, keyed as mesp.ondevice.programs expects."""
    lora = {n: p.detach().contiguous() for n, p in block.named_parameters()}
    return frozen_tensors(block), lora


def example_hidden(model: CausalLM, batch: int, seq: int) -> tuple[Tensor, torch.Generator]:
    """The block input (B, S, hidden) every export traces its programs with, and the seeded
    generator it came from (for further example inputs)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, seq, model.config.hidden_size, generator=g) * 0.5
    return x.to(model.dtype), g


# ---- the block forward: Block.forward / Attention.forward / MLP.forward, tensors as arguments ----


def _linear(bs: BlockSpec, name: str, x: Tensor, w: Tensors, lora: Tensors) -> Tensor:
    """Linear.forward: y = x Wᵀ (+ b) (+ s·(x Aᵀ) Bᵀ in one addmm), the same ops in the same
    order (the lowering writes addmm out as mm, mul and add: see mesp.ondevice.lower)."""
    ws = bs.lin(name)
    src = base(w, ws)
    if isinstance(src, PackedKernel) and ws.lora_scale is not None and not ws.bias:
        a, b = lora[f"{ws.prefix}.lora_A"], lora[f"{ws.prefix}.lora_B"]
        return src.linear_add(x, F.linear(x, a), b, ws.lora_scale)  # the addmm in the kernel
    y = src.linear(x) if isinstance(src, PackedKernel | TracedBlocks) else F.linear(x, src(x.dtype))
    if ws.bias:
        y = y + w[f"{ws.prefix}.bias"]
    if ws.lora_scale is not None:
        a, b = lora[f"{ws.prefix}.lora_A"], lora[f"{ws.prefix}.lora_B"]
        y = add_product(y, F.linear(x, a), b.t(), ws.lora_scale)
    return y


def _project(bs: BlockSpec, x: Tensor, w: Tensors, lora: Tensors) -> tuple[Tensor, ...]:
    """Attention.project: the q, k, v projections (Phi-3: one linear, split q | k | v)."""
    if not bs.fused:
        return tuple(_linear(bs, n, x, w, lora) for n in ("q_proj", "k_proj", "v_proj"))
    q_out, kv_out = bs.n_heads * bs.head_dim, bs.n_kv * bs.head_dim
    return _linear(bs, "qkv_proj", x, w, lora).split([q_out, kv_out, kv_out], dim=-1)


def _norm(bs: BlockSpec, x: Tensor, w: Tensors, name: str) -> Tensor:
    return rms_norm(x, w[f"{name}.weight"], bs.eps, bs.norm_offset)


def _qk_norm(bs: BlockSpec, x: Tensor, w: Tensors, name: str) -> Tensor:
    """Attention.qkv's q/k norm: per head, or over the whole projection (HeadsRMSNorm)."""
    if bs.qk_whole:
        return rms_norm_heads(x, w[f"{name}.weight"], bs.eps)
    return _norm(bs, x, w, name)


def attn_kw(bs: BlockSpec) -> dict:
    """attention_fwd/bwd's options: the query tiles (edge programs) and Gemma 2's cap."""
    kw: dict = {} if bs.attn_tile is None else {"impl": "chunked", "chunk": bs.attn_tile}
    return kw if bs.softcap is None else {**kw, "softcap": bs.softcap}


def gate_up(bs: BlockSpec, n2: Tensor, w: Tensors, lora: Tensors) -> tuple[Tensor, Tensor]:
    """MLP.gate_up: the gate and up projections (Phi-3: one linear, split gate | up)."""
    if bs.fused:
        gate, up = _linear(bs, "gate_up_proj", n2, w, lora).chunk(2, dim=-1)
        return gate, up
    return _linear(bs, "gate_proj", n2, w, lora), _linear(bs, "up_proj", n2, w, lora)


def _mlp(bs: BlockSpec, n2: Tensor, w: Tensors, lora: Tensors, tape: Tensors | None) -> Tensor:
    """MLP.forward: down(act(gate(n2))·up(n2)); gate and up go on the tape."""
    gate, up = gate_up(bs, n2, w, lora)
    if tape is not None:
        tape["gate"], tape["up"] = gate, up
    return _linear(bs, "down_proj", gated(bs, gate, up), w, lora)


def act_kernel(bs: BlockSpec, gate: Tensor) -> bool:  # the kernels take fp32
    return bs.act_kernel and gate.dtype == torch.float32


def gated(bs: BlockSpec, gate: Tensor, up: Tensor) -> Tensor:
    """MLP.inner: act(gate) · up."""
    if act_kernel(bs, gate):
        return gated_kernel.gated(gate, up, bs.act)
    return gated_act(gate, up, bs.act)


def branch(bs: BlockSpec, t: Tensor) -> Tensor:
    """Block.branch: a residual branch as it is added (× Granite's residual_multiplier)."""
    return t if bs.residual is None else t * bs.residual


def block_forward(
    bs: BlockSpec, w: Tensors, lora: Tensors, x: Tensor, ctx: Tensors, tape: Tensors | None
) -> Tensor:
    """x (B, S, hidden) -> (B, S, hidden); with a `tape`, records the saved tensors."""
    b, s, _ = x.shape
    mask = ctx.get("mask")
    n1 = x if bs.post_norms else _norm(bs, x, w, "input_layernorm")
    q, k, v = _project(bs, n1, w, lora)
    q = q.reshape(b, s, bs.n_heads, bs.head_dim).transpose(1, 2)
    k = k.reshape(b, s, bs.n_kv, bs.head_dim).transpose(1, 2)
    v = v.reshape(b, s, bs.n_kv, bs.head_dim).transpose(1, 2)
    if bs.qk_norm:
        if tape is not None:
            tape["q_lin"], tape["k_lin"] = q, k
        q, k = _qk_norm(bs, q, w, "self_attn.q_norm"), _qk_norm(bs, k, w, "self_attn.k_norm")
    if bs.rope:
        q, k = apply_rope(q, ctx["cos"], ctx["sin"]), apply_rope(k, ctx["cos"], ctx["sin"])
    kw = attn_kw(bs)
    if tape is not None:
        o, tape["lse"] = attention_fwd(q, k, v, bs.attn_scale, mask, **kw)
        tape.update(q=q, k=k, v=v, o=o)
    elif bs.attn_tile is not None:
        o = attention_fwd(q, k, v, bs.attn_scale, mask, **kw)[0]
    else:
        o = attention(q, k, v, bs.attn_scale, mask, softcap=bs.softcap)
    a = _linear(bs, "o_proj", o.transpose(1, 2).reshape(b, s, bs.n_heads * bs.head_dim), w, lora)
    post = bs.sandwich or bs.post_norms  # Gemma, OLMo 2: a norm on each branch's output
    if post:
        x2 = x + _norm(bs, a, w, "post_attention_layernorm")
        n2 = _norm(bs, x2, w, "pre_feedforward_layernorm") if bs.sandwich else x2
    else:
        x2 = x + branch(bs, a)
        n2 = _norm(bs, x2, w, "post_attention_layernorm")
    d = _mlp(bs, n2, w, lora, tape)
    y = x2 + _norm(bs, d, w, "post_feedforward_layernorm") if post else x2 + branch(bs, d)
    if tape is not None:
        tape["x2"] = x2
        if not bs.post_norms:  # else n1 is x (an argument) and n2 is x2
            tape.update(n1=n1, n2=n2)
        if post:
            tape.update(a=a, d=d)
    return y
