"""paraspec's llama.cpp forwards beside llama-server's on the same GGUF file (issue 48: is the gap under load in the
forwards or in the schedule?): a prompt's prefill, and one decode step of N requests at once.

    .venv/bin/python benchmarks/server_forwards.py [--prompt-tokens 150 400] [--requests 4] [--steps 40] [--rounds 3]

paraspec: the reference target on the Engine's exact configuration (LlamaCppModel: probed kernels, prompts in
PROMPT_CHUNK forwards; N sequences with a KV cache each). llama-server: its defaults (`-np N`, one unified cache),
2 threads, timings from its own `timings` (prompt_ms; predicted_per_token_ms of N requests sent at once, whose
prompts it decodes together before they decode together). Random prompt ids, interleaved rounds, medians (ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request

import numpy as np

from paraspec.bench.llamacpp_peers import LlamaServer, gguf_file, peer_binaries

TARGET = "Qwen/Qwen2.5-Coder-1.5B-Instruct"


def completion(port: int, ids: list[int], n_predict: int) -> dict:
    body = {"prompt": ids, "n_predict": n_predict, "cache_prompt": False, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request) as answer:
        return json.load(answer)["timings"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[150, 400])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from paraspec.models.llamacpp.model import LlamaCppModel

    path, n = gguf_file(TARGET), args.requests
    model = LlamaCppModel(path, 1024, (), n_threads=args.threads, n_seqs=n)
    print(f"{path.name}: {model.kernels} kernels, flash attention {model.flash_attention}, {args.threads} threads")
    rows: dict[str, list[float]] = {}
    decode_prompts = [np.random.default_rng(s).integers(100, 20000, 150).tolist() for s in range(n)]
    with LlamaServer(peer_binaries(), path, threads=args.threads, slots=n, context=1024) as server:
        for rnd in range(args.rounds):
            for p in args.prompt_tokens:
                ids = np.random.default_rng(p).integers(100, 20000, p).tolist()
                rows.setdefault(f"prompt {p}: llama-server", []).append(completion(server.port, ids, 1)["prompt_ms"])
                start = time.perf_counter()
                model.prefill(ids)
                rows.setdefault(f"prompt {p}: paraspec", []).append((time.perf_counter() - start) * 1000)
            per_token: list[float] = []

            def call(ids: list[int], into: list[float] = per_token) -> None:
                into.append(completion(server.port, ids, args.steps)["predicted_per_token_ms"])

            callers = [threading.Thread(target=call, args=(ids,)) for ids in decode_prompts]
            for caller in callers:
                caller.start()
            for caller in callers:
                caller.join()
            rows.setdefault(f"{n}-request step: llama-server", []).append(statistics.median(per_token))
            for s, ids in enumerate(decode_prompts):
                model.prefill(ids, s)
            start = time.perf_counter()
            for i in range(args.steps):
                model.forward_batch([(s, [100 + i], 1) for s in range(n)])
            rows.setdefault(f"{n}-request step: paraspec", []).append((time.perf_counter() - start) * 1000 / args.steps)
            start = time.perf_counter()
            for i in range(args.steps // 2):
                model.forward_batch([(0, [300 + i], 1)])
            rows.setdefault("1-request step: paraspec", []).append((time.perf_counter() - start) * 2000 / args.steps)
            print(f"round {rnd}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rows.items()), flush=True)
    model.close()
    print("| forward | ms (median) | rounds |\n|---|---:|---|")
    for key, values in rows.items():
        print(f"| {key} | {statistics.median(values):.1f} | {' '.join(f'{v:.0f}' for v in values)} |")


if __name__ == "__main__":
    main()
