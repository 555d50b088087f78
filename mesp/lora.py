"""LoRA: attach adapters to target linears, save/load them in PEFT's format, merge into the base.

PEFT keys: `base_model.model.<module path>.lora_A.weight` (r, in) and `.lora_B.weight` (out, r);
adapter_config.json carries r, lora_alpha (scale = alpha / r), target_modules.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mesp.atomic_io import atomic_write
from mesp.errors import MespError
from mesp.models.linear import Linear
from mesp.models.transformer import FUSED_TARGETS, LORA_TARGETS, CausalLM, is_target

PEFT_PREFIX = "base_model.model."


@dataclass
class LoraConfig:
    rank: int = field(default=8, metadata={"help": "LoRA rank r"})
    scale: float | None = field(
        default=None, metadata={"help": "absolute LoRA scale s (MLX style); default alpha/r"}
    )
    alpha: float | None = field(
        default=None, metadata={"help": "PEFT lora_alpha; scale = alpha / r (default 2r: s=2)"}
    )
    targets: tuple[str, ...] = field(
        default=LORA_TARGETS, metadata={"help": "module names that get adapters"}
    )

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise MespError(f"--rank must be a positive integer, got {self.rank}")
        if self.scale is not None and self.alpha is not None:
            raise MespError("give either --scale or --alpha, not both")
        bad = [t for t in self.targets if t not in LORA_TARGETS and t not in FUSED_TARGETS]
        if bad:
            raise MespError(f"unknown LoRA target(s) {bad}; choose from {list(LORA_TARGETS)}")

    @property
    def lora_scale(self) -> float:
        if self.scale is not None:
            return float(self.scale)
        alpha = self.alpha if self.alpha is not None else 2.0 * self.rank
        return float(alpha) / self.rank

    @property
    def lora_alpha(self) -> float:
        return self.lora_scale * self.rank


def apply_lora(model: CausalLM, cfg: LoraConfig, seed: int = 0) -> int:
    """Freeze the base, add adapters to every target linear; returns the adapter parameter count."""
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    n = 0
    for mod in _target_linears(model, cfg.targets).values():
        mod.add_lora(cfg.rank, cfg.lora_scale, model.dtype, g)
        n += mod.lora_A.numel() + mod.lora_B.numel()  # type: ignore[union-attr]
    return n


def _target_linears(model: CausalLM, targets: tuple[str, ...]) -> dict[str, Any]:
    from mesp.models.linear import Linear

    return {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, Linear) and is_target(n.rsplit(".", 1)[-1], targets)
    }


def lora_param_count(model: CausalLM, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
    return sum(
        rank * (m.in_features + m.out_features) for m in _target_linears(model, targets).values()
    )


def adapter_state(model: CausalLM) -> dict[str, torch.Tensor]:
    """PEFT-named adapter tensors."""
    out = {}
    for name, mod in model.lora_modules().items():
        out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = mod.lora_A.detach()
        out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = mod.lora_B.detach()
    return out


def check_output_dir(out_dir: Path) -> None:
    """Create out_dir or fail in one line now, before hours of training, not after."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise MespError(f"{out_dir}: exists and is not a directory") from None
    except PermissionError:
        raise MespError(f"{out_dir}: cannot create directory (permission denied)") from None
    if not os.access(out_dir, os.W_OK):
        raise MespError(f"{out_dir}: directory is not writable")


def save_adapter(model: CausalLM, out_dir: Path, cfg: LoraConfig, base_name: str = "") -> Path:
    """Write adapter_model.safetensors + adapter_config.json (PEFT format), atomically."""
    check_output_dir(out_dir)
    tensors = {k: v.contiguous() for k, v in adapter_state(model).items()}
    targets = sorted({k.split(".")[-3] for k in tensors})
    conf = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": cfg.rank,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": targets,
        "base_model_name_or_path": base_name,
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    # Weights first, config last: a directory with a config always has matching weights.
    atomic_write(out_dir / "adapter_model.safetensors", lambda p: save_file(tensors, p))
    atomic_write(
        out_dir / "adapter_config.json",
        lambda p: Path(p).write_text(json.dumps(conf, indent=2) + "\n"),
    )
    return out_dir


def load_adapter(model: CausalLM, adapter_dir: Path) -> LoraConfig:
    """Attach a PEFT adapter (ours or PEFT's) to the model; shapes must match the base."""
    conf_p, w_p = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    for p in (conf_p, w_p):
        if not p.exists():
            raise MespError(f"{p}: missing (not a PEFT adapter directory?)")
    try:
        conf = json.loads(conf_p.read_text())
        tensors = load_file(str(w_p))
    except Exception as e:  # json or safetensors errors
        raise MespError(f"{adapter_dir}: unreadable adapter: {e}") from None
    if not isinstance(conf, dict) or type(conf.get("r")) is not int:
        raise MespError(f'{conf_p}: needs an integer "r" (the LoRA rank), as PEFT writes it')
    r, alpha = conf["r"], conf.get("lora_alpha", conf["r"])
    if type(alpha) not in (int, float):
        raise MespError(f'{conf_p}: "lora_alpha" must be a number, got {alpha!r}')
    if any(k.count(".") < 3 for k in tensors):
        raise MespError(f"{w_p}: tensor names are not PEFT's (…<module>.lora_A.weight)")
    targets = tuple(sorted({k.split(".")[-3] for k in tensors}))
    cfg = LoraConfig(rank=r, alpha=float(alpha), targets=targets)
    if conf.get("use_rslora") or conf.get("use_dora"):
        raise MespError(f"{conf_p}: rsLoRA/DoRA adapters are not supported")
    apply_lora(model, cfg)
    mods = model.lora_modules()
    seen = set()
    for key, t in tensors.items():
        name = key.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0]
        which = key.rsplit(".", 2)[1]
        mod = mods.get(name)
        if mod is None or which not in ("lora_A", "lora_B"):
            raise MespError(f"{w_p}: tensor {key} does not belong to this model")
        p = getattr(mod, which)
        if tuple(t.shape) != tuple(p.shape):
            raise MespError(
                f"{w_p}: {key} has shape {tuple(t.shape)}, this model needs {tuple(p.shape)} "
                "(adapter made for another model?)"
            )
        with torch.no_grad():
            p.copy_(t.to(p.dtype))
        seen.add(key)
    missing = [n for n in mods if f"{PEFT_PREFIX}{n}.lora_A.weight" not in seen]
    if missing:
        raise MespError(f"{w_p}: no adapter tensors for {missing[0]} (and {len(missing) - 1} more)")
    return cfg


@torch.no_grad()
def merged_weight(mod: Linear) -> torch.Tensor:
    """W + s·BA of one adapted linear, in float32: a fresh tensor, the module is untouched."""
    return mod.dense(torch.float32) + mod.lora_scale * (mod.lora_B.float() @ mod.lora_A.float())


@torch.no_grad()
def merge_lora(model: CausalLM, keep_quant: bool = True) -> None:
    """Fold s·BA into each base weight (in float32) and drop the adapters; a quantized base
    is requantized at its own spec, or left dense with keep_quant=False."""
    for mod in model.lora_modules().values():
        w = merged_weight(mod)
        mod.set_dense(w.to(model.dtype), mod.quant if keep_quant else None)
        mod.remove_lora()
