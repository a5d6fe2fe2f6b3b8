"""The Model protocol every strategy talks to.

Implemented by the native decoder (`models/llama.py`), the Hugging Face fallback (`models/hf.py`), a remote
worker proxy (`runtime/`) and the simulated model. Logits come back as float32 tensors of shape
[n_tokens, vocab_size] on the CPU-side of the caller's device.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Model(Protocol):
    vocab_size: int            # rows of the output layer (may exceed the tokenizer's vocabulary: padding)
    eos_token_ids: tuple[int, ...]
    max_context: int           # positions the KV cache can hold

    @property
    def length(self) -> int:
        """Tokens currently in the KV cache."""

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        """Reset the cache, run the prompt, return logits [vocab] for its last position."""

    def forward(self, token_ids: list[int], positions: list[int] | None = None,
                tree_mask: torch.Tensor | None = None, last_n: int | None = None) -> torch.Tensor:
        """Append tokens to the cache and return logits [len(token_ids), vocab] for each of them
        (only for the last `last_n` when given: a long prompt's LM head is the costliest part of a prefill).

        positions default to length, length+1, ...; tree_mask [n, n] (bool, True = may attend) restricts
        attention among the new tokens (they always see the whole cache before them).
        """

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""


def check_rollback(length: int, cached: int) -> None:
    """The one rule of `rollback`: a cache can only be cut back to a length it holds."""
    if not 0 <= length <= cached:
        raise ValueError(f"cannot roll back to {length}: the cache holds {cached} tokens")
