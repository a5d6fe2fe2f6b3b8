"""What a llama.cpp forward costs when several threads of the process have started OpenMP work, with every
llama_decode run by one thread (models/llamacpp/native_thread.py) and without (PARASPEC_LLAMACPP_ONE_THREAD=0).

    python benchmarks/openmp_pools.py [--model Qwen/Qwen2.5-Coder-1.5B-Instruct] [--rounds 3] [--forwards 25]

libgomp keeps a pool of worker threads for each thread that starts a parallel region (llama.cpp's forwards and
torch's ops share torch's libgomp) and throttles every pool once they hold more threads than the process has
cores: the barriers inside a forward then sleep instead of spinning. Each scenario runs in a fresh process (the
pools are process state), on the Engine's configuration of the model (4 sequences, repacked kernels, torch's
thread count), and times one-token forwards after a 160-token prompt (median ms):
- `alone`: the main thread runs every forward (a script calling a model);
- `scheduler`: the main thread runs a few, then a second, long-lived thread runs the timed ones (an Engine: its
  set-up thread times the drafts' costs, its Scheduler runs the steps);
- `sampling threads`: a long-lived thread runs the forwards while four other live threads have run torch ops on
  a vocabulary-sized vector (a server's request threads, sampling).
Interleaved: every round runs each (scenario, setting) once, in turn.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("alone", "scheduler", "sampling threads")


def child(model_name: str, scenario: str, forwards: int) -> None:
    import threading
    import time

    import torch

    from paraspec.bench.llamacpp_peers import gguf_file
    from paraspec.models.llamacpp.model import LlamaCppModel

    model = LlamaCppModel(gguf_file(model_name), 4096, (), n_seqs=4, probe=False, kernels="repacked")
    prompt = list(range(100, 260))
    model.prefill(prompt, 0)

    def timed() -> float:
        times = []
        for i in range(forwards):
            start = time.perf_counter()
            model.forward_batch([(0, [100 + i], 1)])
            times.append(time.perf_counter() - start)
            model.rollback(len(prompt), 0)
        return 1000 * statistics.median(times)

    def on_live_thread(fn) -> float:
        out: list[float] = []
        release = threading.Event()

        def run():
            out.append(fn())
            release.wait()

        thread = threading.Thread(target=run)
        thread.start()
        while not out:
            time.sleep(0.01)
        release.set()
        thread.join()
        return out[0]

    keep = threading.Event()
    if scenario == "scheduler":
        for i in range(3):
            model.forward_batch([(0, [100 + i], 1)])
            model.rollback(len(prompt), 0)
    elif scenario == "sampling threads":
        logits = torch.randn(model.vocab_size)
        started = []

        def sampler():
            torch.softmax(logits, -1).argmax()
            started.append(1)
            keep.wait()

        for _ in range(4):
            threading.Thread(target=sampler, daemon=True).start()
        while len(started) < 4:
            time.sleep(0.01)
    ms = timed() if scenario == "alone" else on_live_thread(timed)
    keep.set()
    model.close()
    print(f"RESULT {ms:.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--forwards", type=int, default=25)
    ap.add_argument("--child", nargs=2, metavar=("SCENARIO", "FORWARDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.model, args.child[0], int(args.child[1]))
        return 0
    settings = {"one thread": "1", "each caller": "0"}
    times: dict[tuple[str, str], list[float]] = {(s, k): [] for s in SCENARIOS for k in settings}
    for _ in range(args.rounds):
        for scenario in SCENARIOS:
            for setting, flag in settings.items():
                env = dict(os.environ, PARASPEC_LLAMACPP_ONE_THREAD=flag, PYTHONPATH=str(ROOT))
                out = subprocess.run(
                    [sys.executable, __file__, "--model", args.model, "--child", scenario, str(args.forwards)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                times[(scenario, setting)].append(float(out.split("RESULT")[-1]))
    print(f"{args.model}, {os.cpu_count()} cores, median of {args.rounds} rounds (ms per one-token forward)")
    print("| scenario | " + " | ".join(f"llama_decode on {s}" for s in settings) + " |")
    print("|---|" + "---:|" * len(settings))
    for scenario in SCENARIOS:
        cells = [f"{statistics.median(times[(scenario, s)]):.1f}" for s in settings]
        print(f"| {scenario} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
