"""Concurrent first requests on a fresh Engine: each one's TTFT (issue 48's stall).

    python benchmarks/first_requests.py [--callers 4] [--draft suffix] [--max-tokens 32]

A fresh Engine (reference target, llama.cpp, `sd` with the adaptive rule, max_num_seqs = callers), then `callers`
HumanEval requests at once from as many threads: prints each request's TTFT and the Engine's start-up seconds.
The rule's forward costs are timed once per model when the Engine starts and shared by its seats
(LocalStrategy.cost_tables). (Until 2026-11-29 a `--per-sequence-timing` flag replayed the old stall, every
sequence timing its own costs at its first request; with the Scheduler owning every model call that replay would
run forwards outside its steps, so it is gone: docs/results/ keeps the before/after figures.)
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

from paraspec import Engine, SamplingParams
from paraspec.bench.datasets import load_prompts

TARGET, DRAFT = "Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--callers", type=int, default=4)
    parser.add_argument("--draft", default="suffix", help="suffix, ngram or model (the 0.5B draft)")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    draft = DRAFT if args.draft == "model" else args.draft
    prompts = [p.as_input(True) for p in load_prompts("humaneval", args.callers)]
    start = time.perf_counter()
    with Engine(
        TARGET, draft, strategy="sd", adaptive=True, lookahead=8, backend="llamacpp", max_num_seqs=args.callers
    ) as engine:
        built = time.perf_counter() - start
        begin = time.perf_counter()
        with ThreadPoolExecutor(args.callers) as pool:  # every request at once, one thread each
            results = list(
                pool.map(lambda p: engine.generate(p, SamplingParams(max_new_tokens=args.max_tokens)), prompts)
            )
        wall = time.perf_counter() - begin
    ttfts = sorted(r.stats.ttft_s for r in results)
    print(
        f"engine built in {built:.1f} s; "
        f"{args.callers} first requests: TTFT " + ", ".join(f"{t:.1f}" for t in ttfts) + f" s; all done in {wall:.1f} s"
    )


if __name__ == "__main__":
    main()
