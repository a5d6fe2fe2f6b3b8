"""Convert a GGUF file (llama.cpp's format) into a Hugging Face checkpoint folder.

    from paraspec.models.gguf import convert_gguf
    folder = convert_gguf("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "out/qwen-0.5b", dtype="bfloat16")

The folder holds `config.json`, `generation_config.json`, `model.safetensors` (HF tensor names, every tensor
dequantized to `dtype`), the tokenizer (`tokenizer.json`, `tokenizer_config.json` with the chat template) and
`paraspec_source.json`, a record of what it was made from (GGUF sha256, dtype, versions). Both
`transformers.AutoModelForCausalLM.from_pretrained(folder)` and `AutoTokenizer.from_pretrained(folder)` load it,
and so does paraspec's native decoder.

Supported GGUF architectures: `llama` (Llama 1/2/3, and Mistral, which llama.cpp also files as `llama`) and
`qwen2` (Qwen2 / Qwen2.5, incl. Qwen2.5-Coder). The tensors are read and dequantized with the `gguf` package
(any quantization it knows: Q4_K_M, Q8_0, F16, ...); the names are mapped here, and llama.cpp's Q/K row
permutation of llama-family files is undone. The tokenizer is rebuilt by transformers' GGUF tokenizer support.

Dequantizing is lossy in the sense that the result is exactly the quantized model, not the original
full-precision one: a Q4_K_M file gives a Q4_K_M-quality model in bf16 weights.

The folder is written atomically (models/cache.py): everything goes into a hidden temporary folder next to
`out_dir`, which is renamed into place only when complete, so an interrupted conversion never leaves a folder
that looks done.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from paraspec.models.cache import (
    file_sha256,
    made_by_paraspec,
    make_partial_dir,
    publish_dir,
    read_marker,
    write_marker,
)

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"

#: GGUF `general.architecture` values this converter handles, and the HF model they become.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM (MistralForCausalLM when the file's general.name says Mistral)",
    "qwen2": "Qwen2ForCausalLM",
}

_DTYPE_NAMES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}

# tokens llama.cpp also treats as "end of generation" when the file marks them as control tokens
_EOG_TEXTS = (
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<end_of_turn>",
    "<|return|>",
    "<|call|>",
    "<EOT>",
)

# GGUF tensor name (within a block) -> HF parameter name (within `model.layers.N.`)
_BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# tensors that carry no weights of their own in the HF model (folded into config.json or recomputed)
_CONSUMED_TENSORS = {"rope_freqs.weight"}
_IGNORED_TENSOR_SUFFIXES = (".attn_rot_embd",)  # very old llama.cpp files stored the rotary tables
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


class GGUFConversionError(ValueError):
    """The GGUF file cannot be turned into a checkpoint folder; the message says why and what to do."""


class UnsupportedGGUFError(GGUFConversionError):
    """The GGUF file is valid but describes a model this converter does not handle."""


# --------------------------------------------------------------------------------------------- helpers


def normalize_dtype(dtype: Any) -> str:
    """'bfloat16' | 'float16' | 'float32' from a name ('bf16', 'fp32', ...) or a torch.dtype."""
    name = str(dtype).lower().removeprefix("torch.")
    try:
        return _DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of bfloat16, float16, float32") from None


def is_converted(folder: str | os.PathLike, sha256: str | None = None, dtype: Any = None) -> bool:
    """Whether `folder` is a complete conversion (of the GGUF with this sha256, to this dtype, when given)."""
    marker = read_marker(folder)
    if marker is None or marker.get("source") != "gguf":
        return False
    if sha256 is not None and marker.get("gguf_sha256") != sha256.lower():
        return False
    if dtype is not None and marker.get("dtype") != (dtype if dtype == "gguf" else normalize_dtype(dtype)):
        return False
    return True


def _f32(value: float) -> float:
    """GGUF stores floats as float32; give back the shortest decimal that rounds to it (9.99999997e-07 -> 1e-06)."""
    return float(str(np.float32(value)))


@dataclass
class GGUFFile:
    """The parts of a GGUF file the conversion needs (tensors stay memory-mapped)."""

    path: Path
    reader: Any
    metadata: dict[str, Any]
    architecture: str
    tensors: list = field(default_factory=list)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)


def _field_value(f: Any) -> Any:
    """A metadata value as Python: str, int, float, bool, or a list of those."""
    if hasattr(f, "contents"):
        return f.contents()
    # gguf < 0.11 has no ReaderField.contents()
    from gguf import GGUFValueType

    kind = f.types[0] if f.types else None
    if kind == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    if kind == GGUFValueType.ARRAY:
        sub = f.types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    return f.parts[f.data[0]].tolist()[0]


_BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")


def read_gguf(path: str | os.PathLike, *, with_vocab: bool = False) -> GGUFFile:
    """Open a GGUF file; raise a clear error when it is missing or not a GGUF. Tensor data is memory-mapped.

    The big tokenizer arrays are decoded only with `with_vocab=True` (the tokens are needed for EOS detection)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if path.is_dir():
        raise GGUFConversionError(
            f"{path} is a folder, not a .gguf file; a folder with config.json and "
            f"*.safetensors is already a Hugging Face checkpoint and needs no conversion"
        )
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFConversionError(
            f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}). Pass a llama.cpp .gguf "
            f"file, or a Hugging Face checkpoint folder (config.json + *.safetensors) instead"
        )
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path), "r")
    except Exception as e:  # truncated / corrupt files fail in many ways inside the reader
        raise GGUFConversionError(
            f"cannot read GGUF file {path} ({type(e).__name__}: {e}); it is probably "
            f"truncated or corrupt: download it again"
        ) from None
    metadata: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key in _BIG_ARRAYS and not (with_vocab and key == "tokenizer.ggml.tokens"):
            metadata[key] = None  # present, not decoded
            continue
        try:
            metadata[key] = _field_value(f)
        except Exception:  # an exotic value type we do not need
            metadata[key] = None
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFConversionError(f"{path} has no general.architecture entry; it is not a model GGUF file")
    return GGUFFile(path=path, reader=reader, metadata=metadata, architecture=arch, tensors=list(reader.tensors))


# --------------------------------------------------------------------------------------------- config


def _unsupported(gf: GGUFFile, what: str) -> UnsupportedGGUFError:
    supported = ", ".join(f"{k} -> {v}" for k, v in SUPPORTED_ARCHITECTURES.items())
    return UnsupportedGGUFError(
        f"{gf.path.name}: {what}. Supported GGUF architectures: {supported}. For other models, pass a Hugging "
        f"Face checkpoint folder (config.json + *.safetensors) or a hub id instead of a .gguf file"
    )


def _family(gf: GGUFFile) -> str:
    arch = gf.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise _unsupported(gf, f"architecture {arch!r} is not supported")
    if arch == "llama":
        name = str(gf.get("general.name") or "") + " " + str(gf.get("general.basename") or "")
        return "mistral" if "mistral" in name.lower() else "llama"
    return arch


def _tensor_shape(t: Any) -> tuple[int, ...]:
    """A tensor's shape in numpy/torch order (GGUF lists the fastest-varying dimension first)."""
    return tuple(int(d) for d in reversed(list(t.shape)))


def _fit_llama3_rope(factors: np.ndarray, theta: float, head_dim: int, original_context: int | None = None) -> dict:
    """Recover HF's `llama3` rope parameters from llama.cpp's `rope_freqs.weight` (per-frequency divisors).

    llama.cpp stores the result of the Llama 3.1 formula, not its parameters; we try the parameter sets in
    use and keep the one that reproduces the tensor. (The formula only depends on original/low and
    original/high, so any set that reproduces the tensor gives the same model.)"""
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if len(factors) != len(inv_freq):
        raise GGUFConversionError(f"rope_freqs.weight has {len(factors)} entries, expected {len(inv_freq)}")
    factor = float(factors.max())
    origs = ((original_context,) if original_context else ()) + (8192, 4096, 16384, 32768, 2048, 65536, 131072)
    for orig in origs:
        for low in (1.0, 2.0, 0.5, 4.0):
            for high in (4.0, 2.0, 8.0, 1.0, 16.0):
                if high <= low:
                    continue
                low_wl, high_wl = orig / low, orig / high
                expect = []
                for freq in inv_freq:
                    wl = 2 * math.pi / freq
                    if wl < high_wl:
                        expect.append(1.0)
                    elif wl > low_wl:
                        expect.append(factor)
                    else:
                        smooth = (orig / wl - low) / (high - low)
                        expect.append(1 / ((1 - smooth) / factor + smooth))
                if np.allclose(factors, expect, rtol=1e-4, atol=1e-6):
                    return {
                        "rope_type": "llama3",
                        "factor": _f32(factor),
                        "low_freq_factor": low,
                        "high_freq_factor": high,
                        "original_max_position_embeddings": orig,
                    }
    raise UnsupportedGGUFError(
        "the file's rope_freqs.weight (per-frequency rope factors) does not match Llama 3 rope scaling with "
        "any usual parameters; pass the model's Hugging Face checkpoint folder instead"
    )


def _rope_scaling(gf: GGUFFile, theta: float, head_dim: int, tensors: dict) -> dict | None:
    kind = gf.arch("rope.scaling.type")
    if "rope_freqs.weight" in tensors:
        from gguf import dequantize

        t = tensors["rope_freqs.weight"]
        factors = dequantize(t.data, t.tensor_type)
        if np.allclose(factors, 1.0):
            return None
        return _fit_llama3_rope(factors, theta, head_dim, gf.arch("rope.scaling.original_context_length"))
    if kind in (None, "none"):
        return None
    factor = gf.arch("rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn" and factor:
        out = {"rope_type": "yarn", "factor": _f32(factor)}
        orig = gf.arch("rope.scaling.original_context_length")
        if orig:
            out["original_max_position_embeddings"] = int(orig)
        return out
    raise _unsupported(gf, f"rope scaling {kind!r} is not supported")


def _eos_ids(gf: GGUFFile, tokens: list[str] | None, token_types: list[int] | None) -> list[int]:
    ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = gf.get(key)
        if isinstance(v, int) and v not in ids:
            ids.append(v)
    if tokens is not None:
        for i, tok in enumerate(tokens):
            if tok in _EOG_TEXTS and i not in ids and (token_types is None or token_types[i] == 3):
                ids.append(i)
    return ids


def _required(gf: GGUFFile, key: str) -> Any:
    """An architecture metadata entry the config cannot do without; its absence names the missing key."""
    v = gf.arch(key)
    if v is None:
        raise GGUFConversionError(f"{gf.path.name} lacks the metadata entry {gf.architecture}.{key}")
    return v


def _kv_head_count(gf: GGUFFile, heads: int) -> int:
    """The number of KV heads; some files list it per layer, which the supported models keep constant."""
    kv_heads = gf.arch("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some files; the supported models have one value
        if len(set(kv_heads)) != 1:
            raise _unsupported(gf, "per-layer numbers of KV heads are not supported")
        kv_heads = kv_heads[0]
    return int(kv_heads)


def _family_config_class(
    gf: GGUFFile, family: str, tensors: dict, hidden: int, heads: int, head_dim: int, n_layers: int
) -> tuple[Any, str, dict[str, Any]]:
    """(config class, HF architecture name, family-only config fields): the families differ in head_dim,
    biases and sliding windows, and each HF class rejects what its family cannot express."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if family == "qwen2":
        if head_dim != hidden // heads:
            raise _unsupported(gf, f"a qwen2 model with head_dim {head_dim} != hidden/heads is not supported")
        return (
            Qwen2Config,
            "Qwen2ForCausalLM",
            dict(use_sliding_window=False, sliding_window=None, max_window_layers=n_layers),
        )
    has = lambda suffix: any(n.endswith(suffix) for n in tensors)  # noqa: E731
    if has(".attn_q.bias") != has(".attn_output.bias"):
        raise _unsupported(gf, "llama-family attention with biases on only some projections is not supported")
    extra: dict[str, Any] = dict(head_dim=head_dim, attention_bias=has(".attn_q.bias"), mlp_bias=has(".ffn_up.bias"))
    if family == "mistral":
        window = gf.arch("attention.sliding_window")
        extra["sliding_window"] = int(window) if window else None
        extra.pop("attention_bias"), extra.pop("mlp_bias")
        if has(".attn_q.bias") or has(".ffn_up.bias"):
            raise _unsupported(gf, "a Mistral model with biases is not supported")
        return MistralConfig, "MistralForCausalLM", extra
    extra["pretraining_tp"] = 1
    return LlamaConfig, "LlamaForCausalLM", extra


def _instantiate_config(cls, arch_name: str, common: dict, extra: dict, theta: float, scaling: dict | None, dtype: str):
    """Build the config in the spelling the installed transformers reads: 5.x takes `rope_parameters` and
    `dtype`, 4.x takes `rope_theta` / `rope_scaling` and `torch_dtype`."""
    rope = {"rope_type": "default", "rope_theta": theta} if scaling is None else {**scaling, "rope_theta": theta}
    if "rope_parameters" in inspect.signature(cls.__init__).parameters:
        return cls(architectures=[arch_name], rope_parameters=rope, **common, **extra)
    common.pop("dtype")
    return cls(architectures=[arch_name], torch_dtype=dtype, rope_theta=theta, rope_scaling=scaling, **common, **extra)


def gguf_to_hf_config(gf: GGUFFile, *, tensors: dict | None = None, dtype: str = "bfloat16"):
    """A transformers `PretrainedConfig` for the model in `gf` (raises UnsupportedGGUFError for others).

    The GGUF metadata gives the sizes; the tensors themselves settle what metadata leaves implicit (vocab
    size, tied embeddings, biases, llama-3 rope factors)."""
    family = _family(gf)
    tensors = tensors if tensors is not None else {t.name: t for t in gf.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFConversionError(f"{gf.path.name} has no token_embd.weight tensor; it is not a complete model")

    hidden = int(_required(gf, "embedding_length"))
    heads = int(_required(gf, "attention.head_count"))
    kv_heads = _kv_head_count(gf, heads)
    head_dim = int(gf.arch("attention.key_length") or gf.arch("rope.dimension_count") or hidden // heads)
    vocab_size = _tensor_shape(tensors["token_embd.weight"])[0]
    theta = _f32(gf.arch("rope.freq_base", 10000.0))
    eps = _f32(gf.arch("attention.layer_norm_rms_epsilon", 1e-6))
    n_ctx = int(gf.arch("context_length", 4096))
    tied = "output.weight" not in tensors
    bos = gf.get("tokenizer.ggml.bos_token_id")
    eos = gf.get("tokenizer.ggml.eos_token_id")

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(_required(gf, "feed_forward_length")),
        num_hidden_layers=int(_required(gf, "block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_act="silu",
        max_position_embeddings=n_ctx,
        rms_norm_eps=eps,
        tie_word_embeddings=tied,
        bos_token_id=bos,
        eos_token_id=eos,
        dtype=dtype,
        initializer_range=0.02,
        use_cache=True,
        attention_dropout=0.0,
    )
    scaling = _rope_scaling(gf, theta, head_dim, tensors)
    cls, arch_name, extra = _family_config_class(
        gf, family, tensors, hidden, heads, head_dim, common["num_hidden_layers"]
    )
    return _instantiate_config(cls, arch_name, common, extra, theta, scaling, dtype)


# --------------------------------------------------------------------------------------------- tensors


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (interleaved rotary pairs back to HF's half-split layout).

    llama.cpp writes `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)`."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GGUFConversionError(f"cannot un-permute a Q/K tensor of {rows} rows for {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str, n_layers: int) -> str | None:
    """The HF parameter name for a GGUF tensor name; None for tensors with no HF weight."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name in _CONSUMED_TENSORS or gguf_name.rsplit(".", 1)[0].endswith(_IGNORED_TENSOR_SUFFIXES):
        return None
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_TENSORS and int(m.group(1)) < n_layers:
        return f"model.layers.{int(m.group(1))}.{_BLOCK_TENSORS[m.group(2)]}"
    raise GGUFConversionError(
        f"unexpected tensor {gguf_name!r} in the GGUF file; this converter does not know "
        f"where it goes in a Hugging Face model"
    )


def _plan_tensors(gf: GGUFFile, config) -> list[tuple[Any, str]]:
    """[(gguf tensor, hf name)] for every tensor that becomes an HF weight, checked against the HF model."""
    plan = []
    for t in gf.tensors:
        name = _hf_name(t.name, config.num_hidden_layers)
        if name is not None:
            plan.append((t, name))
    names = [n for _, n in plan]
    if len(set(names)) != len(names):
        raise GGUFConversionError(f"{gf.path.name} has duplicate tensors")
    expected = set(_expected_param_names(config))
    got = set(names)
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        raise GGUFConversionError(
            f"{gf.path.name}: the tensors do not match a {config.architectures[0]} with this config "
            f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{'...' if len(unexpected) > 5 else ''})"
        )
    return plan


def _expected_param_names(config) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = list(model.state_dict().keys())
    if config.tie_word_embeddings:
        names = [n for n in names if n != "lm_head.weight"]
    return names


def _dequantized(t: Any, config, family: str) -> np.ndarray:
    from gguf import dequantize

    w = dequantize(t.data, t.tensor_type)
    w = np.asarray(w, dtype=np.float32).reshape(_tensor_shape(t))
    if not w.flags.writeable:  # unquantized tensors come straight from the read-only memory map
        w = w.copy()
    if family in ("llama", "mistral"):
        if ".attn_q." in t.name:
            w = _unpermute_qk(w, config.num_attention_heads)
        elif ".attn_k." in t.name:
            w = _unpermute_qk(w, config.num_key_value_heads)
    return w


def _write_weights(
    gf: GGUFFile, config, family: str, plan: list, out: Path, dtype: str, max_shard_bytes: int, progress: bool
) -> list[str]:
    """Dequantize tensor by tensor and write `model.safetensors` (or shards + index). Returns file names."""
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    tdtype = getattr(torch, dtype)
    itemsize = torch.empty((), dtype=tdtype).element_size()
    shards: list[list[tuple[Any, str]]] = [[]]
    size = 0
    for t, name in plan:
        nbytes = math.prod(_tensor_shape(t)) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((t, name))
        size += nbytes
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map, total = {}, 0
    bar = tqdm(total=len(plan), desc=f"dequantizing {gf.path.name}", unit="tensor", disable=not progress)
    for fname, shard in zip(files, shards):
        tensors = {}
        for t, name in shard:
            w = _dequantized(t, config, family)
            tensors[name] = torch.from_numpy(np.ascontiguousarray(w)).to(tdtype)
            del w
            weight_map[name] = fname
            total += tensors[name].numel() * itemsize
            bar.update(1)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
    bar.close()
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        files.append("model.safetensors.index.json")
    return files


# --------------------------------------------------------------------------------------------- tokenizer


_TOKENIZER_CONFIG_NOISE = ("is_local", "local_files_only", "_commit_hash", "name_or_path", "gguf_file")


def _write_tokenizer(gf: GGUFFile, out: Path, model_max_length: int) -> None:
    from transformers import AutoTokenizer

    if gf.get("tokenizer.ggml.model") is None:
        raise GGUFConversionError(
            f"{gf.path.name} carries no tokenizer (no tokenizer.ggml.* metadata); convert with "
            f"with_tokenizer=False and copy the model's tokenizer files into the folder"
        )
    try:
        tok = AutoTokenizer.from_pretrained(str(gf.path.parent), gguf_file=gf.path.name)
    except Exception as e:
        raise GGUFConversionError(
            f"transformers could not build a tokenizer from {gf.path.name} ({type(e).__name__}: {e})"
        ) from e
    tok.model_max_length = model_max_length
    template = gf.get("tokenizer.chat_template")
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    tok.save_pretrained(str(out))
    # tokenizer_config.json: keep the chat template inline too (older transformers only read it from there),
    # and drop keys that describe where this load came from rather than the tokenizer.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in _TOKENIZER_CONFIG_NOISE:
        cfg.pop(key, None)
    template = getattr(tok, "chat_template", None) or template
    if template and "chat_template" not in cfg:
        cfg["chat_template"] = template
    if "add_bos_token" not in cfg and gf.get("tokenizer.ggml.add_bos_token") is not None:
        cfg["add_bos_token"] = bool(gf.get("tokenizer.ggml.add_bos_token"))
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("paraspec", "transformers", "gguf", "torch", "safetensors", "tokenizers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def _config_rope_scaling(config) -> dict | None:
    """The non-default rope scaling of `config` as a legacy `rope_scaling` dict (None for plain rope)."""
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict):
        if rope.get("rope_type", "default") == "default":
            return None
        return {k: v for k, v in rope.items() if k != "rope_theta"}
    return getattr(config, "rope_scaling", None)


def _write_config(config, out: Path, scaling: dict | None) -> None:
    config.save_pretrained(str(out))
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.get("rope_parameters") or {}
    # transformers 4.x reads rope_theta / rope_scaling at the top level; keep both spellings in agreement
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    if scaling is not None and "rope_scaling" not in cfg:
        cfg["rope_scaling"] = scaling
    if "torch_dtype" not in cfg and "dtype" in cfg:
        cfg["torch_dtype"] = cfg["dtype"]
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _write_generation_config(gf: GGUFFile, out: Path, eos_ids: list[int]) -> None:
    gen: dict[str, Any] = {}
    bos = gf.get("tokenizer.ggml.bos_token_id")
    pad = gf.get("tokenizer.ggml.padding_token_id")
    if isinstance(bos, int):
        gen["bos_token_id"] = bos
    if eos_ids:
        gen["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if isinstance(pad, int):
        gen["pad_token_id"] = pad
    # A GGUF holds no sampling defaults; leaving them out makes `generate()` greedy unless told otherwise.
    try:
        from transformers import GenerationConfig

        GenerationConfig(**gen).save_pretrained(str(out))
    except Exception:  # pragma: no cover - fall back to the plain file
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _check_destination(gguf_path: Path, out_dir: Path, overwrite: bool) -> None:
    """Refuse before any work when the source is missing or `out_dir` holds something convert_gguf did not make
    (replacing a folder of the user's must be asked for)."""
    if not gguf_path.exists():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not made_by_paraspec(out_dir) and not overwrite:
        raise FileExistsError(
            f"{out_dir} exists, is not empty and was not made by convert_gguf; choose another "
            f"folder or pass overwrite=True to replace it"
        )


def _token_types(gf: GGUFFile) -> list[int] | None:
    """The vocabulary's token types (3 = control), decoded here because read_gguf skips the big arrays."""
    if "tokenizer.ggml.token_type" in gf.reader.fields:
        return _field_value(gf.reader.fields["tokenizer.ggml.token_type"])
    return None


def _write_configs(gf: GGUFFile, out: Path, config, eos_ids: list[int], context: int) -> None:
    """config.json and generation_config.json. Without weights (config None) config.json only names the
    architecture and context: the runtime that reads the GGUF itself finds the rest in the GGUF."""
    if config is not None:
        _write_config(config, out, _config_rope_scaling(config))
    else:
        (out / "config.json").write_text(
            json.dumps({"gguf_architecture": gf.architecture, "max_position_embeddings": context}, indent=2) + "\n"
        )
    _write_generation_config(gf, out, eos_ids)


def _source_record(
    gf: GGUFFile, digest: str, held: str, config, with_tokenizer: bool, extra_record: dict | None
) -> dict[str, Any]:
    """What paraspec_source.json records: enough to tell later whether the folder still matches a GGUF file."""
    quant: dict[str, int] = {}
    for t in gf.tensors:
        quant[t.tensor_type.name] = quant.get(t.tensor_type.name, 0) + 1
    return {
        "source": "gguf",
        "gguf_file": gf.path.name,
        "gguf_path": str(gf.path),
        "gguf_size": gf.path.stat().st_size,
        "gguf_sha256": digest,
        "dtype": held,
        "architecture": gf.architecture,
        "model_type": config.model_type if config is not None else None,
        "general_name": gf.get("general.name"),
        "gguf_tensor_types": quant,
        "tokenizer": bool(with_tokenizer),
        "converter": "paraspec.models.gguf.convert_gguf",
        "versions": _versions(),
        **(extra_record or {}),
    }


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: Any = "bfloat16",
    *,
    sha256: str | None = None,
    overwrite: bool = False,
    with_tokenizer: bool = True,
    progress: bool = True,
    max_shard_size: int = 5 * 2**30,
    extra_record: dict | None = None,
    weights: bool = True,
) -> Path:
    """Convert a GGUF file into a Hugging Face checkpoint folder at `out_dir` and return its path.

    dtype: bfloat16 (default) | float16 | float32 -- every tensor is dequantized to it.
    sha256: the GGUF's sha256 when the caller already knows it (saves hashing the file again).
    overwrite: replace an existing `out_dir` that this function did not make. A folder it did make is
        replaced when it came from another file or dtype, and returned as it is when it matches.
    with_tokenizer: also write the tokenizer files (needs the GGUF's tokenizer metadata).
    extra_record: more fields for paraspec_source.json.
    weights: False writes everything but the weights (config, tokenizer, marker naming the GGUF): the folder a
        backend that runs the GGUF itself (llamacpp) needs for its tokenizer and chat template.
    """
    dtype = normalize_dtype(dtype)
    gguf_path = Path(gguf_path).expanduser().resolve()
    out_dir = Path(out_dir).expanduser().absolute()
    _check_destination(gguf_path, out_dir, overwrite)

    gf = read_gguf(gguf_path, with_vocab=True)  # fails fast on non-GGUF files
    family = _family(gf) if weights else gf.architecture  # without weights any architecture will do
    digest = (sha256 or "").lower() or file_sha256(gguf_path, progress=progress)
    held = dtype if weights else "gguf"  # no weights: the folder describes the file as it is
    if not overwrite and is_converted(out_dir, sha256=digest, dtype=held):
        logger.info("%s is already a conversion of %s to %s", out_dir, gguf_path.name, dtype)
        return out_dir

    # everything that can reject the file is checked here, before a partial folder exists
    config = gguf_to_hf_config(gf, tensors={t.name: t for t in gf.tensors}, dtype=dtype) if weights else None
    plan = _plan_tensors(gf, config) if weights else []
    eos_ids = _eos_ids(gf, gf.get("tokenizer.ggml.tokens"), _token_types(gf))
    context = config.max_position_embeddings if config is not None else int(gf.arch("context_length", 4096) or 4096)

    tmp = make_partial_dir(out_dir)
    try:
        _write_configs(gf, tmp, config, eos_ids, context)
        if with_tokenizer:
            _write_tokenizer(gf, tmp, model_max_length=context)
        if weights:
            _write_weights(gf, config, family, plan, tmp, dtype, max_shard_size, progress)
        write_marker(tmp, _source_record(gf, digest, held, config, with_tokenizer, extra_record))
        publish_dir(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


__all__ = [
    "convert_gguf",
    "read_gguf",
    "gguf_to_hf_config",
    "is_converted",
    "normalize_dtype",
    "GGUFConversionError",
    "UnsupportedGGUFError",
    "SUPPORTED_ARCHITECTURES",
]
