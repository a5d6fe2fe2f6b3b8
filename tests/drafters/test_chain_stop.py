"""The adaptive rule's chain stop (drafters/adaptive.py, ChainStop): a draft model's chain goes on while the draft is
sure and ends at a draft it doubts, at costs injected here (never measured), with the real ModelDrafter over a
scripted model whose confidence is known at each position."""

import pytest
import torch

from paraspec.drafters import DraftPolicy, ModelDrafter
from paraspec.drafters.adaptive import (
    CONFIDENCE_EDGES,
    ChainStop,
    ForwardCost,
    confidence_bucket,
    confidence_prior,
)
from paraspec.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=64)
GEN = torch.Generator().manual_seed(0)
VERIFY = ForwardCost({1: 0.050, 2: 0.052, 4: 0.056, 8: 0.064, 16: 0.080, 32: 0.112})  # a GPU-like target
DRAFT = ForwardCost({1: 0.005, 64: 0.1})  # a 0.5B draft: 5 ms a token


def test_confidence_buckets_cover_every_probability():
    buckets = [confidence_bucket(m) for m in (0.0, 0.29, 0.3, 0.5, 0.94, 0.95, 0.999, 1.0)]
    assert buckets == sorted(buckets) and len(set(buckets)) == 6  # 0.999 and 1.0 share the top one
    for b in set(buckets):
        lo, hi = CONFIDENCE_EDGES[b - 1], CONFIDENCE_EDGES[b]
        assert lo < confidence_prior(b) < hi


def stop(mean=0.9, rate=None, pending=1, limit=40) -> ChainStop:
    # R: what a round of 4 drafts at `mean` buys per second, so the rule's own kind of rate
    if rate is None:
        tokens = sum(mean**j for j in range(5))
        rate = tokens / (4 * DRAFT(1) + VERIFY(pending + 4))
    return ChainStop(lambda m: m, mean, rate, VERIFY, DRAFT(1), pending, limit)


def test_sure_drafts_make_a_long_chain_and_a_doubted_one_ends_it():
    sure = stop()
    # a draft as sure as 0.995 is fed on for as long as its reach pays the next step at the round's rate
    fed = 0
    while sure.include(fed, 0.995) and sure.feed(fed) and fed < 40:
        fed += 1
    assert fed >= 16
    doubted = stop()
    assert doubted.include(0, 0.995) and doubted.feed(0)
    assert doubted.include(1, 0.3)  # its verification slot is cheap next to what it may bring
    assert not doubted.feed(1)  # but a step more after a 30% draft does not pay at this rate
    # the first draft is the round's k* > 0: included whatever its confidence
    assert stop().include(0, 0.01)


def test_the_rounds_rate_decides_what_a_draft_must_bring():
    """At a higher rate (what else the time would buy) a draft must be surer to be worth its step."""
    low, high = stop(rate=20.0), stop(rate=200.0)
    assert low.include(0, 0.6) and high.include(0, 0.6)
    assert low.feed(0) and not high.feed(0)


def test_a_step_in_the_cost_by_width_does_not_end_a_chain_that_pays_past_it():
    """A CPU's verification cost has steps (7 rows cost far more than 6, 16 little more than 7): after 5 sure drafts
    one step more does not pay by itself, but ten more do, so the chain goes on."""
    steps = ForwardCost({1: 0.060, 2: 0.097, 6: 0.115, 7: 0.150, 16: 0.160, 17: 0.200, 32: 0.300})
    chain = ChainStop(lambda m: m, 0.97, 22.0, steps, 0.023, 1, 32)
    for j in range(5):
        assert chain.include(j, 0.995)
    one_more = chain.rate * (steps(7) - steps(6) + chain.draft_s)
    assert chain.reach * chain.mean < one_more  # what a rule looking one draft ahead would stop at
    assert chain.feed(4)
    assert not ChainStop(lambda m: m, 0.97, 22.0, steps, 0.023, 1, 6).feed(4)  # a limit of 6 leaves one: it stops


class Scripted:
    """A draft model stand-in with a KV 'cache' (its length) whose next-token distribution is set by the last token
    fed: after token t the next is t + 1 with probability `sure` -- except after `doubt`, where it is t + 1 with
    probability 0.35 (the rest spread over the other ids)."""

    vocab_size = 16

    def __init__(self, doubt: int, sure: float = 0.998):
        self.doubt, self.sure, self.length, self.fed = doubt, sure, 0, []

    def forward(self, token_ids, last_n=1):
        self.length += len(token_ids)
        self.fed.append(len(token_ids))
        t = token_ids[-1]
        top = 0.35 if t == self.doubt else self.sure
        probs = torch.full((self.vocab_size,), (1 - top) / (self.vocab_size - 1))
        probs[(t + 1) % self.vocab_size] = top
        return probs.log().unsqueeze(0)

    def rollback(self, length):
        self.length = min(self.length, length)


def scripted_policy(doubt: int, mean: float = 0.95) -> tuple[DraftPolicy, ModelDrafter]:
    drafter = ModelDrafter(Scripted(doubt), 16)
    policy = DraftPolicy([drafter], ForwardCost(dict(VERIFY.seconds)), {0: ForwardCost(dict(DRAFT.seconds))})
    state = policy.stats(0)
    state.judged, state.accepted, state.tried = 40.0, 40.0 * mean, True  # a draft judged right 95% of the time
    return policy, drafter


def test_the_rule_drafts_through_sure_drafts_and_stops_after_the_doubted_one():
    """Drafts after 1: 2, 3, ... sure until the one after 6, where the draft doubts: the chain keeps that draft
    (its slot is cheap) and ends there, though 12 were allowed; the draft fed no token past it."""
    policy, drafter = scripted_policy(doubt=6)
    sequence = [0, 1]
    drafter.model.length = 1  # the draft has cached all but the last token
    proposal = policy.propose(sequence, 12, GREEDY, GEN, pending=1, remaining=100)
    assert policy.decisions[-1]["k"] > 0
    assert proposal.tokens == [2, 3, 4, 5, 6, 7]
    assert drafter.model.fed == [1] * 6  # the catch-up (token 1) and 5 drafts fed; 7 was never fed
    assert drafter.confidences == pytest.approx([0.998] * 5 + [0.35])
    # without the rule (fixed lengths) the same draft drafts all 12
    fixed_drafter = ModelDrafter(Scripted(doubt=6), 16)
    fixed_drafter.model.length = 1
    assert len(DraftPolicy([fixed_drafter]).propose(sequence, 12, GREEDY, GEN).tokens) == 12


def test_drafts_are_judged_by_their_confidence():
    """The target keeps the five sure drafts and rejects the doubted one: the sure bucket gains five accepted, the
    doubted bucket one rejected; the draft's acceptance at any position (bucket 0) counts all six. A chain the stop
    ended with every draft kept fails the slot after it in bucket 0 (what k* reads: a slot's chance to be drafted
    and kept), but not in its confidence buckets (they judge drafts made)."""
    policy, drafter = scripted_policy(doubt=6)
    drafter.model.length = 1
    proposal = policy.propose([0, 1], 12, GREEDY, GEN, pending=1, remaining=100)
    sure, doubted = confidence_bucket(0.998), confidence_bucket(0.35)
    before = {b: (policy.stats(0, b).judged, policy.stats(0, b).accepted) for b in (0, sure, doubted)}
    policy.accept(2, [0, 1, 2, 3, 4])
    policy.observe(len(proposal.tokens) + 1, VERIFY(7), proposal.tokens[:5] + [3])
    assert (policy.stats(0, sure).judged, policy.stats(0, sure).accepted) == (5, 5)
    assert (policy.stats(0, doubted).judged, policy.stats(0, doubted).accepted) == (1, 0)
    judged0, accepted0 = before[0]
    assert policy.stats(0, 0).judged == pytest.approx(0.9 * judged0 + 6)
    assert policy.stats(0, 0).accepted == pytest.approx(0.9 * accepted0 + 5)
    again = policy.propose([0, 1] + proposal.tokens[:5] + [3], 12, GREEDY, GEN, pending=1, remaining=90)  # 4 5 6 7
    judged0, accepted1 = policy.stats(0, 0).judged, policy.stats(0, 0).accepted
    sure_judged = policy.stats(0, sure).judged
    policy.accept(8, list(range(len(again.tokens))))
    policy.observe(len(again.tokens) + 1, VERIFY(len(again.tokens) + 1), again.tokens + [9])
    assert again.tokens == [4, 5, 6, 7] and policy.stats(0, 0).judged == pytest.approx(0.9 * judged0 + 5)
    assert policy.stats(0, 0).accepted == pytest.approx(0.9 * accepted1 + 4)
    assert policy.stats(0, sure).judged == pytest.approx(0.9 * sure_judged + 3)  # 4, 5, 6 (7: the doubted one)
    # the report names the confidence buckets
    assert {"model", f"model/confidence{CONFIDENCE_EDGES[sure - 1]:g}+"} <= set(policy.report()["alpha"])


def test_a_trial_drafts_its_length_whatever_the_confidence():
    """An untried draft's trial rounds draft their set length (1, 2, 4, ...) to be judged, without the stop."""
    drafter = ModelDrafter(Scripted(doubt=2), 16)
    drafter.model.length = 1
    policy = DraftPolicy([drafter], ForwardCost(dict(VERIFY.seconds)), {0: ForwardCost(dict(DRAFT.seconds))})
    policy.stats(0).trial_k = 4
    proposal = policy.propose([0, 1], 12, GREEDY, GEN, pending=1, remaining=100)
    assert policy.decisions[-1]["trial"] and len(proposal.tokens) == 4 and drafter.confidences == []


# -- sampling: a chain the stop cuts by its distributions still follows the target --------------------------------

V = 6


def table(top: dict[int, tuple[int, float]]) -> torch.Tensor:
    """[V, V] next-token probabilities by the last token: row t puts `p` on `x` for top[t] = (x, p), the rest evenly."""
    rows = torch.empty(V, V, dtype=torch.float64)
    for t, (x, p) in top.items():
        rows[t] = (1 - p) / (V - 1)
        rows[t, x] = p
    return rows


# the draft is sure after even tokens and unsure after odd ones (its chains stop at different lengths); the target
# agrees with it in places and not in others
DRAFT_TABLE = table({0: (1, 0.9), 1: (2, 0.4), 2: (3, 0.95), 3: (4, 0.35), 4: (5, 0.9), 5: (0, 0.45)})
TARGET_TABLE = table({0: (1, 0.7), 1: (3, 0.5), 2: (3, 0.8), 3: (4, 0.3), 4: (2, 0.6), 5: (0, 0.5)})


class TableModel:
    """A draft model stand-in drawing from DRAFT_TABLE by the last token fed."""

    vocab_size = V

    def __init__(self):
        self.length = 0

    def forward(self, token_ids, last_n=1):
        self.length += len(token_ids)
        return DRAFT_TABLE[token_ids[-1]].log().float().unsqueeze(0)

    def rollback(self, length):
        self.length = min(self.length, length)


def test_chains_cut_by_the_stop_sample_the_targets_joint():
    """Speculative sampling rounds whose chains the rule's stop cuts (up to 4 drafts, its decisions by each
    distribution's top probability): the first two committed tokens follow the target's exact joint over 20,000
    requests, and the chains had several lengths."""
    from scipy.stats import chisquare

    from paraspec.verify import verify_chain

    params = SamplingParams(max_new_tokens=2, temperature=1.0)
    gen = torch.Generator().manual_seed(3)
    drafter = ModelDrafter(TableModel(), V)
    policy = DraftPolicy([drafter], ForwardCost(dict(VERIFY.seconds)), {0: ForwardCost(dict(DRAFT.seconds))})
    state = policy.stats(0)
    state.judged, state.accepted, state.tried = 40.0, 28.0, True
    prompt, n = [0, 5], 20_000
    counts, lengths = torch.zeros(V, V), set()
    for _ in range(n):
        policy.reset()
        drafter.model.length = 1  # the draft has read the prompt but its last token
        sequence = list(prompt)
        while len(sequence) < len(prompt) + 2:
            proposal = policy.propose(sequence, 4, params, gen, pending=1, remaining=100)
            lengths.add(len(proposal.tokens))
            contexts = [sequence[-1]] + proposal.tokens
            logits = TARGET_TABLE[contexts].log().float()
            accepted, token = verify_chain(proposal.tokens, proposal.q, logits, params, gen)
            policy.accept(len(sequence), list(range(accepted)))
            committed = proposal.tokens[:accepted] + [token]
            policy.observe(len(proposal.tokens) + 1, VERIFY(len(proposal.tokens) + 1), committed)
            sequence += committed
        counts[sequence[2], sequence[3]] += 1
    p1 = TARGET_TABLE[prompt[-1]]
    joint = (p1[:, None] * TARGET_TABLE).numpy().ravel()
    assert len(lengths - {0}) >= 2  # the stop cut chains at several lengths
    assert chisquare(counts.numpy().ravel(), joint * n).pvalue > 1e-3
