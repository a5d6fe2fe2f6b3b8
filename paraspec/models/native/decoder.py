"""Native decoder for the Llama family (Llama 2/3.x, Qwen2, Mistral) with a static KV cache.

In the spirit of gpt-fast: a plain nn.Module that takes explicit positions; the KV cache is a preallocated buffer
indexed by slot, so rolling back is moving a length pointer. Each layer's attention block and MLP block can be
called on their own (EasySpec runs several attention blocks from one input; hidden-state studies read them).

Module names match Hugging Face checkpoints, so a safetensors state dict loads without renaming.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paraspec.models.base import check_rollback, eos_ids
from paraspec.models.native.kernels import Linear
from paraspec.models.native.padded import WIDTHS, PaddedForward, check_width, measured_width

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}


class UnsupportedModelError(ValueError):
    pass


@dataclass
class DecoderConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, cfg: dict) -> DecoderConfig:
        archs = cfg.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None and cfg.get("model_type") in ("llama", "qwen2", "mistral"):
            family = cfg["model_type"]
        if family is None:
            raise UnsupportedModelError(
                f"architecture {archs or cfg.get('model_type')!r} is not implemented by the native backend "
                f"(it supports {', '.join(SUPPORTED_ARCHITECTURES)}); pass --backend hf (backend='hf') "
                f"to run it through transformers"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"activation {cfg['hidden_act']!r} is not supported natively; pass --backend hf"
            )
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("llama3", "linear", "default"):
                raise UnsupportedModelError(f"rope scaling {kind!r} is not supported natively; pass --backend hf")
            if kind == "default":
                scaling = None
        heads = cfg["num_attention_heads"]
        window = cfg.get("sliding_window") if (family == "mistral" or cfg.get("use_sliding_window")) else None
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=family != "qwen2" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=window,
            eos_token_ids=eos_ids(cfg.get("eos_token_id")),
        )


def rope_inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq.float()
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return (inv_freq / s["factor"]).float()
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled).float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class KVCache:
    """Preallocated keys and values, one [kv_heads, max_context, head_dim] pair per layer, filled by slot.

    `length` is the number of valid slots; everything at or after it is garbage that the next write replaces,
    which is why rollback is O(1).
    """

    def __init__(
        self, cfg: DecoderConfig, max_context: int, dtype: torch.dtype, device: torch.device, slots: int | None = None
    ):
        shape = (cfg.num_layers, cfg.num_kv_heads, slots or max_context, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        self.max_context = max_context


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, q_dim, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, kv_dim, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, kv_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_dim, cfg.hidden_size, bias=cfg.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        layer: int,
        start: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """x: [n, hidden] (already normed). Writes k, v into cache slots start..start+n-1 of `layer`."""
        return self.o_proj(self.attend(*self.project(x, cos, sin), cache, layer, start, mask))

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [heads, n, head_dim], k and v [kv_heads, n, head_dim] of n rows, RoPE applied (row by row)."""
        cfg, n = self.cfg, x.shape[0]
        q = self.q_proj(x).view(n, cfg.num_heads, cfg.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(n, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(n, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        layer: int,
        start: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """One sequence's rows: k, v written at slots start.., attention over its cache; [n, heads * head_dim]
        before o_proj."""
        cfg, n = self.cfg, q.shape[1]
        end = start + n
        cache.k[layer, :, start:end] = k
        cache.v[layer, :, start:end] = v
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0),
            cache.k[layer, :, :end].unsqueeze(0),
            cache.v[layer, :, :end].unsqueeze(0),
            attn_mask=mask,
            enable_gqa=cfg.num_kv_heads != cfg.num_heads,
        )
        return out.squeeze(0).transpose(0, 1).reshape(n, cfg.num_heads * cfg.head_dim)

    def over_whole_cache(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        layer: int,
        slots: torch.Tensor,
        bias: torch.Tensor,
    ) -> torch.Tensor:
        """The padded forward's attention (models/native/padded.py): x [W, hidden] (normed), keys and values
        written at `slots` (a tensor), attention over every cache slot under the additive `bias` [W, slots].

        Grouped-query attention as plain attention per KV head: the query heads that share a KV head are stacked
        along the sequence axis (one [G*W, slots] mask), so no KV head is copied and the fused kernels apply.
        The tensors go in as 4-D (one batch of KV heads): SDPA sends 3-D inputs to its math path, which on a GPU
        copies K and V to fp32 every layer (benchmarks/padded_attention.py times the two forms)."""
        cfg, W = self.cfg, x.shape[0]
        H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q = self.q_proj(x).view(W, H, D).transpose(0, 1)
        k = self.k_proj(x).view(W, KV, D).transpose(0, 1)
        v = self.v_proj(x).view(W, KV, D).transpose(0, 1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        cache.k[layer].index_copy_(1, slots, k)
        cache.v[layer].index_copy_(1, slots, v)
        G = H // KV
        out = F.scaled_dot_product_attention(
            q.reshape(1, KV, G * W, D),
            cache.k[layer].unsqueeze(0),
            cache.v[layer].unsqueeze(0),
            attn_mask=bias.repeat(G, 1)[None, None],
        )
        # reshape, not view: a fused kernel may return its output strided
        return self.o_proj(out.reshape(H, W, D).transpose(0, 1).reshape(W, H * D))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attention_block(self, h, cos, sin, cache, layer, start, mask) -> torch.Tensor:
        """The residual update of the attention sub-block: attn(norm(h))."""
        return self.self_attn(self.input_layernorm(h), cos, sin, cache, layer, start, mask)

    def mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        """The residual update of the MLP sub-block: mlp(norm(h))."""
        return self.mlp(self.post_attention_layernorm(h))

    def forward(self, h, cos, sin, cache, layer, start, mask) -> torch.Tensor:
        h = h + self.attention_block(h, cos, sin, cache, layer, start, mask)
        return h + self.mlp_block(h)


class Embedding(nn.Embedding):
    """nn.Embedding whose weights are not initialised (they come from a checkpoint, as kernels.Linear's do)."""

    def reset_parameters(self) -> None:
        pass


class DecoderBody(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Decoder(nn.Module):
    """The network: embeddings, layers, final norm, LM head (weights only; no state besides parameters)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.model = DecoderBody(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


class NativeModel:
    """Implements the Model protocol (`models/base.py`) over a Decoder and its static KV cache.

    padded_width: an int W pads every forward to W rows (models/native/padded.py: one shape, so a row's logits do not
    depend on the others; graph-captured on CUDA); None runs each forward at its own width; "auto" is W measured
    once on a CUDA device and None on a CPU, where padding costs compute. `graph` (None: on CUDA) captures the
    W-row step in a CUDA graph; `compile_step` runs the step through torch.compile first (fewer, fused kernels:
    docs/GPU.md; off by default)."""

    splits_prompts = False  # prompt and tokens after it: one forward (models.base.Model)

    def __init__(
        self,
        decoder: Decoder,
        max_context: int,
        eos_token_ids: tuple[int, ...] = (),
        padded_width: int | str | None = None,
        graph: bool | None = None,
        compile_step: bool = False,
    ):
        cfg = decoder.cfg
        self.decoder, self.cfg = decoder, cfg
        param = decoder.lm_head.weight
        self.dtype, self.device = param.dtype, param.device
        self.max_context = max_context
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = tuple(eos_token_ids or cfg.eos_token_ids)
        width = check_width(padded_width)
        if width == "auto" and self.device.type != "cuda":
            width = None
        # a padded forward writes up to W - 1 rows past the last real one; "auto" picks one of WIDTHS
        spare = width if isinstance(width, int) else max(WIDTHS) if width == "auto" else 0
        slots = -(-(max_context + spare) // 64) * 64 if spare else max_context  # aligned rows for fused kernels
        self.cache = KVCache(cfg, max_context, self.dtype, self.device, slots)
        inv_freq = rope_inv_freq(cfg).to(self.device)
        angles = torch.outer(torch.arange(slots, dtype=torch.float32, device=self.device), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self._cos, self._sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
        self.padded = None
        if compile_step and width is None:
            raise ValueError(
                "compile_step compiles the padded step: pass padded_width=W (an int; 'auto' is off on a CPU)"
            )
        if width is not None:
            if not isinstance(width, int):  # "auto"
                width = measured_width(self)
            self.padded = PaddedForward(self, width, graph, compile_step)

    @property
    def padded_width(self) -> int | None:
        """W when every forward is padded to W rows, else None."""
        return None if self.padded is None else self.padded.width

    @property
    def length(self) -> int:
        return self.cache.length

    def rollback(self, length: int) -> None:
        check_rollback(length, self.cache.length)
        self.cache.length = length

    def keep_path(self, prefix_len: int, slots: list[int]) -> None:
        """The Model protocol's compaction: only the moved entries are copied, the prefix stays in place."""
        cache = self.cache
        if slots:
            src = torch.tensor(slots, device=cache.k.device)
            dst = torch.arange(prefix_len, prefix_len + len(slots), device=cache.k.device)
            if not torch.equal(src, dst):
                cache.k[:, :, dst] = cache.k[:, :, src]  # the right side is gathered first: overlap is safe
                cache.v[:, :, dst] = cache.v[:, :, src]
        cache.length = prefix_len + len(slots)

    def cache_entries(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the first `length` keys and values (native only; tests compare caches with it)."""
        return self.cache.k[:, :, :length].clone(), self.cache.v[:, :, :length].clone()

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        self.cache.length = 0
        return self.forward(token_ids, last_n=1)[-1]

    def attention_mask(self, positions: torch.Tensor, start: int, tree_mask: torch.Tensor | None):
        """Bool [n, start + n]: every new token sees the cached prefix; among themselves, causal or `tree_mask`.

        Returns None when plain SDPA without a mask is exact (one new token, no sliding window).
        """
        n = positions.shape[0]
        window = self.cfg.sliding_window
        if n == 1 and tree_mask is None and (window is None or start < window):
            return None
        new = (
            torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
            if tree_mask is None
            else tree_mask.to(device=self.device, dtype=torch.bool)
        )
        mask = torch.cat((torch.ones(n, start, dtype=torch.bool, device=self.device), new), dim=1)
        if window is not None:
            key_pos = torch.cat((torch.arange(start, device=self.device), positions))
            mask &= (positions[:, None] - key_pos[None, :]) < window
        return mask

    def embed(self, token_ids: list[int]) -> torch.Tensor:
        return self.decoder.model.embed_tokens(torch.tensor(token_ids, device=self.device))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cos[positions].unsqueeze(0), self._sin[positions].unsqueeze(0)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder.lm_head(self.decoder.model.norm(h)).float()

    @torch.inference_mode()
    def forward(
        self,
        token_ids: list[int],
        positions: list[int] | None = None,
        tree_mask: torch.Tensor | None = None,
        last_n: int | None = None,
    ) -> torch.Tensor:
        n, start = len(token_ids), self.cache.length
        if n == 0:
            raise ValueError("forward needs at least one token")
        if start + n > self.max_context:
            raise ValueError(
                f"context full: {start} cached + {n} new tokens exceed max_context "
                f"{self.max_context}; create the engine with a larger max_context"
            )
        if self.padded is not None:
            return self.padded.forward(token_ids, positions, tree_mask, last_n)
        pos = (
            torch.arange(start, start + n, device=self.device)
            if positions is None
            else torch.tensor(positions, device=self.device)
        )
        cos, sin = self.rope(pos)
        mask = self.attention_mask(pos, start, tree_mask)
        h = self.embed(token_ids)
        for i, layer in enumerate(self.decoder.model.layers):
            h = layer(h, cos, sin, self.cache, i, start, mask)
        self.cache.length = start + n
        return self.logits(h if last_n is None else h[-last_n:])
