"""paraspec `ar` on the llamacpp backend against what a user would run instead, greedy, one interleaved run:

- `paraspec ar`: the Engine, backend llamacpp (its exact kernel configuration: `engine.target.kernels`), 2 threads;
- `bare loop, same config`: what a C program would do on paraspec's own llama.cpp context (same kernels): decode
  one token, argmax over the logits pointer with numpy, repeat. paraspec ar over it is the orchestration's cost
  (the RequestState, the trace, the logits copy into a torch tensor, the stop checks);
- `llama-cpp-python`: a bare loop over llama-cpp-python's `Llama` with its default options (repacking on,
  flash attention off, the tiled matmul as built) except the thread counts and a context large enough, in its
  own process (GGML_CPU_TILED_MM is read once per process, and paraspec sets it): `eval` the prompt, then
  argmax of the last logits and `eval` one token, repeated;
- `llama-server`: llama.cpp's own server (the default build from the same vendored source, `make peer`); the
  last two are the peers: their configuration is llama.cpp's default, not exact (docs/BENCHMARKS.md).

    python benchmarks/llamacpp_ar_peers.py [--threads 2] [--prompts 3] [--tokens 64] [--rounds 3]
    python benchmarks/llamacpp_ar_peers.py --bare-lib /tmp/unpatched-site     # the bare loop on another build

Every variant gets the same prompt token ids and --tokens tokens to make; paraspec and the bare loops do not stop
early, llama-server stops at its end-of-generation tokens (the `tokens = paraspec ar` column shows whether every
variant made the same tokens). Rounds x prompts run the variants in turn, the order rotating, after a warm-up of
each; TPOT = (wall time - TTFT) / (tokens - 1), TTFT for llama-server is its own prompt time. The table gives each
variant's median TPOT and the median over (round, prompt) pairs of paraspec's TPOT over the variant's on the same
pair. The load average is printed at the start and the end: quote the figures only from a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from paraspec import Engine, SamplingParams
from paraspec.bench.datasets import encode_prompt, load_prompts
from paraspec.bench.llamacpp_peers import LlamaServer, gguf_file, peer_binaries, result_from_answer

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[3]) if sys.argv[3] else None
import numpy as np
import llama_cpp
threads = int(sys.argv[2])
llm = llama_cpp.Llama(model_path=sys.argv[1], n_threads=threads, n_threads_batch=threads, n_ctx=4096,
                      verbose=False)
print(json.dumps({"ready": True, "lib": llama_cpp.__file__,
                  "system": llama_cpp.llama_print_system_info().decode(errors="replace")}), flush=True)
n_vocab = llm.n_vocab()


def argmax_last():
    return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,)).argmax())


for line in sys.stdin:
    job = json.loads(line)
    prompt, tokens = job["prompt"], job["tokens"]
    llm.reset()                                   # eval drops the KV cache from n_tokens = 0 on
    start = time.perf_counter()
    llm.eval(prompt)
    out = [argmax_last()]
    ttft = time.perf_counter() - start
    for _ in range(tokens - 1):
        llm.eval([out[-1]])
        out.append(argmax_last())
    total = time.perf_counter() - start
    print(json.dumps({"tokens": out, "ttft": ttft, "total": total}), flush=True)
"""


def same_config_loop(model, prompt: list[int], tokens: int) -> tuple[list[int], float, float]:
    """(tokens, TTFT s, total s) on paraspec's own llama.cpp context: its prefill, then one-token llama_decode
    calls (the backend's own `_llama_decode_many`) and an argmax in numpy, without the Engine around them."""
    from paraspec.models.llamacpp.model import _lib, _llama_decode_many

    def argmax_last() -> int:
        return int(np.ctypeslib.as_array(_lib.llama_get_logits_ith(model._ctx, -1), shape=(model.vocab_size,)).argmax())

    start = time.perf_counter()
    model.prefill(prompt)
    out = [argmax_last()]
    ttft = time.perf_counter() - start
    for pos in range(len(prompt), len(prompt) + tokens - 1):
        _llama_decode_many(model._ctx, model._batch, [(0, out[-1:], pos, 1)])
        out.append(argmax_last())
    return out, ttft, time.perf_counter() - start


class BareLoop:
    """llama-cpp-python's Llama with default options in a child process; `generate` -> (ids, ttft s, total s)."""

    def __init__(self, gguf: Path, threads: int, lib: str | None):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(gguf), str(threads), lib or ""],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"},
        )
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError(f"the llama-cpp-python child exited with status {self.proc.wait()}")
        self.info = json.loads(hello)

    def generate(self, prompt: list[int], tokens: int):
        self.proc.stdin.write(json.dumps({"prompt": prompt, "tokens": tokens}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        return answer["tokens"], answer["ttft"], answer["total"]

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--bare-lib", default=None, help="a folder holding another llama_cpp package for the bare loop")
    ap.add_argument(
        "--flash-off",
        action="store_true",
        help="also paraspec ar with flash attention off (PARASPEC_LLAMACPP_FLASH_ATTN=0), interleaved",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cores = list(range(args.threads))
    gguf = gguf_file(args.model)
    names = ["paraspec ar", "bare loop, same config", "llama-cpp-python", "llama-server"]
    names += ["paraspec ar, flash attention off"] if args.flash_off else []
    rows = {name: [] for name in names}  # (round, prompt) -> (ids, ttft s, tpot s)
    devices = [f"cpu:0-{args.threads - 1}" if args.threads > 1 else "cpu:0"]

    def ar_engine(flash_off: bool) -> Engine:
        """One request at a time (max_num_seqs=1), as every variant here; the switch is read when the model opens."""
        with mock.patch.dict(os.environ, {"PARASPEC_LLAMACPP_FLASH_ATTN": "0"} if flash_off else {}):
            return Engine(args.model, strategy="ar", backend="llamacpp", target_devices=devices, max_num_seqs=1)

    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(ar_engine(False))
        off = stack.enter_context(ar_engine(True)) if args.flash_off else None
        server = stack.enter_context(LlamaServer(peer_binaries(), gguf, args.threads, cores))
        bare = BareLoop(gguf, args.threads, args.bare_lib)
        try:
            prompts = [
                encode_prompt(engine.tokenizer, p.as_input(chat=True)) for p in load_prompts(args.dataset, args.prompts)
            ]
            for e in (engine, off):
                if e is not None:
                    e.target.eos_token_ids = ()  # paraspec does not stop either: --tokens tokens, as the loops

            def run(name, prompt, tokens):
                """(token ids, TTFT s, TPOT s) of one variant on one prompt."""
                params = SamplingParams(max_new_tokens=tokens, stop_token_ids=[])
                if name.startswith("paraspec ar"):
                    r = (off if name.endswith("off") else engine).generate(prompt, params)
                elif name == "llama-server":
                    answer, seconds = server.complete(prompt, params)
                    r = result_from_answer("llamacpp-ar", prompt, params, answer, seconds, 4096)
                else:
                    ids, ttft, total = (
                        bare.generate(prompt, tokens)
                        if name == "llama-cpp-python"
                        else same_config_loop(engine.target, prompt, tokens)
                    )
                    return ids, ttft, (total - ttft) / (len(ids) - 1)
                return r.token_ids, r.stats.ttft_s, r.stats.tpot_ms / 1000

            for name in names:  # warm-up
                run(name, prompts[0], 8)
            load = os.getloadavg()[0]
            for rnd in range(args.rounds):
                for i, prompt in enumerate(prompts):
                    k = (rnd * len(prompts) + i) % len(names)
                    for name in names[k:] + names[:k]:
                        rows[name].append(run(name, prompt, args.tokens))
                        print(
                            f"round {rnd + 1} prompt {i + 1} {name}: TPOT {rows[name][-1][2] * 1000:.2f} ms",
                            file=sys.stderr,
                            flush=True,
                        )
        finally:
            bare.close()
        kernels = f"{engine.target.kernels}, flash attention {'on' if engine.target.flash_attention else 'off'}"
    print(
        f"{args.model} ({gguf.name}), {args.threads} threads, {args.prompts} {args.dataset} prompts x "
        f"{args.tokens} tokens x {args.rounds} rounds, interleaved; paraspec kernels: {kernels}; "
        f"llama-cpp-python from {bare.info['lib']}; load average {load:.2f} at the start (after the warm-up) "
        f"and {os.getloadavg()[0]:.2f} at the end, {os.cpu_count()} CPUs, one variant running at a time"
    )
    ref = [x[0] for x in rows["paraspec ar"]]
    print(
        "| variant | TTFT ms (median) | TPOT ms (median) | paraspec ar TPOT / this (median of pairs) | "
        "tokens = paraspec ar |"
    )
    print("|---|---|---|---|---|")
    for name in names:
        r = rows[name]
        ratio = statistics.median(a[2] / b[2] for a, b in zip(rows["paraspec ar"], r))
        same = sum(a == b[0] for a, b in zip(ref, r))
        print(
            f"| {name} | {statistics.median(x[1] for x in r) * 1000:.1f} | "
            f"{statistics.median(x[2] for x in r) * 1000:.2f} | {ratio:.3f} | {same}/{len(r)} |"
        )


if __name__ == "__main__":
    main()
