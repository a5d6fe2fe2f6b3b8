"""Event-driven simulator of speculative decoding with explicit devices: what the DSI paper's model leaves out.

The paper's simulator (`dsi_paper.py`) counts time units: a target forward costs 1 whatever its width, messages
are free, there is no prefill, and target servers never queue. Here a drafter and N target servers are explicit,
each with a KV cache, so the simulator can charge:
- a forward by its width (a `ForwardCost`): verifying k drafts is a forward of k + 1 tokens, and a DSI server that
  last verified chunk j - N must first catch up on every token since, in the same forward;
- a communication latency per message (drafts to a server, a verdict back, a rollback to the drafter), and a
  link latency for a drafter or target servers on other nodes (the messages paraspec's workers send per step);
- prefill on every replica (each DSI server holds its own copy of the prompt);
- queueing, when chunks are drafted faster than the servers verify them.

Strategies (the engine's names): `ar` (target alone), `sd` (draft k, verify, repeat), `amusd` (McDanel 2024: one
verifier works continuously on whatever has been drafted while the drafter keeps drafting up to `max_ahead`
tokens ahead; a rejection rolls the drafter back), `dsi` (Timor et al. 2024: chunks of k drafts go to N target
servers in parallel; a rejection preempts everything after it; a spare server runs the target alone from the
committed text, the paper's "non-SI thread", so DSI does not fall behind `ar` when it has a server to spare).

With the paper's idealisations (constant costs, no messages, no prefill) `ar` and `sd` agree with the paper's
model, and `dsi` agrees at a = 0 and a = 1 and meets Proposition 1 exactly for lookahead 1. Elsewhere it differs,
for reasons worth knowing (benchmarks/sim_event_vs_paper.py measures them):
- the paper's count of servers, ceil(1 / (k c)), leaves none for the non-SI thread its cost assumes; with exactly
  that many, DSI here can be as slow as SI (c = 0.5, a = 0.3, k = 5: 2.5x the paper's time); with one more it is
  never slower than the paper's model;
- and then up to ~14% faster: the paper charges the drafting of a chunk whose first draft is rejected right after
  an accepted chunk, although the previous verification already revealed it (c a (1 - a) per token at k = 1,
  exactly its gap to Proposition 1), and it races speculation against non-SI per window (min of the two), where
  here the non-SI thread's tokens also verify drafts.

Acceptance: each draft is independently the target's token with probability a (drawn when it is drafted),
which gives the paper's geometric number of accepted drafts per verification.

Positions: position 0 is the last token already known (the prompt's last token, or the first generated token
when prefill is simulated); the run generates positions 1..tokens. A model's cache holds positions < its `cache`.
The output is a `paraspec.trace.Trace`, as the engine records, so bench plots draw simulated and real runs alike.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from paraspec.sim.costs import ForwardCost
from paraspec.trace import Trace

STRATEGIES = ("ar", "sd", "amusd", "dsi")

# Messages across the link per step, as paraspec's workers exchange them on the network transport (each channel
# call is a request and its reply; runtime/net_channel.py), counted in the runtime (`benchmarks/multinode.py
# messages --link-ms L`: a = 0.8, lookahead 3): a draft token is one publish that brings the next read back with
# it (`publish_and_read`; a rollback needs no extra trip, `read_since` returns the whole sequence then): 1.01-1.05
# round trips per draft token in dsi; amusd's drafter adds waits at max_ahead (1.14 at 1 ms, 1.01 at 5 ms), which
# happen while it is ahead, off the critical path (the wait runs where the channel is and its reply brings the next
# read: `wait_below_ahead`), so they are not charged. A dsi chunk is a request to the server
# and its reply; an amusd verification waits for the drafts (a round trip), commits (the verdict is visible once
# that message lands), then receives the commit's reply and judges the next position in hand (a read and a commit
# when every draft was accepted): about 3.5 round trips. A verification's messages are counted as (before its
# verdict is visible, after): the drafter learns of a rejection when the commit lands, while the verifier is still
# busy with the rest.
DRAFT_MESSAGES = {"amusd": 2, "dsi": 2}
CHUNK_MESSAGES = (2, 0)
AMUSD_VERIFY_MESSAGES = (3, 4)


@dataclass(frozen=True)
class Setup:
    strategy: str
    target: ForwardCost
    draft: ForwardCost | None = None
    acceptance_rate: float = 0.0
    lookahead: int = 5  # sd, dsi: drafts per verification
    servers: int = 1  # dsi: target servers
    max_ahead: int | None = None  # amusd, dsi: uncommitted drafts allowed (amusd: 2 lookahead, dsi: (N+1) lookahead)
    verify_min: int = 1  # amusd: drafts the verifier waits for while the drafter can still add some
    comm_s: float = 0.0  # one message between devices
    target_prefill_s: float = 0.0  # 0: the prompt is already in every cache
    draft_prefill_s: float = 0.0
    target_only_thread: bool = True  # dsi: a spare server runs the target alone from the committed text
    preempt: bool = True  # a rollback cuts every forward in flight short (the papers' model); False:
    # the drafter and the target servers first finish it, as paraspec's workers do
    link_s: float = 0.0  # one message across nodes, on top of comm_s (the network transport)
    remote_draft: bool = False  # amusd, dsi: the drafter on another node than the caller
    remote_servers: int = 0  # amusd, dsi: the last N target servers (amusd: its target) on other nodes

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if self.strategy != "ar" and self.draft is None:
            raise ValueError(f"strategy {self.strategy!r} needs a draft forward cost")
        if not 0 <= self.acceptance_rate <= 1:
            raise ValueError(f"acceptance rate {self.acceptance_rate} must be in [0, 1]")
        if self.lookahead < 1:
            raise ValueError(f"lookahead {self.lookahead} must be >= 1")
        if self.servers < 1:
            raise ValueError(f"servers {self.servers} must be >= 1 (target servers for dsi)")
        if self.verify_min < 1:
            raise ValueError(f"verify_min {self.verify_min} must be >= 1")
        if self.max_ahead is not None and self.max_ahead < 1:
            raise ValueError(f"max_ahead {self.max_ahead} must be >= 1")
        if self.strategy == "dsi" and self.max_ahead is not None and self.max_ahead < self.lookahead:
            raise ValueError(
                f"max_ahead {self.max_ahead} < lookahead {self.lookahead}: a DSI chunk would never "
                f"fill; allow at least one chunk ahead"
            )
        if min(self.comm_s, self.target_prefill_s, self.draft_prefill_s, self.link_s) < 0:
            raise ValueError("latencies must be >= 0")
        if not 0 <= self.remote_servers <= (self.servers if self.strategy == "dsi" else 1):
            raise ValueError(
                f"remote_servers {self.remote_servers} must be between 0 and the number of target "
                f"servers ({self.servers if self.strategy == 'dsi' else 1})"
            )
        if (self.remote_draft or self.remote_servers) and self.strategy not in ("amusd", "dsi"):
            raise ValueError(f"{self.strategy} runs in the caller's process: it has no remote drafter or server")

    def server_link_s(self, i: int, servers: int) -> tuple[float, float]:
        """What crossing the link adds to one verification by target server i (of `servers`): before its verdict
        is visible, and after it (the server is still busy, nobody waits for it)."""
        if i < servers - self.remote_servers:
            return 0.0, 0.0
        before, after = AMUSD_VERIFY_MESSAGES if self.strategy == "amusd" else CHUNK_MESSAGES
        return before * self.link_s, after * self.link_s

    @property
    def draft_link_s(self) -> float:
        """What crossing the link adds to one draft token of a remote drafter."""
        return DRAFT_MESSAGES[self.strategy] * self.link_s if self.remote_draft else 0.0

    @property
    def ahead_limit(self) -> int:
        if self.max_ahead is not None:
            return self.max_ahead
        return 2 * self.lookahead if self.strategy == "amusd" else (self.servers + 1) * self.lookahead


@dataclass
class Result:
    tokens: int
    total_s: float
    ttft_s: float  # time of the first generated token
    trace: Trace
    drafts: int = 0  # drafts of positions not yet committed (a rollback may discard some)
    accepted: int = 0  # drafts committed
    rollbacks: int = 0
    verifications: int = 0  # target forwards that verified drafts (or generated, for ar)

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.total_s / self.tokens

    @property
    def tpot_ms(self) -> float:
        """Time per output token after the first, as the engine reports it."""
        return 1000 * (self.total_s - self.ttft_s) / max(1, self.tokens - 1)


def simulate(setup: Setup, tokens: int, seed: int = 0) -> Result:
    """Generate `tokens` tokens with `setup.strategy`; deterministic for a given seed."""
    if tokens < 1:
        raise ValueError(f"tokens={tokens} must be >= 1")
    rng = np.random.default_rng(seed)
    if setup.strategy == "ar":
        return _ar(setup, tokens)
    if setup.strategy == "sd":
        return _sd(setup, tokens, rng)
    return _Concurrent(setup, tokens, rng).run()


def mean_result(setup: Setup, tokens: int, repeats: int, seed: int = 0) -> tuple[float, float]:
    """Mean total seconds and mean TPOT (ms) over `repeats` seeds."""
    runs = [simulate(setup, tokens, seed + r) for r in range(repeats)]
    return float(np.mean([r.total_s for r in runs])), float(np.mean([r.tpot_ms for r in runs]))


# --------------------------------------------------------------------------------------------- prefill


def _prefill(setup: Setup, trace: Trace, targets: list[str], with_draft: bool) -> tuple[float, float, int]:
    """Prefill every replica in parallel. Returns (target ready, draft ready, first known position count)."""
    if setup.target_prefill_s == 0 and setup.draft_prefill_s == 0:
        return 0.0, 0.0, 1
    for name in targets:
        trace.add(name, "prefill", 0.0, setup.target_prefill_s)
    first = setup.target_prefill_s  # the target's prefill yields the first new token
    trace.commit(1, at_s=first)
    draft_ready = first
    if with_draft:
        trace.add("draft", "prefill", 0.0, setup.draft_prefill_s)
        draft_ready = max(setup.draft_prefill_s, first + setup.comm_s)  # and the drafter needs that token
    return first, draft_ready, 2


# ------------------------------------------------------------------------------------------------- ar


def _ar(setup: Setup, tokens: int) -> Result:
    trace = Trace(t0=0.0)
    t, _, known = _prefill(setup, trace, ["target"], with_draft=False)
    ttft = t if known == 2 else setup.target(1)
    end = tokens + 1
    forwards = 0
    while known < end:
        dt = setup.target(1)
        trace.add("target", "verify", t, t + dt, 1)  # target forwards are "verify" events in every strategy
        t += dt
        known += 1
        forwards += 1
        trace.commit(known - 1, at_s=t)
    return Result(tokens, t, ttft, trace, verifications=forwards)


# ------------------------------------------------------------------------------------------------- sd


def _sd(setup: Setup, tokens: int, rng: np.random.Generator) -> Result:
    """Leviathan et al. 2023, Algorithm 1: draft min(k, left - 1) tokens, verify them in one target forward
    of k + 1 tokens, keep the accepted prefix and the target's next token."""
    trace = Trace(t0=0.0)
    t_target, t_draft, known = _prefill(setup, trace, ["target"], with_draft=True)
    t = max(t_target, t_draft)
    ttft = t_target if known == 2 else None
    end = tokens + 1
    draft_cache = target_cache = known - 1
    draft = setup.draft
    assert draft is not None  # Setup requires one for every strategy but ar
    res = Result(tokens, 0.0, 0.0, trace)
    while known < end:
        n = min(setup.lookahead, end - known - 1)  # never draft the last token (the paper's curr_k)
        for i in range(n):  # the first forward also feeds tokens the drafter lacks
            width = known - draft_cache if i == 0 else 1
            dt = draft(width)
            trace.add("draft", "draft", t, t + dt, width)
            t += dt
        if n:
            draft_cache = known + n - 1
            t += setup.comm_s
        width = known + n - target_cache
        dt = setup.target(width)
        trace.add("target", "verify", t, t + dt, width)
        t += dt + (setup.comm_s if n else 0.0)
        ok = rng.random(n) < setup.acceptance_rate
        accepted = int(np.argmin(ok)) if not ok.all() else n
        res.drafts += n
        res.accepted += accepted
        res.verifications += 1
        res.rollbacks += accepted < n
        if accepted < n:
            trace.add("draft", "rollback", t, t, n - accepted)
        draft_cache = min(draft_cache, known + accepted)
        known += accepted + 1
        target_cache = known - 1
        if ttft is None:
            ttft = t
        trace.commit(known - 1, at_s=t)
    res.total_s, res.ttft_s = t, ttft if ttft is not None else t  # set at the first commit at the latest
    return res


# ------------------------------------------------------------------------------------------- amusd, dsi


@dataclass
class _Server:
    name: str
    cache: int
    task: int | None = None  # id of the running task, None when idle
    started: float = 0.0
    width: int = 0
    cache_before: int = 0  # the cache when the running task started (a cut-off task keeps it)
    free_at: float = 0.0  # busy until then after its last task's verdict (the link's last messages)

    def idle(self, t: float) -> bool:
        return self.task is None and t >= self.free_at


@dataclass
class _Task:
    kind: str  # "chunk" (verify drafts) or "solo" (the target-only thread)
    server: int
    first: int  # chunk: first drafted position; solo: the position it generates
    last: int  # chunk: one past the last drafted position; solo: == first
    trim: int | None = None  # preempt=False: rolled back to here while running; its result is void


@dataclass
class _Concurrent:
    """AMUSD and DSI: a drafter and target servers working at the same time, driven by an event queue."""

    setup: Setup
    tokens: int
    rng: np.random.Generator
    trace: Trace = field(default_factory=lambda: Trace(t0=0.0))

    def run(self) -> Result:
        s = self.setup
        n_servers = s.servers if s.strategy == "dsi" else 1
        names = [f"target#{i}" for i in range(n_servers)] if s.strategy == "dsi" else ["target"]
        ready_target, ready_draft, self.known = _prefill(s, self.trace, names, with_draft=True)
        self.ttft = ready_target if self.known == 2 else None
        self.end = self.tokens + 1
        self.t = 0.0
        self.truth: set[int] = set()  # positions >= known whose target token is known
        self.drafts: dict[int, bool] = {}  # position -> the draft there is the target's token
        self.servers = [_Server(n, cache=self.known - 1) for n in names]
        self.server_ready = ready_target
        self.tasks: dict[int, _Task] = {}
        self.queue: deque[tuple[int, int]] = deque()  # dsi: drafted chunks waiting for a server
        self.chunk_start = self.known  # dsi: first position of the chunk being drafted
        self.chain_end = self.known  # next position the drafter drafts
        self.draft_cache = self.known - 1
        self.draft_gen = 0  # the drafter's forward in flight is stale when this moved on
        self.draft_busy = False
        self.draft_free_at = ready_draft
        self.draft_event: tuple[float, float, int] | None = None  # (start, end, width) of a forward in flight
        self.heap: list = []
        self.ids = itertools.count()
        self.result = Result(self.tokens, 0.0, 0.0, self.trace)
        self._at(ready_draft, self._drafter_wake, 0)
        self._at(ready_target, self._schedule)
        while self.known < self.end and self.heap:
            self.t, _, fn, args = heapq.heappop(self.heap)
            fn(*args)
        if self.known < self.end:
            raise RuntimeError("simulation stalled before generating every token")  # a bug, not bad input
        self.result.total_s = self.t
        self.result.ttft_s = self.ttft if self.ttft is not None else self.t
        return self.result

    # -- plumbing
    def _at(self, when: float, fn, *args) -> None:
        heapq.heappush(self.heap, (when, next(self.ids), fn, args))

    # -- the drafter
    def _drafter_wake(self, gen: int) -> None:
        if gen != self.draft_gen:
            return  # a later rollback rescheduled the drafter
        self.draft_busy = False
        self._start_draft()

    def _start_draft(self) -> None:
        if self.draft_busy or self.t < self.draft_free_at:
            return
        pos = max(self.chain_end, self.known)  # text committed meanwhile is simply input
        if pos >= self.end - 1 or pos - self.known >= self.setup.ahead_limit:
            return  # nothing left worth drafting, or far enough ahead
        width = pos - self.draft_cache
        assert self.setup.draft is not None  # Setup requires one for every strategy but ar
        dt = self.setup.draft(width) + self.setup.draft_link_s
        self.draft_busy = True
        self.draft_event = (self.t, self.t + dt, width)
        self._at(self.t + dt, self._draft_done, self.draft_gen, pos)

    def _draft_done(self, gen: int, pos: int) -> None:
        if gen != self.draft_gen:
            return  # preempted by a rollback
        assert self.draft_event is not None  # set by _start_draft, which scheduled this
        start, end, width = self.draft_event
        self.trace.add("draft", "draft", start, end, width)
        self.draft_event = None
        self.draft_busy = False
        self.draft_cache = pos
        self.chain_end = pos + 1
        if pos >= self.known:  # else the target got there first: nothing to add
            self.drafts[pos] = bool(self.rng.random() < self.setup.acceptance_rate)
            self.result.drafts += 1
            full = pos + 1 - self.chunk_start >= self.setup.lookahead
            if self.setup.strategy == "dsi" and (full or pos + 1 >= self.end - 1):  # the last chunk may be short
                self.queue.append((self.chunk_start, pos + 1))
                self.chunk_start = pos + 1
            if pos in self.truth:  # its verdict was already computed
                self._commit()
        self._schedule()

    # -- the target servers
    def _schedule(self) -> None:
        """Give idle servers work (chunks first, then the target-only thread) and keep the drafter busy."""
        if self.t >= self.server_ready:
            while True:
                idle = [i for i, server in enumerate(self.servers) if server.idle(self.t)]
                chunk = self._next_chunk() if idle else None
                if chunk is None:
                    break
                # the idle server with the freshest cache has the fewest tokens to catch up on
                self._start_chunk(max(idle, key=lambda i: self.servers[i].cache), *chunk)
            idle = [i for i, server in enumerate(self.servers) if server.idle(self.t)]
            if idle:
                self._start_solo(max(idle, key=lambda i: self.servers[i].cache), len(idle))
        self._start_draft()

    def _next_chunk(self) -> tuple[int, int] | None:
        if self.setup.strategy == "dsi":
            while self.queue and self.queue[0][1] < self.known:
                self.queue.popleft()  # committed meanwhile (by the target-only thread)
            return self.queue.popleft() if self.queue else None
        # AMUSD's verifier takes everything drafted and not yet verified: at least one draft, and at least
        # `verify_min` while the drafter can still add some
        first = self.known
        pending = self.chain_end - first if first in self.drafts else 0
        can_extend = max(self.chain_end, first) < self.end - 1 and pending < self.setup.ahead_limit
        if pending < 1 or (can_extend and pending < self.setup.verify_min):
            return None
        return first, first + pending

    def _start_chunk(self, i: int, first: int, last: int) -> None:
        width = last - self.servers[i].cache  # catch-up tokens + the token before the chunk + drafts
        before, after = self.setup.server_link_s(i, len(self.servers))
        dt = self.setup.comm_s + self.setup.target(width) + self.setup.comm_s + before
        self._run(i, _Task("chunk", i, first, last), width, dt, after)

    def _start_solo(self, i: int, idle: int) -> None:
        """The target alone generates the next position from the committed text (DSI's non-SI thread)."""
        s = self.setup
        if self.known >= self.end:
            return
        # It only uses a server while another stays free for the next chunk, so it never delays verification;
        # and it always runs when nothing is left to draft (a rejection just before the end).
        nothing_to_draft = max(self.chain_end, self.known) >= self.end - 1 and self.known not in self.drafts
        if not (s.strategy == "dsi" and s.target_only_thread and idle >= 2) and not nothing_to_draft:
            return
        # One at a time, and only where no verification in flight will deliver this position sooner.
        if any(t.trim is None and (t.kind == "solo" or t.first <= self.known <= t.last) for t in self.tasks.values()):
            return
        server = self.servers[i]
        width = self.known - server.cache
        before, after = s.server_link_s(i, len(self.servers))
        self._run(i, _Task("solo", i, self.known, self.known), width, s.target(width) + s.comm_s + before, after)

    def _run(self, i: int, task: _Task, width: int, dt: float, after: float = 0.0) -> None:
        """Server i runs `task`: its verdict is visible after `dt`, and the server is free `after` later."""
        tid = next(self.ids)
        server = self.servers[i]
        server.task, server.started, server.width, server.cache_before = tid, self.t, width, server.cache
        server.free_at = self.t + dt + after
        self.tasks[tid] = task
        self._at(self.t + dt, self._task_done, tid)
        if after:
            self._at(server.free_at, self._schedule)

    def _finish(self, tid: int) -> _Task:
        task = self.tasks.pop(tid)
        server = self.servers[task.server]
        self.trace.add(server.name, "verify", server.started, self.t, server.width)
        server.task = None
        server.cache = task.last if task.kind == "chunk" else task.first
        return task

    def _task_done(self, tid: int) -> None:
        if tid not in self.tasks:
            return  # cancelled by a rollback
        task = self._finish(tid)
        if task.trim is not None:  # overtaken by a rollback while it ran: drop it
            self.servers[task.server].cache = min(self.servers[task.server].cache, task.trim)
            self._schedule()
            return
        self.result.verifications += 1
        if task.kind == "solo":
            if task.first >= self.known:
                self.truth.add(task.first)
        else:
            # The forward saw the token before `first` and the drafts; it yields the target's token for
            # first..last, each valid while every input before it was right.
            for pos in range(task.first, task.last + 1):
                if pos >= self.known:
                    self.truth.add(pos)
                if pos < task.last and pos >= self.known and not self.drafts.get(pos, True):
                    break
        self._commit()
        self._schedule()

    # -- committing and rolling back (a rollback cancels every task: results built on a wrong draft never land)
    def _commit(self) -> None:
        start = self.known
        while self.known in self.truth and self.known < self.end:
            pos = self.known
            self.truth.discard(pos)
            draft_ok = self.drafts.pop(pos, None)
            self.known += 1
            if draft_ok:
                self.result.accepted += 1
            elif draft_ok is False:  # the target's token replaces a wrong draft
                self._rollback(pos)
        if self.known > start:
            if self.ttft is None:
                self.ttft = self.t
            self.trace.commit(self.known - 1, at_s=self.t)
            for tid, task in list(self.tasks.items()):  # a target-only step the speculation overtook
                if task.kind == "solo" and task.first < self.known:
                    self._cancel(tid)

    def _cancel(self, tid: int) -> None:
        task = self._finish(tid)
        server = self.servers[task.server]
        server.cache = server.cache_before  # a cut-off forward leaves nothing usable behind
        server.free_at = self.t

    def _rollback(self, pos: int) -> None:
        """A wrong draft at `pos`: drop every speculation built on it (DSI preempts those threads)."""
        self.result.rollbacks += 1
        dropped = [p for p in self.drafts if p > pos]
        for p in dropped:
            del self.drafts[p]
        self.trace.add("draft", "rollback", self.t, self.t + self.setup.comm_s, len(dropped) + 1)
        self.truth = {p for p in self.truth if p <= pos}
        self.queue.clear()
        for tid, task in list(self.tasks.items()):
            if self.setup.preempt:
                self._cancel(tid)
            else:  # the server finishes this forward, then rolls back
                task.trim = pos if task.trim is None else min(task.trim, pos)
        for server in self.servers:
            server.cache = min(server.cache, pos)  # `pos` held the wrong draft
        # the drafter hears of it one message later; a forward it has in flight is wasted
        self.draft_gen += 1
        self.draft_busy = True
        self.draft_free_at = self.t + self.setup.comm_s
        if self.draft_event is not None:
            start, end, width = self.draft_event
            if not self.setup.preempt:
                self.draft_free_at = max(end, self.draft_free_at)
            self.trace.add("draft", "draft", start, min(end, self.draft_free_at), width)
            self.draft_event = None
        self._at(self.draft_free_at, self._drafter_wake, self.draft_gen)
        self.draft_cache = min(self.draft_cache, pos)
        self.chain_end = self.chunk_start = pos + 1
