import pytest

from tests.tiny import make_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def qwen2_target(tiny_dir):
    return make_checkpoint(tiny_dir / "qwen2-target", "qwen2", seed=1, scale=20)


@pytest.fixture(scope="session")
def qwen2_unrelated(tiny_dir):
    return make_checkpoint(tiny_dir / "qwen2-unrelated", "qwen2", seed=2, scale=20)


@pytest.fixture(scope="session")
def qwen2_partial(tiny_dir, qwen2_target):
    """The target with noise on every weight: agrees on some tokens, not all."""
    return make_checkpoint(tiny_dir / "qwen2-partial", "qwen2", seed=3, base=qwen2_target, noise=0.05)


@pytest.fixture(scope="session")
def llama_target(tiny_dir):
    return make_checkpoint(tiny_dir / "llama-target", "llama", seed=4, scale=20)


@pytest.fixture(scope="session")
def mistral_target(tiny_dir):
    return make_checkpoint(tiny_dir / "mistral-target", "mistral", seed=5, scale=20)


@pytest.fixture(scope="session")
def deep_pair(tiny_dir):
    """A 6-layer target and a noisy copy as draft: deep enough for EasySpec groups of 2 and 3 layers."""
    target = make_checkpoint(tiny_dir / "deep-t", "qwen2", seed=1, scale=20, num_hidden_layers=6)
    draft = make_checkpoint(tiny_dir / "deep-d", "qwen2", seed=3, base=target, noise=0.05)
    return target, draft


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread avoids oversubscription stalls."""
    import torch
    torch.set_num_threads(1)
