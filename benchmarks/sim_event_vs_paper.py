"""Where the event simulator and the DSI paper's model disagree, and by how much.

Part 1 runs both with the paper's idealisations (constant forward cost, no messages, no prefill, enough
target servers) on a grid of (c, a, k) and prints event / paper time ratios per algorithm. Part 2 adds, one at a
time, what the paper leaves out, for this machine's reference pair (docs/BENCHMARKS.md: target 376 ms, draft 133 ms
per token on one core each): forward width, server catch-up, messages, prefill, and fewer servers than needed.

    .venv/bin/python benchmarks/sim_event_vs_paper.py [--tokens 1000] [--repeats 5]
"""

from __future__ import annotations

import argparse

import numpy as np

from paraspec.sim import dsi_paper as paper
from paraspec.sim.costs import ForwardCost
from paraspec.sim.events import Setup, mean_result


def idealised(tokens: int, repeats: int) -> None:
    print("Part 1: event / paper time with the paper's idealisations (1.000 = same). N = ceil(1/(k c)), the")
    print("paper's server count; N + 1 leaves a server for DSI's non-SI thread, which the paper's count omits.")
    print(f"{'c':>5} {'a':>5} {'k':>3} {'N':>3} {'SI':>7} {'DSI, N':>8} {'DSI, N+1':>9} {'N+1, no non-SI thread':>22}")
    ratios = {"sd": [], "dsi": [], "dsi+1": []}
    for c in (0.05, 0.2, 0.5, 0.9):
        for a in (0.2, 0.5, 0.8, 0.95):
            for k in (1, 5):
                p = paper.simulate(c, a, k, tokens, repeats)
                n = paper.servers_required(c, k)
                base = dict(
                    target=ForwardCost.constant(1.0), draft=ForwardCost.constant(c), acceptance_rate=a, lookahead=k
                )
                sd = mean_result(Setup("sd", **base), tokens, repeats)[0] / p.si
                dsi = mean_result(Setup("dsi", servers=n, **base), tokens, repeats)[0] / p.dsi
                dsi1 = mean_result(Setup("dsi", servers=n + 1, **base), tokens, repeats)[0] / p.dsi
                alone = (
                    mean_result(Setup("dsi", servers=n + 1, target_only_thread=False, **base), tokens, repeats)[0]
                    / p.dsi
                )
                for key, v in (("sd", sd), ("dsi", dsi), ("dsi+1", dsi1)):
                    ratios[key].append(v)
                print(f"{c:>5.2f} {a:>5.2f} {k:>3} {n:>3} {sd:>7.3f} {dsi:>8.3f} {dsi1:>9.3f} {alone:>22.3f}")
    for key, label in (("sd", "SI"), ("dsi", "DSI with N"), ("dsi+1", "DSI with N + 1")):
        print(f"{label}: event / paper in [{min(ratios[key]):.3f}, {max(ratios[key]):.3f}]")
    print()


def overheads(tokens: int, repeats: int) -> None:
    print("Part 2: the reference CPU pair (target 376 ms, draft 133 ms, a = 0.8), ms per token after the first")
    target_ms, draft_ms, a = 376.0, 133.0, 0.8
    cases = [
        (
            "paper's assumptions",
            dict(target=ForwardCost.constant(target_ms / 1000), draft=ForwardCost.constant(draft_ms / 1000)),
        ),
        (
            "+ forward width (2%/token)",
            dict(target=ForwardCost.linear(target_ms / 1000), draft=ForwardCost.linear(draft_ms / 1000)),
        ),
        (
            "+ 0.5 ms per message",
            dict(target=ForwardCost.linear(target_ms / 1000), draft=ForwardCost.linear(draft_ms / 1000), comm_s=0.0005),
        ),
        (
            "+ prefill 900/300 ms",
            dict(
                target=ForwardCost.linear(target_ms / 1000),
                draft=ForwardCost.linear(draft_ms / 1000),
                comm_s=0.0005,
                target_prefill_s=0.9,
                draft_prefill_s=0.3,
            ),
        ),
    ]
    print(f"{'':<28} {'ar':>7} {'sd k=3':>7} {'amusd':>7} {'dsi k=1 N=3':>12} {'dsi k=1 N=1':>12}")
    for label, kw in cases:
        row = []
        for strategy, extra in (
            ("ar", {}),
            ("sd", {"lookahead": 3}),
            ("amusd", {"max_ahead": 6}),
            ("dsi", {"lookahead": 1, "servers": 3}),
            ("dsi", {"lookahead": 1, "servers": 1}),
        ):
            _, tpot = mean_result(Setup(strategy, acceptance_rate=a, **{**kw, **extra}), tokens, repeats)
            row.append(tpot)
        print(f"{label:<28} " + " ".join(f"{v:>{w}.1f}" for v, w in zip(row, (7, 7, 7, 12, 12))))
    print("(c = 0.35 and k = 1 need ceil(1/(k c)) = 3 target servers; N = 1 shows the queueing the paper excludes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    idealised(args.tokens, args.repeats)
    overheads(min(args.tokens, 300), args.repeats)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
