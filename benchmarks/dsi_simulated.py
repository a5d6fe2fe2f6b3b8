"""Simulated devices through the real runtime: measured wall time next to the event simulator's prediction.

Three parts (select with --part):
  sim       ar, sd, amusd and dsi with simulated latencies: measured / simulated time (1.000 = the simulator
            predicted the runtime exactly; the difference is orchestration and sleep overhead plus what the
            simulator models differently, e.g. a preempted server that cannot stop its forward here)
  table1    the DSI paper's Table 1, ten rows: measured DSI / SI speedup next to the event simulator's, the
            authors' thread-pool model's (paraspec/sim/dsi_online.py) and the paper's
  overhead  orchestration overhead per generated token with zero-latency simulated models, sd / amusd / dsi

    .venv/bin/python benchmarks/dsi_simulated.py --part sim --runtime-kind process
    .venv/bin/python benchmarks/dsi_simulated.py --part table1 --runtime-kind process --tokens 50 --repeats 3
    .venv/bin/python benchmarks/dsi_simulated.py --part overhead --runtime-kind process
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from paraspec import Engine, SamplingParams
from paraspec.models.simulated import SimulatedModel, SimulatedSpec
from paraspec.sim.costs import ForwardCost
from paraspec.sim.events import Setup, simulate

PROMPT = [5, 6, 7]


@dataclass(frozen=True)
class Case:
    strategy: str
    target: ForwardCost
    draft: ForwardCost | None
    acceptance_rate: float
    lookahead: int = 3
    servers: int = 1
    max_ahead: int | None = None

    @property
    def ahead(self) -> int:
        if self.max_ahead is not None:
            return self.max_ahead
        return 2 * self.lookahead if self.strategy == "amusd" else (self.servers + 1) * self.lookahead


def open_engine(case: Case, runtime_kind: str = "inprocess", seed: int = 0) -> Engine:
    target = SimulatedSpec(cost=case.target, seed=seed)
    draft = SimulatedSpec(
        role="draft", cost=case.draft, seed=seed, draft_seed=seed + 1, acceptance_rate=case.acceptance_rate
    )
    options = {
        "ar": {},
        "sd": dict(lookahead=case.lookahead, adaptive=False),  # the papers' SI: fixed k
        "amusd": dict(max_ahead=case.ahead, verify_chunk=case.ahead),
        "dsi": dict(lookahead=case.lookahead, max_ahead=case.ahead, target_devices=["cpu"] * case.servers),
    }[case.strategy]
    if case.strategy == "ar":
        return Engine(target, strategy="ar")
    return Engine(target, draft, strategy=case.strategy, runtime_kind=runtime_kind, **options)


def measure(case: Case, tokens: int, repeats: int, runtime_kind: str = "inprocess", warmup: bool = True) -> list[float]:
    """Wall seconds of `repeats` requests of `tokens` tokens (after one warm-up), each on a fresh engine with
    its own truth and draft seeds; raises if a run does not return the target's tokens."""
    times = []
    for r in range(1 - warmup, repeats + 1):
        with open_engine(case, runtime_kind, seed=r) as engine:
            result = engine.generate(PROMPT, SamplingParams(max_new_tokens=tokens))
            expected = SimulatedModel(SimulatedSpec(seed=r)).predicted[len(PROMPT) : len(PROMPT) + tokens]
            if result.token_ids != expected.tolist():
                raise AssertionError(f"{case.strategy}: the simulated run did not return the target's tokens")
            if r:
                times.append(_total_s(result))
    return times


def _total_s(result) -> float:
    return result.stats.ms_per_token * len(result.token_ids) / 1000


def predict(case: Case, tokens: int, repeats: int = 20) -> float:
    """The event simulator's mean time for the same latencies, including prefill of the prompt."""
    setup = Setup(
        case.strategy,
        target=case.target,
        draft=case.draft,
        acceptance_rate=case.acceptance_rate,
        lookahead=case.lookahead,
        servers=case.servers,
        max_ahead=case.ahead if case.strategy in ("amusd", "dsi") else None,
        target_only_thread=False,
        preempt=False,  # the real workers finish a forward in flight first
        target_prefill_s=case.target(len(PROMPT)),
        draft_prefill_s=case.draft(len(PROMPT)) if case.draft is not None else 0.0,
    )
    return statistics.mean(simulate(setup, tokens, seed=s).total_s for s in range(repeats))


def sim_cases(target_s: float = 0.02, draft_s: float = 0.004, a: float = 0.7) -> list[Case]:
    t, d = ForwardCost.linear(target_s), ForwardCost.linear(draft_s)
    return [
        Case("ar", t, None, a),
        Case("sd", t, d, a, lookahead=3),
        Case("amusd", t, d, a),
        Case("dsi", t, d, a, lookahead=3, servers=1),
        Case("dsi", t, d, a, lookahead=2, servers=4),
    ]


def part_sim(tokens: int, repeats: int, runtime_kind: str) -> None:
    print(
        f"measured vs event simulator: target 20 ms, draft 4 ms (+2%/token), a = 0.7, {tokens} tokens, "
        f"runtime_kind={runtime_kind}, median of {repeats}"
    )
    print(f"{'strategy':<18} {'measured s':>10} {'simulated s':>11} {'ratio':>7}")
    for case in sim_cases():
        measured = statistics.median(measure(case, tokens, repeats, runtime_kind))
        predicted = predict(case, tokens)
        label = case.strategy + (f" N={case.servers} k={case.lookahead}" if case.strategy == "dsi" else "")
        print(f"{label:<18} {measured:>10.3f} {predicted:>11.3f} {measured / predicted:>7.3f}", flush=True)


def part_table1(tokens: int, repeats: int, runtime_kind: str, scale: float, measured: bool = True) -> None:
    """The ten rows of the paper's Table 1 with the configuration the event simulator picks for each (the online
    protocol: SI at its best lookahead of 1, 5, 10; DSI at its best lookahead and 1 or 7 target servers): measured
    DSI / SI wall-time speedup through the real runtime, beside the event simulator's as paraspec runs it ("as
    run": prompt prefill, no target-only thread, forwards never cut short), the event simulator's on the paper's
    assumptions, the authors' thread-pool model's (dsi_online, variant paper) and the paper's."""
    from paraspec.sim import dsi_online as online
    from paraspec.sim import dsi_paper as paper
    from paraspec.sim.table1 import events_choice, online_choice

    print(
        f"DSI paper Table 1 with simulated devices (latencies x {scale}), {tokens} tokens, "
        f"runtime_kind={runtime_kind}, median of {repeats}"
    )
    print(
        f"{'pair':<42} {'SI k':>4} {'DSI k':>5} {'N':>2} {'measured':>8} {'as run':>7} {'events':>7} {'online':>7} "
        f"{'paper':>6}"
    )
    for row in paper.PAPER_TABLE1:
        ev = events_choice(row, repeats=30, tokens=tokens)
        on = online_choice(row, online.VARIANTS["paper"], repeats=300)
        t = ForwardCost.constant(row.target_ms / 1000 * scale)
        d = ForwardCost.constant(row.drafter_ms / 1000 * scale)
        si = Case("sd", t, d, row.acceptance, lookahead=ev.si_k)
        dsi = Case("dsi", t, d, row.acceptance, lookahead=ev.dsi_k, servers=ev.dsi_servers)
        m_si = statistics.median(measure(si, tokens, repeats, runtime_kind)) if measured else float("nan")
        m_dsi = statistics.median(measure(dsi, tokens, repeats, runtime_kind)) if measured else float("nan")
        as_run = predict(si, tokens, repeats=100) / predict(dsi, tokens, repeats=100)
        name = f"{row.target} / {row.drafter}, {row.dataset}"
        print(
            f"{name:<42} {ev.si_k:>4} {ev.dsi_k:>5} {ev.dsi_servers:>2} {m_si / m_dsi:>7.2f}x {as_run:>6.2f}x "
            f"{ev.speedup:>6.2f}x "
            f"{on.speedup:>6.2f}x {row.paper_speedup:>5.2f}x",
            flush=True,
        )


def part_overhead(tokens: int, repeats: int, runtime_kind: str) -> None:
    print(
        f"orchestration overhead, zero-latency simulated models, {tokens} tokens, a = 0.8, runtime_kind={runtime_kind}"
    )
    print(f"{'strategy':<18} {'ms/token (median)':>17} {'min':>7}")
    zero = ForwardCost.constant(1e-9)
    for case in (
        Case("sd", zero, zero, 0.8, lookahead=4),
        Case("amusd", zero, zero, 0.8, max_ahead=8),
        Case("dsi", zero, zero, 0.8, lookahead=4, servers=1),
        Case("dsi", zero, zero, 0.8, lookahead=4, servers=2),
        Case("dsi", zero, zero, 0.8, lookahead=2, servers=8),
    ):
        target = SimulatedSpec()
        draft = SimulatedSpec(role="draft", acceptance_rate=case.acceptance_rate)
        options = {
            "sd": dict(lookahead=case.lookahead, adaptive=False),
            "amusd": dict(max_ahead=case.ahead),
            "dsi": dict(lookahead=case.lookahead, max_ahead=case.ahead, target_devices=["cpu"] * case.servers),
        }[case.strategy]
        per_token = []
        with Engine(target, draft, strategy=case.strategy, runtime_kind=runtime_kind, **options) as engine:
            engine.generate(PROMPT, SamplingParams(max_new_tokens=tokens))
            for _ in range(repeats):
                start = time.perf_counter()
                engine.generate(PROMPT, SamplingParams(max_new_tokens=tokens))
                per_token.append(1000 * (time.perf_counter() - start) / tokens)
        label = case.strategy + (f" N={case.servers} k={case.lookahead}" if case.strategy == "dsi" else "")
        print(f"{label:<18} {statistics.median(per_token):>17.3f} {min(per_token):>7.3f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["sim", "table1", "overhead"], required=True)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--runtime-kind", choices=["inprocess", "process"], default="inprocess")
    p.add_argument("--scale", type=float, default=1.0, help="table1: multiply the paper's latencies")
    p.add_argument("--no-measure", action="store_true", help="table1: only the models' columns (no runtime)")
    args = p.parse_args()
    if args.part == "sim":
        part_sim(args.tokens, args.repeats, args.runtime_kind)
    elif args.part == "table1":
        part_table1(args.tokens, args.repeats, args.runtime_kind, args.scale, measured=not args.no_measure)
    else:
        part_overhead(args.tokens, args.repeats, args.runtime_kind)


if __name__ == "__main__":
    main()
