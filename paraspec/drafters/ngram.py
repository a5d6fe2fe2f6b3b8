"""Prompt lookup (n-gram) drafting: the drafter that costs nothing (HF `prompt_lookup_num_tokens`, vLLM `ngram`).

Match the last n tokens of the sequence (n from `max_ngram` down to `min_ngram`: the longest match wins) against
every earlier place in the prompt and the generated text, and propose the tokens that followed the most recent
earlier occurrence. Code edits, summaries and answers over a given text copy long spans of their prompt, so the
proposal is often right for many tokens at once.

An index from each n-gram to where its latest continuation starts is kept up to date as the sequence grows
(O(max_ngram) per token), so a proposal is a dictionary lookup, not a scan of the sequence. With `memory` on, a
proposal from a pattern whose last proposal went wrong after r tokens is cut to r (drafters/memory.py).

q: the proposal is a deterministic function of the sequence, so each token's q is the point mass on it (q = None
in the Proposal); the target then accepts token x with probability p(x) and otherwise resamples from p with x
removed (lossless).
"""

from __future__ import annotations

import contextlib
import gc

import torch

from paraspec.drafters.base import Drafter, Proposal
from paraspec.drafters.memory import PatternMemory
from paraspec.sampling import SamplingParams

BULK = 64  # appends that pause the cyclic garbage collector (a prompt's worth)


@contextlib.contextmanager
def gc_paused(enabled: bool = True):
    """Python's cyclic garbage collector off for a bulk build of an index (restored after, if it was on).

    Indexing a prompt allocates many small containers (a suffix trie: up to `depth` nodes per token); the
    allocations trigger collections that scan every node built so far, most of the build's time (docs/results/,
    "Costs around the kernels"). None of them is garbage: pausing loses nothing."""
    if not enabled or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class SequenceIndex:
    """The sequence seen so far, growing by appends; restarts when a new sequence is not an extension of it."""

    def __init__(self):
        self.tokens: list[int] = []

    def sync(self, sequence: list[int]) -> None:
        """Make `tokens` equal `sequence`: append what it adds, or restart if it is not an extension."""
        n = len(self.tokens)
        if len(sequence) < n or sequence[:n] != self.tokens:
            self.restart()
            n = 0
        with gc_paused(len(sequence) - n >= BULK):
            for token in sequence[n:]:
                self.append(int(token))

    def restart(self) -> None:
        self.tokens = []

    def append(self, token: int) -> None:
        self.tokens.append(token)


class NGramIndex(SequenceIndex):
    def __init__(self, min_ngram: int, max_ngram: int):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes need 1 <= ngram_min <= ngram_max, got {min_ngram} and {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        super().__init__()
        self.restart()

    def restart(self) -> None:
        super().restart()
        # n -> {n-gram: index where the tokens after its latest occurrence start}
        self.continuations: dict[int, dict[tuple, int]] = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}

    def append(self, token: int) -> None:
        i = len(self.tokens)  # the new token's index: the continuation of every n-gram ending at i - 1
        super().append(token)
        for n, table in self.continuations.items():
            if i >= n:
                table[tuple(self.tokens[i - n : i])] = i

    def lookup(self, k: int, context: list[int] | None = None) -> tuple[list[int], int]:
        """Up to k tokens continuing the latest earlier occurrence of the longest matching suffix of `context`
        (default: the sequence itself); (tokens, n) with n the matched length, or ([], 0) without a match."""
        tokens = self.tokens
        context = tokens if context is None else context
        for n in range(min(self.max_ngram, len(tokens) - 1, len(context)), self.min_ngram - 1, -1):
            start = self.continuations[n].get(tuple(context[len(context) - n :]))
            if start is not None:
                return tokens[start : start + k], n
        return [], 0


class NGramDrafter(Drafter):
    name = "ngram"
    free = True  # proposing costs microseconds: the adaptive rule may ask for it every round

    def __init__(self, vocab_size: int, min_ngram: int = 2, max_ngram: int = 4, memory: bool = True):
        self.vocab_size = vocab_size
        self.index = NGramIndex(min_ngram, max_ngram)
        self.memory = PatternMemory() if memory else None
        self.last_match = 0  # the n of the last proposal (0: no match)

    def reset(self) -> None:
        self.index.restart()
        if self.memory is not None:
            self.memory.reset()

    def propose(
        self, sequence: list[int], k: int, params: SamplingParams, generator: torch.Generator, pending: int = 1
    ) -> Proposal:
        if k <= 0:
            return Proposal([])
        self.index.sync(sequence[: len(sequence) - self.uncommitted])  # the committed tokens only
        tokens, self.last_match = self.index.lookup(k, sequence)
        cap, _ = self.memory.consult(sequence, self.last_match, tokens) if self.memory else (None, False)
        tokens = tokens if cap is None else tokens[:cap]
        return Proposal(tokens)  # q = None: point masses
