"""Tiny GGUF files written the way llama.cpp's converter writes them, for tests (no real model needed).

A random Hugging Face model is exported with llama.cpp's tensor names, its Q/K row permutation for llama-family
files and optional quantization (gguf's own quantizer), together with a small byte-level BPE tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from paraspec.models.llamacpp.child_tasks import gpt2_byte_spelling as _bytes_to_unicode

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """tokens, token types (1 normal, 3 control), merges: 256 bytes + a few merges + chat special tokens."""
    tokens = list(_bytes_to_unicode().values())
    merges = [
        ("Ġ", "t"),
        ("h", "e"),
        ("Ġt", "he"),
        ("d", "e"),
        ("de", "f"),
        ("Ġ", "f"),
        ("i", "b"),
        ("Ġf", "ib"),
        ("r", "e"),
        ("Ġ", "re"),
        ("u", "r"),
        ("ur", "n"),
        ("t", "urn"),
        ("Ġre", "turn"),
    ]
    for a, b in merges:
        tokens.append(a + b)
    types = [1] * len(tokens) + [3] * len(SPECIALS)
    tokens += SPECIALS
    return tokens, types, [f"{a} {b}" for a, b in merges]


def tiny_hf_model(
    family: str,
    vocab_size: int,
    tied: bool,
    seed: int = 0,
    rope_scaling: dict | None = None,
    scale: float = 1.0,
    **overrides,
):
    """A random tiny model; `scale` multiplies the init std (peaked logits for sampling tests), `overrides`
    change config fields (e.g. max_position_embeddings for long-context tests)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        bos_token_id=vocab_size - 3,
        eos_token_id=vocab_size - 1,
        initializer_range=0.02 * scale,
    )
    common.update(overrides)
    rope = {"rope_type": "default", "rope_theta": 10000.0} if rope_scaling is None else rope_scaling
    if family == "qwen2":
        cfg = Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, **common)
    else:
        cfg = LlamaConfig(rope_parameters=rope, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # norms are initialised to ones; make them non-trivial so a mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model


def noisy_copy(model, seed: int, noise: float):
    """The model with relative noise on every weight: a draft that agrees with it on some tokens, not all."""
    import copy

    other = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(noise * torch.randn_like(p) * p.std().clamp_min(1e-3))
    return other


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, written independently of the converter."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_TO_GGUF_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    return f"blk.{parts[2]}." + _HF_TO_GGUF_BLOCK[".".join(parts[3:])]


def write_gguf(
    path: Path,
    model,
    *,
    arch: str | None = None,
    name: str = "tiny test model",
    quantize: dict[str, str] | None = None,
    tokenizer: bool = True,
    extra_tensors: dict | None = None,
    pre: str = "qwen2",
) -> dict[str, np.ndarray]:
    """Export `model` like llama.cpp would. Returns, per HF name, the values the GGUF really holds (after
    f16 rounding / quantization, before the Q/K permutation): what the conversion must give back."""
    cfg = model.config
    family = cfg.model_type
    arch = arch or family
    quantize = quantize or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if family == "llama":
        w.add_rope_dimension_count(cfg.head_dim)
    if tokenizer:
        tokens, types, merges = tiny_vocab()
        assert len(tokens) == cfg.vocab_size
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_pad_token_id(tokens.index("<|endoftext|>"))
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    expected = {}
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().float().numpy().copy()
        n_head = None
        if family == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            n_head = cfg.num_attention_heads if ".q_proj." in hf_name else cfg.num_key_value_heads
            a = _llamacpp_permute(a, n_head)  # llama.cpp permutes first, then quantizes
        kind = quantize.get(hf_name, "F32")
        if kind == "F32":
            stored, raw, held = a, None, a
        elif kind == "F16":
            stored, raw = a.astype(np.float16), None
            held = stored.astype(np.float32)
        else:
            raw = getattr(gguf.GGMLQuantizationType, kind)
            stored = gguf.quantize(a, raw)
            held = gguf.dequantize(stored, raw).reshape(a.shape)
        expected[hf_name] = held if n_head is None else _llamacpp_permute_inverse(held, n_head)
        w.add_tensor(_gguf_name(hf_name), stored, raw_dtype=raw)
    for gname, arr in (extra_tensors or {}).items():
        w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _llamacpp_permute_inverse(w: np.ndarray, n_head: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize_gguf(src: Path, dst: Path, kind: str) -> Path:
    """`src` quantized by llama.cpp's own quantizer (llama_model_quantize) to `kind` ("Q4_K", "Q4_0", "Q6_K", ...),
    every matrix it can (pure: no per-tensor upgrades), or "Q4_K_M" with llama.cpp's own mix (Q6_K for the output
    and some ffn_down/attn_v, as the reference pair has); gguf-py cannot write K-quants."""
    from paraspec.models.llamacpp.model import _llama_cpp

    lib = _llama_cpp()
    params = lib.llama_model_quantize_default_params()
    params.ftype = {
        "Q4_K": lib.LLAMA_FTYPE_MOSTLY_Q4_K_S,
        "Q4_0": lib.LLAMA_FTYPE_MOSTLY_Q4_0,
        "IQ4_NL": lib.LLAMA_FTYPE_MOSTLY_IQ4_NL,
        "Q6_K": lib.LLAMA_FTYPE_MOSTLY_Q6_K,
        "Q4_K_M": lib.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    }[kind]
    params.pure = kind != "Q4_K_M"
    params.nthread = 1
    if lib.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {kind}")
    return dst
