import numpy as np
import pytest
import torch

from paraspec.sampling import SamplingParams, adjust_logits, logits_to_probs


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [2.0, 0.0, 1.0]])
    probs = logits_to_probs(logits, SamplingParams())
    assert probs.tolist() == [[0, 1, 0], [1, 0, 0]]


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(
        logits_to_probs(logits, SamplingParams(temperature=1.0)), torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=1e-6
    )
    top2 = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    # top_p 0.8: 0.5 + 0.3 reaches 0.8, so the third token is dropped
    top_p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(top_p, torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    top_p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert torch.allclose(top_p, torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95, atol=1e-6)
    hot = logits_to_probs(logits, SamplingParams(temperature=2.0))
    expected = torch.tensor([0.5, 0.3, 0.15, 0.05]).sqrt()
    assert torch.allclose(hot, expected / expected.sum(), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(seed="x"), "seed"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_invalid_sampling_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sample_draws_from_the_given_probabilities():
    """The inverse-CDF sampler: a chi-square test on 40,000 draws from a 6-token distribution with zeros (never
    drawn: not at the start, the middle or the end), unnormalised weights drawn the same way, bad input refused."""
    from scipy.stats import chisquare

    from paraspec.sampling import sample
    from tests.conftest import TEST_DEVICE

    probs = torch.tensor([0.0, 0.1, 0.0, 0.45, 0.3, 0.15, 0.0])
    gen = torch.Generator().manual_seed(0)
    on_device = probs.to(TEST_DEVICE)  # drawn where the logits are, with the CPU generator
    counts = np.bincount([sample(on_device, gen) for _ in range(40_000)], minlength=len(probs))
    assert counts[[0, 2, 6]].sum() == 0
    kept = probs > 0
    assert chisquare(counts[kept.numpy()], 40_000 * probs[kept].numpy()).pvalue > 1e-3
    weights = probs * 7.5
    counts = np.bincount([sample(weights, gen) for _ in range(20_000)], minlength=len(probs))
    assert counts[[0, 2, 6]].sum() == 0
    assert chisquare(counts[kept.numpy()], 20_000 * probs[kept].numpy()).pvalue > 1e-3
    assert sample(torch.tensor([0.0, 0.0, 1.0]), gen) == 2
    for bad in (
        torch.zeros(3),
        torch.tensor([0.5, float("nan")]),
        torch.tensor([1.5, -0.5]),
        torch.tensor([float("inf"), 1.0]),
    ):
        with pytest.raises(ValueError, match="cannot sample"):
            sample(bad, gen)


def test_sample_on_a_gpu_draws_from_the_cpu_generator():
    """Probabilities on cuda, the generator on the CPU (make_generator's): the uniform is drawn there and searched
    for as a number, so each seed gives the token it gives on the CPU, with two read-backs per draw (the total and
    the minimum together, then the index). tests/fake_cuda.py raises where CUDA would mix devices."""
    from paraspec.sampling import make_generator, sample
    from tests.fake_cuda import fake_cuda

    probs = torch.tensor([0.0, 0.1, 0.0, 0.45, 0.3, 0.15, 0.0])
    on_cpu = [sample(probs, make_generator(seed)) for seed in range(200)]
    with fake_cuda() as cuda:
        on_cuda = [sample(cuda.tensor(probs), make_generator(seed)) for seed in range(200)]
        assert cuda.reads == 2 * 200
        with pytest.raises(ValueError, match="cannot sample"):
            sample(cuda.tensor([1.5, -0.5]), make_generator(0))
    assert on_cuda == on_cpu and set(on_cpu) == {1, 3, 4, 5}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sample_on_a_real_gpu_gives_the_cpu_tokens():
    from paraspec.sampling import make_generator, sample

    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    probs = logits_to_probs(logits, SamplingParams(temperature=0.8, top_k=100, top_p=0.9))
    on_cpu = [sample(probs, make_generator(seed)) for seed in range(100)]
    assert [sample(probs.to("cuda:0"), make_generator(seed)) for seed in range(100)] == on_cpu


# -- the processor chain: logit bias and penalties (adjust_logits), min-p ----------------------------------------


def test_nothing_to_adjust_returns_the_logits_themselves():
    logits = torch.randn(3, 10)
    assert adjust_logits(logits, SamplingParams(temperature=1.0), [1, 2], [3], [4, 5]) is logits


def test_logit_bias_adds_to_the_named_tokens():
    logits = torch.zeros(2, 6)
    out = adjust_logits(logits, SamplingParams(logit_bias={4: 100.0, 1: -2.5}))
    expected = torch.zeros(2, 6)
    expected[:, 4], expected[:, 1] = 100.0, -2.5
    assert torch.equal(out, expected) and torch.equal(logits, torch.zeros(2, 6))  # the input is not changed
    with pytest.raises(ValueError, match="names token 9, but the vocabulary has 6"):
        adjust_logits(logits, SamplingParams(logit_bias={9: 1.0}))


def test_frequency_and_presence_penalties_count_the_output_before_each_row():
    """Row i sees the output and the drafts before it; the prompt does not count (OpenAI's and vLLM's rule)."""
    params = SamplingParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.25)
    logits = torch.zeros(3, 5)
    out = adjust_logits(logits, params, prompt=[4, 4, 4], output=[1, 1, 2], row_tokens=[2, 3, 0])
    counts = torch.tensor([[0, 2, 1, 0, 0], [0, 2, 2, 0, 0], [0, 2, 2, 1, 0]], dtype=torch.float)
    assert torch.allclose(out, -(0.5 * counts + 0.25 * (counts > 0).float()))
    one_row = adjust_logits(torch.zeros(5), params, output=[1, 1, 2])  # a 1-D row: the distribution after output
    assert torch.allclose(one_row, out[0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    params = SamplingParams(repetition_penalty=2.0)
    logits = torch.tensor([[4.0, -4.0, 4.0, -4.0, 1.0], [4.0, -4.0, 4.0, -4.0, 1.0]])
    out = adjust_logits(logits, params, prompt=[0], output=[1], row_tokens=[2])
    assert torch.equal(out[0], torch.tensor([2.0, -8.0, 4.0, -4.0, 1.0]))  # 0 (prompt) and 1 (output) seen
    assert torch.equal(out[1], torch.tensor([2.0, -8.0, 2.0, -4.0, 1.0]))  # and the draft before row 1


def test_greedy_follows_the_adjusted_logits():
    logits = torch.tensor([3.0, 2.0, 1.0])
    params = SamplingParams(frequency_penalty=2.0)
    assert int(adjust_logits(logits, params, output=[0]).argmax()) == 1
    assert logits_to_probs(adjust_logits(logits, params, output=[0]), params)[1] == 1


def test_min_p_drops_tokens_below_a_fraction_of_the_top_one():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, min_p=0.25))
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95  # 0.05 < 0.25 x 0.5
    assert torch.allclose(probs, expected)
    assert torch.allclose(logits_to_probs(logits, SamplingParams(temperature=1.0)), logits.softmax(-1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be a number in \\[-2, 2\\]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be"),
        ({"repetition_penalty": 0}, "repetition_penalty must be a number > 0"),
        ({"min_p": 1.5}, "min_p must be in \\[0, 1\\]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias must map token ids"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias must map token ids"),
        ({"logit_bias": {5: 101.0}}, "logit_bias must map token ids"),
        ({"logit_bias": [(5, 1.0), (5, 2.0)]}, "names a token twice"),
    ],
)
def test_invalid_processor_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_logit_bias_is_stored_sorted_and_hashable():
    params = SamplingParams(logit_bias={7: 1.0, 2: -1.0})
    assert params.logit_bias == ((2, -1.0), (7, 1.0)) and hash(params) == hash(
        SamplingParams(logit_bias=[(7, 1), (2, -1)])
    )
