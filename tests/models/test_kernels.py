"""models/native/kernels.py: the oneDNN path gives F.linear's result, and the dispatch rule does what it says."""

import pytest
import torch
import torch.nn.functional as F

from paraspec.models.native import kernels
from paraspec.models.native.kernels import Linear, linear, onednn_available, use_onednn

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN inner product")


@pytest.mark.parametrize("mode", kernels.MODES)
@pytest.mark.parametrize("shape", [(1, 24), (5, 24), (2, 3, 24)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_equals_f_linear(monkeypatch, mode, shape, bias):
    monkeypatch.setenv("PARASPEC_MATMUL", mode)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(shape, generator=g), torch.randn(40, 24, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    with torch.inference_mode():
        out = linear(x, w, b)
    assert out.shape == (*shape[:-1], 40)
    assert torch.allclose(out, F.linear(x, w, b), atol=1e-5)


def test_linear_takes_a_non_contiguous_input(monkeypatch):
    monkeypatch.setenv("PARASPEC_MATMUL", "onednn")
    x, w = torch.randn(24, 6).t(), torch.randn(8, 24)
    with torch.inference_mode():
        assert torch.allclose(linear(x, w), F.linear(x, w), atol=1e-5)


@needs_onednn
def test_dispatch_rule(monkeypatch):
    w, one, few = torch.randn(8, 4), torch.randn(1, 4), torch.randn(3, 4)
    with torch.inference_mode():
        monkeypatch.setenv("PARASPEC_MATMUL", "auto")
        assert use_onednn(few, w)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert not use_onednn(one, w)  # one row on one thread: MKL's gemv is as fast
            torch.set_num_threads(2)
            assert use_onednn(one, w)
        finally:
            torch.set_num_threads(threads)
        assert not use_onednn(few.bfloat16(), w.bfloat16())
        assert not use_onednn(few.double(), w.double())
        monkeypatch.setenv("PARASPEC_MATMUL", "torch")
        assert not use_onednn(few, w)
        monkeypatch.setenv("PARASPEC_MATMUL", "onednn")
        assert use_onednn(one, w)
    # autograd: oneDNN's op has no backward, so a product that needs a gradient stays on F.linear
    assert not use_onednn(few, w.requires_grad_())
    layer = Linear(4, 8)
    layer(few).sum().backward()
    assert layer.weight.grad is not None


def test_bad_mode_names_the_choices(monkeypatch):
    monkeypatch.setenv("PARASPEC_MATMUL", "mkl")
    with pytest.raises(ValueError, match="auto, torch, onednn"):
        linear(torch.ones(2, 3), torch.ones(4, 3))


@needs_onednn
def test_native_decoder_logits_do_not_depend_on_the_kernel(monkeypatch):
    from paraspec.models.native.decoder import Decoder, DecoderConfig, NativeModel

    cfg = DecoderConfig.from_hf(
        dict(
            architectures=["Qwen2ForCausalLM"],
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=97,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            tie_word_embeddings=False,
        )
    )
    torch.manual_seed(0)
    decoder = Decoder(cfg).float()
    for p in decoder.parameters():
        torch.nn.init.normal_(p, std=0.05)
    outputs = {}
    for mode in ("torch", "onednn"):
        monkeypatch.setenv("PARASPEC_MATMUL", mode)
        model = NativeModel(decoder, 64)
        outputs[mode] = torch.cat([model.forward([3, 5, 7, 11]), model.forward([13]), model.forward([17, 19])])
    assert torch.allclose(outputs["torch"], outputs["onednn"], atol=1e-4)
