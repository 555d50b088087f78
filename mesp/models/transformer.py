"""The decoder, written once for every family; family differences are FamilySpec flags.

HF attribute names throughout (`model.layers.0.self_attn.q_proj`, `input_layernorm`, …) so that
HF, MLX and PEFT state dicts map one to one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from mesp.config import SLIDING, ModelConfig
from mesp.models import FAMILIES
from mesp.models.linear import FrozenWeight, Linear, frozen_matmul
from mesp.models.spec import FamilySpec
from mesp.ops.attention import attention, attention_fwd, sliding_mask
from mesp.ops.mlp import gated_act
from mesp.ops.norm import rms_norm, rms_norm_heads
from mesp.ops.rope import apply_rope, rope_tables

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3's fused linears and the targets each stands for: naming any part adapts the fused one
FUSED_TARGETS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def is_target(leaf: str, targets: tuple[str, ...]) -> bool:
    """Whether the linear named `leaf` gets an adapter under `targets` (PEFT's names: the
    fused ones, or the parts they fuse)."""
    return leaf in targets or any(t in targets for t in FUSED_TARGETS.get(leaf, ()))


Tape = dict[str, Tensor]  # name -> tensor kept for the structured backward


@dataclass
class SeqContext:
    """Per-forward tables shared by all blocks, keyed by layer type."""

    cos: dict[str, Tensor]
    sin: dict[str, Tensor]
    mask: dict[str, Tensor | None]
    start: int = 0  # position of the first token (KV-cache decoding)


@dataclass
class KVCache:
    """Keys/values per layer for generation: (B, KV, T, D) each."""

    k: list[Tensor | None] = field(default_factory=list)
    v: list[Tensor | None] = field(default_factory=list)


class RMSNorm(nn.Module):
    def __init__(
        self, dim: int, eps: float, offset: float, dtype: torch.dtype, divisor: float = 1.0
    ) -> None:
        super().__init__()
        # divisor: the output ÷ it (Granite's logits_scaling, on the final norm only)
        self.eps, self.offset, self.divisor = eps, offset, divisor
        init = torch.zeros(dim, dtype=dtype) if offset else torch.ones(dim, dtype=dtype)
        self.register_buffer("weight", init)

    def forward(self, x: Tensor) -> Tensor:
        y = rms_norm(x, self.weight, self.eps, self.offset)
        return y if self.divisor == 1.0 else y / self.divisor


class HeadsRMSNorm(RMSNorm):
    """OLMo 2's q/k norm: weight (H·D), one RMS over all heads of a token, on (B, H, S, D)."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm_heads(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, spec: FamilySpec, dtype: torch.dtype, rope: bool = True
    ) -> None:
        super().__init__()
        self.rope = rope  # False: a NoPE layer (SmolLM3), q/k are not rotated
        h, kv, d, hid = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.hidden_size,
        )
        self.n_heads, self.n_kv, self.head_dim, self.scale = h, kv, d, cfg.attn_scale
        self.softcap = cfg.attn_logit_softcapping  # Gemma 2: scores cap·tanh(s/cap)
        bias = cfg.attention_bias
        self.fused = spec.fused_proj
        if spec.fused_proj:  # Phi-3: one linear, its output split q | k | v
            self.qkv_proj = Linear(hid, (h + 2 * kv) * d, bias, dtype)
        else:
            self.q_proj = Linear(hid, h * d, bias, dtype)
            self.k_proj = Linear(hid, kv * d, bias, dtype)
            self.v_proj = Linear(hid, kv * d, bias, dtype)
        self.o_proj = Linear(h * d, hid, False, dtype)
        eps, off = cfg.rms_norm_eps, spec.norm_offset
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if spec.qk_norm_whole:  # OLMo 2: over the whole projection, weights (H·D) / (KV·D)
            self.q_norm = HeadsRMSNorm(h * d, eps, off, dtype)
            self.k_norm = HeadsRMSNorm(kv * d, eps, off, dtype)
        elif spec.qk_norm:  # Qwen3, Gemma3: per head, weights (D)
            self.q_norm = RMSNorm(d, eps, off, dtype)
            self.k_norm = RMSNorm(d, eps, off, dtype)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, S, hidden) -> the q, k, v projections (B, S, H·D / KV·D / KV·D)."""
        if not self.fused:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q_out, kv_out = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_out, kv_out, kv_out], dim=-1)
        return q, k, v

    def qkv(
        self, x: Tensor, cos: Tensor, sin: Tensor, tape: Tape | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, S, hidden) -> q (B, H, S, D), k/v (B, KV, S, D), normed and rotated."""
        b, s, _ = x.shape
        q, k, v = self.project(x)
        q = q.reshape(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.reshape(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            if tape is not None:  # the q/k norm backward needs its input
                tape["q_lin"], tape["k_lin"] = q, k
            q, k = self.q_norm(q), self.k_norm(k)
        if not self.rope:
            return q, k, v
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        cache: tuple[KVCache, int] | None = None,
        window: int | None = None,
        tape: Tape | None = None,
    ) -> Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x, cos, sin, tape)
        causal = True
        if tape is not None:  # structured recompute: the flash backward needs out and lse
            o, tape["lse"] = attention_fwd(q, k, v, self.scale, mask, softcap=self.softcap)
            tape.update(q=q, k=k, v=v, o=o)
        else:
            if cache is not None:
                kv, i = cache
                if kv.k[i] is not None:
                    k, v = torch.cat([kv.k[i], k], dim=2), torch.cat([kv.v[i], v], dim=2)
                    causal = False  # decoding one token at a time: it sees every cached key
                if window is not None:  # sliding layers never need more than the window
                    k, v = k[:, :, -window:], v[:, :, -window:]
                kv.k[i], kv.v[i] = k, v
            o = attention(q, k, v, self.scale, mask, causal=causal, softcap=self.softcap)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class MLP(nn.Module):
    tile = 512  # tokens per tile in no-grad passes (forward, recompute, inference)

    def __init__(self, cfg: ModelConfig, spec: FamilySpec, dtype: torch.dtype) -> None:
        super().__init__()
        hid, inter = cfg.hidden_size, cfg.intermediate_size
        self.act = spec.activation
        self.fused = spec.fused_proj
        if spec.fused_proj:  # Phi-3: one linear, its output split gate | up
            self.gate_up_proj = Linear(hid, 2 * inter, False, dtype)
        else:
            self.gate_proj = Linear(hid, inter, False, dtype)
            self.up_proj = Linear(hid, inter, False, dtype)
        self.down_proj = Linear(inter, hid, False, dtype)

    def tiled(self, x: Tensor) -> bool:
        """Whether a no-grad pass over x runs in token tiles (see forward)."""
        return not torch.is_grad_enabled() and x.numel() // x.shape[-1] > self.tile

    def tiles(self, rows: int) -> Iterator[slice]:
        """The token slices, `tile` rows each, that a tiled pass over `rows` tokens takes."""
        return (slice(r, r + self.tile) for r in range(0, rows, self.tile))

    def gate_up(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The gate and up projections of x."""
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return gate, up
        return self.gate_proj(x), self.up_proj(x)

    def inner(self, x: Tensor) -> Tensor:
        """act(gate(x)) · up(x): the input of down_proj."""
        return gated_act(*self.gate_up(x), self.act)

    def forward(self, x: Tensor, tape: Tape | None = None) -> Tensor:
        if self.tiled(x):
            # The MLP acts per token: without autograd, run it `tile` tokens at a time so the
            # (tokens × intermediate) tensors exist one tile at a time. Nothing goes on the
            # tape: the structured backward recomputes gate/up tile by tile from n2.
            x2 = x.reshape(-1, x.shape[-1])
            out = x.new_empty(x2.shape[0], self.down_proj.out_features)
            for sl in self.tiles(x2.shape[0]):
                out[sl] = self.down_proj(self.inner(x2[sl]))
            return out.view(*x.shape[:-1], -1)
        gate, up = self.gate_up(x)
        if tape is not None:  # act(gate)·up is recomputed in backward; gate and up are kept
            tape["gate"], tape["up"] = gate, up
        return self.down_proj(gated_act(gate, up, self.act))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: FamilySpec, idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.idx, self.layer_type = idx, cfg.layer_types[idx]
        self.window = cfg.sliding_window if self.layer_type == SLIDING else None
        eps, off = cfg.rms_norm_eps, spec.norm_offset
        self.self_attn = Attention(cfg, spec, dtype, cfg.rope_layers[idx])
        self.residual = cfg.residual_multiplier  # Granite: each branch × it before the add
        self.mlp = MLP(cfg, spec, dtype)
        # OLMo 2 has no input norm (post_norms): the attention reads the residual stream
        self.post_norms = spec.post_norms
        self.input_layernorm = (
            None if spec.post_norms else RMSNorm(cfg.hidden_size, eps, off, dtype)
        )
        # Llama/Qwen: the pre-MLP norm. Gemma3, OLMo 2: the norm on the attention output.
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, off, dtype)
        self.sandwich = spec.sandwich_norms
        if spec.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, off, dtype)
        if spec.sandwich_norms or spec.post_norms:
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, off, dtype)

    def forward(
        self, x: Tensor, ctx: SeqContext, cache: KVCache | None = None, tape: Tape | None = None
    ) -> Tensor:
        """x (B, S, hidden) -> (B, S, hidden). With a `tape`, also records what the structured
        (hand) backward needs: the inputs of every LoRA linear, norm and nonlinearity."""
        t = self.layer_type
        c = None if cache is None else (cache, self.idx)
        n1 = x if self.input_layernorm is None else self.input_layernorm(x)
        a = self.self_attn(n1, ctx.cos[t], ctx.sin[t], ctx.mask[t], c, self.window, tape)
        if self.sandwich or self.post_norms:
            x2 = x + self.post_attention_layernorm(a)
            n2 = self.pre_feedforward_layernorm(x2) if self.sandwich else x2
            d = self.mlp(n2, tape)
            y = x2 + self.post_feedforward_layernorm(d)
        else:
            x2 = x + self.branch(a)
            n2 = self.post_attention_layernorm(x2)
            d = self.mlp(n2, tape)
            y = x2 + self.branch(d)
        if tape is not None:
            tape.update(n1=n1, x2=x2, n2=n2)
            if self.sandwich or self.post_norms:  # the post-norms' backward needs their inputs
                tape.update(a=a, d=d)
        return y

    def branch(self, t: Tensor) -> Tensor:
        """A residual branch as it is added: × residual_multiplier (Granite), else itself."""
        return t if self.residual is None else t * self.residual


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: FamilySpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = FrozenWeight(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(
            Block(cfg, spec, i, dtype) for i in range(cfg.num_hidden_layers)
        )
        div = cfg.logits_scaling or 1.0  # Granite: logits ÷ it, as the final norm's output ÷ it
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, spec.norm_offset, dtype, div)


class CausalLM(nn.Module):
    """Embedding -> blocks -> final norm -> head. `forward` is used by bp; the block-wise
    engines call `embed`, each block, and `head_weight` themselves."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config, self.spec, self.dtype = cfg, FAMILIES[cfg.family], dtype
        self.model = Decoder(cfg, self.spec, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else FrozenWeight(cfg.vocab_size, cfg.hidden_size, dtype)
        )

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def device(self) -> torch.device:
        """Where the frozen weights live (batches and generated ids follow them)."""
        return next(self.buffers()).device

    def head_weight(self) -> FrozenWeight:
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    def context(self, seq_len: int, device: torch.device, start: int = 0) -> SeqContext:
        cfg = self.config
        cos, sin, mask = {}, {}, {}
        for t in set(cfg.layer_types):
            c, s = rope_tables(cfg.rope[t], cfg.head_dim, start + seq_len, device, self.dtype)
            cos[t], sin[t] = c[start:], s[start:]
            win = cfg.sliding_window if t == SLIDING else None
            mask[t] = sliding_mask(seq_len, win, device) if start == 0 else None
        return SeqContext(cos, sin, mask, start)

    def embed(self, ids: Tensor) -> Tensor:
        """ids (B, S) -> (B, S, hidden) in the compute dtype."""
        h = self.model.embed_tokens.gather(ids).to(self.dtype)
        if self.spec.embed_scale:  # Gemma: × √hidden, rounded to the compute dtype as HF does
            h = h * torch.tensor(self.config.hidden_size**0.5, dtype=self.dtype)
        if self.config.embedding_multiplier is not None:  # Granite, a Python float as HF's
            h = h * self.config.embedding_multiplier
        return h

    def final_norm(self, h: Tensor) -> Tensor:
        return self.model.norm(h)

    def logits(self, h_normed: Tensor) -> Tensor:
        """Full logits from final-normed hidden states (B, S, hidden) -> (B, S, V)."""
        z = frozen_matmul(h_normed, self.head_weight())
        cap = self.config.final_logit_softcapping
        return torch.tanh(z / cap) * cap if cap else z

    def hidden(self, ids: Tensor, cache: KVCache | None = None, start: int = 0) -> Tensor:
        """Final-normed hidden states (B, S, hidden)."""
        ctx = self.context(ids.shape[1], ids.device, start)
        h = self.embed(ids)
        for block in self.layers:
            h = block(h, ctx, cache)
        return self.final_norm(h)

    def forward(self, ids: Tensor, cache: KVCache | None = None, start: int = 0) -> Tensor:
        return self.logits(self.hidden(ids, cache, start))

    def lora_modules(self) -> dict[str, Linear]:
        """Name -> Linear for every linear that carries an adapter."""
        return {n: m for n, m in self.named_modules() if isinstance(m, Linear) and m.rank}

    def lora_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]
