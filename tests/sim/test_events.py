"""The event-driven simulator: agreement with the paper's model where that model is exact, Proposition 1, the
AMUSD limit, and the costs the paper leaves out (width, catch-up, messages, prefill, queueing)."""

import dataclasses
import math

import numpy as np
import pytest

from paraspec.sim import dsi_paper as paper
from paraspec.sim.costs import ForwardCost
from paraspec.sim.events import AMUSD_VERIFY_MESSAGES, CHUNK_MESSAGES, DRAFT_MESSAGES, Setup, simulate
from paraspec.trace import Trace
from tests.conftest import busy_s


def unit_setup(strategy, c, a, **kw):
    """The paper's idealisations: target forward = 1, drafter = c, any width, no messages, no prefill."""
    return Setup(strategy, ForwardCost.constant(1.0), ForwardCost.constant(c), a, **kw)


def totals(setup, tokens, runs, seed=0):
    return np.array([simulate(setup, tokens, seed + r).total_s for r in range(runs)])


def close_within_sampling_error(x: np.ndarray, y: np.ndarray, sigmas=4.0) -> bool:
    se = math.sqrt(x.var(ddof=1) / len(x) + y.var(ddof=1) / len(y))
    return abs(x.mean() - y.mean()) <= sigmas * se + 1e-9


def test_ar_is_one_forward_per_token():
    r = simulate(Setup("ar", ForwardCost.constant(0.25)), 40)
    assert r.total_s == pytest.approx(10.0)
    assert r.verifications == 40
    with_prefill = simulate(Setup("ar", ForwardCost.constant(0.25), target_prefill_s=2.0), 40)
    assert with_prefill.ttft_s == pytest.approx(2.0)
    assert with_prefill.total_s == pytest.approx(2.0 + 39 * 0.25)
    assert with_prefill.tpot_ms == pytest.approx(250.0)


@pytest.mark.parametrize("c,a,k", [(0.05, 0.5, 5), (0.3, 0.8, 3), (0.9, 0.3, 1), (0.2, 0.95, 10)])
def test_sd_agrees_with_the_papers_si(c, a, k):
    tokens = 500
    events = totals(unit_setup("sd", c, a, lookahead=k), tokens, runs=12)
    draws = paper.paper_draws(a, k, tokens, repeats=12)
    model = np.array([paper.si_rounds(d, k, tokens).cost(c) for d in draws])
    assert close_within_sampling_error(events, model)


@pytest.mark.parametrize("c,k", [(0.05, 5), (0.3, 2), (0.9, 1)])
def test_dsi_agrees_with_the_paper_at_the_edges(c, k):
    """a = 0: every draft is wrong and DSI runs at the target's pace; a = 1: the drafter's pace plus one
    verification."""
    servers = paper.servers_required(c, k) + 1
    for a in (0.0, 1.0):
        model = paper.simulate(c, a, k, tokens=300, repeats=1).dsi
        assert simulate(unit_setup("dsi", c, a, lookahead=k, servers=servers), 300).total_s == pytest.approx(model)


@pytest.mark.parametrize("c,a,k", [(0.05, 0.5, 5), (0.2, 0.8, 1), (0.5, 0.5, 1), (0.5, 0.95, 5), (0.9, 0.2, 5)])
def test_dsi_is_never_slower_than_the_papers_model(c, a, k):
    """With a server for its non-SI thread besides the ceil(1/(k c)) the paper counts, the event model's DSI is at
    most the paper's: the paper overcharges first-draft rejections and races speculation against non-SI per window,
    where the simulated non-SI thread's tokens also verify drafts."""
    servers = paper.servers_required(c, k) + 1
    events = totals(unit_setup("dsi", c, a, lookahead=k, servers=servers), 1000, runs=5)
    draws = paper.paper_draws(a, k, 1000, repeats=5)
    model = np.array([paper.dsi_windows(d, k, 1000).cost(c) for d in draws])
    se = math.sqrt(events.var(ddof=1) / 5 + model.var(ddof=1) / 5)
    assert events.mean() <= model.mean() + 3 * se + 1e-9
    assert events.mean() <= 1000 + 1e-9 and events.mean() <= paper.simulate(c, a, k).si


@pytest.mark.parametrize("c,a", [(0.1, 0.5), (0.3, 0.3), (0.6, 0.8), (0.05, 0.9)])
def test_dsi_meets_proposition1(c, a):
    """Two models, lookahead 1, enough servers: every token after the first costs the drafter's forward when its
    draft was accepted and the target's otherwise, so the mean time is Proposition 1's bound."""
    tokens, servers = 400, paper.servers_required(c, 1) + 1
    events = totals(unit_setup("dsi", c, a, lookahead=1, servers=servers), tokens, runs=24)
    bound = paper.proposition1_bound(c, 1.0, a, tokens)
    se = events.std(ddof=1) / math.sqrt(len(events))
    assert abs(events.mean() - bound) <= 4 * se


@pytest.mark.parametrize("a,m", [(0.5, 4), (0.8, 6), (0.95, 8)])
def test_amusd_with_an_instant_drafter_gains_the_mean_accepted_length_per_verification(a, m):
    """c -> 0: the verifier always has `max_ahead` drafts and is never idle, so time per token tends to
    verify latency / E[accepted + 1], with E[accepted + 1] = (1 - a^(m+1)) / (1 - a)."""
    setup = Setup("amusd", ForwardCost.constant(0.2), ForwardCost.constant(1e-6), a, max_ahead=m, verify_min=m)
    runs = [simulate(setup, 2000, seed) for seed in range(3)]
    per_token = np.mean([r.total_s / r.tokens for r in runs])
    assert per_token == pytest.approx(0.2 / paper.si_expected_tokens_per_round(a, m), rel=0.03)


def test_amusd_verifier_is_busy_when_the_drafter_is_fast():
    setup = Setup("amusd", ForwardCost.constant(1.0), ForwardCost.constant(0.01), 0.7, max_ahead=8)
    r = simulate(setup, 500)
    busy = busy_s(r.trace, "verify")
    assert busy == pytest.approx(r.verifications * 1.0)
    assert busy / r.total_s > 0.95
    assert r.tokens / r.verifications > 1.5  # and each verification gains several tokens


def test_amusd_overlaps_drafting_with_verification():
    """The point of AMUSD: with a drafter at half the target's cost, the asynchronous pair beats synchronous SD."""
    sd = totals(unit_setup("sd", 0.5, 0.8, lookahead=3), 400, runs=3).mean()
    amusd = totals(unit_setup("amusd", 0.5, 0.8, max_ahead=6), 400, runs=3).mean()
    assert amusd < 0.9 * sd


@pytest.mark.parametrize("preempt,per_token", [(True, 1.4), (False, 1.6)])
def test_amusd_rollback_with_and_without_preempting_the_drafter(preempt, per_token):
    """a = 0: every draft is wrong. Each token then costs one draft (0.4) and one verification (1.0) when the
    rollback cuts the drafter's forward short; without preemption the drafter, 2.5 forwards into the 1.0 s
    verification, first finishes the forward in flight (0.2 more): 1.6 per token, as paraspec's draft workers."""
    setup = Setup("amusd", ForwardCost.constant(1.0), ForwardCost.constant(0.4), 0.0, max_ahead=50, preempt=preempt)
    short, long = simulate(setup, 10), simulate(setup, 200)
    assert long.rollbacks == 199
    assert (long.total_s - short.total_s) / 190 == pytest.approx(per_token)


def test_forward_width_and_catch_up_cost_time():
    """A DSI server that last verified an older chunk re-reads every token since: forwards get wider with more
    servers, and with a per-token cost that makes the run slower than under the paper's constant cost."""
    base = dict(acceptance_rate=0.8, lookahead=2, servers=4)
    flat = simulate(Setup("dsi", ForwardCost.constant(1.0), ForwardCost.constant(0.2), **base), 300)
    widths = [e.tokens for e in flat.trace.events if e.kind == "verify"]
    assert max(widths) > 3  # catch-up beyond the chunk's k + 1 tokens
    wide = simulate(Setup("dsi", ForwardCost.linear(1.0, 0.1), ForwardCost.linear(0.2, 0.1), **base), 300)
    assert wide.total_s > flat.total_s * 1.02


@pytest.mark.parametrize(
    "strategy,kw", [("sd", {"lookahead": 4}), ("amusd", {"max_ahead": 6}), ("dsi", {"lookahead": 2, "servers": 4})]
)
def test_messages_and_prefill_cost_time(strategy, kw):
    plain = totals(unit_setup(strategy, 0.2, 0.7, **kw), 200, runs=3).mean()
    slow = totals(unit_setup(strategy, 0.2, 0.7, comm_s=0.05, **kw), 200, runs=3).mean()
    assert slow > plain * 1.01
    r = simulate(unit_setup(strategy, 0.2, 0.7, target_prefill_s=5.0, draft_prefill_s=1.0, **kw), 200)
    assert r.ttft_s == pytest.approx(5.0)
    assert r.trace.progress[0] == (5.0, 1)
    assert sum(e.kind == "prefill" for e in r.trace.events) == (kw.get("servers", 1) + 1)


def test_too_few_servers_queue():
    """c = 0.05, k = 2 needs 10 servers; with 1 the chunks queue and DSI is much slower."""
    enough = totals(unit_setup("dsi", 0.05, 0.9, lookahead=2, servers=11), 500, runs=2).mean()
    one = totals(unit_setup("dsi", 0.05, 0.9, lookahead=2, servers=1), 500, runs=2).mean()
    assert one > 1.5 * enough


@pytest.mark.parametrize(
    "strategy,kw",
    [("ar", {}), ("sd", {"lookahead": 3}), ("amusd", {"max_ahead": 4}), ("dsi", {"lookahead": 3, "servers": 3})],
)
def test_trace_is_the_engines_format(strategy, kw):
    r = simulate(unit_setup(strategy, 0.3, 0.6, **kw), 120, seed=3)
    assert isinstance(r.trace, Trace)
    assert {e.kind for e in r.trace.events} <= {"prefill", "draft", "verify", "rollback", "idle", "wait"}
    assert all(e.end_s >= e.start_s for e in r.trace.events)
    times = [t for t, _ in r.trace.progress]
    counts = [n for _, n in r.trace.progress]
    assert times == sorted(times) and counts == sorted(counts)
    assert r.trace.progress[-1] == (pytest.approx(r.total_s), 120)
    assert Trace.from_dict(r.trace.to_dict()).events == r.trace.events
    assert r.accepted <= r.drafts
    # a device never runs two forwards at once
    for device in {e.device for e in r.trace.events}:
        spans = sorted(
            (e.start_s, e.end_s) for e in r.trace.events if e.device == device and e.kind in ("draft", "verify")
        )
        assert all(s2 >= e1 - 1e-12 for (_, e1), (s2, _) in zip(spans, spans[1:]))


def test_dsi_servers_without_preemption_finish_their_forward_first():
    """preempt=False (paraspec's workers): a rollback leaves a server busy until its forward ends. Without
    rollbacks (a = 1) nothing changes; with them it costs time, and every cut-off forward runs its full length."""
    kw = dict(lookahead=2, servers=3, target_only_thread=False)
    assert (
        simulate(unit_setup("dsi", 0.2, 1.0, **kw), 100).total_s
        == simulate(unit_setup("dsi", 0.2, 1.0, preempt=False, **kw), 100).total_s
    )
    cut = totals(unit_setup("dsi", 0.2, 0.5, **kw), 100, runs=20)
    whole = totals(unit_setup("dsi", 0.2, 0.5, preempt=False, **kw), 100, runs=20)
    assert whole.mean() > 1.02 * cut.mean()
    r = simulate(unit_setup("dsi", 0.2, 0.5, preempt=False, **kw), 100)
    assert all(e.end_s - e.start_s >= 1.0 - 1e-9 for e in r.trace.events if e.kind == "verify")
    assert any(
        e.end_s - e.start_s < 1.0 - 1e-9
        for e in simulate(unit_setup("dsi", 0.2, 0.5, **kw), 100).trace.events
        if e.kind == "verify"
    )


def test_random_setups_always_finish_and_never_double_book_a_device():
    rng = np.random.default_rng(0)
    for i in range(60):
        strategy = str(rng.choice(["ar", "sd", "amusd", "dsi"]))
        k = int(rng.integers(1, 6))
        setup = Setup(
            strategy,
            ForwardCost.linear(1.0, float(rng.choice([0, 0.05]))),
            ForwardCost.linear(float(rng.uniform(0.01, 1.0)), 0.02),
            float(rng.choice([0, 1, rng.random()])),
            lookahead=k,
            servers=int(rng.integers(1, 5)),
            max_ahead=int(rng.integers(k, 10)),
            verify_min=int(rng.integers(1, 4)),
            comm_s=float(rng.choice([0, 0.05])),
            target_prefill_s=float(rng.choice([0, 2.0])),
            target_only_thread=bool(rng.random() < 0.7),
            preempt=bool(rng.random() < 0.5),
        )
        tokens = int(rng.integers(1, 60))
        r = simulate(setup, tokens, seed=i)
        assert r.trace.progress[-1][1] == tokens
        for device in {e.device for e in r.trace.events}:
            spans = sorted(
                (e.start_s, e.end_s) for e in r.trace.events if e.device == device and e.kind in ("draft", "verify")
            )
            assert all(s2 >= e1 - 1e-9 for (_, e1), (s2, _) in zip(spans, spans[1:])), (setup, device)


def test_deterministic_for_a_seed():
    setup = unit_setup("dsi", 0.2, 0.7, lookahead=3, servers=3)
    assert simulate(setup, 200, seed=5).total_s == simulate(setup, 200, seed=5).total_s
    assert simulate(setup, 200, seed=5).total_s != simulate(setup, 200, seed=6).total_s


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(strategy="beam", target=ForwardCost.constant(1.0)), "unknown strategy 'beam'"),
        (dict(strategy="sd", target=ForwardCost.constant(1.0)), "needs a draft forward cost"),
        (
            dict(strategy="dsi", target=ForwardCost.constant(1.0), draft=ForwardCost.constant(0.1), servers=0),
            "servers 0 must be >= 1",
        ),
        (
            dict(strategy="sd", target=ForwardCost.constant(1.0), draft=ForwardCost.constant(0.1), acceptance_rate=1.5),
            r"must be in \[0, 1\]",
        ),
        (
            dict(
                strategy="dsi",
                target=ForwardCost.constant(1.0),
                draft=ForwardCost.constant(0.1),
                lookahead=4,
                max_ahead=3,
            ),
            "would never fill",
        ),
    ],
)
def test_bad_setup(kw, match):
    with pytest.raises(ValueError, match=match):
        Setup(**kw)


# -- workers on other nodes: the link latency ------------------------------------------------------------------


def _remote_dsi(a: float, link_s: float, remote: int = 1, **kw) -> "Setup":
    return Setup(
        "dsi",
        target=ForwardCost.constant(0.1),
        draft=ForwardCost.constant(0.001),
        acceptance_rate=a,
        lookahead=4,
        servers=1,
        preempt=False,
        link_s=link_s,
        remote_servers=remote,
        target_only_thread=False,
        **kw,
    )


@pytest.mark.parametrize("a", [0.0, 1.0])
def test_a_remote_server_pays_a_request_and_a_reply_per_verification(a):
    """One server, the bottleneck (the drafter is 100x faster): every verification takes 2 link latencies longer,
    by hand: CHUNK_MESSAGES x link_s."""
    near, far = simulate(_remote_dsi(a, 0.0), 50, seed=0), simulate(_remote_dsi(a, 0.01), 50, seed=0)
    assert near.verifications == far.verifications
    assert far.total_s - near.total_s == pytest.approx(far.verifications * sum(CHUNK_MESSAGES) * 0.01)


def test_a_remote_verifiers_verdict_lands_before_its_last_messages():
    """amusd's remote verifier: the drafter rolls back when the commit lands (the verification's end in the trace),
    and the verifier starts its next verification only after the messages that follow the commit."""
    link = 0.01
    before, after = AMUSD_VERIFY_MESSAGES
    setup = Setup(
        "amusd",
        target=ForwardCost.constant(0.1),
        draft=ForwardCost.constant(0.001),
        acceptance_rate=0.3,
        lookahead=3,
        preempt=False,
        link_s=link,
        remote_servers=1,
    )
    trace = simulate(setup, 40, seed=1).trace
    verifies = sorted((e.start_s, e.end_s) for e in trace.events if e.kind == "verify")
    rollbacks = [e.start_s for e in trace.events if e.kind == "rollback"]
    assert rollbacks and all(any(end == pytest.approx(t) for _, end in verifies) for t in rollbacks)
    assert all(end - start == pytest.approx(0.1 + before * link) for start, end in verifies)
    assert all(nxt[0] - prev[1] >= after * link - 1e-12 for prev, nxt in zip(verifies, verifies[1:]))


def test_a_link_costs_nothing_where_nothing_crosses_it():
    for strategy in ("amusd", "dsi"):
        base = Setup(
            strategy,
            target=ForwardCost.constant(0.05),
            draft=ForwardCost.constant(0.01),
            acceptance_rate=0.7,
            lookahead=3,
            servers=2 if strategy == "dsi" else 1,
            preempt=False,
        )
        linked = dataclasses.replace(base, link_s=0.02)
        assert simulate(base, 60, seed=3).total_s == simulate(linked, 60, seed=3).total_s


def test_a_remote_drafter_pays_its_messages_per_token():
    """Every draft forward of a remote drafter lasts DRAFT_MESSAGES links longer; a local one pays nothing."""
    setup = Setup(
        "amusd",
        target=ForwardCost.constant(0.001),
        draft=ForwardCost.constant(0.05),
        acceptance_rate=1.0,
        preempt=False,
        link_s=0.002,
    )
    for remote, extra in ((False, 0.0), (True, DRAFT_MESSAGES["amusd"] * 0.002)):
        trace = simulate(dataclasses.replace(setup, remote_draft=remote), 40, seed=0).trace
        drafts = [e.end_s - e.start_s for e in trace.events if e.kind == "draft"]
        assert drafts and all(d == pytest.approx(0.05 + extra) for d in drafts)


def test_remote_placement_is_checked():
    with pytest.raises(ValueError, match="remote_servers"):
        _remote_dsi(0.5, 0.01, remote=2)
    with pytest.raises(ValueError, match="no remote drafter or server"):
        Setup("sd", target=ForwardCost.constant(0.1), draft=ForwardCost.constant(0.01), remote_draft=True)
    with pytest.raises(ValueError, match=">= 0"):
        _remote_dsi(0.5, -0.001)
