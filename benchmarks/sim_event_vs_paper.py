"""Where the event simulator and the DSI paper's model disagree, and by how much.

Part 1 runs both with the paper's idealisations (constant forward cost, no messages, no prefill, enough
target servers) on a grid of (c, a, k) and prints event / paper time ratios per algorithm. Part 2 adds, one at a
time, what the paper leaves out, for this machine's reference pair (BENCHMARKS.md: target 376 ms, draft 133 ms
per token on one core each): forward width, server catch-up, messages, prefill, and fewer servers than needed.

    .venv/bin/python benchmarks/sim_event_vs_paper.py [--tokens 1000] [--repeats 5]
"""
from __future__ import annotations

import argparse

import numpy as np

from paraspec.sim import dsi_paper as paper
from paraspec.sim.events import Setup, mean_result
from paraspec.sim.profile import ForwardCost


def idealised(tokens: int, repeats: int) -> None:
    print("Part 1: event / paper time with the paper's idealisations (1.000 = same; DSI with enough servers)")
    print(f"{'c':>5} {'a':>5} {'k':>3} {'SI ev/paper':>12} {'DSI ev/paper':>13} {'DSI ev, no non-SI thread':>25}")
    ratios_sd, ratios_dsi = [], []
    for c in (0.05, 0.2, 0.5, 0.9):
        for a in (0.2, 0.5, 0.8, 0.95):
            for k in (1, 5):
                p = paper.simulate(c, a, k, tokens, repeats)
                base = dict(target=ForwardCost.constant(1.0), draft=ForwardCost.constant(c), acceptance_rate=a,
                            lookahead=k, servers=paper.servers_required(c, k))
                sd, _ = mean_result(Setup("sd", **base), tokens, repeats)
                dsi, _ = mean_result(Setup("dsi", **base), tokens, repeats)
                solo_off, _ = mean_result(Setup("dsi", target_only_thread=False, **base), tokens, repeats)
                ratios_sd.append(sd / p.si)
                ratios_dsi.append(dsi / p.dsi)
                print(f"{c:>5.2f} {a:>5.2f} {k:>3} {sd / p.si:>12.3f} {dsi / p.dsi:>13.3f} {solo_off / p.dsi:>25.3f}")
    print(f"SI: event/paper in [{min(ratios_sd):.3f}, {max(ratios_sd):.3f}] (sampling error only); "
          f"DSI: [{min(ratios_dsi):.3f}, {max(ratios_dsi):.3f}]\n")


def overheads(tokens: int, repeats: int) -> None:
    print("Part 2: the reference CPU pair (target 376 ms, draft 133 ms, a = 0.8), ms per token after the first")
    target_ms, draft_ms, a = 376.0, 133.0, 0.8
    cases = [
        ("paper's assumptions", dict(target=ForwardCost.constant(target_ms / 1000),
                                     draft=ForwardCost.constant(draft_ms / 1000))),
        ("+ forward width (2%/token)", dict(target=ForwardCost.linear(target_ms / 1000),
                                            draft=ForwardCost.linear(draft_ms / 1000))),
        ("+ 0.5 ms per message", dict(target=ForwardCost.linear(target_ms / 1000),
                                      draft=ForwardCost.linear(draft_ms / 1000), comm_s=0.0005)),
        ("+ prefill 900/300 ms", dict(target=ForwardCost.linear(target_ms / 1000),
                                      draft=ForwardCost.linear(draft_ms / 1000), comm_s=0.0005,
                                      target_prefill_s=0.9, draft_prefill_s=0.3)),
    ]
    print(f"{'':<28} {'ar':>7} {'sd k=3':>7} {'amusd':>7} {'dsi k=1 N=3':>12} {'dsi k=1 N=1':>12}")
    for label, kw in cases:
        row = []
        for strategy, extra in (("ar", {}), ("sd", {"lookahead": 3}), ("amusd", {"max_ahead": 6}),
                                ("dsi", {"lookahead": 1, "servers": 3}), ("dsi", {"lookahead": 1, "servers": 1})):
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
