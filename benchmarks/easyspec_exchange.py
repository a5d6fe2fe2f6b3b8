"""Latency of one all-gather of attention outputs between two CPU processes: easyspec's shared-memory
exchange vs torch.distributed gloo. A draft forward of the reference 0.5B draft with layer-parallel size 2 makes 11
all-gathers (one per group of two layers).

    python benchmarks/easyspec_exchange.py --iters 2000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import torch

HIDDEN = 896  # Qwen2.5-0.5B


def shm_rank(rank, name, rows, iters, out):
    from paraspec.runtime.exchange import ShmExchange

    os.sched_setaffinity(0, {rank})
    torch.set_num_threads(1)
    ex = ShmExchange.attach(name, rank, 2, rows * HIDDEN * 4)
    x = torch.randn(1, rows, HIDDEN)
    for _ in range(50):
        ex.all_gather(x)
    start = time.perf_counter()
    for _ in range(iters):
        ex.all_gather(x)
    out[rank] = (time.perf_counter() - start) / iters
    ex.segment.close()


def gloo_rank(rank, port, rows, iters, out):
    import torch.distributed as dist

    os.sched_setaffinity(0, {rank})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.randn(1, rows, HIDDEN)
    bufs = [torch.empty_like(x) for _ in range(2)]
    for _ in range(50):
        dist.all_gather(bufs, x)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_gather(bufs, x)
    out[rank] = (time.perf_counter() - start) / iters
    dist.destroy_process_group()


def run(target, args_for_rank):
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    procs = [ctx.Process(target=target, args=(*args_for_rank(r), out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max(out.values())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    args = p.parse_args()
    from paraspec.runtime.exchange import ShmExchange

    print("| rows (tokens) | shared memory (us) | gloo (us) |\n|---|---|---|")
    for i, rows in enumerate(args.rows):
        ex = ShmExchange.create(2, rows * HIDDEN * 4)
        try:
            shm = run(shm_rank, lambda r, name=ex.segment.name, rows=rows: (r, name, rows, args.iters))
        finally:
            ex.close()
        gloo = run(gloo_rank, lambda r, port=29600 + i, rows=rows: (r, port, rows, args.iters))
        print(f"| {rows} | {shm * 1e6:.1f} | {gloo * 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
