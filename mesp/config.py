"""ModelConfig: one dataclass for every family, built from an HF config.json (old or new RoPE keys).

A family is a handful of flags (see `mesp.models.families`); everything else is a dimension.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mesp.errors import MespError

# HF model_type -> our family name
MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",  # multimodal wrapper config; we take its text_config
    "mistral": "mistral",
    "smollm3": "smollm3",
    "granite": "granite",
    "olmo2": "olmo2",
    "gemma2": "gemma2",
    "phi3": "phi3",
}
# rope_theta when config.json names none (transformers' default_theta per family)
DEFAULT_THETA = {"gemma3": 1_000_000.0, "smollm3": 2_000_000.0}
GRANITE_KEYS = (
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
)
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass
class RopeSpec:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3 | longrope
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # Phi-4-mini: only the first int(head_dim·factor) dims of a head rotate
    partial_rotary_factor: float = 1.0
    # LongRoPE (Phi-3): per-frequency divisors, long ones past original_max_position_embeddings,
    # and the factor cos/sin are multiplied by (resolved from factor when config.json has none)
    short_factor: list[float] = field(default_factory=list)
    long_factor: list[float] = field(default_factory=list)
    attention_factor: float = 1.0


@dataclass
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # RoPE per layer type ("full_attention" / "sliding_attention")
    rope: dict[str, RopeSpec] = field(default_factory=lambda: {FULL: RopeSpec()})
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 2: attention scores cap·tanh(s/cap) before the mask (the query-chunked attention)
    attn_logit_softcapping: float | None = None
    # SmolLM3: per layer, whether it rotates q/k (HF's no_rope_layers: 1 = RoPE, 0 = NoPE)
    rope_layers: list[bool] = field(default_factory=list)
    # Granite: embeddings × embedding_multiplier, each residual branch × residual_multiplier,
    # softmax scale attention_multiplier (instead of 1/√head_dim), logits ÷ logits_scaling
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    attention_multiplier: float | None = None
    logits_scaling: float | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_hidden_layers
        if not self.rope_layers:
            self.rope_layers = [True] * self.num_hidden_layers
        if self.num_attention_heads % self.num_key_value_heads:
            raise MespError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise MespError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        if len(self.rope_layers) != self.num_hidden_layers:
            raise MespError(
                f"no_rope_layers has {len(self.rope_layers)} entries for "
                f"{self.num_hidden_layers} layers"
            )

    @property
    def attn_scale(self) -> float:
        """Softmax scale: Gemma3 uses query_pre_attn_scalar, Granite attention_multiplier, the
        rest 1/sqrt(head_dim)."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return 1.0 / math.sqrt(base)

    @classmethod
    def from_hf(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from an HF config dict; keeps the keys we know, ignores the rest."""
        if d.get("model_type") == "gemma3" and "text_config" in d:
            d = {**d["text_config"], "model_type": "gemma3_text"}
        mt = d.get("model_type")
        if mt not in MODEL_TYPES:
            known = ", ".join(sorted(k for k in MODEL_TYPES if k != "gemma3"))
            raise MespError(f"{source}: model_type {mt!r} is not supported (supported: {known})")
        family = MODEL_TYPES[mt]
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            n_layers = int(d["num_hidden_layers"])
            cfg = dict(
                family=family,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=n_layers,
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(
                    d.get("tie_word_embeddings", family in ("gemma3", "smollm3", "gemma2"))
                ),
                # Qwen2 always has q/k/v biases; HF's Qwen2 config has no key for it
                attention_bias=family == "qwen2" or bool(d.get("attention_bias", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
                pad_token_id=d.get("pad_token_id"),
            )
        except KeyError as e:
            raise MespError(f"{source}: missing key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise MespError(f"{source}: bad value: {e}") from None
        if family == "gemma3":
            pattern = int(d.get("sliding_window_pattern", 6))
            types = d.get("layer_types") or [
                SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)
            ]
            cfg.update(
                layer_types=list(types),
                sliding_window=d.get("sliding_window", 4096),
                query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
                final_logit_softcapping=d.get("final_logit_softcapping"),
            )
            if d.get("attn_logit_softcapping"):
                raise MespError(f"{source}: attn_logit_softcapping (Gemma 2) is not supported")
        cfg.update(_new_families(d, family, n_layers, source))
        cfg["rope"] = _rope_from_hf(d, family)
        if SLIDING in cfg.get("layer_types", []) and SLIDING not in cfg["rope"]:
            cfg["rope"][SLIDING] = cfg["rope"][FULL]  # one RoPE for both (Mistral, SmolLM3)
        return cls(**cfg)

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        if not path.exists():
            raise MespError(f"{path}: missing config.json")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MespError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise MespError(f"{path}: expected a JSON object")
        return cls.from_hf(d, source=str(path))

    def to_hf(self) -> dict[str, Any]:
        """An HF-style config.json dict (new-style rope_parameters plus legacy keys)."""
        mt = {"gemma3": "gemma3_text"}.get(self.family, self.family)
        skip = ("family", "rope", "rope_layers", *GRANITE_KEYS)
        d = {k: v for k, v in asdict(self).items() if k not in skip}
        d["model_type"] = mt
        if self.family == "smollm3":
            d["no_rope_layers"] = [int(r) for r in self.rope_layers]
            d["use_sliding_window"] = SLIDING in self.layer_types
        if self.family == "mistral":  # its window is one key; transformers warns on layer_types
            d.pop("layer_types")
        if self.family == "granite":
            d.update({k: getattr(self, k) for k in GRANITE_KEYS})
        if self.family == "phi3":  # Phi3Config reads these two outside rope_parameters
            r = self.rope[FULL]
            d["partial_rotary_factor"] = r.partial_rotary_factor
            if r.kind == "longrope":  # transformers prefers the top-level key to the nested one
                d["original_max_position_embeddings"] = r.original_max_position_embeddings
        if self.family != "gemma2":  # the one family whose config has the key
            d.pop("attn_logit_softcapping")
        elif float(d["query_pre_attn_scalar"]).is_integer():  # Gemma2Config takes an int only
            d["query_pre_attn_scalar"] = int(d["query_pre_attn_scalar"])

        def rp(r: RopeSpec) -> dict[str, Any]:
            out: dict[str, Any] = {"rope_type": r.kind, "rope_theta": r.theta}
            if r.kind != "default":
                out["factor"] = r.factor
            if r.kind == "llama3":
                out.update(
                    low_freq_factor=r.low_freq_factor,
                    high_freq_factor=r.high_freq_factor,
                    original_max_position_embeddings=r.original_max_position_embeddings,
                )
            if r.kind == "longrope":  # the resolved attention factor: no default to re-derive
                out.update(
                    short_factor=list(r.short_factor),
                    long_factor=list(r.long_factor),
                    attention_factor=r.attention_factor,
                    original_max_position_embeddings=r.original_max_position_embeddings,
                )
            if r.partial_rotary_factor != 1.0:
                out["partial_rotary_factor"] = r.partial_rotary_factor
            return out

        if self.family == "gemma3":
            d["rope_parameters"] = {k: rp(v) for k, v in self.rope.items()}
            d["rope_theta"] = self.rope[FULL].theta
            d["rope_local_base_freq"] = self.rope[SLIDING].theta
        else:
            d["rope_parameters"] = rp(self.rope[FULL])
            d["rope_theta"] = self.rope[FULL].theta
        return d


def _new_families(d: dict[str, Any], family: str, n_layers: int, source: str) -> dict[str, Any]:
    """The keys of Mistral, SmolLM3, Granite, OLMo 2 and Gemma 2, read as transformers reads
    them."""
    if d.get("mlp_bias"):
        raise MespError(f"{source}: mlp_bias is not supported")
    if family == "mistral":  # a window on every layer; absent means transformers' 4096
        win = d.get("sliding_window", 4096)
        return {"sliding_window": win, "layer_types": [SLIDING if win else FULL] * n_layers}
    if family == "smollm3":
        interval = int(d.get("no_rope_layer_interval", 4))
        rope = d.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n_layers)]
        rope = [bool(r) for r in rope[:n_layers]]  # "at least" one entry per layer
        win = d.get("sliding_window") if d.get("use_sliding_window") else None
        # transformers: the NoPE layers slide when use_sliding_window is set
        types = d.get("layer_types") or [SLIDING if win and not r else FULL for r in rope]
        types = [t if win else FULL for t in types]
        return {"rope_layers": rope, "layer_types": list(types), "sliding_window": win}
    if family == "granite":
        return {k: float(d.get(k, 1.0)) for k in GRANITE_KEYS}
    if family == "olmo2":
        if d.get("attention_bias"):  # OLMo 2's o_proj then has a bias too, which we do not build
            raise MespError(f"{source}: attention_bias is not supported for OLMo 2")
        return {"rms_norm_eps": float(d.get("rms_norm_eps", 1e-5))}  # transformers' default
    if family == "phi3":  # a window on every layer when config.json names one (Phi3Model's mask)
        win = d.get("sliding_window")
        if d.get("hidden_act", "silu") != "silu":
            raise MespError(f"{source}: hidden_act {d['hidden_act']!r} is not supported for phi3")
        return {
            "sliding_window": win,
            "layer_types": [SLIDING if win else FULL] * n_layers,
            "rms_norm_eps": float(d.get("rms_norm_eps", 1e-5)),  # transformers' default
        }
    if family == "gemma2":  # absent keys: transformers' Gemma2Config defaults
        if d.get("use_bidirectional_attention"):
            raise MespError(f"{source}: use_bidirectional_attention is not supported")
        types = d.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n_layers)]
        win = d.get("sliding_window", 4096)
        return {
            "layer_types": list(types) if win else [FULL] * n_layers,
            "sliding_window": win,
            "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar", 256)),
            "final_logit_softcapping": d.get("final_logit_softcapping", 30.0),
            "attn_logit_softcapping": d.get("attn_logit_softcapping", 50.0),
        }
    return {}


def _rope_spec(p: dict[str, Any] | None, theta: float) -> RopeSpec:
    p = p or {}
    kind = p.get("rope_type", p.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise MespError(f"rope type {kind!r} is not supported (default, linear, llama3)")
    return RopeSpec(
        theta=float(p.get("rope_theta", theta)),
        kind=kind,
        factor=float(p.get("factor", 1.0)),
        low_freq_factor=float(p.get("low_freq_factor", 1.0)),
        high_freq_factor=float(p.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(p.get("original_max_position_embeddings", 8192)),
    )


def _phi3_rope(d: dict[str, Any], p: dict[str, Any] | None, theta: float) -> RopeSpec:
    """Phi3Config's reading: partial_rotary_factor nested or top level; rope type su / yarn
    mean longrope; the top-level original_max_position_embeddings (default 4096) wins over
    the nested one; absent factor = max_position / original, absent attention_factor =
    sqrt(1 + ln(factor) / ln(original)) when factor > 1 (transformers' longrope init)."""
    p = dict(p or {})
    kind = p.get("rope_type", p.get("type", "default"))
    kind = "longrope" if kind in ("su", "yarn") else kind
    partial = float(p.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    if kind == "default":
        return RopeSpec(theta=float(p.get("rope_theta", theta)), partial_rotary_factor=partial)
    if kind != "longrope":
        raise MespError(f"rope type {kind!r} is not supported for phi3 (default, longrope)")
    omp = int(d.get("original_max_position_embeddings", 4096))
    factor = p.get("factor") or int(d.get("max_position_embeddings", 4096)) / omp
    att = p.get("attention_factor")
    if att is None:
        att = math.sqrt(1 + math.log(factor) / math.log(omp)) if factor > 1.0 else 1.0
    try:
        short, long = [float(x) for x in p["short_factor"]], [float(x) for x in p["long_factor"]]
    except (KeyError, TypeError, ValueError):
        raise MespError("longrope needs short_factor and long_factor lists of numbers") from None
    head_dim = int(d.get("head_dim") or int(d["hidden_size"]) // int(d["num_attention_heads"]))
    n = len(range(0, int(head_dim * partial), 2))  # one factor per rotated frequency
    if len(short) != n or len(long) != n:
        raise MespError(f"longrope short_factor / long_factor need {n} entries each")
    return RopeSpec(
        theta=float(p.get("rope_theta", theta)),
        kind=kind,
        factor=float(factor),
        original_max_position_embeddings=omp,
        partial_rotary_factor=partial,
        short_factor=short,
        long_factor=long,
        attention_factor=float(att),
    )


def _rope_from_hf(d: dict[str, Any], family: str) -> dict[str, RopeSpec]:
    """Accept both the legacy keys (rope_theta, rope_scaling, rope_local_base_freq) and
    transformers 5's rope_parameters (nested per layer type for Gemma3)."""
    params = d.get("rope_parameters") or d.get("rope_scaling")
    theta = float(d.get("rope_theta", DEFAULT_THETA.get(family, 10_000.0)))
    if family == "phi3":
        return {FULL: _phi3_rope(d, params, theta)}
    if family != "gemma3":
        return {FULL: _rope_spec(params, theta)}
    if params and FULL in params:
        local = params.get(SLIDING) or {}
        return {
            FULL: _rope_spec(params[FULL], theta),
            SLIDING: _rope_spec(local, float(d.get("rope_local_base_freq", 10_000.0))),
        }
    local_theta = float(d.get("rope_local_base_freq", 10_000.0))
    return {FULL: _rope_spec(params, theta), SLIDING: RopeSpec(theta=local_theta)}
