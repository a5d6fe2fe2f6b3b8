"""The DSI paper's Table 1, row by row, in the three models we have: each row's DSI/SI speedup as

- `offline`: the paper's own offline model (`dsi_paper`, time units, 1000 tokens, lookaheads 1, 5, 10, DSI on the
  servers it needs, at most 7) -- the model of its Figure 1, not of Table 1;
- `online`: the authors' thread-pool simulation (`dsi_online`), the one Table 1 was made with (50 tokens, SI at
  its best lookahead of 1, 5, 10, DSI at its best lookahead and its best of 1 or 7 target threads);
- `events`: the event simulator (`events`), with the online protocol (50 tokens, the same grid) and constant
  forward costs in milliseconds, no messages, no prefill.

Each model picks its own lookaheads and server counts; the rows carry them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paraspec.sim import dsi_online as online
from paraspec.sim import dsi_paper as paper
from paraspec.sim.costs import ForwardCost
from paraspec.sim.dsi_paper import Choice
from paraspec.sim.events import Setup, simulate


@dataclass(frozen=True)
class Row:
    pair: paper.PairRow
    offline: Choice
    online: Choice
    events: Choice

    @property
    def online_gap(self) -> float:
        """online / paper - 1."""
        return self.online.speedup / self.pair.paper_speedup - 1


def offline_choice(pair: paper.PairRow) -> Choice:
    return paper.table1(rows=(pair,))[0]


def online_choice(
    pair: paper.PairRow,
    variant: online.Variant,
    repeats: int,
    restart_ms: float = 0.0,
    seed: int = 0,
    lookaheads=online.ONLINE_LOOKAHEADS,
    servers=online.ONLINE_SERVERS,
) -> Choice:
    """The paper's protocol (section 4): SI at its best lookahead; DSI at its best (lookahead, target threads)."""
    latencies = online.Latencies(pair.target_ms, pair.drafter_ms)

    def mean_ms(k: int, n: int | None) -> float:
        setup = online.OnlineSetup(latencies, pair.acceptance, k, n, variant=variant, restart_ms=restart_ms)
        return online.mean_time_ms(setup, repeats, seed)

    si, si_k = min((mean_ms(k, None), k) for k in lookaheads)
    dsi, dsi_k, dsi_n = min((mean_ms(k, n), k, n) for k in lookaheads for n in servers)
    return Choice(si, si_k, dsi, dsi_k, dsi_n)


def events_choice(
    pair: paper.PairRow,
    repeats: int,
    tokens: int = online.ONLINE_TOKENS,
    lookaheads=online.ONLINE_LOOKAHEADS,
    servers=online.ONLINE_SERVERS,
) -> Choice:
    target = ForwardCost.constant(pair.target_ms / 1000)
    draft = ForwardCost.constant(pair.drafter_ms / 1000)

    def mean_ms(strategy: str, k: int, n: int = 1) -> float:
        setup = Setup(strategy, target, draft, acceptance_rate=pair.acceptance, lookahead=k, servers=n)
        return 1000 * float(np.mean([simulate(setup, tokens, seed=s).total_s for s in range(repeats)]))

    si, si_k = min((mean_ms("sd", k), k) for k in lookaheads)
    dsi, dsi_k, dsi_n = min((mean_ms("dsi", k, n), k, n) for k in lookaheads for n in servers)
    return Choice(si, si_k, dsi, dsi_k, dsi_n)


def table1(
    rows=paper.PAPER_TABLE1,
    variant: online.Variant = online.VARIANTS["paper"],
    online_repeats: int = 1000,
    events_repeats: int = 100,
    restart_ms: float = 0.0,
) -> list[Row]:
    return [
        Row(
            pair,
            offline_choice(pair),
            online_choice(pair, variant, online_repeats, restart_ms),
            events_choice(pair, events_repeats),
        )
        for pair in rows
    ]


def online_spread(
    pair: paper.PairRow, variant: online.Variant, repeats: int = online.ONLINE_REPEATS, estimates: int = 40
) -> tuple[float, float]:
    """5th and 95th percentile of the online speedup when every configuration is estimated from `repeats` runs
    (the authors' `iter_count`, 30) and the best is picked from those noisy means, as the paper's protocol does:
    how far one honest run of it can land from its expectation."""
    values = [online_choice(pair, variant, repeats, seed=1 + i).speedup for i in range(estimates)]
    return float(np.percentile(values, 5)), float(np.percentile(values, 95))
