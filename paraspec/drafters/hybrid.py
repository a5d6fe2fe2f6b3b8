"""Hybrid: a strategy's drafters in order -- one drafter, or a model-free one first and a draft model where it has
nothing (or is not confident) -- and, optionally, the adaptive draft length (drafters/adaptive.py).

Each round the drafters are asked in order and the first with a proposal drafts the round:

    fixed length   each drafter is asked for up to `k` tokens; the first non-empty proposal is the round's;
    adaptive       a model-free drafter proposes first (it costs nothing) and the rule then picks how much of
                   it to verify from that drafter's own acceptance; k* = 0 (not confident) passes the round to
                   the next drafter. A model drafter is asked for exactly k* tokens, k* from its acceptance and
                   its measured seconds per token; with k* = 0 nobody drafts and the target decodes plainly.

q is each proposal's own (point masses for a model-free drafter, the draft model's distributions otherwise), and
a round's drafts all come from one drafter, so acceptance divides by exactly what was drawn from. Which drafter
drafts, and how much, depends only on the sequence and on rounds already verified (lossless).
"""
from __future__ import annotations

import time

import torch

from paraspec.drafters.adaptive import PROBE_START, Acceptance, VerifyCost, best_length
from paraspec.drafters.base import Drafter, Proposal
from paraspec.drafters.token_tree import TokenTree
from paraspec.sampling import SamplingParams


class Hybrid(Drafter):
    def __init__(self, drafters: list[Drafter], cost: VerifyCost | None = None):
        """cost: the target's verification cost by width; None drafts fixed lengths (not adaptive)."""
        if not drafters:
            raise ValueError("Hybrid needs at least one drafter")
        self.drafters, self.cost = list(drafters), cost
        # acceptance per drafter and, for a model-free one, per length of the match behind its proposal (a
        # 4-token match in copied text is right far more often than a 1-token one; the estimates persist)
        self.acceptance: dict[tuple[int, int], Acceptance] = {}
        self.decisions: list[dict] = []        # one per round: who drafted, k*, alpha (the trace's "plan")
        self._used: tuple[int, int] | None = None   # the (drafter, match bucket) of the last proposal
        self._drafted = self._accepted = 0
        self._would: tuple[tuple[int, int], int] | None = None   # (stats key, token) a model-free drafter
                                                                 # proposed but did not draft
        self._probing = False

    @property
    def adaptive(self) -> bool:
        return self.cost is not None

    def reset(self) -> None:
        self.decisions = []
        for stats in self.acceptance.values():
            stats.fade()
        for d in self.drafters:
            d.reset()

    def finish(self, sequence: list[int]) -> None:
        for d in self.drafters:
            d.finish(sequence)

    def close(self) -> None:
        for d in self.drafters:
            d.close()

    # -- proposing --------------------------------------------------------------------------------------------
    def propose(self, sequence: list[int], k: int, params: SamplingParams, generator: torch.Generator,
                pending: int = 1) -> Proposal:
        """Up to k tokens from the first drafter that drafts this round. `pending`: the committed tokens the
        target has not cached (they go into the same verification forward)."""
        self._start_round()
        if k <= 0:
            return Proposal([])
        for i, drafter in enumerate(self.drafters):
            if not self.adaptive:
                proposal = drafter.propose(sequence, k, params, generator)
            elif drafter.free:
                proposal = drafter.propose(sequence, k, params, generator)
                if not proposal.tokens:
                    continue
                chosen = self._choose(i, pending, len(proposal.tokens), proposal.tokens[0])
                proposal = _truncate(proposal, chosen)
            else:
                chosen = self._choose(i, pending, k)
                if chosen == 0:
                    continue
                start = time.perf_counter()
                proposal = drafter.propose(sequence, chosen, params, generator)
                self.stats(i).observe_draft_time(time.perf_counter() - start, len(proposal.tokens))
            if proposal.tokens:
                self._used, self._drafted = self.key(i), len(proposal.tokens)
                return proposal
        return Proposal([])

    def propose_tree(self, sequence: list[int], width: int, depth: int, budget: int, params: SamplingParams,
                     generator: torch.Generator, pending: int = 1) -> TokenTree:
        """A tree from the first drafter that drafts this round; adaptive: its depth is k*, with a tree of
        depth k costed as min(budget, k * width) nodes."""
        self._start_round()
        for i, drafter in enumerate(self.drafters):
            if not self.adaptive:
                tree = drafter.propose_tree(sequence, width, depth, budget, params, generator)
            elif drafter.free:
                tree = drafter.propose_tree(sequence, width, depth, budget, params, generator)
                if not len(tree):
                    continue
                first = tree.tokens[0]
                tree = prune(tree, self._choose(i, pending, tree.depth, first, width=width, budget=budget))
            else:
                chosen = self._choose(i, pending, depth, width=width, budget=budget)
                if chosen == 0:
                    continue
                start = time.perf_counter()
                tree = drafter.propose_tree(sequence, width, chosen, budget, params, generator)
                self.stats(i).observe_draft_time(time.perf_counter() - start, len(tree))
            if len(tree):
                self._used, self._drafted = self.key(i), tree.depth
                return tree
        return TokenTree()

    def _start_round(self) -> None:
        self._used, self._would, self._probing = None, None, False
        self._drafted = self._accepted = 0

    def _choose(self, i: int, pending: int, max_k: int, would: int | None = None, width: int = 1,
                budget: int | None = None) -> int:
        """k* for drafter i (see adaptive.py); remembers a model-free drafter's first token when k* = 0."""
        stats, drafter = self.stats(i), self.drafters[i]
        nodes = (lambda k: k) if width == 1 else (lambda k: min(budget, k * width))
        k, rate = best_length(stats.alpha, stats.draft_s_per_token, lambda n: self.cost(pending + nodes(n - pending)),
                              pending, max_k)
        if k == 0 and not drafter.free:
            stats.plain_rounds += 1
            if stats.plain_rounds >= stats.probe_after:       # probe a model drafter that has not drafted lately
                k, self._probing = 1, True
        if k > 0:
            stats.plain_rounds = 0
        if k == 0 and would is not None and self._would is None:
            self._would = (self.key(i), would)
        self.decisions.append({"drafter": drafter.name, "k": k, "alpha": round(stats.alpha, 3),
                               "tokens_per_s": round(rate, 2), "probe": self._probing})
        return k

    def key(self, i: int) -> tuple[int, int]:
        """Drafter i's statistics key: (i, its last match length bucketed 0-4, 5 for 8 or more)."""
        n = getattr(self.drafters[i], "last_match", 0)
        return i, (n if n <= 4 else 4 if n < 8 else 5)

    def stats(self, i: int) -> Acceptance:
        return self.acceptance.setdefault(self.key(i), Acceptance())

    # -- after verification -----------------------------------------------------------------------------------
    def accept(self, prefix_len: int, path: list[int]) -> None:
        if self._used is not None:
            self._accepted = len(path)
            self.drafters[self._used[0]].accept(prefix_len, path)

    def observe(self, verify_width: int, verify_s: float, committed: list[int]) -> None:
        """Feedback after the round: the verification's width and seconds, and the tokens it committed."""
        if not self.adaptive:
            return
        self.cost.observe(verify_width, verify_s)
        if self._used is not None:
            stats = self.acceptance[self._used]
            stats.observe(self._drafted, self._accepted)
            if self._probing:
                stats.probe_after = PROBE_START if self._accepted else 2 * stats.probe_after
        if self._would is not None and committed:      # what a model-free drafter would have drafted
            key, token = self._would
            self.acceptance[key].observe(1, int(committed[0] == token))

    def report(self) -> dict:
        """Per drafter: its acceptance estimate now; the rounds by k* (the rule's decisions)."""
        by_k: dict[str, dict[int, int]] = {}
        for d in self.decisions:
            counts = by_k.setdefault(d["drafter"], {})
            counts[d["k"]] = counts.get(d["k"], 0) + 1
        return {"rule": "k* = argmax_k (1 + a + ... + a^k) / (k d + c(w + k))",
                "alpha": {f"{self.drafters[i].name}/match{n}": round(s.alpha, 3)
                          for (i, n), s in sorted(self.acceptance.items())},
                "rounds_by_k": by_k,
                "verify_cost_ms": {w: round(s * 1e3, 2) for w, s in sorted(self.cost.seconds.items())}}


def _truncate(proposal: Proposal, k: int) -> Proposal:
    """The first k tokens of a proposal (a prefix of a deterministic proposal is the proposal for k)."""
    if k >= len(proposal.tokens):
        return proposal
    return Proposal(proposal.tokens[:k], None if proposal.q is None else proposal.q[:k])


def prune(tree: TokenTree, depth: int) -> TokenTree:
    """The nodes of `tree` at most `depth` deep (parents come first, so every kept node's parent is kept)."""
    if depth >= tree.depth:
        return tree
    kept, index = TokenTree(), {}
    for node, (token, parent, d) in enumerate(zip(tree.tokens, tree.parents, tree.depths)):
        if d <= depth:
            index[node] = kept.add(token, index[parent] if parent >= 0 else -1)
    kept.draft_probs = {(index[n] if n >= 0 else -1): q for n, q in tree.draft_probs.items() if n < 0 or n in index}
    return kept
