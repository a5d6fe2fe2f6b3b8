import pytest

from paraspec.bench.metrics import Record
from paraspec.stats import GenerationStats
from paraspec.trace import Trace
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
    config.addinivalue_line(
        "markers",
        "llamacpp_peer: needs llama.cpp's llama-server (built once by "
        "`python scripts/build_llamacpp.py peer`, or by the test's fixture)",
    )


# hand-built records for the report arithmetic (test_metrics, test_report)
def stats(
    new_tokens, total_s, ttft_s=0.1, drafted=0, accepted=0, rounds=0, draft_s=0.0, verify_s=0.0, speculative=False
):
    return GenerationStats(
        strategy="x",
        prompt_tokens=10,
        new_tokens=new_tokens,
        total_s=total_s,
        ttft_s=ttft_s,
        tpot_ms=(total_s - ttft_s) * 1000 / (new_tokens - 1),
        ms_per_token=total_s * 1000 / new_tokens,
        tokens_per_s=new_tokens / total_s,
        acceptance_rate=(accepted / drafted if drafted else 0.0) if speculative else None,
        mean_accepted_length=(new_tokens / rounds if rounds else 0.0) if speculative else None,
        draft_s=draft_s,
        verify_s=verify_s,
        drafted=drafted,
        accepted=accepted,
        rounds=rounds,
        rollbacks=0,
    )


def record(variant, prompt, tokens, st, margins=None, trace=None):
    return Record(variant, prompt, f"p{prompt}", 10, tokens, "", "length", st, trace or Trace(), margins)
