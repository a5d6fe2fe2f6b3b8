"""A generation as the Engine's callers see it: the request, its Stream and result, the errors, and the gate that
decides which requests run on an Engine now (engine.py drives them; strategies decode them).

The gate: up to `capacity` generations at once (an Engine's max_num_seqs where its strategy batches requests,
else 1); restart_workers() and set_options() run alone. A request beyond the capacity waits its turn
(`on_busy="wait"`, at most `wait_timeout` seconds: 600 by default, None for no limit) or raises EngineBusy
(`on_busy="error"`), naming the requests holding the Engine (a stream left open: which thread opened it, when) and
how to end them. A request from a thread that left a stream open ends that stream first (its reader gets
StreamCancelled).
"""
from __future__ import annotations

import itertools
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Iterator

from paraspec.stats import GenerationStats
from paraspec.trace import Trace


class IncompatibleModelsError(ValueError):
    pass


class EngineBusy(RuntimeError):
    """The Engine is full: raised with on_busy="error", or after `wait_timeout` seconds of waiting."""


class EngineClosed(RuntimeError):
    """The Engine was closed; create a new one."""


class StreamCancelled(RuntimeError):
    """A stream was ended by someone other than its reader (a newer request from the thread that left it open, or
    engine.close()): raised at its next iteration, so that its text is never cut short without a word."""


_numbers = itertools.count(1)


@dataclass(eq=False)
class Request:
    """A generation: who opened it and when, whether it was asked to stop, and its result once it has ended."""
    kind: str                                     # "generate()" | "stream" | "restart_workers()" | "set_options()"
    exclusive: bool = False                       # runs alone on the Engine (restart_workers, set_options)
    number: int = field(default_factory=lambda: next(_numbers))
    thread: int = field(default_factory=threading.get_ident)
    thread_name: str = field(default_factory=lambda: threading.current_thread().name)
    opened: float = field(default_factory=time.time)
    stream: weakref.ref | None = None             # the Stream (weak: dropping it cancels the generation)
    cancelled: threading.Event = field(default_factory=threading.Event)
    ended_by: str | None = None                   # why another thread ended it, if not by cancel()
    result: "GenerationResult | None" = None

    def __str__(self) -> str:
        opened = time.strftime("%H:%M:%S", time.localtime(self.opened))
        return (f"{self.kind} #{self.number} (opened by thread {self.thread_name!r} at {opened}, "
                f"{time.time() - self.opened:.1f} s ago)")

    def how_to_end(self) -> str:
        if self.kind == "stream":
            return ("read that stream to its end or close it (stream.close(), in its thread), or cancel it from any "
                    "thread (engine.cancel())")
        return "wait for it, or cancel it from any thread (engine.cancel())"

    def open_stream(self) -> "Stream | None":
        return self.stream() if self.stream is not None else None


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    trace: Trace = field(repr=False)
    finish_reason: str = "length"     # "stop" (a stop token or string) | "length" | "context" | "cancelled"
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    margins: dict[int, float] | None = field(default=None, repr=False)   # see generate(record_margins=...)
    worker_reports: dict = field(default_factory=dict, repr=False)      # raw counters of worker loops


class Stream:
    """A generation streamed as text deltas (Engine.stream): iterate it; `result` is its GenerationResult once it
    has ended; close() (also `with engine.stream(...) as s:`) cancels it. The request starts at the first next()."""

    def __init__(self, deltas: Iterator[str], request: Request, wake=None):
        self._deltas, self._request, self._wake = deltas, request, wake
        self._ended_by: str | None = None      # why it was ended by its own thread, not by its reader

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        if self._ended_by is not None:
            raise StreamCancelled(f"{self._request} was cancelled: {self._ended_by}")
        return next(self._deltas)

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

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RequestGate:
    """Which requests run on an Engine now (see the module docstring), whether the Engine is closed or failed."""

    def __init__(self, capacity: int, on_busy: str, wait_timeout: float | None):
        self.capacity, self.on_busy, self.wait_timeout = capacity, on_busy, wait_timeout
        self.cv = threading.Condition()          # guards active, closed, failure
        self.active: list[Request] = []
        self.closed = False
        self.failure: BaseException | None = None   # a dead or stuck worker: refused until restart_workers()

    def check_usable(self, failed_ok: bool = False) -> None:
        if self.closed:
            raise EngineClosed("this Engine is closed; create a new Engine to generate again")
        if self.failure is not None and not failed_ok:
            raise self.failure

    def _room_for(self, request: Request) -> bool:
        if request.exclusive:
            return not self.active
        return len(self.active) < self.capacity and not any(a.exclusive for a in self.active)

    def acquire(self, request: Request, failed_ok: bool = False) -> Request:
        """Make `request` one of those in progress: wait for room (at most wait_timeout), or refuse with
        on_busy="error"; end a stream the calling thread left open (its reader gets StreamCancelled)."""
        deadline = None if self.wait_timeout is None else time.monotonic() + self.wait_timeout
        while True:
            with self.cv:
                self.check_usable(failed_ok)
                left_open = [a for a in self.active if a.thread == request.thread and a.open_stream() is not None]
                if not left_open:
                    if self._room_for(request):
                        self.active.append(request)
                        return request
                    holders = "; ".join(f"{a}" for a in self.active)
                    ends = self.active[0].how_to_end() if len(self.active) == 1 else \
                        "end one of them (read a stream to its end or close it, or engine.cancel() from any thread)"
                    if self.on_busy == "error":
                        raise EngineBusy(f"{holders} {'is' if len(self.active) == 1 else 'are'} running on this "
                                         f"Engine; {ends}, or create the Engine with on_busy='wait'")
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise EngineBusy(f"waited {self.wait_timeout:g} s (wait_timeout) for {holders}, which still "
                                         f"hold{'s' if len(self.active) == 1 else ''} this Engine; {ends}")
                    self.cv.wait(left)
                    continue
            # this thread left a stream open: it ends (its reader is told), outside the lock; a stream that never
            # started holds nothing: drop it as an active one
            for active in left_open:
                stream = active.open_stream()
                if stream is not None:
                    stream.end(f"{request} was started on the same thread before this stream ended; read a stream "
                               f"to its end or close() it before starting another request")
                self.release(active)

    def release(self, request: Request) -> None:
        with self.cv:
            if request in self.active:
                self.active.remove(request)
                self.cv.notify_all()

    def claim(self, request: Request, refusal: str) -> Request:
        """Make `request` the only one in progress at once, or raise EngineBusy: `refusal` while the holder runs,
        and how to end it (set_options: it never waits)."""
        with self.cv:
            self.check_usable(failed_ok=True)
            if self.active:
                raise EngineBusy(f"{refusal} while {self.active[0]} runs; {self.active[0].how_to_end()}")
            self.active.append(request)
            return request

    def generations(self) -> list[Request]:
        """The generations in progress (not restart_workers() / set_options())."""
        with self.cv:
            return [r for r in self.active if not r.exclusive]

    def wait_idle(self, timeout: float) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: not self.active, timeout)
