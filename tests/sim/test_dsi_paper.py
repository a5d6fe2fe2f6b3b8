"""The DSI paper's offline model: edge cases, closed forms, the paper's theorems, and faithfulness to the authors'
per-round loops (transcribed here literally as the reference)."""

import math

import numpy as np
import pytest

from paraspec.sim import dsi_paper as paper


def si_reference(draws, k, c, tokens):
    """The authors' SI loop, line by line."""
    cost, left, it = 0.0, tokens, iter(draws)
    while left > 0:
        cost += min(k, left - 1) * c + 1
        left -= next(it) + 1
    return cost


def dsi_reference(draws, k, c, tokens):
    """The authors' DSI loop, line by line."""
    cost, done, verified, it = 0.0, 0, False, iter(draws)
    while done < tokens:
        new, si = 0, 0.0
        while True:
            chunk = min(k, tokens - 1 - done - new)
            accepted = min(chunk, next(it))
            new += accepted
            if accepted > 0 or not verified:
                si += chunk * c
            if chunk == 0 or accepted < chunk:
                si += 1
                new += 1
                verified = True
                break
            verified = False
        cost += min(si, new)
        done += new
    return cost


def test_vectorised_costs_equal_the_authors_loops():
    rng = np.random.default_rng(1)
    for _ in range(150):
        a = float(rng.choice([0.0, 1.0, rng.uniform(0.01, 0.99)]))
        k, tokens = int(rng.integers(1, 25)), int(rng.integers(1, 400))
        c = np.array([0.01, float(rng.uniform(0.01, 1)), 1.0])
        for draws in paper.paper_draws(a, k, tokens, repeats=2, seed=int(rng.integers(1000))):
            si = paper.si_rounds(draws, k, tokens).cost(c)
            dsi = paper.dsi_windows(draws, k, tokens).cost(c)
            for j, cj in enumerate(c):
                assert si[j] == pytest.approx(si_reference(draws, k, cj, tokens))
                assert dsi[j] == pytest.approx(dsi_reference(draws, k, cj, tokens))


def test_draws_are_the_authors_stream():
    # legacy RandomState(42), geometric(1 - a) - 1 capped at k, `tokens` draws per repeat from one generator
    rng = np.random.RandomState(42)
    expected = [np.minimum(rng.geometric(0.4, 1000) - 1, 7) for _ in range(2)]
    got = paper.paper_draws(0.6, 7, 1000, repeats=2)
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(e, g)


@pytest.mark.parametrize("k", [1, 5, 20])
@pytest.mark.parametrize("c", [0.01, 0.3, 1.0])
def test_acceptance_zero(c, k):
    costs = paper.simulate(c, 0.0, k, tokens=100, repeats=1)
    # every round gains one token and pays min(k, left - 1) drafts
    assert costs.si == pytest.approx(sum(min(k, left - 1) * c + 1 for left in range(100, 0, -1)))
    assert costs.dsi == pytest.approx(100)  # nothing is ever accepted: DSI = its non-SI thread


@pytest.mark.parametrize("k", [1, 4, 20])
@pytest.mark.parametrize("c", [0.01, 0.3, 1.0])
def test_acceptance_one(c, k):
    tokens = 100
    costs = paper.simulate(c, 1.0, k, tokens=tokens, repeats=1)
    rounds = math.ceil(tokens / (k + 1))
    drafts = (rounds - 1) * k + min(k, tokens - (rounds - 1) * (k + 1) - 1)
    assert costs.si == pytest.approx(drafts * c + rounds)
    # one window: all tokens but the last drafted and accepted, then one target forward
    assert costs.dsi == pytest.approx(min((tokens - 1) * c + 1, tokens))


@pytest.mark.parametrize("a,k", [(0.3, 1), (0.6, 4), (0.8, 10), (0.95, 3)])
def test_si_tokens_per_round_match_closed_form(a, k):
    draws = paper.accepted_draws(a, k, 40000, np.random.RandomState(7))
    gained = draws + 1
    expected = paper.si_expected_tokens_per_round(a, k)
    assert abs(gained.mean() - expected) < 4 * gained.std() / math.sqrt(len(gained))
    # and through whole SI runs: tokens / rounds
    rounds = paper.si_rounds(draws, k, 30000)
    assert 30000 / len(rounds.drafts) == pytest.approx(expected, rel=0.02)


def test_dsi_never_slower_than_si_or_nonsi_on_the_paper_grid():
    """The paper's Theorems: on every grid point and every lookahead (feasible or not), DSI <= SI, DSI <= non-SI."""
    c, a, k = paper.paper_grid(20)
    hm = paper.heatmap(c, a, k, max_servers=None)
    assert not np.isnan(hm.si).any() and not np.isnan(hm.dsi).any()
    assert (hm.dsi <= hm.si + 1e-9).all()
    assert (hm.dsi <= hm.nonsi + 1e-9).all()
    # and SI is slower than non-SI somewhere, which is the paper's point (Fig. 1, pink)
    assert (hm.speedups()["si_vs_nonsi"] < 1).any()


def test_heatmap_excludes_configurations_needing_too_many_servers():
    c = np.array([0.01, 0.5])
    hm = paper.heatmap(c, np.array([0.5]), np.array([1, 14, 15]), tokens=50, repeats=1, max_servers=7)
    # c = 0.01 needs ceil(1 / (k c)) servers: 100, 8, 7
    assert np.isnan(hm.dsi[0, 0, :2]).all() and not np.isnan(hm.dsi[0, 0, 2])
    assert not np.isnan(hm.dsi[1]).any()
    assert np.isnan(hm.si[0, 0, :2]).all()  # the authors drop the whole configuration
    free_si = paper.heatmap(c, np.array([0.5]), np.array([1, 14, 15]), tokens=50, repeats=1, si_feasible_only=False)
    assert not np.isnan(free_si.si).any()
    assert hm.best_lookahead("dsi")[0, 0] == 15


def test_servers_required():
    assert paper.servers_required(2.5 / 37.7, 5) == 4
    assert paper.servers_required(0.01, 14) == 8
    assert paper.servers_required(0.01, 15) == 7
    assert paper.servers_required(1.0, 1) == 1


def test_paper_grid():
    c, a, k = paper.paper_grid(20)
    assert len(c) == len(a) == 21 and list(k) == list(range(1, 21))
    assert c[0] == 0.01 and c[1] == pytest.approx(0.05) and c[-1] == 1.0
    assert a[0] == 0.01 and a[-1] == 0.99


def test_proposition1_gap_of_the_authors_model_is_the_charged_rejected_draft():
    """Proposition 1 (lookahead 1): E[latency] <= t1 p (N - 1) + t2 ((1 - p)(N - 1) + 1). The authors' offline model
    charges the drafting of a draft rejected right after an accepted one, which the previous verification already
    reveals; so it sits above the bound by c a (1 - a) (N - 1). (The event simulator meets the bound:
    tests/sim/test_events.py.)"""
    for c, a in [(0.1, 0.5), (0.3, 0.3), (0.05, 0.9)]:
        cost = paper.simulate(c, a, 1, tokens=1000, repeats=100).dsi
        bound = paper.proposition1_bound(c, 1.0, a, 1000)
        assert cost - bound == pytest.approx(c * a * (1 - a) * 999, rel=0.1, abs=1.0)


def test_table1_all_ten_rows():
    results = paper.table1()
    assert len(results) == 10
    for row, r in zip(paper.PAPER_TABLE1, results):
        assert r.si_k in paper.TABLE1_LOOKAHEADS and r.dsi_k in paper.TABLE1_LOOKAHEADS
        assert r.dsi_servers == paper.servers_required(row.drafter_ms / row.target_ms, r.dsi_k)
        assert r.dsi_servers <= paper.PAPER_MAX_SERVERS
        assert 1.0 < r.speedup < row.paper_speedup  # faster than SI; below the paper's (thread-pool) figure
    with pytest.raises(ValueError, match="allow more servers"):
        paper.table1(lookaheads=(1,), max_servers=2)  # Vicuna: c = 0.066 needs 16 servers at k = 1


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: paper.simulate(0.0, 0.5, 5), r"c=0.0 is outside \(0, 1\]"),
        (lambda: paper.simulate(1.5, 0.5, 5), r"outside \(0, 1\]"),
        (lambda: paper.simulate(0.5, -0.1, 5), r"outside \[0, 1\]"),
        (lambda: paper.check_acceptance(1.0, allow_one=False), r"outside \[0, 1\)"),
        (lambda: paper.simulate(0.5, 0.5, 0), r"k=0 must be an integer >= 1"),
    ],
)
def test_bad_input_names_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()
