"""The DSI paper's *online* (thread-pool) simulation, the one behind its Table 1, reproduced as an exact
discrete-event model (Timor et al. 2024, arXiv 2405.14105, section 4: "These results are based on simulations
with thread pools").

The authors' code (github.com/keyboardAnt/distributed-speculative-inference) sleeps instead of computing. Its
first version, `dsi/online/run/simulation_core.py` and `run_simulation.py` at commit 91ab8b9 (2024-07-01, the
nearest to the paper's Table 1, whose defaults are the paper's setup: 50 tokens, 7 target threads), works so:

- A run generates S tokens after a 100-token prompt. It is a sequence of *windows*; each window is a fresh
  drafter process (simulation_core.py:215-238, `restart_draft`), and a window ends when a verification rejects
  a draft (the process kills itself, :14-36) or the run reaches its S tokens.
- At the window's start one number is drawn: `correct`, the drafts this window will get accepted,
  min(G - 1, 20) with G ~ Geometric(1 - a) (:48-56, :170-174). Nothing else is random.
- The drafter sleeps TTFT once (the first draft of the run, :196-200) and TPOT per later draft, forever;
  a target call is issued at the window's start (draft count 0, :182-189) and after every k drafts (:204-212).
- DSI (`run_type="federated"`): each call goes to a `ThreadPoolExecutor(max_workers=N)` whose queue is made
  LIFO (:162-165). A call sleeps the target's TTFT the first time its thread index is used in the run, TPOT
  afterwards (:39-45, :59-80: "visited" is keyed by the thread's index and kept for the whole run).
  SI (`"livyatan"`): the same calls, made synchronously in the drafter's loop, so drafting stops meanwhile.
- A call issued after d drafts rejects when correct < d: the window gains `correct` tokens (no bonus token,
  :28-36, :98-102). Otherwise it accepts; if the window's tokens would then exceed S the run stops (:103-112).
- Time: wall time of the whole run minus the 0.1 s `wait_for_pipe` sleep of each window (run_simulation.py:
  96-102); the process start-up of each window stays in. Speedup DSI/SI = SI time / DSI time.
- The draw is made after `np.random.seed(int(time.time()))` (:52): every window that starts within the same
  wall-clock second draws the same `correct`. Windows are >= 0.1 s apart (the pipe wait), so a second holds a
  handful of windows, all with one value.

Later versions changed this (`Variant`): `main` (commit 2024206) draws `correct` independently per window from
one generator seeded 42 (dsi/online/simul/simul.py:18-32); `add_1_from_target` (commit 1fb0623) adds the target's
bonus token to every window and rejects when correct <= d (dsi/online/simul/core.py:27-35, :86-107 there).

Our model replays exactly these rules with a clock instead of sleeps, so it has no scheduling noise; what it
cannot know is the authors' per-window process start-up time (`restart_ms`, 0 unless measured) and the TTFTs
behind each Table 1 row (the paper prints TPOTs only; TTFT = TPOT unless given).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

ONLINE_TOKENS = 50  # S: "a simulation of generating 50 tokens" (paper, section 4); run_simulation.py:18
ONLINE_MAX_CORRECT = 20  # `draft_tokens_until_fail` (run_simulation.py:22)
ONLINE_REPEATS = 30  # `iter_count` (run_simulation.py:24)
ONLINE_PIPE_WAIT_S = 0.1  # `wait_for_pipe` (run_simulation.py:44): slept, then subtracted from the time
ONLINE_LOOKAHEADS = (1, 5, 10)  # paper, section 4: "multiple lookahead token values (namely 1, 5, and 10)"
ONLINE_SERVERS = (1, 7)  # paper, section 4: "different parallel target counts (namely 1 and 7)"


@dataclass(frozen=True)
class Variant:
    """Which version of the authors' online simulation to replay."""

    name: str
    per_second_draws: bool  # `correct` drawn after seeding with int(time.time()): one value per second
    bonus: bool  # a window gains correct + 1 tokens, rejects when correct <= d, stops at >= S


VARIANTS = {
    "paper": Variant("paper", per_second_draws=True, bonus=False),  # 91ab8b9, the paper's time
    "main": Variant("main", per_second_draws=False, bonus=False),  # 2024206 (main)
    "bonus": Variant("bonus", per_second_draws=False, bonus=True),  # 1fb0623 (add_1_from_target)
}


@dataclass(frozen=True)
class Latencies:
    """One target/drafter pair, in milliseconds: TPOT for every forward, TTFT for the first of each thread."""

    target_tpot_ms: float
    draft_tpot_ms: float
    target_ttft_ms: float | None = None  # None: the same as TPOT (the paper's Table 1 gives TPOT only)
    draft_ttft_ms: float | None = None

    def __post_init__(self):
        for name in ("target_tpot_ms", "draft_tpot_ms", "target_ttft_ms", "draft_ttft_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value} must be > 0 milliseconds")

    @property
    def target_first(self) -> float:
        return self.target_tpot_ms if self.target_ttft_ms is None else self.target_ttft_ms

    @property
    def draft_first(self) -> float:
        return self.draft_tpot_ms if self.draft_ttft_ms is None else self.draft_ttft_ms


@dataclass(frozen=True)
class OnlineSetup:
    latencies: Latencies
    acceptance: float
    lookahead: int
    servers: int | None  # None: SI (synchronous calls); N: DSI with an N-thread pool
    tokens: int = ONLINE_TOKENS
    max_correct: int = ONLINE_MAX_CORRECT
    variant: Variant = VARIANTS["paper"]
    restart_ms: float = 0.0  # process start-up per window, counted in the time (theirs: unknown)

    def __post_init__(self):
        if not 0 < self.acceptance <= 1:
            # Every version ends a run only from an *accepting* call (simulation_core.py:103-112), which needs
            # correct >= 1 (bonus: > the call's drafts): at a = 0 the authors' loop never ends.
            raise ValueError(
                f"acceptance {self.acceptance} must be in (0, 1]: at 0 no call ever accepts, and the "
                f"authors' simulation only stops a run from an accepting call (it loops forever)"
            )
        if int(self.lookahead) != self.lookahead or self.lookahead < 1:
            raise ValueError(f"lookahead {self.lookahead} must be an integer >= 1")
        if self.servers is not None and self.servers < 1:
            raise ValueError(f"servers {self.servers} must be >= 1 (None for SI)")
        if self.tokens < 1 or self.max_correct < 0 or self.restart_ms < 0:
            raise ValueError("tokens >= 1, max_correct >= 0 and restart_ms >= 0 are required")


# ------------------------------------------------------------------------------------------------- windows


def _rejects(setup: OnlineSetup, correct: int, drafts: int) -> bool:
    return correct <= drafts if setup.variant.bonus else correct < drafts


def _gain(setup: OnlineSetup, correct: int) -> int:
    return correct + 1 if setup.variant.bonus else correct


def _stops(setup: OnlineSetup, gained: int, correct: int) -> bool:
    """An accepting call ends the run when the window's tokens reach S (simulation_core.py:103-112)."""
    total = gained + _gain(setup, correct)
    return total >= setup.tokens if setup.variant.bonus else total > setup.tokens


@dataclass
class _Run:
    """State that outlives a window: tokens so far and the thread indices that already paid their TTFT."""

    gained: int = 0
    visited: set[int] = field(default_factory=set)

    def call_ms(self, setup: OnlineSetup, thread) -> float:
        if thread in self.visited:
            return setup.latencies.target_tpot_ms
        self.visited.add(thread)
        return setup.latencies.target_first


def _draft_times(setup: OnlineSetup, first_window: bool):
    """Completion times of drafts 1, 2, ... in a window (simulation_core.py:191-200)."""
    lat = setup.latencies
    t = lat.draft_first if first_window else lat.draft_tpot_ms
    while True:
        yield t
        t += lat.draft_tpot_ms


def si_window(setup: OnlineSetup, run: _Run, correct: int) -> tuple[float, bool]:
    """One SI window: (duration in ms, whether the run stopped). Calls are synchronous: the drafter waits."""
    t = 0.0
    drafts = 0
    first_window = run.gained == 0
    draft_ms = setup.latencies.draft_first if first_window else setup.latencies.draft_tpot_ms
    while True:
        t += run.call_ms(setup, "main")  # the call at draft count 0, then after every k drafts
        if _rejects(setup, correct, drafts):
            run.gained += _gain(setup, correct)
            return t, False
        if _stops(setup, run.gained, correct):
            return t, True
        for _ in range(setup.lookahead):
            t += draft_ms
            draft_ms = setup.latencies.draft_tpot_ms
        drafts += setup.lookahead


def dsi_window(setup: OnlineSetup, run: _Run, correct: int) -> tuple[float, bool]:
    """One DSI window on an N-thread pool with a LIFO queue: (duration in ms, whether the run stopped).

    ThreadPoolExecutor semantics (CPython 3.10 `concurrent/futures/thread.py`): a submission is taken by an idle
    thread if there is one, else starts a new thread (indices 0, 1, ... in order of creation) while fewer than
    N exist, else waits in the queue; a thread that finishes takes the newest waiting call."""
    n = setup.servers
    assert n is not None  # run() takes dsi_window only for DSI (servers set)
    k = setup.lookahead
    drafts = _draft_times(setup, run.gained == 0)
    done: list[tuple[float, int, int, int]] = []  # heap of (end, order, drafts of the call, thread index)
    waiting: list[int] = []  # drafts of queued calls; the newest is taken first
    idle: list[int] = []
    threads = 0
    order = 0

    def start(t: float, call_drafts: int, thread: int) -> None:
        nonlocal order
        heapq.heappush(done, (t + run.call_ms(setup, thread), order, call_drafts, thread))
        order += 1

    def submit(t: float, call_drafts: int) -> None:
        nonlocal threads
        if idle:
            start(t, call_drafts, idle.pop())
        elif threads < n:
            start(t, call_drafts, threads)
            threads += 1
        else:
            waiting.append(call_drafts)

    submit(0.0, 0)
    next_call = k
    next_submit = _nth(drafts, k)
    while True:
        if not done or next_submit < done[0][0]:  # a submission comes first (ties: the completion first)
            submit(next_submit, next_call)
            next_call += k
            next_submit = _nth(drafts, k)
            continue
        t, _, call_drafts, thread = heapq.heappop(done)
        if _rejects(setup, correct, call_drafts):
            run.gained += _gain(setup, correct)
            return t, False
        if _stops(setup, run.gained, correct):
            return t, True
        if waiting:
            start(t, waiting.pop(), thread)
        else:
            idle.append(thread)


def _nth(times, k: int) -> float:
    """Advance a draft-time iterator by k drafts and return the k-th time."""
    for _ in range(k):
        t = next(times)
    return t


# ------------------------------------------------------------------------------------------------- runs


class _Draws:
    """`correct` per window: independent draws, or one draw per wall-clock second (the paper's version)."""

    def __init__(self, setup: OnlineSetup, rng: np.random.Generator):
        self.setup, self.rng = setup, rng
        self.by_second: dict[int, int] = {}
        self.phase_s = float(rng.random())  # where in its second the run starts

    def _draw(self) -> int:
        a = self.setup.acceptance
        if a == 0:
            return 0
        if a == 1:
            return self.setup.max_correct
        return int(min(self.rng.geometric(1 - a) - 1, self.setup.max_correct))

    def correct(self, wall_s: float) -> int:
        if not self.setup.variant.per_second_draws:
            return self._draw()
        second = math.floor(self.phase_s + wall_s)
        if second not in self.by_second:
            self.by_second[second] = self._draw()
        return self.by_second[second]


@dataclass(frozen=True)
class RunResult:
    time_ms: float  # what the authors measure: sum of window times and restarts
    windows: int


def simulate_run(setup: OnlineSetup, rng: np.random.Generator) -> RunResult:
    """One run of S tokens."""
    run = _Run()
    draws = _Draws(setup, rng)
    window = si_window if setup.servers is None else dsi_window
    measured = wall_s = 0.0
    windows = 0
    while True:
        wall_s += ONLINE_PIPE_WAIT_S + setup.restart_ms / 1000  # the draw comes after the pipe wait
        correct = draws.correct(wall_s)
        dt, stopped = window(setup, run, correct)
        measured += setup.restart_ms + dt
        wall_s += dt / 1000
        windows += 1
        if stopped:
            return RunResult(measured, windows)


def mean_time_ms(setup: OnlineSetup, repeats: int = ONLINE_REPEATS, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    return float(np.mean([simulate_run(setup, rng).time_ms for _ in range(repeats)]))
