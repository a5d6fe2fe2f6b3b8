"""Tiny random checkpoints written like real ones (config.json + safetensors + tokenizer), for fast tests."""

from __future__ import annotations

import string
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
EOS_ID = 2  # <|im_end|>


def write_tokenizer(folder: Path) -> int:
    """A byte-level BPE tokenizer with no merges (specials + one token per byte), like Qwen2's minus the merges.

    Byte-level, so that AutoTokenizer's family-specific classes (e.g. Qwen2Tokenizer, which rebuilds the
    pre-tokenizer) read it the same way. Returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    byte_chars.sort(key=lambda c: (c not in string.printable, c))
    vocab = {tok: i for i, tok in enumerate(SPECIALS + byte_chars)}
    tok = Tokenizer(models.BPE(vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[:2],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return len(vocab)


def hf_config(family: str, vocab_size: int, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=EOS_ID,
        bos_token_id=0,
        pad_token_id=0,
        rms_norm_eps=1e-6,
    )
    common.update(overrides)
    if family == "qwen2":
        return Qwen2Config(tie_word_embeddings=common.pop("tie_word_embeddings", True), **common)
    if family == "llama":
        rope = common.pop(
            "rope_parameters",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500000.0,
            },
        )
        return LlamaConfig(tie_word_embeddings=common.pop("tie_word_embeddings", False), rope_parameters=rope, **common)
    if family == "mistral":
        return MistralConfig(tie_word_embeddings=False, sliding_window=common.pop("sliding_window", 16), **common)
    raise ValueError(family)


def make_checkpoint(
    folder: Path,
    family: str = "qwen2",
    seed: int = 0,
    vocab_size: int | None = None,
    tokenizer: bool = True,
    scale: float = 1.0,
    base: Path | None = None,
    noise: float = 0.0,
    **overrides,
) -> Path:
    """Write a random (or `base` + noise) fp32 checkpoint. `scale` multiplies the init std so that logits
    are peaked enough for sampling tests to see a non-uniform distribution."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    n_tok = write_tokenizer(folder) if tokenizer else 0
    vocab = vocab_size or (n_tok + 7)  # a few padding rows, like real checkpoints
    torch.manual_seed(seed)
    if base is not None:
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * torch.randn_like(p) * p.std().clamp_min(1e-3))
    else:
        cfg = hf_config(family, vocab, initializer_range=0.02 * scale, **overrides)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():  # random biases and norms too, so a wrong bias or norm cannot pass unnoticed
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(str(folder))
    return folder
