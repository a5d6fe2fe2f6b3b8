"""A loan of cores: a thread that runs a prompt on more cores than its own (runtime/devices.py `lend_cores`) says
so here, and the models read it: a llama.cpp model runs that prompt's forwards on the lent threads and keeps its own
thread count for everything else (its other forwards, the exactness probe measured at that count)."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

_LOAN = threading.local()  # .own: this thread's own torch thread count while it runs on lent cores


@contextmanager
def on_loan(own: int):
    """Within the block this thread runs on lent cores (torch's thread count already set to them); `own`: its
    thread count outside the loan."""
    _LOAN.own = own
    try:
        yield
    finally:
        _LOAN.own = None


def lent_threads() -> int | None:
    """The thread count of the cores lent to this thread, or None outside a loan."""
    return torch.get_num_threads() if getattr(_LOAN, "own", None) is not None else None


def own_threads() -> int:
    """This thread's own torch thread count: the one it had before a loan of cores, else the current one."""
    own = getattr(_LOAN, "own", None)
    return torch.get_num_threads() if own is None else own
