"""The gate that decides which requests run on an Engine now (engine.py drives them; strategies decode them):
up to `capacity` generations at once (an Engine's max_num_seqs where its strategy batches requests,
else 1); restart_workers() and set_options() run alone. A request beyond the capacity waits its turn
(`on_busy="wait"`, at most `wait_timeout` seconds: 600 by default, None for no limit) or raises EngineBusy
(`on_busy="error"`), naming the requests holding the Engine (a stream left open: which thread opened it, when) and
how to end them. A request from a thread that left a stream open ends that stream first (its reader gets
StreamCancelled).
"""

from __future__ import annotations

import threading
import time

from paraspec.errors import EngineBusy, EngineClosed
from paraspec.streams import Request


class RequestGate:
    """Which requests run on an Engine now (see the module docstring), whether the Engine is closed or failed."""

    def __init__(self, capacity: int, on_busy: str, wait_timeout: float | None):
        self.capacity, self.on_busy, self.wait_timeout = capacity, on_busy, wait_timeout
        self.cv = threading.Condition()  # guards active, closed, failure
        self.active: list[Request] = []
        self.closed = False
        self.failure: BaseException | None = None  # a dead or stuck worker: refused until restart_workers()

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
                    ends = (
                        self.active[0].how_to_end()
                        if len(self.active) == 1
                        else "end one of them (read a stream to its end or close it, "
                        "or engine.cancel() from any thread)"
                    )
                    if self.on_busy == "error":
                        raise EngineBusy(
                            f"{holders} {'is' if len(self.active) == 1 else 'are'} running on this "
                            f"Engine; {ends}, or create the Engine with on_busy='wait'"
                        )
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise EngineBusy(
                            f"waited {self.wait_timeout:g} s (wait_timeout) for {holders}, which still "
                            f"hold{'s' if len(self.active) == 1 else ''} this Engine; {ends}"
                        )
                    self.cv.wait(left)
                    continue
            # this thread left a stream open: it ends (its reader is told), outside the lock; a stream that never
            # started holds nothing: drop it as an active one
            for active in left_open:
                stream = active.open_stream()
                if stream is not None:
                    stream.end(
                        f"{request} was started on the same thread before this stream ended; read a stream "
                        f"to its end or close() it before starting another request"
                    )
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
