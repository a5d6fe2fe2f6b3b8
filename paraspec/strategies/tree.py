"""Token-tree speculative decoding (SpecInfer, Miao et al. 2024): the draft expands a tree, one target forward
verifies every branch under a tree attention mask, and both KV caches keep only the accepted path.

Each round:
    1. the draft catches up on the committed tokens it has not cached and gives q at the root;
    2. level by level, up to `tree_width` nodes per level, `tree_depth` levels, `tree_budget` nodes in all
       (draft_tree: greedy keeps the most probable paths; sampling draws children i.i.d. from q, with
       replacement, as multi-step speculative sampling needs); each level's nodes go through the draft in one
       forward, each seeing only its ancestors in the cache;
    3. the target runs its pending tokens plus every node in one forward (positions = depth, tree mask);
    4. verify.verify_tree accepts a path (greedy: argmax matches; sampling: multi-step speculative sampling)
       and yields the correction or bonus token; the path's KV entries are moved next to the prefix.

The drafter grows the tree (drafters/token_tree.py, drafters/model.py); this module verifies it, and the round
loop around both is strategies/rounds.py's (sd's too). Trees need the native backend (explicit positions and a
tree attention mask).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from paraspec.drafters import DraftPolicy, ModelDrafter, TokenTree
from paraspec.request_state import RequestState
from paraspec.strategies.base import Capabilities, LocalStrategy, Seat
from paraspec.strategies.registry import ROUND_DRAFTER_OPTIONS, register
from paraspec.strategies.rounds import speculative_rounds
from paraspec.verify import verify_tree


def tree_mask(parents: list[int]) -> torch.Tensor:
    """Bool [n, n]: node i sees node j iff j is i itself or one of its ancestors."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]  # parents come first, so their rows are complete
    return mask


def verification_inputs(pending: list[int], tree: TokenTree, first_position: int):
    """Target input for one round: the pending committed tokens (causal) then every tree node.

    first_position is the position of pending[0]; a node at depth d sits at the position after the last
    pending token plus d - 1. Returns (token ids, positions, mask [m, m] over the new tokens)."""
    n_pending, n = len(pending), len(tree)
    mask = torch.zeros(n_pending + n, n_pending + n, dtype=torch.bool)
    mask[:n_pending, :n_pending] = torch.ones(n_pending, n_pending, dtype=torch.bool).tril()
    mask[n_pending:, :n_pending] = True
    mask[n_pending:, n_pending:] = tree_mask(tree.parents)
    root = first_position + n_pending - 1
    positions = list(range(first_position, first_position + n_pending)) + [root + d for d in tree.depths]
    return pending + tree.tokens, positions, mask


def tree_shape(run: RequestState, sequence_len: int, depth: int, budget: int) -> tuple[int, int]:
    """Depth and node budget for this round: the round adds at most depth + 1 tokens, and every node takes a
    target cache slot for the verification forward."""
    room = run.max_context - sequence_len - 1
    depth = max(0, min(depth, run.remaining - 1, room))
    return depth, max(0, min(budget, room))


def verify_round(
    run: RequestState, target, sequence: list[int], pending: list[int], tree: TokenTree
) -> tuple[list[int], int]:
    """One target forward over the pending tokens and the whole tree; compact the target's cache to the
    accepted path. Returns (accepted node indices, the next token)."""
    tokens, positions, mask = verification_inputs(pending, tree, target.length)
    target_logits = target.forward(tokens, positions=positions, tree_mask=mask, last_n=len(tree) + 1)
    adjusted = run.adjust_tree(target_logits, tree.tokens, tree.parents)  # bias and penalties along each path
    path, next_token = verify_tree(tree.tokens, tree.parents, tree.draft_probs, adjusted, run.params, run.generator)
    run.observe_target(len(run.tokens), target_logits[[0] + [node + 1 for node in path]])
    target.keep_path(len(sequence), [len(sequence) + node for node in path])
    return path, next_token


def tree_rounds(run: RequestState, target, policy: DraftPolicy, tree_width: int, tree_depth: int, tree_budget: int):
    """The rounds of `tree` and `easyspec` (strategies/rounds.py): draft a tree, verify it in one target forward.
    With the adaptive rule the tree's depth is the rule's k* (0: the target decodes plainly)."""

    def draft(policy: DraftPolicy, sequence: list[int], pending: int) -> TokenTree:
        depth, budget = tree_shape(run, len(sequence), tree_depth, tree_budget)
        if depth == 0:
            return TokenTree()
        return policy.propose_tree(
            sequence, tree_width, depth, budget, run.params, run.generator, pending=pending, remaining=run.remaining
        )

    def verify(sequence: list[int], pending: list[int], tree: TokenTree) -> tuple[list[int], int]:
        return verify_round(run, target, sequence, pending, tree)

    return speculative_rounds(run, target, policy, draft, verify)


# token trees need explicit positions and a tree attention mask; llama.cpp's sequence ids are not exact for a branch
# whose KV cells are not contiguous (benchmarks/llamacpp_tree_exactness.py)
TREE_BACKENDS = ("native",)


class TreeStrategy(LocalStrategy):
    """What `tree` and `easyspec` share: the options, the native backend only, the round loop."""

    option_names: ClassVar[tuple[str, ...]] = ("tree_width", "tree_depth", "tree_budget")  # extended below
    caps = Capabilities(backends=TREE_BACKENDS)

    def round_policy(self, seat: Seat) -> DraftPolicy:
        """Who drafts the rounds: tree's kept DraftPolicy, easyspec's layer-parallel drafter alone."""
        raise NotImplementedError

    def decode(self, run: RequestState, seat: Seat | None = None):
        o, seat = self.options, seat or self.seat
        yield from tree_rounds(
            run, seat.target, self.round_policy(seat), o["tree_width"], o["tree_depth"], o["tree_budget"]
        )


@register
class Tree(TreeStrategy):
    """The drafter: a draft model, "suffix" (branches by frequency), "ngram" (one branch), or several in order."""

    name = "tree"
    summary = "token-tree speculative decoding, one tree-masked target forward (SpecInfer)"
    option_names = TreeStrategy.option_names + ("adaptive",) + ROUND_DRAFTER_OPTIONS
    caps = Capabilities(drafts="several", model_free=True, backends=TREE_BACKENDS)

    def build_policy(self, seat: Seat) -> DraftPolicy:
        o = self.options
        return self.make_policy(
            lambda m: ModelDrafter(m, self.target.vocab_size),
            min(o["tree_budget"], o["tree_width"] * o["tree_depth"]),
            seat,
        )

    def round_policy(self, seat: Seat) -> DraftPolicy:
        return self.kept_policy(seat)
