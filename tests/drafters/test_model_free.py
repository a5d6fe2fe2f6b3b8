"""The model-free drafters (prompt lookup, suffix tries), the hybrid order and the adaptive draft length rule, on
hand-made sequences; point-mass acceptance against the target distribution (chi-square)."""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from paraspec import SamplingParams
from paraspec.drafters import Hybrid, NGramDrafter, Proposal, SuffixDrafter
from paraspec.drafters.adaptive import Acceptance, VerifyCost, best_length, expected_tokens
from paraspec.drafters.base import Drafter
from paraspec.drafters.hybrid import prune
from paraspec.drafters.suffix import SuffixTrie
from paraspec.verify import point_mass_accept, verify_chain, verify_tree

GREEDY = SamplingParams()
GEN = torch.Generator().manual_seed(0)


def ngram(seq, k=5, lo=1, hi=3, vocab=100):
    return NGramDrafter(vocab, lo, hi).propose(seq, k, GREEDY, GEN).tokens


# -- prompt lookup ---------------------------------------------------------------------------------------------

def test_ngram_longest_match_wins():
    # "7 8" occurred followed by 1, 2; "9 7 8" occurred (later-ending shorter match elsewhere) followed by 3, 4
    seq = [9, 7, 8, 3, 4, 0, 5, 7, 8, 1, 2, 0, 9, 7, 8]
    assert ngram(seq, k=2, lo=1, hi=3) == [3, 4]          # the 3-gram (9 7 8) beats the 2-gram's latest (1 2)
    assert ngram(seq, k=2, lo=1, hi=2) == [1, 2]          # up to 2-grams: the most recent occurrence of (7 8)


def test_ngram_no_match_proposes_nothing_and_respects_min():
    assert ngram([1, 2, 3, 4, 5]) == []
    seq = [1, 2, 3, 4, 2]                                   # only a 1-gram match (2 -> 3)
    assert ngram(seq, lo=1) == [3, 4, 2] and ngram(seq, lo=2) == []


def test_ngram_proposal_length_and_growth():
    drafter = NGramDrafter(100, 2, 3)
    seq = [5, 6, 7, 8, 9, 5, 6]
    assert drafter.propose(seq, 2, GREEDY, GEN).tokens == [7, 8]
    assert drafter.propose(seq, 10, GREEDY, GEN).tokens == [7, 8, 9, 5, 6]   # runs to the end of the text
    assert drafter.propose(seq + [7], 3, GREEDY, GEN).tokens == [8, 9, 5]   # extended incrementally
    assert drafter.propose([1, 2, 1], 3, GREEDY, GEN).tokens == []          # a new sequence: index rebuilt
    assert drafter.propose([1, 2, 1, 2], 0, GREEDY, GEN).tokens == []


def test_ngram_q_is_the_point_mass_under_sampling():
    p = NGramDrafter(10, 1, 2).propose([1, 2, 3, 1, 2], 2, SamplingParams(temperature=1.0), GEN)
    assert p.tokens == [3, 1] and torch.equal(p.q, torch.eye(10)[[3, 1]])


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
    seq = [1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 4, 0, 1, 2]
    drafter = SuffixDrafter(100, depth=8, cache_requests=0)
    assert drafter.propose(seq, 2, GREEDY, GEN).tokens == [4, 0]


def test_suffix_cache_is_shared_across_requests_and_bounded():
    drafter = SuffixDrafter(100, depth=8, cache_requests=2)
    outputs = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]
    for i, out in enumerate(outputs):
        drafter.reset()
        drafter.propose([99, i], 1, GREEDY, GEN)             # the request's prompt
        drafter.finish([99, i] + out)
    drafter.reset()
    assert drafter.propose([5, 5, 20, 21], 2, GREEDY, GEN).tokens == [22, 23]   # an earlier request's output
    assert drafter.propose([5, 5, 30, 31], 2, GREEDY, GEN).tokens == [32, 33]
    assert drafter.propose([5, 5, 10, 11], 2, GREEDY, GEN).tokens == []         # evicted: the cache holds 2
    assert len(drafter.cached) == 2
    # the cache holds exactly what the two kept outputs put there
    fresh = SuffixTrie(8)
    fresh.add(outputs[1])
    fresh.add(outputs[2])
    assert drafter.cache.size() == fresh.size()


def test_suffix_tree_branches_ordered_by_frequency():
    seq = [7, 2, 0, 7, 2, 1, 7, 2, 5, 7, 3, 6, 7, 3, 8, 7, 1, 9, 7]   # the longest earlier match is "7" alone
    tree = SuffixDrafter(100, depth=6, cache_requests=0).propose_tree(seq, 3, 2, 10, GREEDY, GEN)
    roots = [t for t, p in zip(tree.tokens, tree.parents) if p == -1]
    assert roots == [2, 3, 1]                               # 3, 2 and 1 occurrences after "7"
    assert all(tree.depths[i] == 2 for i, p in enumerate(tree.parents) if p != -1)
    assert not tree.draft_probs                             # deterministic: point masses


def test_suffix_drops_improbable_paths():
    seq = [7, 1, 7, 2, 7, 3, 7, 4, 7, 5, 7, 6, 7, 8, 7, 9, 7, 10, 7, 11, 7, 12, 7]   # after 7: 11 continuations
    assert SuffixDrafter(100, depth=4, cache_requests=0).propose(seq, 3, GREEDY, GEN).tokens == []


# -- hybrid and adaptive length --------------------------------------------------------------------------------

class Fixed(Drafter):
    def __init__(self, name, tokens, free):
        self.name, self.tokens, self.free, self.asked = name, tokens, free, []

    def propose(self, sequence, k, params, generator):
        self.asked.append(k)
        return Proposal(self.tokens[:k])


def test_hybrid_falls_back_to_the_next_drafter():
    empty, model = Fixed("ngram", [], True), Fixed("model", [4, 5, 6], False)
    hybrid = Hybrid([empty, model])
    assert hybrid.propose([1], 2, GREEDY, GEN).tokens == [4, 5]
    first = Fixed("ngram", [9], True)
    assert Hybrid([first, model]).propose([1], 2, GREEDY, GEN).tokens == [9]


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


def test_adaptive_rule_prompt_round_pays_at_the_margin():
    """With 400 pending prompt tokens the ratio would favour any draft; the margin rule drafts only when the
    expected extra tokens are worth their extra verification."""
    cost = VerifyCost({1: 0.05, 2: 0.1, 8: 0.25, 16: 0.45})
    assert best_length(0.5, 0.0, cost, 400, 12)[0] == 0
    assert best_length(0.99, 0.0, cost, 400, 12)[0] == 12


def test_adaptive_rule_compute_bound_verification():
    """This CPU's llama.cpp profile (ms by width 1/2/4/6/8/16: 57/116/165/223/270/482, interpolated): a draft model
    at 23 ms a token pays only with high acceptance; a free drafter pays earlier."""
    cost = VerifyCost({1: 0.057, 2: 0.116, 4: 0.165, 6: 0.223, 8: 0.270, 16: 0.482})
    assert best_length(0.5, 0.023, cost, 1, 16)[0] == 0
    assert best_length(0.95, 0.0, cost, 1, 16)[0] > 4
    assert cost(3) == pytest.approx((0.116 + 0.165) / 2) and cost(32) > cost(16)


def test_verify_cost_follows_the_level_keeps_the_shape():
    cost = VerifyCost({1: 0.05, 5: 0.15})
    for _ in range(40):
        cost.observe(1, 0.10)                  # a long context: the 1-token forward now costs twice as much
    assert cost(1) == pytest.approx(0.10, rel=0.01) and cost(5) == pytest.approx(0.30, rel=0.05)
    cost.observe(500, 9.0)                     # a prompt round changes nothing
    assert cost(1) == pytest.approx(0.10, rel=0.01)


def test_adaptive_hybrid_learns_to_stop_and_observes_for_free():
    """A free drafter that is always wrong ends up drafting nothing, but keeps being observed; one that is always
    right drafts the most under a flat cost."""
    wrong = Fixed("ngram", [7] * 8, True)
    hybrid = Hybrid([wrong], VerifyCost({1: 0.05, 9: 0.45}))      # compute-bound: each drafted token costs
    ks = []
    for _ in range(30):
        proposal = hybrid.propose([1, 2], 8, GREEDY, GEN)
        ks.append(len(proposal.tokens))
        hybrid.accept(2, [])
        hybrid.observe(1 + len(proposal.tokens), 0.05, [3])      # the target's token is never 7
    assert set(ks) == {0} and hybrid.stats(0).alpha < 0.1      # observed without drafting
    right = Fixed("ngram", [7] * 8, True)
    hybrid = Hybrid([right], VerifyCost({1: 0.05, 9: 0.05}))
    for _ in range(10):
        proposal = hybrid.propose([1, 2], 8, GREEDY, GEN)
        hybrid.accept(2, list(range(len(proposal.tokens))))
        hybrid.observe(1 + len(proposal.tokens), 0.05, proposal.tokens + [7])
    assert len(hybrid.propose([1, 2], 8, GREEDY, GEN).tokens) == 8


def test_adaptive_model_drafter_is_probed_after_plain_rounds():
    model = Fixed("model", [7] * 8, False)
    hybrid = Hybrid([model], VerifyCost({1: 0.05, 2: 0.1, 9: 0.45}))
    hybrid.acceptance[hybrid.key(0)] = Acceptance(judged=100, accepted=0, draft_s_per_token=0.02)
    drafted = [len(hybrid.propose([1], 8, GREEDY, GEN).tokens) for _ in range(8)]
    assert drafted == [0] * 7 + [1]                          # plain rounds, then one probe


def test_prune_keeps_parents_and_remaps():
    tree = SuffixDrafter(100, depth=6, cache_requests=0).propose_tree(
        [7, 1, 2, 0, 7, 1, 3, 0, 7], 2, 3, 10, GREEDY, GEN)
    assert tree.depth == 3                                 # something to cut
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
    """verify_chain with one-hot q, and verify_tree with deterministic siblings: the first token follows p."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]]))
    params = SamplingParams(temperature=1.0)
    n = 30_000
    chain, tree = np.zeros(4), np.zeros(4)
    q = torch.eye(4)[[2, 0]]
    for _ in range(n):
        accepted, nxt = verify_chain([2, 0], q, logits, params, gen)
        chain[2 if accepted else nxt] += 1
        path, nxt = verify_tree([1, 3], [-1, -1], {}, logits[[0, 1, 1]], params, gen)
        tree[[1, 3][path[0]] if path else nxt] += 1
    p = np.array([0.1, 0.5, 0.2, 0.2])
    assert chisquare(chain, p * n).pvalue > 1e-3 and chisquare(tree, p * n).pvalue > 1e-3
