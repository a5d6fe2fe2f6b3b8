"""The native decoder computes what Hugging Face computes (fp32), through prefill, decoding and rollbacks."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from paraspec.models.loader import load_model, load_native
from paraspec.models.native.decoder import UnsupportedModelError
from tests.conftest import ON_CUDA, TEST_DEVICE

FAMILIES = ["qwen2_target", "llama_target", "mistral_target"]
# fp32 logits against transformers' on the CPU. On a GPU the padded step's attention is a fused kernel (online
# softmax) where the reference's is the math path: one H100 run measured a max difference of 1.0e-4 (a rollback
# then 23 tokens, padded width 3)
TOL = 3e-4 if ON_CUDA else 1e-4


def hf_logits(folder, ids):
    """transformers' logits (on CPU), moved to the test device to compare with the native decoder's there."""
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].to(TEST_DEVICE)


@pytest.mark.parametrize("padded_width", [None, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_native_matches_hf_prefill_decode_and_rollback(family, padded_width, request):
    folder = request.getfixturevalue(family)
    ids = torch.randint(0, 100, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = hf_logits(folder, ids)
    model = load_native(folder, torch.float32, device=TEST_DEVICE, padded_width=padded_width)

    assert (model.prefill(ids[:20]) - ref[19]).abs().max() <= TOL
    for i in range(20, 30):  # one token at a time
        assert (model.forward([ids[i]])[-1] - ref[i]).abs().max() <= TOL
    assert (model.forward(ids[30:40]) - ref[30:40]).abs().max() <= TOL  # a chunk
    model.rollback(25)  # rewrite positions 25.. with the same tokens
    assert model.length == 25
    assert (model.forward(ids[25:48]) - ref[25:48]).abs().max() <= TOL
    model.rollback(33)
    other = [5] * 6  # a different continuation after a rollback
    ref_other = hf_logits(folder, ids[:33] + other)
    assert (model.forward(other) - ref_other[33:]).abs().max() <= TOL


def test_hf_backend_matches_hf(qwen2_target):
    ids = list(range(10, 40))
    ref = hf_logits(qwen2_target, ids)
    model = load_model(qwen2_target, "float32", backend="hf", device=TEST_DEVICE)  # ref is on TEST_DEVICE
    assert (model.prefill(ids[:10]) - ref[9]).abs().max() <= 1e-4
    assert (model.forward(ids[10:20]) - ref[10:20]).abs().max() <= 1e-4
    model.rollback(12)
    assert model.length == 12
    assert (model.forward(ids[12:30]) - ref[12:30]).abs().max() <= 1e-4
    with pytest.raises(ValueError, match="native backend"):
        model.forward([1, 2], tree_mask=torch.ones(2, 2, dtype=torch.bool))


@pytest.mark.parametrize("padded_width", [None, 3])
def test_tree_mask_and_positions(qwen2_target, padded_width):
    """Two branches after a shared prefix, in one forward, give each branch's own sequential logits."""
    model = load_native(qwen2_target, torch.float32, device=TEST_DEVICE, padded_width=padded_width)
    prefix, a, b = [10, 11, 12, 13], [20, 21], [30, 31]
    ref_a, ref_b = hf_logits(qwen2_target, prefix + a), hf_logits(qwen2_target, prefix + b)
    model.prefill(prefix)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    out = model.forward(a + b, positions=[4, 5, 4, 5], tree_mask=mask)
    assert (out[:2] - ref_a[4:]).abs().max() <= 1e-4
    assert (out[2:] - ref_b[4:]).abs().max() <= 1e-4
    model.keep_path(4, [6, 7])  # keep branch b
    assert model.length == 6
    assert (model.forward([40]) - hf_logits(qwen2_target, prefix + b + [40])[-1]).abs().max() <= 1e-4


def test_blocks_compose_to_the_layer(qwen2_target):
    model = load_native(qwen2_target, torch.float32)
    layer = model.decoder.model.layers[0]
    h = torch.randn(3, model.cfg.hidden_size)
    pos = torch.arange(3)
    cos, sin = model.rope(pos)
    mask = model.attention_mask(pos, 0, None)
    full = layer(h, cos, sin, model.cache, 0, 0, mask)
    after_attn = h + layer.attention_block(h, cos, sin, model.cache, 0, 0, mask)
    assert torch.allclose(full, after_attn + layer.mlp_block(after_attn), atol=1e-6)
    assert not torch.allclose(full, h + layer.mlp_block(h), atol=1e-3)


def test_bf16_default_and_untied_head(llama_target):
    model = load_model(llama_target)  # bfloat16 by default
    assert model.dtype == torch.bfloat16
    assert model.decoder.lm_head.weight is not model.decoder.model.embed_tokens.weight
    logits = model.prefill([1, 2, 3])
    assert logits.dtype == torch.float32 and logits.shape == (model.vocab_size,)


def test_unknown_architecture_names_hf_backend(tmp_path, qwen2_target):
    cfg = json.loads((qwen2_target / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    folder = tmp_path / "gpt2ish"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").write_bytes((qwen2_target / "model.safetensors").read_bytes())
    with pytest.raises(UnsupportedModelError, match="--backend hf"):
        load_model(folder)


def test_rollback_beyond_length_is_an_error(qwen2_target):
    model = load_native(qwen2_target, torch.float32)
    model.prefill([1, 2, 3])
    with pytest.raises(ValueError, match="cannot roll back"):
        model.rollback(4)


@pytest.mark.parametrize("fast_bf16,expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_follows_the_cpu(monkeypatch, qwen2_target, fast_bf16, expected):
    from paraspec.models import loader

    monkeypatch.setattr(loader, "cpu_has_fast_bf16", lambda: fast_bf16)
    assert loader.parse_dtype("auto") == expected
    assert loader.parse_dtype("auto", "cuda:0") == torch.bfloat16
    assert load_model(qwen2_target, "auto").dtype == expected
