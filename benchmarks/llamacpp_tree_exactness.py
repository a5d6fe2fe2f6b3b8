"""Can llama.cpp verify a token tree exactly? The evidence behind the llamacpp backend refusing `tree`.

    python benchmarks/llamacpp_tree_exactness.py [--model Qwen/Qwen2.5-Coder-1.5B-Instruct] [--threads 2]

A tree goes through llama.cpp with sequence ids: every node's token carries the id of every branch (leaf) through
it, so a node attends to its ancestors only (llama.cpp masks KV cells by the query's first sequence id and by
position). The script compares, bitwise, with what `ar` computes one token at a time:

1. the logits of the nodes of branch A, from ONE forward of a two-branch tree (A and B interleaved in the batch,
   so A's cells are not contiguous);
2. the logits of the next tokens decoded one at a time after branch B's cells are removed (`seq_rm`), i.e. with
   the accepted branch left where the tree put it, holes between its cells;
3. as 2, with the tree laid out as A's nodes first, then B's: A's cells contiguous, B's removed from the end.

Everything runs in the batch-invariant configuration of the llamacpp backend (repacking off, flash attention
off, GGML_CPU_TILED_MM=0, llamafile off), in which a chain of any width 1..16 is bitwise exact.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from paraspec.models.llamacpp import model as L
from paraspec.models.loader import gguf_source, resolve_checkpoint


def context(path, threads: int, n_seq: int):
    lib = L._llama_cpp()
    mp = lib.llama_model_default_params()
    mp.use_extra_bufts = False
    model = lib.llama_model_load_from_file(str(path).encode(), mp)
    cp = lib.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 1024, 512, 512, n_seq
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = 0
    cp.kv_unified = True
    ctx = lib.llama_init_from_model(model, cp)
    n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    return lib, ctx, n_vocab


def decode(lib, ctx, n_vocab, items):
    """items: (token, position, seq ids, wants logits) per batch row; returns logits of the wanted rows."""
    batch = lib.llama_batch_init(len(items), 0, 4)
    for i, (tok, pos, seqs, want) in enumerate(items):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, len(seqs), want
        for j, s in enumerate(seqs):
            batch.seq_id[i][j] = s
    batch.n_tokens = len(items)
    assert lib.llama_decode(ctx, batch) == 0
    n_out = sum(1 for it in items if it[3])
    out = torch.from_numpy(np.ctypeslib.as_array(lib.llama_get_logits(ctx), shape=(n_out, n_vocab)).copy())
    lib.llama_batch_free(batch)
    return out


def prefill(lib, ctx, n_vocab, ids, seqs):
    lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
    decode(lib, ctx, n_vocab, [(t, i, seqs, i == len(ids) - 1) for i, t in enumerate(ids)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=200)
    ap.add_argument("--depth", type=int, default=4)
    args = ap.parse_args()
    path = (
        gguf_source(resolve_checkpoint(args.model, backend="llamacpp"))
        if not args.model.endswith(".gguf")
        else Path(args.model)
    )
    lib, ctx, n_vocab = context(path, args.threads, n_seq=2)
    mem = lib.llama_get_memory(ctx)
    rng = np.random.default_rng(0)
    P, d = args.prefix, args.depth
    ids = rng.integers(0, n_vocab, size=P).tolist()
    branch_a = rng.integers(0, n_vocab, size=d).tolist()
    branch_b = [branch_a[0]] + rng.integers(0, n_vocab, size=d - 1).tolist()  # shares the root with A
    after = rng.integers(0, n_vocab, size=4).tolist()  # tokens decoded afterwards

    # reference: ar, one token at a time along A, then the tokens after
    prefill(lib, ctx, n_vocab, ids, [0])
    ref = torch.cat([decode(lib, ctx, n_vocab, [(t, P + i, [0], True)]) for i, t in enumerate(branch_a + after)])

    def tree(layout: str):
        prefill(lib, ctx, n_vocab, ids, [0, 1])
        # root shared by both branches (seq 0 = A, seq 1 = B), then A's and B's own nodes
        rows = [(branch_a[0], P, [0, 1], True)]
        a_rows = [(branch_a[i], P + i, [0], True) for i in range(1, d)]
        b_rows = [(branch_b[i], P + i, [1], False) for i in range(1, d)]
        rows += [r for pair in zip(a_rows, b_rows) for r in pair] if layout == "interleaved" else a_rows + b_rows
        logits = decode(lib, ctx, n_vocab, rows)
        tree_a = logits  # root + A's nodes, in order (B's rows have no logits)
        lib.llama_memory_seq_rm(mem, 1, -1, -1)  # reject branch B
        later = torch.cat([decode(lib, ctx, n_vocab, [(t, P + d + i, [0], True)]) for i, t in enumerate(after)])
        return tree_a, later

    print(f"{path.name}, {args.threads} thread(s), prefix {P}, two branches of depth {d}")
    for layout in ("interleaved", "a-first"):
        tree_a, later = tree(layout)
        diff_tree = float((tree_a - ref[:d]).abs().max())
        diff_later = float((later - ref[d:]).abs().max())
        print(
            f"  {layout:12s} tree forward vs ar: max |diff| {diff_tree:.4g} "
            f"({'bitwise' if diff_tree == 0 else 'NOT exact'}); tokens decoded after: max |diff| "
            f"{diff_later:.4g} ({'bitwise' if diff_later == 0 else 'NOT exact'})"
        )
    lib.llama_free(ctx)


if __name__ == "__main__":
    main()
