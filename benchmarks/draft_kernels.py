"""What a draft model's prompt and steps cost on llama.cpp, by configuration, beside llama.cpp's own figure.

    python benchmarks/draft_kernels.py [--threads 2] [--prompt-tokens 64 157 400] [--rounds 3] [--no-peer]
                                       [--out TABLE.md]

The reference draft (Qwen2.5-Coder-0.5B Q4_K_M), as given and with its Q5_0 matrices as Q8_0 (models/llamacpp/widen.py),
on paraspec's contexts (LlamaCppModel), the same prompt token ids, rounds interleaved (the fastest of `--rounds`):
- `exact`: the target's configuration (exact=True: no tinyBLAS, probed widths; what drafts ran before issue 47);
- `draft`: a draft's configuration (exact=False: weight repacking, llamafile's tinyBLAS, flash attention);
- `draft, flash off`: the same with flash attention off (PARASPEC_LLAMACPP_FLASH_ATTN has no say over a draft: this
  row opens the context by hand to show what flash attention is worth).
Each prints the prompt's ms, the one-token step's ms after it, and a 5-token catch-up's ms. Then the target's own
prompt on its exact context (sd's TTFT is the draft's prompt plus the target's), and llama-server's own
`timings.prompt_ms` for the draft file alone (the peer's prompt kernels; `--no-peer` skips it). Quote timings only
from a quiet machine (the load average is printed).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from paraspec.bench.llamacpp_peers import LlamaServer, gguf_file, peer_binaries
from paraspec.models.llamacpp.model import LlamaCppModel, _llama_cpp
from paraspec.models.llamacpp.widen import widened
from paraspec.sampling import SamplingParams

MODELS = {"target": "Qwen/Qwen2.5-Coder-1.5B-Instruct", "draft": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}


def time_model(model: LlamaCppModel, ids: list[int], prompt: int) -> tuple[float, float, float]:
    """(prompt ms, one-token step ms, 5-token forward ms) on `model`."""
    start = time.perf_counter()
    model.prefill(ids[:prompt])
    mid = time.perf_counter()
    model.forward(ids[prompt : prompt + 1])
    step = time.perf_counter()
    model.forward(ids[prompt + 1 : prompt + 6], last_n=5)
    end = time.perf_counter()
    return (mid - start) * 1e3, (step - mid) * 1e3, (end - step) * 1e3


def flash_off(model: LlamaCppModel) -> LlamaCppModel:
    """`model`'s context opened again with flash attention off (the draft's other settings kept)."""
    model.flash_attention = False
    model.close()
    model._open("repacked")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[64, 157, 400])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    args = parser.parse_args()
    lib = _llama_cpp()
    print(f"load average {os.getloadavg()[0]:.2f}; {lib.llama_print_system_info().decode()}")
    draft, target = gguf_file(MODELS["draft"], "draft"), gguf_file(MODELS["target"])
    files = {"as given": draft, "Q5_0 as Q8_0": widened(draft)}
    ctx = max(args.prompt_tokens) + 16
    models = {}
    for label, path in files.items():
        models[f"exact, {label}"] = LlamaCppModel(path, ctx, (), n_threads=args.threads)
        models[f"draft, {label}"] = LlamaCppModel(path, ctx, (), n_threads=args.threads, exact=False)
        models[f"draft flash off, {label}"] = flash_off(
            LlamaCppModel(path, ctx, (), n_threads=args.threads, exact=False)
        )
    models["target (exact)"] = LlamaCppModel(target, ctx, (), n_threads=args.threads)
    for name, m in models.items():
        print(
            f"{name}: kernels {m.kernels}, tinyBLAS {m.tinyblas}, flash attention {m.flash_attention}, "
            f"exact width {m.exact_width}"
        )
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 150_000, size=max(args.prompt_tokens) + 8).tolist()
    best: dict[tuple[str, int], list[float]] = {}
    for m in models.values():  # warm-up: weights paged in
        time_model(m, ids, 16)
    for r in range(args.rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for p in args.prompt_tokens:
            for name in order:
                got = time_model(models[name], ids, p)
                old = best.get((name, p))
                best[(name, p)] = list(got) if old is None else [min(a, b) for a, b in zip(old, got)]
    peer = {}
    if not args.no_peer:
        with LlamaServer(peer_binaries(), draft, args.threads, context=ctx + 16) as server:
            server.complete(ids[:16], SamplingParams(temperature=0.0, max_new_tokens=1))
            for p in args.prompt_tokens:
                runs = [
                    server.complete(ids[:p], SamplingParams(temperature=0.0, max_new_tokens=1))[0]["timings"][
                        "prompt_ms"
                    ]
                    for _ in range(args.rounds)
                ]
                peer[p] = min(runs)
    lines = [
        f"{args.threads} thread(s), fastest of {args.rounds} rounds, ms: prompt / one-token step / 5-token forward",
        "",
        "| configuration | " + " | ".join(f"P={p}" for p in args.prompt_tokens) + " |",
        "|---|" + "---|" * len(args.prompt_tokens),
    ]
    for name in models:
        cells = [
            f"{best[(name, p)][0]:.0f} / {best[(name, p)][1]:.1f} / {best[(name, p)][2]:.1f}"
            for p in args.prompt_tokens
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if peer:
        lines.append(
            "| llama-server, draft file (timings.prompt_ms) | "
            + " | ".join(f"{peer[p]:.0f}" for p in args.prompt_tokens)
            + " |"
        )
    lines.append(f"\nload average {os.getloadavg()[0]:.2f}")
    print("\n" + "\n".join(lines))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    for m in models.values():
        m.close()


if __name__ == "__main__":
    main()
