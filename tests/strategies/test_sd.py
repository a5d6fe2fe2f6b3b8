"""sd: what is sd's own (EOS, the confidence stop, sampling at several settings, the power control). Greedy equality
with ar for every draft pattern and lookahead, stops and budgets: tests/strategies/test_lossless.py."""

import numpy as np
import pytest

from paraspec import Engine, SamplingParams
from tests.conftest import PROMPT, VOCAB, assert_matches, exact_joint, inject_costs
from tests.tiny import make_checkpoint

N_SAMPLES = 5_000


@pytest.fixture(scope="module")
def ar_engine(qwen2_target):
    with Engine(qwen2_target, strategy="ar", dtype="float32") as engine:
        yield engine


def test_sd_model_eos_ends_generation(tmp_path):
    """A model whose greedy continuation hits its own EOS id stops there, in ar and sd alike."""
    target = make_checkpoint(tmp_path / "t", "qwen2", seed=11, scale=20, tokenizer=False, vocab_size=40)
    with Engine(target, strategy="ar", dtype="float32") as ar:
        free = ar.generate([3, 4, 5], SamplingParams(max_new_tokens=30)).token_ids
        eos = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
        ar.target.eos_token_ids = (eos,)
        expected = ar.generate([3, 4, 5], SamplingParams(max_new_tokens=30))
    with Engine(target, target, strategy="sd", adaptive=False, lookahead=6, dtype="float32") as sd:
        sd.target.eos_token_ids = (eos,)
        result = sd.generate([3, 4, 5], SamplingParams(max_new_tokens=30))
    assert expected.finish_reason == result.finish_reason == "stop"
    assert result.token_ids == expected.token_ids and result.token_ids[-1] == eos


# -- sampling: the joint distribution of the first two tokens equals the target's ---------------------------


def sampled_joint(engine, prompt, params_for_seed, n: int = N_SAMPLES):
    counts, accepted = np.zeros((VOCAB, VOCAB)), 0
    for seed in range(n):
        result = engine.generate(prompt, params_for_seed(seed))
        x1, x2 = result.token_ids
        counts[x1, x2] += 1
        accepted += result.stats.accepted
    engine.accepted_in_samples = accepted
    return counts


@pytest.mark.parametrize(
    "sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=4), dict(temperature=1.3, top_p=0.8)]
)
def test_sd_sampling_matches_target_distribution(small_vocab_pair, sampling):
    target, draft = small_vocab_pair
    prompt = [1, 2, 3]
    with Engine(target, draft, strategy="sd", adaptive=False, lookahead=3, dtype="float32") as sd:
        joint = exact_joint(sd, prompt, SamplingParams(**sampling))
        counts = sampled_joint(sd, prompt, lambda s: SamplingParams(max_new_tokens=2, seed=s, **sampling))
    # both branches of the acceptance rule ran many times: kept drafts and resampled rejections
    assert 0.1 * N_SAMPLES < sd.accepted_in_samples < 0.9 * N_SAMPLES
    assert_matches(counts, joint)


POWER_SAMPLES = 1_500  # a check that rejects the lossy decoder at 1,500 samples rejects it at 5,000 (chi-square's
# statistic grows with the sample count for a fixed difference); 5,000 cost CI 43 s


def test_sampling_check_has_power(small_vocab_pair):
    """Sampling the draft alone (a lossy 'speculative' decoder) is rejected by the same check, even on fewer
    samples than the tests above take."""
    target, draft = small_vocab_pair
    prompt = [1, 2, 3]
    with Engine(target, strategy="ar", dtype="float32") as tgt, Engine(draft, strategy="ar", dtype="float32") as d:
        joint = exact_joint(tgt, prompt, SamplingParams(temperature=1.0))
        counts = sampled_joint(
            d, prompt, lambda s: SamplingParams(max_new_tokens=2, seed=s, temperature=1.0), POWER_SAMPLES
        )
    with pytest.raises(AssertionError):
        assert_matches(counts, joint)


@pytest.mark.parametrize("confidence", [0.3, 0.9])
def test_sd_confidence_stop_equals_ar(ar_engine, qwen2_target, qwen2_partial, confidence):
    """Stopping a round's drafting where the draft is unsure (HF's assisted-generation rule) stays exact,
    and really shortens rounds."""
    params = SamplingParams(max_new_tokens=40)
    with Engine(
        qwen2_target,
        qwen2_partial,
        strategy="sd",
        adaptive=False,
        lookahead=12,
        draft_confidence=confidence,
        dtype="float32",
    ) as sd:
        result = sd.generate(PROMPT, params)
    assert result.token_ids == ar_engine.generate(PROMPT, params).token_ids
    assert result.stats.drafted < 12 * result.stats.rounds


def test_sd_trace_counts_the_tokens_really_drafted(qwen2_target, qwen2_partial):
    with Engine(
        qwen2_target, qwen2_partial, strategy="sd", adaptive=False, lookahead=12, draft_confidence=0.9, dtype="float32"
    ) as sd:
        result = sd.generate(PROMPT, SamplingParams(max_new_tokens=30))
    drafted = sum(e.tokens for e in result.trace.events if e.kind == "draft")
    assert drafted == result.stats.drafted < 12 * result.stats.rounds


def test_sd_traces_the_prompt_forward_as_the_prefill(ar_engine, qwen2_target, qwen2_partial):
    """The first round's target forward takes the prompt and verifies the first drafts (a native model runs them in
    one forward): the timeline shows it as the prefill, like ar's, and every later target forward as a
    verification; verify_s counts only those."""
    with Engine(qwen2_target, qwen2_partial, strategy="sd", adaptive=False, lookahead=4, dtype="float32") as sd:
        result = sd.generate(PROMPT, SamplingParams(max_new_tokens=20))
        prompt = len(sd.encode(PROMPT))
    target = [e for e in result.trace.events if e.device == "target"]
    assert target[0].kind == "prefill" and target[0].tokens == prompt + 4
    assert {e.kind for e in target[1:]} == {"verify"} and all(e.tokens <= 5 for e in target[1:])
    assert result.stats.verify_s == pytest.approx(sum(e.duration_s for e in target[1:]))
    assert [e.kind for e in ar_engine.generate(PROMPT, SamplingParams(max_new_tokens=3)).trace.events][0] == "prefill"


def test_set_options_reaches_the_kept_drafters(qwen2_target):
    """The drafters are built with the drafter options; set_options builds them again at once (a changed option
    would otherwise be ignored), and they are kept across requests while nothing changes."""
    with Engine(qwen2_target, "suffix", strategy="sd", dtype="float32") as sd:
        sd.generate(PROMPT, SamplingParams(max_new_tokens=4))
        kept = sd.strategy.policy
        sd.generate(PROMPT, SamplingParams(max_new_tokens=4))
        assert sd.strategy.policy is kept and kept.drafters[0].factor == 0.0 and kept.drafters[0].memory
        sd.set_options(suffix_factor=3.0, draft_memory=False, suffix_min_prob=0.5)
        rebuilt = sd.strategy.policy  # by set_options, before the next request
        assert rebuilt is not kept and sd.options["suffix_factor"] == 3.0
        suffix = rebuilt.drafters[0]
        assert (suffix.factor, suffix.memory, suffix.min_prob) == (3.0, None, 0.5)
        sd.generate(PROMPT, SamplingParams(max_new_tokens=4))
        assert sd.strategy.policy is rebuilt
        with pytest.raises(ValueError, match="suffix_min_prob must be <= 1"):
            sd.set_options(suffix_min_prob=1.5)


# -- the default: the adaptive rule, standing aside for seeded sampled requests ---------------------------------


def with_costs(engine, per_token: float) -> None:
    """Give the rule verification costs that make drafting pay (flat) or never pay (steep), whatever it measured."""
    inject_costs(engine, {1: 0.01, 64: 0.01 + 63 * per_token}, {1: 1e-4, 64: 1e-4})


def rounds_and_tokens(engine, params):
    result = engine.generate(PROMPT, params)
    plans = [e for e in result.trace.events if e.kind == "plan"]
    return result.token_ids, result.stats.drafted, bool(plans), "adaptive" in result.worker_reports


def test_sd_default_is_the_rule_but_a_seeded_sample_repeats(ar_engine, qwen2_target, qwen2_partial):
    """sd's default (adaptive=None, auto): greedy and unseeded requests are the rule's (its plan events and
    report), and greedy answers are ar's; a sampled request with a seed drafts `lookahead` every round, so the
    same seed gives the same tokens after the rule's costs changed. With adaptive=True the same change moves
    where its rounds end (what would make a seeded answer drift)."""
    greedy = SamplingParams(max_new_tokens=24)
    seeded = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5)
    with Engine(qwen2_target, qwen2_partial, strategy="sd", lookahead=4, dtype="float32", max_num_seqs=1) as sd:
        assert sd.options["adaptive"] is None and sd.strategy.policy.auto
        with_costs(sd, 0.0)
        tokens, drafted, planned, reported = rounds_and_tokens(sd, greedy)
        assert tokens == ar_engine.generate(PROMPT, greedy).token_ids and planned and reported and drafted > 0
        _, _, planned, _ = rounds_and_tokens(sd, SamplingParams(max_new_tokens=8, temperature=1.0))
        assert planned  # unseeded: the rule's
        first = rounds_and_tokens(sd, seeded)
        with_costs(sd, 1.0)  # drafting would never pay now
        assert rounds_and_tokens(sd, greedy)[1] < drafted  # the rule decodes greedy requests (nearly) plainly
        again = rounds_and_tokens(sd, seeded)
        assert first == again and not first[2] and not first[3] and first[1] > 0
    with Engine(
        qwen2_target, qwen2_partial, strategy="sd", lookahead=4, dtype="float32", max_num_seqs=1, adaptive=True
    ) as rule:
        with_costs(rule, 0.0)
        cheap = rounds_and_tokens(rule, seeded)
        with_costs(rule, 1.0)
        steep = rounds_and_tokens(rule, seeded)
        assert cheap[2] and cheap[1] > steep[1]  # the same seed, other rounds
