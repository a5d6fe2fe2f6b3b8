"""The Drafter interface: propose draft tokens continuing a sequence, and say which distribution each came from.

The q contract (what makes every strategy lossless, whatever the drafter): under sampling, q[i] is the
distribution that tokens[i] was actually drawn from -- for a model drafter, the processed draft distribution
(`sampling.logits_to_probs` of its logits); a deterministic drafter (a lookup table, an n-gram match) gives
q = None, which acceptance reads as the point mass on each proposed token (verify.point_mass_accept), as vLLM's
rejection sampler does: no [k, vocab] one-hot is built. Acceptance divides by exactly this q, so the output
follows the target's distribution however good or bad the drafts are. Under greedy decoding q is not used (None).

A drafter may propose fewer tokens than asked, or none (nothing to propose here): a round then verifies nothing
and the target supplies its own next token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from paraspec.drafters.token_tree import TokenTree
from paraspec.sampling import SamplingParams

if TYPE_CHECKING:
    from paraspec.drafters.adaptive import ChainStop
    from paraspec.drafters.memory import PatternMemory
    from paraspec.structured import GrammarMatcher


@dataclass
class Proposal:
    """A chain of drafts: a one-branch tree, whose depth is its length (what a round counts as drafted)."""

    tokens: list[int]
    q: torch.Tensor | None = None  # [len(tokens), vocab] from a model under sampling; None: greedy or point masses

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return len(self.tokens)


class Drafter:
    """What the chain and tree strategies draw from. Subclasses implement propose(); a drafter that can
    branch overrides propose_tree(); one with state (a KV cache) overrides reset() and accept()."""

    name = "drafter"
    free = False  # True: proposing costs next to nothing (no model): the adaptive rule may ask every round
    last_match = 0  # a model-free drafter: the context length its last proposal continued (0: none, a model)
    # a model-free drafter with several sources of evidence: which one its last proposal came from (an index into
    # `sources`); the adaptive rule keeps a separate acceptance for each (the suffix drafter's output cache of
    # other requests is right less often than the request's own text at the same match length)
    last_source = 0
    sources: tuple[str, ...] = ("",)
    memory: PatternMemory | None = None  # a model-free drafter's PatternMemory (drafters/memory.py), if it keeps one
    timings: Sequence[tuple[int, float]] = ()  # a draft model: (width, seconds) of the forwards of its last proposal
    model: Any = None  # a draft model's drafter: the model (or a Scheduler's view of it) its forwards run on
    prompt_length = 0  # the request's prompt length (DraftPolicy.begin): where a draft's penalties start counting
    grammar: GrammarMatcher | None = None  # the request's structured-output state (DraftPolicy.begin; its grammar)
    # the last tokens of the sequence a proposal continues that are drafts, not committed (the grammar's forced
    # tokens, drafters/forced.py): a drafter that indexes the sequence leaves them out, so a rejected one never enters
    uncommitted = 0
    # a draft model's chain: where the adaptive rule stops it (set for one proposal, if the drafter `stops_chains`),
    # and the top probability each of its drafts was drawn from then
    stops_chains = False
    stop: ChainStop | None = None
    confidences: Sequence[float] = ()

    def reset(self) -> None:
        """A new request starts: forget everything about the previous one."""

    def propose(
        self, sequence: list[int], k: int, params: SamplingParams, generator: torch.Generator, pending: int = 1
    ) -> Proposal:
        """Up to `k` tokens continuing `sequence` (the prompt plus every committed token), with their q.
        `pending`: how many of the committed tokens the target has not cached yet (they go into the same
        verification forward as the drafts). Only a drafter that sizes its proposal by what the verification
        will cost reads it (DraftPolicy's adaptive rule); the others ignore it."""
        raise NotImplementedError

    def propose_tree(
        self,
        sequence: list[int],
        width: int,
        depth: int,
        budget: int,
        params: SamplingParams,
        generator: torch.Generator,
        pending: int = 1,
    ) -> TokenTree:
        """A token tree continuing `sequence`: at most `width` nodes per level, `depth` levels, `budget` nodes
        (`pending` as in propose). The default is the chain of propose(sequence, depth) as a one-branch tree
        (width 1)."""
        proposal = self.propose(sequence, min(depth, budget), params, generator)
        tree = TokenTree()
        for i, token in enumerate(proposal.tokens):
            if proposal.q is not None:
                tree.draft_probs[i - 1] = proposal.q[i]  # node i - 1's one child was drawn from q[i]
            tree.add(token, i - 1)
        return tree

    def accept(self, prefix_len: int, path: list[int]) -> None:
        """Verification kept `path` of the last proposal (chain: indices 0..accepted-1; tree: node indices
        root-down) after the first `prefix_len` tokens of the sequence it continued."""

    def committed(self, prefix_len: int, tokens: list[int]) -> None:
        """The round after the last proposal committed `tokens` after the first `prefix_len` tokens of the
        sequence it continued, whoever drafted them: a drafter's memory judges its last proposal by them."""
        if self.memory is not None:
            self.memory.committed(prefix_len, tokens)

    def rollback(self, length: int) -> None:
        """The committed sequence is `length` tokens: a drafter with a cache (a draft model's) keeps that much of it
        (its proposal continued forced tokens the target did not keep)."""

    def behind(self, sequence: list[int]) -> int:
        """Tokens of `sequence` the drafter must feed before it can draft (a draft model's catch-up; 0 for one
        that needs none)."""
        return 0

    def finish(self, sequence: list[int]) -> None:
        """The request ended with `sequence` (prompt + output); a drafter that learns across requests keeps it."""

    def close(self) -> None:
        """Release what the drafter holds (worker processes, shared memory)."""
