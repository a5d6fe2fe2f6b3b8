"""`paraspec profile`: the DSI paper's acceptance arithmetic and the planner's JSON schema."""

import pytest

from paraspec import Engine
from paraspec.bench.pair_profile import (
    acceptance_from_windows,
    draft_hits,
    greedy_tokens,
    match_windows,
    profile_pair,
    time_forwards,
)
from paraspec.runtime.devices import Device, available_cores
from paraspec.sim.costs import Profile


def test_match_windows_and_acceptance():
    # runs of hits closed by a miss: 3, 0, 2 -> n̄ = 5 / 3; the trailing open run (1 hit) adds its hit only
    hits = [True, True, True, False, False, True, True, False, True]
    assert match_windows(hits) == (6, 3)
    rate, mean = acceptance_from_windows(6, 3)
    assert mean == pytest.approx(2.0) and rate == pytest.approx(1 - 1 / 3)
    assert acceptance_from_windows(0, 4) == (0.0, 0.0)
    rate, mean = acceptance_from_windows(10, 0)  # never missed: one window of 10, rate stays < 1
    assert mean == 10 and rate == pytest.approx(10 / 11)


ONE_CORE = Device("cpu", cores=(available_cores()[0],))


@pytest.fixture(scope="module")
def engine(bench_target, bench_draft):
    with Engine(bench_target, bench_draft, strategy="sd", dtype="float32") as e:
        yield e


def test_draft_hits_agree_with_step_by_step_greedy(engine):
    ids = engine.encode("def add(a, b):")
    reference = greedy_tokens(engine.target, ids, 12)
    assert len(reference) == 12
    hits = draft_hits(engine.draft, ids, reference)
    expected = []
    for i, token in enumerate(reference):
        logits = engine.draft.prefill(ids + reference[:i])
        expected.append(int(logits.argmax()) == token)
    assert hits == expected and 0 < sum(hits) < 12  # a partial draft: some hits, some misses


def test_time_forwards_leaves_the_cache_as_it_found_it(engine):
    ids = engine.encode("abc")
    times = time_forwards(engine.target, ids, widths=(1, 4), repeats=2)
    assert set(times) == {"1", "4"} and all(t > 0 for t in times.values())
    assert engine.target.length == len(ids)


def test_profile_schema_is_what_the_planner_reads(engine, bench_target, bench_draft):
    prompts = [engine.encode(p) for p in ("def add(a, b):", "Once upon a time")]
    profile = profile_pair(
        engine.target, engine.draft, ONE_CORE, ONE_CORE, prompts, "T", "D", tokens=5, match_tokens=16, widths=(1, 2, 8)
    )
    assert set(profile) == {"target", "draft", "acceptance_rate", "mean_match_length", "devices"}
    for role, name in (("target", "T"), ("draft", "D")):
        entry = profile[role]
        assert set(entry) == {"model", "device", "ttft_ms", "tpot_ms", "forward_ms"}
        assert entry["model"] == name and entry["device"] == str(ONE_CORE)
        assert set(entry["forward_ms"]) == {"1", "2", "8"}
        assert entry["ttft_ms"] > 0 and entry["tpot_ms"] > 0
    assert 0 < profile["acceptance_rate"] < 1 and profile["devices"] == [str(ONE_CORE)]
    assert profile["acceptance_rate"] == pytest.approx(1 - 1 / (1 + profile["mean_match_length"]))
    planner = Profile.from_dict(profile)
    assert planner.target.tpot_ms == profile["target"]["tpot_ms"]


def test_a_draft_equal_to_the_target_always_matches(engine):
    prompts = [engine.encode("Once upon a time")]
    profile = profile_pair(
        engine.target, engine.target, ONE_CORE, ONE_CORE, prompts, "T", "T", tokens=3, match_tokens=10, widths=(1,)
    )
    assert profile["mean_match_length"] == 10 and profile["acceptance_rate"] == pytest.approx(10 / 11)


def test_profile_rejects_bad_counts(engine):
    with pytest.raises(ValueError, match="--tokens must be >= 2"):
        profile_pair(engine.target, engine.draft, ONE_CORE, ONE_CORE, [[1, 2]], "T", "D", tokens=1)
