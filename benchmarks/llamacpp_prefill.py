"""Where a prompt's prefill (TTFT) goes on llama.cpp's kernels, and whether flash attention would be exact there.

    python benchmarks/llamacpp_prefill.py [--model target|draft|PATH.gguf] [--threads 2] [--prompt-tokens 400 1000]
                                          [--rounds 5]

One model file, weight repacking on (llama.cpp's default kernels: AMX on CPUs that have it), contexts that differ
in one setting each, the same prompt token ids, interleaved rounds (median ms):
- `paraspec`: flash attention off, n_batch = n_ubatch = 512 (LlamaCppModel's context);
- `flash`: flash attention on, the same batches (llama-server's default is flash attention auto = on on CPU);
- `flash, ubatch 512 / batch 2048`: llama-server's batch sizes as well.
Then the check that decides whether a flash-attention prefill could serve every strategy: a prefill must give the
same KV cache (and so the same logits for the tokens decoded after it) at 1 and at 2 threads, because amusd's and
dsi's targets run on one core while `ar` runs on two, and every strategy must return `ar`'s tokens. Printed: the
largest difference of the logits of 8 tokens decoded one at a time after the prompt, 1 thread vs 2, per setting.
Quote timings only from a quiet machine (the load average is printed).

    python benchmarks/llamacpp_prefill.py --compare-models [--prompt-tokens 157]

instead times the draft's and the target's prompts, and a one-token forward after them, on paraspec's own contexts
(LlamaCppModel, repacking on), interleaved, with the draft as given and with its Q5_0 matrices as Q8_0 (what the
Engine runs where its measured verdict says so, models/llamacpp/widen.py): sd's TTFT is the sum of the draft's and
the target's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from paraspec.bench.llamacpp_peers import gguf_file
from paraspec.models.llamacpp.model import _llama_cpp, _llama_decode_many

SETTINGS = {"paraspec": (0, 512, 512), "flash": (1, 512, 512), "flash, ubatch 512 / batch 2048": (1, 2048, 512)}
MODELS = {"target": "Qwen/Qwen2.5-Coder-1.5B-Instruct", "draft": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}


class Context:
    def __init__(self, lib, model, n_ctx: int, flash: int, n_batch: int, n_ubatch: int, threads: int):
        self.lib = lib
        p = lib.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_batch, n_ubatch, 1
        p.n_threads = p.n_threads_batch = threads
        p.flash_attn_type = flash
        p.no_perf = True
        self.ctx = lib.llama_init_from_model(model, p)
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        self.n_batch = n_batch
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))

    def prefill(self, ids: list[int]) -> float:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        for s in range(0, len(ids), self.n_batch):
            chunk = ids[s : s + self.n_batch]
            _llama_decode_many(self.ctx, self.batch, [(0, chunk, s, 1 if s + len(chunk) == len(ids) else 0)])
        return (time.perf_counter() - start) * 1000

    def logits_after(self, ids: list[int], more: list[int]) -> np.ndarray:
        self.prefill(ids)
        rows = []
        for i, t in enumerate(more):
            _llama_decode_many(self.ctx, self.batch, [(0, [t], len(ids) + i, 1)])
            rows.append(np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, -1), (self.n_vocab,)).copy())
        return np.stack(rows)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


def compare_models(args) -> None:
    from paraspec.models.llamacpp.model import LlamaCppModel
    from paraspec.models.llamacpp.widen import widened

    files = {role: gguf_file(name) for role, name in MODELS.items()}
    files["draft, Q5_0 as Q8_0"] = widened(files["draft"])  # what the Engine runs where widening measured faster
    models = {
        role: LlamaCppModel(path, 4096, (), n_threads=args.threads, kernels="repacked", probe=False)
        for role, path in files.items()
    }
    print(f"repacking on, {args.threads} thread(s); load average {os.getloadavg()[0]:.2f}")
    for p in args.prompt_tokens:
        ids = np.random.default_rng(p).integers(0, 150000, size=p).tolist()
        times = {role: [] for role in models}
        for model in models.values():
            model.prefill(ids)  # warm-up
        for _ in range(args.rounds):
            for role, model in models.items():
                start = time.perf_counter()
                model.prefill(ids)
                times[role].append((time.perf_counter() - start) * 1000)
        print(f"{p} prompt tokens: " + ", ".join(f"{role} {statistics.median(t):.0f} ms" for role, t in times.items()))
        steps = {role: [] for role in models}  # then one-token forwards after that prompt
        for _ in range(args.rounds):
            for role, model in models.items():
                model.rollback(p)
                start = time.perf_counter()
                for t in ids[:16]:
                    model.forward([t])
                steps[role].append((time.perf_counter() - start) * 1000 / 16)
        print(
            "  one-token forward after it: "
            + ", ".join(f"{role} {statistics.median(t):.1f} ms" for role, t in steps.items())
        )
    for model in models.values():
        model.close()
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="target")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[400, 1000])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compare-models", action="store_true", help="the draft's prompt against the target's")
    args = ap.parse_args()
    if args.compare_models:
        return compare_models(args)
    lib = _llama_cpp()
    path = gguf_file(MODELS.get(args.model, args.model))
    mp = lib.llama_model_default_params()
    mp.use_extra_bufts = True
    model = lib.llama_model_load_from_file(str(path).encode(), mp)
    print(f"{Path(path).name}, repacking on, {args.threads} thread(s); load average {os.getloadavg()[0]:.2f}")
    rng = np.random.default_rng(0)
    n_ctx = max(args.prompt_tokens) + 64
    contexts = {name: Context(lib, model, n_ctx, *s, args.threads) for name, s in SETTINGS.items()}
    vocab = next(iter(contexts.values())).n_vocab
    print("| prompt tokens | " + " | ".join(contexts) + " |")
    print("|---|" + "---|" * len(contexts))
    for p in args.prompt_tokens:
        ids = rng.integers(0, vocab, size=p).tolist()
        times = {name: [] for name in contexts}
        for ctx in contexts.values():
            ctx.prefill(ids)  # warm-up
        for r in range(args.rounds):
            order = list(contexts)[r % len(contexts) :] + list(contexts)[: r % len(contexts)]
            for name in order:
                times[name].append(contexts[name].prefill(ids))
        print(f"| {p} | " + " | ".join(f"{statistics.median(times[n]):.0f}" for n in contexts) + " |")
    for ctx in contexts.values():
        ctx.close()
    print(f"\n1 thread vs {args.threads}: largest |difference| of the logits of 8 tokens decoded after the prompt")
    for p in args.prompt_tokens:
        ids = rng.integers(0, vocab, size=p + 8).tolist()
        for name, setting in SETTINGS.items():
            got = []
            for threads in (1, args.threads):
                ctx = Context(lib, model, n_ctx, *setting, threads)
                got.append(ctx.logits_after(ids[:p], ids[p:]))
                ctx.close()
            print(f"- P = {p}, {name}: {float(np.abs(got[0] - got[1]).max()):.3g}")
    lib.llama_model_free(model)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
