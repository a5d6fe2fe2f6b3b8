"""Workers: one model per device group, served from its own process (or thread), driven by the caller.

    Runtime                 owns workers, channels and a stop signal; close() (or with-exit, garbage
    │                       collection, interpreter exit) stops every worker and unlinks every segment
    ├── Worker  "draft"     process pinned to its device; builds its model once from a picklable factory
    │     ├── call / submit(method, *args)     the model's methods, synchronously or as a Handle
    │     └── start_loop(fn, **kwargs)         fn(model, ctx, **kwargs) runs inside the worker until it returns
    ├── Worker  "target"
    └── TokenChannel(s)     shared-memory token exchange between loops (channels.py)

Two backends with one interface: "process" (default; spawn, one process per device group) and "inprocess"
(a thread of the caller's process, no pinning: for tests and single-device runs). Both run the same request
loop (_serve) behind the same Worker interface. A Ray backend would subclass Worker too: _start() launches an
actor running that loop, and the single-host pieces (socket pair, process sentinel, /dev/shm channels) get
Ray equivalents (actor calls, actor liveness, Ray's object store).

Requests to one worker run one at a time, in submission order (a call submitted while a loop runs waits for
the loop). Control messages and results travel over a socket pair (wire.py); logits come back as arrays
through that socket. Faults: an exception in the worker raises RemoteError (with the worker's traceback)
in whoever waits for that request; a dead worker raises WorkerDied in every waiter within milliseconds
(the wait includes the process sentinel), and the Runtime's monitor stops all channels so loops in other
workers blocked on them wake up with ChannelStopped.
"""
from __future__ import annotations

import abc
import dataclasses
import itertools
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
import traceback
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from paraspec.runtime.channels import StopSignal, TokenChannel, release_attached
from paraspec.runtime.devices import Device, apply_device, parse_device
from paraspec.runtime.wire import Wire, wire_pair
from paraspec.trace import Trace, TraceEvent

BACKENDS = ("process", "inprocess", "ray")   # ray: paraspec/runtime/ray_backend.py (optional extra)


# --- errors ------------------------------------------------------------------------------------------------

class WorkerError(RuntimeError):
    """Base of every failure that comes from a worker."""

    def __init__(self, message: str, worker: str = ""):
        super().__init__(message)
        self.worker = worker


class RemoteError(WorkerError):
    """The worker raised. `exc_type` is the remote exception's class name, `remote_traceback` its formatted
    traceback, `original` the exception itself when it could be unpickled here (else None)."""

    def __init__(self, worker: str, exc_type: str, message: str, remote_traceback: str, original=None):
        super().__init__(f"{exc_type} in worker {worker!r}: {message}\n\n"
                         f"--- traceback in worker {worker!r} ---\n{remote_traceback}", worker)
        self.exc_type, self.remote_message, self.remote_traceback = exc_type, message, remote_traceback
        self.original = original


class WorkerDied(WorkerError):
    """The worker's process exited while a request was outstanding (or before it started)."""

    def __init__(self, message: str, worker: str, exitcode: int | None):
        super().__init__(message, worker)
        self.exitcode = exitcode


class WorkerClosed(WorkerError):
    pass


def _error_payload(exc: BaseException) -> tuple:
    try:
        pickled = pickle.dumps(exc)
    except Exception:
        pickled = None
    return type(exc).__qualname__, str(exc), traceback.format_exc(), pickled


def _remote_error(worker: str, payload: tuple) -> RemoteError:
    exc_type, message, tb, pickled = payload
    original = None
    if pickled is not None:
        try:
            original = pickle.loads(pickled)
        except Exception:
            pass
    return RemoteError(worker, exc_type, message, tb, original)


# --- what a worker reports and what a loop gets -----------------------------------------------------------

@dataclass(frozen=True)
class WorkerInfo:
    name: str
    device: str
    pid: int
    cores: tuple[int, ...]          # the CPU affinity the worker runs with
    num_threads: int                # torch.get_num_threads() inside the worker
    model_type: str
    vocab_size: int | None
    eos_token_ids: tuple[int, ...] | None
    max_context: int | None
    build_s: float                  # pinning + model factory, measured inside the worker
    startup_s: float = 0.0          # from start to ready, measured by the caller (includes spawn + imports)


class TraceRecorder:
    """Timed events of one request, in seconds since the caller's t0 (time.perf_counter is CLOCK_MONOTONIC
    on Linux, one clock for every process, so the caller's t0 is valid here)."""

    def __init__(self, device: str, t0: float):
        self.device, self.t0 = device, t0
        self.events: list[tuple] = []
        self.progress: list[tuple[float, int]] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, kind: str, start_s: float, end_s: float, tokens: int = 0, device: str | None = None) -> None:
        self.events.append((device or self.device, kind, start_s, end_s, tokens))

    @contextmanager
    def span(self, kind: str, tokens: int = 0):
        start = self.now()
        try:
            yield
        finally:
            self.add(kind, start, self.now(), tokens)

    def commit(self, total_tokens: int, at_s: float | None = None) -> None:
        """A point of the token-progress curve: `total_tokens` committed at `at_s` (default now)."""
        self.progress.append((self.now() if at_s is None else at_s, total_tokens))


@dataclass
class LoopContext:
    """What a loop function gets besides its model: its worker's identity, the Runtime's channels (by name)
    and stop signal, and a trace recorder."""
    name: str
    device: Device
    channels: dict[str, TokenChannel]
    stop: StopSignal
    trace: TraceRecorder

    @property
    def stopped(self) -> bool:
        return self.stop.is_set()


# --- the worker side ---------------------------------------------------------------------------------------

def _serve(sock: socket.socket, name: str, device: Device, spec: bytes, in_process: bool) -> None:
    """A worker's life: build the model, then answer requests until shutdown or the caller goes away."""
    wire = Wire(sock)
    requests: queue.SimpleQueue = queue.SimpleQueue()
    shutting_down = threading.Event()

    def read_requests():
        # Reading on its own thread keeps the socket drained while the main thread computes, so a caller
        # that sends while the worker sends never deadlocks on two full socket buffers.
        while True:
            try:
                envelope, load_body = wire.recv()
            except Exception:   # EOF, or a stream garbled by a caller interrupted mid-send: stop serving
                requests.put((("eof",), None))
                return
            if envelope[0] == "shutdown":
                shutting_down.set()   # requests still queued are dropped: nobody will read their replies
                requests.put((envelope, None))
                try:
                    wire.send(("closing",))   # tells the caller it may now stop our loop without a race
                except OSError:
                    pass
                return
            requests.put((envelope, load_body))

    threading.Thread(target=read_requests, name=f"paraspec-{name}-reader", daemon=True).start()
    label = f"{name}:{device}"
    try:
        t_build = time.perf_counter()
        if not in_process or device.kind == "cuda":
            apply_device(device)   # CPU pinning is per process: the in-process backend leaves it alone
        factory, factory_args = pickle.loads(spec)
        model = factory(**factory_args)
        import torch
        info = WorkerInfo(
            name=name, device=str(device), pid=os.getpid(),
            cores=tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else (),
            num_threads=torch.get_num_threads(), model_type=type(model).__qualname__,
            vocab_size=getattr(model, "vocab_size", None),
            eos_token_ids=(tuple(model.eos_token_ids) if hasattr(model, "eos_token_ids") else None),
            max_context=getattr(model, "max_context", None), build_s=time.perf_counter() - t_build)
    except BaseException as exc:
        wire.send(("ready_error",), _error_payload(exc))
        wire.close()
        return
    wire.send(("ready",), info)

    try:
        while True:
            envelope, load_body = requests.get()
            kind = envelope[0]
            if kind in ("shutdown", "eof") or shutting_down.is_set():
                break
            _, request_id, t0 = envelope
            recorder = TraceRecorder(label, t0)
            try:
                body = load_body()
                if kind == "call":
                    method, args, kwargs = body
                    attribute = getattr(model, method)
                    if callable(attribute):
                        result = attribute(*args, **kwargs)
                    elif args or kwargs:
                        raise TypeError(f"{type(model).__name__}.{method} is not callable; it takes no arguments")
                    else:
                        result = attribute
                elif kind == "loop":
                    loop_fn, kwargs, channels, stop = body
                    result = loop_fn(model, LoopContext(name, device, channels, stop, recorder), **kwargs)
                elif kind == "release":
                    release_attached(body[0])
                    result = None
                else:
                    raise ValueError(f"unknown request {kind!r}")
                status = "ok"
            except BaseException as exc:
                status, result = "error", _error_payload(exc)
            try:
                wire.send((status, request_id, recorder.events, recorder.progress), result)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:   # an unpicklable result
                wire.send(("error", request_id, recorder.events, recorder.progress), _error_payload(exc))
    except (BrokenPipeError, ConnectionResetError):
        pass   # the caller is gone
    finally:
        wire.close()


def _process_main(sock: socket.socket, name: str, device: str, spec: bytes) -> None:
    # Ctrl-C reaches the whole process group; the caller decides what happens to its workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        def exit_with_parent():
            multiprocessing.connection.wait([parent.sentinel])
            os._exit(1)   # the parent died without closing us (e.g. SIGKILL): nobody will read our results
        threading.Thread(target=exit_with_parent, name="paraspec-parent-watch", daemon=True).start()
    _serve(sock, name, parse_device(device), spec, in_process=False)
    # Everything this process shared is released by now; skip the interpreter's teardown (with torch loaded
    # it takes ~0.5 s), which is most of a close().
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass
    os._exit(0)


# --- the caller side ---------------------------------------------------------------------------------------

class Handle:
    """One outstanding request. result() blocks (or raises RemoteError / WorkerDied / TimeoutError);
    after it settles, `events` holds the worker's TraceEvents (also merged into the trace given at submit)."""

    def __init__(self, worker: "Worker", request_id: int, trace: Trace | None):
        self.worker, self.request_id, self.trace = worker, request_id, trace
        self.events: list[TraceEvent] = []
        self._settled = False
        self._value = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once result() would not block."""
        if self._settled:
            return True
        self.worker._pump(0.0)
        return self.request_id in self.worker._replies or self.worker._death is not None

    def result(self, timeout: float | None = None):
        if not self._settled:
            self._settle(self.worker._reply_for(self.request_id, timeout))
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error result() would raise (None on success); TimeoutError still propagates."""
        if not self._settled:
            self._settle(self.worker._reply_for(self.request_id, timeout))
        return self._error

    def _settle(self, reply: tuple | WorkerDied) -> None:
        self._settled = True
        if isinstance(reply, WorkerDied):
            self._error = reply
            return
        (status, _, events, progress), load_body = reply
        self.events = [TraceEvent(*e) for e in events]
        if self.trace is not None:
            self.trace.events.extend(self.events)
            self.trace.progress.extend(progress)
        try:
            body = load_body()
        except Exception as exc:
            self._error = WorkerError(f"the reply of worker {self.worker.name!r} cannot be unpickled here: "
                                      f"{type(exc).__name__}: {exc}", self.worker.name)
            return
        if status == "ok":
            self._value = body
        else:
            self._error = _remote_error(self.worker.name, body)

    def __repr__(self) -> str:
        return f"<Handle {self.worker.name}#{self.request_id} {'settled' if self._settled else 'pending'}>"


class Worker(abc.ABC):
    """The caller's end of one worker. Backends subclass it and provide _start(), _sentinel, _is_alive(),
    _exitcode() and _stop_worker()."""

    backend = ""

    def __init__(self, name: str, device: Device | str, factory: Callable[..., Any], factory_args: dict | None,
                 stop: StopSignal, channels: dict[str, TokenChannel]):
        self.name = name
        self.device = parse_device(device)
        try:
            self._spec = pickle.dumps((factory, dict(factory_args or {})))
        except Exception as exc:
            raise TypeError(f"worker {name!r}: the model factory and its arguments must be picklable (a "
                            f"module-level function or class, plain arguments): {exc}") from exc
        self._stop_signal, self._channels = stop, channels
        self._wire, self._their_sock = wire_pair()
        self._recv_lock = threading.Lock()
        self._replies: dict[int, tuple] = {}
        self._abandoned: set[int] = set()
        self._ids = itertools.count(1)
        self._info: WorkerInfo | None = None
        self._ready_error: BaseException | None = None
        self._death: WorkerDied | None = None
        self._closed = False
        self._closing_acked = False
        self._t_start = time.perf_counter()
        self._start()

    # -- backend hooks ------------------------------------------------------------------------------------
    _sentinel: int | None = None   # a process handle that becomes readable when the worker dies, if any

    @abc.abstractmethod
    def _start(self) -> None:
        """Start serving `_their_sock` (the other end of `_wire`) with _serve()."""

    @abc.abstractmethod
    def _is_alive(self) -> bool: ...

    @abc.abstractmethod
    def _exitcode(self) -> int | None: ...

    @abc.abstractmethod
    def _stop_worker(self, deadline: float) -> None:
        """Wait for the worker to exit until `deadline` (monotonic), then force it if the backend can."""

    # -- public ---------------------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return None

    @property
    def alive(self) -> bool:
        return self._death is None and not self._closed and self._is_alive()

    @property
    def info(self) -> WorkerInfo:
        return self.wait_ready()

    def wait_ready(self, timeout: float | None = None) -> WorkerInfo:
        """Block until the model is built; raise RemoteError if the factory failed, WorkerDied if the
        process died, TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._info is None and self._ready_error is None:
            if self._death is not None:
                raise self._death
            if not self._pump(_remaining(deadline)) and _expired(deadline):
                raise TimeoutError(f"worker {self.name!r} not ready after {timeout} s")
        if self._ready_error is not None:
            raise self._ready_error
        return self._info

    def submit(self, method: str, *args, trace: Trace | None = None, **kwargs) -> Handle:
        """Run model.<method>(*args, **kwargs) in the worker (a non-callable attribute is returned as is)."""
        return self._request("call", trace, method, args, kwargs)

    def call(self, method: str, *args, timeout: float | None = None, trace: Trace | None = None, **kwargs):
        handle = self.submit(method, *args, trace=trace, **kwargs)
        try:
            return handle.result(timeout)
        except TimeoutError:
            self._abandoned.add(handle.request_id)
            self._replies.pop(handle.request_id, None)   # in case it arrived in between
            raise

    def start_loop(self, loop_fn: Callable[..., Any], *, trace: Trace | None = None, **kwargs) -> Handle:
        """Run loop_fn(model, ctx, **kwargs) inside the worker; the handle yields its return value.
        loop_fn must be picklable (module level); kwargs may hold TokenChannels and arrays."""
        return self._request("loop", trace, loop_fn, kwargs, dict(self._channels), self._stop_signal)

    def release_channels(self, names: Iterable[str]) -> None:
        """Have the worker unmap channels it attached, once it gets to it (queued behind earlier requests;
        nobody waits for the reply)."""
        self._request("release", None, list(names), abandon=True)

    def close(self, timeout: float = 3.0) -> None:
        """Ask the worker to exit; terminate (then kill) it if it has not after `timeout` seconds."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        self._request_shutdown(deadline)
        self._stop_worker(deadline)
        self._wire.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("dead" if self._death else "alive")
        return f"<{type(self).__name__} {self.name!r} on {self.device} pid={self.pid} {state}>"

    # -- plumbing ---------------------------------------------------------------------------------------------
    def _request_shutdown(self, deadline: float) -> None:
        """Send shutdown and wait (briefly) for the worker to confirm it will take no further request, so
        whatever ends its current loop next cannot let a queued request start first."""
        try:
            self._wire.send(("shutdown",))
        except OSError:
            return
        ack_deadline = min(deadline, time.monotonic() + 0.5)
        while not self._closing_acked and self._death is None and not _expired(ack_deadline):
            self._pump(_remaining(ack_deadline))

    def _request(self, kind: str, trace: Trace | None, *body, abandon: bool = False) -> Handle:
        if self._closed:
            raise WorkerClosed(f"worker {self.name!r} is closed", self.name)
        if self._death is not None:
            raise self._death
        request_id = next(self._ids)
        if abandon:
            self._abandoned.add(request_id)
        t0 = trace.t0 if trace is not None else time.perf_counter()
        try:
            self._wire.send((kind, request_id, t0), body)
        except (BrokenPipeError, ConnectionResetError):
            self._pump(1.0)
            raise self._death or WorkerDied(f"worker {self.name!r} is gone", self.name, self._exitcode())
        return Handle(self, request_id, trace)

    def _reply_for(self, request_id: int, timeout: float | None) -> tuple | WorkerDied:
        deadline = None if timeout is None else time.monotonic() + timeout
        while request_id not in self._replies:
            if self._death is not None:
                return self._death
            if not self._pump(_remaining(deadline)) and _expired(deadline):
                raise TimeoutError(f"worker {self.name!r}: no reply to request {request_id} after {timeout} s")
        return self._replies.pop(request_id)

    def _pump(self, timeout: float | None) -> bool:
        """Read what the worker sent, waiting up to `timeout` s for something; True if anything happened.
        Waits on the socket and the process sentinel together, so a death is noticed at once."""
        if not self._recv_lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            return False
        try:
            if self._death is not None:
                return False
            watched = [self._wire.sock] + ([self._sentinel] if self._sentinel is not None else [])
            ready = multiprocessing.connection.wait(watched, timeout)
            if not ready:
                return False
            if self._wire.sock in ready:
                try:
                    self._dispatch(*self._wire.recv())
                    return True
                except (EOFError, OSError):
                    pass
            # The process exited (or closed its socket): keep what it sent before it went, then report it.
            while multiprocessing.connection.wait([self._wire.sock], 0):
                try:
                    self._dispatch(*self._wire.recv())
                except (EOFError, OSError):
                    break
            self._note_death()
            return True
        finally:
            self._recv_lock.release()

    def _dispatch(self, envelope: tuple, load_body: Callable[[], Any]) -> None:
        kind = envelope[0]
        if kind == "ready":
            self._info = dataclasses.replace(load_body(), startup_s=time.perf_counter() - self._t_start)
        elif kind == "ready_error":
            self._ready_error = _remote_error(self.name, load_body())
        elif kind == "closing":
            self._closing_acked = True
        elif envelope[1] in self._abandoned:
            self._abandoned.discard(envelope[1])
        else:
            self._replies[envelope[1]] = (envelope, load_body)

    def _note_death(self) -> None:
        if self._death is not None:
            return
        code = self._exitcode()
        how = "closed" if self._closed else "died"
        if code is not None and code < 0:
            try:
                how += f" with signal {signal.Signals(-code).name}"
            except ValueError:
                how += f" with signal {-code}"
        elif code is not None:
            how += f" with exit code {code}"
        if self._info is None and self._ready_error is None:
            how += (" before its model was ready; its stderr says why (a script that starts workers needs "
                    "`if __name__ == '__main__':`, and the model factory must be importable by module name)")
        self._death = WorkerDied(f"worker {self.name!r} ({self.device}, pid {self.pid}) {how}", self.name, code)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


class ProcessWorker(Worker):
    """A worker in its own spawned process, pinned to its device."""

    backend = "process"

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._process = context.Process(target=_process_main, name=f"paraspec-{self.name}", daemon=True,
                                        args=(self._their_sock, self.name, str(self.device), self._spec))
        self._process.start()
        self._their_sock.close()
        self._sentinel = self._process.sentinel

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _is_alive(self) -> bool:
        return self._process.is_alive()

    def _exitcode(self) -> int | None:
        self._process.join(0.5)   # the sentinel fired: the exit status is a waitpid away
        return self._process.exitcode

    def _stop_worker(self, deadline: float) -> None:
        process = self._process
        process.join(_remaining(deadline))
        if process.is_alive():
            process.terminate()
            process.join(1.0)
        if process.is_alive():
            process.kill()
            process.join(1.0)


class ThreadWorker(Worker):
    """The in-process backend: the same protocol, served by a thread of the caller's process. No CPU pinning
    (affinity and torch's thread count are per process); requests still run one at a time, concurrently with
    the caller and with other workers' loops."""

    backend = "inprocess"

    def _start(self) -> None:
        self._thread = threading.Thread(target=_serve, name=f"paraspec-{self.name}", daemon=True,
                                        args=(self._their_sock, self.name, self.device, self._spec, True))
        self._thread.start()

    @property
    def pid(self) -> int | None:
        return os.getpid()

    def _is_alive(self) -> bool:
        return self._thread.is_alive()

    def _exitcode(self) -> int | None:
        return None

    def _stop_worker(self, deadline: float) -> None:
        self._thread.join(_remaining(deadline))   # a thread cannot be killed; a stuck one stays (daemon)


_WORKER_CLASSES = {"process": ProcessWorker, "inprocess": ThreadWorker}


def _worker_class(backend: str) -> type[Worker]:
    if backend == "ray":                    # imported on demand: Ray is an optional extra
        from paraspec.runtime.ray_backend import RayWorker
        return RayWorker
    return _WORKER_CLASSES[backend]


# --- the owner ---------------------------------------------------------------------------------------------

@dataclass
class _RuntimeState:
    """Everything close() needs, kept apart from the Runtime so the finalizer holds no reference to it."""
    stop: StopSignal
    workers: dict[str, Worker] = field(default_factory=dict)
    channels: dict[str, TokenChannel] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    closing: bool = False
    wake_r: int = -1
    wake_w: int = -1
    monitor: threading.Thread | None = None

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
    """Stop every channel as soon as a worker process dies, so loops blocked on them wake up."""
    noted: set[str] = set()
    while not state.closing:
        with state.lock:
            watched = {w._sentinel: w for w in state.workers.values()
                       if w._sentinel is not None and w.name not in noted}
        ready = multiprocessing.connection.wait([state.wake_r, *watched])
        if state.wake_r in ready:
            os.read(state.wake_r, 4096)
        for sentinel in ready:
            worker = watched.get(sentinel)
            if worker is None:
                continue
            noted.add(worker.name)
            if not state.closing and not worker._closed:
                code = worker._exitcode()
                state.stop_all(f"worker {worker.name!r} ({worker.device}) died with exit code {code}")


def _shutdown(state: _RuntimeState, timeout: float) -> None:
    if state.closing:
        return
    state.closing = True
    state.poke_monitor()
    if state.monitor is not None and state.monitor is not threading.current_thread():
        state.monitor.join(1.0)
    workers = list(state.workers.values())
    deadline = time.monotonic() + timeout
    for worker in workers:   # ask them all first, so they exit in parallel
        if not worker._closed:
            worker._request_shutdown(deadline)
    state.stop_all("runtime closed")   # now wake their loops
    for worker in workers:
        worker._closed = True
        try:
            worker._stop_worker(deadline)
        finally:
            worker._wire.close()
    for channel in list(state.channels.values()):
        channel.close()
    state.channels.clear()
    state.stop.close()
    for fd in (state.wake_r, state.wake_w):
        try:
            os.close(fd)
        except OSError:
            pass


class Runtime:
    """Owner of a set of workers and the channels between them.

        with Runtime() as rt:
            draft = rt.add_worker("draft", "cpu:0", load_model, {"path": draft_path})
            target = rt.add_worker("target", "cpu:1", load_model, {"path": target_path})
            channel = rt.channel("tokens", capacity=4096, vocab_size=151936)   # q ring for sampling
            ...
    close() stops every worker and unlinks every shared-memory segment; it also runs when the Runtime is
    garbage-collected unclosed, and at interpreter exit (including after Ctrl-C).
    """

    def __init__(self, backend: str = "process", close_timeout: float = 3.0):
        if backend not in BACKENDS:
            raise ValueError(f"unknown runtime backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self.backend = backend
        state = _RuntimeState(stop=StopSignal("stop"))
        state.wake_r, state.wake_w = os.pipe()
        self._state = state
        self._finalizer = weakref.finalize(self, _shutdown, state, close_timeout)
        state.monitor = threading.Thread(target=_monitor, args=(state,), name="paraspec-monitor", daemon=True)
        state.monitor.start()

    # -- workers ----------------------------------------------------------------------------------------------
    def add_worker(self, name: str, device: Device | str, factory: Callable[..., Any],
                   factory_args: dict | None = None) -> Worker:
        """Start a worker building factory(**factory_args) on `device`; returns at once (see wait_ready)."""
        self._check_open()
        state = self._state
        if name in state.workers:
            raise ValueError(f"a worker named {name!r} already exists in this runtime")
        worker = _worker_class(self.backend)(name, device, factory, factory_args, state.stop, state.channels)
        with state.lock:
            state.workers[name] = worker
        state.poke_monitor()
        return worker

    @property
    def workers(self) -> dict[str, Worker]:
        return dict(self._state.workers)

    def __getitem__(self, name: str) -> Worker:
        return self._state.workers[name]

    def wait_ready(self, timeout: float | None = None) -> dict[str, WorkerInfo]:
        deadline = None if timeout is None else time.monotonic() + timeout
        return {name: w.wait_ready(_remaining(deadline)) for name, w in self._state.workers.items()}

    # -- channels and stopping ------------------------------------------------------------------------------
    def channel(self, name: str, capacity: int, *, vocab_size: int | None = None,
                q_window: int = 64) -> TokenChannel:
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

    def close_channel(self, name: str) -> None:
        channel = self._state.channels.pop(name)
        channel.close()   # stops it first, so loops still using it wake up with ChannelStopped
        for worker in self._state.workers.values():
            if worker.alive:
                worker.release_channels([channel.name])

    @property
    def stop_signal(self) -> StopSignal:
        return self._state.stop

    def stop(self, reason: str = "stopped") -> None:
        """Set the stop signal and stop every channel: loops see ctx.stopped, waiters get ChannelStopped."""
        self._state.stop_all(reason)

    def clear_stop(self) -> None:
        """Clear the stop signal before the next request (channels are cleared by their reset())."""
        self._state.stop.clear()

    # -- waiting on several handles ----------------------------------------------------------------------------
    def wait(self, handles: Iterable[Handle], timeout: float | None = None,
             return_when: str = "first") -> tuple[list[Handle], list[Handle]]:
        """Block until one ("first") or every ("all") handle is done; return (done, pending)."""
        if return_when not in ("first", "all"):
            raise ValueError(f"return_when must be 'first' or 'all', not {return_when!r}")
        handles = list(handles)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            done = [h for h in handles if h.done()]
            pending = [h for h in handles if h not in done]
            if (done and return_when == "first") or not pending or _expired(deadline):
                return done, pending
            workers = {h.worker for h in pending}
            watched = {w._wire.sock: w for w in workers} | {w._sentinel: w for w in workers
                                                            if w._sentinel is not None}
            for ready in multiprocessing.connection.wait(list(watched), _remaining(deadline)):
                watched[ready]._pump(0.0)

    def gather(self, *handles: Handle, timeout: float | None = None, grace: float = 5.0) -> list:
        """Results of all handles. On the first failure: stop the runtime (so the other loops end), give
        them `grace` seconds to finish, and raise that failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = list(handles)
        while pending:
            done, pending = self.wait(pending, _remaining(deadline), "first")
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
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _check_open(self) -> None:
        if self.closed:
            raise WorkerClosed("this runtime is closed")

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Runtime {self.backend} workers={list(self._state.workers)} channels={list(self._state.channels)}>"
