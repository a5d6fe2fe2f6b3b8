"""Which CPU kernel the native decoder's linear layers use.

`F.linear` on CPU calls MKL's sgemm. On an AVX2 CPU a product with a few rows -- a verification chunk of k+1
tokens -- can cost several times a one-row product there, and two threads barely help, while oneDNN's inner
product on the very same weight tensor (plain layout, no copy) is faster for a few rows, more so on two threads
(`python benchmarks/linear_kernels.py` times one layer's four projections both ways; the end-to-end
gain is in docs/results/).
Speculative decoding lives on that ratio, so `Linear` sends fp32 CPU products to oneDNN where it wins and to
`F.linear` elsewhere:

    PARASPEC_MATMUL=auto     (default) oneDNN for fp32 on CPU with more than one row, or with several threads;
                             F.linear for one row on one thread, for other dtypes, devices and under autograd
    PARASPEC_MATMUL=torch    always F.linear (the before/after baseline of the benchmarks)
    PARASPEC_MATMUL=onednn   oneDNN wherever it applies (fp32 CPU, no autograd)

oneDNN is probed once with a tiny product; if this torch build or CPU lacks it, F.linear is used throughout.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("auto", "torch", "onednn")


def matmul_mode() -> str:
    mode = os.environ.get("PARASPEC_MATMUL", "auto")
    if mode not in MODES:
        raise ValueError(f"PARASPEC_MATMUL={mode!r}: use one of {', '.join(MODES)}")
    return mode


@lru_cache(maxsize=1)
def onednn_available() -> bool:
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.inference_mode():
            x, w, b = torch.ones(2, 4), torch.ones(3, 4), torch.ones(3)
            return bool(torch.equal(op(x, w, b, "none", [], ""), F.linear(x, w, b)))
    except (RuntimeError, TypeError):
        return False


def use_onednn(x: torch.Tensor, weight: torch.Tensor, mode: str | None = None) -> bool:
    mode = mode or matmul_mode()
    if mode == "torch" or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
        return False
    if not onednn_available():
        return False
    return mode == "onednn" or x.numel() > x.shape[-1] or torch.get_num_threads() > 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # under torch.compile (the padded step's compile_step) the compiler picks the product's kernel itself
    if torch.compiler.is_compiling() or not use_onednn(x, weight):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) whose product goes through `linear` above. Its weights
    are not initialised: a decoder is built on the meta device and given a checkpoint's weights (or random ones,
    shapes.random_decoder), and nn.Linear's init there would only cost the first load of each process the import
    of torch's compiler (seconds: every worker process loads a model)."""

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
