"""A generation as the Engine's callers see it: the `Request`, its `Stream` (read from any thread, `.cancel()`),
and its `GenerationResult`."""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from paraspec.errors import StreamCancelled
from paraspec.request_state import RequestState, TokenLogprob
from paraspec.stats import GenerationStats, compute_stats
from paraspec.trace import Trace

_numbers = itertools.count(1)


@dataclass(eq=False)
class Request:
    """A generation: who opened it and when, whether it was asked to stop, and its result once it has ended."""

    kind: str  # "generate()" | "stream" | "restart_workers()" | "set_options()"
    exclusive: bool = False  # runs alone on the Engine (restart_workers, set_options)
    number: int = field(default_factory=lambda: next(_numbers))
    thread: int = field(default_factory=threading.get_ident)
    thread_name: str = field(default_factory=lambda: threading.current_thread().name)
    opened: float = field(default_factory=time.time)
    stream: weakref.ref | None = None  # the Stream (weak: dropping it cancels the generation)
    cancelled: threading.Event = field(default_factory=threading.Event)
    ended_by: str | None = None  # why another thread ended it, if not by cancel()
    result: GenerationResult | None = None
    admitted: float | None = None  # perf_counter() when the gate admitted it (queue time: admitted - queued)
    queued: float = field(default_factory=time.perf_counter)
    seat: Any = None  # the Seat it decodes on (RequestGate), while it runs

    def __str__(self) -> str:
        opened = time.strftime("%H:%M:%S", time.localtime(self.opened))
        return (
            f"{self.kind} #{self.number} (opened by thread {self.thread_name!r} at {opened}, "
            f"{time.time() - self.opened:.1f} s ago)"
        )

    def how_to_end(self) -> str:
        if self.kind == "stream":
            return (
                "read that stream to its end or close it (stream.close(), in its thread), or cancel it from any "
                "thread (engine.cancel())"
            )
        return "wait for it, or cancel it from any thread (engine.cancel())"

    def open_stream(self) -> Stream | None:
        return self.stream() if self.stream is not None else None


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    trace: Trace = field(repr=False)
    finish_reason: str = "length"  # "stop" (a stop token or string) | "length" | "context" | "cancelled"
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    margins: dict[int, float] | None = field(default=None, repr=False)  # see generate(record_margins=...)
    worker_reports: dict = field(default_factory=dict, repr=False)  # raw counters of worker loops
    logprobs: list[TokenLogprob] | None = field(default=None, repr=False)  # with SamplingParams.logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = field(default=None, repr=False)  # .prompt_logprobs

    @classmethod
    def of(cls, run: RequestState, text: str, strategy: str, start: float) -> GenerationResult:
        """A request's result as it ended (done, cancelled, or cut short), `start` its perf_counter() start."""
        total = time.perf_counter() - start
        return cls(
            text,
            list(run.tokens),
            compute_stats(run, strategy, total),
            run.trace,
            run.finish_reason or "length",
            run.prompt_ids,
            run.margins,
            run.worker_reports,
            run.logprobs,
            run.prompt_logprobs,
        )


class Stream:
    """A generation streamed as text deltas (Engine.stream): iterate it; `result` is its GenerationResult once it
    has ended; close() (also `with engine.stream(...) as s:`) cancels it. The request starts at the first next()."""

    def __init__(
        self, deltas: Generator[str, None, None], request: Request, wake=None, run: RequestState | None = None
    ):
        self._deltas, self._request, self._wake, self._run = deltas, request, wake, run
        self._ended_by: str | None = None  # why it was ended by its own thread, not by its reader

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        if self._ended_by is not None:
            raise StreamCancelled(f"{self._request} was cancelled: {self._ended_by}")
        return next(self._deltas)

    @property
    def token_ids(self) -> list[int]:
        """The output tokens committed so far, read between deltas (in the reader's thread): the deltas so far are
        their text, but for text held back (a possible stop string, half a character)."""
        return self._run.tokens if self._run is not None else []

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """With SamplingParams.logprobs, the TokenLogprobs of the committed tokens known so far, read as token_ids
        (a strategy whose target runs in a worker reports them at the end: then fewer than token_ids until then)."""
        return self._run.logprobs if self._run is not None else None

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """With SamplingParams.prompt_logprobs, the prompt's, known from the first delta on."""
        return self._run.prompt_logprobs if self._run is not None else None

    @property
    def queue_s(self) -> float:
        """Seconds it waited in the Engine's line (so far, if it still waits or never got its turn)."""
        request = self._request
        return (request.admitted or time.perf_counter()) - request.queued

    @property
    def result(self) -> GenerationResult | None:
        """The GenerationResult once the stream has ended (read to its end, closed or cancelled), else None."""
        return self._request.result

    def close(self) -> None:
        """Cancel the generation (in the thread that reads the stream); the stream ends, its result says
        "cancelled". Closing a stream that has ended does nothing."""
        self._request.cancelled.set()
        self._deltas.close()

    def cancel(self) -> None:
        """Cancel the generation from any thread (a server's disconnect or timeout): it ends within one round,
        its result says "cancelled"; the other requests on the Engine go on."""
        self._request.cancelled.set()
        if self._wake is not None:
            self._wake()

    def end(self, why: str) -> None:
        """Its thread ends it, not its reader: its next iteration raises StreamCancelled saying `why`."""
        self._ended_by = why
        self.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
