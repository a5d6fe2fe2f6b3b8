import pytest

from tests.tiny import make_checkpoint


@pytest.fixture(scope="session")
def bench_target(tiny_dir):
    """A tiny Qwen2 with room for HumanEval prompts (about 420 byte-level tokens with the chat template)."""
    return make_checkpoint(tiny_dir / "bench-target", "qwen2", seed=11, scale=20, max_position_embeddings=1024)


@pytest.fixture(scope="session")
def bench_draft(tiny_dir, bench_target):
    """The target with noise on every weight: agrees on some tokens, not all."""
    return make_checkpoint(tiny_dir / "bench-draft", "qwen2", seed=12, base=bench_target, noise=0.05)


@pytest.fixture(scope="session")
def bench_tokenizer(bench_target):
    from paraspec.models.loader import load_tokenizer
    return load_tokenizer(bench_target, "float32")


def pytest_configure(config):
    config.addinivalue_line("markers", "llamacpp_peer: needs llama.cpp's llama-server (built once by "
                                       "`python scripts/build_llamacpp.py peer`, or by the test's fixture)")
