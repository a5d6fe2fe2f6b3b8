"""The grammar's forced tokens drafted first (drafters/forced.py, DraftPolicy): under a grammar, a round drafts the
tokens it forces and the configured drafter continues after them. Greedy constrained sd (suffix, ngram, a draft model)
and tree still return constrained ar's tokens; the forced tokens are really drafted and accepted; the grammar's
committed state and a model-free drafter's index never take them before the target does; and constrained sampling
still follows the target's constrained joint distribution (a forced token's q is a point mass, a one-hot row in front
of a draft model's q)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from paraspec import Engine, SamplingParams
from paraspec.drafters import DraftPolicy, NGramDrafter, SuffixDrafter, TokenTree
from paraspec.drafters.base import Drafter, Proposal
from paraspec.drafters.forced import graft_tree, join_chain
from paraspec.models.loader import load_tokenizer_if_any
from paraspec.sampling import logits_to_probs, make_generator
from paraspec.structured import GrammarMatcher
from paraspec.verify import verify_chain
from tests.conftest import PROMPT, assert_matches
from tests.tiny import EOS_ID, make_checkpoint

VOCAB = 267  # the tiny checkpoints' ids (their tokenizer is byte-level: a forced byte is a forced token)
GREEDY, GEN = SamplingParams(temperature=0.0), make_generator(0)
# long keys, no free whitespace: most of the answer is forced (`{"identifier_of_record":`, `,"classification":"`)
SCHEMA = {
    "type": "object",
    "properties": {
        "identifier_of_record": {"type": "integer", "minimum": 0, "maximum": 999},  # (unbounded, the model runs on)
        "classification": {"enum": ["mammal", "reptile"]},
    },
    "required": ["identifier_of_record", "classification"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},  # llguidance: no free whitespace (a random model loops in it)
}
STRUCTURED = ("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def tokenizer(deep_pair):
    return load_tokenizer_if_any(deep_pair[0])


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def forced_positions(tokenizer, output: list[int]) -> int:
    """How many tokens of `output` were the only one the grammar allowed where they came (read from its masks)."""
    matcher = GrammarMatcher.for_request(tokenizer, STRUCTURED, VOCAB, {EOS_ID})
    count = 0
    for token in output:
        if token == EOS_ID:
            break
        count += matcher.allowed().nonzero().flatten().tolist() == [token]
        matcher.consume(token)
    return count


# -- the matcher and the policy ---------------------------------------------------------------------------------


class Stub(Drafter):
    """Proposes fixed tokens; records what it was asked and told."""

    def __init__(self, tokens, free=True):
        self.tokens, self.free = tokens, free
        self.asked: list[tuple[list[int], int, int]] = []  # (sequence, k, uncommitted)
        self.told: list[tuple] = []

    def propose(self, sequence, k, params, generator):
        self.asked.append((list(sequence), k, self.uncommitted))
        return Proposal(self.tokens[:k])

    def accept(self, prefix_len, path):
        self.told.append(("accept", prefix_len, path))

    def rollback(self, length):
        self.told.append(("rollback", length))


def test_the_forced_tokens_come_first_and_the_drafter_continues_after_them(tokenizer):
    matcher = GrammarMatcher.for_request(tokenizer, ("regex", "abc[de]+"), VOCAB, {EOS_ID})
    a, b, c, d, e = (ids(tokenizer, ch)[0] for ch in "abcde")
    assert matcher.forced(8) == [a, b, c] and matcher.forced(2) == [a, b] and matcher.forced(0) == []
    stub = Stub([d, e, d])
    policy = DraftPolicy([stub])
    policy.begin(GREEDY, 1, matcher)
    assert policy.propose([5], 5, GREEDY, GEN).tokens == [a, b, c, d, e]
    assert stub.asked == [([5, a, b, c], 2, 3)] and stub.uncommitted == 0  # after them, told they are drafts
    assert matcher.forced(8) == [a, b, c]  # the committed state did not move
    assert set(torch.nonzero(matcher.mask_rows(torch.zeros(VOCAB)) == 0).flatten().tolist()) == {a}
    assert policy.propose([5], 2, GREEDY, GEN).tokens == [a, b] and len(stub.asked) == 1  # k spent: not asked
    # the drafter's q is masked in the state after the forced tokens (a draft model's chain)
    with matcher.ahead([a, b, c]):
        assert set(torch.nonzero(matcher.mask_after(torch.zeros(VOCAB), []) == 0).flatten().tolist()) == {d, e}
    assert matcher.forced(8) == [a, b, c]


def test_the_drafter_is_told_what_the_target_kept_of_its_part(tokenizer):
    """All forced tokens kept: the drafter's path and prefix as if it had drafted after them; one rejected: a
    drafter with a cache keeps the committed tokens only (rollback)."""
    a, b, c, d, e = (ids(tokenizer, ch)[0] for ch in "abcde")
    for kept, told in [(4, ("accept", 4, [0])), (2, ("rollback", 3))]:
        matcher = GrammarMatcher.for_request(tokenizer, ("regex", "abc[de]+"), VOCAB, {EOS_ID})
        stub = Stub([d, e], free=False)
        policy = DraftPolicy([stub])
        policy.begin(GREEDY, 1, matcher)
        policy.propose([5], 5, GREEDY, GEN)
        policy.accept(1, list(range(kept)))
        assert stub.told == [told]


def test_a_tree_hangs_from_the_forced_trunk():
    tree = TokenTree()
    q = torch.tensor([0.5, 0.5])
    tree.add(7, -1), tree.add(8, -1), tree.add(9, 0)
    tree.draft_probs = {-1: q, 0: q}
    grafted = graft_tree([3, 4], tree)
    assert grafted.tokens == [3, 4, 7, 8, 9] and grafted.parents == [-1, 0, 1, 1, 2]
    assert grafted.depths == [1, 2, 3, 3, 4] and set(grafted.draft_probs) == {1, 2}  # the trunk: point masses


def test_a_forced_tokens_one_hot_row_is_judged_as_its_point_mass():
    """In front of a draft model's sampled chain a forced token's q is its one-hot row: verify_chain's speculative
    sampling then keeps and replaces it exactly as the point mass (q None) does, draw for draw."""
    torch.manual_seed(0)
    forced, width = [3, 1], 6
    logits = torch.randn(len(forced) + 1, width)
    one_hot = join_chain(forced, Proposal([], torch.zeros(0, width))).q
    assert one_hot is not None and one_hot.tolist() == [[0, 0, 0, 1, 0, 0], [0, 1, 0, 0, 0, 0]]
    params = SamplingParams(temperature=1.0)
    outcomes = set()
    for seed in range(300):
        as_rows = verify_chain(forced, one_hot, logits, params, make_generator(seed))
        assert as_rows == verify_chain(forced, None, logits, params, make_generator(seed))
        outcomes.add(as_rows[0])
    assert outcomes == {0, 1, 2}  # rejected at each place, and kept: the check saw every branch


@pytest.mark.parametrize("drafter", [NGramDrafter(VOCAB, 2, 3), SuffixDrafter(VOCAB, depth=16, cache_requests=4)])
def test_a_model_free_drafter_matches_the_forced_tokens_but_indexes_committed_tokens_only(drafter):
    committed = [1, 2, 3, 4, 5, 1, 2]
    drafter.reset()
    drafter.uncommitted = 1
    assert drafter.propose(committed + [3], 3, GREEDY, GEN).tokens == [4, 5, 1]  # "2 3" continued
    index = drafter.index if isinstance(drafter, NGramDrafter) else drafter.request
    assert index.tokens == committed
    drafter.uncommitted = 0
    drafter.propose(committed + [9], 3, GREEDY, GEN)  # the forced 3 was rejected: the index only grows
    assert index.tokens == committed + [9]


# -- end to end: greedy == constrained ar, the forced tokens drafted and accepted ---------------------------------


@pytest.fixture(scope="module")
def reference(deep_pair) -> list[int]:
    with Engine(deep_pair[0], strategy="ar", dtype="float32", max_num_seqs=1) as ar:
        result = ar.generate(PROMPT, SamplingParams(max_new_tokens=60, structured=STRUCTURED))
    assert result.finish_reason == "stop" and json.loads(result.text)["classification"] in ("mammal", "reptile")
    return result.token_ids


DRAFTS = [
    ("sd", "suffix", dict(lookahead=3, adaptive=False)),
    ("sd", "ngram", {}),  # the adaptive rule (sd's default)
    ("sd", "model", dict(lookahead=4, adaptive=False)),
    ("sd", "model", {}),
    ("tree", "suffix", dict(tree_width=2, tree_depth=4)),
    ("tree", "model", dict(tree_width=2, tree_depth=4, tree_budget=8)),
]


@pytest.mark.parametrize("name,draft,options", DRAFTS, ids=[f"{n}-{d}-{len(o)}" for n, d, o in DRAFTS])
def test_greedy_constrained_sd_with_forced_tokens_equals_ar(deep_pair, tokenizer, reference, name, draft, options):
    target, draft_model = deep_pair
    params = SamplingParams(max_new_tokens=60, structured=STRUCTURED)
    with Engine(target, draft_model if draft == "model" else draft, strategy=name, dtype="float32", **options) as e:
        result = e.generate(PROMPT, params)
    assert result.token_ids == reference
    # every forced token came in a round's drafts: fewer target rounds than tokens by at least the forced runs
    forced = forced_positions(tokenizer, reference)
    assert forced > len(reference) / 2 and result.stats.accepted >= forced / 2


def test_the_forced_tokens_are_drafted_and_accepted(deep_pair, tokenizer, reference, monkeypatch):
    """sd[ngram] on a schema with long keys: with the forced tokens drafted, most of the answer is accepted drafts
    and the rounds fall; the control (forced tokens switched off) drafts little from the prompt's n-grams."""
    params = SamplingParams(max_new_tokens=60, structured=STRUCTURED)
    with Engine(deep_pair[0], "ngram", strategy="sd", dtype="float32", lookahead=8, adaptive=False) as e:
        result = e.generate(PROMPT, params)
        monkeypatch.setattr(GrammarMatcher, "forced", lambda self, limit: [])
        control = e.generate(PROMPT, params)
    assert result.token_ids == control.token_ids == reference
    forced = forced_positions(tokenizer, reference)
    assert result.stats.accepted >= forced - 4  # a forced token is always accepted (the only one allowed)
    assert result.stats.acceptance_rate > 0.8 and result.stats.accepted > control.stats.accepted + forced / 2
    assert result.stats.rounds < control.stats.rounds / 2


# -- sampling: the tokens after a forced prefix follow the target's constrained joint ---------------------------

N_SAMPLES = 1_200
REGEX = "ab[cd][ef]+"  # "ab" forced, then two free positions (no end token before the fifth)


@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory):
    """Milder logits than deep_pair's (the constrained distribution is not a point mass), a draft that differs."""
    d = tmp_path_factory.mktemp("forced-sampling")
    return make_checkpoint(d / "t", "qwen2", seed=41, scale=3), make_checkpoint(d / "d", "qwen2", seed=42, scale=3)


def constrained_joint(engine, prompt: list[int], params: SamplingParams) -> tuple[np.ndarray, list[list[int]]]:
    """P(x3, x4) of sampling the target under REGEX after the forced "ab" (from its logits and the id sets written
    here, not the matcher's masks)."""
    tok = engine.tokenizer
    a, b = ids(tok, "a")[0], ids(tok, "b")[0]
    allowed = [[ids(tok, ch)[0] for ch in "cd"], [ids(tok, ch)[0] for ch in "ef"]]

    def probs(output, allow):
        logits = engine.target.prefill(prompt + output)
        masked = torch.full_like(logits, float("-inf"))
        masked[allow] = logits[allow]
        return logits_to_probs(masked, params).double()

    p3 = probs([a, b], allowed[0])
    joint = np.zeros((2, 2))
    for i, x3 in enumerate(allowed[0]):
        joint[i] = p3[x3].item() * probs([a, b, x3], allowed[1])[allowed[1]].numpy()
    return joint, allowed


SAMPLED = {
    "sd-model": ("model", "sd", dict(lookahead=4, adaptive=False)),  # "ab" and two of the model's: one-hot rows
    "sd-suffix": ("suffix", "sd", dict(lookahead=4, adaptive=False)),
    "tree-model": ("model", "tree", dict(tree_width=2, tree_depth=4)),  # the model's tree under the forced trunk
}


@pytest.mark.parametrize("case", SAMPLED)
def test_constrained_sampling_after_forced_tokens_matches_the_targets_joint(sampling_pair, case):
    target, draft_model = sampling_pair
    draft, name, options = SAMPLED[case]
    prompt, sampling = [10, 11, 12], dict(temperature=0.9)
    with Engine(target, strategy="ar", dtype="float32") as reference:
        joint, allowed = constrained_joint(reference, prompt, SamplingParams(**sampling))
    assert joint.min() > 0.02 and joint.max() < 0.7  # not a point mass: the test can tell distributions apart
    counts = np.zeros_like(joint)
    drafted = accepted = 0
    with Engine(target, draft_model if draft == "model" else draft, strategy=name, dtype="float32", **options) as e:
        ab = ids(e.tokenizer, "ab")
        for seed in range(N_SAMPLES):
            params = SamplingParams(max_new_tokens=4, seed=seed, structured=("regex", REGEX), **sampling)
            result = e.generate(prompt, params)
            assert result.token_ids[:2] == ab
            counts[allowed[0].index(result.token_ids[2]), allowed[1].index(result.token_ids[3])] += 1
            drafted += result.stats.drafted
            accepted += result.stats.accepted
    assert drafted >= 2 * N_SAMPLES and accepted >= 2 * N_SAMPLES  # "ab" drafted and kept in every answer
    if draft == "model":
        assert 0.05 * (drafted - 2 * N_SAMPLES) < accepted - 2 * N_SAMPLES < 0.95 * (drafted - 2 * N_SAMPLES)
    assert_matches(counts, joint / joint.sum())
