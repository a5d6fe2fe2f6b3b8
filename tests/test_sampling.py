import numpy as np
import pytest
import torch

from paraspec.sampling import SamplingParams, logits_to_probs


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [2.0, 0.0, 1.0]])
    probs = logits_to_probs(logits, SamplingParams())
    assert probs.tolist() == [[0, 1, 0], [1, 0, 0]]


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(logits_to_probs(logits, SamplingParams(temperature=1.0)),
                          torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=1e-6)
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


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-2), "top_k"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(seed="x"), "seed"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_invalid_sampling_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sample_draws_from_the_given_probabilities():
    """The inverse-CDF sampler: a chi-square test on 40,000 draws from a 6-token distribution with zeros (never
    drawn: not at the start, the middle or the end), unnormalised weights drawn the same way, bad input refused."""
    from scipy.stats import chisquare

    from paraspec.sampling import sample
    probs = torch.tensor([0.0, 0.1, 0.0, 0.45, 0.3, 0.15, 0.0])
    gen = torch.Generator().manual_seed(0)
    counts = np.bincount([sample(probs, gen) for _ in range(40_000)], minlength=len(probs))
    assert counts[[0, 2, 6]].sum() == 0
    kept = probs > 0
    assert chisquare(counts[kept.numpy()], 40_000 * probs[kept].numpy()).pvalue > 1e-3
    weights = probs * 7.5
    counts = np.bincount([sample(weights, gen) for _ in range(20_000)], minlength=len(probs))
    assert counts[[0, 2, 6]].sum() == 0
    assert chisquare(counts[kept.numpy()], 20_000 * probs[kept].numpy()).pvalue > 1e-3
    assert sample(torch.tensor([0.0, 0.0, 1.0]), gen) == 2
    for bad in (torch.zeros(3), torch.tensor([0.5, float("nan")]), torch.tensor([1.5, -0.5]),
                torch.tensor([float("inf"), 1.0])):
        with pytest.raises(ValueError, match="cannot sample"):
            sample(bad, gen)
