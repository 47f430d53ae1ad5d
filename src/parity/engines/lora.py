"""LoRA: low-rank adapters trained on a frozen base, saved in PEFT's format.

`apply_lora` freezes every parameter of a `CausalLM`, stores the frozen base in the
trainer precision (a BF16/FP16 base takes half the memory of FP32 and needs no cast on
each forward), and replaces each targeted projection by a `LoRALinear`: the base matmul
plus scale · (x·Aᵀ)·Bᵀ, both in the compute dtype through `kernels.linear`, where A
(rank × in) and B (out × rank) are FP32 master parameters and scale = alpha / rank.
`models/modules.py` needs no change: a `LoRALinear` is a `Linear`.

The rollout engine is sent either merged weights, W + scale·B·A computed in FP32
(`merged_state`), which it casts to the rollout precision like any other sync, or
(`lora.merge=false`) the base once (`base_state`) and then only the adapters
(`adapter_pairs`), which it applies unmerged as the trainer does.
Adapters are saved under PEFT's names (`adapter_config.json`,
`adapter_model.safetensors`), so `peft.PeftModel.from_pretrained(base, adapter_dir)`
loads them.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from parity.config import MAX_CONFIG_BYTES
from parity.engines import kernels
from parity.engines.models.io import save_tensors
from parity.engines.models.modules import CausalLM, Linear, cast_once
from parity.files import JSONError, parse_json, regular_file_problem
from parity.folders import atomic_dir

# The attention and MLP projections LoRA may adapt (PEFT's usual `target_modules` for the Llama family).
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGETS = (*ATTENTION, "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PEFT's options that change what an adapter computes, and the values at which it computes what Parity does
# (PEFT's defaults; absent means the same): an adapter saved with another is a model Parity would misread.
PLAIN_LORA_OPTIONS = {
    "use_rslora": (False,),
    "use_dora": (False,),
    "fan_in_fan_out": (False,),
    "bias": ("none",),
    "modules_to_save": (None, []),
    "rank_pattern": ({},),
    "alpha_pattern": ({},),
    "layers_to_transform": (None,),
}
# PEFT's fields that say nothing of what a trained adapter computes (how it was initialised or saved): any
# value. Every other field PEFT has or will have must be unset (None, false or empty): aLoRA's invocation
# tokens, a bias, replicated layers, trainable tokens ... would make a model Parity computes otherwise.
INERT_FIELDS = {
    "peft_type", "r", "lora_alpha", "target_modules", "lora_dropout", "task_type", "inference_mode",
    "base_model_name_or_path", "revision", "auto_mapping", "peft_version", "init_lora_weights", "loftq_config",
    "eva_config", "corda_config", "lora_ga_config", "megatron_config", "megatron_core", "qalora_group_size",
    "layers_pattern", "ensure_weight_tying",
}  # fmt: skip


class AdapterError(ValueError):
    """Adapters that do not fit the model or the LoRA config; the message says what differs."""


@dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float
    targets: tuple[str, ...] = TARGETS
    # The rollout engine gets W + scale·B·A each sync (`lora.merge`); in exact mode the trainer's forward
    # then computes with that merged weight too, so that both engines multiply by the same matrix.
    merge: bool = True

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


# ----------------------------------------------------------------------------- tensor functions


def init_a(rank: int, fan_in: int, generator: torch.Generator) -> torch.Tensor:
    """A's start: PEFT's Kaiming-uniform with a = √5, which is U(−1/√fan_in, 1/√fan_in). With B = 0
    the adapted model starts as the base exactly."""
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=generator) * 2 - 1) * bound


# ----------------------------------------------------------------------------- modules


class LoRALinear(Linear):
    """A frozen `Linear` plus a trainable low-rank update. Takes over the base layer's own
    (already frozen) parameters, so nothing is copied."""

    def __init__(self, base: Linear, rank: int, scale: float, generator: torch.Generator, merge: bool = True):
        nn.Module.__init__(self)  # not Linear.__init__: that would allocate a new weight
        self.weight, self.bias, self.numerics, self.casts = base.weight, base.bias, base.numerics, None
        d_out, d_in = base.weight.shape
        device = base.weight.device
        self.lora_A = nn.Parameter(init_a(rank, d_in, generator).to(device))
        self.lora_B = nn.Parameter(torch.zeros(d_out, rank, device=device))
        self.scale = scale
        self.merge = merge

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_A, self.lora_B
        cast = functools.partial(cast_once, self.casts, dtype=x.dtype)
        return self.numerics.lora_linear(x, self.weight, self.bias, a, b, self.scale, self.merge, cast)


def targeted(model: CausalLM, targets: tuple[str, ...]) -> list[str]:
    """Names of the projections `targets` selects."""
    return [n for n, m in model.named_modules() if isinstance(m, Linear) and n.rpartition(".")[2] in targets]


def adapted(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def check_lora(
    model: CausalLM, cfg: LoRAConfig, rank_key: str = "lora.rank", targets_key: str = "lora.targets"
) -> list[str]:
    """The names of the projections `cfg` adapts on `model`, once they are known to take its adapters: an
    AdapterError naming `rank_key` or `targets_key` otherwise, before anything is allocated."""
    mlp = [t for t in cfg.targets if t not in ATTENTION]
    if model.config.num_experts and mlp:
        # PEFT on transformers 5 reads these names on a MoE model as the stacked expert tensors,
        # so adapters Parity put on the projections of the same names would not load there.
        raise AdapterError(
            f"{targets_key}: {', '.join(mlp)} on a {model.config.architecture} (MoE) model: PEFT maps these names "
            f"onto the experts, which Parity does not adapt; adapt {','.join(ATTENTION)} only"
        )
    names = targeted(model, cfg.targets)
    narrowest = min(min(model.get_submodule(name).weight.shape) for name in names)
    if cfg.rank > narrowest:  # A and B grow with the rank
        raise AdapterError(
            f"{rank_key}={cfg.rank}: more than {narrowest}, the narrowest adapted projection's width; a rank "
            "above min(in, out) adds nothing but memory"
        )
    return names


def apply_lora(model: CausalLM, cfg: LoRAConfig, base_dtype: torch.dtype, seed: int) -> None:
    """Freeze `model` in `base_dtype` and put adapters on the projections `cfg.targets` names.
    A is drawn from its own generator seeded with `seed`, so the start is reproducible and the
    global RNG is untouched."""
    names = check_lora(model, cfg)
    model.requires_grad_(False)
    for p in model.parameters():  # a tied head shares its Parameter with the embedding: cast once
        p.data = p.data.to(base_dtype)
    generator = torch.Generator().manual_seed(seed)
    for name in names:
        parent, _, child = name.rpartition(".")
        adapter = LoRALinear(model.get_submodule(name), cfg.rank, cfg.scale, generator, cfg.merge)
        setattr(model.get_submodule(parent), child, adapter)


# ----------------------------------------------------------------------------- state


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's tensor names, FP32 copies."""
    out = {}
    for name, m in adapted(model):
        out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A.detach().float().clone()
        out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B.detach().float().clone()
    return out


@torch.no_grad()
def load_adapter_state(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy adapters saved under PEFT's names into `model`'s adapters (all of them, shapes checked)."""
    params = {}
    for name, m in adapted(model):
        params[f"{PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A
        params[f"{PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B
    missing, unexpected = sorted(params.keys() - tensors.keys()), sorted(tensors.keys() - params.keys())
    if missing or unexpected:
        raise AdapterError(f"adapters do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    wrong = [
        f"{k} {tuple(tensors[k].shape)}, expected {tuple(p.shape)}"
        for k, p in params.items()
        if tensors[k].shape != p.shape
    ]
    if wrong:
        raise AdapterError(f"adapter shapes do not match lora.rank and the model ({'; '.join(wrong[:3])})")
    bad = [k for k in params if not tensors[k].is_floating_point() or not torch.isfinite(tensors[k]).all()]
    if bad:  # an integer tensor would be cast silently, and inf/NaN would reach every score
        raise AdapterError(f"adapter tensors that are not finite floating-point numbers: {', '.join(bad[:3])}")
    for k, p in params.items():
        p.copy_(tensors[k])


def base_state(model: CausalLM) -> dict[str, torch.Tensor]:
    """The frozen base under its Hugging Face names, as held (no copy; the tied head omitted)."""
    tied = model.config.tie_word_embeddings
    return {
        name: tensor
        for name, tensor in model.state_dict().items()
        if name.rpartition(".")[2] not in ("lora_A", "lora_B") and not (tied and name == "lm_head.weight")
    }


def merged_state(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under their Hugging Face names, adapters merged into their projections in
    FP32 (the rest as held, which the rollout engine casts like any weight): what it loads."""
    lora = dict(adapted(model))
    out = base_state(model)
    for name in out:
        module, _, leaf = name.rpartition(".")
        m = lora.get(module)
        if m is not None and leaf == "weight":
            out[name] = kernels.merged_weight(m.weight, m.lora_A, m.lora_B, m.scale).detach()
    return out


@torch.no_grad()
def adapter_pairs(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each adapted projection's (A, scale·B), FP32, under its module name: what the rollout engine
    applies unmerged (`RolloutWeights.load_adapters`), with B scaled as `Numerics.lora_linear` scales it."""
    return {name: (m.lora_A.detach().clone(), m.lora_B * m.scale) for name, m in adapted(model)}


# ----------------------------------------------------------------------------- PEFT files


def peft_config(cfg: LoRAConfig, base_model: str) -> dict[str, Any]:
    """adapter_config.json for PEFT."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "target_modules": list(cfg.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def save_adapter(model: CausalLM, cfg: LoRAConfig, out_dir: str | Path, base_model: str) -> Path:
    """Write adapter_config.json + adapter_model.safetensors atomically."""
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        config = peft_config(cfg, base_model)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_tensors(adapter_state(model), tmp / WEIGHTS_FILE, {"format": "pt"})
    return out_dir


def read_adapter_config(adapter_dir: Path) -> tuple[LoRAConfig, Any]:
    """The LoRA settings of a PEFT adapter folder's adapter_config.json and its `base_model_name_or_path`
    (unchecked: PEFT may write null). Every field Parity computes with must have its kind and range, and
    PEFT's options that change the arithmetic their plain values: an AdapterError naming the file and the
    key otherwise. The model decides the rest (`check_lora`: the rank against its widths)."""
    path = adapter_dir / CONFIG_FILE
    problem = regular_file_problem(path)
    if problem is not None:
        raise AdapterError(f"{path} {problem}")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(
            f"{path}: {path.stat().st_size:,} bytes; an adapter config holds at most {MAX_CONFIG_BYTES:,}"
        )
    try:
        saved = parse_json(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise AdapterError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None
    except JSONError as e:
        raise AdapterError(f"{path}{f':{e.lineno}' if e.lineno else ''}: {e}") from None
    if not isinstance(saved, dict):
        raise AdapterError(f"{path}: expected a JSON object {{...}} at the top level, got a {type(saved).__name__}")

    lora = check_adapter_fields(saved, str(path))
    return lora, saved.get("base_model_name_or_path")


def check_adapter_fields(saved: dict[str, Any], where: str) -> LoRAConfig:
    """The LoRA settings of PEFT's config fields (adapter_config.json's, or a `peft.LoraConfig`'s `to_dict()`):
    every field Parity computes with must have its kind and range, and PEFT's options that change the
    arithmetic their plain values; an AdapterError naming `where` and the key otherwise."""

    def refuse(key: str, expected: str) -> AdapterError:
        return AdapterError(f"{where}: {key}: expected {expected}, got {saved.get(key)!r:.80}")

    if saved.get("peft_type") != "LORA":
        raise refuse("peft_type", '"LORA" (Parity reads LoRA adapters only)')
    rank, alpha, targets = saved.get("r"), saved.get("lora_alpha"), saved.get("target_modules")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse("r", "an integer >= 1 (the adapters' rank)")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not (math.isfinite(alpha) and alpha > 0):
        raise refuse("lora_alpha", "a finite number > 0")
    if (
        not isinstance(targets, list)
        or not targets
        or any(t not in TARGETS for t in targets)
        or len(set(targets)) != len(targets)
    ):
        # PEFT also takes a string, a regular expression over module names: Parity adapts these names only
        raise refuse("target_modules", f"a list of distinct names from {', '.join(TARGETS)}")
    for key, plain in PLAIN_LORA_OPTIONS.items():
        if key in saved and saved[key] not in plain:
            raise refuse(key, f"{' or '.join(json.dumps(v) for v in plain)} (plain LoRA, which Parity computes)")
    for key, value in saved.items():
        if key not in INERT_FIELDS and key not in PLAIN_LORA_OPTIONS and value not in (None, False, [], {}):
            raise refuse(key, "it unset: Parity computes plain LoRA, and this option changes what an adapter computes")
    return LoRAConfig(rank, float(alpha), tuple(targets), True)


def read_adapter(adapter_dir: Path, cfg: LoRAConfig) -> dict[str, torch.Tensor]:
    """The adapter tensors of `adapter_dir`, after checking that its config is `cfg`'s."""
    saved, _ = read_adapter_config(adapter_dir)
    differ = [
        f"{key}={held!r}, expected {wanted!r}"
        for key, held, wanted in (
            ("r", saved.rank, cfg.rank),
            ("lora_alpha", saved.alpha, cfg.alpha),
            ("target_modules", list(saved.targets), list(cfg.targets)),
        )
        if held != wanted
    ]
    if differ:
        raise AdapterError(f"{adapter_dir / CONFIG_FILE}: not this run's adapters ({'; '.join(differ)})")
    return load_file(str(adapter_dir / WEIGHTS_FILE))
