"""The worker side: what runs inside a worker process (or thread, or Ray actor) -- build the model once, then
answer requests until shutdown or until the caller goes away.

`serve(sock, name, device, spec, in_process)` is the public entry point every kind of worker runs: the process
runtime's from `process_main` in a spawned child, the in-process runtime's on a thread, the Ray runtime's inside an
actor.
A request is a model call, a loop (`fn(model, ctx, **kwargs)` with a `LoopContext`), or the link's latency.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

from paraspec.runtime.channels import StopSignal, TokenChannel
from paraspec.runtime.devices import Device, apply_device, check_available, parse_device, sync
from paraspec.runtime.errors import error_payload
from paraspec.runtime.wire import Wire
from paraspec.trace import Trace

# --- what a worker reports and what a loop gets -----------------------------------------------------------


@dataclass(frozen=True)
class WorkerInfo:
    name: str
    device: str
    pid: int
    cores: tuple[int, ...]  # the CPU affinity the worker runs with
    num_threads: int  # torch.get_num_threads() inside the worker
    model_type: str
    vocab_size: int | None
    eos_token_ids: tuple[int, ...] | None
    max_context: int | None
    build_s: float  # pinning + model factory, measured inside the worker
    startup_s: float = 0.0  # from start to ready, measured by the caller (includes spawn + imports)
    exact: bool | None = None  # llama.cpp: the target's exact kernels, or a draft's fastest (None: no such choice)
    splits_prompts: bool = False  # models.base.Model (a worker may serve what is not a Model)


@dataclass
class LoopContext:
    """What a loop function gets besides its model: its worker's identity, the Runtime's channels (by name)
    and stop signal, and a trace (its events reach the caller's Handle)."""

    name: str
    device: Device
    channels: dict[str, TokenChannel]
    stop: StopSignal
    trace: Trace

    @property
    def stopped(self) -> bool:
        return self.stop.is_set()


# --- the worker side ---------------------------------------------------------------------------------------


def serve(
    sock: socket.socket, name: str, device: Device, spec: bytes, in_process: bool, heartbeat_s: float | None = None
) -> None:
    """A worker's life: build the model, then answer requests until shutdown or the caller goes away.
    With heartbeat_s, a thread sends a heartbeat that often from the start (model loading included): the
    caller's watchdog tells a slow worker from a stopped or stuck one."""
    worker = _Worker(Wire(sock), name, device)
    if heartbeat_s is not None:
        worker.start_heartbeats(heartbeat_s)
    worker.start_reading()
    if worker.build(spec, in_process):
        worker.answer_requests()


class _Worker:
    """One worker's state while it serves: its end of the wire, the requests its reader thread queued, the
    shutdown flag the reader and heartbeat threads share, the model once built, and the simulated link latency."""

    def __init__(self, wire: Wire, name: str, device: Device):
        self.wire, self.name, self.device = wire, name, device
        self.label = f"{name}:{device}"
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.shutting_down = threading.Event()
        self.model = None
        self.link_latency_s = 0.0  # a simulated link (tests, benchmarks): each request arrives, and each reply
        # leaves, this much later; the caller is not held up meanwhile, as on a real link

    # The threads get the wire, queue and flag, not the worker: a thread that outlives serve() (a heartbeat
    # until its next send fails) must not keep the model alive.
    def start_heartbeats(self, interval: float) -> None:
        threading.Thread(
            target=_beat,
            args=(self.wire, interval, self.shutting_down),
            name=f"paraspec-{self.name}-heartbeat",
            daemon=True,
        ).start()

    def start_reading(self) -> None:
        threading.Thread(
            target=_read_requests,
            args=(self.wire, self.requests, self.shutting_down),
            name=f"paraspec-{self.name}-reader",
            daemon=True,
        ).start()

    def build(self, spec: bytes, in_process: bool) -> bool:
        """Build the model and tell the caller: "ready" with a WorkerInfo, or "ready_error" (and close) if the
        build failed. Returns whether the worker is ready to answer requests."""
        try:
            self.model, info = _build_model(self.name, self.device, spec, in_process)
        except BaseException as exc:
            self.wire.send(("ready_error",), error_payload(exc))
            self.wire.close()
            return False
        self.wire.send(("ready",), info)
        return True

    def answer_requests(self) -> None:
        """Answer requests in arrival order until shutdown, EOF or a broken socket; then close the wire."""
        try:
            while True:
                envelope, load_body = self.requests.get()
                if envelope[0] in ("shutdown", "eof") or self.shutting_down.is_set():
                    break
                self._answer(envelope, load_body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the caller is gone
        finally:
            self.wire.close()

    def _answer(self, envelope: tuple, load_body) -> None:
        """Run one request and send its reply; a failure becomes an error reply, never the worker's end."""
        kind, request_id, t0 = envelope
        if self.link_latency_s > 0 and kind != "link":
            time.sleep(self.link_latency_s)
        recorder = Trace(t0=t0, device=self.label)
        try:
            result = self._run(kind, load_body(), recorder)
            status = "ok"
        except BaseException as exc:
            status, result = "error", error_payload(exc)
        if self.link_latency_s > 0:
            time.sleep(self.link_latency_s)
        try:
            self.wire.send((status, request_id, recorder.event_tuples(), recorder.progress), result)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # an unpicklable result
            self.wire.send(("error", request_id, recorder.event_tuples(), recorder.progress), error_payload(exc))

    def _run(self, kind: str, body, recorder: Trace):
        if kind == "call":
            method, args, kwargs = body
            attribute = getattr(self.model, method)
            if callable(attribute):
                return attribute(*args, **kwargs)
            if args or kwargs:
                raise TypeError(f"{type(self.model).__name__}.{method} is not callable; it takes no arguments")
            return attribute
        if kind == "loop":
            loop_fn, kwargs, channels, stop = body
            return loop_fn(self.model, LoopContext(self.name, self.device, channels, stop, recorder), **kwargs)
        if kind == "link":
            self.link_latency_s = float(body[0])
            return None
        raise ValueError(f"unknown request {kind!r}")


def _beat(wire: Wire, interval: float, shutting_down: threading.Event) -> None:
    while not shutting_down.wait(interval):
        try:
            wire.send(("heartbeat",))
        except OSError:
            return


def _read_requests(wire: Wire, requests: queue.SimpleQueue, shutting_down: threading.Event) -> None:
    # Reading on its own thread keeps the socket drained while the main thread computes, so a caller
    # that sends while the worker sends never deadlocks on two full socket buffers.
    while True:
        try:
            envelope, load_body = wire.recv()
        except Exception:  # EOF, or a stream garbled by a caller interrupted mid-send: stop serving
            requests.put((("eof",), None))
            return
        if envelope[0] == "shutdown":
            shutting_down.set()  # requests still queued are dropped: nobody will read their replies
            requests.put((envelope, None))
            try:
                wire.send(("closing",))  # tells the caller it may now stop our loop without a race
            except OSError:
                pass
            return
        requests.put((envelope, load_body))


def _build_model(name: str, device: Device, spec: bytes, in_process: bool):
    """Pin this worker to its device and run the model factory; returns the model and the WorkerInfo to report."""
    t_build = time.perf_counter()
    if device.node:  # a device on a named node: its cores and GPUs are checked here, on it
        check_available(device, f"node {device.node!r}")
    if not in_process or device.kind == "cuda":
        apply_device(device)  # CPU pinning is per process: the in-process runtime leaves it alone
    factory, factory_args = pickle.loads(spec)
    try:
        model = factory(**factory_args)
    except (OSError, ValueError) as exc:
        if device.node:  # a checkpoint missing on that node, say: name the node and the fix
            exc.args = (
                f"on node {device.node!r}: {exc} (a node loads the checkpoint from the path the caller "
                f"resolved: put it at the same path there, e.g. `make models` on that node, or use a "
                f"shared filesystem)",
            )
        raise
    sync(device)  # build_s includes the weights' copies to a GPU, not only their launch
    import torch

    info = WorkerInfo(
        name=name,
        device=str(device),
        pid=os.getpid(),
        cores=tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else (),
        num_threads=torch.get_num_threads(),
        model_type=type(model).__qualname__,
        vocab_size=getattr(model, "vocab_size", None),
        eos_token_ids=(tuple(model.eos_token_ids) if hasattr(model, "eos_token_ids") else None),
        max_context=getattr(model, "max_context", None),
        build_s=time.perf_counter() - t_build,
        exact=getattr(model, "exact", None),
        splits_prompts=bool(getattr(model, "splits_prompts", False)),
    )
    return model, info


class CallerState:
    """What a worker forked from the fork server takes from its caller as the caller is when the worker starts (a
    spawned worker inherits the same): the environment, the core affinity (a worker on `cpu` keeps it; one on
    `cpu:N` pins itself) and the caller's stdout and stderr. The descriptors travel as the start method passes
    descriptors (multiprocessing's DupFd, made while the worker is being started)."""

    def __init__(self, environ: dict[str, str], affinity: set[int] | None = None, stdio: tuple = (None, None)):
        self.environ, self.affinity, self.stdio = environ, affinity, stdio

    @classmethod
    def now(cls) -> CallerState:
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        return cls(dict(os.environ), affinity)

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        stdio = tuple(DupFd(fd) if _is_open(fd) else None for fd in (1, 2))
        return CallerState, (self.environ, self.affinity, stdio)

    def apply(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        if self.affinity and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.affinity)
        for stream in (sys.stdout, sys.stderr):
            _flush(stream)
        for target, passed in zip((1, 2), self.stdio, strict=True):
            if passed is not None:
                fd = passed.detach()
                os.dup2(fd, target)
                os.close(fd)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _flush(stream) -> None:
    try:
        stream.flush()
    except (AttributeError, ValueError, OSError):
        pass


def process_main(
    sock: socket.socket,
    name: str,
    device: str,
    spec: bytes,
    heartbeat_s: float | None = None,
    caller: CallerState | None = None,
) -> None:
    # Ctrl-C reaches the whole process group; the caller decides what happens to its workers. The caller held
    # SIGINT and SIGTERM while it started us (workers.signals_held_while_starting), and the fork server holds them
    # as the caller did when it started the server: take SIGTERM again.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if caller is not None:
        caller.apply()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    parent = multiprocessing.parent_process()
    if parent is not None:

        def exit_with_parent():
            multiprocessing.connection.wait([parent.sentinel])
            os._exit(1)  # the parent died without closing us (e.g. SIGKILL): nobody will read our results

        threading.Thread(target=exit_with_parent, name="paraspec-parent-watch", daemon=True).start()
    serve(sock, name, parse_device(device), spec, in_process=False, heartbeat_s=heartbeat_s)
    # Everything this process shared is released by now; skip the interpreter's teardown, which with torch loaded
    # is most of a close().
    for stream in (sys.stdout, sys.stderr):
        _flush(stream)
    os._exit(0)
