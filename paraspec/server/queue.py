"""The server's jobs on one Engine: a bounded number of them, cancellation of one. Which job runs when is the
Engine's decision (its RequestGate admits them in arrival order, up to its max_num_seqs at once: batched, each
answer as if alone; 1 for strategies that do not batch); the queue only refuses a request when running and waiting
jobs would exceed max_num_seqs + max_queue.

A request is one or more jobs (its choices: n per prompt), admitted together or not at all: when they do not all
fit in the free slots and the free places of the queue, the request is refused whole (QueueFull), never answered in
part. Its jobs share one event queue, their events tagged with the choice's index.

Each job runs in a thread of its own (the Engine is synchronous), waiting there for its turn; its text deltas reach
the event loop through an asyncio queue. A job is cancelled (client gone, --request-timeout, shutdown) with its own
Stream.cancel(), which takes it out of the line or ends its generation within one round, workers included, and no
other. A worker fault (WorkerError) is reported to its request; the Engine (restart_on_fault) restarts the workers
(/health says 503 until they are back) and the next request in line runs on the new ones.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paraspec.sampling import SamplingParams

if TYPE_CHECKING:
    from paraspec.request_state import TokenLogprob
    from paraspec.streams import GenerationResult, Stream

log = logging.getLogger("paraspec.server")


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


@dataclass(frozen=True)
class Delta:
    """A streamed job's text delta and the output tokens committed since the previous delta (their text is the
    delta's, but for text held back), with their logprobs where the request asked for them (a strategy whose target
    runs in a worker has none until the end: the result's); the first delta also carries the prompt's logprobs."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    index: int = 0  # the choice's index in its response
    # (index, "delta", Delta) ... then (index, "end", None) once result or error is set (a worker restart may
    # follow); shared by the jobs of one request
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    reason: str | None = None  # why it was cancelled: "disconnect" | "timeout" | "shutdown"
    result: GenerationResult | None = None  # also for a cancelled generation
    error: BaseException | None = None
    queue_s: float = 0.0
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    stream_handle: Stream | None = None  # the Engine's Stream once the request thread has opened it

    def cancel(self, reason: str) -> None:
        """(event loop) Stop this job's generation, and no other: it ends with what it has, `reason` says why."""
        if self.finished.is_set() or self.cancelled.is_set():
            return
        self.reason = reason
        self.cancelled.set()
        if self.stream_handle is not None:
            self.stream_handle.cancel()


class GenerationQueue:
    def __init__(self, engine, metrics, max_queue: int, request_timeout: float | None):
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self.jobs: set[Job] = set()  # started, not finished: running or in the Engine's line
        self.closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        engine.restart_on_fault = True  # a worker fault: the Engine restarts its workers, the line waits for them

    @property
    def waiting(self) -> int:
        """Jobs in the Engine's line."""
        return self.engine.waiting

    @property
    def capacity(self) -> int:
        """The most jobs one request can have: every slot and every place in the queue."""
        return self.engine.max_num_seqs + self.max_queue

    def room(self) -> int:
        """How many more jobs fit now: the free slots and the free places of the queue."""
        return self.capacity - len(self.jobs)

    async def start(self, jobs: list[Job]) -> None:
        """Start every job of one request (each waits for its turn in the Engine's line); QueueFull when they do not
        all fit now, nothing started."""
        if self.closing:
            raise ShuttingDown()
        if len(jobs) > self.room():
            raise QueueFull()
        self._loop = asyncio.get_running_loop()
        for job in jobs:
            self.jobs.add(job)
            timer = self._loop.call_later(self.request_timeout, job.cancel, "timeout") if self.request_timeout else None
            threading.Thread(target=self._run, args=(job, timer), daemon=True, name="paraspec-request").start()

    def _emit(self, job: Job, kind: str, value=None) -> None:
        try:
            assert self._loop is not None  # set by start(), before any job runs
            self._loop.call_soon_threadsafe(job.events.put_nowait, (job.index, kind, value))
        except RuntimeError:  # the event loop is gone (the server stopped): nobody is listening
            pass

    def _run(self, job: Job, timer) -> None:
        """(request thread) Wait for the Engine's turn, run the generation, report it."""
        try:
            stream = job.stream_handle = self.engine.stream(job.prompt_ids, job.params)
            if job.cancelled.is_set():  # cancelled before the engine had the request: stop it at once
                stream.cancel()
            tokens = logprobs = 0  # how many of each the deltas so far carried
            for delta in stream:
                if job.stream:
                    new_logprobs = stream.logprobs[logprobs:] if stream.logprobs is not None else None
                    first = stream.prompt_logprobs if tokens == 0 else None
                    self._emit(job, "delta", Delta(delta, stream.token_ids[tokens:], new_logprobs, first))
                    tokens, logprobs = len(stream.token_ids), logprobs + len(new_logprobs or ())
            job.result = stream.result
        except Exception as e:  # noqa: BLE001 -- reported to the client
            job.error = e
            log.error("request failed: %s", e)
        finally:
            job.queue_s = job.stream_handle.queue_s if job.stream_handle is not None else 0.0
            self._emit(job, "end")
        try:
            assert self._loop is not None  # set by start(), before any job runs
            self._loop.call_soon_threadsafe(self._finished, job, timer)
        except RuntimeError:
            pass

    def _finished(self, job: Job, timer) -> None:
        """(event loop) Count the generation, release the engine to the next request."""
        if timer is not None:
            timer.cancel()
        self.metrics.queue_time.observe(job.queue_s)
        if job.result is not None:
            reason = job.result.finish_reason
            self.metrics.generation(
                job.result,
                job.reason if reason == "cancelled" and job.reason else "length" if reason == "context" else reason,
            )
            self.metrics.e2e.observe(job.queue_s + job.result.stats.total_s)
        self.jobs.discard(job)
        job.finished.set()

    def shutdown(self) -> None:
        """(event loop) Refuse new requests and end the running ones with an error."""
        self.closing = True
        for job in list(self.jobs):
            job.cancel("shutdown")

    def health(self) -> str | None:
        if self.closing:
            return "the server is shutting down"
        return self.engine.health()
