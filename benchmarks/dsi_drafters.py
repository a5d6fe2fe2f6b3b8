"""DSI with several drafters (the paper's f_1..f_{m-1}) on simulated devices: does a fast, weaker drafter that
fills in while an accurate, slow one lags beat either drafter alone?

Simulated models (models/simulated.py) sleep a fixed time per forward and agree with the target's "truth"
with a fixed probability per position, and run through the real runtime (one process per worker). Every
configuration's output is checked against the truth; configurations are interleaved per repeat.

    .venv/bin/python benchmarks/dsi_drafters.py [--tokens 200] [--repeats 3] [--servers 4] [--lookahead 4]
"""

from __future__ import annotations

import argparse
import statistics

from paraspec import Engine, SamplingParams
from paraspec.models.simulated import SimulatedModel, SimulatedSpec
from paraspec.sim.costs import ForwardCost


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--lookahead", type=int, default=4)
    p.add_argument("--target-ms", type=float, default=30.0, help="target forward, ms")
    p.add_argument(
        "--accurate",
        type=float,
        nargs=2,
        default=(0.9, 10.0),
        metavar=("A", "MS"),
        help="the accurate drafter: acceptance rate, ms per token",
    )
    p.add_argument(
        "--fast",
        type=float,
        nargs=2,
        default=(0.6, 1.0),
        metavar=("A", "MS"),
        help="the fast drafter: acceptance rate, ms per token",
    )
    p.add_argument("--runtime-kind", default="process", choices=["process", "inprocess"])
    args = p.parse_args()

    target = SimulatedSpec(seed=5, cost=ForwardCost.constant(args.target_ms / 1000))
    drafters = {
        name: SimulatedSpec(
            role="draft", seed=5, draft_seed=50 + i, acceptance_rate=a, cost=ForwardCost.constant(ms / 1000)
        )
        for i, (name, (a, ms)) in enumerate([("accurate", args.accurate), ("fast", args.fast)])
    }
    setups = {
        "accurate": ["accurate"],
        "fast": ["fast"],
        "accurate+fast": ["accurate", "fast"],
        "fast+accurate": ["fast", "accurate"],
    }
    truth = SimulatedModel(target).predicted
    prompt = [5, 6, 7]
    engines = {}
    rows: dict[str, list] = {name: [] for name in setups}
    try:
        for name, order in setups.items():
            engines[name] = Engine(
                target,
                [drafters[d] for d in order],
                strategy="dsi",
                lookahead=args.lookahead,
                max_ahead=args.lookahead * (args.servers + 1),
                target_devices=["cpu"] * args.servers,
                runtime_kind=args.runtime_kind,
            )
        for engine in engines.values():  # warm-up
            engine.generate(prompt, SamplingParams(max_new_tokens=8))
        for _ in range(args.repeats):
            for name, engine in engines.items():  # interleaved
                result = engine.generate(prompt, SamplingParams(max_new_tokens=args.tokens))
                if result.token_ids != truth[len(prompt) : len(prompt) + args.tokens].tolist():
                    raise SystemExit(f"{name}: the output is not the target's truth")
                rows[name].append(result)
    finally:
        for engine in engines.values():
            engine.close()

    print(
        f"target {args.target_ms:g} ms/forward, {args.servers} servers, lookahead {args.lookahead}; accurate "
        f"drafter a={args.accurate[0]:g} {args.accurate[1]:g} ms/token, fast drafter a={args.fast[0]:g} "
        f"{args.fast[1]:g} ms/token; {args.tokens} tokens x {args.repeats} repeats, runtime {args.runtime_kind}\n"
    )
    print("| drafters (in order) | ms/token (median) | acceptance | chunks per drafter | same as truth |")
    print("|---|---|---|---|---|")
    for name, results in rows.items():
        ms = statistics.median(1000 * r.stats.total_s / len(r.token_ids) for r in results)
        acceptance = sum(r.stats.accepted for r in results) / max(1, sum(r.stats.drafted for r in results))
        chunks = [
            sum(r.worker_reports["dsi"]["chunks_by_drafter"][i] for r in results) for i in range(len(setups[name]))
        ]
        share = " / ".join(f"{d} {c}" for d, c in zip(setups[name], chunks))
        print(f"| {name} | {ms:.2f} | {acceptance:.1%} | {share} | yes |")


if __name__ == "__main__":
    main()
