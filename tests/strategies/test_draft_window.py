"""The draft's window (`draft_window`): a draft model reads at most the last N tokens of the context it has not
cached. What it changes is what the draft reads (so its proposals and q), never what the target decides: greedy
answers stay ar's, sampled ones follow the target's distribution, for sd (in-process) and the worker drafters
(amusd, dsi)."""

import pytest
import torch

from paraspec import Engine, SamplingParams
from paraspec.drafters import ModelDrafter
from paraspec.models.loader import load_model
from paraspec.sampling import logits_to_probs, make_generator
from tests.conftest import PROMPT, assert_matches, exact_joint
from tests.strategies.conftest import check_draft_cache
from tests.strategies.test_lossless import N_SAMPLES, SAMPLING, ar, engine, sample_first_two

WINDOW = 4
GREEDY = SamplingParams(max_new_tokens=1)


@pytest.fixture(scope="module")
def draft_model(qwen2_partial):
    return load_model(qwen2_partial, "float32")


def test_the_draft_reads_the_last_window_tokens_only(draft_model):
    """The catch-up of a 12-token sequence is its last 4 tokens, at positions from 0: the q of the first draft is a
    fresh prefill's of those 4 (not of all 12); the sequence's positions map onto the cache's through rollbacks."""
    sequence = list(range(3, 15))
    sampled = SamplingParams(max_new_tokens=1, temperature=1.0)
    drafter = ModelDrafter(draft_model, draft_model.vocab_size, window=WINDOW)
    drafter.reset()
    assert drafter.behind(sequence) == WINDOW
    proposal = drafter.propose(sequence, 3, sampled, make_generator(0))
    assert draft_model.length == WINDOW + 2 and drafter.length == len(sequence) + 2 and drafter.offset == 8
    draft_model.rollback(0)
    whole = logits_to_probs(draft_model.prefill(sequence), sampled)
    draft_model.rollback(0)
    window = logits_to_probs(draft_model.prefill(sequence[-WINDOW:]), sampled)
    assert torch.allclose(proposal.q[0], window, atol=1e-6) and not torch.allclose(proposal.q[0], whole, atol=1e-3)
    draft_model.forward(proposal.tokens[:2])  # the drafter's cache as it was: the window, then two drafts

    drafter.rollback(len(sequence) + 1)  # the first draft kept: the sequence's positions, not the cache's
    assert draft_model.length == WINDOW + 1 and drafter.behind(sequence + proposal.tokens[:2]) == 1
    drafter.rollback(5)  # into what the window skipped: afresh, the next catch-up windowed again
    assert draft_model.length == 0 and drafter.offset == 0
    longer = sequence + [7] * 9
    drafter.propose(longer, 1, GREEDY, make_generator(0))
    assert drafter.offset == len(longer) - WINDOW and draft_model.length == WINDOW

    # a cache far behind (more than the window to read): it starts afresh on the last window's tokens
    drafter.propose(longer + [9] * 6, 1, GREEDY, make_generator(0))
    assert drafter.offset == len(longer) + 6 - WINDOW and draft_model.length == WINDOW


def test_without_a_window_the_draft_reads_everything(draft_model):
    sequence = list(range(3, 15))
    drafter = ModelDrafter(draft_model, draft_model.vocab_size)
    drafter.reset()
    assert drafter.behind(sequence) == len(sequence)
    drafter.propose(sequence, 2, GREEDY, make_generator(0))
    assert draft_model.length == len(sequence) + 1 and drafter.offset == 0


@pytest.mark.parametrize("name", ["sd", "amusd", "dsi"])
def test_a_windowed_draft_returns_ar_tokens(qwen2_target, qwen2_partial, name):
    params = SamplingParams(max_new_tokens=40)
    shape = dict(sd=dict(lookahead=4, adaptive=False), amusd=dict(max_ahead=6), dsi=dict(lookahead=3))[name]
    with ar(qwen2_target) as reference:
        expected = reference.generate(PROMPT, params).token_ids
    with engine(name, qwen2_target, qwen2_partial, draft_window=WINDOW, **shape) as e:
        assert len(e.encode(PROMPT)) > WINDOW
        result = e.generate(PROMPT, params)
        assert result.token_ids == expected
        assert 0 < result.stats.accepted < result.stats.drafted
        if name == "sd":  # the prompt's catch-up was the window's
            assert e.strategy.policy.drafters[0].offset >= len(result.prompt_ids) - WINDOW
        else:  # the worker's record of its cache: the window's tokens, after what it skipped
            assert result.worker_reports["draft"]["offset"] >= len(result.prompt_ids) - WINDOW
            check_draft_cache(e, result)


def test_a_windowed_draft_samples_the_targets_distribution(slow_target_pair):
    """The draft reads the prompt's last 2 tokens of 3: its q differs from the full-context draft's, and is still
    the distribution each draft was drawn from, so the first two tokens follow the target's joint. (The worker
    drafters draft with the same ModelDrafter.propose; their sampling is amusd's and dsi's own tests'.)"""
    target, draft = slow_target_pair
    prompt = [1, 2, 3]
    with engine("sd", target, draft, draft_window=2, lookahead=3, adaptive=False) as e, ar(target) as reference:
        joint = exact_joint(reference, prompt, SamplingParams(**SAMPLING))
        counts, drafted, accepted = sample_first_two(e, prompt)
    assert drafted > N_SAMPLES / 2 and 0.05 * drafted < accepted < 0.95 * drafted  # both branches ran
    assert_matches(counts, joint)


def test_a_window_is_an_option_of_the_draft_model_strategies_only(qwen2_target, qwen2_partial):
    with pytest.raises(ValueError, match="draft_window"):
        Engine(qwen2_target, qwen2_partial, strategy="tree", dtype="float32", draft_window=4)
    with pytest.raises(ValueError, match="draft_window must be >= 0"):
        Engine(qwen2_target, qwen2_partial, strategy="sd", dtype="float32", draft_window=-1)
