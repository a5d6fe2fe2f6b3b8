"""The RequestGate (gate.py), the one place that admits requests: arrival order, a seat each (the free one that stands
first), an exclusive request (restart_workers) first in line, a cancelled waiter out of the line at once, and after a
worker fault the line waiting for the restart rather than meeting the dead workers."""

from __future__ import annotations

import threading
import time

import pytest

from paraspec.errors import EngineBusy
from paraspec.gate import RequestGate
from paraspec.runtime.errors import WorkerDied
from paraspec.streams import Request


def gate(seats=("a", "b"), on_busy="wait", wait_timeout=30.0) -> RequestGate:
    g = RequestGate(on_busy, wait_timeout)
    g.open(list(seats), order=lambda s: {"a": 1, "b": 0, "c": 2}[s])
    return g


def in_thread(g: RequestGate, request: Request, admitted: list) -> threading.Thread:
    def run():
        admitted.append((request.number, g.acquire(request)))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def wait_line(g: RequestGate, n: int) -> None:
    deadline = time.monotonic() + 10
    while g.waiting() != n:
        assert time.monotonic() < deadline, f"{g.waiting()} in line, expected {n}"
        time.sleep(0.005)


def test_requests_get_the_free_seat_that_stands_first_and_wait_in_arrival_order():
    g = gate()
    first, second = g.acquire(Request("generate()")), g.acquire(Request("generate()"))
    assert (first.seat, second.seat) == ("b", "a")  # order(): b before a
    admitted: list = []
    waiting = [Request("generate()") for _ in range(3)]
    threads = []
    for r in waiting:  # one at a time, so that their arrival order is known
        threads.append(in_thread(g, r, admitted))
        wait_line(g, len(threads))
    g.release(first)
    g.release(second)
    deadline = time.monotonic() + 10
    while len(admitted) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert [n for n, _ in admitted] == [waiting[0].number, waiting[1].number]
    assert {r.seat for r in waiting[:2]} == {"a", "b"} and g.waiting() == 1
    g.release(waiting[0])
    threads[2].join(10)
    assert admitted[-1][0] == waiting[2].number and waiting[2].seat == waiting[0].seat


def test_a_cancelled_waiter_leaves_the_line_and_an_exclusive_one_goes_first():
    g = gate(seats=("a",))
    holder = g.acquire(Request("generate()"))
    admitted: list = []
    plain, cancelled = Request("generate()"), Request("stream")
    t1 = in_thread(g, plain, admitted)
    wait_line(g, 1)
    t2 = in_thread(g, cancelled, admitted)
    wait_line(g, 2)
    cancelled.cancelled.set()
    g.notify()
    t2.join(5)
    assert (cancelled.number, None) in admitted and g.waiting() == 1  # out of the line, admitted to nothing
    restart = Request("restart_workers()", exclusive=True)
    t3 = in_thread(g, restart, admitted)
    wait_line(g, 2)
    g.release(holder)
    t3.join(5)
    assert admitted[-1] == (restart.number, restart) and plain not in g.active  # the exclusive one went first
    g.release(restart)
    t1.join(5)
    assert admitted[-1] == (plain.number, plain)


def test_after_a_fault_the_line_waits_for_the_restart_and_raises_without_one():
    g = gate(seats=("a",))
    failing = g.acquire(Request("generate()"))
    admitted: list = []
    waiter = Request("generate()")
    t = in_thread(g, waiter, admitted)
    wait_line(g, 1)
    restarts: list = []

    def restart(reserved):
        request = g.acquire(reserved, failed_ok=True)
        restarts.append(request)
        g.failure = None
        g.release(request)

    g.fail(WorkerDied("worker 'target' died", "target", -9), restart=restart)
    assert "restarting after a fault" in g.health()
    g.release(failing)  # the failed request lets go: the restart runs first, then the waiter, on new workers
    t.join(10)
    assert restarts and admitted == [(waiter.number, waiter)] and g.health() is None
    g.release(waiter)
    # nobody restarts: requests raise the fault, naming the fix
    g.fail(WorkerDied("worker 'target' died", "target", -9))
    with pytest.raises(WorkerDied, match="restart_workers"):
        g.acquire(Request("generate()"))


def test_on_busy_error_and_wait_timeout_name_the_holder():
    g = gate(seats=("a",), on_busy="error")
    g.acquire(Request("generate()"))
    with pytest.raises(EngineBusy, match="generate\\(\\) #.* is running on this Engine"):
        g.acquire(Request("generate()"))
    g = gate(seats=("a",), wait_timeout=0.2)
    g.acquire(Request("generate()"))
    with pytest.raises(EngineBusy, match="waited 0.2 s"):
        g.acquire(Request("generate()"))
    assert g.waiting() == 0  # the refused request left the line
