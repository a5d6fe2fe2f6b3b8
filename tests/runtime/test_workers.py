"""The worker protocol: commands, async submits, loops, pinning, remote exceptions, traces, RemoteModel."""

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from paraspec.models.base import Model
from paraspec.runtime import RemoteError, Runtime, TokenChannel, WorkerError
from paraspec.runtime.remote import RemoteModel
from paraspec.runtime.workers import WORKER_STARTS
from paraspec.trace import Trace
from tests.runtime import loops
from tests.runtime.toy_model import ToyModel, broken_factory, make_toy


@pytest.fixture(scope="module")
def inproc():
    rt = Runtime("inprocess")
    rt.add_worker("t0", "cpu", make_toy, {"vocab_size": 64})
    rt.wait_ready(timeout=30)
    yield rt
    rt.close()


@pytest.fixture(params=["process", "inprocess"])
def worker(request, pair, inproc):
    return pair["w0"] if request.param == "process" else inproc["t0"]


def test_command_round_trips(worker):
    local = ToyModel(vocab_size=64)
    logits = worker.call("prefill", [3, 4, 5])
    assert torch.equal(logits, local.prefill([3, 4, 5]))
    assert worker.call("length") == 3
    out = worker.call("forward", [6, 7], [3, 4], None)
    assert out.shape == (2, 64) and torch.equal(out, local.forward([6, 7], [3, 4]))
    mask = torch.tensor([[True, False], [True, True]])
    out = worker.call("forward", [8, 9], tree_mask=mask)
    assert torch.equal(out, local.forward([8, 9], tree_mask=mask))
    worker.call("rollback", 4)
    assert worker.call("length") == 4
    assert worker.call("echo", 1, "a", key=[1, 2]) == ((1, "a"), {"key": [1, 2]})
    assert worker.call("vocab_size") == 64


def test_many_requests_in_order(worker):
    worker.call("prefill", [0])
    handles = [worker.submit("forward", [i % 60]) for i in range(300)]
    assert [h.result(timeout=30).shape[0] for h in handles] == [1] * 300
    assert worker.call("length") == 301


def test_pipelined_large_requests_and_replies_do_not_deadlock(worker):
    """20 x 2 MB arguments sent before any 2 MB reply is read: the worker keeps reading while it writes."""
    payload = torch.ones(512, 1024)
    handles = [worker.submit("echo", payload * i) for i in range(20)]
    for i, handle in enumerate(handles):
        (echoed,), _ = handle.result(timeout=30)
        assert torch.equal(echoed, payload * i)


def test_exception_carries_remote_traceback_and_worker_survives(worker):
    with pytest.raises(RemoteError) as info:
        worker.call("fail", "bad tokens 1234")
    err = info.value
    assert isinstance(err, WorkerError) and err.exc_type == "ValueError"
    assert isinstance(err.original, ValueError) and str(err.original) == "bad tokens 1234"
    assert "toy_model.py" in err.remote_traceback and "in fail" in err.remote_traceback
    assert "bad tokens 1234" in str(err) and worker.name in str(err)
    with pytest.raises(RemoteError, match="AttributeError"):
        worker.call("no_such_method")
    assert worker.call("echo", 5) == ((5,), {})


def test_bad_request_or_reply_fails_only_that_request(worker):
    gone = TokenChannel(4, tag="gone")
    gone.close()  # unlinked: the worker cannot attach it any more
    with pytest.raises(RemoteError, match="FileNotFoundError"):
        worker.call("echo", gone)
    with pytest.raises(RemoteError, match="pickle"):
        worker.call("unpicklable")
    assert worker.call("echo", 6) == ((6,), {})


def test_exception_in_loop(worker):
    with pytest.raises(RemoteError, match="KeyError") as info:
        worker.start_loop(loops.raise_in_loop, message="loop broke").result(timeout=10)
    assert "raise_in_loop" in info.value.remote_traceback


def test_workers_are_pinned(pair):
    for name, core in (("w0", 0), ("w1", 1)):
        cores, threads, pid, device, ctx_name = pair[name].start_loop(loops.report_pinning).result(timeout=10)
        assert cores == [core] and threads == 1
        assert pid == pair[name].pid != os.getpid()
        assert device == f"cpu:{core}" and ctx_name == name
        assert pair[name].info.cores == (core,) and pair[name].info.num_threads == 1


def test_submit_overlaps_two_workers(pair):
    # each sleeps 1 s in its own process: together they take ~1 s, not 2 s (0.8 s of slack for a loaded machine)
    start = time.perf_counter()
    a, b = pair["w0"].submit("sleep", 1.0), pair["w1"].submit("sleep", 1.0)
    assert not a.done()
    assert pair.gather(a, b, timeout=10) == [1.0, 1.0]
    assert time.perf_counter() - start < 1.8


def test_wait_first_completed(pair):
    slow, fast = pair["w0"].submit("sleep", 0.5), pair["w1"].submit("sleep", 0.05)
    done, pending = pair.wait([slow, fast], timeout=10)
    assert done == [fast] and pending == [slow]
    assert slow.result(timeout=10) == 0.5


def test_result_timeout(pair):
    handle = pair["w1"].submit("sleep", 0.3)
    with pytest.raises(TimeoutError):
        handle.result(timeout=0.05)
    assert handle.result(timeout=10) == 0.3


def test_loop_trace_uses_the_callers_clock(pair):
    trace = Trace()
    before = trace.now()
    handle = pair["w1"].start_loop(loops.traced_work, trace=trace, steps=3, seconds=0.05)
    assert handle.result(timeout=10) == 3
    after = trace.now()
    assert [(e.device, e.kind, e.tokens) for e in trace.events] == [("w1:cpu:1", "draft", i) for i in (1, 2, 3)]
    for e in trace.events:
        assert before <= e.start_s < e.end_s <= after and e.duration_s >= 0.045
    assert [tokens for _, tokens in trace.progress] == [1, 2, 3]
    assert handle.events == trace.events


def test_channel_passed_to_loop_and_by_name(pair):
    channel = pair.channel("shared", capacity=16)
    channel.reset([7, 8, 9])
    tokens, version = pair["w0"].start_loop(loops.read_channel, name="shared").result(timeout=10)
    assert tokens == [7, 8, 9] and version == channel.version


def test_large_logits_come_back_intact(pair):
    out = pair["w0"].call("big_logits", 8, 151_936)
    assert out.shape == (8, 151_936) and out.dtype == torch.float32
    assert bool((out == 0.5).all())
    out.add_(1)  # writable, owned by the caller


def test_remote_model_follows_the_model_protocol(pair):
    remote, local = RemoteModel(pair["w1"]), ToyModel(vocab_size=64)
    assert isinstance(remote, Model)
    assert (remote.vocab_size, remote.eos_token_ids, remote.max_context) == (64, (1,), 512)
    assert torch.equal(remote.prefill([1, 2]), local.prefill([1, 2]))
    assert torch.equal(remote.forward([3, 4, 5], last_n=1), local.forward([3, 4, 5], last_n=1))
    assert remote.length == 5
    remote.rollback(2)
    assert remote.length == 2
    handle = remote.submit_forward([6])
    assert torch.equal(handle.result(timeout=10), local.logits_for([6], [2]))


def test_factory_failure_is_reported():
    with Runtime("inprocess") as rt:
        worker = rt.add_worker("broken", "cpu", broken_factory)
        with pytest.raises(RemoteError, match="factory exploded on purpose") as info:
            worker.wait_ready(timeout=30)
        assert "broken_factory" in info.value.remote_traceback


def test_unpicklable_factory_is_refused_early():
    with Runtime("inprocess") as rt:
        with pytest.raises(TypeError, match="picklable"):
            rt.add_worker("lambda", "cpu", lambda: ToyModel())


def test_unknown_kind_and_duplicate_names(pair):
    with pytest.raises(ValueError, match="unknown runtime kind 'ray-someday'; choose one of process, inprocess, ray"):
        Runtime("ray-someday")
    with pytest.raises(ValueError, match="already exists"):
        pair.add_worker("w0", "cpu:0", make_toy)


@contextmanager
def stderr_to_devnull():
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@pytest.mark.parametrize("method", WORKER_STARTS)
def test_a_worker_starts_with_the_callers_environment_and_stderr_of_that_moment(method, monkeypatch, capfd):
    """Either start method: a worker sees the caller's environment as it is when the worker starts and writes to
    the caller's stderr of that moment, though a forked worker's server started earlier (with the first worker, or
    in an earlier test), with the environment and stderr of then."""
    monkeypatch.setenv("PARASPEC_WORKER_START", method)
    with Runtime("process") as rt:
        with stderr_to_devnull():  # a fork server started now has no stderr of its own to give its workers
            first = rt.add_worker("first", "cpu:0", make_toy)
            first.wait_ready(timeout=60)
        monkeypatch.setenv("PARASPEC_TEST_MARK", "set after the first start")
        second = rt.add_worker("second", "cpu:1", make_toy)
        second.wait_ready(timeout=60)
        assert first.call("environment", "PARASPEC_TEST_MARK") is None
        assert second.call("environment", "PARASPEC_TEST_MARK") == "set after the first start"
        capfd.readouterr()
        second.call("say", "from the second worker")
        assert "from the second worker" in capfd.readouterr().err
        assert (second.call("parent_pid") == os.getpid()) == (method == "spawn")  # forked from the server


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to one")
def test_a_worker_on_cpu_gets_the_callers_cores_of_its_start_not_the_servers():
    """In a fresh interpreter (so a fresh fork server): the server starts while the caller is pinned to one core;
    a worker on `cpu` started once the caller has every core again gets every core, as a spawned one would."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "tests.runtime.affinity_child"],
        cwd=root,
        env=dict(os.environ, PARASPEC_WORKER_START="forkserver"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    cores = json.loads(done.stdout.strip().splitlines()[-1])
    assert cores["pinned"] == cores["caller"][:1] and cores["free"] == cores["caller"], cores


def test_an_unknown_start_method_is_named(monkeypatch):
    monkeypatch.setenv("PARASPEC_WORKER_START", "fork")
    with Runtime("process") as rt:
        with pytest.raises(ValueError, match="PARASPEC_WORKER_START='fork': use one of forkserver, spawn"):
            rt.add_worker("w", "cpu:0", make_toy)
