"""A model family with a structure of its own is one file: this one. It registers a post-norm family (OLMo 2's
norm placement: attention and the MLP read the stream itself, and their outputs are normalised before they are
added) and touches nothing under src/. Both engines then build and run it: the trainer's logits match a plain
transcription of that order, and the rollout engine samples with it, μ equal to the trainer's π bit for bit in
exact mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_CONFIG
from engine_pair import FILTERED, PLAIN, random_prompts, trainer_logprobs
from parity.engines import kernels
from parity.engines.models.config import ARCHITECTURES, ModelConfig
from parity.engines.models.decoder import attention, mlp, show_stages
from parity.engines.models.families import FAMILIES, Family, register
from parity.engines.models.io import export_state
from parity.engines.models.modules import CausalLM
from parity.engines.rollout import RolloutEngine
from parity.engines.trainer import sequence_logprobs


def post_norm_layer(layer, x, pending, attend, cfg, numerics, replay=None, tap=None):
    """OLMo 2's order: no norm before attention or the MLP; each output normalised, then added."""
    core, attn = attention(layer, x, attend, cfg)
    x = x + layer.norm("post_attention_layernorm", attn)
    out, routing = mlp(layer, x, cfg, numerics, replay)
    x = x + layer.norm("post_feedforward_layernorm", out)
    show_stages(tap, x, core, attn, out, x)
    return x, None, routing


@pytest.fixture(scope="module")
def post_norm():
    family = Family("test_post_norm", post_norm_layer, ("post_attention_layernorm", "post_feedforward_layernorm"))
    register(family, hf_class="Olmo2ForCausalLM")
    hf = {**TINY_CONFIG, "model_type": family.model_type}
    yield ModelConfig.from_hf(hf)
    FAMILIES.pop(family.model_type)
    ARCHITECTURES.pop(family.model_type)


def _model(cfg: ModelConfig, exact: bool) -> CausalLM:
    model = CausalLM(cfg, kernels.numerics(exact=exact))
    model.init_weights(seed=0, std=0.2)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # not all ones: a norm that is left out shows
                p.copy_(1 + 0.5 * torch.rand(p.shape, generator=gen))
    return model


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The post-norm model written out for one sequence [T] -> logits [T, V], FP32, in plain torch."""
    cfg, w = model.config, model.state_dict()
    t, d, h, hkv = len(ids), cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    freqs = torch.arange(t).float()[:, None] / cfg.rope_theta ** (torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()

    def rope(z):  # [heads, T, d]
        z1, z2 = z.chunk(2, -1)
        return z * cos + torch.cat([-z2, z1], -1) * sin

    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        q = rope((x @ w[p + "self_attn.q_proj.weight"].T).view(t, h, d).transpose(0, 1))
        k = rope((x @ w[p + "self_attn.k_proj.weight"].T).view(t, hkv, d).transpose(0, 1))
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, hkv, d).transpose(0, 1)
        k, v = k.repeat_interleave(h // hkv, 0), v.repeat_interleave(h // hkv, 0)
        core = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(t, h * d)
        x = x + _rms(
            core @ w[p + "self_attn.o_proj.weight"].T, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps
        )
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        out = (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        x = x + _rms(out, w[p + "post_feedforward_layernorm.weight"], cfg.rms_norm_eps)
    return _rms(x, w["model.norm.weight"], cfg.rms_norm_eps) @ w["lm_head.weight"].T


def test_a_registered_family_holds_the_weights_its_order_reads(post_norm):
    layer_weights = {
        n.split(".", 3)[3] for n in CausalLM(post_norm, kernels.numerics()).state_dict() if ".layers.0." in n
    }
    assert "post_feedforward_layernorm.weight" in layer_weights and "input_layernorm.weight" not in layer_weights


def test_the_trainer_computes_the_registered_order(post_norm):
    model = _model(post_norm, exact=False)
    ids = torch.randint(3, post_norm.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(1, 8, dtype=torch.bool)
    _, logp = sequence_logprobs(model, ids[:, :4].tolist(), ids[:, 4:], mask, None, 1.0, torch.float32)
    expected = torch.log_softmax(_reference_logits(model, ids[0]), -1)[3:11].gather(-1, ids[0, 4:, None])[:, 0]
    torch.testing.assert_close(logp[0], expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("sampling", [PLAIN, FILTERED], ids=["plain", "filtered"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_engine_samples_the_registered_family_with_the_trainers_bits(post_norm, precision, sampling):
    model = _model(post_norm, exact=True)
    engine = RolloutEngine(post_norm, precision, [post_norm.eos_token_id], post_norm.pad_token_id, model.numerics)
    engine.weights.load(export_state(model), version=0)
    batch = engine.generate(random_prompts(6, post_norm.vocab_size, seed=3), 2, sampling, seed=4)
    assert batch.response_mask.sum() > 20
    pi = trainer_logprobs(model, batch, precision, micro_batch=4)
    mu = batch.rollout_logprobs
    assert torch.equal(pi[batch.response_mask], mu[batch.response_mask])
