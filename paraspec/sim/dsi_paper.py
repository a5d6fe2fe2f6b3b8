"""The offline simulator of the DSI paper (Timor et al. 2024, arXiv 2405.14105), reproduced.

Model (the authors' `dsi/offline/simul/{common,si,dsi}.py`, re-derived here, not copied):
- Time unit: one target forward = 1. The drafter costs c per drafted token, 0 < c <= 1.
- Acceptance: the drafts accepted in a round follow a geometric law: G ~ Geometric(1 - a) on {1, 2, ...},
  accepted = min(G - 1, k). So P(accepted >= j) = a^j: every draft is accepted with probability a, given
  its predecessors were.
- non-SI generates S tokens in S units. SI drafts k tokens, verifies them in one target forward and gains
  accepted + 1 tokens per round. DSI drafts continuously while target servers verify chunks of k drafts
  (speculation parallelism), so only a rejection makes it wait for a target forward; and it races a
  target-only thread, so a stretch of tokens never costs more than generating them without speculation.
- Draws use numpy's legacy `RandomState(42)`, reset per configuration, S draws per repeat: the authors'
  stream, so SI and DSI see the same draws and our costs reproduce theirs sample by sample.

Everything is a pure function of its arguments. Trajectories (which rounds happen, how many drafts each
charges) do not depend on c, so each (a, k, repeat) trajectory is computed once and its cost is evaluated
for a whole vector of drafter latencies with numpy: that is what makes the 21 x 21 x 20 grid take seconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

PAPER_SEED = 42
PAPER_TOKENS = 1000  # S: tokens generated per simulated run
PAPER_REPEATS = 5
PAPER_MAX_SERVERS = 7  # DSI configurations needing more target servers are excluded


# ---------------------------------------------------------------------------------------------- validation


def check_latency(c) -> None:
    arr = np.atleast_1d(np.asarray(c, dtype=float))
    if not np.all((arr > 0) & (arr <= 1)):
        raise ValueError(
            f"drafter latency c={c} is outside (0, 1]: c is the drafter's forward time divided by "
            f"the target's (e.g. 2.5 ms / 37.7 ms = 0.066); a drafter slower than the target "
            f"(c > 1) never helps, and c = 0 needs infinitely many target servers"
        )


def check_acceptance(a: float, allow_one: bool = True) -> None:
    hi_ok = a <= 1 if allow_one else a < 1
    if not (0 <= a and hi_ok):
        interval = "[0, 1]" if allow_one else "[0, 1)"
        raise ValueError(
            f"acceptance rate a={a} is outside {interval}: pass the probability that the target "
            f"accepts one drafted token, e.g. 0.8 for 80%"
        )


def check_lookahead(k: int) -> None:
    if int(k) != k or k < 1:
        raise ValueError(f"lookahead k={k} must be an integer >= 1 (drafts per verification)")


# ------------------------------------------------------------------------------------------------ sampling


def accepted_draws(a: float, k: int, n: int, rng: np.random.RandomState) -> np.ndarray:
    """n draws of the number of accepted drafts in a round: min(G - 1, k), G ~ Geometric(1 - a).

    a = 0 and a = 1 consume no randomness (as in the authors' sampler), which keeps the stream aligned."""
    if a == 0:
        return np.zeros(n, dtype=np.int64)
    if a == 1:
        return np.full(n, k, dtype=np.int64)
    return np.minimum(rng.geometric(1 - a, size=n) - 1, k).astype(np.int64)


def paper_draws(
    a: float, k: int, tokens: int = PAPER_TOKENS, repeats: int = PAPER_REPEATS, seed: int = PAPER_SEED
) -> list[np.ndarray]:
    """The draws of one configuration: one generator seeded once, `tokens` draws per repeat.

    Every round yields at least one token, so `tokens` draws always suffice for one run."""
    rng = np.random.RandomState(seed)
    return [accepted_draws(a, k, tokens, rng) for _ in range(repeats)]


# ------------------------------------------------------------------------------------------------------ SI


@dataclass(frozen=True)
class Rounds:
    """An SI run: per round, the drafts it paid for and the tokens it gained."""

    drafts: np.ndarray
    tokens: np.ndarray

    def cost(self, c, target: float = 1.0):
        """Time of the run, vectorised over c: every round pays its drafts and one target forward."""
        return self.drafts.sum() * np.asarray(c, dtype=float) + target * len(self.drafts)


def si_rounds(draws: np.ndarray, k: int, tokens: int) -> Rounds:
    """SI (Leviathan et al. 2023): draft min(k, left - 1) tokens, verify, gain accepted + 1 tokens.

    The round count is found with a cumulative sum: round i starts with tokens - gained[:i] left."""
    gained = np.cumsum(draws + 1)
    n_rounds = int(np.searchsorted(gained, tokens)) + 1  # first round whose total reaches `tokens`
    left = tokens - np.concatenate(([0], gained[: n_rounds - 1]))
    drafts = np.minimum(k, left - 1)
    # The last round may overshoot (accepted is drawn with lookahead k, not left - 1), as in the authors' code;
    # it only matters for the token count, never for the cost.
    return Rounds(drafts=drafts, tokens=draws[:n_rounds] + 1)


# ----------------------------------------------------------------------------------------------------- DSI


@dataclass(frozen=True)
class Windows:
    """A DSI run cut into speculation windows (a window ends with a rejection): per window, the drafts whose
    time counts and the tokens gained."""

    drafts: np.ndarray
    tokens: np.ndarray

    def cost(self, c, target: float = 1.0):
        """Time of the run, vectorised over c. A window costs its drafting plus one target forward (the wait
        for the verification that rejects), unless the target-only thread generating those tokens one by
        one is faster: DSI orchestrates both, so min(speculative, tokens x target)."""
        c = np.asarray(c, dtype=float)
        speculative = self.drafts[:, None] * c.reshape(1, -1) + target
        plain = self.tokens[:, None] * target
        total = np.minimum(speculative, plain).sum(axis=0)
        return total.reshape(c.shape) if c.ndim else float(total[0])


def dsi_windows(draws: np.ndarray, k: int, tokens: int) -> Windows:
    """DSI (Timor et al. 2024): drafts chunk after chunk of k while target servers verify the chunks in
    parallel. A fully accepted chunk costs only its drafting (k c), since its verification overlaps the next
    chunk's drafting; a rejected chunk costs the target forward we wait for, and ends the window with
    accepted + 1 tokens (the correction).

    Whose drafting is charged follows the authors' model: a rejected chunk's drafting counts when some of it
    was accepted, or when the chunk before it was fully accepted. A chunk rejected at its first draft right
    after a rejection costs only the target forward: the target, restarted from the correction, already
    computes that position while the drafter drafts (the target-only thread)."""
    drafts_per_window: list[int] = []
    tokens_per_window: list[int] = []
    draws = draws.tolist()  # plain ints: this loop runs ~10^6 times over a full heatmap
    i = done = 0
    previous_rejected = False  # the authors' `verified`: the last chunk ended a window
    while done < tokens:
        charged = gained = 0
        while True:
            chunk = min(k, tokens - 1 - done - gained)  # never draft the last token
            accepted = min(chunk, draws[i])
            i += 1
            gained += accepted
            if accepted > 0 or not previous_rejected:
                charged += chunk
            if chunk == 0 or accepted < chunk:  # a draft rejected (or nothing drafted)
                gained += 1
                previous_rejected = True
                break
            previous_rejected = False
        drafts_per_window.append(charged)
        tokens_per_window.append(gained)
        done += gained
    return Windows(np.asarray(drafts_per_window, dtype=np.int64), np.asarray(tokens_per_window, dtype=np.int64))


def servers_required(c: float, k: int) -> int:
    """Target servers DSI needs so that no chunk ever waits for one: a verification lasts 1 unit and a chunk
    is drafted every k c units (the paper's feasibility rule, same float expression as the authors')."""
    return math.ceil(1.0 / (max(1, k) * c))


# -------------------------------------------------------------------------------------------------- costs


@dataclass(frozen=True)
class Costs:
    """Mean time to generate `tokens` tokens, in target forwards (arrays when c is an array)."""

    nonsi: float
    si: np.ndarray | float
    dsi: np.ndarray | float


def simulate(
    c, a: float, k: int, tokens: int = PAPER_TOKENS, repeats: int = PAPER_REPEATS, seed: int = PAPER_SEED
) -> Costs:
    """Mean non-SI, SI and DSI costs of one (a, k) for one or many drafter latencies c (no feasibility
    check here: see `servers_required`)."""
    check_latency(c)
    check_acceptance(a)
    check_lookahead(k)
    c_arr = np.asarray(c, dtype=float)
    draws = paper_draws(a, k, tokens, repeats, seed)
    si = np.mean([si_rounds(d, k, tokens).cost(c_arr) for d in draws], axis=0)
    dsi = np.mean([dsi_windows(d, k, tokens).cost(c_arr) for d in draws], axis=0)
    if c_arr.ndim == 0:
        si, dsi = float(si), float(dsi)
    return Costs(nonsi=float(tokens), si=si, dsi=dsi)


def si_expected_tokens_per_round(a: float, k: int) -> float:
    """E[accepted + 1] = (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023, eq. 1)."""
    return float(k + 1) if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def proposition1_bound(t1: float, t2: float, p: float, n: int) -> float:
    """DSI paper, Proposition 1 (two models, lookahead 1): expected latency of generating n tokens is at most
    t1 p (n - 1) + t2 ((1 - p)(n - 1) + 1): the first token costs a target forward, every later one the
    drafter's forward if the draft was accepted, the target's otherwise."""
    return t1 * p * (n - 1) + t2 * ((1 - p) * (n - 1) + 1)


# ---------------------------------------------------------------------------------------------- heatmaps


def paper_grid(ndim: int = 20) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The authors' grid (`dsi/configs/heatmap.py`): c and a on linspace(0, 1, ndim + 1), c clipped below at
    0.01, a clipped to [0.01, 0.99]; lookaheads 1..ndim."""
    c = np.linspace(0, 1, ndim + 1)
    c = np.where(c <= 0.01, 0.01, c)
    a = np.linspace(0, 1, ndim + 1)
    a = np.clip(np.where(a <= 0.01, 0.01, a), None, 0.99)
    return np.unique(c), np.unique(a), np.arange(1, ndim + 1)


@dataclass(frozen=True)
class Heatmap:
    """Costs on a c x a x k grid. Infeasible DSI configurations are NaN."""

    c: np.ndarray
    a: np.ndarray
    k: np.ndarray
    si: np.ndarray  # [c, a, k]
    dsi: np.ndarray  # [c, a, k]
    nonsi: float

    def best(self, algorithm: str) -> np.ndarray:
        """[c, a] cost at the best lookahead; NaN where no lookahead was feasible."""
        cost = {"si": self.si, "dsi": self.dsi}[algorithm]
        best = np.where(np.isnan(cost), np.inf, cost).min(axis=2)
        return np.where(np.isinf(best), np.nan, best)

    def speedups(self) -> dict[str, np.ndarray]:
        """The paper's four heatmaps ([c, a] arrays), each algorithm at its best lookahead (Fig. 1 / Fig. 5):
        SI over non-SI, DSI over SI, DSI over non-SI, DSI over the better of SI and non-SI."""
        si, dsi = self.best("si"), self.best("dsi")
        baseline = np.minimum(si, self.nonsi)
        return {
            "si_vs_nonsi": self.nonsi / si,
            "dsi_vs_si": si / dsi,
            "dsi_vs_nonsi": self.nonsi / dsi,
            "dsi_vs_baseline": baseline / dsi,
        }

    def best_lookahead(self, algorithm: str) -> np.ndarray:
        """[c, a] lookahead minimising the cost; 0 where none was feasible."""
        cost = {"si": self.si, "dsi": self.dsi}[algorithm]
        filled = np.where(np.isnan(cost), np.inf, cost)
        return np.where(np.isinf(filled.min(axis=2)), 0, self.k[np.argmin(filled, axis=2)])


def heatmap(
    c_values,
    a_values,
    lookaheads,
    tokens: int = PAPER_TOKENS,
    repeats: int = PAPER_REPEATS,
    seed: int = PAPER_SEED,
    max_servers: int | None = PAPER_MAX_SERVERS,
    si_feasible_only: bool = True,
    progress: bool = False,
) -> Heatmap:
    """Mean SI and DSI costs over a grid.

    A (c, k) needing more than `max_servers` target servers is excluded for DSI (NaN). With
    `si_feasible_only` (the default, as in the authors' pipeline, which drops those configurations before
    simulating anything) SI is excluded there too, so both algorithms are minimised over the same lookaheads;
    pass False to let SI use every lookahead (it needs one target server only)."""
    c_values = np.asarray(c_values, dtype=float)
    a_values = np.asarray(a_values, dtype=float)
    lookaheads = np.asarray(lookaheads, dtype=int)
    check_latency(c_values)
    for a in a_values:
        check_acceptance(float(a))
    for k in lookaheads:
        check_lookahead(int(k))
    shape = (len(c_values), len(a_values), len(lookaheads))
    si = np.full(shape, np.nan)
    dsi = np.full(shape, np.nan)
    pairs: Iterable[tuple[int, int]] = [(ia, ik) for ia in range(len(a_values)) for ik in range(len(lookaheads))]
    if progress:
        from tqdm import tqdm

        pairs = tqdm(pairs, desc="simulating (a, k)", unit="cfg")
    for ia, ik in pairs:
        k = int(lookaheads[ik])
        costs = simulate(c_values, float(a_values[ia]), k, tokens, repeats, seed)
        si[:, ia, ik] = costs.si
        dsi[:, ia, ik] = costs.dsi
    if max_servers is not None:
        infeasible = np.array(
            [[servers_required(c, int(k)) > max_servers for k in lookaheads] for c in c_values]
        )  # [c, k]
        dsi[infeasible[:, None, :].repeat(len(a_values), axis=1)] = np.nan
        if si_feasible_only:
            si[infeasible[:, None, :].repeat(len(a_values), axis=1)] = np.nan
    return Heatmap(c=c_values, a=a_values, k=lookaheads, si=si, dsi=dsi, nonsi=float(tokens))


# ------------------------------------------------------------------------------------------------ Table 1


@dataclass(frozen=True)
class PairRow:
    target: str
    drafter: str
    dataset: str
    target_ms: float  # TPOT of the target (the paper's "Target Latency (ms)")
    drafter_ms: float  # TPOT of the drafter
    drafter_pct: float  # the paper's "Drafter Latency (%)", as printed
    acceptance: float
    paper_speedup: float  # the paper's "Speedup DSI vs. SI" (thread-pool simulation; see dsi_online.py)


# The DSI paper's Table 1 (Timor et al. 2024, arXiv 2405.14105 v1, section 4), all ten
# rows as printed: measured on one A100 80GB, 50 prompts x 20 tokens per model/dataset, TPOT in ms; acceptance
# rate = 1 - 1 / (1 + mean longest exact-match prefix over 256 drafted tokens). The models are named in the
# authors' `dsi/configs/table.py` (lmsys/vicuna-13b-v1.3, lmsys/vicuna-7b-v1.3, double7/vicuna-68m,
# bigcode/starcoder, bigcode/tiny_starcoder_py, microsoft/Phi-3-medium-128k-instruct, Phi-3-mini-128k-instruct).
PAPER_TABLE1 = (
    PairRow("Vicuna-13B", "Vicuna-68M", "CNN-DM", 37.7, 2.5, 6.5, 0.63, 1.47),
    PairRow("Vicuna-13B", "Vicuna-68M", "Alpaca", 33.3, 2.5, 7.4, 0.58, 1.41),
    PairRow("Vicuna-7B", "Vicuna-68M", "CNN-DM", 29.4, 2.5, 8.4, 0.67, 1.29),
    PairRow("Vicuna-7B", "Vicuna-68M", "Alpaca", 26.0, 2.5, 9.5, 0.59, 1.70),
    PairRow("Starcoder-15B", "Starcoder-168M", "HumanEval", 20.6, 6.8, 32.3, 0.93, 1.92),
    PairRow("Starcoder-15B", "Starcoder-168M", "MBPP", 21.0, 6.8, 32.9, 0.90, 1.66),
    PairRow("Phi3-14B", "Phi3-4B", "HumanEval", 52.1, 34.0, 65.3, 0.95, 1.41),
    PairRow("Phi3-14B", "Phi3-4B", "MBPP", 52.2, 34.3, 65.8, 0.94, 1.37),
    PairRow("Phi3-14B", "Phi3-4B", "CNN-DM", 52.4, 34.6, 66.0, 0.93, 1.39),
    PairRow("Phi3-14B", "Phi3-4B", "Alpaca", 49.6, 33.4, 67.4, 0.87, 1.60),
)
TABLE1_LOOKAHEADS = (1, 5, 10)


@dataclass(frozen=True)
class Choice:
    """One model's result on one row of Table 1 (this offline model's, or sim/table1.py's others): mean SI and DSI
    times (the model's own unit) and what each used."""

    si: float
    si_k: int
    dsi: float
    dsi_k: int
    dsi_servers: int

    @property
    def speedup(self) -> float:
        return self.si / self.dsi


def table1(
    rows=PAPER_TABLE1,
    lookaheads=TABLE1_LOOKAHEADS,
    max_servers: int = PAPER_MAX_SERVERS,
    tokens: int = PAPER_TOKENS,
    repeats: int = PAPER_REPEATS,
    seed: int = PAPER_SEED,
) -> list[Choice]:
    """DSI vs SI on measured pairs, one Choice per row: SI runs on one target server with its best lookahead; DSI on
    up to `max_servers` target servers with its best lookahead among those that fit."""
    results = []
    for row in rows:
        c = row.drafter_ms / row.target_ms
        si_best = dsi_best = (math.inf, 0)
        for k in lookaheads:
            costs = simulate(c, row.acceptance, k, tokens, repeats, seed)
            si_best = min(si_best, (float(costs.si), k))  # one drafter latency c: one cost
            if servers_required(c, k) <= max_servers:
                dsi_best = min(dsi_best, (float(costs.dsi), k))
        if dsi_best[1] == 0:
            raise ValueError(
                f"{row.target}/{row.drafter}: no lookahead in {lookaheads} fits {max_servers} target "
                f"servers (needs {servers_required(c, max(lookaheads))}); allow more servers"
            )
        results.append(Choice(si_best[0], si_best[1], dsi_best[0], dsi_best[1], servers_required(c, dsi_best[1])))
    return results
