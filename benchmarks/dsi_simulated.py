"""Simulated devices through the real runtime: measured wall time next to the event simulator's prediction.

Three parts (select with --part):
  sim       ar, sd, amusd and dsi with simulated latencies: measured / simulated time (1.000 = the simulator
            predicted the runtime exactly; the difference is orchestration and sleep overhead plus what the
            simulator models differently, e.g. a preempted server that cannot stop its forward here)
  table1    the DSI paper's Table 1 configurations (<= 7 servers): measured DSI / SI speedup next to the event
            simulator's and the paper's
  overhead  orchestration overhead per generated token with zero-latency simulated models, sd / amusd / dsi

    .venv/bin/python benchmarks/dsi_simulated.py --part sim --runtime process
    .venv/bin/python benchmarks/dsi_simulated.py --part table1 --scale 0.02
    .venv/bin/python benchmarks/dsi_simulated.py --part overhead --runtime process
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from paraspec import Engine, SamplingParams
from paraspec.models.simulated import SimulatedModel, SimulatedSpec
from paraspec.sim.events import Setup, simulate
from paraspec.sim.profile import ForwardCost

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


def open_engine(case: Case, runtime: str = "inprocess", seed: int = 0) -> Engine:
    target = SimulatedSpec(cost=case.target, seed=seed)
    draft = SimulatedSpec(role="draft", cost=case.draft, seed=seed, draft_seed=seed + 1,
                          acceptance_rate=case.acceptance_rate)
    options = {"ar": {}, "sd": dict(lookahead=case.lookahead),
               "amusd": dict(max_ahead=case.ahead, verify_chunk=case.ahead),
               "dsi": dict(lookahead=case.lookahead, max_ahead=case.ahead,
                           target_devices=["cpu"] * case.servers)}[case.strategy]
    if case.strategy == "ar":
        return Engine(target, strategy="ar")
    return Engine(target, draft, strategy=case.strategy, runtime=runtime, **options)


def measure(case: Case, tokens: int, repeats: int, runtime: str = "inprocess", warmup: bool = True) -> list[float]:
    """Wall seconds of `repeats` requests of `tokens` tokens (after one warm-up), each on a fresh engine with
    its own truth and draft seeds; raises if a run does not return the target's tokens."""
    times = []
    for r in range(1 - warmup, repeats + 1):
        with open_engine(case, runtime, seed=r) as engine:
            result = engine.generate(PROMPT, SamplingParams(max_new_tokens=tokens))
            expected = SimulatedModel(SimulatedSpec(seed=r)).predicted[len(PROMPT):len(PROMPT) + tokens]
            if result.token_ids != expected.tolist():
                raise AssertionError(f"{case.strategy}: the simulated run did not return the target's tokens")
            if r:
                times.append(_total_s(result))
    return times


def _total_s(result) -> float:
    return result.stats.ms_per_token * len(result.token_ids) / 1000


def predict(case: Case, tokens: int, repeats: int = 20) -> float:
    """The event simulator's mean time for the same latencies, including prefill of the prompt."""
    setup = Setup(case.strategy, target=case.target, draft=case.draft, acceptance_rate=case.acceptance_rate,
                  lookahead=case.lookahead, servers=case.servers, max_ahead=case.ahead if case.strategy in
                  ("amusd", "dsi") else None, target_only_thread=False,
                  target_prefill_s=case.target(len(PROMPT)),
                  draft_prefill_s=case.draft(len(PROMPT)) if case.draft is not None else 0.0)
    return statistics.mean(simulate(setup, tokens, seed=s).total_s for s in range(repeats))


def sim_cases(target_s: float = 0.02, draft_s: float = 0.004, a: float = 0.7) -> list[Case]:
    t, d = ForwardCost.linear(target_s), ForwardCost.linear(draft_s)
    return [Case("ar", t, None, a), Case("sd", t, d, a, lookahead=3), Case("amusd", t, d, a),
            Case("dsi", t, d, a, lookahead=3, servers=1), Case("dsi", t, d, a, lookahead=2, servers=4)]


def part_sim(tokens: int, repeats: int, runtime: str) -> None:
    print(f"measured vs event simulator: target 20 ms, draft 4 ms (+2%/token), a = 0.7, {tokens} tokens, "
          f"runtime={runtime}, median of {repeats}")
    print(f"{'strategy':<18} {'measured s':>10} {'simulated s':>11} {'ratio':>7}")
    for case in sim_cases():
        measured = statistics.median(measure(case, tokens, repeats, runtime))
        predicted = predict(case, tokens)
        label = case.strategy + (f" N={case.servers} k={case.lookahead}" if case.strategy == "dsi" else "")
        print(f"{label:<18} {measured:>10.3f} {predicted:>11.3f} {measured / predicted:>7.3f}", flush=True)


def part_table1(tokens: int, repeats: int, runtime: str, scale: float) -> None:
    """The rows of sim/dsi_paper.PAPER_TABLE1 (only those whose latencies and acceptance we could source), each
    with the lookahead and server count the paper's model picks: SI with its best lookahead on one server, DSI
    with its best lookahead on the servers it needs (<= 7)."""
    from paraspec.sim import dsi_paper as paper
    lo, hi = paper.PAPER_TABLE1_SPEEDUP_RANGE
    print(f"DSI paper Table 1 rows with simulated devices (latencies x {scale}), {tokens} tokens, runtime={runtime}")
    print(f"the paper reports DSI/SI in [{lo}, {hi}] over its ten rows; per-row figures are not available here")
    print(f"{'pair':<42} {'SI k':>4} {'DSI k':>5} {'N':>2} {'measured DSI/SI':>15} {'event sim':>9} "
          f"{'paper model':>11}")
    for r in paper.table1(max_servers=7):
        row = r.row
        t = ForwardCost.constant(row.target_ms / 1000 * scale)
        d = ForwardCost.constant(row.drafter_ms / 1000 * scale)
        si = Case("sd", t, d, row.acceptance, lookahead=r.si_k)
        dsi = Case("dsi", t, d, row.acceptance, lookahead=r.dsi_k, servers=r.dsi_servers)
        m_si = statistics.median(measure(si, tokens, repeats, runtime))
        m_dsi = statistics.median(measure(dsi, tokens, repeats, runtime))
        s_ratio = predict(si, tokens) / predict(dsi, tokens)
        name = f"{row.target} / {row.drafter}, {row.dataset}"
        print(f"{name:<42} {r.si_k:>4} {r.dsi_k:>5} {r.dsi_servers:>2} {m_si / m_dsi:>15.2f} {s_ratio:>9.2f} "
              f"{r.speedup:>11.2f}", flush=True)


def part_overhead(tokens: int, repeats: int, runtime: str) -> None:
    print(f"orchestration overhead, zero-latency simulated models, {tokens} tokens, a = 0.8, runtime={runtime}")
    print(f"{'strategy':<18} {'ms/token (median)':>17} {'min':>7}")
    zero = ForwardCost.constant(1e-9)
    for case in (Case("sd", zero, zero, 0.8, lookahead=4), Case("amusd", zero, zero, 0.8, max_ahead=8),
                 Case("dsi", zero, zero, 0.8, lookahead=4, servers=1),
                 Case("dsi", zero, zero, 0.8, lookahead=4, servers=2),
                 Case("dsi", zero, zero, 0.8, lookahead=2, servers=8)):
        target = SimulatedSpec()
        draft = SimulatedSpec(role="draft", acceptance_rate=case.acceptance_rate)
        options = {"sd": dict(lookahead=case.lookahead), "amusd": dict(max_ahead=case.ahead),
                   "dsi": dict(lookahead=case.lookahead, max_ahead=case.ahead,
                               target_devices=["cpu"] * case.servers)}[case.strategy]
        per_token = []
        with Engine(target, draft, strategy=case.strategy, runtime=runtime, **options) as engine:
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
    p.add_argument("--runtime", choices=["inprocess", "process"], default="inprocess")
    p.add_argument("--scale", type=float, default=1.0, help="table1: multiply the paper's latencies")
    args = p.parse_args()
    if args.part == "sim":
        part_sim(args.tokens, args.repeats, args.runtime)
    elif args.part == "table1":
        part_table1(args.tokens, args.repeats, args.runtime, args.scale)
    else:
        part_overhead(args.tokens, args.repeats, args.runtime)


if __name__ == "__main__":
    main()
