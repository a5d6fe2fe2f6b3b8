"""What a shared forward costs: one llama_decode of B sequences' next token (B = 1..8, each sequence at its own
context) against B one-token forwards of a sequence alone, on the same multi-sequence context.

    python benchmarks/batch_rows_cost.py [--target Qwen/Qwen2.5-Coder-1.5B-Instruct] [--threads 2] [--repeats 20]

Prints ms per forward and the ratio to B forwards alone: batching requests pays where the ratio is below 1.
Interleaved: every repeat times each B once, in turn.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--context", type=int, default=200, help="tokens each sequence holds before the timed forwards")
    args = ap.parse_args(argv)

    import numpy as np

    from paraspec.models.llamacpp.model import LlamaCppModel
    from paraspec.models.loader import gguf_source, resolve_checkpoint

    path = gguf_source(resolve_checkpoint(args.target, backend="llamacpp"))
    model = LlamaCppModel(path, 2048, (), n_threads=args.threads, n_seqs=args.seqs)
    rng = np.random.default_rng(0)
    for sequence_id in range(args.seqs):
        model.prefill(rng.integers(0, model.vocab_size, size=args.context + 7 * sequence_id).tolist(), sequence_id)
    base = [model.sequence(s).length for s in range(args.seqs)]
    times = {b: [] for b in range(1, args.seqs + 1)}
    for _ in range(args.repeats):
        for b in times:
            start = time.perf_counter()
            model.forward_batch([(s, [int(rng.integers(0, model.vocab_size))], 1) for s in range(b)])
            times[b].append(time.perf_counter() - start)
            for s in range(b):
                model.rollback(base[s], s)
    one = statistics.median(times[1])
    print(f"{path.name}, {args.threads} thread(s), {model.kernels} kernels, batch_exact={model.batch_exact}")
    print("| rows (sequences) | ms per forward | vs that many one-token forwards |")
    print("|---:|---:|---:|")
    for b, ts in times.items():
        ms = statistics.median(ts) * 1000
        print(f"| {b} | {ms:.1f} | {ms / (b * one * 1000):.2f} |")
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
