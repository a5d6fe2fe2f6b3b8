"""Acceptance rules: greedy prefix matching, and speculative sampling that reproduces p exactly."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from paraspec.verify import accept_one, greedy_accept, residual, speculative_accept
from tests.conftest import TEST_DEVICE

N_SAMPLES = 20_000


def test_greedy_accept():
    logits = torch.full((4, 10), -1.0)
    for i, t in enumerate([3, 5, 7, 9]):
        logits[i, t] = 1.0
    assert greedy_accept([3, 5, 7], logits) == (3, 9)  # all accepted, bonus from the last row
    assert greedy_accept([3, 4, 7], logits) == (1, 5)  # correction at the first mismatch
    assert greedy_accept([0, 5, 7], logits) == (0, 3)
    assert greedy_accept([], logits[:1]) == (0, 3)


def emitted_distribution(p, q, seed):
    """Draw from q, apply one acceptance step, count the emitted token. p is judged on the test device, q stays
    on the CPU (as a channel's q arrives)."""
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(len(p))
    p = p.to(TEST_DEVICE)
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
        n, nxt = speculative_accept(drafts, q, p.to(TEST_DEVICE), gen)
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


def acceptance_case():
    """Drafts and the q they came from, all on the CPU (a channel's q, a tree's q): a chain of 2, and a tree whose
    root has 2 children drawn from q and whose first child has 2 point-mass children (a model-free drafter's).
    q is far from the target's p below, so rejections (and residuals) are common."""
    g = torch.Generator().manual_seed(2)
    q = torch.stack([random_dist(8, g) for _ in range(2)])
    drafts = [int(torch.multinomial(row, 1, generator=g)) for row in q]
    root_q = random_dist(8, g)
    tree = [int(t) for t in torch.multinomial(root_q, 2, generator=g)] + [5, 6], [-1, -1, 0, 0], {-1: root_q}
    return drafts, q, tree


def verdicts(target_logits: torch.Tensor, case, seeds=range(60)) -> list:
    """What verify_chain, verify_token and verify_tree decide for each seed, the target's logits wherever they are."""
    from paraspec.sampling import SamplingParams, make_generator
    from paraspec.verify import verify_chain, verify_token, verify_tree

    drafts, q, (tokens, parents, tree_q) = case
    params = SamplingParams(temperature=1.0)
    out = []
    for seed in seeds:
        gen = make_generator(seed)
        out.append(
            (
                verify_chain(drafts, q, target_logits[:3], params, gen),
                verify_token(drafts[0], q[0], target_logits[0], params, gen),
                verify_tree(tokens, parents, tree_q, target_logits, params, gen),
            )
        )
    return out


def test_acceptance_on_a_gpu_takes_q_from_the_cpu():
    """p on cuda, q on the CPU: each entry point brings q to p's device, and the uniforms come from the CPU
    generator (also where torch's default device is cuda), so every seed decides as on the CPU.
    tests/fake_cuda.py raises where CUDA would mix devices."""
    from tests.fake_cuda import fake_cuda

    logits, case = torch.randn(5, 8, generator=torch.Generator().manual_seed(1)) * 3, acceptance_case()
    on_cpu = verdicts(logits, case)
    assert len({chain for chain, _, _ in on_cpu}) > 2 and any(token is not None for _, token, _ in on_cpu)
    with fake_cuda() as cuda:
        p = cuda.tensor(logits)
        assert verdicts(p, case) == on_cpu
        with torch.device("cuda"):
            assert verdicts(p, case, seeds=range(10)) == on_cpu[:10]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_acceptance_on_a_real_gpu_decides_as_on_the_cpu():
    logits, case = torch.randn(5, 8, generator=torch.Generator().manual_seed(1)) * 3, acceptance_case()
    assert verdicts(logits.to("cuda:0"), case) == verdicts(logits, case)
