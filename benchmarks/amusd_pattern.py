"""AMUSD's Table I pattern (AMUSD faster than SD faster than AR; McDanel 2024: 1.57x and 1.24x over AR on
HumanEval) -- with simulated latencies at the paper's GPU ratios, and on the reference pair on this machine.

  sim   the real Engine, runtime and worker processes with simulated models (sleeps, so 2 cores suffice):
        draft ~10 ms/token and verify ~25 ms/token "when run in a standalone autoregressive setting" (AMUSD paper,
        section IV); on a GPU a verification of a few tokens costs about one forward, so the target's cost is
        constant in the width. Acceptance: SD "accepts 5.35 draft tokens per verify step" (section IV, Fig. 4),
        so a / (1 - a) = 5.35, a = 0.84. SD lookahead 5 and AMUSD max_ahead 16 are paraspec's defaults (the paper
        gives none); AMUSD verifies up to max_ahead drafts per forward (free on a GPU). Prints measured ms/token
        and the event simulator's prediction (`preempt=False`: a forward in flight is finished, as the workers do).
  real  the grid of `paraspec bench` runs on the reference pair (llamacpp and native backends, draft on cpu:0,
        target on cpu:1, one thread each, as AMUSD puts each model on its own device), printed; --run executes
        it. About 10 minutes on a quiet 2-core machine (`--only 3`: just the native backend). Do not run it while
        other jobs load the cores: llama.cpp slows ~10x under contention.

    .venv/bin/python benchmarks/amusd_pattern.py sim --tokens 256 --repeats 5
    .venv/bin/python benchmarks/amusd_pattern.py real            # print the commands
    .venv/bin/python benchmarks/amusd_pattern.py real --run      # run them (quiet machine only)
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys

from dsi_simulated import Case, measure, predict  # noqa: E402 (benchmarks/ is the script's folder)

from paraspec.sim.costs import ForwardCost

AMUSD_DRAFT_S = 0.010  # AMUSD paper, section IV: "the draft model takes ~10 ms/token"
AMUSD_TARGET_S = 0.025  # "... and the verify model takes ~25 ms/token"
AMUSD_ACCEPTANCE = 5.35 / 6.35  # "speculative decoding accepts 5.35 draft tokens per verify step": a/(1-a) = 5.35
AMUSD_PAPER = {"ar": 22.15, "sd": 17.88, "amusd": 14.08}  # Table I, HumanEval, ms/token


def part_sim(tokens: int, repeats: int, scale: float) -> None:
    target = ForwardCost.constant(AMUSD_TARGET_S * scale)
    draft = ForwardCost.constant(AMUSD_DRAFT_S * scale)
    a = AMUSD_ACCEPTANCE
    cases = [
        Case("ar", target, None, a),
        Case("sd", target, draft, a, lookahead=5),
        Case("amusd", target, draft, a, max_ahead=16),
    ]
    print(
        f"AMUSD Table I pattern with simulated models through the real runtime (process workers): target "
        f"{1000 * AMUSD_TARGET_S * scale:g} ms per forward of any width, draft {1000 * AMUSD_DRAFT_S * scale:g} ms, "
        f"a = {a:.3f}, {tokens} tokens, median of {repeats}"
    )
    print(
        f"{'strategy':<8} {'measured ms/token':>17} {'x AR':>6} {'event sim ms/token':>18} {'x AR':>6} "
        f"{'paper ms/token':>14} {'x AR':>6}"
    )
    measured, simulated = {}, {}
    for case in cases:
        measured[case.strategy] = 1000 * statistics.median(measure(case, tokens, repeats, "process")) / tokens
        simulated[case.strategy] = 1000 * predict(case, tokens) / tokens
    for name in ("ar", "sd", "amusd"):
        paper = AMUSD_PAPER[name]
        print(
            f"{name:<8} {measured[name]:>17.2f} {measured['ar'] / measured[name]:>5.2f}x "
            f"{simulated[name]:>18.2f} {simulated['ar'] / simulated[name]:>5.2f}x "
            f"{paper * scale:>14.2f} {AMUSD_PAPER['ar'] / paper:>5.2f}x",
            flush=True,
        )


# Each setting: (label, strategies, extra flags). One thread per model, draft on core 0, target on core 1; `ar`
# and `sd` run on the target's device (cpu:1) only, so "x AR" compares on one core. The first setting also runs
# what a user would run instead on both cores: our `ar` at 2 threads and llama.cpp's own llama-server (the peer).
# The last uses the native PyTorch backend: slower, but where bf16 matmuls are fast (AVX512_BF16) a forward of a few
# tokens costs about what one token costs, the GPU-like regime AMUSD was designed for.
LLAMACPP = ["--backend", "llamacpp"]
REAL_GRID = [
    ("llamacpp, defaults: lookahead 5, max_ahead 16, verify_chunk 8", "ar,sd,amusd,ar@2t,llamacpp-ar", LLAMACPP),
    (
        "llamacpp, short chunks: lookahead 3, max_ahead 6, verify_chunk 2",
        "ar,sd,amusd",
        LLAMACPP + ["--lookahead", "3", "--max-ahead", "6", "--verify-chunk", "2"],
    ),
    (
        "llamacpp, medium: lookahead 4, max_ahead 8, verify_chunk 4",
        "ar,sd,amusd",
        LLAMACPP + ["--lookahead", "4", "--max-ahead", "8", "--verify-chunk", "4"],
    ),
    ("native, dtype auto, defaults", "ar,sd,amusd", ["--backend", "native"]),
]


def real_commands(python: str, out: str) -> list[list[str]]:
    base = [
        python,
        "-m",
        "paraspec",
        "bench",
        "--target",
        "Qwen/Qwen2.5-Coder-1.5B-Instruct",
        "--draft",
        "Qwen/Qwen2.5-Coder-0.5B-Instruct",
        "--threads",
        "1",
        "--target-devices",
        "cpu:1",
        "--draft-devices",
        "cpu:0",
        "--dataset",
        "humaneval",
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "64",
        "--no-progress",
    ]
    return [
        base + ["--strategies", strategies] + flags + ["--out", f"{out}/{i}"]
        for i, (_, strategies, flags) in enumerate(REAL_GRID)
    ]


def part_real(run: bool, out: str, only: list[int] | None = None) -> None:
    for i, ((label, _, _), cmd) in enumerate(zip(REAL_GRID, real_commands(sys.executable, out))):
        if only is not None and i not in only:
            continue
        print(f"# {label}")
        print(shlex.join(cmd), flush=True)
        if run:
            subprocess.run(cmd, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    s = sub.add_parser("sim")
    s.add_argument("--tokens", type=int, default=64)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--scale", type=float, default=1.0, help="multiply the paper's latencies")
    r = sub.add_parser("real")
    r.add_argument("--run", action="store_true", help="run the grid (quiet machine only; ~10 minutes)")
    r.add_argument("--only", type=int, nargs="+", help="run only these settings (0-based)")
    r.add_argument("--out", default="out/amusd_pattern")
    args = p.parse_args()
    if args.part == "sim":
        part_sim(args.tokens, args.repeats, args.scale)
    else:
        part_real(args.run, args.out, args.only)


if __name__ == "__main__":
    main()
