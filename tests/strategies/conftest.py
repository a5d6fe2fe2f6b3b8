"""Fixtures the strategy test modules share."""
import os
from pathlib import Path

import pytest

from tests.tiny import make_checkpoint

VOCAB = 6          # tests/strategies/test_sd.py's small vocabulary, for the sampling pairs


@pytest.fixture
def shm_segments():
    """A function listing the shared-memory segments this test process created (other processes on a shared
    machine create and remove segments of their own at any time)."""
    prefix = f"paraspec_{os.getpid()}_"
    return lambda: {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix)}


@pytest.fixture(scope="module")
def slow_target_pair(tmp_path_factory):
    """A target several times slower than its draft, so the draft is usually ahead and most tokens go
    through speculative acceptance rather than the verifier's own sampling."""
    d = tmp_path_factory.mktemp("slow-target")
    target = make_checkpoint(d / "t", "qwen2", seed=21, scale=3, tokenizer=False, vocab_size=VOCAB,
                             eos_token_id=None, num_hidden_layers=6, hidden_size=128, intermediate_size=512)
    draft = make_checkpoint(d / "d", "qwen2", seed=22, scale=5, tokenizer=False, vocab_size=VOCAB,
                            eos_token_id=None, num_hidden_layers=1)
    return target, draft
