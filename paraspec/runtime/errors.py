"""What a worker failure looks like to the caller: one exception hierarchy, and its trip over the wire.

WorkerError     base of every failure that comes from a worker
├── RemoteError the worker raised (its traceback, and the exception itself when it unpickles here)
├── WorkerDied  the worker's process exited while a request was outstanding
│   └── WorkerTimeout  it sent no sign of life for `worker_timeout` seconds (stopped or stuck): killed
└── WorkerClosed the worker (or its runtime) was closed
"""

from __future__ import annotations

import pickle
import traceback


class WorkerError(RuntimeError):
    """Base of every failure that comes from a worker."""

    def __init__(self, message: str, worker: str = ""):
        super().__init__(message)
        self.worker = worker


class RemoteError(WorkerError):
    """The worker raised. `exc_type` is the remote exception's class name, `remote_traceback` its formatted
    traceback, `original` the exception itself when it could be unpickled here (else None)."""

    def __init__(self, worker: str, exc_type: str, message: str, remote_traceback: str, original=None):
        super().__init__(
            f"{exc_type} in worker {worker!r}: {message}\n\n--- traceback in worker {worker!r} ---\n{remote_traceback}",
            worker,
        )
        self.exc_type, self.remote_traceback = exc_type, remote_traceback
        self.original = original


class WorkerDied(WorkerError):
    """The worker's process exited while a request was outstanding (or before it started)."""

    def __init__(self, message: str, worker: str, exitcode: int | None):
        super().__init__(message, worker)
        self.exitcode = exitcode


class WorkerTimeout(WorkerDied):
    """The worker sent no heartbeat for the runtime's `worker_timeout` seconds (stopped, or stuck holding the
    interpreter); it is treated as dead, and its process is killed."""


class WorkerClosed(WorkerError):
    pass


def error_payload(exc: BaseException) -> tuple:
    try:
        pickled = pickle.dumps(exc)
    except Exception:
        pickled = None
    return type(exc).__qualname__, str(exc), traceback.format_exc(), pickled


def remote_error(worker: str, payload: tuple) -> RemoteError:
    exc_type, message, tb, pickled = payload
    original = None
    if pickled is not None:
        try:
            original = pickle.loads(pickled)
        except Exception:
            pass
    return RemoteError(worker, exc_type, message, tb, original)
