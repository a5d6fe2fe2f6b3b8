"""Logprobs (SamplingParams.logprobs): the target's log-softmax at each output token, the same from every strategy
as from `ar` (amusd's verifier computes them in its worker and reports them; dsi's servers send their rows back)."""

import pytest
import torch

from paraspec import Engine, SamplingParams
from tests.conftest import PROMPT, inject_flat_costs, on_device

STRATEGIES = ["ar", "sd", "tree", "easyspec", "amusd", "dsi"]
DEVICES = {"easyspec": dict(draft_devices=["cpu:0", "cpu:1"]), "dsi": dict(target_devices=["cpu:0", "cpu:1"])}
WORKERS = {"amusd": dict(max_ahead=4, verify_chunk=2), "dsi": dict(lookahead=3)}  # their workers as threads


def build(name, target, draft):
    options = dict(WORKERS[name], runtime_kind="inprocess") if name in WORKERS else dict(max_num_seqs=1)
    return Engine(
        target,
        None if name == "ar" else draft,
        strategy=name,
        dtype="float32",
        **options,
        **on_device(**DEVICES.get(name, {})),
    )


@pytest.fixture(scope="module")
def ar_logprobs(qwen2_target):
    with build("ar", qwen2_target, None) as e:
        return e.generate(PROMPT, SamplingParams(max_new_tokens=12, logprobs=3)), e.target.vocab_size


def test_ar_reports_the_targets_log_softmax_at_each_token(ar_logprobs, qwen2_target):
    result, _ = ar_logprobs
    assert [lp.token for lp in result.logprobs] == result.token_ids
    with build("ar", qwen2_target, None) as e:
        target = e.target
        for i, lp in enumerate(result.logprobs):
            target.rollback(0)
            row = torch.log_softmax(target.prefill(result.prompt_ids + result.token_ids[:i]).float(), -1)
            assert lp.logprob == pytest.approx(float(row[lp.token]), abs=1e-4)
            top = row.topk(3)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert lp.top[0][1] >= lp.logprob  # greedy: the chosen token is the likeliest
            assert lp.top[0][0] == lp.token


@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "ar"])
def test_speculative_strategies_report_ars_logprobs(ar_logprobs, qwen2_target, qwen2_partial, name):
    """Each output token's row comes from the verification that committed it (accepted drafts, the correction or
    the bonus, a draft judged from a row in hand), and matches ar's one-token row."""
    reference, _ = ar_logprobs
    with build(name, qwen2_target, qwen2_partial) as e:
        if getattr(e.strategy, "policy", None) is not None and e.strategy.policy.adaptive:
            inject_flat_costs(e)  # the adaptive rule drafts whatever this machine's load
        result = e.generate(PROMPT, SamplingParams(max_new_tokens=12, logprobs=3))
    assert result.token_ids == reference.token_ids and result.stats.drafted > 0
    assert 0 < result.stats.accepted < result.stats.drafted  # accepted drafts and corrections both reported
    for mine, theirs in zip(result.logprobs, reference.logprobs, strict=True):
        assert mine.token == theirs.token
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
        assert [v for _, v in mine.top] == pytest.approx([v for _, v in theirs.top], abs=1e-4)


@pytest.mark.parametrize("name", ["sd", "amusd", "dsi"])
def test_sampled_tokens_report_the_targets_raw_row(qwen2_target, qwen2_partial, name):
    """Sampling with a bias and a penalty: each token's logprob is still the target's raw log-softmax on the output
    before it (vLLM's raw logprobs), whichever path committed it (an accepted draft, a residual's draw, the bonus)."""
    params = SamplingParams(
        max_new_tokens=10, temperature=1.0, seed=3, logprobs=2, presence_penalty=1.0, logit_bias={3: 1.0}
    )
    with build(name, qwen2_target, qwen2_partial) as e:
        result = e.generate(PROMPT, params)
    assert result.stats.drafted > 0
    with build("ar", qwen2_target, None) as reference:
        for i, lp in enumerate(result.logprobs):
            reference.target.rollback(0)
            row = torch.log_softmax(reference.target.prefill(result.prompt_ids + result.token_ids[:i]).float(), -1)
            assert lp.token == result.token_ids[i]
            assert lp.logprob == pytest.approx(float(row[lp.token]), abs=1e-4)
            assert [t for t, _ in lp.top] == row.topk(2).indices.tolist()


def test_no_logprobs_unless_asked(qwen2_target):
    with build("ar", qwen2_target, None) as e:
        assert e.generate(PROMPT, SamplingParams(max_new_tokens=3)).logprobs is None
        assert [lp.top for lp in e.generate(PROMPT, SamplingParams(max_new_tokens=3, logprobs=0)).logprobs] == [()] * 3


def test_logprobs_are_checked():
    with pytest.raises(ValueError, match="logprobs must be an integer in 0 .. 20"):
        SamplingParams(logprobs=21)


@pytest.mark.parametrize("name", STRATEGIES)
def test_prompt_logprobs_score_each_prompt_token_given_the_ones_before(qwen2_target, qwen2_partial, name):
    """vLLM's prompt_logprobs (what `echo` with logprobs returns): one forward over the prompt; the answer after it
    is the one without it."""
    with build("ar", qwen2_target, None) as reference:
        plain = reference.generate(PROMPT, SamplingParams(max_new_tokens=6))
        target = reference.target
        target.rollback(0)
        ids = plain.prompt_ids
        rows = torch.log_softmax(target.forward(ids, last_n=len(ids)).float(), -1)
    with build(name, qwen2_target, qwen2_partial) as e:
        result = e.generate(PROMPT, SamplingParams(max_new_tokens=6, prompt_logprobs=2))
    assert result.token_ids == plain.token_ids
    scored = result.prompt_logprobs
    assert scored[0] is None and [lp.token for lp in scored[1:]] == ids[1:]
    for i, lp in enumerate(scored[1:]):
        assert lp.logprob == pytest.approx(float(rows[i][ids[i + 1]]), abs=1e-4)
        assert [t for t, _ in lp.top] == rows[i].topk(2).indices.tolist()
