"""What a forward costs when a thread that outlives the set-up has run OpenMP work: `sd` with the draft model on
llama.cpp, four sequences (the Scheduler's thread runs every step), one request; its one-token target steps.

    python benchmarks/openmp_pools.py [--rounds 3] [--max-tokens 48]

llama.cpp's forwards and torch's operations start an OpenMP pool in each thread that runs them (they share torch's
libgomp), and once a process's pools hold more threads than it has cores libgomp throttles them all: the hundreds
of barriers inside a forward sleep instead of spinning. The adaptive rule times the models' forwards when the Engine
starts; timed on the set-up thread, that thread keeps a pool for the Engine's life. Each setting runs in a fresh
process (the pools are process state), interleaved over `rounds`:
- `passing thread`: the forwards timed on a thread that ends with them (runtime.devices.on_passing_thread, paraspec's);
- `set-up thread`: timed on the thread that builds the Engine (before).
Prints the median one-token target step (ms) and the process's thread count after the request.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET, DRAFT = "Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"
SETTINGS = ("passing thread", "set-up thread")


def child(setting: str, max_tokens: int) -> None:
    import threading
    import time

    from benchmarks.serve_concurrency import prompts_of
    from paraspec import Engine, SamplingParams
    from paraspec import scheduler as scheduler_module
    from paraspec.strategies import base

    if setting == "set-up thread":
        base.on_passing_thread = lambda fn, *args, **kwargs: fn(*args, **kwargs)
    steps: list[float] = []
    step = scheduler_module.Scheduler._step

    def timed_step(self, asks):
        start = time.perf_counter()
        step(self, asks)
        if len(asks) == 1 and len(asks[0].tokens) == 1 and asks[0].model is self.seats[0].target.model:
            steps.append(time.perf_counter() - start)

    scheduler_module.Scheduler._step = timed_step
    prompts = prompts_of("humaneval", 2, TARGET)
    with Engine(TARGET, DRAFT, strategy="sd", lookahead=5, backend="llamacpp", max_num_seqs=4) as engine:
        engine.generate(prompts[0], SamplingParams(max_new_tokens=8))
        steps.clear()
        request = threading.Thread(
            target=lambda: engine.generate(prompts[1], SamplingParams(max_new_tokens=max_tokens))
        )
        request.start()
        request.join()
        threads = len(os.listdir("/proc/self/task"))
    print(f"RESULT {1000 * statistics.median(steps):.3f} {threads}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.max_tokens)
        return 0
    times: dict[str, list[float]] = {s: [] for s in SETTINGS}
    threads: dict[str, int] = {}
    for _ in range(args.rounds):
        for setting in SETTINGS:
            out = subprocess.run(
                [sys.executable, __file__, "--child", setting, "--max-tokens", str(args.max_tokens)],
                env=dict(os.environ, PYTHONPATH=str(ROOT)),
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            ms, n = out.split("RESULT")[-1].split()
            times[setting].append(float(ms))
            threads[setting] = int(n)
    print(f"sd (draft model, adaptive), llama.cpp, 4 sequences; {os.cpu_count()} cores; median of {args.rounds} rounds")
    print("| forwards timed at start-up on | one-token target step, ms | threads in the process |")
    print("|---|---:|---:|")
    for setting in SETTINGS:
        print(f"| {setting} | {statistics.median(times[setting]):.1f} | {threads[setting]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
