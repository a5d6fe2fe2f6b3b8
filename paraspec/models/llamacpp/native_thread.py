"""One thread of the process runs every llama.cpp graph computation, whichever thread asks for it.

Why. llama.cpp's CPU backend, built with OpenMP (llama-cpp-python's default and paraspec's build), runs each
forward as one OpenMP parallel region, and libgomp keeps a pool of worker threads for every thread that has
started one. Once the pools of a process hold more threads than it has cores, libgomp throttles them: each of
the hundreds of barriers inside a forward then sleeps on a futex instead of spinning, and a forward costs ~20-30%
more (benchmarks/openmp_pools.py measures it). Two threads that have both called llama_decode are enough: an
Engine's set-up thread (which times the drafts' costs) and its Scheduler, or a server's request threads. With every
call made from this one thread there is one pool, as in llama-server.

The thread is started by the first call and inherits that caller's core affinity (as the OpenMP workers it starts
inherit its own): a worker process pins itself before it loads a model. A call waits for its result; an interrupt
(Ctrl-C) in the waiting caller is raised once the call has returned, so no llama.cpp context is used by two threads
at once and none is freed during a forward. `PARASPEC_LLAMACPP_ONE_THREAD=0` makes every caller run its own calls
(for measuring the difference).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_thread: threading.Thread | None = None
_calls: queue.SimpleQueue = queue.SimpleQueue()
ENABLED = os.environ.get("PARASPEC_LLAMACPP_ONE_THREAD", "1") != "0"


class _Call:
    __slots__ = ("fn", "args", "done", "result", "error")

    def __init__(self, fn: Callable[..., Any], args: tuple):
        self.fn, self.args, self.done = fn, args, threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


def _serve() -> None:
    while True:
        call = _calls.get()
        try:
            call.result = call.fn(*call.args)
        except BaseException as e:  # noqa: BLE001 -- raised in the caller
            call.error = e
        finally:
            call.done.set()


def native_thread() -> threading.Thread:
    """The thread that runs llama.cpp's computations (started on first use, a daemon: it holds no state)."""
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_serve, daemon=True, name="paraspec-llamacpp")
            _thread.start()
        return _thread


def on_native_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) run on the native thread (directly when already there); its exception is raised here."""
    if not ENABLED or threading.current_thread() is _thread:
        return fn(*args)
    native_thread()
    call = _Call(fn, args)
    _calls.put(call)
    try:
        call.done.wait()
    except BaseException:
        call.done.wait()  # the native call cannot be stopped: let it finish before the caller goes on
        raise
    if call.error is not None:
        raise call.error
    return call.result
