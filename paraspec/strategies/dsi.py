"""DSI (Timor et al. 2024, "Distributed Speculative Inference", Algorithm 1): one drafter drafts without pause
while N target servers verify successive chunks of its drafts in parallel.

    draft worker     `amusd.draft_loop`, unchanged: drafts continuously from the latest sequence in the channel,
                     up to `max_ahead` tokens past the verified prefix, and rolls back when the version moves.
    target servers   workers target0..N-1 (one per entry of target_devices), each with its own copy of the
                     target and its own KV cache. A chunk is one request to one server (`serve_chunk`): roll the
                     cache back to the longest prefix that is still the sequence (at most up to the token
                     before the chunk), then ONE forward over the tokens it lacks -- verified ones and the
                     still-speculative drafts of earlier chunks -- followed by the chunk itself.
    caller           the paper's main thread (`_MainThread`): cuts the drafts into chunks of `lookahead`, hands
                     each to a free server, and resolves the results strictly in chunk order:
                     - chunk j rejects a draft: commit the accepted prefix plus the correction. The channel bumps
                       its version, so the drafter restarts from the corrected prefix; every chunk after j is
                       preempted (its result is discarded when it comes; its server rolls back when it is next
                       used, because its cache no longer matches the sequence).
                     - chunk j is fully accepted: the target distribution its forward computed for the next
                       position judges the draft there at once (greedy: equality with the argmax; sampling:
                       rejection sampling with that draft's q) -- a rejection preempts chunk j+1 onward -- or,
                       if nothing is drafted there yet, supplies the target's own token (the bonus).

Every draft is judged against exactly the prefix it was drafted from: a chunk is cut from the channel under one
version, and any commit that differs from a draft bumps the version and preempts every chunk in flight.
Rejection sampling consumes the run's generator in the order positions are settled, so sampling is lossless.

N = 1 versus AMUSD (`amusd.py`): both run the same drafter and settle the position after a full acceptance
from the distribution already in hand. AMUSD's verifier is a loop in the target worker that takes whatever has
been drafted (1 to `verify_chunk` tokens) the moment it is free; DSI's caller waits for a full chunk of
`lookahead` drafts (shorter only at the token budget) and orchestrates over worker requests, so with one server
it verifies fixed chunks and pays a round trip per chunk. Differences from the paper's Algorithm 1: no
target-only ("non-SI") thread on a spare server, a preempted server finishes its forward before it takes the
next chunk (a forward cannot be interrupted), and one drafter only (the paper's f_1..f_{m-1} are not here).
"""
from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from paraspec.runtime.channels import ChannelStopped
from paraspec.strategies import amusd
from paraspec.strategies.ar import next_token
from paraspec.strategies.base import Run
from paraspec.trace import Trace, TraceEvent
from paraspec.verify import verify_chain, verify_token

CHANNEL = amusd.CHANNEL


def target_server_names(runtime) -> list[str]:
    """The DSI target servers of a runtime, in index order (target0, target1, ...)."""
    names = [n for n in runtime.workers if n.startswith("target") and n[6:].isdigit()]
    return sorted(names, key=lambda n: int(n[6:]))


def serve_chunk(target, ctx, keep: int, tokens: list[int], rows: int, greedy: bool, margins: bool) -> dict:
    """Runs in a target server: catch up and verify in one forward. The cache keeps its first `keep` tokens,
    then `tokens` (catch-up + the token before the chunk + the chunk) are fed; the last `rows` rows are the
    target's predictions for the chunk's positions and the one after it."""
    with ctx.trace.span("verify", len(tokens)):
        target.rollback(keep)
        logits = target.forward(tokens, last_n=rows)[-rows:]
    reply = {"argmax": logits.argmax(-1).tolist(), "logits": None if greedy else logits, "margins": None}
    if margins:
        top2 = logits.float().topk(2, dim=-1).values
        reply["margins"] = (top2[:, 0] - top2[:, 1]).tolist()
    return reply


@dataclass
class _Server:
    worker: object
    cached: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # its cache after every request sent
    busy: bool = False


@dataclass
class _Chunk:
    start: int                     # position of the first draft (the forward also yields position start + len)
    tokens: list[int]
    q: torch.Tensor | None         # [len(tokens), vocab] when sampling
    server: int
    handle: object
    prefill: bool = False          # the prompt's forward: it yields the first token, it verifies nothing


@dataclass
class _Row:
    """The target's prediction for one position, kept after a full acceptance."""
    argmax: int
    logits: torch.Tensor | None    # sampling only


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _notify_when_done(handle, server: int, events: queue.SimpleQueue) -> None:
    handle.exception()             # blocks until the reply (or the worker's death) arrives; never raises
    events.put(("done", server, handle))


def _watch_channel(channel, events: queue.SimpleQueue) -> None:
    """Turn channel changes (new drafts, commits, stop) into events, so the main thread blocks on one queue."""
    seen = None
    try:
        while True:
            state = channel.wait_until(lambda s: (s.version, s.committed, s.length) != seen)
            seen = (state.version, state.committed, state.length)
            events.put(("channel",))
    except ChannelStopped:
        events.put(("stopped",))


class _MainThread:
    def __init__(self, run: Run, runtime, channel, lookahead: int, version: int):
        self.run, self.runtime, self.channel, self.lookahead = run, runtime, channel, lookahead
        self.servers = [_Server(runtime[name]) for name in target_server_names(runtime)]
        self.version = version
        self.sampling = not run.params.greedy
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.chunks: deque[_Chunk] = deque()      # in flight, in sequence order
        self.settled: set[int] = set()            # ids of handles whose reply arrived
        self.handles: list = []                   # every request sent (their trace events are merged at the end)
        self.next_start = len(run.prompt_ids)     # first position not in any chunk
        self.next_row: _Row | None = None         # the target's prediction for the next position, if in hand
        self.chunks_sent = self.preempted = self.judged_at_once = self.bonus = 0

    # -- requests to servers ---------------------------------------------------------------------------------
    def send(self, i: int, start: int, end: int, sequence: np.ndarray):
        """Have server i verify positions [start, end) of `sequence` (drafts; none for a prefill)."""
        server = self.servers[i]
        keep = min(_common_prefix(server.cached, sequence[:end]), start - 1)
        handle = server.worker.start_loop(
            serve_chunk, trace=Trace(t0=self.run.trace.t0), keep=keep,
            tokens=[int(t) for t in sequence[keep:end]], rows=end - start + 1, greedy=not self.sampling,
            margins=self.run.margins is not None)
        server.cached = np.array(sequence[:end], np.int64)
        server.busy = True
        self.handles.append(handle)
        threading.Thread(target=_notify_when_done, args=(handle, i, self.events), daemon=True,
                         name=f"paraspec-dsi-{server.worker.name}").start()
        return handle

    def start(self) -> None:
        """Every server prefills the prompt at once; server 0's result yields the first token."""
        prompt = np.array(self.run.prompt_ids, np.int64)
        start = len(prompt)
        self.chunks.append(_Chunk(start, [], None, 0, self.send(0, start, start, prompt), prefill=True))
        for i in range(1, len(self.servers)):
            self.send(i, start, start, prompt)
        threading.Thread(target=_watch_channel, args=(self.channel, self.events), daemon=True,
                         name="paraspec-dsi-watch").start()

    # -- the loop ----------------------------------------------------------------------------------------------
    def steps(self):
        """Yield each batch of committed tokens until the request is done (or cancelled)."""
        run = self.run
        while not run.done:
            if self.next_row is not None:
                kept = self.settle_next_position()
            elif self.chunks and id(self.chunks[0].handle) in self.settled:
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
                self.settled.add(id(handle))
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
            position = len(run.sequence)
            start = max(self.next_start, position)
            size = min(self.lookahead, position + run.remaining - 1 - start)   # the last token is the target's
            if size <= 0:
                if self.chunks or self.next_row is not None or start > position:
                    return sent
                size = 0          # one token left and nothing in flight: a chunk without drafts yields it
            snap = self.channel.snapshot(0, start + size)
            if snap.version != self.version or len(snap.tokens) < start + size:
                return sent       # the drafter has not got that far yet
            q = torch.from_numpy(self.channel.read_q(start, start + size, version=snap.version)) \
                if self.sampling and size else None
            sequence = snap.tokens
            # the free server whose cache already holds most of the sequence has the least to catch up on
            i = max(free, key=lambda j: _common_prefix(self.servers[j].cached, sequence))
            handle = self.send(i, start, start + size, sequence)
            self.chunks.append(_Chunk(start, [int(t) for t in sequence[start:]], q, i, handle))
            self.chunks_sent += 1
            self.next_start = start + size
            sent = True

    def resolve(self, chunk: _Chunk) -> list[int]:
        """Judge the head chunk's drafts that are not settled yet (the first may have been judged at once)."""
        run = self.run
        reply = chunk.handle.result()
        position = len(run.sequence)
        skip = position - chunk.start
        drafts = chunk.tokens[skip:]
        if reply["margins"] is not None:
            for r, gap in enumerate(reply["margins"][skip:]):
                run.margins.setdefault(position - len(run.prompt_ids) + r, gap)
        if self.sampling:
            logits = reply["logits"][skip:]
            accepted, correction = verify_chain(drafts, chunk.q[skip:], logits, run.params, run.generator) \
                if drafts else (0, None)
        else:
            target = reply["argmax"][skip:]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == target[accepted]:
                accepted += 1
            correction = target[accepted]
        if not chunk.prefill:
            run.rounds += 1
            run.verified_tokens += accepted + 1
        run.drafted += len(drafts)
        run.accepted += accepted
        if accepted == len(drafts):
            # Alg. 1: the forward also computed p for the position after the chunk; keep it for the next step
            self.next_row = _Row(reply["argmax"][skip + accepted],
                                 reply["logits"][skip + accepted] if self.sampling else None)
            return self.commit(drafts)
        run.rollbacks += 1
        return self.commit(drafts[:accepted] + [correction])

    def settle_next_position(self) -> list[int]:
        """p for the next position is in hand: judge the draft there at once, or take the target's token."""
        run, row = self.run, self.next_row
        self.next_row = None
        position = len(run.sequence)
        snap = self.channel.snapshot(position, position + 1)
        if len(snap.tokens) and snap.version == self.version:
            token = int(snap.tokens[0])
            if self.sampling:
                q = torch.from_numpy(self.channel.read_q(position, position + 1, version=snap.version)[0])
                replacement = verify_token(token, q, row.logits, run.params, run.generator)
            else:
                replacement = None if row.argmax == token else row.argmax
            run.drafted += 1
            run.accepted += replacement is None
            run.rollbacks += replacement is not None
            self.judged_at_once += 1
            return self.commit([token if replacement is None else replacement])
        self.bonus += 1
        return self.commit([row.argmax if not self.sampling else next_token(row.logits, run)])

    def commit(self, tokens: list[int]) -> list[int]:
        """Commit to the run and the channel; a commit that replaces a draft preempts every chunk in flight."""
        kept = self.run.commit(tokens)
        if kept:
            result = self.channel.commit(kept, start=len(self.run.sequence) - len(kept))
            if result.version != self.version:
                self.version = result.version
                self.preempted += len(self.chunks)
                self.chunks.clear()
                self.next_start = len(self.run.sequence)
        return kept

    def trace_events(self) -> list[TraceEvent]:
        return [e for h in self.handles if id(h) in self.settled for e in h.events]

    def report(self) -> dict:
        return {"servers": len(self.servers), "chunks": self.chunks_sent, "preempted": self.preempted,
                "judged_at_once": self.judged_at_once, "bonus": self.bonus}


def decode(run: Run, runtime, channel, lookahead: int = 5, max_ahead: int = 16):
    """Caller side: start the drafter, run the main thread, then merge the drafter's report into `run`."""
    if max_ahead < lookahead:
        raise ValueError(f"dsi: max_ahead ({max_ahead}) < lookahead ({lookahead}) would never fill a chunk; "
                         f"pass max_ahead >= lookahead (servers x lookahead keeps every server busy)")
    if not target_server_names(runtime):
        raise ValueError("dsi needs target servers named target0..N-1 in the runtime (the Engine starts one "
                         "per entry of target_devices)")
    version = channel.reset(run.prompt_ids)
    main = _MainThread(run, runtime, channel, lookahead, version)
    drafting = runtime["draft"].start_loop(amusd.draft_loop, params=run.params, max_ahead=max_ahead,
                                           vocab_size=main.servers[0].worker.info.vocab_size,
                                           seed=run.params.seed, t0=run.trace.t0)
    finished = False
    try:
        main.start()
        yield from main.steps()
        finished = run.done
    finally:
        channel.stop("done" if finished else "cancelled")
        if not finished:
            _raise_worker_failure(main)
            run.finish_reason = run.finish_reason or "cancelled"
        draft_report, = runtime.gather(drafting)
    draft_trace = Trace.from_dict(draft_report["trace"])
    run.draft_s = draft_trace.busy_s("draft")
    server_events = main.trace_events()
    run.verify_s = sum(e.end_s - e.start_s for e in server_events if e.kind == "verify")
    run.trace.events = sorted(run.trace.events + draft_trace.events + server_events, key=lambda e: e.start_s)
    run.worker_reports = {"draft": draft_report, "dsi": main.report()}


def _raise_worker_failure(main: _MainThread) -> None:
    """The loop ended early: if a server died or failed, raise that (a dead drafter raises in gather)."""
    for server in main.servers:
        if not server.worker.alive:
            server.worker.call("length", timeout=2.0)     # raises the worker's WorkerDied
    while True:
        try:
            event = main.events.get_nowait()
        except queue.Empty:
            return
        if event[0] == "done" and event[2].exception() is not None:
            raise event[2].exception()
