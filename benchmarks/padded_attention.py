"""The padded step's attention over the whole cache (models/native/decoder.py `over_whole_cache`), by SDPA call form.

The padded step attends W query rows (times G query heads per KV head) over every cache slot under an additive
mask. The profile of one step on an H100 (`gpu_check --sections profile`) put its attention on torch's math path:
fp32 copies of K and V every layer, a bmm with two batches over 2048 slots, the safe softmax's extra passes. This
times the call forms on one device and checks the property the padded step needs from whichever is used: a query
row's output bits depend on that row (its query and mask row) alone, not on the other rows or its own position.

    3d            q [KV, G*W, D], k/v [KV, slots, D], mask [G*W, slots]: the form used before (math path)
    4d            the same tensors as [1, KV, G*W, D] / [1, 1, G*W, slots]: what the fused kernels take
    4d-<backend>  4d with SDPA limited to one backend (efficient, cudnn, math)

    python benchmarks/padded_attention.py [--device cuda:0] [--slots 2048] [--width 8] [--repeats 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {
    "qwen2.5-0.5b": (14, 2, 64),
    "qwen2.5-1.5b": (12, 2, 128),
    "llama-3.2-1b": (32, 8, 64),
    "llama-3.1-8b": (32, 8, 128),
}  # (query heads, KV heads, head dim)
BACKENDS = {
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
}


def forms(device: torch.device) -> dict:
    def three_d(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def four_d(q, k, v, mask):
        return F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask.view(1, 1, *mask.shape)
        ).squeeze(0)

    out = {"3d": three_d, "4d": four_d}
    names = ("efficient", "cudnn", "math") if device.type == "cuda" else ("flash", "math")
    for name in names:

        def limited(q, k, v, mask, backend=BACKENDS[name]):
            with sdpa_kernel([backend]):
                return four_d(q, k, v, mask)

        out[f"4d-{name}"] = limited
    return out


def inputs(H: int, KV: int, D: int, W: int, slots: int, device, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    G = H // KV
    q = torch.randn(KV, G * W, D, generator=g).to(device, dtype)
    k = torch.randn(KV, slots, D, generator=g).to(device, dtype)
    v = torch.randn(KV, slots, D, generator=g).to(device, dtype)
    visible = torch.zeros(W, slots, dtype=torch.bool)
    for row in range(W):  # a chain at slots 300..: row r sees slots 0..300+r
        visible[row, : 301 + row] = True
    bias = torch.zeros(W, slots, dtype=dtype).masked_fill_(~visible, float("-inf")).to(device)
    return q, k, v, bias.repeat(G, 1)


def time_ms(fn, args, repeats: int, device) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn(*args)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(*args)
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def graph_ms(fn, args, repeats: int, device) -> float | None:
    """One call captured in a CUDA graph and replayed: the kernels' cost without Python's launches."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    return time_ms(graph.replay, (), repeats, device)


def rows_independent(fn, q, k, v, mask, W: int) -> bool:
    """Row r's output is the same bits when the other rows change (new queries, other masks) and when the rows are
    reversed (so every row sits at another position): per query head group of W rows."""
    KV, R, D = q.shape
    G = R // W
    base = fn(q, k, v, mask)
    order = torch.arange(R, device=q.device).view(G, W).flip(1).reshape(-1)  # reverse the W rows of each head
    flipped = fn(q[:, order], k, v, mask[order])
    if not torch.equal(flipped[:, order], base):
        return False
    other = q.clone()
    other[:, 1:] = torch.randn_like(other[:, 1:])  # every row of each KV head changes but its first
    other_mask = mask.clone()
    other_mask[1:] = mask[0]
    changed = fn(other, k, v, other_mask)
    return torch.equal(changed[:, 0], base[:, 0])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--slots", type=int, default=2048)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    results = []
    print(f"{'shape':14s} {'form':14s} {'eager ms':>9s} {'graph ms':>9s} {'rows independent':>17s} {'= 3d':>6s}")
    calls = forms(device)
    with torch.inference_mode():
        for shape, (H, KV, D) in SHAPES.items():
            q, k, v, mask = inputs(H, KV, D, args.width, args.slots, device, dtype)
            reference = calls["3d"](q, k, v, mask).float()
            for name, fn in calls.items():
                row = dict(shape=shape, form=name)
                try:
                    out = fn(q, k, v, mask)
                    row.update(
                        eager_ms=time_ms(fn, (q, k, v, mask), args.repeats, device),
                        graph_ms=graph_ms(fn, (q, k, v, mask), args.repeats, device),
                        rows_independent=rows_independent(fn, q, k, v, mask, args.width),
                        max_diff_vs_3d=float((out.float() - reference).abs().max()),
                    )
                except Exception as error:  # a backend that refuses these inputs says why
                    row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
                results.append(row)
                if "error" in row:
                    print(f"{shape:14s} {name:14s} {row['error']}")
                else:
                    graph = "-" if row["graph_ms"] is None else f"{row['graph_ms']:.4f}"
                    print(
                        f"{shape:14s} {name:14s} {row['eager_ms']:9.4f} {graph:>9s} "
                        f"{str(row['rows_independent']):>17s} {row['max_diff_vs_3d']:6.0e}",
                        flush=True,
                    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(settings=vars(args), torch=torch.__version__, results=results), f, indent=2)


if __name__ == "__main__":
    main()
