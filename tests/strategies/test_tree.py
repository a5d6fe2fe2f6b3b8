"""tree: masks and positions against a brute-force reference, KV compaction, greedy equality with ar, and the
sampling distribution (multi-step speculative sampling over i.i.d. siblings), with a control that a wrong
rule is caught."""

import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from paraspec import Engine, SamplingParams, verify
from paraspec.drafters.token_tree import DraftTreeCache, TokenTree, draft_tree
from paraspec.models.loader import load_native
from paraspec.models.native.layer_parallel import exact_forward
from paraspec.request_state import RequestState
from paraspec.sampling import make_generator
from paraspec.strategies.tree import tree_mask, verification_inputs
from paraspec.verify import multi_step_accept, residual, verify_tree
from tests.conftest import PROMPT, VOCAB, assert_matches, exact_joint


def random_tree(rng: random.Random, n: int, vocab: int) -> TokenTree:
    tree = TokenTree()
    for i in range(n):
        tree.add(rng.randrange(vocab), rng.randrange(-1, i))
    return tree


def brute_path(tree: TokenTree, node: int) -> list[int]:
    """Root-down node indices from the root's child to `node`, by walking parent links."""
    path = [node]
    while tree.parents[path[-1]] >= 0:
        path.append(tree.parents[path[-1]])
    return path[::-1]


def test_mask_and_positions_match_brute_force():
    rng = random.Random(0)
    for _ in range(50):
        tree = random_tree(rng, rng.randrange(1, 12), 50)
        pending = [rng.randrange(50) for _ in range(rng.randrange(1, 4))]
        first = rng.randrange(0, 20)
        tokens, positions, mask = verification_inputs(pending, tree, first)
        n_p = len(pending)
        assert tokens == pending + tree.tokens
        for i in range(len(tokens)):
            for j in range(len(tokens)):
                if i < n_p:
                    expected = j <= i
                elif j < n_p:
                    expected = True
                else:
                    expected = (j - n_p) in brute_path(tree, i - n_p)
                assert bool(mask[i, j]) == expected
            expected_pos = first + i if i < n_p else first + n_p - 1 + len(brute_path(tree, i - n_p))
            assert positions[i] == expected_pos
        assert torch.equal(tree_mask(tree.parents), mask[n_p:, n_p:])


@pytest.fixture(scope="module")
def models(qwen2_target, qwen2_partial):
    return load_native(qwen2_target, torch.float32), load_native(qwen2_partial, torch.float32)


def test_tree_forward_gives_each_branch_its_sequential_logits(models):
    """One target forward over a random tree equals, node by node, the plain forward of prefix + its path."""
    target, _ = models
    rng = random.Random(1)
    prefix = [rng.randrange(100) for _ in range(7)]
    tree = random_tree(rng, 10, 100)
    target.prefill(prefix[:4])
    tokens, positions, mask = verification_inputs(prefix[4:], tree, 4)
    logits = target.forward(tokens, positions=positions, tree_mask=mask, last_n=len(tree) + 1)
    for node in range(len(tree)):
        path = [tree.tokens[i] for i in brute_path(tree, node)]
        reference = target.prefill(prefix + path)
        assert (logits[node + 1] - reference).abs().max() < 1e-4


def test_draft_levels_and_compaction_match_sequential_decoding(models):
    """Level-by-level drafting sees exactly each node's ancestors; after accepting a path, the draft cache equals
    the cache of plain decoding of prefix + path (keep_path), and decoding continues from it exactly."""
    _, draft = models
    prefix = [5, 9, 14, 3, 22]
    run = RequestState(prefix, SamplingParams(), frozenset(), make_generator(0), 256)
    root = draft.prefill(prefix)
    seen = {}

    def forward(tokens, positions, mask):
        logits = exact_forward(draft, tokens, positions, mask)
        seen.update({len(seen) + i: row for i, row in enumerate(logits)})
        return logits

    cache = DraftTreeCache(draft, forward, len(prefix))
    tree = draft_tree(root, cache, run.params, run.generator, draft.vocab_size, width=3, depth=4, budget=20)
    assert len(tree) == 12 and tree.depth == 4 and len(cache.slots) == 9
    assert tree.tokens[:3] == torch.topk(root, 3).indices.tolist()
    for node, slot in cache.slots.items():
        path = [tree.tokens[i] for i in brute_path(tree, node)]
        reference = _fresh(draft).prefill(prefix + path)
        assert (seen[slot - len(prefix)] - reference).abs().max() < 1e-4
    deepest = max((n for n in cache.slots), key=lambda n: tree.depths[n])
    path = brute_path(tree, deepest)
    cache.accept(path)
    tokens = prefix + [tree.tokens[i] for i in path]
    assert draft.length == len(tokens)
    reference = _fresh(draft)
    reference.prefill(tokens)
    n = len(tokens)
    assert torch.allclose(draft.cache.k[:, :, :n], reference.cache.k[:, :, :n], atol=1e-5)
    assert torch.allclose(draft.cache.v[:, :, :n], reference.cache.v[:, :, :n], atol=1e-5)
    assert (draft.forward([7]) - reference.forward([7])).abs().max() < 1e-4


def _fresh(model):
    from paraspec.models.native.decoder import NativeModel

    return NativeModel(model.decoder, model.max_context, model.eos_token_ids)


def test_keep_path_moves_only_the_path(models):
    """The Model protocol's keep_path on the native model: the prefix stays, the slots move next to it."""
    model = _fresh(models[0])
    model.forward(list(range(1, 10)))
    k, v = model.cache_entries(9)
    model.keep_path(3, [4, 6, 7])
    assert model.length == 6
    k2, v2 = model.cache_entries(6)
    assert torch.equal(k2, k[:, :, [0, 1, 2, 4, 6, 7]]) and torch.equal(v2, v[:, :, [0, 1, 2, 4, 6, 7]])


def test_keep_path_of_backends_that_cannot_move_entries():
    """A chain is a rollback; anything else is refused with the fix named (HF) -- or, for the simulated model,
    whose predictions depend only on positions, is the new length."""
    from paraspec.models.base import keep_chain
    from paraspec.models.simulated import SimulatedModel, SimulatedSpec

    sim = SimulatedModel(SimulatedSpec())
    sim.forward(list(range(8)))
    keep_chain(sim, 3, [3, 4])
    assert sim.length == 5
    with pytest.raises(ValueError, match="native backend"):
        keep_chain(sim, 2, [3])
    sim.forward([1, 2, 3])
    sim.keep_path(2, [5, 7])
    assert sim.length == 4


# -- greedy: exactly ar's tokens ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ar_engine(qwen2_target):
    with Engine(qwen2_target, strategy="ar", dtype="float32") as engine:
        yield engine


def test_tree_beats_chain_on_accepted_length(qwen2_target, qwen2_partial):
    """Wider trees accept at least as many tokens per round with the same draft (greedy, same depth)."""
    params = SamplingParams(max_new_tokens=40)
    lengths = []
    for width in (1, 4):
        with Engine(
            qwen2_target,
            qwen2_partial,
            strategy="tree",
            dtype="float32",
            tree_width=width,
            tree_depth=4,
            tree_budget=64,
        ) as engine:
            lengths.append(engine.generate(PROMPT, params).stats.mean_accepted_length)
    assert lengths[1] >= lengths[0]


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5])
def test_tree_never_overshoots(ar_engine, qwen2_target, qwen2_partial, max_new_tokens):
    params = SamplingParams(max_new_tokens=max_new_tokens)
    with Engine(qwen2_target, qwen2_partial, strategy="tree", dtype="float32", max_context=64) as engine:
        assert engine.generate(PROMPT, params).token_ids == ar_engine.generate(PROMPT, params).token_ids
        long = engine.generate(PROMPT, SamplingParams(max_new_tokens=200))
    assert long.finish_reason == "context" and len(long.prompt_ids) + len(long.token_ids) == 64


# -- sampling: multi-step speculative sampling is exact ------------------------------------------------------


def wrong_multi_step_accept(candidates, p, q, generator):
    """A plausible bug: every sibling judged against the original p (no residual between siblings)."""
    for i, token in enumerate(candidates):
        if torch.rand((), generator=generator).item() * float(q[token]) < float(p[token]):
            return i, token
    return None, verify.sample(residual(p, q), generator)


def mss_counts(rule, p, q, width, n, seed=0):
    g = make_generator(seed)
    counts = np.zeros(p.shape[0])
    for _ in range(n):
        children = torch.multinomial(q, width, replacement=True, generator=g).tolist()
        counts[rule(children, p, q, g)[1]] += 1
    return counts


def test_multi_step_accept_outputs_p():
    """The pure rule, three i.i.d. siblings: the output token follows p; the wrong rule does not."""
    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    q = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2])
    counts = mss_counts(multi_step_accept, p, q, 3, 20_000)
    assert counts[4] == 0
    assert chisquare(counts[:4], p[:4].numpy() * counts.sum()).pvalue > 1e-3
    wrong = mss_counts(wrong_multi_step_accept, p, q, 3, 20_000)
    assert chisquare(wrong[:4], p[:4].numpy() * wrong.sum()).pvalue < 1e-6


N_SAMPLES = 2_000
SAMPLING = dict(temperature=0.9, top_k=5)  # top-k: q has zeros, as real samplers make


def tree_joint_counts(engine, prompt, sampling):
    counts, accepted = np.zeros((VOCAB, VOCAB)), 0
    for seed in range(N_SAMPLES):
        result = engine.generate(prompt, SamplingParams(max_new_tokens=3, seed=seed, **sampling))
        x1, x2 = result.token_ids[:2]
        counts[x1, x2] += 1
        accepted += result.stats.accepted
    return counts, accepted


def test_tree_sampling_matches_target_distribution(small_vocab_pair):  # noqa: F811
    """Depth 2, width 3 (siblings often repeat a token in a 6-token vocabulary): the first two tokens follow
    the target's exact joint distribution."""
    target, draft = small_vocab_pair
    prompt = [1, 2, 3]
    with Engine(target, draft, strategy="tree", dtype="float32", tree_width=3, tree_depth=2, tree_budget=12) as engine:
        joint = exact_joint(engine, prompt, SamplingParams(**SAMPLING))
        counts, accepted = tree_joint_counts(engine, prompt, SAMPLING)
    assert 0.2 * N_SAMPLES < accepted < 1.8 * N_SAMPLES  # drafts were really accepted and rejected
    assert_matches(counts, joint)


def test_tree_sampling_check_catches_a_wrong_rule(small_vocab_pair, monkeypatch):  # noqa: F811
    target, draft = small_vocab_pair
    prompt = [1, 2, 3]
    monkeypatch.setattr(verify, "multi_step_accept", wrong_multi_step_accept)
    with Engine(target, draft, strategy="tree", dtype="float32", tree_width=3, tree_depth=2, tree_budget=12) as engine:
        joint = exact_joint(engine, prompt, SamplingParams(**SAMPLING))
        counts, _ = tree_joint_counts(engine, prompt, SAMPLING)
    with pytest.raises(AssertionError):
        assert_matches(counts, joint)


def test_verify_tree_greedy_follows_argmax():
    tree = TokenTree()
    a, b = tree.add(3, -1), tree.add(1, -1)
    c = tree.add(2, b)
    logits = torch.full((4, 5), -1.0)
    logits[0, 1] = logits[2, 2] = logits[3, 4] = 5.0  # root -> 1 (node b) -> 2 (node c) -> bonus 4
    path, token = verify_tree(tree.tokens, tree.parents, None, logits, SamplingParams(), make_generator(0))
    assert path == [b, c] and token == 4
    logits[0, 1], logits[0, 0] = -1.0, 5.0  # root wants 0: nothing accepted, correction 0
    assert verify_tree(tree.tokens, tree.parents, None, logits, SamplingParams(), make_generator(0)) == ([], 0)
    assert a == 0
