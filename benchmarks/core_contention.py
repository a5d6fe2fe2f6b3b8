"""Do two models on two cores slow each other down? AMUSD's premise is that the draft and the target each run at
full speed on their own device. On a 2-core VM the two cores may share a physical core (SMT siblings on the
host), memory bandwidth and the L3, so a one-thread forward can be slower while the other core is busy.

    python benchmarks/core_contention.py [--seconds 12]

Runs the draft on cpu:0 and the target on cpu:1 (llamacpp backend, one thread each, `ar` decoding, one process
each), first each alone, then both at once, and prints each model's TPOT (ms per decoded token) alone, together,
and the slowdown. Quiet machine only.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

TARGET = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
DRAFT = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def decode_for(model: str, core: int, seconds: float, ready, start, out) -> None:
    """In a child: load `model` on `core`, report ready, wait for the start signal, decode for `seconds`."""
    from paraspec import Engine, SamplingParams

    os.sched_setaffinity(0, {core})
    with Engine(model, strategy="ar", backend="llamacpp", target_devices=[f"cpu:{core}"]) as engine:
        ids = engine.tokenizer.encode(PROMPT)
        engine.generate(ids, SamplingParams(max_new_tokens=4))  # warm-up
        ready.put(model)
        start.wait()
        tpots, deadline = [], time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            result = engine.generate(ids, SamplingParams(max_new_tokens=32, stop_token_ids=[]))
            tpots.append(result.stats.tpot_ms)
        out.put((model, statistics.median(tpots), len(tpots)))


def run(jobs: list[tuple[str, int]], seconds: float) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    ready, start, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=decode_for, args=(m, c, seconds, ready, start, out)) for m, c in jobs]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            ready.get(timeout=300)  # every model loaded and warm: then all start at once
        start.set()
        for _ in procs:
            model, tpot, _n = out.get(timeout=seconds + 120)
            results[model] = tpot
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=12.0)
    args = ap.parse_args()
    alone = {**run([(DRAFT, 0)], args.seconds), **run([(TARGET, 1)], args.seconds)}
    together = run([(DRAFT, 0), (TARGET, 1)], args.seconds)
    print(f"one thread per model, llamacpp backend, {args.seconds:g} s of 32-token decodes each, median TPOT")
    print(f"{'model':<36} {'core':>4} {'alone ms':>9} {'together ms':>11} {'slowdown':>8}")
    for model, core in ((DRAFT, 0), (TARGET, 1)):
        print(
            f"{model:<36} {core:>4} {alone[model]:>9.1f} {together[model]:>11.1f} "
            f"{together[model] / alone[model]:>7.2f}x"
        )


if __name__ == "__main__":
    main()
