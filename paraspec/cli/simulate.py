"""Command line of the simulators: `paraspec simulate heatmap|table1|point` and `paraspec plan`.

`add_commands(subparsers)` registers them on the main parser's subparsers; each leaf sets `func(args) -> int`.
Bad input raises ValueError inside; the command prints it and returns 2.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import sys
from pathlib import Path

import numpy as np

from paraspec.sim import dsi_online as online
from paraspec.sim import dsi_paper as paper


def add_commands(subparsers) -> None:
    sim = subparsers.add_parser("simulate", help="the DSI paper's simulator: heatmaps, Table 1, one configuration")
    sim_sub = sim.add_subparsers(dest="simulate_command", required=True)

    hm = sim_sub.add_parser("heatmap", help="speedup heatmaps over drafter latency x acceptance rate (paper Fig. 1)")
    hm.add_argument("--out", required=True, help="folder for the PNGs and heatmap.csv")
    hm.add_argument(
        "--lookahead",
        type=int,
        default=None,
        help="fix the lookahead (the paper's Fig. 6 uses 5); default: each algorithm's best of 1..ndim",
    )
    hm.add_argument("--ndim", type=int, default=20, help="grid steps per axis (paper: 20)")
    hm.add_argument("--tokens", type=int, default=paper.PAPER_TOKENS)
    hm.add_argument("--repeats", type=int, default=paper.PAPER_REPEATS)
    hm.add_argument(
        "--max-servers",
        type=int,
        default=paper.PAPER_MAX_SERVERS,
        help="exclude DSI configurations needing more target servers",
    )
    hm.add_argument(
        "--si-all-lookaheads",
        action="store_true",
        help="let SI use lookaheads DSI cannot (the authors drop them for both)",
    )
    hm.set_defaults(func=_guarded(cmd_heatmap))

    t1 = sim_sub.add_parser(
        "table1",
        help="the paper's Table 1, ten rows: its speedup beside the offline model, the "
        "authors' thread-pool model and the event simulator",
    )
    t1.add_argument(
        "--variant",
        choices=sorted(online.VARIANTS),
        default="paper",
        help="which version of the authors' thread-pool simulation to replay (default: paper, their "
        "first commit 91ab8b9; main: 2024206; bonus: add_1_from_target 1fb0623)",
    )
    t1.add_argument("--repeats", type=int, default=1000, help="runs per configuration, thread-pool model")
    t1.add_argument("--event-repeats", type=int, default=100, help="runs per configuration, event simulator")
    t1.add_argument(
        "--restart-ms",
        type=float,
        default=0.0,
        help="process start-up per window in the thread-pool model (theirs is not published; "
        "benchmarks/dsi_table1_restart.py measures the mechanism on this machine)",
    )
    t1.add_argument(
        "--spread",
        action="store_true",
        help="also the 5-95%% range of the thread-pool speedup with the authors' 30 runs per configuration (slower)",
    )
    t1.set_defaults(func=_guarded(cmd_table1))

    pt = sim_sub.add_parser("point", help="non-SI, SI and DSI costs of one configuration")
    pt.add_argument("--c", type=float, required=True, help="drafter latency / target latency, in (0, 1]")
    pt.add_argument("--a", type=float, required=True, help="acceptance rate, in [0, 1)")
    pt.add_argument("--k", type=int, required=True, help="lookahead, >= 1")
    pt.add_argument("--tokens", type=int, default=paper.PAPER_TOKENS)
    pt.add_argument("--repeats", type=int, default=paper.PAPER_REPEATS)
    pt.add_argument(
        "--events",
        action="store_true",
        help="also run the event simulator (zero overheads, constant forward cost) for comparison",
    )
    pt.set_defaults(func=_guarded(cmd_point))

    pl = subparsers.add_parser("plan", help="recommend a strategy, lookahead, servers and placement from a profile")
    pl.add_argument("--profile", help="JSON written by `paraspec profile`")
    pl.add_argument("--target-tpot-ms", type=float, help="target ms per token (instead of --profile)")
    pl.add_argument("--draft-tpot-ms", type=float, help="draft ms per token")
    pl.add_argument("--acceptance-rate", type=float, help="fraction of drafted tokens the target accepts")
    pl.add_argument(
        "--devices",
        nargs="+",
        help="devices available, e.g. cpu:0 cpu:1 (draft on the first, "
        "target on the second); NODE/cpu:0 is a device on another node",
    )
    pl.add_argument("--target-ttft-ms", type=float, default=0.0)
    pl.add_argument("--draft-ttft-ms", type=float, default=0.0)
    pl.add_argument("--comm-ms", type=float, default=None, help="latency of one message between devices")
    pl.add_argument(
        "--link-ms",
        type=float,
        default=None,
        help="latency added to a message to another node (devices written NODE/...; default 1)",
    )
    pl.add_argument("--tokens", type=int, default=128, help="tokens per simulated run")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=_guarded(cmd_plan))


def _guarded(command):
    """Turn a ValueError (bad input) into a message and exit status 2, as argparse does for bad flags."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except ValueError as e:
            print(f"paraspec: error: {e}", file=sys.stderr)
            return 2

    return run


def _check_runs(tokens: int, repeats: int) -> None:
    if tokens < 1 or repeats < 1:
        raise ValueError(f"--tokens {tokens} and --repeats {repeats} must be >= 1")


# ------------------------------------------------------------------------------------------- heatmap


def cmd_heatmap(args: argparse.Namespace) -> int:
    from paraspec.sim.plots import PANELS, save_heatmap

    _check_runs(args.tokens, args.repeats)
    if args.ndim < 2:
        raise ValueError(f"--ndim {args.ndim} must be >= 2")
    if args.max_servers < 1:
        raise ValueError(f"--max-servers {args.max_servers} must be >= 1")
    c, a, ks = paper.paper_grid(args.ndim)
    if args.lookahead is not None:
        paper.check_lookahead(args.lookahead)
        ks = np.array([args.lookahead])
    hm = paper.heatmap(
        c,
        a,
        ks,
        args.tokens,
        args.repeats,
        max_servers=args.max_servers,
        si_feasible_only=not args.si_all_lookaheads,
        progress=True,
    )
    speedups = hm.speedups()
    out = Path(args.out)
    suffix = f"_k{args.lookahead}" if args.lookahead is not None else ""
    for name, (title, step, vmax) in PANELS.items():
        label = f"{title}, lookahead {args.lookahead}" if args.lookahead else f"{title}, best lookahead"
        path = save_heatmap(speedups[name], c, a, out / f"{name}{suffix}.png", label, step, vmax)
        print(f"wrote {path}")
    _write_csv(hm, speedups, out / f"heatmap{suffix}.csv")
    print(summarize_heatmap(hm, speedups))
    return 0


def _write_csv(hm: paper.Heatmap, speedups: dict, path: Path) -> None:
    si_k, dsi_k = hm.best_lookahead("si"), hm.best_lookahead("dsi")
    si_cost, dsi_cost = hm.best("si"), hm.best("dsi")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["c", "a", "cost_nonsi", "k_si", "cost_si", "k_dsi", "cost_dsi", *speedups])
        for i, c in enumerate(hm.c):
            for j, a in enumerate(hm.a):
                w.writerow(
                    [
                        f"{c:g}",
                        f"{a:g}",
                        hm.nonsi,
                        si_k[i, j],
                        f"{si_cost[i, j]:.2f}",
                        dsi_k[i, j],
                        f"{dsi_cost[i, j]:.2f}",
                        *(f"{speedups[s][i, j]:.4f}" for s in speedups),
                    ]
                )
    print(f"wrote {path}")


def summarize_heatmap(hm: paper.Heatmap, speedups: dict) -> str:
    si = speedups["si_vs_nonsi"]
    slow = np.isfinite(si) & (si < 1)
    lines = [
        f"SI is slower than non-SI at {slow.sum()} of {np.isfinite(si).sum()} grid points; "
        f"per drafter latency, the acceptance rates where it is:"
    ]
    for i, c in enumerate(hm.c):
        if slow[i].any():
            lines.append(f"  c = {c:.2f}: a <= {hm.a[slow[i]].max():.2f}")
    for name, label in (("dsi_vs_si", "SI"), ("dsi_vs_nonsi", "non-SI"), ("dsi_vs_baseline", "min(SI, non-SI)")):
        v = speedups[name]
        i, j = (int(x) for x in np.unravel_index(np.nanargmax(v), v.shape))
        lines.append(
            f"DSI over {label}: max {v[i, j]:.2f}x at c = {hm.c[i]:.2f}, a = {hm.a[j]:.2f}; min {np.nanmin(v):.3f}x"
        )
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------- table1


def cmd_table1(args: argparse.Namespace) -> int:
    from paraspec.sim.table1 import online_spread, table1

    _check_runs(online.ONLINE_TOKENS, min(args.repeats, args.event_repeats))
    if args.restart_ms < 0:
        raise ValueError(f"--restart-ms {args.restart_ms} must be >= 0")
    variant = online.VARIANTS[args.variant]
    rows = table1(
        variant=variant, online_repeats=args.repeats, events_repeats=args.event_repeats, restart_ms=args.restart_ms
    )
    spreads = [online_spread(r.pair, variant) for r in rows] if args.spread else None
    print(render_table1(rows, variant, args.restart_ms, spreads))
    return 0


def render_table1(rows, variant: online.Variant, restart_ms: float, spreads=None) -> str:
    """One line per row: the inputs, the paper's speedup, then per model its speedup and (SI k / DSI k / N)."""

    def used(choice) -> str:
        return f"{choice.si_k}/{choice.dsi_k}/{choice.dsi_servers}"

    head = (
        f"{'target':<13} {'drafter':<14} {'dataset':<9} {'t ms':>5} {'d ms':>5} {'a':>4} {'paper':>6} "
        f"{'offline':>7} {'k/k/N':>8} {'online':>7} {'k/k/N':>8} {'gap':>6} {'events':>7} {'k/k/N':>8}"
    )
    if spreads:
        head += f" {'online, 30 runs: 5-95%':>23}"
    lines = [head]
    for i, r in enumerate(rows):
        p = r.pair
        line = (
            f"{p.target:<13} {p.drafter:<14} {p.dataset:<9} {p.target_ms:>5.1f} {p.drafter_ms:>5.1f} "
            f"{p.acceptance:>4.2f} {p.paper_speedup:>5.2f}x {r.offline.speedup:>6.2f}x {used(r.offline):>8} "
            f"{r.online.speedup:>6.2f}x {used(r.online):>8} {100 * r.online_gap:>+5.0f}% "
            f"{r.events.speedup:>6.2f}x {used(r.events):>8}"
        )
        if spreads:
            lo, hi = spreads[i]
            line += f" {f'{lo:.2f}-{hi:.2f}x':>23}"
        lines.append(line)
    lines.append(
        f"DSI/SI speedups. k/k/N: SI lookahead / DSI lookahead / DSI target servers. offline: the paper's "
        f"offline model (1000 tokens, DSI on <= {paper.PAPER_MAX_SERVERS} servers). online: the authors' "
        f"thread-pool simulation replayed (variant {variant.name}, {online.ONLINE_TOKENS} tokens, "
        f"TTFT = TPOT, process restart {restart_ms:g} ms per window). events: the event simulator, same "
        f"grid and tokens, zero message latency. gap: online / paper - 1."
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- point


def cmd_point(args: argparse.Namespace) -> int:
    paper.check_latency(args.c)
    paper.check_acceptance(args.a, allow_one=False)
    paper.check_lookahead(args.k)
    _check_runs(args.tokens, args.repeats)
    costs = paper.simulate(args.c, args.a, args.k, args.tokens, args.repeats)
    servers = paper.servers_required(args.c, args.k)
    too_many = f" (more than the paper allows: {paper.PAPER_MAX_SERVERS})" if servers > paper.PAPER_MAX_SERVERS else ""
    print(
        f"c = {args.c:g}, a = {args.a:g}, k = {args.k}: {args.tokens} tokens, mean of {args.repeats} runs "
        f"(time unit: one target forward)"
    )
    print(f"  non-SI {costs.nonsi:9.1f}")
    print(f"  SI     {costs.si:9.1f}   {costs.nonsi / costs.si:.3f}x non-SI")
    print(
        f"  DSI    {costs.dsi:9.1f}   {costs.si / costs.dsi:.3f}x SI, {costs.nonsi / costs.dsi:.3f}x non-SI; "
        f"needs {servers} target server{'s' * (servers > 1)}{too_many}"
    )
    if args.events:
        from paraspec.sim.costs import ForwardCost
        from paraspec.sim.events import Setup, mean_result

        base = dict(
            target=ForwardCost.constant(1.0),
            draft=ForwardCost.constant(args.c),
            acceptance_rate=args.a,
            lookahead=args.k,
        )
        print("event simulator, zero overheads (same units):")
        for label, strategy, extra in (
            ("ar", "ar", {}),
            ("sd", "sd", {}),
            ("amusd", "amusd", {"max_ahead": 2 * args.k}),
            (f"dsi, {servers} server{'s' * (servers > 1)}", "dsi", {"servers": servers}),
            (f"dsi, {servers + 1} servers", "dsi", {"servers": servers + 1}),
        ):
            total, _ = mean_result(Setup(strategy, **{**base, **extra}), args.tokens, args.repeats)
            print(f"  {label:<16} {total:9.1f}   {args.tokens / total:.3f}x non-SI")
        print("  (the paper's DSI cost assumes a server for its non-SI thread on top of the ones it counts)")
    return 0


# ---------------------------------------------------------------------------------------------- plan


def profile_from_args(args: argparse.Namespace):
    from paraspec.sim.costs import Profile

    flags = {
        "--target-tpot-ms": args.target_tpot_ms,
        "--draft-tpot-ms": args.draft_tpot_ms,
        "--acceptance-rate": args.acceptance_rate,
        "--devices": args.devices,
    }
    if args.profile:
        given = [f for f, v in flags.items() if v is not None]
        if given:
            raise ValueError(
                f"pass either --profile or {', '.join(flags)}, not both (got --profile and {', '.join(given)})"
            )
        return Profile.load(args.profile)
    missing = [f for f, v in flags.items() if v is None]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}: pass --profile FILE.json, or all of {', '.join(flags)}")
    for flag, value in (("--target-tpot-ms", args.target_tpot_ms), ("--draft-tpot-ms", args.draft_tpot_ms)):
        if value <= 0:
            raise ValueError(f"{flag} {value} must be positive (milliseconds per generated token)")
    if not 0 <= args.acceptance_rate < 1:
        raise ValueError(f"--acceptance-rate {args.acceptance_rate} must be in [0, 1), e.g. 0.8 for 80%")
    devices = list(dict.fromkeys(args.devices))
    draft_dev = devices[0]
    target_dev = devices[1] if len(devices) > 1 else devices[0]
    return Profile.from_dict(
        {
            "target": {
                "model": "target",
                "device": target_dev,
                "tpot_ms": args.target_tpot_ms,
                "ttft_ms": args.target_ttft_ms,
            },
            "draft": {
                "model": "draft",
                "device": draft_dev,
                "tpot_ms": args.draft_tpot_ms,
                "ttft_ms": args.draft_ttft_ms,
            },
            "acceptance_rate": args.acceptance_rate,
            "devices": devices,
        },
        source="flags",
    )


def cmd_plan(args: argparse.Namespace) -> int:
    from paraspec.sim.planner import DEFAULT_COMM_MS, DEFAULT_LINK_MS, plan

    profile = profile_from_args(args)
    result = plan(
        profile,
        tokens=args.tokens,
        comm_ms=DEFAULT_COMM_MS if args.comm_ms is None else args.comm_ms,
        link_ms=DEFAULT_LINK_MS if args.link_ms is None else args.link_ms,
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.render())
    return 0


def main(argv=None) -> int:
    """Run these commands alone (`python -m paraspec.cli.simulate ...`), before they are wired into `paraspec`."""
    parser = argparse.ArgumentParser(prog="paraspec")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
