"""One thread runs every llama.cpp computation of the process (models/llamacpp/native_thread.py): libgomp throttles
its pools once several threads have started OpenMP work, and a forward then costs ~20-30% more
(benchmarks/openmp_pools.py). The timing is the benchmark's; these tests check the mechanism."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from paraspec.models.llamacpp import model as llamacpp
from paraspec.models.llamacpp import native_thread
from paraspec.models.llamacpp.native_thread import on_native_thread

pytest.importorskip("llama_cpp")


def test_every_llama_decode_runs_on_the_one_thread_whoever_calls(gguf_pair, monkeypatch):
    model = llamacpp.LlamaCppModel(gguf_pair["target"], 256, (), n_threads=2, probe=False, n_seqs=2)
    seen = []
    real = llamacpp._lib.llama_decode

    def spy(ctx, batch):
        seen.append(threading.current_thread().name)
        return real(ctx, batch)

    monkeypatch.setattr(llamacpp._lib, "llama_decode", spy)
    try:
        model.sequence(0).prefill([5, 6, 7])
        other = threading.Thread(target=lambda: model.sequence(1).prefill([8, 9]))
        other.start()
        other.join()
        model.forward_batch([(0, [3], 1), (1, [4], 1)])
    finally:
        model.close()
    assert len(seen) >= 3 and set(seen) == {"paraspec-llamacpp"}, seen  # two prefills (each 1+ forwards), one step


def test_errors_are_raised_in_the_caller_and_nested_calls_run_in_place():
    def fails():
        raise ValueError("from the native thread")

    with pytest.raises(ValueError, match="from the native thread"):
        on_native_thread(fails)
    # a call made from the native thread itself runs there at once (no deadlock waiting on its own queue)
    assert on_native_thread(lambda: on_native_thread(threading.current_thread)).name == "paraspec-llamacpp"
    assert on_native_thread(lambda a, b: a + b, 2, 3) == 5


def test_an_interrupt_in_the_caller_waits_for_the_running_call(monkeypatch):
    finished = []

    def slow():
        time.sleep(0.4)
        finished.append(time.perf_counter())

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(KeyboardInterrupt):
            on_native_thread(slow)
        raised = time.perf_counter()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert finished and finished[0] <= raised  # the context was not left in use behind the caller's back


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(native_thread, "ENABLED", False)
    assert on_native_thread(threading.current_thread) is threading.current_thread()
