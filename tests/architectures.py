"""Tiny random checkpoints of every architecture Parity runs, built with `transformers`.

Each config turns on what makes its family different at a size where it matters: a
sliding window shorter than the test sequences, Llama 3 RoPE scaling with a short
original context, Gemma's soft-capping, a MoE model with a dense layer among sparse ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from conftest import TINY_CONFIG, randomize_weights, write_char_tokenizer

COMMON = {**TINY_CONFIG, "num_hidden_layers": 3}
ARCHITECTURES = ("llama3", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3")


def hf_config(arch: str):
    import transformers as tf

    if arch == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return tf.LlamaConfig(**{**COMMON, "eos_token_id": [2, 3]}, rope_parameters=rope)
    if arch == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=8)
    if arch == "qwen2":
        return tf.Qwen2Config(**COMMON, tie_word_embeddings=True)
    if arch == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=24)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **COMMON,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    if arch == "gemma2":
        return tf.Gemma2Config(
            **COMMON,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=15.0,
        )
    if arch == "gemma3":
        rope = {
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
        return tf.Gemma3TextConfig(
            **COMMON,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters=rope,
        )
    raise ValueError(arch)


def save_random_model(out: Path, arch: str, seed: int = 0) -> Path:
    """A random checkpoint of `arch` with the character tokenizer of conftest, saved by transformers."""
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = hf_config(arch)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config)
    randomize_weights(model, gemma=arch.startswith("gemma"))
    model.save_pretrained(out)
    write_char_tokenizer(out)
    if isinstance(config.eos_token_id, list):
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": config.eos_token_id}))
    return out


def reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
