"""Acceptance rules: greedy prefix matching, and speculative sampling that reproduces p exactly."""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from paraspec.verify import accept_one, greedy_accept, residual, speculative_accept

N_SAMPLES = 20_000


def test_greedy_accept():
    logits = torch.full((4, 10), -1.0)
    for i, t in enumerate([3, 5, 7, 9]):
        logits[i, t] = 1.0
    assert greedy_accept([3, 5, 7], logits) == (3, 9)       # all accepted, bonus from the last row
    assert greedy_accept([3, 4, 7], logits) == (1, 5)       # correction at the first mismatch
    assert greedy_accept([0, 5, 7], logits) == (0, 3)
    assert greedy_accept([], logits[:1]) == (0, 3)


def emitted_distribution(p, q, seed):
    """Draw from q, apply one acceptance step, count the emitted token."""
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(len(p))
    for _ in range(N_SAMPLES):
        token = int(torch.multinomial(q, 1, generator=g))
        replacement = accept_one(token, p, q, g)
        counts[token if replacement is None else replacement] += 1
    return counts


def expected_counts(p, n=N_SAMPLES):
    p = p.double().numpy()
    return p / p.sum() * n


def random_dist(n, g, zeros=()):
    d = torch.rand(n, generator=g) ** 3
    d[list(zeros)] = 0
    return d / d.sum()


@pytest.mark.parametrize("case", ["random", "q_zero_where_p_positive", "q_equals_p", "p_zero_where_q_positive"])
def test_rejection_sampler_reproduces_p(case):
    g = torch.Generator().manual_seed(7)
    vocab = 12
    p = random_dist(vocab, g)
    q = random_dist(vocab, g)
    if case == "q_zero_where_p_positive":
        q = random_dist(vocab, g, zeros=(0, 3, 4))
    elif case == "q_equals_p":
        q = p.clone()
    elif case == "p_zero_where_q_positive":
        p = random_dist(vocab, g, zeros=(1, 2))
    counts = emitted_distribution(p, q, seed=11)
    expected = expected_counts(p)
    support = expected > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support], expected[support]).pvalue > 1e-3


def test_rejection_sampler_detects_a_wrong_rule():
    """The chi-square check above has power: accepting every draft (a classic bug) is caught."""
    g = torch.Generator().manual_seed(7)
    p, q = random_dist(12, g), random_dist(12, g)
    gen = torch.Generator().manual_seed(3)
    counts = np.bincount(torch.multinomial(q, N_SAMPLES, replacement=True, generator=gen).numpy(), minlength=12)
    assert chisquare(counts, expected_counts(p)).pvalue < 1e-6


def test_chain_speculative_accept_marginals():
    """Over a 2-token chain, the first emitted token follows p_1, and full acceptance draws the bonus from p_3."""
    g = torch.Generator().manual_seed(1)
    vocab = 6
    p = torch.stack([random_dist(vocab, g) for _ in range(3)])
    q = torch.stack([random_dist(vocab, g) for _ in range(2)])
    gen = torch.Generator().manual_seed(5)
    first, accepted_lengths = np.zeros(vocab), []
    for _ in range(N_SAMPLES):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        n, nxt = speculative_accept(drafts, q, p, gen)
        first[drafts[0] if n >= 1 else nxt] += 1
        accepted_lengths.append(n)
    assert chisquare(first, expected_counts(p[0])).pvalue > 1e-3
    # the acceptance probability of the first draft is sum(min(p, q)) (Leviathan et al., Lemma 3.3)
    rate = np.mean(np.array(accepted_lengths) >= 1)
    expected = torch.minimum(p[0], q[0]).sum().item()
    assert abs(rate - expected) < 4 * np.sqrt(expected * (1 - expected) / N_SAMPLES)


def test_residual():
    p, q = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.25, 0.25, 0.5])
    assert torch.allclose(residual(p, q), torch.tensor([0.5, 0.5, 0.0]))
    assert torch.allclose(residual(p, p), p)


def test_token_with_zero_q_is_refused():
    with pytest.raises(ValueError, match="q = 0"):
        accept_one(2, torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.5, 0.5, 0.0]), torch.Generator())
