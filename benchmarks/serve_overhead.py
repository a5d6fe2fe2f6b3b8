"""One caller, three paths to the same forwards: an in-process `Engine` (its Scheduler, as `paraspec serve` builds
it), `paraspec serve` through the official `openai` client, and llama-server on the same GGUF file (issue 48: is a
one-caller gap in the HTTP path or in the forwards?).

    python benchmarks/serve_overhead.py [--prompts 4] [--max-tokens 64] [--rounds 3] [--dataset humaneval]

`ar` on llama.cpp, 2 threads, greedy, chat-templated token ids; the Engine streams as the server does. Each round runs
the prompts through every path in turn, the order rotating; printed: each round's median TTFT and TPOT per path,
then their medians over the rounds. The server's own TTFT (its Prometheus histogram) beside the client's says how
much of a gap is the HTTP stack. Quote it from a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.serve_concurrency import TARGET, ParaspecServer, PeerServer, prompts_of, run_level  # noqa: E402
from paraspec import Engine, SamplingParams  # noqa: E402


def histogram_totals(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of one of the server's Prometheus histograms."""
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    total = sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"paraspec:{name}_sum"))
    count = sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"paraspec:{name}_count"))
    return total, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from paraspec.bench.llamacpp_peers import gguf_file, peer_binaries

    prompts = prompts_of(args.dataset, args.prompts, TARGET)
    flags = ["--target", TARGET, "--backend", "llamacpp", "--max-context", "2048", "--max-num-seqs", "8"]
    log = ROOT / "out" / "serve_overhead-serve.log"
    serve = ParaspecServer("paraspec ar", flags + ["--strategy", "ar"], args.threads, log)
    peer = PeerServer("llama-server", peer_binaries(), gguf_file(TARGET), args.threads, None, 2048)
    engine = Engine(TARGET, strategy="ar", backend="llamacpp", max_num_seqs=8, max_context=2048)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_tokens)

    def through_engine() -> list[dict]:
        answers = []
        for ids in prompts:
            start, first, n = time.perf_counter(), None, 0
            for _ in engine.stream(ids, params):
                first, n = first or time.perf_counter(), n + 1
            end = time.perf_counter()
            first = first or end
            answers.append({"ttft_s": first - start, "tpot_ms": (end - first) * 1000 / max(n - 1, 1)})
        return answers

    try:
        for server in (serve, peer):  # warm-up
            run_level(server.url, prompts[:1], 1, 8, server.extra)
        through_engine()
        paths = [("Engine", None), ("paraspec serve", serve), ("llama-server", peer)]
        rows: dict[str, list[tuple[float, float]]] = {}
        server_ttft: list[float] = []
        for rnd in range(args.rounds):
            for name, server in paths[rnd % 3 :] + paths[: rnd % 3]:
                if server is serve:
                    before = histogram_totals(serve.server.url, "time_to_first_token_seconds")
                if server is None:
                    answers = through_engine()
                else:  # llama-server without its prompt cache (paraspec keeps none)
                    answers = run_level(server.url, prompts, 1, args.max_tokens, server.extra)[0]
                if server is serve:
                    after = histogram_totals(serve.server.url, "time_to_first_token_seconds")
                    server_ttft.append((after[0] - before[0]) / max(after[1] - before[1], 1))
                ttfts, tpots = [a["ttft_s"] for a in answers], [a["tpot_ms"] for a in answers]
                row = (statistics.median(ttfts), statistics.median(tpots))
                rows.setdefault(name, []).append(row)
                print(f"round {rnd}: {name}: TTFT {row[0]:.3f} s, TPOT {row[1]:.2f} ms", flush=True)
        print("| path | TTFT s (median) | TPOT ms (median) |\n|---|---:|---:|")
        for name, values in rows.items():
            ttft = statistics.median(v[0] for v in values)
            tpot = statistics.median(v[1] for v in values)
            print(f"| {name} | {ttft:.3f} | {tpot:.2f} |")
        print(f"paraspec serve's own TTFT (its histogram, mean per round): {[round(t, 3) for t in server_ttft]}")
    finally:
        engine.close()
        serve.close()
        peer.close()


if __name__ == "__main__":
    main()
