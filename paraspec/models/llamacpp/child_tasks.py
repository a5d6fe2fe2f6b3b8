"""llama.cpp work that may kill its process, run in a child: a crash there becomes an error here.

    python -m paraspec.models.llamacpp.child_tasks probe '{"path": ..., "kernels": ..., "n_threads": ..., ...}'
    python -m paraspec.models.llamacpp.child_tasks race '{"files": [...], "n_threads": ..., "prompt_tokens": ..., ...}'
    python -m paraspec.models.llamacpp.child_tasks smoke [--threads 1,2]

- `probe`: the exactness probe (`measure_exact_width`, and `probe_batch` for a context of several
  sequences) of one (model, kernels, threads, context). The first
  probe of a (build, CPU, model) is the first time those kernels run on this CPU, so it runs here, where a native
  crash (SIGILL from an instruction the CPU or VM refuses) cannot take down the caller: a pytest run, a server,
  a notebook. Its verdict is cached by the caller; later loads read the cache and run in-process.
- `race`: a draft's file as given against its widened copy (models/llamacpp/widen.py): a prompt and one-token forwards
  on each, interleaved, the fastest of a few rounds. The widened file is the first Q8_0 product of a draft on this
  CPU, so it runs here for the same reason as the probe.
- `smoke`: after a build, tiny random GGUF files (Q4_K_M, Q4_0, Q8_0: every kind of quantized weight llama.cpp
  moves to its repacked or AMX kernels; Q5_0, which only llamafile's tinyBLAS takes) are loaded with weight
  repacking on, as a target and as a draft (tinyBLAS on), and decoded at widths 1 and 8, at 1 and 2 threads, with
  a bf16 torch matmul (oneDNN, which uses AMX where the CPU has it) between two of the forwards on the same thread.
  scripts/build_llamacpp.py runs it and rebuilds without the instructions that crash.
Each prints one JSON line on success; `crashes.run_child` runs them.
"""

from __future__ import annotations

import itertools
import json
import sys
import tempfile
from pathlib import Path


# -- probe ------------------------------------------------------------------------------------------------
def probe(spec: dict) -> dict:
    from paraspec.models.llamacpp.model import LlamaCppModel, measure_exact_width, probe_batch

    model = LlamaCppModel(
        Path(spec["path"]),
        spec["max_context"],
        (),
        n_threads=spec["n_threads"],
        probe=False,
        kv_f32=spec["kv_f32"],
        fast_prefill=False,
        kernels=spec["kernels"],
        n_seqs=spec.get("n_seqs", 1),
    )
    try:
        width, rows = measure_exact_width(model)
        if model.n_seqs > 1:
            model.exact_width = width
            rows += probe_batch(model, width)
    finally:
        model.close()
    return {"exact_width": width, "rows": rows}


# -- race -------------------------------------------------------------------------------------------------
def race(spec: dict) -> dict:
    """For each of `files` (GGUF models with one vocabulary): the seconds of a `prompt_tokens`-token prompt and of one
    one-token forward after it (the mean over `steps`), each the fastest of `rounds` rounds, the files interleaved
    within a round and their order alternating between rounds (a machine that slows down in the middle slows
    both)."""
    import time

    import numpy as np

    from paraspec.models.llamacpp.model import LlamaCppModel

    p, steps = spec["prompt_tokens"], spec["steps"]
    # as drafts run: llama.cpp's fastest kernels (LlamaCppModel's exact=False)
    models = [
        LlamaCppModel(Path(f), p + steps + 8, (), n_threads=spec["n_threads"], exact=False) for f in spec["files"]
    ]
    try:
        vocab = min(m.vocab_size for m in models)
        ids = np.random.default_rng(0).integers(0, vocab, size=p + steps).tolist()
        prompt_s = [float("inf")] * len(models)
        step_s = [float("inf")] * len(models)
        for m in models:  # warm-up: weights paged in, buffers allocated
            m.prefill(ids[:p])
            m.forward(ids[p : p + 1])
        for r in range(spec["rounds"]):
            order = range(len(models)) if r % 2 == 0 else reversed(range(len(models)))
            for i in order:
                m = models[i]
                start = time.perf_counter()
                m.prefill(ids[:p])
                middle = time.perf_counter()
                for t in ids[p:]:
                    m.forward([t])
                end = time.perf_counter()
                prompt_s[i] = min(prompt_s[i], middle - start)
                step_s[i] = min(step_s[i], (end - middle) / steps)
    finally:
        for m in models:
            m.close()
    return {"prompt_s": prompt_s, "step_s": step_s}


# -- smoke ------------------------------------------------------------------------------------------------
SMOKE_KINDS = ("Q4_K_M", "Q4_0", "Q8_0", "Q5_0")
# shapes llama.cpp's AMX and repacked kernels take (rows a multiple of 32, K-quant rows of 256 values)
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 512, 4, 2, 288, 2


def gpt2_byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies are spelled in), printable bytes
    first (the tests' tiny vocabularies take their token order from it)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in bs]
    return dict(zip(bs + extra, map(chr, bs + [256 + n for n in range(len(extra))])))


def write_random_gguf(path: Path, seed: int = 0) -> Path:
    """A random 2-layer llama-architecture model in f32 with a byte-level vocabulary of VOCAB tokens."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = list(gpt2_byte_spelling().values()) + ["Ġt"] + [f"<|special{i}|>" for i in range(VOCAB - 257)]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("paraspec smoke model")
    w.add_block_count(LAYERS)
    w.add_context_length(1024)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3] * (VOCAB - 257))
    w.add_token_merges(["Ġ t"])  # llama.cpp wants at least one
    w.add_bos_token_id(257)
    w.add_eos_token_id(258)

    def matrix(rows: int, cols: int):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    kv = HIDDEN // HEADS * KV_HEADS
    w.add_tensor("token_embd.weight", matrix(VOCAB, HIDDEN))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    w.add_tensor("output.weight", matrix(VOCAB, HIDDEN))
    for i in range(LAYERS):
        for name, shape in (
            ("attn_q", (HIDDEN, HIDDEN)),
            ("attn_k", (kv, HIDDEN)),
            ("attn_v", (kv, HIDDEN)),
            ("attn_output", (HIDDEN, HIDDEN)),
            ("ffn_gate", (FFN, HIDDEN)),
            ("ffn_up", (FFN, HIDDEN)),
            ("ffn_down", (HIDDEN, FFN)),
        ):
            w.add_tensor(f"blk.{i}.{name}.weight", matrix(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantize(src: Path, dst: Path, kind: str) -> Path:
    """`src` quantized by llama.cpp's own quantizer to `kind` (Q4_K_M: llama.cpp's mix of Q4_K and Q6_K)."""
    from paraspec.models.llamacpp.model import _llama_cpp

    lib = _llama_cpp()
    params = lib.llama_model_quantize_default_params()
    params.ftype = {
        "Q4_K_M": lib.LLAMA_FTYPE_MOSTLY_Q4_K_M,
        "Q4_0": lib.LLAMA_FTYPE_MOSTLY_Q4_0,
        "Q8_0": lib.LLAMA_FTYPE_MOSTLY_Q8_0,
        "Q5_0": lib.LLAMA_FTYPE_MOSTLY_Q5_0,
    }[kind]
    params.nthread = 1
    if lib.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {kind}")
    return dst


def smoke(threads: tuple[int, ...] = (1, 2)) -> dict:
    import torch

    from paraspec.models.llamacpp.model import LlamaCppModel

    ran = []
    with tempfile.TemporaryDirectory(prefix="paraspec-smoke-") as tmp:
        f32 = write_random_gguf(Path(tmp) / "f32.gguf")
        for kind in SMOKE_KINDS:
            path = quantize(f32, Path(tmp) / f"{kind}.gguf", kind)
            for n, exact in itertools.product(threads, (True, False)):
                # exact: the target's kernels; else a draft's (llamafile's tinyBLAS too, where the build has it)
                model = LlamaCppModel(
                    path, 256, (), n_threads=n, probe=False, fast_prefill=False, kernels="repacked", exact=exact
                )
                try:
                    ids = [(7 * i + 3) % 256 for i in range(40)]
                    model.prefill(ids[:24])  # a prompt: the multi-row kernels
                    model.forward(ids[24:25])  # width 1: the one-row kernels
                    model.forward(ids[25:33])  # width 8
                    # oneDNN on this thread (AMX on CPUs that have it), then llama.cpp's tiles again
                    x = torch.ones(256, 256, dtype=torch.bfloat16)
                    torch.nn.functional.linear(x, x)
                    logits = model.forward(ids[33:40])
                    if not torch.isfinite(logits).all():
                        raise RuntimeError(f"{kind} at {n} thread(s): non-finite logits")
                finally:
                    model.close()
                ran.append(f"{kind}@{n}t" + ("" if exact else "/draft"))
    return {"ok": True, "ran": ran}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["probe"] and len(argv) == 2:
        answer = probe(json.loads(argv[1]))
    elif argv[:1] == ["race"] and len(argv) == 2:
        answer = race(json.loads(argv[1]))
    elif argv[:1] == ["smoke"]:
        threads: tuple[int, ...] = (1, 2)
        if argv[1:2] == ["--threads"]:
            threads = tuple(int(t) for t in argv[2].split(","))
        answer = smoke(threads)
    else:
        raise SystemExit(__doc__)
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
