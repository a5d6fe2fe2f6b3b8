"""Timed events per device: what the engine records and what the simulators emit.

One format for real and simulated runs, so the bench plots (token progress, device timeline) draw both alike.
Times are seconds since the start of the request.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, astuple, dataclass, field
from types import SimpleNamespace


@dataclass
class TraceEvent:
    device: str  # who did the work, e.g. "target:cpu:1", "draft:cpu:0", "target#2"
    kind: str  # "prefill" | "draft" | "verify" | "rollback" | "idle" | "wait"
    start_s: float
    end_s: float
    tokens: int = 0  # tokens processed by this event (forward width, or tokens rolled back)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class Trace:
    """The events and token progress of one request. Times are seconds since `t0`; time.perf_counter is
    CLOCK_MONOTONIC on Linux, one clock for every process, so a worker records against the caller's t0.
    `device` is the row an event goes to when add/span name none (a worker's own trace)."""

    events: list[TraceEvent] = field(default_factory=list)
    # (seconds since start, tokens committed so far): the AMUSD Fig. 4 token-progress curve
    progress: list[tuple[float, int]] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    device: str = ""

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, device: str | None, kind: str, start_s: float, end_s: float, tokens: int = 0) -> None:
        self.events.append(TraceEvent(device or self.device, kind, start_s, end_s, tokens))

    @contextmanager
    def span(self, kind: str, tokens: int = 0, device: str | None = None, sync=None):
        """Record an event of `kind` around a block. `sync`: called at both ends to wait for the device the block
        computes on (runtime.devices.sync: a GPU forward returns once queued, and its time must not land in the
        next event). Yields the event in the making: the block may set `.tokens` when it learns the count only at
        its end; `.seconds` holds the block's duration once it has ended."""
        event = SimpleNamespace(tokens=tokens, seconds=0.0)
        if sync is not None:
            sync()
        start = self.now()
        try:
            yield event
            if sync is not None:
                sync()
        finally:
            end = self.now()
            event.seconds = end - start
            self.add(device, kind, start, end, event.tokens)

    def commit(self, total_tokens: int, at_s: float | None = None) -> None:
        self.progress.append((self.now() if at_s is None else at_s, total_tokens))

    def event_tuples(self) -> list[tuple]:
        """The events as plain tuples (what a worker sends back; TraceEvent(*t) rebuilds each)."""
        return [astuple(e) for e in self.events]

    def to_dict(self) -> dict:
        return {"events": [asdict(e) for e in self.events], "progress": [list(p) for p in self.progress]}

    @classmethod
    def from_dict(cls, d: dict) -> Trace:
        return cls(
            events=[TraceEvent(**e) for e in d.get("events", [])], progress=[tuple(p) for p in d.get("progress", [])]
        )
