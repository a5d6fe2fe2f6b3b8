"""The grammar's forced tokens in front of a round's drafts (structured outputs, SamplingParams.structured).

Under a JSON schema many output tokens are forced: keys, punctuation, `{"id":`. Where the request's grammar forces
the next tokens (GrammarMatcher.forced: llguidance's fast-forward tokens, never bytes tokenized here), DraftPolicy
drafts them first and the configured drafter continues after them: a model-free drafter matches the committed text
and the forced tokens but indexes only the committed text (Drafter.uncommitted), a draft model feeds them in its
catch-up and masks its chain in the grammar's state after them (GrammarMatcher.ahead).

They are drafts like any other, verified by the target: greedy keeps the target's own tokens, and under sampling
each is a point mass (Drafter's q contract): the target keeps it with probability p(x), which its masked p makes 1
where the grammar allows no other token, and otherwise resamples from p without x. In front of a draft model's
sampled chain a forced token's q is its one-hot row, which accept_one judges by exactly that rule.
"""

from __future__ import annotations

import torch

from paraspec.drafters.base import Proposal
from paraspec.drafters.token_tree import TokenTree


def join_chain(forced: list[int], proposal: Proposal) -> Proposal:
    """The forced tokens, then `proposal` (drafted after them)."""
    if not forced:
        return proposal
    q = proposal.q
    if q is not None:  # a model's sampled chain: the forced tokens' point masses as rows of the same width
        points = torch.nn.functional.one_hot(torch.tensor(forced, device=q.device), q.shape[-1]).to(q.dtype)
        q = torch.cat([points, q])
    return Proposal(forced + proposal.tokens, q)


def graft_tree(forced: list[int], tree: TokenTree) -> TokenTree:
    """A trunk of the forced tokens, then `tree` (drafted after them) hanging from its last node: node i of `tree`
    is node i + len(forced); the trunk's nodes have no draft_probs (point masses)."""
    if not forced:
        return tree
    grafted = TokenTree()
    for token in forced:
        grafted.add(token, len(grafted) - 1)
    shift = len(forced)
    for token, parent in zip(tree.tokens, tree.parents):
        grafted.add(token, parent + shift)  # the root's children (parent -1) under the trunk's last node
    grafted.draft_probs = {node + shift: q for node, q in tree.draft_probs.items()}
    return grafted
