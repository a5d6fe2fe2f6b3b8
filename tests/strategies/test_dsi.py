"""DSI: one or several drafters and N target servers return exactly ar's tokens (greedy) and ar's distribution
(sampling); tokens of preempted chunks never leak; a dying server is reported; nothing is left behind.

Most engines here use the in-process runtime (workers are threads): the protocol, channel and orchestration are
the same as with processes, and starting N + 1 processes per configuration on a loaded 2-core machine would
cost minutes. The fault and cleanup tests use real processes."""

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from paraspec import Engine, SamplingParams
from paraspec.drafters import DraftSpec
from paraspec.models.simulated import SimulatedModel, SimulatedSpec
from paraspec.runtime import WorkerError
from paraspec.strategies.dsi import drafter_name
from tests.conftest import PROMPT, VOCAB, assert_matches, exact_joint
from tests.strategies.conftest import check_draft_cache
from tests.tiny import make_checkpoint


def own_segments():
    """Shared-memory segments this test process created (other test runs on the machine create their own)."""
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(f"paraspec_{os.getpid()}_")}


@pytest.fixture(scope="module")
def ar_engine(qwen2_target):
    with Engine(qwen2_target, strategy="ar", dtype="float32") as engine:
        yield engine


CONFIGS = {  # draft(s), servers, lookahead, max_ahead
    "partial-1-3": ("qwen2_partial", 1, 3, 6),
    "partial-2-2": ("qwen2_partial", 2, 2, 6),
    "same-3-4": ("qwen2_target", 3, 4, 16),
    "unrelated-3-1": ("qwen2_unrelated", 3, 1, 4),
    # extra drafters (the paper's f_1..f_{m-1}): chunks come from whichever agreeing drafter is ahead
    "unrelated+partial-2-2": (("qwen2_unrelated", "qwen2_partial"), 2, 2, 6),
    "partial+unrelated+same-3-3": (("qwen2_partial", "qwen2_unrelated", "qwen2_target"), 3, 3, 9),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def dsi(request, qwen2_target):
    drafts, servers, lookahead, max_ahead = CONFIGS[request.param]
    draft = (
        [request.getfixturevalue(d) for d in drafts] if isinstance(drafts, tuple) else request.getfixturevalue(drafts)
    )
    with Engine(
        qwen2_target,
        draft,
        strategy="dsi",
        dtype="float32",
        lookahead=lookahead,
        max_ahead=max_ahead,
        target_devices=["cpu"] * servers,
        runtime_kind="inprocess",
    ) as engine:
        engine.config_name = request.param
        yield engine


def check_drafters(engine, result, n_drafters: int):
    """Every drafter's cache holds what it processed; chunks and at-once judgements are credited to drafters
    that drafted at least that many tokens."""
    names = [drafter_name(i) for i in range(n_drafters)]
    assert sorted(k for k in result.worker_reports if k.startswith("draft")) == sorted(names)
    for name in names:
        check_draft_cache(engine, result, name)
    dsi = result.worker_reports["dsi"]
    assert len(dsi["chunks_by_drafter"]) == n_drafters and sum(dsi["chunks_by_drafter"]) <= dsi["chunks"]
    for name, chunks, judged in zip(names, dsi["chunks_by_drafter"], dsi["judged_at_once_by_drafter"]):
        drafted = result.worker_reports[name]["drafted"]
        assert chunks <= drafted and judged <= drafted, (name, chunks, judged, drafted)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 40])
def test_dsi_greedy_equals_ar(ar_engine, dsi, max_new_tokens):
    params = SamplingParams(max_new_tokens=max_new_tokens)
    expected = ar_engine.generate(PROMPT, params).token_ids
    result = dsi.generate(PROMPT, params)
    assert result.token_ids == expected
    assert result.finish_reason == "length"
    check_drafters(dsi, result, len(dsi.draft_models))
    if max_new_tokens == 40:
        s = result.stats
        assert s.rounds > 0 and s.drafted > 0
        report = result.worker_reports["dsi"]
        assert report["servers"] == len(dsi.target_devices) and report["chunks"] > 0
        assert sum(report["chunks_by_drafter"]) > 0
        if dsi.config_name.startswith("same"):
            assert s.acceptance_rate == 1.0 and report["preempted"] == 0
        if dsi.config_name.startswith("unrelated"):
            assert s.rollbacks > 0


def test_dsi_servers_work_in_parallel():
    """A draft that is always right and much faster than the target: several chunks are in flight at once on
    different servers (simulated latencies, so the overlap does not hinge on the machine's load)."""
    from paraspec.sim.costs import ForwardCost

    target = SimulatedSpec(seed=3, cost=ForwardCost((1,), (0.03,)))
    draft = SimulatedSpec(role="draft", seed=3, acceptance_rate=1.0, cost=ForwardCost((1,), (0.002,)))
    with Engine(
        target, draft, strategy="dsi", lookahead=2, max_ahead=8, target_devices=["cpu"] * 3, runtime_kind="inprocess"
    ) as engine:
        result = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=40))
    assert result.token_ids == SimulatedModel(target).predicted[3:43].tolist()
    verifies = [e for e in result.trace.events if e.kind in ("prefill", "verify") and e.device.startswith("target")]
    assert len({e.device for e in verifies}) == 3
    assert any(a.device != b.device and a.start_s < b.end_s and b.start_s < a.end_s for a in verifies for b in verifies)
    assert result.worker_reports["dsi"]["judged_at_once"] + result.worker_reports["dsi"]["bonus"] > 0


# -- preemption: rejections at arbitrary chunks never leak tokens ------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_preempted_chunks_never_leak(seed):
    """Simulated draft wrong at random positions (the draft seed picks them), up to 8 servers, random chunk sizes
    and acceptance: the output must be the target's truth exactly, so no token of a preempted chunk got through.
    The draft is 20x faster than a verification (simulated latencies), so later chunks are always in flight when
    one is rejected -- without latencies, whether any chunk was preempted hinged on the machine's load."""
    from paraspec.sim.costs import ForwardCost

    rng = np.random.default_rng(seed)
    a, lookahead, servers = float(rng.uniform(0.2, 0.95)), int(rng.integers(1, 5)), int(rng.integers(2, 9))
    target = SimulatedSpec(seed=seed, cost=ForwardCost.constant(0.01))
    draft = SimulatedSpec(
        role="draft", seed=seed, draft_seed=100 + seed, acceptance_rate=a, cost=ForwardCost.constant(0.0005)
    )
    truth = SimulatedModel(target).predicted
    with Engine(
        target,
        draft,
        strategy="dsi",
        lookahead=lookahead,
        max_ahead=lookahead * (servers + 1),
        target_devices=["cpu"] * servers,
        runtime_kind="inprocess",
    ) as engine:
        for max_new in (int(rng.integers(1, 30)), 150):
            result = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=max_new))
            assert result.token_ids == truth[3 : 3 + max_new].tolist()
    report = result.worker_reports["dsi"]
    assert result.stats.rollbacks > 0 and report["preempted"] > 0  # rejections really preempted chunks


# -- several drafters ---------------------------------------------------------------------------------------------


def test_first_agreeing_takes_the_lowest_index_that_reached_the_end_and_agrees():
    from paraspec.strategies.dsi import first_agreeing

    a = lambda *t: np.array(t, np.int64)
    speculated = a(1, 2, 3, 4)  # verified 1 2, then chunks in flight drafted 3 4
    assert first_agreeing([a(1, 2, 3, 4, 5, 6), a(1, 2, 3, 4, 5, 6)], speculated, 6) == 0
    assert first_agreeing([a(1, 2, 3, 4, 5), a(1, 2, 3, 4, 5, 6)], speculated, 6) == 1  # 0 not there yet
    assert first_agreeing([a(1, 2, 3, 9, 5, 6), a(1, 2, 3, 4, 5, 6)], speculated, 6) == 1  # 0 disagrees
    assert first_agreeing([None, a(1, 2, 3, 4, 7, 7)], speculated, 6) == 1  # 0 is stale
    assert first_agreeing([a(1, 2, 3, 9, 5, 6), a(1, 2)], speculated, 6) is None
    assert first_agreeing([a(1, 2, 8), a(1, 2, 3)], a(1, 2), 3) == 0  # nothing in flight: any draft


@pytest.mark.parametrize("fast", [0, 1])
def test_the_first_drafter_that_is_ahead_supplies_the_chunks(fast):
    """Two simulated drafters, one 100x slower than the other: the output is the target's truth, and the fast
    one supplies (nearly) every chunk whether it comes first or second."""
    from paraspec.sim.costs import ForwardCost

    target = SimulatedSpec(seed=1, cost=ForwardCost.constant(0.01))
    costs = [0.05, 0.05]
    costs[fast] = 0.0005
    drafts = [
        SimulatedSpec(
            role="draft", seed=1, draft_seed=101 + i, acceptance_rate=(0.9, 0.5)[i], cost=ForwardCost.constant(costs[i])
        )
        for i in range(2)
    ]
    with Engine(
        target, drafts, strategy="dsi", lookahead=3, max_ahead=12, target_devices=["cpu"] * 3, runtime_kind="inprocess"
    ) as engine:
        result = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=100))
        check_drafters(engine, result, 2)
    assert result.token_ids == SimulatedModel(target).predicted[3:103].tolist()
    chunks = result.worker_reports["dsi"]["chunks_by_drafter"]
    assert chunks[fast] >= 0.9 * sum(chunks) and sum(chunks) > 20
    assert {e.device for e in result.trace.events if e.kind == "draft"} == {"draft:cpu", "draft1:cpu"}


def test_several_drafts_are_checked():
    target = SimulatedSpec(seed=1)
    drafts = [SimulatedSpec(role="draft", seed=1), SimulatedSpec(role="draft", seed=1, draft_seed=2)]
    with pytest.raises(ValueError, match="takes one draft model, got 2; only .*dsi.* takes several"):
        Engine(target, drafts, strategy="amusd")
    with pytest.raises(ValueError, match="one per model, got 3"):
        Engine(target, drafts, strategy="dsi", draft_devices=["cpu", "cpu", "cpu"])
    with pytest.raises(ValueError, match="needs a draft model"):
        Engine(target, [], strategy="dsi")


def test_cli_takes_draft_several_times():
    from paraspec.cli.main import build_parser, engine_config

    parser = build_parser()
    base = ["generate", "--target", "t", "--strategy", "dsi", "--prompt", "x"]
    assert engine_config(parser.parse_args(base + ["--draft", "a"])).draft == "a"
    assert engine_config(parser.parse_args(base + ["--draft", "a", "--draft", "b"])).draft_specs == (
        DraftSpec("a", False),
        DraftSpec("b", False),
    )


# -- sampling -----------------------------------------------------------------------------------------------------

N_SAMPLES = 1_200


@pytest.fixture(scope="module")
def mid_speed_draft(tmp_path_factory):
    """A second draft with its own distribution, slower than slow_target_pair's draft and faster than its
    target: as drafter 0 it is ahead only some of the time, so both drafters' drafts get judged."""
    return make_checkpoint(
        tmp_path_factory.mktemp("mid-draft") / "d",
        "qwen2",
        seed=23,
        scale=5,
        tokenizer=False,
        vocab_size=VOCAB,
        eos_token_id=None,
        num_hidden_layers=2,
        hidden_size=128,
        intermediate_size=512,
    )


@pytest.mark.parametrize("drafters", [2])  # one drafter: test_lossless.py::test_worker_processes, test_multinode.py
def test_dsi_sampling_matches_target_distribution(slow_target_pair, mid_speed_draft, drafters):
    target, draft = slow_target_pair
    sampling = dict(temperature=0.8, top_k=4)
    prompt = [1, 2, 3]
    drafts = draft if drafters == 1 else [mid_speed_draft, draft]
    with (
        Engine(
            target,
            drafts,
            strategy="dsi",
            dtype="float32",
            lookahead=1,
            max_ahead=3,
            target_devices=["cpu", "cpu"],
            runtime_kind="inprocess",
        ) as engine,
        Engine(target, strategy="ar", dtype="float32") as ar,
    ):
        joint = exact_joint(ar, prompt, SamplingParams(**sampling))
        counts, drafted, accepted = np.zeros((VOCAB, VOCAB)), 0, 0
        judged = np.zeros(drafters)  # drafts judged, per drafter
        for seed in range(N_SAMPLES):
            result = engine.generate(prompt, SamplingParams(max_new_tokens=2, seed=seed, **sampling))
            x1, x2 = result.token_ids
            counts[x1, x2] += 1
            drafted += result.stats.drafted
            accepted += result.stats.accepted
            report = result.worker_reports["dsi"]
            judged += np.add(report["chunks_by_drafter"], report["judged_at_once_by_drafter"])
    assert drafted > N_SAMPLES / 2 and 0.1 * drafted < accepted < 0.9 * drafted  # drafts were really judged
    assert judged.min() > 0.1 * N_SAMPLES, judged  # each drafter's q was really used
    assert_matches(counts, joint)
    assert_matches(counts.sum(1), joint.sum(1))  # the first token alone: more power there


# -- faults and cleanup (real processes) --------------------------------------------------------------------------


def test_server_dying_while_others_hold_chunks(ar_engine, qwen2_target, qwen2_partial):
    before = own_segments()
    engine = Engine(
        qwen2_target,
        qwen2_partial,
        strategy="dsi",
        dtype="float32",
        lookahead=2,
        max_ahead=8,
        target_devices=["cpu:1", "cpu:1"],
        draft_devices=["cpu:0"],
    )
    assert len(own_segments() - before) > 0
    pids = [w.pid for w in engine.runtime.workers.values()]
    assert len(set(pids)) == 3
    params = SamplingParams(max_new_tokens=12)  # the process engine serves exactly, before the fault
    assert engine.generate(PROMPT, params).token_ids == ar_engine.generate(PROMPT, params).token_ids
    stream = engine.stream(PROMPT, SamplingParams(max_new_tokens=4000))
    next(stream)  # the tiny pair stops (EOS) ~25 tokens in: most are yet to come
    os.kill(engine.runtime["target1"].pid, signal.SIGKILL)
    start = time.monotonic()
    while engine.runtime["target1"].alive and time.monotonic() - start < 2.0:
        time.sleep(0.01)  # dead before the loop resumes, whether it holds a chunk or not
    with pytest.raises(WorkerError, match="target1"):
        for _ in stream:
            pass
    assert time.monotonic() - start < 2.0
    engine.close()
    engine.close()  # idempotent
    time.sleep(0.2)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    assert own_segments() <= before


def test_abandoned_stream_cancels_cleanly(ar_engine, qwen2_target, qwen2_partial):
    with Engine(
        qwen2_target,
        qwen2_partial,
        strategy="dsi",
        dtype="float32",
        target_devices=["cpu"] * 2,
        runtime_kind="inprocess",
    ) as engine:
        stream = engine.stream(PROMPT, SamplingParams(max_new_tokens=2000))
        next(stream)
        stream.close()
        params = SamplingParams(max_new_tokens=12)
        assert engine.generate(PROMPT, params).token_ids == ar_engine.generate(PROMPT, params).token_ids


def test_bad_options_fail_before_any_worker_starts(qwen2_target, qwen2_partial, monkeypatch):
    from paraspec.runtime.runtime import Runtime

    monkeypatch.setattr(Runtime, "add_worker", lambda *a, **k: pytest.fail("a worker started"))
    with pytest.raises(ValueError, match="max_ahead \\(4\\) < lookahead \\(6\\)"):
        Engine(qwen2_target, qwen2_partial, strategy="dsi", dtype="float32", lookahead=6, max_ahead=4)


def test_lent_cores_run_server_0s_prompt_on_every_core_first(ar_engine, qwen2_target, qwen2_partial):
    """lend_cores (the default where every device is a core set of one machine): server 0 reads the prompt on every
    worker's cores while the others wait; then the other servers read theirs and the drafter its own, while the
    servers decode alone (chunks without drafts) until the drafter has read it. Every answer is ar's, lent or not."""
    params = SamplingParams(max_new_tokens=24)
    expected = ar_engine.generate(PROMPT, params).token_ids
    devices = dict(target_devices=["cpu:1", "cpu:0"], draft_devices=["cpu:0"])
    for lend in (True, False):
        with Engine(
            qwen2_target,
            qwen2_partial,
            strategy="dsi",
            dtype="float32",
            lookahead=2,
            max_ahead=6,
            lend_cores=lend,
            **devices,
        ) as engine:
            assert engine.strategy.prompt_cores == ((0, 1) if lend else None)
            result = engine.generate(PROMPT, params)
            again = engine.generate(PROMPT, params)  # a second request: the servers' caches from the first
        assert result.token_ids == expected and again.token_ids == expected
        events = result.trace.events
        server0 = next(e for e in events if e.kind == "prefill" and e.device.startswith("target0"))
        first_draft = min((e for e in events if e.kind == "draft"), key=lambda e: e.start_s)
        server1 = [e for e in events if e.device.startswith("target1")]  # none where server 0 did all the work
        if lend:
            assert first_draft.start_s >= server0.end_s and all(e.start_s >= server0.end_s for e in server1)
