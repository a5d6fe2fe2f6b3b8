"""Loop functions for runtime tests: module-level so a spawned worker can unpickle them."""

from __future__ import annotations

import os
import random
import resource
import time

import numpy as np
import torch

from paraspec.runtime.channels import ChannelStopped


def report_pinning(model, ctx):
    return sorted(os.sched_getaffinity(0)), torch.get_num_threads(), os.getpid(), str(ctx.device), ctx.name


def traced_work(model, ctx, steps: int, seconds: float):
    for i in range(steps):
        with ctx.trace.span("draft", tokens=i + 1):
            time.sleep(seconds)
        ctx.trace.commit(i + 1)
    return steps


def raise_in_loop(model, ctx, message: str):
    raise KeyError(message)


def wait_until_stopped(model, ctx, channel):
    """Block on the channel (never satisfied) until something stops it; report why."""
    try:
        channel.wait_for_commit(10**9)
    except ChannelStopped as stop:
        return f"stopped: {stop.reason}"
    return "woke without a stop"


def report_stop(model, ctx):
    """What the loop's stop signal says: (set, reason)."""
    return ctx.stopped, ctx.stop.reason


def timed_commit_wait(model, ctx, channel, min_committed: int):
    """Wait for a commit; report when we woke (perf_counter) and how often this thread was switched out."""
    before = resource.getrusage(resource.RUSAGE_THREAD)
    cpu0 = time.thread_time()
    state = channel.wait_for_commit(min_committed, timeout=30)
    woke = time.perf_counter()
    after = resource.getrusage(resource.RUSAGE_THREAD)
    return woke, after.ru_nvcsw - before.ru_nvcsw, time.thread_time() - cpu0, state.committed


def read_channel(model, ctx, name: str):
    """Read a channel the worker got through ctx.channels; return its tokens and version."""
    channel = ctx.channels[name]
    return channel.tokens().tolist(), channel.version


# --- the randomized producer/consumer stress test ------------------------------------------------------------

STRESS_VOCAB = 16


def draft_token(position: int, version: int) -> int:
    return (position * 7919 + version * 104729) % 100_000


def correction_token(position: int) -> int:
    return 1_000_000 + position  # never equal to a draft token


def draft_q(position: int, version: int, n: int = STRESS_VOCAB) -> np.ndarray:
    return np.full(n, position + version / 1000.0, dtype=np.float32)


def stress_drafter(model, ctx, channel, seed: int):
    """Publish deterministic drafts (a function of position and version) in random chunks, as fast as the
    q window allows; resync whenever the channel moved on. Returns how many tokens were published."""
    rng = random.Random(seed)
    version, position = channel.version, channel.length
    published = resyncs = 0
    try:
        while True:
            state = channel.wait_for_room(position + 1, version=version, timeout=5)
            if state is None:
                raise TimeoutError("drafter starved for 5 s")
            # a chunk that does not fit the q window would wait for a commit that waits for it
            n = max(1, min(rng.randint(1, 4), state.committed + channel.q_window - position))
            ok = state.version == version and channel.publish_draft(
                position,
                [draft_token(p, version) for p in range(position, position + n)],
                np.stack([draft_q(p, version) for p in range(position, position + n)]),
                version=version,
            )
            if ok:
                position += n
                published += n
            else:
                state = channel.state()
                version, position = state.version, state.length
                resyncs += 1
    except ChannelStopped:
        return published, resyncs


def stress_verifier(model, ctx, channel, rounds: int, seed: int):
    """Check every draft it reads (token, stamp and q match what the drafter published under that version),
    then commit a random prefix plus a correction or a bonus token. Returns its own record of commits."""
    rng = random.Random(seed)
    record = channel.tokens(0, channel.committed).tolist()
    last_version = channel.version
    rollbacks = checked = 0
    for _ in range(rounds):
        committed = len(record)
        snap = channel.wait_for_draft(committed + rng.randint(1, 6), timeout=5)
        if snap is None:
            raise TimeoutError("verifier starved for 5 s")
        assert snap.version >= last_version, (snap.version, last_version)
        assert snap.committed == committed and snap.start == committed
        assert np.all(snap.stamps == snap.version), (snap.stamps, snap.version)
        drafts = snap.tokens.tolist()
        expected = [draft_token(committed + i, snap.version) for i in range(len(drafts))]
        assert drafts == expected, (committed, drafts, expected)
        if drafts:
            q = channel.read_q(committed, committed + len(drafts), version=snap.version)
            want = np.stack([draft_q(committed + i, snap.version) for i in range(len(drafts))])
            assert np.array_equal(q, want)
        checked += len(drafts)
        accepted = rng.randint(0, len(drafts))
        position = committed + accepted
        extra = draft_token(position, snap.version) if rng.random() < 0.4 else correction_token(position)
        result = channel.commit(drafts[:accepted] + [extra])
        if result.rollback_at is not None:
            assert result.rollback_at == position and result.version == snap.version + 1
            rollbacks += 1
        else:
            assert result.version == snap.version
        last_version = result.version
        record.extend(drafts[:accepted] + [extra])
        ctx.trace.commit(len(record))
    channel.stop("verifier done")
    return record, rollbacks, checked
