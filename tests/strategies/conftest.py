"""Fixtures the strategy test modules share."""

import os
from pathlib import Path

import pytest

from tests.tiny import make_checkpoint

VOCAB = 6  # tests/strategies/test_sd.py's small vocabulary, for the sampling pairs


@pytest.fixture
def shm_segments():
    """A function listing the shared-memory segments this test process created (other processes on a shared
    machine create and remove segments of their own at any time)."""
    prefix = f"paraspec_{os.getpid()}_"
    return lambda: {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix)}


@pytest.fixture(scope="module")
def slow_target_pair(tmp_path_factory):
    """A target several times slower than its draft (3 layers against 1; 6 cost the sampling tests minutes of CI and
    checked nothing more), so the draft is usually ahead and most tokens go through speculative acceptance rather
    than the verifier's own sampling."""
    d = tmp_path_factory.mktemp("slow-target")
    target = make_checkpoint(
        d / "t",
        "qwen2",
        seed=21,
        scale=3,
        tokenizer=False,
        vocab_size=VOCAB,
        eos_token_id=None,
        num_hidden_layers=3,
        hidden_size=128,
        intermediate_size=512,
    )
    draft = make_checkpoint(
        d / "d", "qwen2", seed=22, scale=5, tokenizer=False, vocab_size=VOCAB, eos_token_id=None, num_hidden_layers=1
    )
    return target, draft


def check_draft_cache(engine, result, name: str = "draft"):
    """The draft loop's record of its cache is what the cache holds: the same length, and the same entries -- the
    cache continues exactly like a fresh prefill of the recorded tokens (a token fed twice without a rollback,
    or a stale entry left behind, would change the next logits); the record starts with the prompt. With a draft
    window the cache holds the record from its `offset` on."""
    report = result.worker_reports[name]
    cached, offset = report["cached"], report["offset"]
    assert report["cache_length"] == len(cached)
    n = min(len(cached), len(result.prompt_ids))
    assert cached[:n] == result.prompt_ids[:n]
    if cached[offset:]:
        model = engine.draft_models[0 if name == "draft" else int(name.removeprefix("draft"))]
        probe = model.forward([1])[-1]
        assert (probe - model.prefill(cached[offset:] + [1])).abs().max() < 1e-4
