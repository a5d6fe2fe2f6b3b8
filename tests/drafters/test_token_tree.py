"""draft_tree on a GPU: the children of a node are drawn with the CPU generator from the q that acceptance gets.
tests/fake_cuda.py presents tensors as cuda:0 and raises where CUDA would mix devices."""

import pytest
import torch

from paraspec.drafters.token_tree import draft_tree
from paraspec.sampling import SamplingParams, logits_to_probs, make_generator
from tests.fake_cuda import fake_cuda

VOCAB = 16
PARAMS = SamplingParams(temperature=1.0)


def grow(device: str, seed: int):
    """A sampled tree of 3 levels, width 3, from logits on `device` (an expansion's logits: one random row per node).
    Returns the tree and the draft logits of every row handed out (root first)."""
    rows = torch.randn(40, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    handed = [rows[0]]

    def expand(nodes, tree):
        out = rows[len(handed) : len(handed) + len(nodes)]
        handed.extend(out)
        return out.to(device)

    tree = draft_tree(rows[0].to(device), expand, PARAMS, make_generator(seed), VOCAB, width=3, depth=3, budget=9)
    return tree, handed


def test_a_tree_on_a_gpu_is_the_cpu_tree_and_keeps_the_q_it_drew_from():
    on_cpu = [grow("cpu", seed)[0] for seed in range(20)]
    with fake_cuda():
        for seed, cpu_tree in enumerate(on_cpu):
            tree, _ = grow("cuda:0", seed)
            assert (tree.tokens, tree.parents) == (cpu_tree.tokens, cpu_tree.parents)
            assert tree.draft_probs.keys() == cpu_tree.draft_probs.keys()
            for node, q in tree.draft_probs.items():  # acceptance divides by what the children came from
                assert q.device.type == "cuda" and torch.equal(q.cpu(), cpu_tree.draft_probs[node])
    assert len({tuple(t.tokens) for t in on_cpu}) > 10 and all(len(t) == 9 for t in on_cpu)


def test_q_is_the_processed_draft_distribution():
    tree, handed = grow("cpu", 0)
    assert torch.equal(tree.draft_probs[-1], logits_to_probs(handed[0], PARAMS))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_tree_on_a_real_gpu_is_the_cpu_tree():
    for seed in range(5):
        cpu_tree, gpu_tree = grow("cpu", seed)[0], grow("cuda:0", seed)[0]
        assert (gpu_tree.tokens, gpu_tree.parents) == (cpu_tree.tokens, cpu_tree.parents)
