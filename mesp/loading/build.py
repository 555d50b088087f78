"""Turn named tensors (HF names) into a CausalLM: strict, shape-checked, one tensor at a time.

Every loader (HF safetensors, MLX quantized, GGUF, random) ends here, so all produce the same
in-memory model. The model is built on the meta device first, so no memory is spent on weights
until each one is read (and, when asked, quantized) individually.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from mesp.config import ModelConfig
from mesp.errors import MespError
from mesp.models.linear import FrozenWeight, Linear
from mesp.models.transformer import CausalLM, RMSNorm
from mesp.quant import QuantSpec

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class TensorSource:
    """Named tensors read on demand. `get(name)` returns a tensor of its own (never a view of a
    mapped file, which the model would keep mapped); `close` releases the file behind them,
    as leaving a `with` block does. MLX checkpoints set `quant`."""

    def __init__(
        self,
        names: Iterable[str],
        get: Callable[[str], torch.Tensor],
        source: str,
        close: Callable[[], None] | None = None,
    ) -> None:
        self.names, self._get, self.source, self._close = set(names), get, source, close
        self.quant: QuantSpec | None = None  # set by MLX checkpoints
        # set by quantized GGUF files: a weight's codes as stored (words, scales, biases, spec),
        # or None for a weight stored as floats
        self.stored: Callable[[str], tuple[torch.Tensor, ...] | None] | None = None

    def get(self, name: str) -> torch.Tensor:
        return self._get(name)

    def close(self) -> None:
        if self._close is not None:
            self._close()

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def expected_tensors(model: CausalLM) -> dict[str, tuple[int, ...]]:
    """HF names of every frozen tensor the model needs, with its dense shape."""
    out: dict[str, tuple[int, ...]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, FrozenWeight):
            out[f"{name}.weight"] = (mod.out_features, mod.in_features)
        if isinstance(mod, Linear) and mod.bias is not None:
            out[f"{name}.bias"] = (mod.out_features,)
        if isinstance(mod, RMSNorm):
            out[f"{name}.weight"] = tuple(mod.weight.shape)
    return out


def _check_layer_count(cfg: ModelConfig, src: TensorSource) -> None:
    """A config asking for more layers than the weights hold fails before the model is built:
    a corrupt layer count (say 2**24) would otherwise build millions of blocks first."""
    held = {int(n.split(".")[2]) for n in src.names if n.startswith("model.layers.")
            and n.split(".")[2].isdigit()}  # fmt: skip
    n = cfg.num_hidden_layers  # the first absent index is at most len(held): no walk to n
    first = next((i for i in range(min(n, len(held) + 1)) if i not in held), None)
    if first is not None:
        raise MespError(
            f"{src.source}: missing tensor model.layers.{first}.input_layernorm.weight (the "
            f"config has {n} layers, the weights {len(held)})"
        )


def build_model(
    cfg: ModelConfig,
    src: TensorSource,
    dtype: torch.dtype = torch.float32,
    quant: QuantSpec | None = None,
) -> CausalLM:
    """Strict load: every expected tensor present with the config's shape, nothing unexplained."""
    _check_layer_count(cfg, src)
    with torch.device("meta"):
        model = CausalLM(cfg, dtype)
    expected = expected_tensors(model)
    names = {n for n in src.names if not n.endswith(IGNORED_SUFFIXES)}
    packed = {n[: -len(".scales")] + ".weight" for n in names if n.endswith(".scales")}
    if cfg.tie_word_embeddings:
        names.discard("lm_head.weight")  # some tied checkpoints still carry a copy
        names -= {"lm_head.scales", "lm_head.biases"}
    missing = sorted(set(expected) - names)
    if missing:
        raise MespError(f"{src.source}: missing tensor {missing[0]} ({len(missing)} missing)")
    extra = sorted(
        names
        - set(expected)
        - {
            n
            for n in names
            if n.endswith((".scales", ".biases")) and n.rsplit(".", 1)[0] + ".weight" in packed
        }
    )
    if extra:
        raise MespError(
            f"{src.source}: unexpected tensor {extra[0]} (config does not match weights?)"
        )
    modules = dict(model.named_modules())
    for name, shape in expected.items():
        mod_name, attr = name.rsplit(".", 1)
        mod = modules[mod_name]
        if name in packed:
            spec = src.quant or QuantSpec()
            absent = [k for k in ("scales", "biases") if f"{mod_name}.{k}" not in names]
            if absent:
                raise MespError(
                    f"{src.source}: {name} is packed but {mod_name}.{absent[0]} is missing"
                )
            wq, s, b = (src.get(f"{mod_name}.{k}") for k in ("weight", "scales", "biases"))
            want = (shape[0], shape[1] * spec.bits // 32)
            want_s = (shape[0], shape[1] // spec.group_size)
            if tuple(wq.shape) != want:
                raise MespError(
                    f"{src.source}: {name} has packed shape {tuple(wq.shape)}, config expects "
                    f"{want} at {spec.bits} bits"
                )
            if tuple(s.shape) != want_s or tuple(b.shape) != want_s:
                raise MespError(
                    f"{src.source}: {mod_name} scales/biases have shapes {tuple(s.shape)}/"
                    f"{tuple(b.shape)}, config expects {want_s} at group size {spec.group_size}"
                )
            mod.set_packed(_as_int32(wq), s.to(dtype), b.to(dtype), spec)
            continue
        got = src.stored(name) if src.stored and isinstance(mod, FrozenWeight) else None
        if got is not None and attr == "weight":
            wq, s, b, spec = got
            if (tuple(s.shape), s.shape[1] * spec.group_size) != ((shape[0], s.shape[1]), shape[1]):
                raise MespError(
                    f"{src.source}: tensor {name} has {tuple(s.shape)} groups of "
                    f"{spec.group_size}, config expects shape {shape}"
                )
            mod.set_packed(wq, s.to(dtype), b.to(dtype), spec)
            continue
        t = src.get(name)
        if tuple(t.shape) != shape:
            raise MespError(
                f"{src.source}: tensor {name} has shape {tuple(t.shape)}, config expects {shape}"
            )
        if isinstance(mod, FrozenWeight) and attr == "weight":
            mod.set_dense(t.to(dtype), quant)
        else:
            setattr(mod, attr, t.to(dtype).contiguous())
    left = [n for n, t in model.state_dict().items() if t.is_meta and src.source != "meta"]
    if left:
        raise MespError(f"{src.source}: tensor {left[0]} was never loaded")
    return model


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    """MLX stores packed words as uint32; we keep the same bits as int32 (shifts work on it)."""
    return t if t.dtype == torch.int32 else t.view(torch.int32)


def held(model: CausalLM) -> str:
    """How the frozen weight matrices are held, e.g. '4-bit g64 x210, dense x1' (for the log)."""
    counts: dict[str, int] = {}
    for mod in model.modules():
        if isinstance(mod, FrozenWeight):
            q = mod.quant
            k = f"{q.bits}-bit g{q.group_size}" if q else f"dense {str(mod.dtype)[6:]}"
            counts[k] = counts.get(k, 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
