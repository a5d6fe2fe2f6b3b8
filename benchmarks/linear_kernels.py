"""Which CPU matmul kernel makes a forward of n tokens cheapest: the cost that decides speculative decoding here.

A verification forward of k+1 tokens must cost little more than a one-token forward for speculation to pay.
On this AVX2 machine `F.linear` (MKL sgemm) costs ~3.5x more for 8 rows than for 1, so this script times the
alternatives on the reference target's weight shapes, per row count n, median of `--repeats`:

    linear      F.linear(x, W)                              (what models/native/decoder.py used)
    t-layout    x @ W_t with W_t = W.t().contiguous()        (weights stored [in, out])
    w-left      (W @ x.t()).t()                              (the big matrix as the left operand)
    mkl-packed  torch.ops.mkl._mkl_linear with a weight packed once by _mkl_reorder_linear_weight
    onednn      torch.ops.mkldnn._linear_pointwise with a weight reordered once for oneDNN

    python benchmarks/linear_kernels.py --threads 1 --rows 1,2,4,6,8,16,24
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# Qwen2.5-Coder-1.5B: hidden 1536, intermediate 8960, q 1536 + k/v 2 x 256
SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (2 * 8960, 1536), "down": (1536, 8960)}


def kernels(weight: torch.Tensor, rows: int) -> dict:
    out = {"linear": lambda x: F.linear(x, weight)}
    w_t = weight.t().contiguous()
    out["t-layout"] = lambda x: x @ w_t
    out["w-left"] = lambda x: (weight @ x.t()).t()
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        out["mkl-packed"] = lambda x: torch.ops.mkl._mkl_linear(x, packed, weight, None, rows)
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        try:
            reordered = (
                torch.ops.mkldnn._reorder_linear_weight(weight, rows)
                if hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                else weight
            )
            out["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, reordered, None, "none", [], "")
        except RuntimeError:
            pass
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,2,4,6,8,16,24")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    print(
        f"{args.threads} thread(s); ms per call for all four projections of one layer (sum), median of {args.repeats}"
    )
    weights = {name: torch.randn(shape) / shape[1] ** 0.5 for name, shape in SHAPES.items()}
    names = None
    with torch.inference_mode():
        for rows in rows_list:
            per_kernel: dict[str, float] = {}
            for name, weight in weights.items():
                x = torch.randn(rows, weight.shape[1])
                reference = F.linear(x, weight)
                for kernel, fn in kernels(weight, rows).items():
                    if (fn(x) - reference).abs().max() > 1e-3:
                        raise AssertionError(f"{kernel} disagrees with F.linear on {name}")
                    times = []
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        fn(x)
                        times.append(time.perf_counter() - start)
                    per_kernel[kernel] = per_kernel.get(kernel, 0.0) + statistics.median(times) * 1000
            if names is None:
                names = list(per_kernel)
                print("rows | " + " | ".join(f"{n:>10}" for n in names))
            print(f"{rows:>4} | " + " | ".join(f"{per_kernel[n]:10.2f}" for n in names), flush=True)


if __name__ == "__main__":
    main()
