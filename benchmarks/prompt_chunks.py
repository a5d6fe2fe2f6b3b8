"""What a prompt costs alone when it is decoded in chunks narrow enough to share a step with other requests' rows
(issue 48, item 2), and whether those chunks leave the same KV cache as the prompt decoded whole.

    python benchmarks/prompt_chunks.py [--model target|draft|PATH.gguf] [--threads 2] [--prompt-tokens 150 400]
                                       [--chunks 8 16 32] [--rounds 3]

The model on the Engine's exact configuration (LlamaCppModel: the load-time probe picks the kernels and the exact
width), interleaved rounds (median ms): the prompt as every strategy decodes it now (`prefill`: n_batch chunks on the
prompt kernels), then in chunks of C tokens (C <= the exact width: each chunk a forward of that width, as a chunk
sharing a step would run). Printed per C: ms, the ratio to `prefill`, and the largest difference between the logits
of 8 tokens decoded one at a time after the prompt and after the same prompt decoded one token at a time
(0.0: that chunking leaves the KV cache of one-token forwards, the same whatever shares its steps).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from paraspec.bench.llamacpp_peers import gguf_file

MODELS = {"target": "Qwen/Qwen2.5-Coder-1.5B-Instruct", "draft": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}


def chunked(model, ids: list[int], width: int) -> None:
    """The prompt in forwards of `width` tokens on the exact context (each within the probed widths)."""
    model.rollback(0)
    model.forward(ids[:1])  # one token into the empty cache: a one-token forward, not the prompt path
    for start in range(1, len(ids), width):
        model.forward(ids[start : start + width], last_n=1)


def after(model, more: list[int]) -> torch.Tensor:
    return torch.stack([model.forward([t])[-1] for t in more])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="target")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[150, 400])
    parser.add_argument("--chunks", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from paraspec.models.llamacpp.model import LlamaCppModel

    path = gguf_file(MODELS.get(args.model, args.model))
    model = LlamaCppModel(path, 4096, (), n_threads=args.threads)
    print(
        f"{path.name}: {model.kernels} kernels, exact width {model.exact_width}, flash attention "
        f"{'on' if model.flash_attention else 'off'}, {args.threads} thread(s); load {os.getloadavg()[0]:.2f}"
    )
    widths = [c for c in args.chunks if c <= model.exact_width]
    for p in args.prompt_tokens:
        rng = np.random.default_rng(p)
        ids, more = rng.integers(0, 150000, size=p).tolist(), rng.integers(0, 150000, size=8).tolist()
        model.rollback(0)
        for t in ids:  # the reference: one token at a time
            model.forward([t])
        reference = after(model, more)
        times: dict[str, list[float]] = {"prefill": [], **{f"chunks of {c}": [] for c in widths}}
        diffs: dict[str, float] = {}
        for _ in range(args.rounds):
            start = time.perf_counter()
            model.prefill(ids)
            times["prefill"].append((time.perf_counter() - start) * 1000)
            diffs["prefill"] = float((after(model, more) - reference).abs().max())
            for c in widths:
                start = time.perf_counter()
                chunked(model, ids, c)
                times[f"chunks of {c}"].append((time.perf_counter() - start) * 1000)
                diffs[f"chunks of {c}"] = float((after(model, more) - reference).abs().max())
        whole = statistics.median(times["prefill"])
        print(f"{p} prompt tokens:")
        for name, t in times.items():
            ms = statistics.median(t)
            print(f"  {name:>14}: {ms:7.0f} ms ({ms / whole:.2f}x), logits vs one-token prefill: {diffs[name]:.3g}")
    model.close()


if __name__ == "__main__":
    main()
