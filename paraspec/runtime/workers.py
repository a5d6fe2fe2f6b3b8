"""The caller's end of a worker: `Worker` (one per device group) and `Handle` (one outstanding request), and the
kinds of runtime by name (where workers run).

    Worker.call / submit(method, *args)   the model's methods in the worker, synchronously or as a Handle
    Worker.start_loop(fn, **kwargs)       fn(model, ctx, **kwargs) runs inside the worker until it returns

Each kind of runtime subclasses Worker and only changes where `worker_main.serve` runs: "process" (default; spawn,
one process per device group, pinned), "inprocess" (a thread of the caller's process, no pinning: tests and
single-device runs), "ray" (a Ray actor; ray_backend.py, an optional extra). Register another in `RUNTIME_KINDS`.

Requests to one worker run one at a time, in submission order (a call submitted while a loop runs waits for
the loop). Control messages and results travel over a socket pair (wire.py); logits come back as arrays
through that socket. Faults: an exception in the worker raises RemoteError (with the worker's traceback)
in whoever waits for that request; a dead worker raises WorkerDied in every waiter within milliseconds
(the wait includes the process sentinel).
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from paraspec.models.llamacpp.child import describe_death, signal_name
from paraspec.runtime.channels import StopSignal, TokenChannel
from paraspec.runtime.devices import Device, DeviceError, parse_device
from paraspec.runtime.errors import WorkerClosed, WorkerDied, WorkerError, WorkerTimeout, remote_error
from paraspec.runtime.wire import wire_pair
from paraspec.runtime.worker_main import CallerState, WorkerInfo, process_main, serve
from paraspec.trace import Trace, TraceEvent


class Handle:
    """One outstanding request. result() blocks (or raises RemoteError / WorkerDied / TimeoutError);
    once its reply is in, `events` holds the worker's TraceEvents (also merged into the trace given at submit)."""

    def __init__(self, worker: Worker, request_id: int, trace: Trace | None):
        self.worker, self.request_id, self.trace = worker, request_id, trace
        self.events: list[TraceEvent] = []
        self._replied = False
        self._value = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once result() would not block."""
        return self._replied or self.worker.reply_ready(self.request_id)

    def result(self, timeout: float | None = None):
        if not self._replied:
            self._take_reply(self.worker.reply_for(self.request_id, timeout))
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error result() would raise (None on success); TimeoutError still propagates."""
        if not self._replied:
            self._take_reply(self.worker.reply_for(self.request_id, timeout))
        return self._error

    def _take_reply(self, reply: tuple | WorkerDied) -> None:
        self._replied = True
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
            self._error = WorkerError(
                f"the reply of worker {self.worker.name!r} cannot be unpickled here: {type(exc).__name__}: {exc}",
                self.worker.name,
            )
            return
        if status == "ok":
            self._value = body
        else:
            self._error = remote_error(self.worker.name, body)

    def __repr__(self) -> str:
        return f"<Handle {self.worker.name}#{self.request_id} {'replied' if self._replied else 'pending'}>"


class Worker(abc.ABC):
    """The caller's end of one worker. Each kind of runtime subclasses it and provides _start(), _sentinel,
    _is_alive(), exit_code() and _stop_worker()."""

    kind = ""  # the kind of runtime it belongs to: a key of RUNTIME_KINDS
    options_taken: tuple[str, ...] = ()
    places_on_nodes = False  # it can run a worker on the node a device names (NODE/cpu:0)

    def __init__(
        self,
        name: str,
        device: Device | str,
        factory: Callable[..., Any],
        factory_args: dict | None,
        stop: StopSignal,
        channels: dict[str, TokenChannel],
        heartbeat_s: float | None = None,
        **options,
    ):
        """heartbeat_s: the worker sends a heartbeat this often (None: never), for the Runtime's watchdog.
        options: its kind's own (Ray: `address`); a kind that takes none refuses them."""
        unknown = set(options) - set(self.options_taken)
        if unknown:
            raise TypeError(
                f"the {self.kind} runtime takes no option(s) {sorted(unknown)}"
                f"{' (it takes ' + ', '.join(self.options_taken) + ')' if self.options_taken else ''}"
            )
        self.options = options
        self.name = name
        self.heartbeat_s = heartbeat_s
        self.device = parse_device(device)
        if self.device.node and not self.places_on_nodes:
            raise DeviceError(
                f"device {self.device} names a node: only runtime_kind='ray' places workers on nodes "
                f"(--runtime-kind ray), the {self.kind} runtime runs them on this host"
            )
        try:
            self._spec = pickle.dumps((factory, dict(factory_args or {})))
        except Exception as exc:
            raise TypeError(
                f"worker {name!r}: the model factory and its arguments must be picklable (a "
                f"module-level function or class, plain arguments): {exc}"
            ) from exc
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
        self._last_heard = time.monotonic()  # the last message from the worker (heartbeats included)
        self._heard = False  # any message yet: before it, the process is starting up
        self._start()

    # -- hooks of each kind --------------------------------------------------------------------------------
    _sentinel: int | None = None  # a process handle that becomes readable when the worker dies, if any

    @abc.abstractmethod
    def _start(self) -> None:
        """Start serving `_their_sock` (the other end of `_wire`) with worker_main.serve()."""

    @abc.abstractmethod
    def _is_alive(self) -> bool: ...

    @abc.abstractmethod
    def exit_code(self) -> int | None:
        """The worker process's exit status once it has exited (None: unknown, or not our child)."""

    @abc.abstractmethod
    def _stop_worker(self, deadline: float) -> None:
        """Wait for the worker to exit until `deadline` (monotonic), then force it if its kind can."""

    # -- public ---------------------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return None

    @property
    def alive(self) -> bool:
        return self._death is None and not self._closed and self._is_alive()

    @property
    def closed(self) -> bool:
        """close() (or the Runtime's) has begun: it takes no further request."""
        return self._closed

    @property
    def failure(self) -> WorkerDied | None:
        """Why it stopped answering (WorkerDied, or WorkerTimeout from the watchdog), or None."""
        return self._death

    @property
    def sentinel(self) -> int | None:
        """A handle that becomes readable when the worker dies, if its kind has one (the Runtime's monitor)."""
        return self._sentinel

    @property
    def waitables(self) -> list:
        """What becomes ready when the worker sends something or dies (for multiprocessing.connection.wait)."""
        return [self._wire.sock] + ([self._sentinel] if self._sentinel is not None else [])

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
            if not self._pump(remaining(deadline)) and expired(deadline):
                raise TimeoutError(f"worker {self.name!r} not ready after {timeout} s")
        if self._ready_error is not None:
            raise self._ready_error
        assert self._info is not None  # ready: its info arrived
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
            self._replies.pop(handle.request_id, None)  # in case it arrived in between
            raise

    def start_loop(self, loop_fn: Callable[..., Any], *, trace: Trace | None = None, **kwargs) -> Handle:
        """Run loop_fn(model, ctx, **kwargs) inside the worker; the handle yields its return value.
        loop_fn must be picklable (module level); kwargs may hold arrays. The loop reaches the Runtime's
        channels as ctx.channels[name]: shared memory, or over TCP for a worker linked by use_network()."""
        if self._link is None:
            return self._request("loop", trace, loop_fn, kwargs, dict(self._channels), self._stop_signal)
        from paraspec.runtime.net_channel import RemoteChannel, RemoteStopSignal

        address, latency_s = self._link
        channels = {name: RemoteChannel(address, name, latency_s) for name in self._channels}
        by_identity = {id(channel): channels[name] for name, channel in self._channels.items()}
        kwargs = {
            key: by_identity.get(id(value), value) if isinstance(value, TokenChannel) else value
            for key, value in kwargs.items()
        }  # a channel passed as an argument travels as a proxy too
        return self._request("loop", trace, loop_fn, kwargs, channels, RemoteStopSignal(address, latency_s=latency_s))

    # -- how its loops reach the channels ----------------------------------------------------------------------
    _link: tuple[tuple[str, int], float] | None = None  # (channel server address, link latency in s)

    def use_network(self, address: tuple[str, int], latency_s: float = 0.0) -> None:
        """Its loops reach the channels through the Runtime's ChannelServer at `address` (a worker on another
        host, or the network transport forced), each message delayed by `latency_s` (tests, benchmarks)."""
        self._link = ((address[0], address[1]), float(latency_s))
        if latency_s > 0:  # requests and their replies cross the same link
            self._request("link", None, float(latency_s), abandon=True)

    @property
    def transport(self) -> str:
        return "shm" if self._link is None else "tcp"

    @property
    def same_host(self) -> bool:
        """Whether the worker runs on the caller's host (its loops can map shared memory)."""
        return True

    def caller_address(self) -> str:
        """An address of the caller that this worker's host can reach (where the channel server listens)."""
        return "127.0.0.1"

    def close(self, timeout: float = 3.0) -> None:
        """Ask the worker to exit; terminate (then kill) it if it has not after `timeout` seconds."""
        if self._closed:
            return
        deadline = time.monotonic() + timeout
        self.request_exit(deadline)
        self.wait_exit(deadline)

    def request_exit(self, deadline: float) -> None:
        """close()'s first half: mark it closed and ask it to exit once its current request ends (it confirms
        it will take no further one). The Runtime asks all its workers first, so they exit in parallel."""
        if self._closed:
            return
        self._closed = True
        self._request_shutdown(deadline)

    def wait_exit(self, deadline: float) -> None:
        """close()'s second half: wait for it to exit until `deadline` (monotonic), then force it if its kind
        can; drop the connection. Repeatable."""
        try:
            self._stop_worker(deadline)
        finally:
            self._wire.close()

    # -- reading what it sent (Handle, the Runtime's wait and watchdog) ------------------------------------------
    def poll(self) -> bool:
        """Read what the worker has sent, without waiting; True if anything happened."""
        return self._pump(0.0)

    def reply_ready(self, request_id: int) -> bool:
        """True once reply_for(request_id) would not block."""
        self._pump(0.0)
        return request_id in self._replies or self._death is not None

    def reply_for(self, request_id: int, timeout: float | None) -> tuple | WorkerDied:
        """The reply to a request (envelope, body loader), or the worker's death; it is taken: ask once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while request_id not in self._replies:
            if self._death is not None:
                return self._death
            if not self._pump(remaining(deadline)) and expired(deadline):
                raise TimeoutError(f"worker {self.name!r}: no reply to request {request_id} after {timeout} s")
        return self._replies.pop(request_id)

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
        while not self._closing_acked and self._death is None and not expired(ack_deadline):
            self._pump(remaining(ack_deadline))

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
        except (BrokenPipeError, ConnectionResetError) as err:
            self._pump(1.0)
            raise self._death or WorkerDied(f"worker {self.name!r} is gone", self.name, self.exit_code()) from err
        return Handle(self, request_id, trace)

    def _pump(self, timeout: float | None) -> bool:
        """Read what the worker sent, waiting up to `timeout` s for something; True if anything happened.
        Waits on the socket and the process sentinel together, so a death is noticed at once."""
        if not self._recv_lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            return False
        try:
            if self._death is not None:
                return False
            ready = multiprocessing.connection.wait(self.waitables, timeout)
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
        self._last_heard, self._heard = time.monotonic(), True
        if kind == "heartbeat":
            return
        if kind == "ready":
            self._info = dataclasses.replace(load_body(), startup_s=time.perf_counter() - self._t_start)
        elif kind == "ready_error":
            self._ready_error = remote_error(self.name, load_body())
        elif kind == "closing":
            self._closing_acked = True
        elif envelope[1] in self._abandoned:
            self._abandoned.discard(envelope[1])
        else:
            self._replies[envelope[1]] = (envelope, load_body)

    def check_heartbeat(self, timeout: float) -> bool:
        """The watchdog (the Runtime's monitor thread): read what the worker sent if nobody else is reading; if
        it has been silent for `timeout` s, fail every request to it with WorkerTimeout and kill it. True then."""
        if self._closed or self._death is not None or self.heartbeat_s is None:
            return False
        self._pump(0.0)
        silent = time.monotonic() - self._last_heard
        if not self._heard:  # spawning and importing (torch) come before the first heartbeat
            timeout = max(timeout, STARTUP_TIMEOUT_S)
        if silent < timeout or self._closed or self._death is not None:
            return False
        self._death = WorkerTimeout(
            f"worker {self.name!r} ({self.device}, pid {self.pid}) sent no sign of life for "
            f"{silent:.1f} s (worker_timeout={timeout:g}): stopped or stuck; it was killed",
            self.name,
            None,
        )
        self._kill()
        return True

    def _kill(self) -> None:  # noqa: B027  (optional hook: a kind that cannot force a stop keeps this no-op)
        """Force the worker to stop now, if its kind can (the watchdog)."""

    def _note_death(self) -> None:
        if self._death is not None:
            return
        code = self.exit_code()
        how = "closed" if self._closed else "died"
        early = self._info is None and self._ready_error is None
        if early:
            how += " before its model was ready"
        how += describe_death(code)
        if early and signal_name(code) is None:
            how += (
                "; its stderr says why (a script that starts workers needs `if __name__ == '__main__':`, and "
                "the model factory must be importable by module name)"
            )
        self._death = WorkerDied(f"worker {self.name!r} ({self.device}, pid {self.pid}) {how}", self.name, code)


# The watchdog's limit before a worker's first heartbeat: a fresh interpreter importing torch on a busy machine.
STARTUP_TIMEOUT_S = 120.0
# How long a dead worker's exit status is waited for beyond the first 5 s (exit_code)
EXIT_STATUS_WAIT_S = 25.0


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


# How worker processes start (PARASPEC_WORKER_START): "forkserver" (default where the platform has it) forks each
# worker from one server process per caller that has imported torch and the worker's modules once, so a worker
# starts in a fraction of the seconds a fresh interpreter takes to import torch; "spawn" starts each from a fresh
# interpreter. Either way a worker gets the caller's environment, cores, working directory, sys.path and stdio as
# they are when it starts (the server's own are those of its first start).
WORKER_STARTS = ("forkserver", "spawn")
WORKER_PRELOAD = ["torch", "paraspec.runtime.worker_main", "paraspec.models.loader"]


def worker_start_method() -> str:
    method = os.environ.get("PARASPEC_WORKER_START", "forkserver")
    if method not in WORKER_STARTS:
        raise ValueError(f"PARASPEC_WORKER_START={method!r}: use one of {', '.join(WORKER_STARTS)}")
    if method == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    return method


def worker_context(method: str):
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(WORKER_PRELOAD)  # read when the server starts (the first worker's start)
    return context


class ProcessWorker(Worker):
    """A worker in its own process (forked from the fork server or spawned: worker_start_method), pinned to its
    device."""

    kind = "process"

    def _start(self) -> None:
        method = worker_start_method()
        context = worker_context(method)
        caller = CallerState.now() if method == "forkserver" else None
        self._process = context.Process(
            target=process_main,
            name=f"paraspec-{self.name}",
            daemon=True,
            args=(self._their_sock, self.name, str(self.device), self._spec, self.heartbeat_s, caller),
        )
        try:
            with signals_held_while_starting():
                self._process.start()
        except BaseException:  # e.g. SIGTERM, raised once the child is fully briefed: no orphan
            if self._process.pid is not None:
                self._process.kill()
                self._process.join(1.0)
            raise
        serialise_polls(self._process)
        self._their_sock.close()
        self._sentinel = self._process.sentinel

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _is_alive(self) -> bool:
        return self._process.is_alive()

    def exit_code(self) -> int | None:
        # its pipe closed or its sentinel fired: the exit status is a waitpid away, unless the kernel is still
        # writing a core dump (SIGILL, SIGSEGV: seconds for a process holding a model) or a process it started
        # holds its sentinel open (join then waits for that one): is_alive() reaps the worker itself, so poll it
        # a while longer (a full CI run once saw the 5 s join end with no exit status)
        self._process.join(5.0)
        deadline = time.monotonic() + EXIT_STATUS_WAIT_S
        while self._process.exitcode is None and self._process.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._process.exitcode

    def _kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()

    def _stop_worker(self, deadline: float) -> None:
        process = self._process
        if self._info is None and process.is_alive():
            # still starting (Python's spawn bootstrap, imports, loading): it cannot read the shutdown request,
            # SIGTERM is blocked in it until serve() runs, and it holds nothing to clean up: kill it now
            process.kill()
        process.join(remaining(deadline))
        if process.is_alive():
            process.terminate()
            process.join(1.0)
        if process.is_alive():
            process.kill()
            process.join(1.0)


def serialise_polls(process: Any) -> None:
    """Make a started process's exit-status polls take turns. The fork server's Popen reads a dead child's status
    from a pipe: two threads polling at once (the Runtime's monitor, and a caller noting the death) both find the
    pipe readable, one reads the status and the other the pipe's end, which Popen takes for a dead fork server and
    records as 255 over the real status (a SIGILL reported as "exit code 255"). A blocking poll waits for the
    sentinel outside the lock, so no poll holds the others up while the process lives."""
    popen = process._popen
    unlocked = popen.poll
    lock = threading.Lock()

    def poll(flag: int = os.WNOHANG) -> int | None:
        if flag != os.WNOHANG:
            multiprocessing.connection.wait([popen.sentinel])
        with lock:
            return unlocked(flag)

    popen.poll = poll


@contextmanager
def signals_held_while_starting():
    """Start processes with SIGINT and SIGTERM blocked from their first instruction (a blocked signal stays
    blocked across fork and exec; the worker ignores SIGINT and unblocks both once its handlers are set), so
    Ctrl-C while a worker imports or loads prints no traceback from it (the caller stops its workers). Meanwhile
    this thread holds both, and one that another thread of this process takes is only recorded (Python would
    otherwise run its handler here, mid-start) and raised again right after: an exception raised halfway through
    start() would leave the child half-briefed (it dies reading its bootstrap data, with a traceback). Neither is
    ever ignored here: the disposition is the whole process's, and a Ctrl-C that another thread took while the
    first start waited seconds for the fork server to import torch would be lost (the run went on to its end)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may change handlers; Python delivers signals there anyway
        return
    held = (signal.SIGINT, signal.SIGTERM)
    caught: list[int] = []
    signal.pthread_sigmask(signal.SIG_BLOCK, set(held))
    previous = {sig: signal.getsignal(sig) for sig in held}
    for sig in held:
        if previous[sig] is not signal.SIG_IGN:
            signal.signal(sig, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for sig in held:
            if previous[sig] is not signal.SIG_IGN:
                signal.signal(sig, previous[sig] if previous[sig] is not None else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(held))
        for sig in dict.fromkeys(caught):  # each once: the caller's handler decides what it means
            signal.raise_signal(sig)


class ThreadWorker(Worker):
    """The in-process runtime: the same protocol, served by a thread of the caller's process. No CPU pinning
    (affinity and torch's thread count are per process); requests still run one at a time, concurrently with
    the caller and with other workers' loops."""

    kind = "inprocess"

    def _start(self) -> None:
        self._thread = threading.Thread(
            target=serve,
            name=f"paraspec-{self.name}",
            daemon=True,
            args=(self._their_sock, self.name, self.device, self._spec, True, self.heartbeat_s),
        )
        self._thread.start()

    @property
    def pid(self) -> int | None:
        return os.getpid()

    def _is_alive(self) -> bool:
        return self._thread.is_alive()

    def exit_code(self) -> int | None:
        return None

    def _stop_worker(self, deadline: float) -> None:
        self._thread.join(remaining(deadline))  # a thread cannot be killed; a stuck one stays (daemon)


# The kinds of runtime (where workers run) by name: `Runtime(kind)`, the Engine's `runtime_kind=`. A kind whose module
# needs an optional package is named as "module:Class" and imported on first use (Ray is an optional extra), so
# importing the runtime never imports it.
RUNTIME_KINDS: dict[str, type[Worker] | str] = {
    "process": ProcessWorker,
    "inprocess": ThreadWorker,
    "ray": "paraspec.runtime.ray_backend:RayWorker",
}


def worker_class(kind: str) -> type[Worker]:
    """The Worker subclass of a kind of runtime; ValueError names the choices."""
    try:
        entry = RUNTIME_KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown runtime kind {kind!r}; choose one of {', '.join(RUNTIME_KINDS)}") from None
    if isinstance(entry, str):
        import importlib

        module, _, name = entry.partition(":")
        entry = getattr(importlib.import_module(module), name)
    return entry
