"""The worker side: what runs inside a worker process (or thread, or Ray actor) -- build the model once, then
answer requests until shutdown or until the caller goes away.

`serve(sock, name, device, spec, in_process)` is the public entry point every backend runs: the process backend
from `process_main` in a spawned child, the in-process backend on a thread, the Ray backend inside an actor.
A request is a model call, a loop (`fn(model, ctx, **kwargs)` with a `LoopContext`), or a channel release.
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

from paraspec.runtime.channels import StopSignal, TokenChannel, release_attached
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
    cores: tuple[int, ...]          # the CPU affinity the worker runs with
    num_threads: int                # torch.get_num_threads() inside the worker
    model_type: str
    vocab_size: int | None
    eos_token_ids: tuple[int, ...] | None
    max_context: int | None
    build_s: float                  # pinning + model factory, measured inside the worker
    startup_s: float = 0.0          # from start to ready, measured by the caller (includes spawn + imports)


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

def serve(sock: socket.socket, name: str, device: Device, spec: bytes, in_process: bool,
          heartbeat_s: float | None = None) -> None:
    """A worker's life: build the model, then answer requests until shutdown or the caller goes away.
    With heartbeat_s, a thread sends a heartbeat that often from the start (model loading included): the
    caller's watchdog tells a slow worker from a stopped or stuck one."""
    wire = Wire(sock)
    requests: queue.SimpleQueue = queue.SimpleQueue()
    shutting_down = threading.Event()
    if heartbeat_s is not None:
        threading.Thread(target=_beat, args=(wire, heartbeat_s, shutting_down), name=f"paraspec-{name}-heartbeat",
                         daemon=True).start()

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
        if device.node:           # a device on a named node: its cores and GPUs are checked here, on it
            check_available(device, f"node {device.node!r}")
        if not in_process or device.kind == "cuda":
            apply_device(device)   # CPU pinning is per process: the in-process backend leaves it alone
        factory, factory_args = pickle.loads(spec)
        try:
            model = factory(**factory_args)
        except (OSError, ValueError) as exc:
            if device.node:       # a checkpoint missing on that node, say: name the node and the fix
                exc.args = (f"on node {device.node!r}: {exc} (a node loads the checkpoint from the path the caller "
                            f"resolved: put it at the same path there, e.g. `make models` on that node, or use a "
                            f"shared filesystem)",)
            raise
        sync(device)               # build_s includes the weights' copies to a GPU, not only their launch
        import torch
        info = WorkerInfo(
            name=name, device=str(device), pid=os.getpid(),
            cores=tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else (),
            num_threads=torch.get_num_threads(), model_type=type(model).__qualname__,
            vocab_size=getattr(model, "vocab_size", None),
            eos_token_ids=(tuple(model.eos_token_ids) if hasattr(model, "eos_token_ids") else None),
            max_context=getattr(model, "max_context", None), build_s=time.perf_counter() - t_build)
    except BaseException as exc:
        wire.send(("ready_error",), error_payload(exc))
        wire.close()
        return
    wire.send(("ready",), info)

    link_latency_s = 0.0      # a simulated link (tests, benchmarks): each request arrives, and each reply leaves,
                              # this much later; the caller is not held up meanwhile, as on a real link
    try:
        while True:
            envelope, load_body = requests.get()
            kind = envelope[0]
            if kind in ("shutdown", "eof") or shutting_down.is_set():
                break
            _, request_id, t0 = envelope
            if link_latency_s > 0 and kind != "link":
                time.sleep(link_latency_s)
            recorder = Trace(t0=t0, device=label)
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
                elif kind == "link":
                    link_latency_s = float(body[0])
                    result = None
                else:
                    raise ValueError(f"unknown request {kind!r}")
                status = "ok"
            except BaseException as exc:
                status, result = "error", error_payload(exc)
            if link_latency_s > 0:
                time.sleep(link_latency_s)
            try:
                wire.send((status, request_id, recorder.event_tuples(), recorder.progress), result)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:   # an unpicklable result
                wire.send(("error", request_id, recorder.event_tuples(), recorder.progress), error_payload(exc))
    except (BrokenPipeError, ConnectionResetError):
        pass   # the caller is gone
    finally:
        wire.close()


def _beat(wire: Wire, interval: float, shutting_down: threading.Event) -> None:
    while not shutting_down.wait(interval):
        try:
            wire.send(("heartbeat",))
        except OSError:
            return


def process_main(sock: socket.socket, name: str, device: str, spec: bytes, heartbeat_s: float | None = None) -> None:
    # Ctrl-C reaches the whole process group; the caller decides what happens to its workers. The caller held
    # SIGINT and SIGTERM while it started us (workers.sigint_ignored_by_children): take SIGTERM again.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    parent = multiprocessing.parent_process()
    if parent is not None:
        def exit_with_parent():
            multiprocessing.connection.wait([parent.sentinel])
            os._exit(1)   # the parent died without closing us (e.g. SIGKILL): nobody will read our results
        threading.Thread(target=exit_with_parent, name="paraspec-parent-watch", daemon=True).start()
    serve(sock, name, parse_device(device), spec, in_process=False, heartbeat_s=heartbeat_s)
    # Everything this process shared is released by now; skip the interpreter's teardown (with torch loaded
    # it takes ~0.5 s), which is most of a close().
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass
    os._exit(0)
