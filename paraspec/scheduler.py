"""Many requests at once: one Scheduler owns the steps. Each request decodes on a Seat (one sequence of each model,
strategies/base.py) with its strategy's own loop, unchanged, in its own thread; every forward it asks of a model
is handed to the Scheduler, whose thread runs the step:

    requests join (their seat's sequences: their KV caches, their rollbacks) and leave (a later request moves into
    the gap, keeping the running sequences 0, 1, 2, ...)
    each step (the scheduler's thread, once every request that is computing has asked):
        order      the draft models' asks, if any, run in a step of their own; the target's wait for it, so the
                   requests that draft do so in the same steps, and verify together in one forward (a request
                   drafting k tokens holds the others back by k draft-model forwards, not k steps of theirs)
        schedule   per model, the asks that may share a forward (a few tokens on a sequence that has its prompt,
                   rows the load-time probe found exact beside others) packed into as few forwards as the width
                   allows, or into more where the forwards' timed costs say several cost less than one (packs());
                   the others (a width outside the probe's) alone; a prompt's next chunk alone (its
                   prompt_steps: the same forwards as alone, so the same KV cache, but no request waits for a whole
                   prompt: the others' steps run between its chunks)
        run        one forward per group (one llama_decode; one pass of the native decoder)
        hand back  each ask its rows; its request goes on with its own acceptance, sampling and commit
    a request waiting on its reader is idle: a step waits for it only briefly (READER_GRACE of a step: a reader
    handed a token comes back within milliseconds, and a request that misses a step loses a whole step), and not at
    all for a stream not being read

Admission (which request gets which seat, how many run) is the Engine's RequestGate, and nothing else's.

Why every answer is bit-identical to the same request run alone: a request's loop, its generator and its drafters
are its own, and a row's logits do not depend on which rows share its forward -- where the load-time probe found
so for these kernels on this CPU (models.base.Sequences: batch_exact, min_shared_width, exact_width, measured with
forwards of the widths this scheduler builds). Where it did not, every ask runs alone: requests still interleave,
one forward each. A draft on llama.cpp's fastest kernels (not batch-invariant) shares its forwards too, except a
seeded sampled request's (Member.repeatable): a greedy answer is the target's whatever the draft proposed, and
only a seeded one promises to repeat.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from paraspec.drafters.adaptive import Load
from paraspec.models.base import Sequences
from paraspec.strategies.base import Seat

TIMINGS_KEPT = 64  # forwards a view remembers for the adaptive rule (SequenceView.take_timings)
STEP_COST_EMA = 0.3  # weight of a new timing of a shared forward's shape (Scheduler.step_costs)
READER_GRACE = 0.1  # a step waits for a request whose reader holds its last commit this share of the last step's
# seconds: a reader handed a token (a server's thread emitting it) is back within milliseconds, and a request that
# misses a step waits a whole step for its next token while that step runs with a row less
SPLIT_SHARE = 0.95  # a step's shareable asks run as several forwards only where those cost at most this share of
# the fewest forwards (timings drift: a split must be clearly cheaper)


@dataclass(eq=False)
class _Ask:
    model: Sequences
    sequence_id: int
    tokens: list[int]
    outputs: int  # rows wanted: the last `outputs` tokens'
    alone: bool  # a prompt, or a width the probe did not find exact beside others
    prompt: int = 0  # its first `prompt` tokens are a prompt into the empty cache, run one forward per step
    steps: Generator | None = None  # the prompt's forwards still to run (Sequences.prompt_steps)
    carried: int = 0  # rows its last prompt forward carried
    timing: tuple[int, float] | None = None  # the rows and seconds of the forward that carried it
    result: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


@dataclass(eq=False)
class _Job:
    """Set-up work run on the scheduler's thread between steps (Scheduler.call)."""

    fn: Callable
    result: Any = None
    error: BaseException | None = None
    done: bool = False


@dataclass(eq=False)
class Member:
    """One running request: its seat, whether it is computing (its forwards are awaited) and what it asks now."""

    seat: Seat
    # its answer must repeat as alone (a seeded sampled request): on a model whose rows depend on which rows share
    # their forward (a draft on llama.cpp's fastest kernels) its forwards run alone; a greedy answer is the target's
    # whatever the draft proposed, and an unseeded one promises no repeat, so theirs are shared
    repeatable: bool = False
    computing: bool = True
    idle_since: float = 0.0  # when its reader took its last commit (perf_counter), while it is not computing
    ask: _Ask | None = None
    rows: dict = field(default_factory=dict)  # per model (id): tokens of its last shareable ask


@dataclass
class BatchStats:
    steps: int = 0  # forwards shared by several requests' asks, and forwards run alone
    shared_rows: int = 0  # rows of the shared forwards
    last_rows: int = 0  # rows of the last step's forwards (/metrics: batch rows per step)
    widths: dict = field(default_factory=dict)  # requests per shared forward -> count
    moves: int = 0  # requests moved to a lower sequence when another left
    prompt_steps: int = 0  # forwards of prompts (a prompt's chunks, one per step)


class Scheduler:
    """The steps of one Engine's requests over its models of several sequences (see the module docstring)."""

    def __init__(self, target: Sequences, draft_models: list[Sequences]):
        self._cv = threading.Condition()
        self._members: list[Member] = []
        self._jobs: deque[_Job] = deque()  # set-up work for this thread (call)
        self._stepping = False
        self._closed = False
        self._lock = threading.Lock()  # one call into the models at a time (a step, a rollback, a move)
        self.stats = BatchStats()
        # per model (id): seconds of a shared forward by its shape (asks, rows), as this scheduler timed them: where
        # several forwards of fewer asks cost less than one of them all, a step's asks are split (packs())
        self.step_costs: dict[int, dict[tuple[int, int], float]] = {}
        self.last_step_s = 0.0  # seconds the last step took: a reader's grace is READER_GRACE of it (grace_s)
        self._target = target
        self.seats = []
        for sequence_id in range(target.n_seqs):
            view = SequenceView(self, target, sequence_id)
            drafts = [SequenceView(self, m, sequence_id) for m in draft_models]
            self.seats.append(
                Seat(view, drafts, load=view.shared_load, split=view.step_forwards, timed=SequenceView.take_timings)
            )
        # the steps run here; started by the thread that set the models up, so it inherits its core pinning
        self._thread = threading.Thread(target=self._loop, daemon=True, name="paraspec-scheduler")
        self._thread.start()

    # -- membership ----------------------------------------------------------------------------------------------
    @staticmethod
    def order(seat: Seat) -> int:
        """Where a free seat stands in line (RequestGate takes the lowest): its sequence number."""
        return seat.target.sequence_id

    def join(self, seat: Seat, repeatable: bool = False) -> Member:
        member = Member(seat, repeatable=repeatable)
        with self._cv:
            for view in (seat.target, *seat.draft_models):
                view.member = member
            self._members.append(member)
        return member

    @contextmanager
    def seated(self, seat: Seat, repeatable: bool = False):
        """A request's membership of the steps while it decodes on `seat` (join, then leave however it ends)."""
        member = self.join(seat, repeatable)
        try:
            yield member
        finally:
            self.leave(member)

    def leave(self, member: Member) -> None:
        """The request ends: the running request on the highest sequence moves into its sequences (caches copied,
        its seat's views renumbered), so that the running sequences stay 0, 1, 2, ... and decode in one micro-batch
        (llama.cpp puts sequences in one micro-batch only while their ids follow each other)."""
        # one hold between steps for the choice and the move: a step run between them could start the chosen
        # request's prompt, whose remaining forwards are bound to its sequence (prompt_steps), or another request
        # could leave and move it first
        with self._between_steps():
            if member in self._members:
                self._members.remove(member)
            self._cv.notify_all()  # the others may all have asked already
            top = max(self._members, key=lambda m: self.order(m.seat), default=None)
            # not in the middle of its prompt: its remaining forwards are bound to its sequence (prompt_steps)
            prompting = top is not None and top.ask is not None and top.ask.steps is not None and not top.ask.done
            if top is not None and self.order(top.seat) > self.order(member.seat) and not prompting:
                self._move(top.seat, member.seat)

    @contextmanager
    def idle(self, member: Member | None):
        """While a request waits on its reader, the others' steps do not wait for its ask."""
        if member is None:
            yield
            return
        with self._cv:
            member.computing, member.idle_since = False, time.perf_counter()
            self._cv.notify_all()
        try:
            yield
        finally:
            with self._cv:
                member.computing = True

    def _move(self, source: Seat, target: Seat) -> None:
        """Between steps (the caller holds them: _between_steps): the request on `source` goes on on `target`'s
        sequences (free: its request has left), its caches moved there (Sequences.move_sequence) and an ask it has
        posted rewritten; the two seats' views swap sequence numbers."""
        for src, dst in zip((source.target, *source.draft_models), (target.target, *target.draft_models)):
            src.model.move_sequence(src.sequence_id, dst.sequence_id)
            if src.member is not None and src.member.ask is not None and src.member.ask.model is src.model:
                src.member.ask.sequence_id = dst.sequence_id
            src.sequence_id, dst.sequence_id = dst.sequence_id, src.sequence_id
        self.stats.moves += 1

    # -- what a request's views ask ------------------------------------------------------------------------------
    @contextmanager
    def _between_steps(self):
        """Hold the scheduler between steps: no step runs (none starts), no model call is in flight."""
        with self._cv:
            while self._stepping:
                self._cv.wait()
            with self._lock:
                yield

    def length(self, view: SequenceView) -> int:
        with self._cv:  # not while its sequence moves
            return view.model.length_of(view.sequence_id)

    def rollback(self, view: SequenceView, length: int) -> None:
        with self._between_steps():
            view.model.rollback(length, view.sequence_id)

    def keep_path(self, view: SequenceView, prefix_len: int, slots: list[int]) -> None:
        with self._between_steps():
            view.model.keep_path(prefix_len, slots, sequence_id=view.sequence_id)

    def forward(self, view: SequenceView, tokens: list[int], outputs: int, prefill: bool = False) -> torch.Tensor:
        """The rows a forward of `tokens` on the view's sequence gives (the last `outputs`), run in the next step."""
        member, model = view.member, view.model
        assert member is not None  # the Engine joins the request before it decodes
        with self._cv:
            if self._closed:
                raise RuntimeError("the Engine's scheduler is closed")
            sequence_id, empty = view.sequence_id, model.length_of(view.sequence_id) == 0
            if not prefill:  # this request's own errors, raised here, not in the step
                model.check_forward(tokens, sequence_id)
            # into an empty cache, the tokens up to the first wanted row are a prompt, run as the model's own forward
            # runs it: its prompt_steps, then the rest
            head = len(tokens) - outputs + 1
            prompt = len(tokens) if prefill else head if empty and model.splits_prompts and head > 1 else 0
            exact_rows = model.batch_exact or (not model.exact and not member.repeatable)
            shareable = (
                not prompt and exact_rows and not empty and model.min_shared_width <= len(tokens) <= model.exact_width
            )
            ask = _Ask(model, sequence_id, list(tokens), outputs, alone=not shareable, prompt=prompt)
            member.rows[id(model)] = len(tokens) if shareable else 0
            member.ask = ask
            self._cv.notify_all()
            while not ask.done:
                self._cv.wait()
        if ask.error is not None:
            raise ask.error
        assert ask.result is not None  # a step sets one of error and result
        if ask.timing is not None:
            view.timings.append(ask.timing)
        return ask.result

    def shared_load(self, view: SequenceView) -> Load:
        """What each other computing request brings to a step of the view's model: the tokens of its last shareable
        ask on it, or the rows of its prompt's next forward (alone; before its first, the prompt up to n_batch): what
        the adaptive rule prices a busy step by (drafters/adaptive.best_length)."""
        with self._cv:
            others = [m for m in self._members if m is not view.member and m.computing]
            rows = [m.rows.get(id(view.model), 0) for m in others]
            apart = [
                m.ask.carried or min(m.ask.prompt, view.model.n_batch)
                for m in others
                if m.ask is not None and m.ask.model is view.model and m.ask.prompt and not m.ask.done
            ]
            return Load(tuple(r for r in rows if r), tuple(apart))

    def call(self, fn: Callable[[], Any]) -> Any:
        """fn() on the scheduler's thread between steps: its result, or its exception raised here. For set-up work
        that runs the models' forwards (timing them for the adaptive rule): a forward run from another thread starts
        an OpenMP pool there, and beside the pool that runs the steps it throttles both
        (docs/LLAMACPP.md, "Threads and OpenMP pools"), so such a timing would price every forward too high."""
        job = _Job(fn)
        with self._cv:
            if self._closed:
                raise RuntimeError("the Engine's scheduler is closed")
            self._jobs.append(job)
            self._cv.notify_all()
            while not job.done:
                self._cv.wait()
        if job.error is not None:
            raise job.error
        return job.result

    # -- the scheduler's thread ----------------------------------------------------------------------------------
    def grace_s(self) -> float:
        """How long a step waits for a request whose reader holds its last commit (READER_GRACE of a step)."""
        return READER_GRACE * self.last_step_s

    def _waiting_for(self, now: float) -> float | None:
        """None when a step can run: someone asked, every request that is computing has (a prompt's ask stays asked
        until its last chunk has run), and no idle request's reader is within its grace. Otherwise the seconds to
        wait before looking again: the grace left, or inf (until a request asks or goes idle)."""
        asked = [m for m in self._members if m.ask is not None and not m.ask.done]
        if not asked or any(m.computing and m not in asked for m in self._members):
            return float("inf")
        grace = self.grace_s()
        left = [m.idle_since + grace - now for m in self._members if not m.computing and m not in asked]
        wait = max(left, default=0.0)
        return wait if wait > 0 else None

    def _loop(self) -> None:
        with self._cv:
            while True:
                while not (self._closed or self._jobs):
                    wait = self._waiting_for(time.perf_counter())
                    if wait is None:
                        break
                    self._cv.wait(None if wait == float("inf") else wait)
                if self._closed:
                    return
                if self._jobs:
                    self._released(self._run_job, self._jobs.popleft())
                    continue
                asks = [m.ask for m in self._members if m.ask is not None and not m.ask.done]
                # the draft models' asks first, on their own: the target's asks wait for every request drafting
                # now to finish its draft, so requests draft in the same steps and verify together (the rule prices
                # a draft model's rounds so: drafters/adaptive.best_length)
                asks = [a for a in asks if a.model is not self._target] or asks
                self._released(self._run_step, asks)

    def _released(self, work: Callable, arg) -> None:
        """work(arg) with _cv released (the loop holds it) and the scheduler marked stepping meanwhile."""
        self._stepping = True
        self._cv.release()
        try:
            work(arg)
        finally:
            self._cv.acquire()
            self._stepping = False
            self._cv.notify_all()

    def _run_step(self, asks: list[_Ask]) -> None:
        start = time.perf_counter()
        try:
            self._step(asks)
            self.last_step_s = time.perf_counter() - start
        except BaseException as e:  # noqa: BLE001 -- a fault of the step itself: each asker raises it
            for a in asks:
                if not a.done:
                    a.error, a.done = e, True

    def _run_job(self, job: _Job) -> None:
        """A call()'s work, between steps."""
        try:
            with self._lock:
                job.result = job.fn()
        except BaseException as e:  # noqa: BLE001 -- raised in the caller
            job.error = e
        finally:
            job.done = True

    def _step(self, asks: list[_Ask]) -> None:
        """Run every ask of this step: the shareable ones of each model in as few forwards as their widths allow,
        the rest alone. An error fails the asks of the forward that raised it (each one's request raises it)."""
        with self._lock:
            rows = 0
            for model in {id(a.model): a.model for a in asks}.values():
                # by sequence: a pack of them is then a run of consecutive sequences (llama.cpp's one micro-batch)
                shared = sorted((a for a in asks if a.model is model and not a.alone), key=lambda a: a.sequence_id)
                costs = self.step_costs.setdefault(id(model), {})
                for group in packs(shared, lambda a: len(a.tokens), model.exact_width, model.n_batch, costs):
                    width = sum(len(a.tokens) for a in group)
                    self._run(
                        group,
                        width,
                        lambda g=group, m=model: m.forward_batch([(a.sequence_id, a.tokens, a.outputs) for a in g]),
                    )
                    timing, shape = group[0].timing, (len(group), width)  # (a timing only where the forward ran)
                    if timing is not None:
                        old = costs.get(shape)
                        costs[shape] = timing[1] if old is None else old + STEP_COST_EMA * (timing[1] - old)
                    rows += width
                    self.stats.shared_rows += width
                    self.stats.widths[len(group)] = self.stats.widths.get(len(group), 0) + 1
                    self.stats.steps += 1
            for a in asks:
                if a.prompt:
                    rows += self._prompt_step(a)
                    self.stats.steps += 1
                elif a.alone:
                    self._run(
                        [a],
                        len(a.tokens),
                        lambda a=a: [a.model.forward(a.tokens, last_n=a.outputs, sequence_id=a.sequence_id)],
                    )
                    rows += len(a.tokens)
                    self.stats.steps += 1
            self.stats.last_rows = rows

    def _prompt_step(self, a: _Ask) -> int:
        """The next forward of a prompt's ask; after its last, the tokens after the prompt (as the model's forward
        runs them) and the ask is done. Returns the rows it carried."""
        before = a.model.length_of(a.sequence_id)
        try:
            if a.steps is None:
                a.steps = a.model.prompt_steps(a.tokens[: a.prompt], a.sequence_id)
            next(a.steps)
        except StopIteration as finished:  # the prompt's last row [1, vocab], then the rows of the tokens after it
            rest = a.tokens[a.prompt :]
            after = [a.model.forward(rest, last_n=a.outputs - 1, sequence_id=a.sequence_id)] if rest else []
            a.result, a.done = torch.cat([finished.value, *after]), True
        except BaseException as e:  # noqa: BLE001 -- handed to the asking request, raised there
            a.error, a.done = e, True
        self.stats.prompt_steps += 1
        a.carried = max(0, a.model.length_of(a.sequence_id) - before)
        return a.carried

    @staticmethod
    def _run(group: list[_Ask], rows: int, forward) -> None:
        """One forward of the group's asks (`rows` tokens in all): each ask its result and the forward's timing."""
        try:
            start = time.perf_counter()
            results = forward()
            timing = (rows, time.perf_counter() - start)
            for a, result in zip(group, results):
                a.result, a.timing = result, timing
        except BaseException as e:  # noqa: BLE001 -- handed to each asking request, raised there
            for a in group:
                a.error = e
        for a in group:
            a.done = True

    def close(self) -> None:
        """Stop the scheduler's thread (the Engine's requests have ended); idempotent."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(10)
        with self._cv:  # an ask no step will run (a request still decoding when the Engine closed) raises
            for m in self._members:
                if m.ask is not None and not m.ask.done:
                    m.ask.error, m.ask.done = RuntimeError("the Engine was closed while this forward waited"), True
            while self._jobs:
                job = self._jobs.popleft()
                job.error, job.done = RuntimeError("the Engine was closed while this call waited"), True
            self._cv.notify_all()


def packs(items: list, rows_of, width: int, n_batch: int, costs: dict[tuple[int, int], float]) -> list[list]:
    """Shareable asks (or their widths), in order, into forwards: as few as the probed width allows (_groups), or,
    where `costs` (seconds by (asks, rows), timed by the Scheduler) say so, more: the cheapest run of consecutive
    packs of timed shapes, if it costs under SPLIT_SHARE of those few. A CPU's kernels change at some widths: one
    llama.cpp forward of eight sequences' next tokens can cost more than two forwards of four (docs/SERVING.md).
    Any pack is exact (each within the probed width), so only the cost decides: the fewest forwards run until
    their shapes are timed, then their halves once, then the cheapest packing of timed shapes."""
    fewest = _groups(items, rows_of, width, n_batch)
    if len(items) < 2 or not costs:
        return fewest

    def cost(pack: list) -> float | None:
        return costs.get((len(pack), sum(rows_of(item) for item in pack)))

    known = [c for c in map(cost, fewest) if c is not None]
    if len(known) < len(fewest):
        return fewest
    # the packs' halves, once each (a shape is timed only where it runs: without a look, a cheaper split of the
    # steps that run most would never be found)
    halves = [
        half for pack in fewest for half in ((pack[: len(pack) // 2], pack[len(pack) // 2 :]) if pack[1:] else (pack,))
    ]
    if any(cost(half) is None for half in halves):
        return halves
    limit, ends = min(width, n_batch), [0]
    for item in items:
        ends.append(ends[-1] + rows_of(item))  # rows of items[:j]
    best: dict[int, tuple[float, list[list]]] = {0: (0.0, [])}  # j -> the cheapest packing of items[:j]
    for j in range(1, len(items) + 1):
        for i in range(j):
            rows = ends[j] - ends[i]
            seconds = costs.get((j - i, rows)) if i in best and rows <= limit else None
            if seconds is not None and (j not in best or best[i][0] + seconds < best[j][0]):
                best[j] = (best[i][0] + seconds, best[i][1] + [items[i:j]])
    cheapest = best.get(len(items))
    return cheapest[1] if cheapest is not None and cheapest[0] < SPLIT_SHARE * sum(known) else fewest


def _groups(items: list, rows_of, width: int, n_batch: int) -> list[list]:
    """Asks (or their widths: `rows_of` gives an item's rows) packed in order into forwards of at most `width` rows
    (the probed exact width) and n_batch tokens."""
    groups: list[list] = []
    rows = 0
    for item in items:
        if not groups or rows + rows_of(item) > min(width, n_batch):
            groups.append([])
            rows = 0
        groups[-1].append(item)
        rows += rows_of(item)
    return groups


class SequenceView:
    """The Model protocol on one sequence of a model of several, its forwards run by the Scheduler in the step of
    every running request: what a Seat holds as its target (or draft model)."""

    def __init__(self, scheduler: Scheduler, model: Sequences, sequence_id: int):
        self.scheduler, self.model, self.sequence_id = scheduler, model, sequence_id
        self.member: Member | None = None  # the request decoding on it now (Scheduler.join)
        # (rows, seconds) of each forward its asks rode in, a prompt's aside: what its forwards cost, not its waits
        # (bounded: a policy that does not adapt never takes them)
        self.timings: deque[tuple[int, float]] = deque(maxlen=TIMINGS_KEPT)
        self.vocab_size, self.max_context, self.eos_token_ids = model.vocab_size, model.max_context, model.eos_token_ids
        self.splits_prompts = model.splits_prompts

    @property
    def length(self) -> int:
        return self.scheduler.length(self)

    def rollback(self, length: int) -> None:
        self.scheduler.rollback(self, length)

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        return self.scheduler.forward(self, token_ids, 1, prefill=True)[0]

    def forward(self, token_ids: list[int], positions=None, tree_mask=None, last_n: int | None = None) -> torch.Tensor:
        if tree_mask is not None or positions is not None:
            raise ValueError(
                "several requests at once take consecutive positions only (no token trees); use max_num_seqs=1"
            )
        if not token_ids:
            raise ValueError("forward needs at least one token")
        outputs = len(token_ids) if last_n is None else min(last_n, len(token_ids))
        return self.scheduler.forward(self, token_ids, outputs)

    def shared_load(self) -> Load:
        return self.scheduler.shared_load(self)

    def step_forwards(self, widths: list[int]) -> list[int]:
        """The forwards (their rows) a step runs shareable asks of these widths on this model as: packed as the
        step packs them (packs()), each pack as the model runs one forward_batch (Sequences.step_forwards)."""
        costs = self.scheduler.step_costs.get(id(self.model), {})
        packed = packs(widths, lambda rows: rows, self.model.exact_width, self.model.n_batch, costs)
        return [rows for pack in packed for rows in self.model.step_forwards(pack)]

    def keep_path(self, prefix_len: int, slots: list[int]) -> None:
        self.scheduler.keep_path(self, prefix_len, slots)

    def take_timings(self) -> list[tuple[int, float]]:
        """The (rows, seconds) of the forwards its asks rode in since the last call (Seat.timed): the adaptive rule
        refines its cost tables from them, by the rows of the whole forward, rather than from a request's wall
        time, which under a Scheduler holds the other requests' steps too."""
        timings = list(self.timings)
        self.timings.clear()
        return timings
