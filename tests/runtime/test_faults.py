"""Faults: killed workers, close(), garbage collection, Ctrl-C. Nothing may be left behind."""

import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from paraspec.runtime import ChannelStopped, RemoteError, Runtime, WorkerClosed, WorkerDied
from tests.runtime import loops
from tests.runtime.conftest import process_running, segments_of
from tests.runtime.toy_model import broken_factory, illegal_instruction_factory, make_toy

REPO = Path(__file__).resolve().parents[2]


def assert_nothing_left(pids, segments=()):
    children = {p.pid for p in multiprocessing.active_children()}
    for pid in pids:
        assert pid not in children, f"worker {pid} is still a live child"
        assert not process_running(pid), f"worker {pid} still runs"
    for name in segments:
        assert not os.path.exists(name), f"segment {name} was not unlinked"


def test_sigkill_is_detected_within_2s_and_wakes_everyone():
    baseline = set(segments_of(os.getpid()))  # other runtimes of this test session
    rt = Runtime("process")
    victim = rt.add_worker("victim", "cpu:0", make_toy)
    watcher = rt.add_worker("watcher", "cpu:1", make_toy)
    rt.wait_ready(timeout=60)
    channel = rt.channel("tokens", capacity=16)
    channel.reset([1])
    segments = sorted(set(segments_of(os.getpid())) - baseline)
    assert len(segments) == 2 and segments[0].endswith("_stop") and segments[1].endswith("_tokens")
    watching = watcher.start_loop(loops.wait_until_stopped, channel=channel)
    sleeping = victim.submit("sleep", 60)
    time.sleep(0.3)
    killed = {}

    def kill():
        killed["at"] = time.perf_counter()
        os.kill(victim.pid, signal.SIGKILL)

    threading.Timer(0.2, kill).start()
    # the caller blocked on a channel wakes (the runtime's monitor stops every channel) ...
    with pytest.raises(ChannelStopped, match="victim"):
        channel.wait_for_commit(10**6, timeout=10)
    assert time.perf_counter() - killed["at"] < 2.0
    # ... the caller blocked on the killed worker's request gets WorkerDied ...
    with pytest.raises(WorkerDied) as info:
        sleeping.result(timeout=10)
    assert time.perf_counter() - killed["at"] < 2.0
    assert info.value.exitcode == -signal.SIGKILL and "SIGKILL" in str(info.value)
    # ... and so does a loop in the other worker that was blocked on the channel
    assert watching.result(timeout=5).startswith("stopped: worker 'victim'")
    with pytest.raises(WorkerDied):
        victim.call("length")
    assert watcher.call("length") == 0  # the survivor still serves
    pids = [victim.pid, watcher.pid]
    rt.close()
    assert_nothing_left(pids, segments)
    assert set(segments_of(os.getpid())) == baseline
    with pytest.raises(WorkerClosed):
        watcher.call("length")


def test_blocked_caller_measures_kill_detection():
    """A caller blocked in result() on a worker that is SIGKILLed mid-call hears of it in well under 2 s."""
    with Runtime("process") as rt:
        worker = rt.add_worker("victim", "cpu:1", make_toy)
        worker.wait_ready(timeout=60)
        handle = worker.submit("sleep", 60)
        time.sleep(0.2)
        threading.Timer(0.1, os.kill, args=(worker.pid, signal.SIGKILL)).start()
        start = time.perf_counter()
        with pytest.raises(WorkerDied):
            handle.result()
        elapsed = time.perf_counter() - start
        assert 0.05 < elapsed < 0.1 + 2.0, elapsed
        pid = worker.pid
    assert_nothing_left([pid])


def test_close_stops_busy_workers_and_unlinks():
    baseline = set(segments_of(os.getpid()))
    rt = Runtime("process", close_timeout=10)  # a close that had to terminate someone would take 10 s
    worker = rt.add_worker("busy", "cpu:0", make_toy)
    channel = rt.channel("tokens", capacity=8, vocab_size=16, q_window=2)
    channel.reset([1])
    looping = worker.start_loop(loops.wait_until_stopped, channel=channel)
    worker.submit("sleep", 60)  # queued behind the loop: dropped at shutdown
    worker.wait_ready(timeout=60)
    segments = sorted(set(segments_of(os.getpid())) - baseline)
    assert len(segments) == 2
    pid = worker.pid
    start = time.perf_counter()
    rt.close()
    assert time.perf_counter() - start < 5  # the loop woke up at once; nobody had to be killed
    assert_nothing_left([pid], segments)
    assert rt.closed
    rt.close()  # idempotent
    with pytest.raises(WorkerClosed):
        looping.worker.call("length")


def test_process_factory_failure_and_exit():
    with Runtime("process") as rt:
        worker = rt.add_worker("broken", "cpu:0", broken_factory)
        with pytest.raises(RemoteError, match="factory exploded") as info:
            worker.wait_ready(timeout=60)
        assert "broken_factory" in info.value.remote_traceback
        pid = worker.pid
    assert_nothing_left([pid])


def test_a_worker_killed_by_sigill_is_an_error_that_says_what_and_how_to_rebuild():
    """A native kernel the CPU refuses kills the worker with SIGILL (injected here): the caller gets WorkerDied
    naming the signal, what it means and the command that rebuilds llama.cpp, within seconds, not a bare code."""
    with Runtime("process") as rt:
        worker = rt.add_worker("target", "cpu:0", illegal_instruction_factory)
        start = time.perf_counter()
        with pytest.raises(WorkerDied) as info:
            worker.wait_ready(timeout=60)
        pid = worker.pid
    assert info.value.exitcode == -signal.SIGILL
    message = str(info.value)
    assert "before its model was ready with signal SIGILL" in message
    assert "an instruction this CPU or VM refuses" in message
    assert "scripts/build_llamacpp.py wheel --force" in message and "stderr says why" not in message
    assert time.perf_counter() - start < 60
    assert_nothing_left([pid])


def test_threads_asking_a_dead_workers_exit_status_at_once_all_get_the_signal():
    """The Runtime's monitor and a caller noting a death both poll the process: with the fork server's Popen, the
    one that lost the race once read the status pipe's end and recorded exit code 255 over SIGILL (a CI failure)."""
    with Runtime("process") as rt:
        # it dies once every asker waits on it (else the monitor reads the status before any asker polls)
        worker = rt.add_worker("target", "cpu:0", illegal_instruction_factory, {"delay_s": 1.0})
        barrier = threading.Barrier(4)
        codes = []

        def ask():
            barrier.wait()
            worker._process.join()  # waits inside Popen's poll, where the race is widest
            codes.append(worker.exit_code())

        askers = [threading.Thread(target=ask) for _ in range(4)]
        for asker in askers:
            asker.start()
        for asker in askers:
            asker.join(60)
        pid = worker.pid
    assert codes == [-signal.SIGILL] * 4
    assert_nothing_left([pid])


def test_garbage_collected_runtime_cleans_up():
    baseline = set(segments_of(os.getpid()))
    rt = Runtime("process")
    rt.add_worker("orphan", "cpu:1", make_toy).wait_ready(timeout=60)
    rt.channel("tokens", capacity=8).reset([1])
    pid, segments = rt["orphan"].pid, sorted(set(segments_of(os.getpid())) - baseline)
    assert process_running(pid) and len(segments) == 2
    del rt  # never closed
    gc.collect()
    assert_nothing_left([pid], segments)


@pytest.mark.parametrize("mode", ["with", "atexit", "sigkill"])
def test_ctrl_c_or_kill_of_the_parent_leaves_nothing(mode):
    """Ctrl-C: the parent closes its runtime (with-block, or the atexit finalizer). SIGKILL: nothing runs in
    the parent; its workers notice it is gone and exit, and multiprocessing's resource tracker unlinks the
    segments the parent had registered."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.runtime.sigint_child", mode],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline()
        assert line, child.stderr.read()
        up = json.loads(line)
        assert len(up["segments"]) == 2 and all(process_running(p) for p in up["workers"])
        child.send_signal(signal.SIGKILL if mode == "sigkill" else signal.SIGINT)
        _, stderr = child.communicate(timeout=20)
    finally:
        if child.poll() is None:
            child.kill()
    if mode == "sigkill":
        assert child.returncode == -signal.SIGKILL
    else:
        assert "KeyboardInterrupt" in stderr
        assert "leaked" not in stderr, stderr  # the resource tracker had nothing to clean up for us
    deadline = time.monotonic() + 5  # the workers were the child's: give them a moment
    while time.monotonic() < deadline and (any(process_running(p) for p in up["workers"]) or segments_of(up["pid"])):
        time.sleep(0.05)
    assert_nothing_left(up["workers"], up["segments"])
    assert segments_of(up["pid"]) == []
