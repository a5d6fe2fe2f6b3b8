"""What the reference pair's test files share (tests/test_real_pair.py: the native backend;
tests/test_real_pair_llamacpp.py: llama.cpp): the pair, the prompts, the marks, and every core for the pair."""

import pytest
import torch

from paraspec import SamplingParams
from paraspec.models.cache import cache_dir
from tests.conftest import cores_of_this_worker

TARGET, DRAFT = "Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"
PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
    '    """Check if in given list of numbers, are any two numbers closer to each other than given '
    'threshold."""\n',
    'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same backwards."""\n',
]
PARAMS = SamplingParams(max_new_tokens=64)
REAL_PAIR_MARKS = [
    pytest.mark.real_pair,
    pytest.mark.skipif(
        not all((cache_dir() / "models" / m.replace("/", "--") / "config.json").exists() for m in (TARGET, DRAFT)),
        reason="reference pair missing: run `make models`",
    ),
]


@pytest.fixture(autouse=True, scope="module")
def every_core():
    """The pair on every core of this test process (all of them, or its share under pytest-xdist), as an Engine on
    device `cpu` runs it outside the tests (the tiny models' session keeps torch at one thread, conftest's
    _one_thread): in-process engines and references here, llama.cpp's too (it follows torch's thread count);
    workers pinned to core sets set their own."""
    before = torch.get_num_threads()
    torch.set_num_threads(cores_of_this_worker())
    yield
    torch.set_num_threads(before)
