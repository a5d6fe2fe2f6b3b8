"""The authors' thread-pool simulation, replayed (paraspec/sim/dsi_online.py): windows computed by hand, the
run rules of each variant, and agreement with the event simulator where the two models assume the same."""

import numpy as np
import pytest

from paraspec.sim import dsi_online as online
from paraspec.sim.costs import ForwardCost
from paraspec.sim.events import Setup, simulate

PAPER = online.VARIANTS["paper"]
BONUS = online.VARIANTS["bonus"]


def setup(a=1.0, k=5, servers=None, t=10.0, c=1.0, tokens=50, variant=PAPER, **lat):
    return online.OnlineSetup(online.Latencies(t, c, **lat), a, k, servers, tokens, variant=variant)


def run_ms(s, seed=0):
    return online.simulate_run(s, np.random.default_rng(seed)).time_ms


def test_acceptance_one_si_by_hand():
    # a = 1: every window has correct = 20. SI, k = 5, target 10, drafter 1: the call at 0 drafts (10), then
    # 5 drafts + a call per step (15 each) for drafts 5, 10, 15, 20 (accepted) and 25 (rejected): 10 + 5 * 15 = 85
    # per window of 20 tokens; the third window's first call would pass 50 tokens: it stops the run at 10.
    s = setup(a=1.0, k=5)
    run = online._Run()
    assert online.si_window(s, run, 20) == (85.0, False) and run.gained == 20
    assert run_ms(s) == 85 + 85 + 10


def test_acceptance_one_dsi_enough_servers_by_hand():
    # DSI, k = 1, 40 threads (no queue): the first rejecting call has 21 drafts, issued at 21, done at 31.
    s = setup(a=1.0, k=1, servers=40)
    assert online.dsi_window(s, online._Run(), 20) == (31.0, False)
    assert run_ms(s) == 31 + 31 + 10


def test_one_server_lifo_queue_by_hand():
    # One thread, k = 5: call 0 runs [0, 10]; calls queue and the newest runs next: 5 at [10, 20], 15 at
    # [20, 30], 25 at [30, 40] rejects (20 < 25). Without the queue, call 25 would have finished at 35.
    s = setup(a=1.0, k=5, servers=1)
    assert online.dsi_window(s, online._Run(), 20) == (40.0, False)
    assert run_ms(s) == 40 + 40 + 10


def test_acceptance_zero_windows_and_runs():
    # correct = 0: with the bonus token the call at 0 rejects at once and the window yields one token (non-SI);
    # without it the window yields nothing, and at a = 0 the authors' loop never ends: refused.
    for servers in (None, 3):
        run = online._Run()
        assert (
            online.dsi_window(setup(a=0.5, k=2, servers=3, variant=BONUS), run, 0) == (10.0, False)
            if servers
            else online.si_window(setup(a=0.5, k=2, variant=BONUS), run, 0) == (10.0, False)
        )
        assert run.gained == 1
    run = online._Run()
    assert online.dsi_window(setup(a=0.5, k=1, servers=3), run, 0) == (11.0, False) and run.gained == 0
    with pytest.raises(ValueError, match="loops forever"):
        setup(a=0.0)


def test_ttft_paid_once_per_thread_index_and_once_by_the_drafter():
    # target TTFT 30 on a thread's first call in the run, drafter TTFT 4 on the run's first draft.
    s = setup(a=1.0, k=1, servers=40, target_ttft_ms=30.0, draft_ttft_ms=4.0)
    run = online._Run()
    # Draft j is done at 3 + j. Call 21 (the first that rejects) is issued at 24 on a new thread: done at 54.
    # But thread 0 (call 0, TTFT) is free at 30 and takes call 27, issued then, at TPOT: it rejects first, at 40.
    assert online.dsi_window(s, run, 20) == (40.0, False)
    # second window: threads 0..21 are known; call 21 is issued at 21 (no drafter TTFT), on thread 21: TPOT
    assert online.dsi_window(s, run, 20) == (31.0, False)
    si = setup(a=1.0, k=5, target_ttft_ms=30.0, draft_ttft_ms=4.0)
    run = online._Run()
    assert online.si_window(si, run, 20)[0] == 30 + 4 + 4 * 1 + 10 + 4 * (5 + 10)
    assert online.si_window(si, run, 20)[0] == 85


def test_per_second_draws_repeat_within_a_second():
    s = setup(a=0.5)
    draws = online._Draws(s, np.random.default_rng(0))
    draws.phase_s = 0.0
    first = draws.correct(0.1)
    assert all(draws.correct(w) == first for w in (0.2, 0.5, 0.99))
    assert len({draws.correct(w + 0.5) for w in range(200)}) > 1  # other seconds draw again
    iid = online._Draws(setup(a=0.5, variant=online.VARIANTS["main"]), np.random.default_rng(0))
    assert len({iid.correct(0.1) for _ in range(50)}) > 1


@pytest.mark.parametrize("t,c,a,k", [(30.0, 3.0, 0.6, 1), (30.0, 3.0, 0.6, 5), (30.0, 10.0, 0.5, 3)])
def test_agrees_with_the_event_simulator_where_the_assumptions_coincide(t, c, a, k):
    # Same assumptions: the bonus token per window (the event simulator's correction), independent draws, enough
    # servers that no call waits, TTFT = TPOT, no restart cost. Left different: the online run stops as soon as an
    # accepting call *would* reach S (up to ~correct drafts early), so a is kept low and the run long.
    tokens, n = 300, int(np.ceil(t / (k * c))) + 2
    s = online.OnlineSetup(online.Latencies(t, c), a, k, n, tokens, max_correct=10**6, variant=BONUS)
    rng = np.random.default_rng(1)
    ours = [online.simulate_run(s, rng).time_ms for _ in range(200)]
    ev = [
        1000
        * simulate(
            Setup(
                "dsi",
                ForwardCost.constant(t / 1000),
                ForwardCost.constant(c / 1000),
                acceptance_rate=a,
                lookahead=k,
                servers=n,
            ),
            tokens,
            seed=r,
        ).total_s
        for r in range(60)
    ]
    error = np.hypot(np.std(ours) / np.sqrt(len(ours)), np.std(ev) / np.sqrt(len(ev)))
    assert abs(np.mean(ours) - np.mean(ev)) < 4 * error + 2 * c


@pytest.mark.parametrize("variant", [PAPER, BONUS])
@pytest.mark.parametrize("correct", [0, 1, 4, 5, 6, 12, 20])
def test_si_window_pays_a_target_call_before_drafting(variant, correct):
    # The authors' SI calls the target at draft count 0 too, synchronously, then after every k drafts: a window
    # costs t + m (k c + t), m = the calls with drafts until one rejects (paper: correct < d; bonus: correct <= d).
    t, c, k = 10.0, 1.0, 5
    s = setup(a=0.5, k=k, t=t, c=c, tokens=10**6, variant=variant)
    m = correct // k + 1 if not variant.bonus else -(-correct // k)
    run = online._Run()
    run.gained = 1  # not the first window: no drafter TTFT question
    assert online.si_window(s, run, correct) == (t + m * (k * c + t), False)
    assert run.gained == 1 + correct + variant.bonus


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(a=1.5), r"\(0, 1\]"),
        (dict(k=0), "lookahead 0"),
        (dict(servers=0), "servers 0"),
        (dict(t=0.0), "target_tpot_ms"),
    ],
)
def test_bad_setup_names_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        setup(**kwargs)
