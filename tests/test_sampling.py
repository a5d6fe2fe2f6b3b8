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
