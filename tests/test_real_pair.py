"""The reference pair (Qwen2.5-Coder 1.5B target, 0.5B draft) in bf16: sd returns ar's tokens.

In bf16 a chunked forward and a one-token forward round differently, so two exact algorithms can part at a
near-tie. Where sd and ar differ, the first divergence must be one: the target's top-2 logit gap there below
0.05 in both computations -- or, where the logits are too large for bf16 to express 0.05 (above 8 its step is
0.0625, above 16 it is 0.125), at most one bf16 step. Any other divergence fails. Needs `make models`.
"""
import math

import pytest
import torch

from paraspec import Engine, SamplingParams
from paraspec.models.loader import cache_dir

TARGET, DRAFT = "Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"
NEAR_TIE = 0.05
PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
    "    \"\"\"Check if in given list of numbers, are any two numbers closer to each other than given "
    "threshold.\"\"\"\n",
    "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n",
]

pytestmark = [
    pytest.mark.real_pair,
    pytest.mark.skipif(not all((cache_dir() / "models" / m.replace("/", "--") / "config.json").exists()
                               for m in (TARGET, DRAFT)), reason="reference pair missing: run `make models`"),
]


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def engines(request):
    with Engine(TARGET, strategy="ar", dtype=request.param) as ar, \
            Engine(TARGET, DRAFT, strategy="sd", lookahead=5, dtype=request.param) as sd:
        yield ar, sd


@pytest.mark.parametrize("prompt", PROMPTS)
def test_sd_equals_ar_on_the_reference_pair(engines, prompt):
    ar, sd = engines
    params = SamplingParams(max_new_tokens=64)
    expected = ar.generate(prompt, params, record_margins=True)
    result = sd.generate(prompt, params, record_margins=True)
    assert len(expected.token_ids) == 64 or expected.finish_reason == "stop"
    assert result.stats.accepted > 0
    if result.token_ids == expected.token_ids:
        return
    first = next(i for i, (a, b) in enumerate(zip(expected.token_ids, result.token_ids)) if a != b)
    gaps = expected.margins[first], result.margins[first]
    top = ar.target.prefill(expected.prompt_ids + expected.token_ids[:first]).max().item()
    bf16_step = 2.0 ** (math.floor(math.log2(abs(top))) - 7) if ar.target.dtype == torch.bfloat16 else 0.0
    print(f"first divergence at output token {first}: ar {expected.token_ids[first]} vs sd "
          f"{result.token_ids[first]}, top-2 gaps {gaps[0]:.4f} (ar) / {gaps[1]:.4f} (sd), top logit "
          f"{top:.2f} (bf16 step {bf16_step})")
    assert max(gaps) < NEAR_TIE or max(gaps) <= bf16_step, \
        f"divergence at token {first} is not a near-tie (gaps {gaps}, bf16 step {bf16_step})"
