"""The Runtime: owner of a set of workers and the channels between them.

    Runtime                 owns workers, channels and a stop signal; close() (or with-exit, garbage
    │                       collection, interpreter exit) stops every worker and unlinks every segment
    ├── Worker  "draft"     pinned to its device; builds its model once from a picklable factory (workers.py)
    ├── Worker  "target"
    └── TokenChannel(s)     shared-memory token exchange between loops (channels.py)

The Runtime's monitor stops all channels as soon as a worker process dies, so loops in other workers blocked on
them wake up with ChannelStopped.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from paraspec.models.llamacpp.child import describe_death
from paraspec.runtime.channels import StopSignal, TokenChannel
from paraspec.runtime.devices import Device
from paraspec.runtime.errors import WorkerClosed
from paraspec.runtime.worker_main import WorkerInfo
from paraspec.runtime.workers import Handle, Worker, expired, remaining, worker_class


@dataclass
class _RuntimeState:
    """Everything close() needs, kept apart from the Runtime so the finalizer holds no reference to it."""

    stop: StopSignal
    workers: dict[str, Worker] = field(default_factory=dict)
    channels: dict[str, TokenChannel] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    closing: bool = False
    workers_stopped: bool = False
    closed: bool = False
    wake_r: int = -1
    wake_w: int = -1
    monitor: threading.Thread | None = None
    worker_timeout: float | None = None  # the watchdog: seconds a worker may stay silent
    server: Any = None  # the ChannelServer of workers on the network transport, once needed

    def stop_all(self, reason: str) -> None:
        self.stop.set(reason)
        for channel in list(self.channels.values()):
            channel.stop(reason)

    def poke_monitor(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass


def _monitor(state: _RuntimeState) -> None:
    """Stop every channel as soon as a worker process dies, so loops blocked on them wake up. With a
    worker_timeout, also the watchdog: read the workers' heartbeats, and fail (kill) one that stays silent."""
    noted: set[str] = set()
    tick = None if state.worker_timeout is None else heartbeat_interval(state.worker_timeout)
    while not state.closing:
        with state.lock:
            workers = list(state.workers.values())
        watched = {w.sentinel: w for w in workers if w.sentinel is not None and w.name not in noted}
        ready = multiprocessing.connection.wait([state.wake_r, *watched], tick)
        if state.wake_r in ready:
            try:
                os.read(state.wake_r, 4096)
            except OSError:
                return
        for sentinel in ready:
            worker = watched.get(sentinel) if isinstance(sentinel, int) else None  # else the wake pipe
            if worker is None:
                continue
            noted.add(worker.name)
            if not state.closing and not worker.closed:
                code = worker.exit_code()
                state.stop_all(f"worker {worker.name!r} ({worker.device}) died{describe_death(code)}")
        if state.worker_timeout is not None and not state.closing:  # (tick is set then)
            for worker in workers:
                if worker.name not in noted and worker.check_heartbeat(state.worker_timeout):
                    noted.add(worker.name)
                    state.stop_all(str(worker.failure))


TRANSPORTS = ("auto", "shm", "tcp")


def check_transport(transport: str, link_latency_s: float) -> None:
    """The Runtime's transport settings (EngineConfig checks them with this too, before anything loads)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; use one of {', '.join(TRANSPORTS)}")
    if isinstance(link_latency_s, bool) or not (isinstance(link_latency_s, (int, float)) and link_latency_s >= 0):
        raise ValueError(f"the link latency must be a number >= 0, got {link_latency_s!r}")


def heartbeat_interval(worker_timeout: float) -> float:
    """How often a worker says it is alive, for a watchdog of `worker_timeout` seconds."""
    return min(1.0, worker_timeout / 4)


def _shutdown(state: _RuntimeState, timeout: float) -> None:
    """Stop every worker and unlink every segment. Each step can be repeated, so a shutdown interrupted by
    Ctrl-C (or an exception) is finished by the next call."""
    if state.closed:
        return
    state.closing = True
    state.poke_monitor()
    if state.monitor is not None and state.monitor is not threading.current_thread():
        state.monitor.join(1.0)
    if not state.workers_stopped:
        workers = list(state.workers.values())
        deadline = time.monotonic() + timeout
        for worker in workers:  # ask them all first, so they exit in parallel
            worker.request_exit(deadline)
        state.stop_all("runtime closed")  # now wake their loops
        for worker in workers:
            worker.wait_exit(deadline)
        state.workers_stopped = True
    if state.server is not None:
        state.server.close()
    for name in list(state.channels):
        state.channels[name].close()
        del state.channels[name]
    state.stop.close()
    for attr in ("wake_r", "wake_w"):
        fd = getattr(state, attr)
        if fd >= 0:
            setattr(state, attr, -1)
            try:
                os.close(fd)
            except OSError:
                pass
    state.closed = True


class Runtime:
    """Owner of a set of workers and the channels between them.

        with Runtime() as rt:
            draft = rt.add_worker("draft", "cpu:0", load_model, {"path": draft_path})
            target = rt.add_worker("target", "cpu:1", load_model, {"path": target_path})
            channel = rt.channel("tokens", capacity=4096, vocab_size=151936)   # q ring for sampling
            ...
    close() stops every worker and unlinks every shared-memory segment; it also runs when the Runtime is
    garbage-collected unclosed, and at interpreter exit (including after Ctrl-C); a close() that was interrupted
    is finished by the next one.

    kind: where its workers run, a key of workers.RUNTIME_KINDS: "process" (default: a pinned process per worker),
    "inprocess" (threads of this process), "ray" (Ray actors, on any node of a cluster).

    worker_timeout (seconds, or None): the watchdog. Workers send heartbeats (also while their model loads); one
    silent for that long (stopped, or stuck holding the interpreter) fails every request to it with
    WorkerTimeout, its channels are stopped and its process killed.

    transport: how workers' loops reach the channels. "auto": shared memory for a worker on this host, TCP
    (net_channel.py) for one on another host; "shm" refuses a worker on another host; "tcp" uses the network
    for every worker (tests and benchmarks of the network path on one host). link_latency_s delays every
    network message by that much (tests and benchmarks only). `options` go to the kind's workers (Ray: address).
    """

    def __init__(
        self,
        kind: str = "process",
        close_timeout: float = 3.0,
        worker_timeout: float | None = None,
        transport: str = "auto",
        link_latency_s: float = 0.0,
        **options,
    ):
        worker_class(kind)  # an unknown name fails here, before anything starts
        check_transport(transport, link_latency_s)
        self.kind = kind
        self.transport, self.link_latency_s, self.options = transport, float(link_latency_s), options
        self.close_timeout = close_timeout
        state = _RuntimeState(stop=StopSignal("stop"), worker_timeout=worker_timeout)
        state.wake_r, state.wake_w = os.pipe()
        self._state = state
        self._finalizer = weakref.finalize(self, _shutdown, state, close_timeout)
        state.monitor = threading.Thread(target=_monitor, args=(state,), name="paraspec-monitor", daemon=True)
        state.monitor.start()

    # -- workers ----------------------------------------------------------------------------------------------
    def add_worker(
        self, name: str, device: Device | str, factory: Callable[..., Any], factory_args: dict | None = None
    ) -> Worker:
        """Start a worker building factory(**factory_args) on `device`; returns at once (see wait_ready)."""
        self._check_open()
        state = self._state
        if name in state.workers:
            raise ValueError(f"a worker named {name!r} already exists in this runtime")
        heartbeat = None if state.worker_timeout is None else heartbeat_interval(state.worker_timeout)
        worker = worker_class(self.kind)(
            name, device, factory, factory_args, state.stop, state.channels, heartbeat_s=heartbeat, **self.options
        )
        with state.lock:
            state.workers[name] = worker
        state.poke_monitor()
        if self.transport == "tcp" or not worker.same_host:
            if self.transport == "shm":
                raise ValueError(
                    f"worker {name!r} runs on another host ({worker.device}), where the shared-memory "
                    f"channels cannot reach; use transport='auto' or 'tcp'"
                )
            worker.use_network(self._channel_server(worker).address, self.link_latency_s)
        return worker

    def _channel_server(self, worker: Worker):
        """The ChannelServer, started on first need, on an address the worker's host can reach."""
        state = self._state
        if state.server is None:
            from paraspec.runtime.net_channel import ChannelServer

            state.server = ChannelServer(state.channels, state.stop, host=worker.caller_address())
        return state.server

    @property
    def worker_timeout(self) -> float | None:
        """The watchdog's seconds (None: no watchdog)."""
        return self._state.worker_timeout

    @property
    def workers(self) -> dict[str, Worker]:
        return dict(self._state.workers)

    def __getitem__(self, name: str) -> Worker:
        return self._state.workers[name]

    def wait_ready(self, timeout: float | None = None) -> dict[str, WorkerInfo]:
        deadline = None if timeout is None else time.monotonic() + timeout
        return {name: w.wait_ready(remaining(deadline)) for name, w in self._state.workers.items()}

    # -- channels and stopping ------------------------------------------------------------------------------
    def channel(self, name: str, capacity: int, *, vocab_size: int | None = None, q_window: int = 64) -> TokenChannel:
        """A new TokenChannel, visible to loops as ctx.channels[name] and closed with the runtime."""
        self._check_open()
        if name in self._state.channels:
            raise ValueError(f"a channel named {name!r} already exists in this runtime")
        channel = TokenChannel(capacity, vocab_size=vocab_size, q_window=q_window, tag=name)
        self._state.channels[name] = channel
        return channel

    @property
    def channels(self) -> dict[str, TokenChannel]:
        return dict(self._state.channels)

    def stop(self, reason: str = "stopped") -> None:
        """Set the stop signal and stop every channel: loops see ctx.stopped, waiters get ChannelStopped."""
        self._state.stop_all(reason)

    # -- waiting on several handles ----------------------------------------------------------------------------
    def wait(
        self, handles: Iterable[Handle], timeout: float | None = None, return_when: str = "first"
    ) -> tuple[list[Handle], list[Handle]]:
        """Block until one ("first") or every ("all") handle is done; return (done, pending)."""
        if return_when not in ("first", "all"):
            raise ValueError(f"return_when must be 'first' or 'all', not {return_when!r}")
        handles = list(handles)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            done = [h for h in handles if h.done()]
            pending = [h for h in handles if h not in done]
            if (done and return_when == "first") or not pending or expired(deadline):
                return done, pending
            workers = {h.worker for h in pending}
            watched = {waitable: w for w in workers for waitable in w.waitables}
            for ready in multiprocessing.connection.wait(list(watched), remaining(deadline)):
                watched[ready].poll()

    def gather(self, *handles: Handle, timeout: float | None = None, grace: float = 5.0) -> list:
        """Results of all handles. On the first failure: stop the runtime (so the other loops end), give
        them `grace` seconds to finish, and raise that failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = list(handles)
        while pending:
            done, pending = self.wait(pending, remaining(deadline), "first")
            if not done:
                raise TimeoutError(f"{len(pending)} request(s) still running after {timeout} s")
            for handle in done:
                error = handle.exception()
                if error is not None:
                    self.stop(f"worker {handle.worker.name!r} failed: {type(error).__name__}")
                    self.wait(pending, grace, "all")
                    raise error
        return [h.result() for h in handles]

    # -- lifetime -----------------------------------------------------------------------------------------------
    def close(self) -> None:
        _shutdown(self._state, self.close_timeout)
        self._finalizer.detach()

    @property
    def closed(self) -> bool:
        return self._state.closing

    def _check_open(self) -> None:
        if self.closed:
            raise WorkerClosed("this runtime is closed")

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Runtime {self.kind} workers={list(self._state.workers)} channels={list(self._state.channels)}>"
