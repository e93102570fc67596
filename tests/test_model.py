"""The model's small ops against transformers' own, bit for bit in fp32: the engine's greedy parity rests on
them, and they are written differently from transformers' (fewer ops per layer)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from kvops.engine.model import LlamaModel, apply_rope


def _tiny(dtype: torch.dtype) -> LlamaModel:
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
    generator = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (32, 64), "model.norm.weight": (64,),
              "model.layers.0.input_layernorm.weight": (64,), "model.layers.0.post_attention_layernorm.weight": (64,),
              "model.layers.0.self_attn.q_proj.weight": (64, 64), "model.layers.0.self_attn.k_proj.weight": (32, 64),
              "model.layers.0.self_attn.v_proj.weight": (32, 64), "model.layers.0.self_attn.o_proj.weight": (64, 64),
              "model.layers.0.mlp.gate_proj.weight": (96, 64), "model.layers.0.mlp.up_proj.weight": (96, 64),
              "model.layers.0.mlp.down_proj.weight": (64, 96)}
    state = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    return LlamaModel(config, state, dtype, max_positions=256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_rms_norm_is_transformers_bit_for_bit(dtype, rows):
    model = _tiny(dtype)
    norm = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(model.layers[0].input_norm)
    x = (torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)) * 7).to(dtype)
    with torch.inference_mode():
        assert torch.equal(model._rms_norm(x, model.layers[0].input_norm), norm(x))


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_rope_is_transformers_bit_for_bit(rows):
    model = _tiny(torch.float32)
    generator = torch.Generator().manual_seed(rows)
    positions = torch.randint(0, 256, (rows,), generator=generator)
    heads = model.num_heads + model.num_kv_heads
    qk = torch.randn(rows, heads, model.head_dim, generator=generator) * 3
    cos, sin_signed = model.cos[positions], model.sin_signed[positions]
    sin = sin_signed.clone()
    sin[:, : model.head_dim // 2].neg_()  # the table's plain sin, as transformers takes it
    # transformers: [batch, heads, tokens, head_dim] with cos/sin [batch, tokens, head_dim]
    expected, _ = apply_rotary_pos_emb(qk.transpose(0, 1)[None], qk.transpose(0, 1)[None], cos[None], sin[None])
    got = apply_rope(qk, cos.unsqueeze(1), sin_signed.unsqueeze(1))
    assert torch.equal(got, expected[0].transpose(0, 1))
    assert not torch.equal(got, apply_rope(qk, cos.unsqueeze(1), sin.unsqueeze(1)))  # the sign matters
