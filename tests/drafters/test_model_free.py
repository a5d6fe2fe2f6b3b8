"""The model-free drafters (prompt lookup, suffix tries), the hybrid order and the adaptive draft length rule, on
hand-made sequences; point-mass acceptance against the target distribution (chi-square)."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from paraspec import SamplingParams
from paraspec.drafters import DraftPolicy, NGramDrafter, Proposal, SuffixDrafter
from paraspec.drafters import policy as policy_module
from paraspec.drafters.adaptive import (
    PROBE_SHARE,
    PROBE_START,
    SOURCE_STRIDE,
    TRIAL_REMAINING,
    Acceptance,
    ForwardCost,
    Load,
    best_length,
    bucket_label,
    calibration_widths,
    catch_up_pays,
    expected_tokens,
    match_bucket,
)
from paraspec.drafters.base import Drafter
from paraspec.drafters.policy import prune
from paraspec.drafters.suffix import SuffixTrie
from paraspec.verify import point_mass_accept, verify_chain, verify_tree

GREEDY = SamplingParams()
GEN = torch.Generator().manual_seed(0)


def ngram(sequence, k=5, lo=1, hi=3, vocab=100):
    return NGramDrafter(vocab, lo, hi).propose(sequence, k, GREEDY, GEN).tokens


# -- prompt lookup ---------------------------------------------------------------------------------------------


def test_ngram_longest_match_wins():
    # "7 8" occurred followed by 1, 2; "9 7 8" occurred (later-ending shorter match elsewhere) followed by 3, 4
    sequence = [9, 7, 8, 3, 4, 0, 5, 7, 8, 1, 2, 0, 9, 7, 8]
    assert ngram(sequence, k=2, lo=1, hi=3) == [3, 4]  # the 3-gram (9 7 8) beats the 2-gram's latest (1 2)
    assert ngram(sequence, k=2, lo=1, hi=2) == [1, 2]  # up to 2-grams: the most recent occurrence of (7 8)


def test_ngram_no_match_proposes_nothing_and_respects_min():
    assert ngram([1, 2, 3, 4, 5]) == []
    sequence = [1, 2, 3, 4, 2]  # only a 1-gram match (2 -> 3)
    assert ngram(sequence, lo=1) == [3, 4, 2] and ngram(sequence, lo=2) == []


def test_ngram_proposal_length_and_growth():
    drafter = NGramDrafter(100, 2, 3)
    sequence = [5, 6, 7, 8, 9, 5, 6]
    assert drafter.propose(sequence, 2, GREEDY, GEN).tokens == [7, 8]
    assert drafter.propose(sequence, 10, GREEDY, GEN).tokens == [7, 8, 9, 5, 6]  # runs to the end of the text
    assert drafter.propose(sequence + [7], 3, GREEDY, GEN).tokens == [8, 9, 5]  # extended incrementally
    assert drafter.propose([1, 2, 1], 3, GREEDY, GEN).tokens == []  # a new sequence: index rebuilt
    assert drafter.propose([1, 2, 1, 2], 0, GREEDY, GEN).tokens == []


def test_ngram_q_is_none_under_sampling():
    """A deterministic proposal's q is its point masses, which acceptance reads from q = None (no one-hot)."""
    p = NGramDrafter(10, 1, 2).propose([1, 2, 3, 1, 2], 2, SamplingParams(temperature=1.0), GEN)
    assert p.tokens == [3, 1] and p.q is None


# -- suffix tries ----------------------------------------------------------------------------------------------


def test_suffix_trie_counts_and_removal():
    trie = SuffixTrie(depth=3)
    trie.add([1, 2, 1, 2])
    node, n = trie.match([5, 1, 2], longest=2)
    assert n == 2 and node.count == 2 and {t: c.count for t, c in node.children.items()} == {1: 1}
    before = trie.size()
    trie.add([7, 8, 9])
    trie.add([7, 8, 9], sign=-1)
    assert trie.size() == before and trie.match([7], 2) == (None, 0)


def test_suffix_most_frequent_continuation_wins():
    sequence = [1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 4, 0, 1, 2]
    drafter = SuffixDrafter(100, depth=8, cache_requests=0)
    assert drafter.propose(sequence, 2, GREEDY, GEN).tokens == [4, 0]


def test_suffix_cache_is_shared_across_requests_and_bounded():
    drafter = SuffixDrafter(100, depth=8, cache_requests=2)
    outputs = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]
    for i, out in enumerate(outputs):
        drafter.reset()
        drafter.propose([99, i], 1, GREEDY, GEN)  # the request's prompt
        drafter.finish([99, i] + out)
    drafter.reset()
    assert drafter.propose([5, 5, 20, 21], 2, GREEDY, GEN).tokens == [22, 23]  # an earlier request's output
    assert drafter.propose([5, 5, 30, 31], 2, GREEDY, GEN).tokens == [32, 33]
    assert drafter.propose([5, 5, 10, 11], 2, GREEDY, GEN).tokens == []  # evicted: the cache holds 2
    assert len(drafter.cached) == 2
    # the cache holds exactly what the two kept outputs put there
    fresh = SuffixTrie(8)
    fresh.add(outputs[1])
    fresh.add(outputs[2])
    assert drafter.cache.size() == fresh.size()


def test_suffix_tree_branches_ordered_by_frequency():
    sequence = [7, 2, 0, 7, 2, 1, 7, 2, 5, 7, 3, 6, 7, 3, 8, 7, 1, 9, 7]  # the longest earlier match is "7" alone
    tree = SuffixDrafter(100, depth=6, cache_requests=0).propose_tree(sequence, 3, 2, 10, GREEDY, GEN)
    roots = [t for t, p in zip(tree.tokens, tree.parents) if p == -1]
    assert roots == [2, 3, 1]  # 3, 2 and 1 occurrences after "7"
    assert all(tree.depths[i] == 2 for i, p in enumerate(tree.parents) if p != -1)
    assert not tree.draft_probs  # deterministic: point masses


def test_suffix_drops_improbable_paths():
    sequence = [7, 1, 7, 2, 7, 3, 7, 4, 7, 5, 7, 6, 7, 8, 7, 9, 7, 10, 7, 11, 7, 12, 7]  # after 7: 11 continuations
    assert SuffixDrafter(100, depth=4, cache_requests=0).propose(sequence, 3, GREEDY, GEN).tokens == []


def test_suffix_stops_where_the_path_probability_falls_below_the_minimum():
    """After the context "0 5" (4 times): 6 always (probability 1), then 7 three times in four (0.75)."""
    sequence = [0, 5, 6, 7, 0, 5, 6, 7, 0, 5, 6, 7, 0, 5, 6, 8, 0, 5]

    def proposal(min_prob):
        drafter = SuffixDrafter(100, depth=4, cache_requests=0, factor=0, min_prob=min_prob, memory=False)
        return drafter.propose(sequence, 8, GREEDY, GEN).tokens

    assert proposal(0.8) == [6]
    assert proposal(0.75) == proposal(0.5) == [6, 7]
    assert proposal(1.0) == [6]


def test_suffix_proposal_is_at_most_factor_times_the_match():
    sequence = list(range(10, 40)) + [10, 11]  # a 2-token match, then 28 tokens to copy

    def proposal(factor, k=16):
        drafter = SuffixDrafter(100, depth=32, cache_requests=0, factor=factor, memory=False)
        tokens = drafter.propose(sequence, k, GREEDY, GEN).tokens
        assert drafter.last_match == 2
        return tokens

    assert proposal(1.0) == [12, 13]
    assert proposal(2.5) == [12, 13, 14, 15, 16]  # ceil(2.5 x 2)
    assert proposal(0.0) == list(range(12, 28)) == proposal(100.0)  # no cap: k = 16
    assert proposal(0.1) == [12]  # at least one token
    tree = SuffixDrafter(100, depth=32, cache_requests=0, factor=1.5).propose_tree(sequence, 2, 10, 20, GREEDY, GEN)
    assert tree.depth == 3


def test_suffix_chain_copies_past_the_trie_depth():
    """A copy longer than the trie's depth: after a match as long as the trie sees (depth // 2), the chain runs to
    the depth, then continues as the text did after the latest occurrence of its last 8 tokens, up to k; without
    such a long match it stays within the depth and the factor."""
    span = [int(t) for t in np.random.default_rng(3).permutation(np.arange(10, 90))]  # 80 distinct tokens
    sequence = span + [1, 2] + span[:20]  # the span copied again: a 20-token earlier match
    drafter = SuffixDrafter(100, depth=16, cache_requests=0, factor=1.0, memory=False)
    tokens = drafter.propose(sequence, 40, GREEDY, GEN).tokens
    assert drafter.last_match == 8 and tokens == span[20:60]  # 8 from the trie, 32 copied
    assert drafter.propose(sequence, 5, GREEDY, GEN).tokens == span[20:25]  # never more than k
    short = span + [1, 2] + span[:5]  # a 5-token match: the factor caps it at 5
    assert (
        SuffixDrafter(100, depth=16, cache_requests=0, factor=1.0, memory=False).propose(short, 40, GREEDY, GEN).tokens
        == span[5:10]
    )
    uncapped = SuffixDrafter(100, depth=16, cache_requests=0, factor=0, memory=False)
    assert uncapped.propose(short, 40, GREEDY, GEN).tokens == span[5:45]  # no factor: 11 from the trie, 29 copied
    edited = span + [1, 2] + span[:20] + [3]  # an edit: nothing earlier continues it
    assert SuffixDrafter(100, depth=16, cache_requests=0, memory=False).propose(edited, 40, GREEDY, GEN).tokens == []


def test_memory_cuts_a_pattern_where_its_last_proposal_went_wrong():
    """ngram: "1 2" was followed by 3 4 5 6; the target wrote 3 4 7 after it. The same pattern continued the same
    way is cut to the 2 tokens that were right; continued otherwise (a later occurrence), it is not cut."""
    drafter = NGramDrafter(100, 2, 2, memory=True)
    first = [1, 2, 3, 4, 5, 6, 0, 1, 2]
    assert drafter.propose(first, 4, GREEDY, GEN).tokens == [3, 4, 5, 6]
    drafter.committed(len(first), [3, 4, 7])  # right for 2, then the target took 7 not 5
    assert drafter.memory.last[(1, 2)] == ([3, 4, 5, 6], 2, False)
    again = [1, 2, 3, 4, 5, 6, 0, 9, 9, 1, 2]  # a new request with the same text and pattern
    drafter.reset()
    assert drafter.propose(again, 4, GREEDY, GEN).tokens == [3, 4, 5, 6]  # reset: forgotten
    drafter.committed(len(again), [3, 4, 7])
    later = again + [3, 4, 7, 8, 1, 2]  # "1 2" again: its latest continuation, 3 4 7 8,
    assert drafter.propose(later, 4, GREEDY, GEN).tokens == [3, 4, 7, 8]  # differs at the wrong token: no cut
    drafter.committed(len(later), [9])  # wrong from the first token on
    same = later + [9, 1, 2, 3, 4, 7, 8, 1, 2]  # "1 2" continued by 3 4 7 8 once more
    assert drafter.propose(same, 4, GREEDY, GEN).tokens == []  # the same continuation: cut to 0 tokens
    without = NGramDrafter(100, 2, 2, memory=False)
    without.propose(later, 4, GREEDY, GEN)
    without.committed(len(later), [9])
    assert without.propose(same, 4, GREEDY, GEN).tokens == [3, 4, 7, 8]


def test_memory_judges_only_the_round_after_its_proposal():
    drafter = NGramDrafter(100, 2, 2, memory=True)
    sequence = [1, 2, 3, 4, 5, 0, 1, 2]
    drafter.propose(sequence, 3, GREEDY, GEN)
    drafter.committed(len(sequence) + 1, [9])  # not the sequence it continued: ignored
    drafter.committed(len(sequence), [])  # nothing committed: ignored
    assert drafter.memory.last == {}
    drafter.committed(len(sequence), [3, 4])  # right as far as it was checked
    assert drafter.memory.last[(1, 2)] == ([3, 4, 5], 2, True)
    drafter.committed(len(sequence), [9])  # judged once
    assert drafter.memory.last[(1, 2)][1:] == (2, True)


def test_memory_lets_a_suffix_pattern_that_was_right_run_past_the_factor():
    sequence = list(range(10, 40)) + [10, 11]
    drafter = SuffixDrafter(100, depth=32, cache_requests=0, factor=1.0, memory=True)
    assert drafter.propose(sequence, 8, GREEDY, GEN).tokens == [12, 13]  # 2-token match, factor 1
    drafter.committed(len(sequence), [12, 13, 14])  # right beyond what was drafted
    again = sequence + [12, 13, 14, 50, 10, 11]  # "10 11" once more
    assert drafter.propose(again, 8, GREEDY, GEN).tokens == [12, 13, 14, 15, 16, 17, 18, 19]  # extended
    drafter.committed(len(again), [12, 13, 99])
    third = again + [12, 13, 99, 51, 10, 11]
    assert drafter.propose(third, 8, GREEDY, GEN).tokens == [12, 13]  # cut where it went wrong


# -- hybrid and adaptive length --------------------------------------------------------------------------------


class Fixed(Drafter):
    def __init__(self, name, tokens, free):
        self.name, self.tokens, self.free, self.asked = name, tokens, free, []

    def propose(self, sequence, k, params, generator):
        self.asked.append(k)
        return Proposal(self.tokens[:k])


def test_hybrid_falls_back_to_the_next_drafter():
    empty, model = Fixed("ngram", [], True), Fixed("model", [4, 5, 6], False)
    policy = DraftPolicy([empty, model])
    assert policy.propose([1], 2, GREEDY, GEN).tokens == [4, 5]
    first = Fixed("ngram", [9], True)
    assert DraftPolicy([first, model]).propose([1], 2, GREEDY, GEN).tokens == [9]


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def flat(width):
    return 0.05


def linear(width):
    return 0.05 * width


def test_adaptive_rule_zero_acceptance_drafts_nothing():
    assert best_length(0.0, 0.0, flat, 1, 16)[0] == 0
    assert best_length(0.0, 0.02, linear, 1, 16)[0] == 0


def test_adaptive_rule_full_acceptance_flat_cost_drafts_the_most():
    assert best_length(1.0, 0.0, flat, 1, 16)[0] == 16
    assert best_length(0.999, 0.0, flat, 1, 12)[0] == 12


def test_forward_costs_are_measured_within_a_small_context():
    """An engine with max_context 24 (sd's default is adaptive) times its widths in what the context holds: a
    shorter prefix, and the widths that would not fit left out, rather than failing at start-up."""

    class Model:  # records the forwards: what a model with 24 positions accepts
        vocab_size, max_context, device = 50, 24, None

        def __init__(self):
            self.cached, self.forwards = 0, []

        def rollback(self, n):
            self.cached = min(self.cached, n)

        def forward(self, tokens, last_n=1):
            assert tokens and self.cached + len(tokens) <= self.max_context, "context full"
            self.cached += len(tokens)
            self.forwards.append(len(tokens))

    model = Model()
    cost = ForwardCost.measure(model, calibration_widths(32))
    fitting = [w for w in calibration_widths(32) if w < 24]
    assert sorted(cost.seconds) == fitting and model.cached == 0
    assert model.forwards[0] == 24 - fitting[-1]  # the prefix: what the widest width that fits leaves
    model = Model()
    model.max_context = 4096
    assert sorted(ForwardCost.measure(model, [1, 8]).seconds) == [1, 8] and model.forwards[0] == 32


def test_start_up_times_a_short_forward_twice_and_a_long_one_once(monkeypatch):
    """The rule's start-up timing: a forward under REPEAT_UNDER_S is timed again and the faster kept; a longer
    one is timed once (start-up time). The clock is the model's own: each forward advances it by its cost."""
    import types

    from paraspec.drafters import adaptive

    class Model:
        vocab_size, max_context, device = 50, 4096, None

        def __init__(self):
            self.now, self.cached, self.forwards, self.rows_out = 0.0, 0, [], []

        def rollback(self, n):
            self.cached = min(self.cached, n)

        def forward(self, tokens, last_n=1):
            self.cached += len(tokens)
            self.forwards.append(len(tokens))
            self.rows_out.append(last_n)
            # 0.04 s a token, and the first forward of a width 10 ms slower (a first call's allocation)
            self.now += 0.04 * len(tokens) + (0.01 if self.forwards.count(len(tokens)) == 1 else 0.0)

    model = Model()
    monkeypatch.setattr(adaptive, "time", types.SimpleNamespace(perf_counter=lambda: model.now))
    cost = ForwardCost.measure(model, adaptive.DRAFT_WIDTHS)
    timed = model.forwards[1:]  # after the prefix
    short = [w for w in adaptive.DRAFT_WIDTHS if 0.04 * w + 0.01 < adaptive.REPEAT_UNDER_S]
    assert short == [1, 2, 4] and all(timed.count(w) == (2 if w in short else 1) for w in adaptive.DRAFT_WIDTHS)
    assert cost.seconds[1] == pytest.approx(0.04) and cost.seconds[16] == pytest.approx(0.65)  # fastest; once
    assert cost(128) == pytest.approx(0.04 * 128 + 0.01)  # beyond the widths: extrapolated from 16 and 64
    assert model.rows_out[1:] == model.forwards[1:]  # a verification's widths: every row's logits
    model = Model()
    ForwardCost.measure(model, adaptive.DRAFT_WIDTHS, last_only=True)
    assert set(model.rows_out) == {1}  # a draft's catch-ups and drafts: the last row's


def test_adaptive_rule_prompt_round_pays_at_the_margin():
    """With 400 pending prompt tokens the ratio would favour any draft; the margin rule drafts only when the
    expected extra tokens are worth their extra verification."""
    cost = ForwardCost({1: 0.05, 2: 0.1, 8: 0.25, 16: 0.45})
    assert best_length(0.5, 0.0, cost, 400, 12)[0] == 0
    assert best_length(0.99, 0.0, cost, 400, 12)[0] == 12


def test_adaptive_rule_compute_bound_verification():
    """This CPU's llama.cpp profile (ms by width 1/2/4/6/8/16: 57/116/165/223/270/482, interpolated): a draft model
    at 23 ms a token pays only with high acceptance; a free drafter pays earlier."""
    cost = ForwardCost({1: 0.057, 2: 0.116, 4: 0.165, 6: 0.223, 8: 0.270, 16: 0.482})
    assert best_length(0.5, 0.023, cost, 1, 16)[0] == 0
    assert best_length(0.95, 0.0, cost, 1, 16)[0] > 4
    assert cost(3) == pytest.approx((0.116 + 0.165) / 2) and cost(32) > cost(16)


def test_adaptive_rule_priced_by_the_batch_rows():
    """Many requests at once: a verification shares its step with the others' rows. Where rows cost compute (the
    same CPU profile, three other requests verifying 4 rows each), each extra draft row slows all of them: k shrinks,
    and grows back when they leave; where rows are almost free (a GPU's small forwards) drafts stay long."""
    cpu = ForwardCost({1: 0.057, 2: 0.116, 4: 0.165, 6: 0.223, 8: 0.270, 16: 0.482})
    alone = best_length(0.8, 0.0, cpu, 1, 16)[0]
    busy = best_length(0.8, 0.0, cpu, 1, 16, Load((4, 4, 4)))[0]
    assert 0 <= busy < alone and best_length(0.8, 0.0, cpu, 1, 16, Load())[0] == alone
    gpu = ForwardCost({1: 0.0060, 8: 0.0063, 16: 0.0066, 32: 0.0072})
    assert best_length(0.8, 0.0, gpu, 1, 16, Load((4, 4, 4)))[0] >= 8 > busy  # still long drafts there
    # a prompt round pays at the margin whatever shares it
    assert best_length(0.99, 0.0, cpu, 400, 12, Load((4, 4, 4))) == best_length(0.99, 0.0, cpu, 400, 12)


def test_a_draft_models_rounds_under_load_are_priced_as_the_drafting_requests_drafting_together():
    """Under a Scheduler the draft model's asks run in steps of their own: the requests that draft (their last
    verification had drafts) do so in the same steps and verify in one forward, the ones decoding plainly wait
    out the draft steps. Where rows cost compute (this Zen 4's profile, ms by width) a draft beside plainly
    decoding requests holds them back and does not pay, and among drafting requests a wider verification is
    cheaper per row than narrow ones, so drafting pays at high acceptance only; where rows are nearly free (a
    GPU's) they draft as a request alone would. A model-free drafter's drafts take no step. Costs injected."""
    cpu = ForwardCost({1: 0.041, 2: 0.071, 4: 0.120, 6: 0.185, 8: 0.263, 16: 0.337, 24: 0.478})
    plain, drafting = Load((1, 1, 1)), Load((4, 4, 4))
    draft_step = lambda n: 0.013 + 0.004 * (n - 1)  # noqa: E731 -- the draft's step of n one-token rows
    assert best_length(1.0, 0.013, cpu, 1, 5)[0] > 0  # alone, every draft right: drafting pays
    assert best_length(0.95, 0.013, cpu, 1, 5, plain, draft_step=draft_step)[0] == 0
    assert best_length(0.8, 0.013, cpu, 1, 5, drafting, draft_step=draft_step)[0] == 0
    k, rate = best_length(0.95, 0.013, cpu, 1, 5, drafting, draft_step=draft_step)
    assert k > 0 and rate == pytest.approx(4 * expected_tokens(0.95, k) / (k * draft_step(4) + cpu(4 * (1 + k))))
    assert rate > 4 / cpu(4)  # the four decoding plainly: one 4-row step a token each
    # two drafting, one plain: mine and theirs k + 1 rows each, the plain request's one row, in one forward
    k, rate = best_length(0.95, 0.013, cpu, 1, 5, Load((4, 1, 4)), draft_step=draft_step)
    assert rate == pytest.approx((3 * expected_tokens(0.95, k) + 1) / (k * draft_step(3) + cpu(3 * (1 + k) + 1)))
    assert best_length(1.0, 0.0, cpu, 1, 16, plain)[0] > 0  # free drafts: the others decode beside them
    gpu = ForwardCost({1: 0.0060, 8: 0.0063, 16: 0.0066, 32: 0.0072})
    assert best_length(0.9, 0.001, gpu, 1, 5)[0] == best_length(0.9, 0.001, gpu, 1, 5, drafting)[0] == 5
    # another request's prompt chunk runs in the verification's step, not in the draft steps: a round pays it once
    assert best_length(0.9, 0.005, cpu, 1, 5, Load(apart=(64,)))[0] >= best_length(0.9, 0.005, cpu, 1, 5)[0] > 0
    assert best_length(1.0, 0.0, cpu, 1, 16, Load(apart=(64,)))[0] > 0


def test_a_step_is_priced_by_the_forwards_the_model_runs_it_as():
    """llama.cpp runs sequences of unequal widths in several micro-batches (step_forwards): a free drafter's long
    draft beside one-token rows costs a forward more, so it drafts less than one forward of all the rows would
    suggest."""
    from paraspec.models.llamacpp.model import LlamaCppModel

    class Context:  # the split needs only n_batch
        n_batch = 512

    def split(widths):
        return LlamaCppModel.step_forwards(Context, widths)

    assert split([1, 3, 6, 6]) == [4, 6, 6] and split([6, 6, 6, 6]) == [24] and split([1, 1, 1, 6]) == [4, 5]
    assert split([300, 300]) == [512, 88] and split([]) == []
    cpu = ForwardCost({1: 0.041, 2: 0.071, 4: 0.120, 6: 0.185, 8: 0.263, 16: 0.337, 24: 0.478})
    whole = best_length(0.95, 0.0, cpu, 1, 16, Load((1, 1, 1)))
    parts = best_length(0.95, 0.0, cpu, 1, 16, Load((1, 1, 1)), split=split)
    assert parts[0] < whole[0] and parts[1] < whole[1]
    assert best_length(0.95, 0.0, cpu, 1, 16, split=split) == best_length(0.95, 0.0, cpu, 1, 16)  # alone: one forward


def test_the_policy_asks_the_batch_for_its_load():
    cpu = ForwardCost({1: 0.057, 2: 0.116, 4: 0.165, 6: 0.223, 8: 0.270, 16: 0.482})
    sequence = [1, 2, 3, 4, 5, 6] * 6  # a repeating text: the n-gram drafts with confidence
    lengths = {}
    for load in ((), (4, 4, 4)):
        policy = DraftPolicy([NGramDrafter(100, 1, 3)], cpu)
        for _ in range(30):  # the same evidence for both: every draft accepted
            proposal = policy.propose(sequence, 16, GREEDY, GEN)
            policy.observe(
                1 + len(proposal.tokens), cpu(1 + len(proposal.tokens)), proposal.tokens + [sequence[len(sequence) % 6]]
            )
        policy.load = lambda load=load: Load(tuple(load))
        lengths[load] = len(policy.propose(sequence, 16, GREEDY, GEN).tokens)
    assert 0 < lengths[(4, 4, 4)] < lengths[()]


def test_under_a_scheduler_the_costs_are_refined_from_the_forwards_not_the_rounds_wall_time():
    """A round's wall time under a Scheduler holds the other requests' steps (and waits for them): the cost table is
    refined from the forwards the request's asks rode in (Seat.timed: their rows and seconds), so a one-token
    round that waited 5 s in a busy step does not make a one-token forward look 5 s long."""
    cpu = ForwardCost({1: 0.04, 4: 0.12, 8: 0.26})
    policy = DraftPolicy([NGramDrafter(100, 1, 3)], cpu)
    rode = [(8, 0.30)]
    policy.timed = lambda view: rode
    sequence = [1, 2, 3, 4, 5, 6] * 6
    policy.propose(sequence, 4, GREEDY, GEN)
    policy.observe(1, 5.0, [sequence[0]])
    assert policy.cost.seconds[8] == pytest.approx(0.8 * 0.26 + 0.2 * 0.30)
    assert policy.cost.seconds[1] == pytest.approx(0.04 * (1 + 0.2 * (0.30 / 0.26 - 1)))


def test_verify_cost_follows_the_level_keeps_the_shape():
    cost = ForwardCost({1: 0.05, 5: 0.15})
    for _ in range(40):
        cost.observe(1, 0.10)  # a long context: the 1-token forward now costs twice as much
    assert cost(1) == pytest.approx(0.10, rel=0.01) and cost(5) == pytest.approx(0.30, rel=0.05)
    cost.observe(500, 9.0)  # a prompt round changes nothing
    assert cost(1) == pytest.approx(0.10, rel=0.01)


def test_adaptive_hybrid_learns_to_stop_and_observes_for_free():
    """A free drafter that is always wrong ends up drafting nothing, but keeps being observed; one that is always
    right drafts the most under a flat cost."""
    wrong = Fixed("ngram", [7] * 8, True)
    policy = DraftPolicy([wrong], ForwardCost({1: 0.05, 9: 0.45}))  # compute-bound: each drafted token costs
    ks = []
    for _ in range(30):
        proposal = policy.propose([1, 2], 8, GREEDY, GEN)
        ks.append(len(proposal.tokens))
        policy.accept(2, [])
        policy.observe(1 + len(proposal.tokens), 0.05, [3])  # the target's token is never 7
    assert set(ks) == {0} and policy.stats(0).alpha < 0.1  # observed without drafting
    right = Fixed("ngram", [7] * 8, True)
    policy = DraftPolicy([right], ForwardCost({1: 0.05, 9: 0.05}))
    for _ in range(10):
        proposal = policy.propose([1, 2], 8, GREEDY, GEN)
        policy.accept(2, list(range(len(proposal.tokens))))
        policy.observe(1 + len(proposal.tokens), 0.05, proposal.tokens + [7])
    assert len(policy.propose([1, 2], 8, GREEDY, GEN).tokens) == 8


def test_adaptive_sampling_keeps_a_model_free_proposals_q_none():
    """Under sampling the rule cuts a model-free proposal and its q stays None (point masses: nothing built)."""
    sequence = list(range(10, 40)) + [10, 11, 12, 13, 14, 15]  # a 6-token match, 24 tokens to copy
    sampling = SamplingParams(temperature=0.8)
    for cost, kept in ((ForwardCost({1: 0.05, 2: 0.05, 33: 0.05}), 6), (ForwardCost({1: 0.01, 2: 1.0}), 0)):
        policy = DraftPolicy([SuffixDrafter(100, depth=32, cache_requests=0, factor=1.0, memory=False)], cost)
        proposal = policy.propose(sequence, 32, sampling, GEN)
        assert proposal.tokens == list(range(16, 16 + kept))  # flat cost: the factor's 6; steep: none
        assert proposal.q is None


# verification whose width is nearly free (drafting could pay), and one that grows a forward's cost per token
# (no acceptance pays for a draft step of 20 ms: 2 tokens in 0.02 + 0.1 s is slower than 1 in 0.05 s)
ROOMY_VERIFY, LINEAR_VERIFY = ForwardCost({1: 0.05, 2: 0.06, 9: 0.2}), ForwardCost({1: 0.05, 2: 0.1, 9: 0.45})


@pytest.mark.parametrize("verify, probed", [(ROOMY_VERIFY, True), (LINEAR_VERIFY, False)])
def test_adaptive_model_drafter_is_probed_after_plain_rounds(verify, probed):
    """A draft model judged always wrong is probed after plain rounds, where drafting could pay at all: not where
    it would lose even if every draft were right. The probe adds its draft (0.02 s) and a verification one token
    wider (0.01 s) to a plain round: it waits for the plain rounds of which that is PROBE_SHARE."""
    model = Fixed("model", [7] * 8, False)
    policy = DraftPolicy([model], ForwardCost(dict(verify.seconds)), {0: ForwardCost({1: 0.02})})
    policy.acceptance[(0, 0)] = Acceptance(judged=100, accepted=0)
    drafted = [len(policy.propose([1], 8, GREEDY, GEN).tokens) for _ in range(40)]
    probe_s = 0.02 + verify(2) - verify(1)
    at = max(PROBE_START, math.ceil(probe_s / (PROBE_SHARE * verify(1)) - 1e-9)) if probed else None
    assert next((i + 1 for i, n in enumerate(drafted) if n), None) == at  # plain rounds, then one probe


def test_match_buckets():
    assert [match_bucket(n) for n in (0, 1, 4, 5, 7, 8, 11, 12, 15, 16, 40)] == [0, 1, 4, 5, 5, 8, 8, 12, 12, 16, 16]
    assert [bucket_label(b) for b in (1, 5, 16)] == ["match1", "match5-7", "match16+"]
    assert expected_tokens([1.0, 0.5, 0.0], 3) == pytest.approx(1 + 1 + 0.5)
    assert best_length([1.0, 1.0], 0.0, flat, 1, 16)[0] == 2  # per-position: at most their number


def test_acceptance_by_position_borrows_from_the_shorter_context():
    """Each drafted token is judged in the bucket of the context it continues (the match plus the tokens drafted
    before it); a bucket without rounds of its own takes the next shorter one's estimate."""
    drafter = Fixed("suffix", [7] * 8, True)
    drafter.last_match = 4
    policy = DraftPolicy([drafter], ForwardCost({1: 0.05, 9: 0.05}))
    assert policy.buckets(0, 6) == [4, 5, 5, 5, 8, 8]
    proposal = policy.propose([1, 2, 3, 4], 6, GREEDY, GEN)
    assert len(proposal.tokens) == 6  # flat cost: any chance pays
    policy.accept(4, [0, 1, 2, 3])  # 4 accepted, the 5th (bucket 8) rejected
    policy.observe(7, 0.05, [7, 7, 7, 7, 3])
    assert (policy.stats(0, 4).judged, policy.stats(0, 4).accepted) == (1, 1)
    assert (policy.stats(0, 5).judged, policy.stats(0, 5).accepted) == (3, 3)
    assert (policy.stats(0, 8).judged, policy.stats(0, 8).accepted) == (1, 0)
    assert (0, 12) not in policy.acceptance  # not judged: the 6th was after the rejection
    assert policy.alpha(0, 12) == policy.alpha(0, 8) < policy.alpha(0, 5)
    assert policy.alpha(0, 1) == 0.5  # nothing shorter: Beta(1, 1)


def test_the_token_after_an_accepted_cut_proposal_is_judged_for_free():
    """The rule drafts 2 of 8 proposed tokens; both accepted, the target's next (bonus) token is one more judgement
    of the third, at its position's bucket, without having drafted it."""
    drafter = Fixed("ngram", [5, 6, 7, 8, 9, 10, 11, 12], True)
    drafter.last_match = 2
    policy = DraftPolicy([drafter], ForwardCost({1: 0.05, 2: 0.06, 3: 0.07, 4: 0.5, 9: 0.9}))
    policy.acceptance[(0, 2)] = Acceptance(judged=50, accepted=50)
    proposal = policy.propose([1, 2], 8, GREEDY, GEN)
    assert proposal.tokens == [5, 6]  # width 4 costs too much
    policy.accept(2, [0, 1])
    policy.observe(3, 0.07, [5, 6, 7])
    assert (policy.stats(0, 4).judged, policy.stats(0, 4).accepted) == (1, 1)  # token 7 at match 2 + 2
    assert len(policy.propose([1, 2], 8, GREEDY, GEN).tokens) == 2
    policy.accept(2, [0])  # a rejection: the third position is not judged
    policy.observe(3, 0.07, [5, 0])
    assert policy.stats(0, 4).judged == 1


class Model(Drafter):
    """A draft model stand-in that has seen `length` tokens: drafting first feeds it the rest (its catch-up)."""

    name, free = "model", False

    def __init__(self, tokens, length=0):
        self.tokens, self.length, self.asked = tokens, length, []

    def behind(self, sequence):
        return len(sequence) - self.length

    def propose(self, sequence, k, params, generator):
        self.asked.append(k)
        self.length = len(sequence) + k - 1
        return Proposal(self.tokens[:k])


CHEAP_VERIFY = ForwardCost({1: 0.050, 2: 0.052, 4: 0.056, 8: 0.064, 16: 0.080})  # a GPU-like target
DRAFT = ForwardCost({1: 0.005, 64: 0.1})  # a 0.5B draft: 5 ms a token, 100 ms for 64 at once


def test_a_draft_that_stops_short_fails_the_slot_it_declined():
    """A draft model asked for k* tokens that stops after 2 (draft_confidence), both accepted: the third slot counts
    as judged and rejected, so the acceptance is that of a slot being drafted and accepted; a draft given all the
    slots it was asked for, all accepted, adds no rejection."""

    def one_round(cap):
        """(asked, drafted, judged, accepted) of one round whose drafts are all accepted, over 100 judged / 95."""
        model = Model([7] * cap, 400)
        policy = DraftPolicy([model], CHEAP_VERIFY, {0: ForwardCost(dict(DRAFT.seconds))})
        policy.acceptance[(0, 0)] = Acceptance(judged=100, accepted=95)
        tokens = policy.propose(list(range(400)), 8, GREEDY, GEN).tokens
        policy.accept(400, list(range(len(tokens))))
        policy.observe(1 + len(tokens), 0.06, tokens + [3])
        return model.asked[-1], len(tokens), policy.stats(0).judged - 90, policy.stats(0).accepted - 85.5

    asked, drafted, judged, accepted = one_round(2)
    assert asked > 2 and drafted == 2 and (judged, accepted) == pytest.approx((3, 2))  # the 3rd slot: rejected
    asked, drafted, judged, accepted = one_round(16)
    assert drafted == asked and (judged, accepted) == pytest.approx((asked, asked))


def test_catch_up_pays_when_the_rest_of_the_request_saves_more():
    assert catch_up_pays(0.0, 10.0, 0.05, 5)
    assert not catch_up_pays(25.0, 4.0, 0.5, 100)  # saves 100 x (0.5 - 0.25) s = 25 s: not more
    assert catch_up_pays(25.0, 4.0, 0.5, 101)
    assert not catch_up_pays(0.1, 15.0, 0.05, 10_000)  # slower than plain decoding: never
    assert catch_up_pays(1.0, 25.0, 0.05, None)  # unknown budget: assumed to pay


def test_adaptive_rule_prices_a_draft_models_catch_up():
    """A good draft model (95% acceptance) with cheap verification: in step (one token behind) it drafts; 400
    tokens behind (the prompt) its catch-up, ~0.6 s extrapolated from DRAFT, pays over 1,000 more tokens, not
    over 16."""

    def choose(length, remaining, sequence_len=400, pending=1):
        policy = DraftPolicy([Model([7] * 8, length)], CHEAP_VERIFY, {0: ForwardCost(dict(DRAFT.seconds))})
        policy.acceptance[(0, 0)] = Acceptance(judged=100, accepted=95)
        return len(
            policy.propose(list(range(sequence_len)), 8, GREEDY, GEN, pending=pending, remaining=remaining).tokens
        )

    assert choose(399, 16) > 2  # in step: drafting pays at once
    assert choose(0, 16) == 0  # the whole prompt to feed first: not for 16 tokens
    assert choose(0, 1000) > 2
    # the prompt round (the target has cached nothing): the target's prefill alone, whatever the catch-up would
    # save, so the first token comes at plain decoding's time; the draft reads the prompt in the next round
    assert choose(0, 16, pending=400) == 0 and choose(0, 1000, pending=400) == 0 and choose(0, None, pending=400) == 0
    assert choose(0, None) > 2  # no budget given: not priced


def test_a_probe_must_not_cost_a_catch_up_on_many_tokens():
    """A draft model that stopped drafting falls behind; it is probed only once what the probe adds to a plain
    round (feeding it what it missed, its draft, a verification one token wider) costs at most PROBE_SHARE of the
    plain rounds since: one token behind, after (draft + wider verification) / (PROBE_SHARE * a plain round) rounds;
    300 behind (a 0.46 s catch-up), not within 40."""
    probe_s = DRAFT(1) + ROOMY_VERIFY(2) - ROOMY_VERIFY(1)  # one token behind: no catch-up
    in_step = max(PROBE_START, math.ceil(probe_s / (PROBE_SHARE * ROOMY_VERIFY(1)) - 1e-9))
    for length, probe_at in ((299, in_step), (0, None)):
        model = Model([7] * 8, length)
        policy = DraftPolicy([model], ForwardCost(dict(ROOMY_VERIFY.seconds)), {0: ForwardCost(dict(DRAFT.seconds))})
        policy.acceptance[(0, 0)] = Acceptance(judged=100, accepted=0)
        drafted = [len(policy.propose(list(range(300)), 8, GREEDY, GEN).tokens) for _ in range(40)]
        assert next((i + 1 for i, n in enumerate(drafted) if n), None) == probe_at and set(drafted) <= {0, 1}


def plain_and_adaptive_seconds(drafter, policy, verify, draft, rounds, right, slower=1.0, context=50, max_k=8):
    """Simulated seconds of `rounds` target tokens decoded plainly and with the rule; `right(k)`: how many of k
    drafts the target accepts. Costs are the injected tables (the rule's own estimates), never measured ones; the
    rule sees each verification take `slower` times its table's figure. The prompt: `context` tokens."""
    sequence, seconds, tokens = list(range(context)), 0.0, 0
    while tokens < rounds:
        behind = drafter.behind(sequence)
        proposal = policy.propose(sequence, max_k, GREEDY, GEN, pending=1, remaining=rounds - tokens)
        k = len(proposal.tokens)
        if k and not drafter.free:
            seconds += draft(behind) + (k - 1) * draft(1)
        accepted = right(k)
        seconds += verify(1 + k)
        policy.accept(len(sequence), list(range(accepted)))
        committed = proposal.tokens[:accepted] + [3]
        policy.observe(1 + k, slower * verify(1 + k), committed)
        sequence += committed
        tokens += len(committed)
    return rounds * verify(1), seconds


@pytest.mark.parametrize("free", [True, False])
def test_adaptive_rule_stays_within_five_percent_of_plain_decoding_when_drafts_are_wrong(free):
    """Compute-bound verification (this CPU's profile) and drafts that are never right: the rule learns it, and
    the drafts it tries, the model's probes and their catch-ups cost under 5% of 400 plain rounds."""
    verify = ForwardCost({1: 0.057, 2: 0.116, 4: 0.165, 6: 0.223, 8: 0.270, 16: 0.482})
    draft = ForwardCost({1: 0.023, 64: 0.4})
    drafter = Fixed("ngram", [7] * 8, True) if free else Model([7] * 8, 50)
    policy = DraftPolicy(
        [drafter], ForwardCost(dict(verify.seconds)), {} if free else {0: ForwardCost(dict(draft.seconds))}
    )
    plain, adaptive = plain_and_adaptive_seconds(drafter, policy, verify, draft, 400, lambda k: 0)
    assert adaptive <= 1.05 * plain


def test_adaptive_rule_gains_with_a_good_cheap_draft_model():
    verify = CHEAP_VERIFY
    drafter = Model([7] * 8, 50)
    policy = DraftPolicy([drafter], ForwardCost(dict(verify.seconds)), {0: ForwardCost(dict(DRAFT.seconds))})
    plain, adaptive = plain_and_adaptive_seconds(drafter, policy, verify, DRAFT, 400, lambda k: k)
    assert adaptive < 0.5 * plain


# the AMX Xeon's profile (llama.cpp, 2 threads, docs/BENCHMARKS.md): a 16-token verification costs 2.8 one-token
# forwards, the draft model's step a third of the target's; a prompt of 157 tokens costs the draft ~0.3 s
AMX_VERIFY = ForwardCost({1: 0.086, 2: 0.118, 4: 0.163, 8: 0.189, 16: 0.241, 32: 0.349})
AMX_DRAFT = ForwardCost({1: 0.030, 64: 0.125})


def test_an_untried_draft_model_is_tried_then_drafts_by_its_own_estimate():
    """From the prior alone (0.5) a draft a third as costly as the target never looks worth a
    round; its trial drafts 1, 2, 4 tokens (all accepted), then the rule drafts by what it saw, and a request of 400
    tokens with a draft that is always right takes under 80% of plain decoding."""
    drafter = Model([7] * 16, 0)
    policy = DraftPolicy([drafter], ForwardCost(dict(AMX_VERIFY.seconds)), {0: ForwardCost(dict(AMX_DRAFT.seconds))})
    plain, adaptive = plain_and_adaptive_seconds(drafter, policy, AMX_VERIFY, AMX_DRAFT, 400, lambda k: k)
    trial = [d["k"] for d in policy.decisions if d["trial"]]
    assert trial == [1, 2, 4]
    assert all(d["k"] > 0 for d in policy.decisions[3:])
    assert adaptive < 0.8 * plain


# Zen 3 (AVX2), llama.cpp, 2 threads, the reference pair, as ForwardCost.measure timed them at start-up (the first of
# two runs; benchmarks/adaptive_startup.py prints these per-width times): the draft model's step costs 60% of the
# target's and verification grows with its width
ZEN3_VERIFY = ForwardCost({1: 0.070, 2: 0.110, 4: 0.159, 8: 0.303, 16: 0.545})
ZEN3_DRAFT = ForwardCost({1: 0.043, 2: 0.066, 4: 0.092, 8: 0.158, 16: 0.318})


def test_a_draft_model_that_cannot_pay_even_when_always_right_is_never_tried():
    """On Zen 3's costs no round with drafts beats plain decoding even if every draft is accepted: the untried draft
    model gets no trial and no probe, so the target decodes plainly and the draft never catches up on the prompt
    (a first-request trial cost 2.2 s of TTFT in make demo). The AMX profile's draft model, which can pay, is
    tried at once."""
    for verify, draft, tried in ((ZEN3_VERIFY, ZEN3_DRAFT, False), (AMX_VERIFY, AMX_DRAFT, True)):
        drafter = Model([7] * 16, 0)
        policy = DraftPolicy([drafter], ForwardCost(dict(verify.seconds)), {0: ForwardCost(dict(draft.seconds))})
        plain_and_adaptive_seconds(drafter, policy, verify, draft, 200, lambda k: k)
        assert bool(drafter.asked) == tried and policy.decisions[0]["trial"] == tried
        assert all(d["k"] == 0 and not d["probe"] for d in policy.decisions) != tried


# the same, on 2026-12-04 (a faster hour of a Zen 3 VM; the first row of benchmarks/adaptive_startup.py's log):
# drafting could not pay even if every draft were right, but by a margin of a few percent
ZEN3_EDGE_VERIFY = ForwardCost(
    {1: 0.0526, 2: 0.0856, 4: 0.1228, 6: 0.2078, 8: 0.2586, 16: 0.5507, 17: 0.4827, 32: 0.7682, 33: 0.944}
)
ZEN3_EDGE_DRAFT = ForwardCost({1: 0.0254, 2: 0.037, 4: 0.0519, 8: 0.0909, 16: 0.129, 64: 0.4315})


class Held(ForwardCost):
    """A draft model's cost that stays at its start-up figures while the target's level moves (the rule before
    DraftPolicy.observe moved an idle draft's costs with the target's)."""

    def rescale(self, level: float) -> None:
        pass


def first_trial(verify, draft, slower: float, held: bool = False) -> int | None:
    """The round in which the untried draft model is first tried (drafts always right, a 160-token prompt, 128
    tokens, up to 32 drafts a round), the target's rounds taking `slower` times their start-up figure; None: never."""
    policy = DraftPolicy(
        [Model([7] * 40, 0)],
        ForwardCost(dict(verify.seconds)),
        {0: (Held if held else ForwardCost)(dict(draft.seconds))},
    )
    plain_and_adaptive_seconds(policy.drafters[0], policy, verify, draft, 128, lambda k: k, slower, 160, 32)
    return next((t for t, d in enumerate(policy.decisions) if d["trial"]), None)


def test_an_idle_draft_model_follows_the_targets_level():
    """The target's rounds run 50% slower than timed at start-up (a slow hour of the machine): a draft model that
    has not run follows the same level, so on Zen 3's table, where no draft pays, it is still not tried. The control:
    a draft held at its start-up cost looks cheaper against the slower target and gets its trial (and its catch-up
    of the prompt: 1.4 s in a bench run; a 20% slower target did that before looks were judged by BEST_ALPHA). The
    AMX profile's draft, which pays, is tried at once either way."""
    assert first_trial(ZEN3_EDGE_VERIFY, ZEN3_EDGE_DRAFT, 1.0) is None
    assert first_trial(ZEN3_EDGE_VERIFY, ZEN3_EDGE_DRAFT, 1.5) is None
    assert first_trial(ZEN3_EDGE_VERIFY, ZEN3_EDGE_DRAFT, 1.5, held=True) is not None
    assert first_trial(AMX_VERIFY, AMX_DRAFT, 1.3) == first_trial(AMX_VERIFY, AMX_DRAFT, 1.3, held=True) == 0


# Zen 4 (AVX-512), llama.cpp, 2 threads, the reference pair, as ForwardCost.measure timed them at start-up on
# 2026-12-06 (the widths an Engine times, the wide ones once each; 31 rows came out dearer than 32); the draft's step
# as a start-up a little faster timed it (its one-token step 15% cheaper, within a run's spread). Every draft right,
# a 31-draft chain costs 31 x 18 + 423 ms for 32 tokens: 30.7 ms a token against 32.9 plainly
ZEN4_VERIFY = ForwardCost(
    {
        1: 0.03288, 2: 0.05664, 3: 0.07712, 4: 0.09483, 5: 0.11921, 6: 0.25272, 7: 0.24819, 8: 0.23283, 9: 0.22453,
        15: 0.32016, 16: 0.25221, 17: 0.30317, 24: 0.38428, 31: 0.53562, 32: 0.42341, 33: 0.49917,
    }
)  # fmt: skip
ZEN4_DRAFT = ForwardCost({1: 0.018, 2: 0.02614, 4: 0.0356, 8: 0.05365, 16: 0.07683, 64: 0.22992})


def test_a_look_needs_drafting_to_pay_with_drafts_as_good_as_they_get(monkeypatch):
    """On Zen 4's costs drafting could pay only if nearly every draft of a 31-token chain were right, by a few
    percent, which a start-up table's noise gives or takes: judged by that case (every draft right), a 51-token
    MT-Bench prompt's catch-up looked worth a trial, which cost that request 12% in a bench run (2026-12-06). Judged
    by drafts right as often as the best are (BEST_ALPHA), no look; the AMX profile's draft is tried at once."""

    def trial(verify, draft):
        policy = DraftPolicy(
            [Model([7] * 40, 0)], ForwardCost(dict(verify.seconds)), {0: ForwardCost(dict(draft.seconds))}
        )
        plain_and_adaptive_seconds(policy.drafters[0], policy, verify, draft, 128, lambda k: k, 1.0, 51, 32)
        return next((t for t, d in enumerate(policy.decisions) if d["trial"] or d["probe"]), None)

    assert trial(ZEN4_VERIFY, ZEN4_DRAFT) is None
    assert trial(AMX_VERIFY, AMX_DRAFT) == 0
    monkeypatch.setattr(policy_module, "BEST_ALPHA", 1.0)  # the best case as it was: every draft right
    assert trial(ZEN4_VERIFY, ZEN4_DRAFT) == 0


def test_a_draft_model_drafts_by_its_mean_and_a_model_free_drafter_by_its_lower_estimate():
    """A draft model's one estimate is judged on every token it drafts: the rule takes its mean (less half a
    deviation, a new request's first rejection ended the request's drafting on the AMX Xeon); a model-free
    drafter's estimates, one per match length and each judged a few times, less half their deviation."""
    for free in (False, True):
        drafter = Fixed("ngram", [7] * 8, True) if free else Model([7] * 8, 300)
        drafts = {} if free else {0: ForwardCost(dict(AMX_DRAFT.seconds))}
        policy = DraftPolicy([drafter], ForwardCost(dict(AMX_VERIFY.seconds)), drafts)
        bucket = policy.buckets(0, 1)[0]
        stats = policy.stats(0, bucket)
        stats.judged, stats.accepted, stats.tried = 5.25, 4.16, True
        policy.propose(list(range(300)), 5, GREEDY, GEN, pending=1, remaining=100)
        used = stats.lower(0.5) if free else stats.posterior(0.5)
        assert policy.decisions[-1]["alpha"] == round(used, 3) and stats.lower(0.5) < stats.posterior(0.5) - 0.05


def test_a_trial_that_fails_ends_and_decoding_goes_plain():
    """Drafts that are never right: the trial drafts one token a round until TRIAL_JUDGED drafts were judged, then
    the rule decodes plainly (probes aside); a short request does not start a trial (its catch-up would not pay)."""
    drafter = Model([7] * 16, 0)
    policy = DraftPolicy([drafter], ForwardCost(dict(AMX_VERIFY.seconds)), {0: ForwardCost(dict(AMX_DRAFT.seconds))})
    plain_and_adaptive_seconds(drafter, policy, AMX_VERIFY, AMX_DRAFT, 60, lambda k: 0)
    ks = [d["k"] for d in policy.decisions]
    assert ks[:5] == [1] * 5 and all(d["trial"] for d in policy.decisions[:5])
    assert policy.stats(0).tried and ks[5:12] == [0] * 7
    short = DraftPolicy(
        [Model([7] * 16, 0)], ForwardCost(dict(AMX_VERIFY.seconds)), {0: ForwardCost(dict(AMX_DRAFT.seconds))}
    )
    assert short.propose(list(range(50)), 8, GREEDY, GEN, remaining=TRIAL_REMAINING - 1).tokens == []


def test_prune_keeps_parents_and_remaps():
    tree = SuffixDrafter(100, depth=6, cache_requests=0, factor=0).propose_tree(
        [7, 1, 2, 0, 7, 1, 3, 0, 7], 2, 3, 10, GREEDY, GEN
    )
    assert tree.depth == 3  # something to cut
    cut = prune(tree, 1)
    assert cut.depth == 1 and cut.tokens == [t for t, d in zip(tree.tokens, tree.depths) if d == 1]


# -- point-mass acceptance follows p ----------------------------------------------------------------------------


def test_point_mass_acceptance_follows_the_target():
    gen = torch.Generator().manual_seed(1)
    p = torch.tensor([0.05, 0.3, 0.0, 0.4, 0.25])
    n = 40_000
    for candidates in ([3, 1], [2, 4, 0], [1]):
        counts = np.zeros(5)
        for _ in range(n):
            _, token = point_mass_accept(candidates, p, gen)
            counts[token] += 1
        assert counts[2] == 0
        keep = p.numpy() > 0
        assert chisquare(counts[keep], p.numpy()[keep] * n).pvalue > 1e-3


def test_chain_and_tree_with_point_masses_follow_the_target():
    """verify_chain with q = None (point masses), and verify_tree with deterministic siblings: the first token
    follows p."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]]))
    params = SamplingParams(temperature=1.0)
    n = 30_000
    chain, tree = np.zeros(4), np.zeros(4)
    for _ in range(n):
        accepted, nxt = verify_chain([2, 0], None, logits, params, gen)
        chain[2 if accepted else nxt] += 1
        path, nxt = verify_tree([1, 3], [-1, -1], {}, logits[[0, 1, 1]], params, gen)
        tree[[1, 3][path[0]] if path else nxt] += 1
    p = np.array([0.1, 0.5, 0.2, 0.2])
    assert chisquare(chain, p * n).pvalue > 1e-3 and chisquare(tree, p * n).pvalue > 1e-3


def test_q_none_is_the_one_hot_q_draw_for_draw():
    """q = None judges a chain exactly as the explicit one-hot q would: the same tokens from the same seed, for
    whole chains and for one token judged in hand (verify_token)."""
    from paraspec.verify import verify_token

    params = SamplingParams(temperature=0.9)
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(3))
    drafts = logits[:4].argmax(-1).tolist()
    drafts[2] = int(logits[2].argsort()[-3])  # a likely rejection in the middle
    one_hot = torch.nn.functional.one_hot(torch.tensor(drafts), 40).float()
    a, b = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    outcomes = set()
    for _ in range(2000):
        implicit = verify_chain(drafts, None, logits, params, a)
        assert implicit == verify_chain(drafts, one_hot, logits, params, b)
        assert verify_token(drafts[2], None, logits[2], params, a) == verify_token(
            drafts[2], one_hot[2], logits[2], params, b
        )
        outcomes.add(implicit[0])
    assert len(outcomes) >= 3  # rejections at several depths were compared


def test_bulk_indexing_pauses_the_garbage_collector_and_restores_it():
    """A prompt's worth of appends runs with the cyclic collector off (its scans of the nodes built so far were 80%
    of a suffix trie's build); the collector's state is restored after, also when it was off or the build fails."""
    import gc

    from paraspec.drafters.ngram import BULK, gc_paused
    from paraspec.drafters.suffix import RequestTrie

    seen = []

    class Spy(RequestTrie):
        def append(self, token):
            seen.append(gc.isenabled())
            super().append(token)

    assert gc.isenabled()
    Spy(8).sync(list(range(BULK)))  # a prompt: paused throughout
    assert seen == [False] * BULK and gc.isenabled()
    seen.clear()
    index = Spy(8)
    index.sync([1, 2])  # a round's few tokens: not paused
    assert seen == [True, True]
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()
    with pytest.raises(RuntimeError):
        with gc_paused():
            raise RuntimeError
    assert gc.isenabled()
    stepped = []

    class SpyTrie(SuffixTrie):
        def _step(self, active, token, sign):
            stepped.append(gc.isenabled())
            return super()._step(active, token, sign)

    trie = SpyTrie(4)
    trie.add(list(range(BULK)) * 2)  # an output joining the cache: paused too
    assert stepped == [False] * 2 * BULK and gc.isenabled() and trie.match([0, 1, 2], 3)[1] == 3


def test_adaptive_keeps_an_acceptance_per_source_of_evidence():
    """The suffix drafter's proposals from its output cache (other requests) are judged apart from the request's
    own: a cache whose proposals are always wrong stops being drafted while the request's right ones, at the same
    match length, still are; the report names both."""
    context = list(range(10, 20))
    request_text = context + [1, 2, 3, 4, 5, 6] + context  # the request repeats itself: right proposals
    suffix = SuffixDrafter(100, depth=16, cache_requests=4, memory=False)
    suffix.reset()
    suffix.propose([50, 51], 4, GREEDY, GEN)  # an earlier request's prompt, and its output:
    suffix.finish([50, 51] + context + [7, 7, 7, 7, 7, 7])  # the context, then the wrong continuation
    cost = ForwardCost({1: 0.05, 2: 0.07, 7: 0.12})
    policy = DraftPolicy([suffix], ForwardCost(dict(cost.seconds)))
    policy.reset()
    for _ in range(12):  # the cache's: always rejected
        proposal = policy.propose([60, 61] + context, 6, GREEDY, GEN)
        assert suffix.last_source == 1
        policy.accept(12, [])
        policy.observe(1 + len(proposal.tokens), cost(1 + len(proposal.tokens)), [9])
    assert len(policy.propose([60, 61] + context, 6, GREEDY, GEN).tokens) == 0
    assert policy.alpha(0, SOURCE_STRIDE + 8) < 0.2 and policy.alpha(0, 8) == 0.5  # the request's: untouched
    policy.reset()
    for bucket in (8, 12):  # the request's own proposals: always right
        policy.acceptance[(0, bucket)] = Acceptance(judged=50, accepted=50)
    proposal = policy.propose(request_text, 6, GREEDY, GEN)  # same match length, the request's own text
    assert suffix.last_source == 0 and proposal.tokens == [1, 2, 3, 4, 5, 6]
    assert {"suffix/cache/match8-11", "suffix/match8-11"} <= set(policy.report()["alpha"])
