"""DSI (Timor et al. 2024, "Distributed Speculative Inference", Algorithm 1): a drafter drafts without pause
while N target servers verify successive chunks of its drafts in parallel (several drafters: see below).

    draft worker     `draft_loop` (drafters/draft_worker.py, amusd's too): drafts continuously from the latest
                     sequence in the channel, up to `max_ahead` tokens past the verified prefix, and rolls back
                     when the version moves.
    target servers   workers target0..N-1 (one per entry of target_devices), each with its own copy of the
                     target and its own KV cache. A chunk is one request to one server (`serve_chunk`): roll the
                     cache back to the longest prefix that is still the sequence (at most up to the token
                     before the chunk), then ONE forward over the tokens it lacks -- verified ones and the
                     still-speculative drafts of earlier chunks -- followed by the chunk itself.
    caller           the paper's main thread (`_Orchestrator`, run in the caller's own thread): cuts the drafts
                     into chunks of `lookahead`, hands each to a free server, and resolves the results strictly in
                     chunk order:
                     - chunk j rejects a draft: commit the accepted prefix plus the correction. The channel bumps
                       its version, so the drafter restarts from the corrected prefix; every chunk after j is
                       preempted (its result is discarded when it comes; its server rolls back when it is next
                       used, because its cache no longer matches the sequence).
                     - chunk j is fully accepted: the target distribution its forward computed for the next
                       position judges the draft there at once (greedy: equality with the argmax; sampling:
                       rejection sampling with that draft's q) -- a rejection preempts chunk j+1 onward -- or,
                       if nothing is drafted there yet, supplies the target's own token (the bonus).

Several drafters (the paper's f_1..f_{m-1}; `draft=[d0, d1, ...]`, `--draft` given several times): each runs
`draft_loop` in its own worker (draft, draft1, ...) on its own channel (tokens, tokens1, ...). A chunk is
cut from the lowest-index drafter that has drafted through the chunk's end and agrees with the sequence the
chunks in flight assume (`first_agreeing`); a faster, weaker drafter so fills in while a better one lags.
A model-free drafter ("ngram", "suffix"; `draft=["ngram", MODEL]`) runs in the caller, not in a worker: it
costs microseconds, so the main thread asks it on the spot for the chunk continuing the speculated sequence
(1 to `lookahead` tokens, q = None: point masses) and, in the given order, takes it when it has one. With only
model-free drafters a position none of them can draft is decoded plainly (a chunk without drafts).

Every draft is judged against exactly the prefix it was drafted from: a chunk is cut from a channel under one
version and only where that drafter agrees with the speculated sequence (every chunk in flight is a
continuation of it), and a commit that differs from the speculated sequence preempts every chunk in flight
(and bumps the version of each channel whose drafts it contradicts, so those drafters roll back). With
sampling, each draft is judged with the q of the drafter that sampled it; which drafter is taken depends only
on timing and on tokens already drafted, never on the draft being judged. Rejection sampling consumes the
run's generator in the order positions are judged, so sampling is lossless.

A request's bias, penalties and grammar are functions of the tokens before each row, and a chunk is judged only once
everything before it is committed: the servers send their raw rows back (`with_rows`) and the caller adjusts them on
the committed output and the chunk's drafts (RequestState.adjust, as sd does), records them for logprobs, and judges;
the row kept after a full acceptance is adjusted when its position is judged. The draft workers mask and adjust their
q the same way on their own caches (draft_loop), so q stays the distribution each draft was drawn from.

N = 1 versus AMUSD (`amusd.py`): both run the same drafter and judge the position after a full acceptance
from the distribution already in hand. AMUSD's verifier is a loop in the target worker that takes whatever has
been drafted (1 to `verify_chunk` tokens) the moment it is free; DSI's caller waits for a full chunk of
`lookahead` drafts (shorter only at the token budget) and orchestrates over worker requests, so with one server
it verifies fixed chunks and pays a round trip per chunk. Differences from the paper's Algorithm 1: no
target-only ("non-SI") thread on a spare server, a preempted server finishes its forward before it takes the
next chunk (a forward cannot be interrupted), and a drafter is not preempted mid-forward either.

The prompts (`lend_cores`, as amusd's: on where every device is a core set of one machine): server 0 reads the
prompt on every worker's cores while the others wait, so the first token comes as soon as ar's would; then the other
servers and the drafters read theirs on their own cores, and until a drafter has read its prompt (its channel's
`draft_ready`) a position no drafter has reached is decoded by a chunk without drafts.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from paraspec.drafters.draft_worker import CHANNEL, draft_loop
from paraspec.request_state import RequestState, common_prefix, top2_margins
from paraspec.runtime.channels import ChannelStopped, TokenChannel
from paraspec.runtime.devices import lend_cores, shared_cores, sync
from paraspec.strategies.base import WITH_RAY, Capabilities, Placement, WorkerStrategy
from paraspec.strategies.registry import DRAFTER_OPTIONS, register
from paraspec.structured import WorkerGrammar
from paraspec.trace import Trace, TraceEvent
from paraspec.verify import greedy_match, verify_chain

if TYPE_CHECKING:
    from paraspec.drafters.base import Drafter
    from paraspec.runtime.workers import Handle, Worker
    from paraspec.sampling import SamplingParams


@register
class DSI(WorkerStrategy):
    name = "dsi"
    summary = "drafters drafting, N target servers verifying chunks in parallel (DSI)"
    option_names = ("lookahead", "max_ahead", "draft_window", "lend_cores") + DRAFTER_OPTIONS
    caps = Capabilities(drafts="several", model_free=True, runtime_kinds=WITH_RAY, in_workers=True, across_nodes=True)

    @classmethod
    def check_config(cls, config) -> None:
        o = config.strategy_options
        if o["lookahead"] is None:
            raise ValueError("dsi: lookahead must be a number of tokens per chunk (its default: 5)")
        if o["max_ahead"] < o["lookahead"]:
            raise ValueError(
                f"dsi: max_ahead ({o['max_ahead']}) < lookahead ({o['lookahead']}) would never fill a "
                f"chunk; pass max_ahead >= lookahead (servers x lookahead keeps every server busy)"
            )

    def setup(self, placement: Placement) -> None:
        """One target server per target device (group), target0..N-1; drafters draft, draft1, ..., each on its
        own draft device or all on one, each with its own channel (tokens, tokens1, ...)."""
        devices, models = placement.draft_devices, placement.draft_checkpoints
        self.server_names = [f"target{i}" for i in range(len(placement.target_devices))]
        self.drafter_names = [drafter_name(i) for i in range(len(models))]
        drafter_devices = [devices[min(i, len(devices) - 1)] for i in range(len(models))]
        runtime = self.start_workers(
            placement,
            [(name, placement.target, d) for name, d in zip(self.server_names, placement.target_devices)]
            + [(name, spec, d) for name, spec, d in zip(self.drafter_names, models, drafter_devices)],
            drafts=self.drafter_names,
        )
        self.target = self.remote(self.server_names[0])
        self.draft_models = [self.remote(name) for name in self.drafter_names]
        capacity = min(m.max_context for m in [self.target, *self.draft_models])
        self.channel_names = [CHANNEL if i == 0 else f"{CHANNEL}{i}" for i in range(len(self.draft_models))]
        for name in self.channel_names:
            runtime.channel(name, capacity=capacity, vocab_size=self.target.vocab_size, q_window=64)
        # every drafter in the given order: a model's channel index, or a model-free Drafter (run in the caller)
        self.draft_specs = list(placement.draft_specs)
        self.order = self.make_drafters(lambda index: index, models=range(len(models)))
        self.tokenizer_folder = str(placement.target)  # the drafters' grammars: the Engine's tokenizer
        self.prompt_cores = (
            shared_cores([*placement.target_devices, *drafter_devices], placement.runtime_kind)
            if self.options["lend_cores"] and models
            else None
        )

    def decode(self, run: RequestState, seat=None):  # one request at a time, on its workers: no seat
        return run_request(
            run,
            self.runtime,
            self.server_names,
            self.drafter_names,
            self.channel_names,
            self.options["lookahead"],
            self.options["max_ahead"],
            self.order,
            None
            if run.params.structured is None
            else WorkerGrammar(self.tokenizer_folder, run.params.structured, tuple(sorted(run.stop_ids))),
            self.options["draft_window"],
            self.prompt_cores,
        )


def drafter_name(i: int) -> str:
    """Worker name of drafter i (and its key in worker_reports): "draft", then draft1, draft2, ..."""
    return "draft" if i == 0 else f"draft{i}"


def first_agreeing(drafts: list[np.ndarray | None], speculated: np.ndarray, end: int) -> int | None:
    """Index of the first drafter whose tokens reach `end` and agree with `speculated` (the sequence the chunks in
    flight assume: verified tokens, then their drafts) wherever both have a token; None if there is none.
    drafts[i] is drafter i's whole sequence under the version last seen, or None when it is stale."""
    for i, tokens in enumerate(drafts):
        if tokens is None or len(tokens) < end:
            continue
        n = min(len(speculated), end)
        if np.array_equal(tokens[:n], speculated[:n]):
            return i
    return None


def serve_chunk(
    target,
    ctx,
    keep: int,
    tokens: list[int],
    rows: int,
    send_logits: bool,
    margins: bool,
    prompt_cores: tuple[int, ...] | None = None,
) -> dict:
    """Runs in a target server: catch up and verify in one forward. The cache keeps its first `keep` tokens,
    then `tokens` (catch-up + the token before the chunk + the chunk) are fed; the last `rows` rows are the
    target's predictions for the chunk's positions and the one after it: their argmax, and with `send_logits` the
    rows themselves (the caller samples from them, adjusts them to the request, or reports their logprobs).
    `prompt_cores`: the prompt's forward runs on these (the other workers wait for it: lend_cores)."""
    with lend_cores(prompt_cores), ctx.trace.span("prefill" if keep == 0 else "verify", len(tokens)):
        target.rollback(keep)
        logits = target.forward(tokens, last_n=rows)[-rows:]
        sync(ctx.device)  # the event ends when the GPU has run the forward, not when it was queued
    return {
        "argmax": logits.argmax(-1).tolist(),
        "logits": logits if send_logits else None,
        "margins": top2_margins(logits) if margins else None,
    }


@dataclass
class _Server:
    worker: Worker
    cached: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # its cache after every request sent
    busy: bool = False


@dataclass
class _Drafter:
    """A draft model's worker, seen through its channel."""

    channel: TokenChannel
    version: int  # the channel's version after the last commit
    name: str = "draft"
    chunks: int = 0  # chunks cut from its drafts
    judged_at_once: int = 0  # its drafts judged at once by a forward already in hand
    local = False

    def proposed(self, speculated: np.ndarray, start: int, end: int) -> np.ndarray | None:
        """Its sequence through `end`, if it has drafted that far and agrees with the speculated sequence."""
        snap = self.channel.snapshot(0, end)
        tokens = snap.tokens if snap.version == self.version else None
        return tokens if first_agreeing([tokens], speculated, end) == 0 else None

    def q(self, start: int, end: int, sequence: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(self.channel.read_q(start, end, version=self.version))


@dataclass
class _LocalDrafter:
    """A model-free drafter, asked in the caller for the tokens continuing the speculated sequence."""

    drafter: Drafter  # a model-free one (NGramDrafter, SuffixDrafter)
    params: SamplingParams
    generator: torch.Generator
    chunks: int = 0
    judged_at_once: int = 0
    local = True

    @property
    def name(self) -> str:
        return self.drafter.name

    def proposed(self, speculated: np.ndarray, start: int, end: int) -> np.ndarray | None:
        """speculated[:start] and then 1 to end - start proposed tokens; None if it has none."""
        if len(speculated) < start:
            return None
        prefix = speculated[:start]
        if end <= start:
            return prefix
        tokens = self.drafter.propose(prefix.tolist(), end - start, self.params, self.generator).tokens
        return np.concatenate([prefix, np.array(tokens, np.int64)]) if tokens else None

    def q(self, start: int, end: int, sequence: np.ndarray) -> None:
        return None  # its tokens are fixed: point masses (verify reads q = None so)


@dataclass
class _Chunk:
    start: int  # position of the first draft (the forward also yields position start + len)
    tokens: list[int]
    q: torch.Tensor | None  # [len(tokens), vocab] when sampling, from the drafter that sampled them
    server: int
    handle: Handle
    prefill: bool = False  # the prompt's forward: it yields the first token, it verifies nothing
    drafter: _Drafter | _LocalDrafter | None = None


@dataclass
class _Row:
    """The target's prediction for one position, kept after a full acceptance."""

    argmax: int
    logits: torch.Tensor | None  # the raw row, where the servers send rows (_Orchestrator.with_rows)


def _notify_when_done(handle, server: int, events: queue.SimpleQueue) -> None:
    handle.exception()  # blocks until the reply (or the worker's death) arrives; never raises
    events.put(("done", server, handle))


def _watch_channel(channel, events: queue.SimpleQueue) -> None:
    """Turn channel changes (new drafts, commits, stop) into events, so the main thread blocks on one queue."""
    seen = None
    try:
        while True:
            state = channel.wait_until(lambda s, seen=seen: (s.version, s.committed, s.length) != seen)
            seen = (state.version, state.committed, state.length)
            events.put(("channel",))
    except ChannelStopped:
        events.put(("stopped",))


class _Orchestrator:
    """The DSI paper's main thread (run in the caller's thread, not a thread of its own): chunks, servers,
    acceptance and preemption for one request."""

    def __init__(
        self,
        run: RequestState,
        runtime,
        server_names: list[str],
        channels: list,
        lookahead: int,
        order: list | None = None,
        drafter_names: list[str] | None = None,
        prompt_cores: tuple[int, ...] | None = None,
    ):
        """order: every drafter in priority order, a channel index (a model drafter) or a model-free Drafter;
        None: the channels in order. `prompt_cores`: server 0's prompt runs on these while every other worker waits
        (lend_cores); then the others read theirs, and the servers decode alone until a drafter has read its."""
        self.run, self.runtime, self.lookahead = run, runtime, lookahead
        self.prompt_cores = prompt_cores
        self.deferred: list[int] = []  # servers whose prompt waits for server 0's (lent cores)
        self.drafts_read = prompt_cores is None  # a model drafter has read its prompt (or read it at once)
        self.servers = [_Server(runtime[name]) for name in server_names]
        names = drafter_names or [drafter_name(i) for i in range(len(channels))]
        self.drafters = [
            _Drafter(channels[d], channels[d].reset(run.prompt_ids), names[d])
            if isinstance(d, int)
            else _LocalDrafter(d, run.params, run.generator)
            for d in (range(len(channels)) if order is None else order)
        ]
        self.all_local = all(d.local for d in self.drafters)
        self.sampling = not run.params.greedy
        # the servers send their rows back where the argmax alone cannot judge: sampling, a request's bias,
        # penalties or grammar (applied here, on the committed output: RequestState.adjust), or its logprobs
        self.with_rows = (
            self.sampling or run.params.adjusts_logits or run.grammar is not None or run.logprobs is not None
        )
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.chunks: deque[_Chunk] = deque()  # in flight, in sequence order
        self.replied: set[int] = set()  # ids of handles whose reply arrived
        self.handles: list = []  # every request sent (their trace events are merged at the end)
        self.next_start = len(run.prompt_ids)  # first position not in any chunk
        self.speculated = np.array(run.prompt_ids, np.int64)  # the sequence the chunks in flight assume
        self.next_row: _Row | None = None  # the target's prediction for the next position, if in hand
        self.chunks_sent = self.preempted = self.judged_at_once = self.bonus = 0

    # -- requests to servers ---------------------------------------------------------------------------------
    def send(self, i: int, start: int, end: int, sequence: np.ndarray, prompt_cores: tuple[int, ...] | None = None):
        """Have server i verify positions [start, end) of `sequence` (drafts; none for a prefill)."""
        server = self.servers[i]
        keep = min(common_prefix(server.cached, sequence[:end]), start - 1)
        handle = server.worker.start_loop(
            serve_chunk,
            trace=Trace(t0=self.run.trace.t0),
            keep=keep,
            tokens=[int(t) for t in sequence[keep:end]],
            rows=end - start + 1,
            send_logits=self.with_rows,
            margins=self.run.margins is not None,
            prompt_cores=prompt_cores,
        )
        server.cached = np.array(sequence[:end], np.int64)
        server.busy = True
        self.handles.append(handle)
        threading.Thread(
            target=_notify_when_done,
            args=(handle, i, self.events),
            daemon=True,
            name=f"paraspec-dsi-{server.worker.name}",
        ).start()
        return handle

    def start(self) -> None:
        """Every server prefills the prompt at once; server 0's result yields the first token. With lent cores,
        server 0's prompt first, on every worker's cores; the other servers' once it is done."""
        prompt = np.array(self.run.prompt_ids, np.int64)
        start = len(prompt)
        handle = self.send(0, start, start, prompt, self.prompt_cores)
        self.chunks.append(_Chunk(start, [], None, 0, handle, prefill=True))
        self.deferred = list(range(1, len(self.servers)))
        if self.prompt_cores is None:
            self.prefill_deferred()
        for i, drafter in enumerate(d for d in self.drafters if isinstance(d, _Drafter)):
            threading.Thread(
                target=_watch_channel, args=(drafter.channel, self.events), daemon=True, name=f"paraspec-dsi-watch{i}"
            ).start()

    def prefill_deferred(self) -> None:
        prompt = np.array(self.run.prompt_ids, np.int64)
        for i in self.deferred:
            self.send(i, len(prompt), len(prompt), prompt)
        self.deferred = []

    def drafters_reading(self) -> bool:
        """Lent cores: the model drafters read their prompts after the first token, and until one has, a position
        no drafter has reached is decoded by a chunk without drafts."""
        if not self.drafts_read:
            self.drafts_read = any(d.channel.draft_ready() for d in self.drafters if isinstance(d, _Drafter))
        return not self.drafts_read

    # -- the loop ----------------------------------------------------------------------------------------------
    def steps(self):
        """Yield the tokens of each commit until the request is done (or cancelled)."""
        run = self.run
        while not run.done:
            if self.next_row is not None:
                kept = self.settle_next_position(self.next_row)
            elif self.chunks and id(self.chunks[0].handle) in self.replied:
                kept = self.resolve(self.chunks.popleft())
            elif self.assign_chunks():
                continue
            else:
                if not self.wait():
                    return
                continue
            if kept:
                yield kept

    def wait(self) -> bool:
        """Block for the next event and take every one queued; False when the channel was stopped."""
        event = self.events.get()
        while True:
            if event[0] == "done":
                _, i, handle = event
                self.servers[i].busy = False
                self.replied.add(id(handle))
                error = handle.exception()
                if error is not None:
                    raise error
            elif event[0] == "stopped":
                return False
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return True

    def assign_chunks(self) -> bool:
        """Cut chunks from the drafts for every free server; True if any was sent."""
        run, sent = self.run, False
        while True:
            free = [i for i, s in enumerate(self.servers) if not s.busy]
            if not free:
                return sent
            for i in free:  # a busy server's death reaches us through its reply; an idle one's here
                _raise_if_dead(self.servers[i].worker)
            position = len(run.sequence)
            start = max(self.next_start, position)
            size = min(self.lookahead, position + run.remaining - 1 - start)  # the last token is the target's
            if size <= 0:
                if self.chunks or self.next_row is not None or start > position:
                    return sent
                size = 0  # one token left and nothing in flight: a chunk without drafts yields it
            drafter: _Drafter | _LocalDrafter | None
            found = self.ready_drafter(start, start + size)
            if found is None:
                alone = self.all_local or self.drafters_reading()
                if not (alone and not self.chunks and self.next_row is None and start == position):
                    return sent  # no drafter has got that far yet (on the sequence in flight)
                # model-free drafters only, none has a draft here, or the draft models are still reading their
                # prompts: a chunk without drafts decodes the position
                drafter, sequence = None, np.array(run.sequence, np.int64)
            else:
                drafter, sequence = found
            size = len(sequence) - start
            q = drafter.q(start, start + size, sequence) if drafter is not None and self.sampling and size else None
            # the free server whose cache already holds most of the sequence has the least to catch up on
            i = max(free, key=lambda j: common_prefix(self.servers[j].cached, sequence))
            handle = self.send(i, start, start + size, sequence)
            self.chunks.append(_Chunk(start, [int(t) for t in sequence[start:]], q, i, handle, drafter=drafter))
            self.chunks_sent += 1
            if drafter is not None:
                drafter.chunks += size > 0
            self.next_start = start + size
            self.speculated = np.array(sequence, np.int64)
            sent = True

    def resolve(self, chunk: _Chunk) -> list[int]:
        """Judge the head chunk's drafts that are not judged yet (the first may have been judged at once)."""
        run = self.run
        reply = chunk.handle.result()
        if chunk.prefill and self.deferred:  # server 0 has read the prompt on every core: the others read theirs
            self.prefill_deferred()
        position = len(run.sequence)
        skip = position - chunk.start
        drafts = chunk.tokens[skip:]
        rows = None if reply["logits"] is None else reply["logits"][skip:]  # after the committed output, then drafts
        if rows is not None:
            run.observe_target(position - len(run.prompt_ids), rows)  # logprobs, margins: the last observation wins
        elif reply["margins"] is not None and run.margins is not None:  # asked for where run.margins is a dict
            for r, gap in enumerate(reply["margins"][skip:]):
                run.margins.setdefault(position - len(run.prompt_ids) + r, gap)
        correction: int | None
        if rows is not None:
            q = None if chunk.q is None else chunk.q[skip:]
            adjusted = run.adjust(rows, drafts)  # grammar, bias, penalties: row i after the output and drafts[:i]
            accepted, correction = verify_chain(drafts, q, adjusted, run.params, run.generator) if drafts else (0, None)
        else:
            accepted, correction = greedy_match(drafts, reply["argmax"][skip:])
        run.count_round(len(drafts), accepted, verified=not chunk.prefill)  # the prompt's forward is no round
        if accepted == len(drafts):
            # Alg. 1: the forward also computed p for the position after the chunk; keep it for the next step
            self.next_row = _Row(reply["argmax"][skip + accepted], None if rows is None else rows[accepted])
            return self.commit(drafts)
        assert correction is not None  # a rejected draft always comes with the target's token
        return self.commit(drafts[:accepted] + [correction])

    def settle_next_position(self, row: _Row) -> list[int]:
        """p for the next position is in hand (`row`, taken from next_row): judge the draft there at once, or take
        the target's token."""
        run = self.run
        self.next_row = None
        draft, q, drafter = self.draft_at(len(run.sequence))
        # judged on the output committed by now: the row adjusted to it (RequestState.adjust), or the bare argmax
        token, judged = run.settle_in_hand(draft, q, row.argmax if row.logits is None else run.adjust(row.logits))
        self.bonus += not judged
        if judged:
            self.judged_at_once += 1
            if drafter is not None:  # always, when judged: a draft was in hand, from this drafter
                drafter.judged_at_once += 1
        return self.commit([token])

    def draft_at(self, position: int) -> tuple[int | None, torch.Tensor | None, _Drafter | _LocalDrafter | None]:
        """The draft to judge at `position` with its q: the head chunk's, if a chunk in flight starts there,
        else the first drafter's that has one (on the current sequence); (None, None, None) if none has."""
        if self.chunks and self.chunks[0].start == position and self.chunks[0].tokens:
            chunk = self.chunks[0]
            return chunk.tokens[0], None if chunk.q is None else chunk.q[0], chunk.drafter
        found = self.ready_drafter(position, position + 1)
        if found is None:
            return None, None, None
        drafter, sequence = found
        q = drafter.q(position, position + 1, sequence) if self.sampling else None
        return int(sequence[position]), None if q is None else q[0], drafter

    def ready_drafter(self, start: int, end: int) -> tuple[_Drafter | _LocalDrafter, np.ndarray] | None:
        """The first drafter, in order, with drafts for [start, end) on the speculated sequence, and its sequence:
        a model drafter's reaches `end` (first_agreeing), a model-free drafter's may stop earlier; None if none has."""
        for drafter in self.drafters:
            sequence = drafter.proposed(self.speculated, start, end)
            if sequence is not None:
                return drafter, sequence
        return None

    def commit(self, tokens: list[int]) -> list[int]:
        """Commit to the run and every drafter's channel. A commit that differs from the speculated sequence
        preempts every chunk in flight (they all assume it); a channel whose drafts it contradicts bumps its
        version, so that drafter rolls back."""
        run = self.run
        start = len(run.sequence)
        kept = run.commit(tokens)
        if not kept:
            return kept
        for drafter in self.drafters:
            if isinstance(drafter, _Drafter):
                drafter.version = drafter.channel.commit(kept, start=start).version
        assumed = self.speculated[start : start + len(kept)].tolist()
        if assumed != kept[: len(assumed)]:
            self.preempted += len(self.chunks)
            self.chunks.clear()
            self.next_start = len(run.sequence)
        if len(self.speculated) <= len(run.sequence) or not self.chunks:
            self.speculated = np.array(run.sequence, np.int64)
        return kept

    def trace_events(self) -> list[TraceEvent]:
        return [e for h in self.handles if id(h) in self.replied for e in h.events]

    def report(self) -> dict:
        return {
            "servers": len(self.servers),
            "chunks": self.chunks_sent,
            "preempted": self.preempted,
            "judged_at_once": self.judged_at_once,
            "bonus": self.bonus,
            "drafters": [d.name for d in self.drafters],
            "chunks_by_drafter": [d.chunks for d in self.drafters],
            "judged_at_once_by_drafter": [d.judged_at_once for d in self.drafters],
        }


def run_request(
    run: RequestState,
    runtime,
    server_names: list[str],
    drafter_names: list[str],
    channel_names: list[str],
    lookahead: int,
    max_ahead: int,
    order: list | None = None,
    grammar: WorkerGrammar | None = None,
    window: int = 0,
    prompt_cores: tuple[int, ...] | None = None,
):
    """Caller side: start the drafters, run the main thread, then merge the drafters' reports into `run`.
    Drafter drafter_names[i] drafts into the channel channel_names[i]; `order` puts them and the model-free
    drafters in priority order (_Orchestrator). `grammar`: the request's structured output, for the drafters' q (the
    target's rows are masked here, by `run`). `window`: the draft models' (draft_loop)."""
    channels = [runtime.channels[name] for name in channel_names]
    local = [d for d in order or [] if not isinstance(d, int)]
    for drafter in local:
        drafter.reset()
    main = _Orchestrator(run, runtime, server_names, channels, lookahead, order, drafter_names, prompt_cores)
    vocab_size = main.servers[0].worker.info.vocab_size
    drafting = []
    for i in range(len(channels)):
        seed = run.params.seed if run.params.seed is None or i == 0 else run.params.seed + 7919 * i
        drafting.append(
            runtime[drafter_names[i]].start_loop(
                draft_loop,
                params=run.params,
                max_ahead=max_ahead,
                vocab_size=vocab_size,
                seed=seed,
                t0=run.trace.t0,
                channel_name=channel_names[i],
                label=drafter_names[i],
                prompt_length=len(run.prompt_ids),
                grammar=grammar,
                window=window,
                after_first_token=prompt_cores is not None,
            )
        )
    finished = False
    try:
        main.start()
        yield from main.steps()
        finished = run.done
    finally:
        for c in channels:
            c.stop("done" if finished else "cancelled")
        if not finished:
            _raise_worker_failure(main)
            run.finish_reason = run.finish_reason or "cancelled"
        draft_reports = runtime.gather(*drafting)
        for drafter in local:
            drafter.finish(run.sequence)
    run.merge_worker_reports(dict(zip(drafter_names, draft_reports)), main.trace_events(), dsi=main.report())


def _raise_worker_failure(main: _Orchestrator) -> None:
    """The loop ended early: if a server died or failed, raise that (a dead drafter raises in gather)."""
    for server in main.servers:
        _raise_if_dead(server.worker)
    while True:
        try:
            event = main.events.get_nowait()
        except queue.Empty:
            return
        if event[0] == "done" and event[2].exception() is not None:
            raise event[2].exception()


def _raise_if_dead(worker) -> None:
    if not worker.alive:
        worker.call("length", timeout=2.0)  # raises the worker's WorkerDied
