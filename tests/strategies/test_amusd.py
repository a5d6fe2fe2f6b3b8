"""AMUSD: concurrent draft and verify workers return exactly ar's tokens (greedy) and ar's distribution
(sampling); the draft's cache never holds a token twice; faults surface fast; nothing is left behind."""

import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from paraspec import Engine, SamplingParams
from paraspec.drafters.draft_worker import CHANNEL
from paraspec.models.loader import load_model
from paraspec.runtime import WorkerError
from paraspec.runtime.channels import TokenChannel
from paraspec.sampling import make_generator
from paraspec.strategies.amusd import Verifier
from paraspec.trace import Trace
from tests.conftest import PROMPT
from tests.strategies.conftest import check_draft_cache

DEVICES = dict(target_devices=["cpu:1"], draft_devices=["cpu:0"])


@pytest.fixture(scope="module")
def ar_engine(qwen2_target):
    with Engine(qwen2_target, strategy="ar", dtype="float32") as engine:
        yield engine


# draft, max_ahead, verify_chunk, lend_cores. Lent, the target's prompt runs on both cores and the target decodes
# alone until the draft has read its own: with tiny models (a target step ~ the draft's prompt) that can be most of
# 40 tokens, so drafting is asserted where the prompts run at once, as in the paper.
CONFIGS = {
    "partial-16-8-lent": ("qwen2_partial", 16, 8, True),
    "same-4-2": ("qwen2_target", 4, 2, False),
    "unrelated-3-8-lent": ("qwen2_unrelated", 3, 8, True),
    "partial-1-1": ("qwen2_partial", 1, 1, False),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def amusd(request, qwen2_target):
    draft_fixture, max_ahead, verify_chunk, lend = CONFIGS[request.param]
    draft = request.getfixturevalue(draft_fixture)
    with Engine(
        qwen2_target,
        draft,
        strategy="amusd",
        dtype="float32",
        max_ahead=max_ahead,
        verify_chunk=verify_chunk,
        lend_cores=lend,
        **DEVICES,
    ) as engine:
        engine.config_name = request.param
        yield engine


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 40])
def test_amusd_greedy_equals_ar(ar_engine, amusd, max_new_tokens):
    params = SamplingParams(max_new_tokens=max_new_tokens)
    expected = ar_engine.generate(PROMPT, params).token_ids
    result = amusd.generate(PROMPT, params)
    assert result.token_ids == expected
    assert result.finish_reason == "length"
    check_draft_cache(amusd, result)
    if max_new_tokens == 40 and not amusd.config_name.endswith("lent"):
        s = result.stats
        assert s.rounds > 0 and s.drafted > 0
        if amusd.config_name.startswith("same"):
            assert s.acceptance_rate == 1.0


def test_amusd_uses_both_paths_and_overlaps(ar_engine, qwen2_target):
    """With draft == target every draft is accepted; the verifier judges tokens from distributions it
    already had (judged at once, or its own bonus) -- neither is dropped, as the output equality shows."""
    params = SamplingParams(max_new_tokens=60)
    with Engine(qwen2_target, qwen2_target, strategy="amusd", dtype="float32", lend_cores=False, **DEVICES) as e:
        result = e.generate(PROMPT, params)
    assert result.token_ids == ar_engine.generate(PROMPT, params).token_ids
    target = result.worker_reports["target"]
    assert target["judged_at_once"] + target["bonus"] > 0
    devices = {ev.device for ev in result.trace.events}
    assert devices == {"target:cpu:1", "draft:cpu:0"}
    # the draft drafted while the target verified: some draft event overlaps some verify event
    drafts = [e for e in result.trace.events if e.kind == "draft"]
    verifies = [e for e in result.trace.events if e.kind == "verify"]
    assert any(d.start_s < v.end_s and v.start_s < d.end_s for d in drafts for v in verifies)


def test_the_targets_prompt_runs_on_both_cores_while_the_draft_waits(ar_engine, qwen2_target, qwen2_partial):
    """lend_cores (the default): the target reads its prompt on both workers' cores while the draft waits; the draft
    reads its own after the first token. Off, the two prompts run at the same time, each on its own core. Every
    answer is ar's."""
    params = SamplingParams(max_new_tokens=12)
    expected = ar_engine.generate(PROMPT, params).token_ids
    for lend in (True, False):
        with Engine(qwen2_target, qwen2_partial, strategy="amusd", dtype="float32", lend_cores=lend, **DEVICES) as e:
            assert e.strategy.prompt_cores == ((0, 1) if lend else None)
            result = e.generate(PROMPT, params)
        assert result.token_ids == expected
        events = result.trace.events
        prefill = next(ev for ev in events if ev.kind == "prefill")
        first_draft = min((ev for ev in events if ev.kind == "draft"), key=lambda ev: ev.start_s)
        waited = [
            ev for ev in events if ev.device == "draft:cpu:0" and ev.kind == "wait" and ev.end_s <= first_draft.start_s
        ]
        if lend:
            assert first_draft.start_s >= prefill.end_s and waited  # the draft waited for the target's prompt
        else:
            assert not waited


def test_the_verifier_decodes_alone_until_the_draft_has_read_its_prompt(ar_engine, qwen2_target):
    """While the draft reads its prompt the target does not wait for it: each forward commits the target's own
    token. Once the draft has read it (`draft_ready`), the verifier waits for drafts and verifies them."""
    target = load_model(qwen2_target, dtype="float32")
    prompt, params = [5, 17, 33, 90, 12, 7], SamplingParams(max_new_tokens=9)
    expected = ar_engine.generate(prompt, params).token_ids
    channel = TokenChannel(64, vocab_size=target.vocab_size, tag="alone")
    stuck = threading.Timer(20, channel.stop, args=("the verifier waited for a draft that was never coming",))
    stuck.start()
    try:
        channel.reset(prompt)
        ctx = SimpleNamespace(channels={CHANNEL: channel}, trace=Trace(), device="cpu")
        verifier = Verifier(
            target, ctx, prompt, params, frozenset(), len(prompt) + 9, 4, make_generator(None), prompt_cores=(0, 1)
        )
        verifier.settle_in_hand(target.prefill(prompt))  # the first token: nothing drafted, the target's own
        for _ in range(2):  # no draft yet: a forward without waiting, and its row commits the target's own token
            verifier.settle_in_hand(verifier.verify_next_chunk())
        assert verifier.alone == 2 and verifier.verdicts == [(0, 0, True)] * 2 and verifier.bonus == 3
        channel.mark_draft_ready()
        drafts = expected[3:7]
        assert channel.publish_draft(len(prompt) + 3, drafts, version=channel.state().version)
        assert verifier.verify_next_chunk() is not None  # four drafts, all accepted: the next row in hand
        assert verifier.verdicts[-1] == (4, 4, True) and verifier.alone == 2
        assert verifier.sequence[len(prompt) :] == expected[:7]
    finally:
        stuck.cancel()
        channel.close()


# -- faults and cleanup ---------------------------------------------------------------------------------------


def test_killed_draft_worker_is_reported_within_seconds(qwen2_target, qwen2_partial, shm_segments):
    before = shm_segments()
    engine = Engine(qwen2_target, qwen2_partial, strategy="amusd", dtype="float32", **DEVICES)
    pids = [w.pid for w in engine.runtime.workers.values()]
    stream = engine.stream(PROMPT, SamplingParams(max_new_tokens=4000))
    next(stream)
    os.kill(engine.runtime["draft"].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="draft"):
        for _ in stream:
            pass
    assert time.monotonic() - start < 2.0
    engine.close()
    time.sleep(0.2)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    assert shm_segments() <= before


def test_close_leaves_nothing_behind(qwen2_target, qwen2_partial, shm_segments):
    before = shm_segments()
    engine = Engine(qwen2_target, qwen2_partial, strategy="amusd", dtype="float32", **DEVICES)
    assert len(shm_segments() - before) > 0
    pids = [w.pid for w in engine.runtime.workers.values()]
    engine.generate(PROMPT, SamplingParams(max_new_tokens=5))
    engine.close()
    engine.close()  # idempotent
    time.sleep(0.2)
    assert all(not Path(f"/proc/{pid}").exists() for pid in pids)
    assert shm_segments() <= before


def test_abandoned_stream_cancels_cleanly(ar_engine, qwen2_target, qwen2_partial):
    with Engine(qwen2_target, qwen2_partial, strategy="amusd", dtype="float32", **DEVICES) as engine:
        stream = engine.stream(PROMPT, SamplingParams(max_new_tokens=2000))
        next(stream)
        stream.close()  # the consumer walks away mid-request
        params = SamplingParams(max_new_tokens=12)  # the engine still serves the next request exactly
        assert engine.generate(PROMPT, params).token_ids == ar_engine.generate(PROMPT, params).token_ids


def test_bad_checkpoint_fails_before_workers_start(tmp_path, qwen2_target):
    with pytest.raises(ValueError, match="no checkpoint at"):
        Engine(qwen2_target, str(tmp_path / "missing"), strategy="amusd", **DEVICES)
