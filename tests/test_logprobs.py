"""Logprobs (SamplingParams.logprobs): the target's log-softmax at each output token, the same from every strategy
that reports them as from `ar`, and refused by name where the target's rows stay in a worker."""

import pytest
import torch

from paraspec import Engine, SamplingParams
from tests.conftest import PROMPT, inject_flat_costs, on_device

LOCAL = ["ar", "sd", "tree", "easyspec"]


def build(name, target, draft):
    devices = {"easyspec": dict(draft_devices=["cpu:0", "cpu:1"])}.get(name, {})
    return Engine(
        target, None if name == "ar" else draft, strategy=name, dtype="float32", max_num_seqs=1, **on_device(**devices)
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


@pytest.mark.parametrize("name", [n for n in LOCAL if n != "ar"])
def test_speculative_strategies_report_ars_logprobs(ar_logprobs, qwen2_target, qwen2_partial, name):
    """Each output token's row comes from the verification that committed it (accepted drafts, the correction or
    the bonus), and matches ar's one-token row."""
    reference, _ = ar_logprobs
    with build(name, qwen2_target, qwen2_partial) as e:
        if e.strategy.policy is not None and e.strategy.policy.adaptive:
            inject_flat_costs(e)  # the adaptive rule drafts whatever this machine's load
        result = e.generate(PROMPT, SamplingParams(max_new_tokens=12, logprobs=3))
    assert result.token_ids == reference.token_ids and result.stats.drafted > 0
    for mine, theirs in zip(result.logprobs, reference.logprobs, strict=True):
        assert mine.token == theirs.token
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]


def test_no_logprobs_unless_asked(qwen2_target):
    with build("ar", qwen2_target, None) as e:
        assert e.generate(PROMPT, SamplingParams(max_new_tokens=3)).logprobs is None
        assert [lp.top for lp in e.generate(PROMPT, SamplingParams(max_new_tokens=3, logprobs=0)).logprobs] == [()] * 3


def test_worker_strategies_refuse_logprobs_by_name(qwen2_target, qwen2_partial):
    with Engine(qwen2_target, qwen2_partial, strategy="amusd", dtype="float32", **on_device()) as e:
        with pytest.raises(ValueError, match="'amusd' does not report logprobs .* use one of ar, sd"):
            e.generate(PROMPT, SamplingParams(max_new_tokens=3, logprobs=1))


def test_logprobs_are_checked():
    with pytest.raises(ValueError, match="logprobs must be an integer in 0 .. 20"):
        SamplingParams(logprobs=21)


@pytest.mark.parametrize("name", LOCAL)
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
