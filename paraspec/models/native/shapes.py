"""Named decoder shapes and random-weight decoders of those shapes, built directly on a device.

What a forward costs depends on the shape and the device, not on the weights' values, so a random decoder of a
real model's shape times like that model without its checkpoint: `make gpu-check` measures forwards of these
shapes, and a simulated model with `shape=` pays one such forward per forward (models/simulated.py).

    qwen2.5-0.5b, qwen2.5-1.5b      Qwen2.5 (qkv bias, tied embeddings)
    llama-3.2-1b, llama-3.1-8b      Llama 3 (3.2-1B tied, 3.1-8B not)
    tiny-draft, tiny-target         two-layer stand-ins for tests and CPU runs
"""

from __future__ import annotations

import torch

from paraspec.models.native.decoder import Decoder, DecoderConfig

# hidden, intermediate, layers, heads, kv heads, head_dim, vocab, tied (from each model's config.json)
SHAPES: dict[str, tuple] = {
    "qwen2.5-0.5b": ("qwen2", 896, 4864, 24, 14, 2, 64, 151936, True),
    "qwen2.5-1.5b": ("qwen2", 1536, 8960, 28, 12, 2, 128, 151936, True),
    "llama-3.2-1b": ("llama", 2048, 8192, 16, 32, 8, 64, 128256, True),
    "llama-3.1-8b": ("llama", 4096, 14336, 32, 32, 8, 128, 128256, False),
    "tiny-draft": ("qwen2", 64, 128, 2, 4, 2, 16, 256, True),
    "tiny-target": ("qwen2", 128, 256, 2, 4, 2, 32, 256, True),
}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def check_shape(shape: str) -> str:
    if shape not in SHAPES:
        raise ValueError(f"unknown decoder shape {shape!r}; use one of {', '.join(SHAPES)}")
    return shape


def decoder_config(shape: str) -> DecoderConfig:
    family, hidden, inter, layers, heads, kv_heads, head_dim, vocab, tied = SHAPES[check_shape(shape)]
    return DecoderConfig(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=1e6 if family == "qwen2" else 5e5,
        rope_scaling=None,
        max_position_embeddings=32768,
        tie_word_embeddings=tied,
        qkv_bias=family == "qwen2",
        o_bias=False,
        mlp_bias=False,
        sliding_window=None,
        eos_token_ids=(),
    )


def shape_dtype(dtype, device) -> torch.dtype:
    """None or "auto": bfloat16 on CUDA, float32 on CPU (where bf16 matmuls are slow on most machines)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or str(dtype) == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if str(dtype) not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[str(dtype)]


@torch.no_grad()
def random_decoder(shape: str, device="cpu", dtype=None, seed: int = 0) -> Decoder:
    """A Decoder of `shape` with random weights (normal, std 0.02; norms 1, biases 0), allocated on `device` in
    its final dtype: an 8B shape never passes through the host or through float32."""
    cfg = decoder_config(shape)
    dtype = shape_dtype(dtype, device)
    with torch.device("meta"):
        decoder = Decoder(cfg).to(dtype)
    if cfg.tie_word_embeddings:
        del decoder.lm_head.weight
    decoder = decoder.to_empty(device=device)
    if cfg.tie_word_embeddings:
        decoder.lm_head.weight = decoder.model.embed_tokens.weight
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in decoder.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, 0.02, generator=generator)
    return decoder.eval().requires_grad_(False)
