"""Channels between processes: a randomized drafter/verifier stress test and cross-process wake-ups, with the
workers as local processes (shared memory) and as Ray actors on two nodes of a cluster (the network transport:
every channel call over TCP to this process)."""

import time

import numpy as np
import pytest

from paraspec.runtime import ChannelStopped, Runtime
from paraspec.trace import Trace
from tests.runtime import loops
from tests.runtime.toy_model import make_toy


@pytest.fixture(scope="module")
def across_nodes(request):
    """w0 on node box-a, w1 on node box-b, reached over TCP (started on first use)."""
    request.getfixturevalue("ray_cluster")
    rt = Runtime("ray", transport="tcp")
    rt.add_worker("w0", "box-a/cpu:0", make_toy, {"vocab_size": 64})
    rt.add_worker("w1", "box-b/cpu:1", make_toy, {"vocab_size": 64})
    rt.wait_ready(timeout=120)
    assert {w.transport for w in rt.workers.values()} == {"tcp"}
    yield rt
    rt.close()


@pytest.fixture(params=["processes", "ray-nodes"])
def rt(request):
    """A runtime that lives across the module's tests, as an Engine's does across requests: each test adds its own
    channel and stops it on the way out (as a strategy does), and the stop signal stays set once a test stops the
    runtime (these loops wait on their channels)."""
    return request.getfixturevalue("pair" if request.param == "processes" else "across_nodes")


def test_randomized_drafter_verifier_stress(rt):
    """w0 drafts as fast as the q window allows, w1 verifies with random rejections, and this process reads
    along: every token, stamp and q row read matches what was published under that version; versions only
    grow; the final committed sequence is exactly the verifier's record."""
    channel = rt.channel("stress", capacity=4096, vocab_size=loops.STRESS_VOCAB, q_window=8)
    try:
        version = channel.reset([1, 2, 3])
        trace = Trace()
        drafter = rt["w0"].start_loop(loops.stress_drafter, trace=trace, channel=channel, seed=1)
        verifier = rt["w1"].start_loop(loops.stress_verifier, trace=trace, channel=channel, rounds=400, seed=2)
        # a third reader in this process: waits for drafts at its version and checks what it gets
        seen_versions, reads = [version], 0
        try:
            length = 3
            while True:
                snap = channel.wait_for_draft(length + 1, version=version, timeout=10)
                assert snap is not None, "reader starved"
                assert snap.version >= version
                assert np.all(snap.stamps == snap.version)
                assert snap.tokens.tolist() == [
                    loops.draft_token(snap.start + i, snap.version) for i in range(len(snap.tokens))
                ]
                version, length = snap.version, snap.length
                seen_versions.append(version)
                reads += 1
        except ChannelStopped as stop:
            assert stop.reason == "verifier done"
        (published, resyncs), (record, rollbacks, checked) = rt.gather(drafter, verifier, timeout=60)
        assert channel.tokens(0, channel.committed).tolist() == record
        assert len(record) > 400 and rollbacks > 50 and checked > 200 and published > 400
        assert resyncs >= rollbacks // 2  # the drafter noticed the rollbacks and resynced
        assert seen_versions == sorted(seen_versions) and reads > 20
        committed_curve = [tokens for _, tokens in trace.progress]
        assert committed_curve == sorted(committed_curve) and committed_curve[-1] == len(record)
    finally:
        channel.stop("test over")  # a loop still waiting on it ends


def test_cross_process_wait_wakes_promptly_without_polling(rt):
    channel = rt.channel("wake", capacity=16)
    try:
        channel.reset([1])
        handle = rt["w1"].start_loop(loops.timed_commit_wait, channel=channel, min_committed=2)
        time.sleep(0.6)  # the worker is asleep in the kernel by now
        committed_at = time.perf_counter()
        channel.commit([5])
        woke, switches, cpu_s, committed = handle.result(timeout=10)
        assert committed == 2
        assert woke - committed_at < 0.25, woke - committed_at  # typically ~0.1 ms
        assert switches < 20 and cpu_s < 0.05, (switches, cpu_s)  # a sleep-poll loop would show hundreds
    finally:
        channel.stop("test over")  # a loop still waiting on it ends


def test_stop_reaches_a_loop_in_another_process(rt):
    channel = rt.channel("halt", capacity=8)
    try:
        channel.reset([1])
        handle = rt["w0"].start_loop(loops.wait_until_stopped, channel=channel)
        time.sleep(0.2)
        rt.stop("request cancelled")
        assert handle.result(timeout=5) == "stopped: request cancelled"
        # and the stop signal: a loop started afterwards, in the other worker, sees it set, with this reason
        assert rt["w1"].start_loop(loops.report_stop).result(timeout=5) == (True, "request cancelled")
    finally:
        channel.stop("test over")  # a loop still waiting on it ends


def test_gather_stops_the_others_when_one_fails(rt):
    channel = rt.channel("fail", capacity=8)
    try:
        channel.reset([1])
        waiting = rt["w0"].start_loop(loops.wait_until_stopped, channel=channel)
        failing = rt["w1"].start_loop(loops.raise_in_loop, message="verifier broke")
        start = time.perf_counter()
        try:
            rt.gather(waiting, failing, timeout=10)
            raise AssertionError("gather should have raised")
        except Exception as error:
            assert "verifier broke" in str(error)
        assert waiting.done() and waiting.result().startswith("stopped: worker 'w1' failed")
        assert time.perf_counter() - start < 2
    finally:
        channel.stop("test over")  # a loop still waiting on it ends
