"""What the adaptive rule's start-up timing of the forwards sees, and what a step costs, by the thread that times them:
`sd` with the draft model on llama.cpp, one request, on one sequence (no Scheduler: the request's thread runs the
steps) or four (the Scheduler's thread runs them).

    python benchmarks/openmp_pools.py [--rounds 3] [--max-tokens 48] [--max-num-seqs 1 4]

llama.cpp's forwards and torch's operations start an OpenMP pool in each thread that runs them (they share torch's
libgomp), and once a process's pools hold more threads than it has cores libgomp throttles them all: the hundreds
of barriers inside a forward sleep instead of spinning. Each setting runs in a fresh process (the pools are process
state), interleaved over `rounds`:
- `step thread`: timed where the steps run (paraspec's: LocalStrategy.start_steps, Scheduler.call);
- `passing thread`: timed on a thread that ends with the timing (`on_passing_thread` below; paraspec's before
  2026-12-03);
- `set-up thread`: timed on the thread that builds the Engine (before 2026-11-29).
Prints the medians of the timed one-token target and draft forwards (what the rule prices a step by), of the
request's one-token target steps, and the process's thread count after the request.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET, DRAFT = "Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"
SETTINGS = ("step thread", "passing thread", "set-up thread")


def on_passing_thread(fn):
    """fn() on a new thread that has ended when this returns: its OpenMP pool ends with it."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result()


def child(setting: str, max_tokens: int, max_num_seqs: int) -> None:
    import threading
    import time

    from benchmarks.serve_concurrency import prompts_of
    from paraspec import Engine, SamplingParams
    from paraspec.strategies import base

    if setting != "step thread":
        runner = on_passing_thread if setting == "passing thread" else (lambda fn: fn())
        start_steps = base.LocalStrategy.start_steps
        base.LocalStrategy.start_steps = lambda self, call=None: start_steps(self, runner)
    steps: list[float] = []
    prompts = prompts_of("humaneval", 2, TARGET)
    options = dict(strategy="sd", lookahead=5, backend="llamacpp", max_num_seqs=max_num_seqs)
    with Engine(TARGET, DRAFT, **options) as engine:
        target = engine.strategy.target
        forward = target.forward

        def timed_forward(tokens, *args, **kwargs):
            start = time.perf_counter()
            out = forward(tokens, *args, **kwargs)
            if len(tokens) == 1:
                steps.append(time.perf_counter() - start)
            return out

        target.forward = timed_forward  # one sequence: the strategy's own forwards
        if engine.scheduler is not None:
            step = engine.scheduler._step

            def timed_step(asks):
                start = time.perf_counter()
                step(asks)
                if len(asks) == 1 and len(asks[0].tokens) == 1 and asks[0].model is target:
                    steps.append(time.perf_counter() - start)

            engine.scheduler._step = timed_step
        tables = engine.strategy.cost_tables
        timed = 1000 * tables["target"].seconds[1], 1000 * tables["draft0"].seconds[1]
        engine.generate(prompts[0], SamplingParams(max_new_tokens=8))
        steps.clear()
        params = SamplingParams(max_new_tokens=max_tokens)
        request = threading.Thread(target=lambda: engine.generate(prompts[1], params))
        request.start()
        request.join()
        threads = len(os.listdir("/proc/self/task"))
    print(f"RESULT {timed[0]:.3f} {timed[1]:.3f} {1000 * statistics.median(steps or [0.0]):.3f} {threads}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        setting, seqs = args.child.rsplit(":", 1)
        child(setting, args.max_tokens, int(seqs))
        return 0
    # one sequence: the set-up thread is where the steps run (the caller's), the same as `step thread`
    cells = [(s, n) for n in args.max_num_seqs for s in SETTINGS if not (n == 1 and s == "set-up thread")]
    results: dict[tuple, list[list[float]]] = {c: [] for c in cells}
    for _ in range(args.rounds):
        for setting, seqs in cells:
            out = subprocess.run(
                [sys.executable, __file__, "--child", f"{setting}:{seqs}", "--max-tokens", str(args.max_tokens)],
                env=dict(os.environ, PYTHONPATH=str(ROOT)),
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            results[(setting, seqs)].append([float(x) for x in out.split("RESULT")[-1].split()])
    print(f"sd (draft model, adaptive), llama.cpp; {os.cpu_count()} cores; median of {args.rounds} rounds, ms")
    print("| sequences | timed on | timed target step | timed draft step | the request's target steps | threads |")
    print("|---:|---|---:|---:|---:|---:|")
    for setting, seqs in cells:
        med = [statistics.median(col) for col in zip(*results[(setting, seqs)])]
        print(f"| {seqs} | {setting} | {med[0]:.1f} | {med[1]:.1f} | {med[2]:.1f} | {med[3]:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
