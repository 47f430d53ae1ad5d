"""Model families by Hugging Face `model_type`: the order in which a decoder layer puts its parts together.

A family is its layer function (where the norms stand around attention and the MLP, `decoder.py`'s parts
in its order) and the norm weights that order reads, under Hugging Face's names; the transformers class that
loads its checkpoints is `config.ARCHITECTURES`'. Everything else a family
may differ in (q/k norms, biases, sliding windows, soft-caps, mixtures of experts) is a `ModelConfig` value
read from its config.json, which the shared parts follow. Both engines build and run each layer through
its family: the trainer's modules make the norms it names, the rollout engine loads and syncs them, and
both call its `layer`. A family with a structure of its own is one `register` call beside its layer
function (a `LayerFunction`), here or in a file of its own (tests/unit/test_model_families.py adds one so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from parity.engines.models.config import ARCHITECTURES, ModelConfig
from parity.engines.models.decoder import Attend, Layer, Tap, attention, input_norm, mlp, show_stages, stream

LayerOutput = tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]


class LayerFunction(Protocol):
    """A family's layer: the new stream (x, pending) and the MoE routing (`decoder.mlp`) of one layer's
    weights `layer` on the stream (x, pending); `attend(q, k, v)` is attention over the other tokens,
    `replay` another engine's experts, `tap` sees every stage of `decoder.LAYER_STAGES`."""

    def __call__(
        self,
        layer: Layer,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        attend: Attend,
        cfg: ModelConfig,
        numerics,
        replay: torch.Tensor | None = None,
        tap: Tap | None = None,
    ) -> LayerOutput: ...


def pre_norm_layer(layer, x, pending, attend, cfg, numerics, replay=None, tap=None) -> LayerOutput:
    """Llama's order: a norm before attention and one before the MLP, each output added to the stream (the
    MLP's by the next layer's input norm: it is returned as `pending`)."""
    x, normed = input_norm(layer, x, pending)
    core, attn = attention(layer, normed, attend, cfg)
    x, post = layer.add_norm("post_attention_layernorm", x, attn)
    out, routing = mlp(layer, post, cfg, numerics, replay)
    if tap is not None:  # the layer's output is one more addition here (the next norm adds it): only when seen
        show_stages(tap, normed, core, attn, out, stream(x, out))
    return x, out, routing


def sandwich_layer(layer, x, pending, attend, cfg, numerics, replay=None, tap=None) -> LayerOutput:
    """Gemma's order: the pre-norm layer with a norm after attention and norms around the MLP as well."""
    x, normed = input_norm(layer, x, pending)
    core, attn = attention(layer, normed, attend, cfg)
    x = x + layer.norm("post_attention_layernorm", attn)
    out, routing = mlp(layer, layer.norm("pre_feedforward_layernorm", x), cfg, numerics, replay)
    x = x + layer.norm("post_feedforward_layernorm", out)
    show_stages(tap, normed, core, attn, out, x)
    return x, None, routing


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's
    layer: LayerFunction
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")  # each layer's, HF names


FAMILIES: dict[str, Family] = {}


def register(family: Family, hf_class: str | None = None) -> Family:
    """Make `family.model_type` a model Parity loads, trains and samples. `hf_class`: the transformers class that
    loads the same checkpoint, for a `model_type` that `config.ARCHITECTURES` does not list yet."""
    if hf_class is not None:
        ARCHITECTURES[family.model_type] = hf_class
    if family.model_type not in ARCHITECTURES:
        raise ValueError(f"register: model_type {family.model_type!r} needs its transformers class (hf_class)")
    FAMILIES[family.model_type] = family
    return family


def family(cfg: ModelConfig) -> Family:
    return FAMILIES[cfg.architecture]


GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
for model_type in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe"):
    register(Family(model_type, pre_norm_layer))
for model_type in ("gemma2", "gemma3_text"):
    register(Family(model_type, sandwich_layer, GEMMA_NORMS))
