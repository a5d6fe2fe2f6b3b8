"""One-token decoding speed of several llama-cpp-python builds, interleaved: does a kernel patch cost decode time?

    python benchmarks/llamacpp_build_decode.py --lib unpatched=/tmp/unpatched-site --lib patched=/tmp/new-site

Each `--lib NAME=DIR` is a folder holding a llama_cpp package (e.g. `pip install --no-deps --target DIR WHEEL`, a
wheel from ~/.cache/paraspec/llamacpp/). Every round runs each build in its own process (the order rotating): a
bare loop over llama-cpp-python's `Llama` with its default options and the given threads, a random prompt, then
--tokens one-token `eval`s with an argmax, --repeats times. Printed: each build's median and best ms/token over all
repeats of all rounds. Quote it only from a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
import llama_cpp
model, threads, tokens, repeats = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = llama_cpp.Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)
n_vocab = llm.n_vocab()
prompt = np.random.default_rng(0).integers(1000, 100000, 300).tolist()
out = []
for _ in range(repeats):
    llm.reset()
    llm.eval(prompt)
    token, start = 0, time.perf_counter()
    for _ in range(tokens):
        llm.eval([token])
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,))
        token = int(logits.argmax())
    out.append((time.perf_counter() - start) / tokens * 1e3)
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", action="append", required=True, help="NAME=DIR: a folder holding a llama_cpp package")
    ap.add_argument("--model", default="Qwen/Qwen2.5-Coder-1.5B-Instruct", help="a .gguf file or a fetched hub id")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    libs = dict(item.split("=", 1) for item in args.lib)
    model = args.model
    if not model.endswith(".gguf"):
        from paraspec.models.loader import gguf_source, resolve_checkpoint

        model = str(gguf_source(resolve_checkpoint(model, backend="llamacpp")))
    names = list(libs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            proc = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    CHILD,
                    libs[name],
                    model,
                    str(args.threads),
                    str(args.tokens),
                    str(args.repeats),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            times[name] += json.loads(proc.stdout.strip().splitlines()[-1])
            print(
                f"round {r + 1}/{args.rounds} {name}: " + " ".join(f"{t:.2f}" for t in times[name][-args.repeats :]),
                file=sys.stderr,
            )
    print(
        f"one-token decode, {args.threads} thread(s), {args.tokens} tokens after a 300-token prompt, "
        f"{args.rounds} rounds x {args.repeats} repeats, builds interleaved"
    )
    print("| build | median ms/token | best ms/token |")
    print("|---|---|---|")
    for name in names:
        print(f"| {name} ({libs[name]}) | {statistics.median(times[name]):.2f} | {min(times[name]):.2f} |")


if __name__ == "__main__":
    main()
