"""Concurrent first requests on a fresh Engine: each one's TTFT (issue 48's stall).

    python benchmarks/first_requests.py [--callers 4] [--draft suffix] [--max-tokens 32] [--per-sequence-timing]

A fresh Engine (reference target, llama.cpp, `sd` with the adaptive rule, max_num_seqs = callers), then `callers`
HumanEval requests at once from as many threads: prints each request's TTFT and the Engine's start-up seconds.
The rule's forward costs are timed once per model when the Engine starts and shared by its sequences
(Strategy.cost_tables); `--per-sequence-timing` makes every sequence time its own at its first request, as before,
while the other requests wait in the Batcher.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

from paraspec import Engine, SamplingParams
from paraspec.bench.datasets import load_prompts
from paraspec.strategies.base import LocalStrategy

TARGET, DRAFT = "Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--callers", type=int, default=4)
    parser.add_argument("--draft", default="suffix", help="suffix, ngram or model (the 0.5B draft)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--per-sequence-timing", action="store_true")
    args = parser.parse_args()
    if args.per_sequence_timing:
        measure = LocalStrategy.forward_cost

        def own_timing(self, key, model, widths, last_only=False):
            self.cost_tables = {}  # this sequence's own table: timed now, as before
            return measure(self, key, model, widths, last_only)

        LocalStrategy.forward_cost = own_timing
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
        f"{'per-sequence timing' if args.per_sequence_timing else 'shared timing'}: engine built in {built:.1f} s; "
        f"{args.callers} first requests: TTFT " + ", ".join(f"{t:.1f}" for t in ttfts) + f" s; all done in {wall:.1f} s"
    )


if __name__ == "__main__":
    main()
