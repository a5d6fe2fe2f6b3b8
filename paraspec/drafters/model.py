"""ModelDrafter: a draft model as a Drafter -- chains (sd) and token trees (tree), exact forwards over its own
KV cache. easyspec's drafters subclass it and change how the root and the tree levels are computed (layer-parallel) and
what the cache keeps after a round (`accept_tree`).

window: a draft model that reads at most the last `window` tokens of the context it has not cached (0: all of it).
Its cache then holds `sequence[offset:]` at positions from 0, and `length` stays in the sequence's positions. The
draft's numbers never reach the output (acceptance judges them against the target), so a shorter context costs
acceptance only: what it saves is the catch-up, a prompt's most of all (docs/DRAFTERS.md, "The draft's window").

q: the processed draft distribution each token was sampled from (`logits_to_probs`), restricted to the first
`vocab_size` ids (those the target can score): a padding row of a wider draft head could otherwise win.
"""

from __future__ import annotations

import time

import torch

from paraspec.drafters.base import Drafter, Proposal
from paraspec.drafters.token_tree import DraftTreeCache, TokenTree, draft_tree
from paraspec.models.base import embeddable, widen
from paraspec.runtime.devices import sync
from paraspec.sampling import SamplingParams, adjust_logits, logits_to_probs, sample


def draw(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, q: torch.Tensor | None = None
) -> tuple[int, torch.Tensor | None]:
    """The draft's next token from its logits, and q: greedy, the argmax (q None); sampling, a sample from
    q = logits_to_probs(logits) (or the `q` already computed from them) -- exactly the distribution it was drawn
    from (the q contract)."""
    if params.greedy:
        return int(logits.argmax()), None
    q = logits_to_probs(logits, params) if q is None else q
    return sample(q, generator), q


def confidence(logits: torch.Tensor, params: SamplingParams) -> tuple[float, torch.Tensor | None]:
    """The top probability of the distribution the next draft is drawn from, and that distribution: under
    sampling q (for `draw`, so it is computed once), under greedy decoding the softmax's top of the (adjusted)
    logits, the draft's confidence in its argmax (q None)."""
    if params.greedy:
        logits = logits.float()
        return float(torch.exp(logits.max() - torch.logsumexp(logits, -1))), None
    q = logits_to_probs(logits, params)
    return float(q.max()), q


class ModelDrafter(Drafter):
    name = "model"
    stops_chains = True

    def __init__(self, model, vocab_size: int, min_confidence: float = 0.0, window: int = 0):
        """vocab_size: the target's (ids the draft may propose). min_confidence: a chain stops after a token
        whose draft probability is below it (HF assisted generation's rule): where the draft is unsure the
        target will likely reject, so drafting on is waste. Stopping early only shortens the chain."""
        self.model, self.vocab_size, self.min_confidence = model, vocab_size, min_confidence
        self.window = window
        self.offset = 0  # the sequence's tokens before the draft's cache (window: the ones it never read)
        self._tree: DraftTreeCache | None = None  # the slots of the last proposed tree's nodes
        self.timings: list[tuple[int, float]] = []  # (width, seconds) of each forward of the last proposal
        self.device = getattr(model, "device", None)  # waited for around each timed forward (None: a model
        # whose calls return when done: llama.cpp, a worker)

    @property
    def length(self) -> int:
        """The sequence's tokens the draft's cache accounts for (read, or skipped by the window)."""
        return self.model.length + self.offset

    def reset(self) -> None:
        self.rollback(0)

    def behind(self, sequence: list[int]) -> int:
        gap = max(len(sequence) - self.length, 0)
        return min(gap, self.window) if self.window else gap

    def catch_up(self, sequence: list[int]) -> list[int]:
        """The tokens of `sequence` to feed before drafting: those the cache lacks, or -- more than `window` of
        them -- the last `window`, into an emptied cache."""
        if self.window and len(sequence) - self.length > self.window:
            self.model.rollback(0)
            self.offset = len(sequence) - self.window
        return sequence[self.length :]

    def propose(
        self, sequence: list[int], k: int, params: SamplingParams, generator: torch.Generator, pending: int = 1
    ) -> Proposal:
        """Sample up to k tokens one by one. The draft first catches up on the tokens of `sequence` it has not
        cached (e.g. the last round's bonus token)."""
        self._tree = None
        self.timings = []
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        if k <= 0:
            return Proposal(tokens)
        confidences: list[float] = []
        self.confidences = confidences
        logits = self.logits(self.catch_up(sequence))
        for i in range(k):
            adjusted, q = self.adjust(logits, params, sequence, tokens), None
            if self.stop is not None:  # the rule's chain stop: by the distribution, before its token is drawn
                m, q = confidence(adjusted, params)
                if not self.stop.include(i, m):
                    break
                confidences.append(m)
            token, q = draw(adjusted, params, generator, q)
            if q is not None:
                probs.append(q)
            tokens.append(token)
            if self.min_confidence > 0 and float(logits.softmax(-1)[token]) < self.min_confidence:
                break
            if i < k - 1:
                if self.stop is not None and not self.stop.feed(i):
                    break
                logits = self.logits([token])
        return Proposal(tokens, torch.stack(probs) if probs else None)

    def adjust(self, logits: torch.Tensor, params: SamplingParams, sequence: list[int], drafted: list[int]):
        """The draft's logits after the request's grammar and its logit bias and penalties, on its own context (the
        prompt, the output, the drafts so far): the target's chain, so that q stays near p. (Trees draft within the
        grammar but without bias and penalties: their q is still the one sampled from, so acceptance stays exact.)"""
        if self.grammar is not None:  # the grammar's state is the committed output's: the drafts go on top of it
            logits = self.grammar.mask_after(logits, drafted)
        if not params.adjusts_logits:
            return logits
        n = self.prompt_length
        return adjust_logits(logits, params, sequence[:n], sequence[n:] + drafted)

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
        """Grow the tree level by level (draft_tree); each level's nodes go through the draft in one forward,
        each seeing only the prefix, its ancestors and itself."""
        assert not self.window, "a windowed draft drafts chains only (its tree slots are the cache's positions)"
        self.timings = []
        root_logits = self.root(sequence[self.length :])
        self._tree = DraftTreeCache(self, self.expand, len(sequence))
        grammar = self.grammar  # the request's structured output: each node's children drawn within it
        mask = None if grammar is None else grammar.mask_after
        return draft_tree(root_logits, self._tree, params, generator, self.vocab_size, width, depth, budget, mask)

    def accept(self, prefix_len: int, path: list[int]) -> None:
        if self._tree is not None:
            self.accept_tree(prefix_len, self._tree, path)
        else:  # a chain: its accepted drafts are already in place
            self.rollback(min(self.length, prefix_len + len(path)))

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Feed token_ids; the draft's logits after the last one, over exactly the target's vocab_size ids (a
        draft with fewer embedding rows than the target: models.base.embeddable / widen)."""
        sync(self.device)
        start = time.perf_counter()
        logits = self.model.forward(embeddable(token_ids, self.model.vocab_size), last_n=1)[-1]
        sync(self.device)
        self.timings.append((len(token_ids), time.perf_counter() - start))
        return widen(logits, self.vocab_size)[: self.vocab_size]

    # -- hooks of the tree drafting (easyspec overrides them) ----------------------------------------------------
    def root(self, pending: list[int]) -> torch.Tensor:
        """Run the committed tokens the draft has not cached; the draft logits after the last one."""
        return self.logits(pending)

    def expand(self, token_ids, positions, mask) -> torch.Tensor:
        """Logits of tree nodes fed with explicit positions and a mask over the whole cache."""
        from paraspec.models.native.layer_parallel import exact_forward

        sync(self.device)
        start = time.perf_counter()
        logits = exact_forward(self.model, token_ids, positions, mask)
        assert logits is not None  # with its LM head
        sync(self.device)
        self.timings.append((len(token_ids), time.perf_counter() - start))
        return logits

    def accept_tree(self, prefix_len: int, cache: DraftTreeCache, path: list[int]) -> None:
        """After verification: keep the prefix and the accepted path's cached nodes."""
        cache.accept(path)

    # -- cache operations (a multi-device drafter runs them on every replica) ------------------------------------
    def rollback(self, length: int) -> None:
        if length < self.offset:  # into what the window skipped: the cache starts afresh at the next catch-up
            self.model.rollback(0)
            self.offset = 0
        else:
            self.model.rollback(length - self.offset)

    def keep_path(self, prefix_len: int, slots: list[int]) -> None:
        self.model.keep_path(prefix_len, slots)
