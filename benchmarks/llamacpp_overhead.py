"""paraspec's orchestration overhead on the llamacpp backend: `ar` through the Engine vs a bare decode loop.

    python benchmarks/llamacpp_overhead.py [--threads 2] [--prompts 3] [--tokens 64]

Both run the same llama.cpp context configuration (the backend's exact one: no repacking, no flash attention,
GGML_CPU_TILED_MM=0, this llamafile-free build) on the same prompt token ids, greedy, interleaved prompt by
prompt after a warm-up. The bare loop is what a C program would do: llama_decode one token, argmax over the
logits pointer with numpy, repeat. The difference is paraspec's Python: the Run, the trace, the logits copy into
a torch tensor, the stop checks. (Kernel configuration vs llama.cpp's defaults is `paraspec bench`'s
llamacpp-ar column.)
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from paraspec import Engine, SamplingParams
from paraspec.bench.datasets import encode_prompt, load_prompts


def bare_loop(model, prompt: list[int], tokens: int) -> tuple[list[int], float, float]:
    """(tokens, TTFT s, TPOT s): prefill then one-token llama_decode calls, argmax in numpy."""
    from paraspec.models import llamacpp
    lib, ctx, batch, n_vocab = llamacpp._lib, model._ctx, model._batch, model.vocab_size
    start = time.perf_counter()
    model.prefill(prompt)                     # the same chunked prefill
    ptr = lib.llama_get_logits_ith(ctx, -1)
    out = [int(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).argmax())]
    ttft = time.perf_counter() - start
    pos = len(prompt)
    batch.n_tokens = 1
    batch.n_seq_id[0], batch.seq_id[0][0], batch.logits[0] = 1, 0, 1
    for _ in range(tokens - 1):
        batch.token[0], batch.pos[0] = out[-1], pos
        assert lib.llama_decode(ctx, batch) == 0
        pos += 1
        out.append(int(np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).argmax()))
    total = time.perf_counter() - start
    return out, ttft, (total - ttft) / (tokens - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cores = f"cpu:0-{args.threads - 1}" if args.threads > 1 else "cpu:0"
    with Engine(args.model, strategy="ar", backend="llamacpp", target_devices=[cores]) as engine:
        model = engine.target
        prompts = [encode_prompt(engine.tokenizer, p.as_input(chat=True))
                   for p in load_prompts("humaneval", args.prompts)]
        params = SamplingParams(max_new_tokens=args.tokens, stop_token_ids=[])
        engine.generate(prompts[0], SamplingParams(max_new_tokens=8))           # warm-up
        bare_loop(model, prompts[0], 8)
        rows = {"paraspec ar": [], "bare loop": []}
        for i, prompt in enumerate(prompts):
            order = ["paraspec ar", "bare loop"] if i % 2 == 0 else ["bare loop", "paraspec ar"]
            for name in order:
                if name == "bare loop":
                    ids, ttft, tpot = bare_loop(model, prompt, args.tokens)
                else:
                    model.eos_token_ids = ()       # the bare loop does not stop either: same token count
                    r = engine.generate(prompt, params)
                    ids, ttft, tpot = r.token_ids, r.stats.ttft_s, r.stats.tpot_ms / 1000
                rows[name].append((ids, ttft, tpot))
    same = all(a[0] == b[0] for a, b in zip(rows["paraspec ar"], rows["bare loop"]))
    print(f"{args.model}, llamacpp exact configuration, {args.threads} thread(s), {args.prompts} HumanEval prompts "
          f"x {args.tokens} tokens, interleaved; same tokens: {same}")
    print("| loop | TTFT ms (median) | TPOT ms (median) |")
    print("|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {statistics.median(x[1] for x in r) * 1000:.1f} | "
              f"{statistics.median(x[2] for x in r) * 1000:.2f} |")
    ratio = statistics.median(a[2] / b[2] for a, b in zip(rows["paraspec ar"], rows["bare loop"]))
    print(f"paraspec ar / bare loop TPOT: {ratio:.3f}")


if __name__ == "__main__":
    main()
