"""The one place that decides which requests run on an Engine (engine.py drives them; strategies decode them; the
server's queue only bounds how many may wait): up to one request per Seat at once (an Engine's max_num_seqs where
its strategy batches requests, else 1), each given the free seat that stands first (Scheduler.order: the lowest
sequence); restart_workers() and set_options() run alone.

Requests are admitted in arrival order (a line; an exclusive request, restart_workers(), goes to its front). A
request beyond the capacity waits its turn (`on_busy="wait"`, at most `wait_timeout` seconds: 600 by default, None
for no limit) or raises EngineBusy (`on_busy="error"`), naming the requests holding the Engine (a stream left open:
which thread opened it, when) and how to end them. A waiting request that is cancelled leaves the line at once. A
request from a thread that left a stream open ends that stream first (its reader gets StreamCancelled).
After a worker fault (`failure`) requests raise it, except while a restart is in line: they wait for the new
workers (the server restarts them itself: Engine.restart_on_fault).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from paraspec.errors import EngineBusy, EngineClosed
from paraspec.streams import Request


class RequestGate:
    """Which requests run on an Engine now (see the module docstring), whether the Engine is closed or failed."""

    def __init__(self, on_busy: str, wait_timeout: float | None):
        self.on_busy, self.wait_timeout = on_busy, wait_timeout
        self.seats: list = []  # open()
        self.order: Callable = lambda seat: 0
        self.cv = threading.Condition()  # guards everything below
        self.active: list[Request] = []
        self.line: list[Request] = []  # waiting, in the order they are admitted
        self.closed = False
        self.failure: BaseException | None = None  # a dead or stuck worker: refused until restart_workers()

    def open(self, seats: list, order: Callable | None = None) -> None:
        """The seats requests are given (the Engine's, again after a restart); `order`: which free one goes first
        (default: as listed)."""
        with self.cv:
            self.seats = list(seats)
            self.order = order or self.seats.index

    @property
    def capacity(self) -> int:
        return len(self.seats)

    def check_usable(self, failed_ok: bool = False) -> None:
        if self.closed:
            raise EngineClosed("this Engine is closed; create a new Engine to generate again")
        if self.failure is not None and not failed_ok and not self._restart_in_line():
            raise self.failure

    def _restart_in_line(self) -> bool:
        return any(r.exclusive for r in self.line + self.active)

    def _room_for(self, request: Request) -> bool:
        if self.line and self.line[0] is not request:
            return False  # not its turn
        if request.exclusive:
            return not self.active
        if self.failure is not None and self._restart_in_line():
            return False  # the workers are being restarted: wait for the new ones
        return len(self.active) < self.capacity and not any(a.exclusive for a in self.active)

    def reserve(self, request: Request) -> Request:
        """Put an exclusive request (restart_workers) at the front of the line now; acquire() it later."""
        with self.cv:
            self.line.insert(0, request)
        return request

    def acquire(self, request: Request, failed_ok: bool = False) -> Request | None:
        """Make `request` one of those in progress: wait for its turn and room (at most wait_timeout), or refuse with
        on_busy="error"; end a stream the calling thread left open (its reader gets StreamCancelled). None: it was
        cancelled while it waited (it leaves the line; nothing runs)."""
        deadline = None if self.wait_timeout is None else time.monotonic() + self.wait_timeout
        with self.cv:
            if request not in self.line:  # exclusive ones before every generation in line
                self.line.insert(sum(r.exclusive for r in self.line) if request.exclusive else len(self.line), request)
        try:
            while True:
                with self.cv:
                    self.check_usable(failed_ok)
                    left_open = [a for a in self.active if a.thread == request.thread and a.open_stream() is not None]
                    if not left_open:
                        if request.cancelled.is_set() and not request.exclusive:
                            return None
                        if self._room_for(request):
                            self._admit(request)
                            return request
                        self._refuse_or_wait(request, deadline)
                        continue
                # this thread left a stream open: it ends (its reader is told), outside the lock
                for active in left_open:
                    stream = active.open_stream()
                    if stream is not None:
                        stream.end(
                            f"{request} was started on the same thread before this stream ended; read a stream "
                            f"to its end or close() it before starting another request"
                        )
                    self.release(active)
        finally:
            with self.cv:
                if request in self.line:  # refused, timed out or failed: out of the line
                    self.line.remove(request)
                    self.cv.notify_all()

    def _admit(self, request: Request) -> None:
        self.line.remove(request)
        self.active.append(request)
        request.admitted = time.perf_counter()
        if not request.exclusive:  # _room_for: a seat is free (one per running generation)
            taken = {id(a.seat) for a in self.active if not a.exclusive and a is not request}
            request.seat = min((s for s in self.seats if id(s) not in taken), key=self.order)
        self.cv.notify_all()

    def _refuse_or_wait(self, request: Request, deadline: float | None) -> None:
        """(holding cv) EngineBusy with on_busy="error" or past the deadline; else wait for a change."""
        holders = "; ".join(f"{a}" for a in self.active) or "requests ahead in line"
        ends = (
            self.active[0].how_to_end()
            if len(self.active) == 1
            else "end one of them (read a stream to its end or close it, or engine.cancel() from any thread)"
        )
        verb = "is" if len(self.active) == 1 else "are"
        if self.on_busy == "error":
            raise EngineBusy(
                f"{holders} {verb} running on this Engine; {ends}, or create the Engine with on_busy='wait'"
            )
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise EngineBusy(
                f"waited {self.wait_timeout:g} s (wait_timeout) for {holders}, which still hold"
                f"{'s' if len(self.active) == 1 else ''} this Engine; {ends}"
            )
        self.cv.wait(left)  # a release, an admission, a cancel (notify) or the deadline

    def notify(self) -> None:
        """Something a waiting request depends on changed (it was cancelled: Stream.cancel)."""
        with self.cv:
            self.cv.notify_all()

    def release(self, request: Request | None) -> None:
        with self.cv:
            if request in self.active:
                self.active.remove(request)
                self.cv.notify_all()

    def claim(self, request: Request, refusal: str) -> Request:
        """Make `request` the only one in progress at once, or raise EngineBusy: `refusal` while the holder runs,
        and how to end it (set_options: it never waits)."""
        with self.cv:
            self.check_usable(failed_ok=True)
            if self.active or self.line:
                holder = self.active[0] if self.active else self.line[0]
                raise EngineBusy(f"{refusal} while {holder} runs; {holder.how_to_end()}")
            self.active.append(request)
            return request

    def generations(self) -> list[Request]:
        """The generations in progress (not restart_workers() / set_options())."""
        with self.cv:
            return [r for r in self.active if not r.exclusive]

    def fail(self, error: BaseException, restart: Callable[[Request], None] | None = None) -> None:
        """A worker fault: requests raise `error` until the workers restart. With `restart` (the Engine's
        restart_workers, where it restarts them itself) the restart goes to the front of the line now, before the
        failed request lets go, and runs in a thread of its own: no request in line meets the dead workers."""
        self.failure = error
        error.args = (
            f"{error}; the Engine's workers must be restarted: call engine.restart_workers() (or create a new Engine)",
        )
        if restart is not None:
            # thread 0: it is no caller's, so it ends no stream a caller left open (the failed one is still active)
            reserved = self.reserve(Request("restart_workers()", exclusive=True, thread=0))
            threading.Thread(target=restart, args=(reserved,), daemon=True, name="paraspec-restart").start()

    def cancel_all(self, wake: Callable[[], None]) -> bool:
        """Cancel every generation in progress (`wake` stops a strategy blocked on its workers); False if none."""
        running = self.generations()
        for request in running:
            request.cancelled.set()
        if running:
            wake()
        return bool(running)

    def waiting(self) -> int:
        """Requests in line for their turn."""
        with self.cv:
            return len(self.line)

    def restarting(self) -> bool:
        """A restart of the workers is in line or running."""
        with self.cv:
            return self._restart_in_line()

    def health(self) -> str | None:
        """Why a request would be refused now (closed, failed: restarting or not), or None."""
        with self.cv:
            if self.closed:
                return "the Engine is closed"
            if self.failure is not None:
                restarting = "the workers are restarting after a fault: " if self._restart_in_line() else ""
                return f"{restarting}{self.failure}"
        return None

    def close(self, why: str, timeout: float, wake: Callable[[], None]) -> None:
        """No request is admitted any more (those in line raise EngineClosed); a stream the calling thread left open
        ends (its reader is told `why`), the generations of other threads are cancelled (`wake` stops a strategy
        blocked on its workers) and given `timeout` seconds to end."""
        with self.cv:
            self.closed = True
            active = list(self.active)
            for request in active:
                request.ended_by = why
            self.cv.notify_all()
        others = False
        for request in active:
            stream = request.open_stream()
            if request.thread == threading.get_ident() and stream is not None:
                stream.end(why)
                self.release(request)
            else:
                request.cancelled.set()
                others = True
        if others:
            wake()
            with self.cv:
                self.cv.wait_for(lambda: not self.active, timeout)
