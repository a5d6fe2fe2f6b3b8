"""Token trees as drafters grow them (SpecInfer, Miao et al. 2024): the tree, the draft cache slots of its nodes,
and draft_tree, which grows a tree level by level from a drafter's logits.

When sampling, how many children a node gets depends only on tokens already drawn (never on the children
themselves), so the children of every node are i.i.d. draws from its q, as multi-step speculative sampling needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from paraspec.sampling import SamplingParams, logits_to_probs


@dataclass
class TokenTree:
    """Nodes in breadth-first order: a parent always comes before its children. Parent -1 is the root (the
    last committed token, whose successor distribution the draft already gave)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # 1 for the root's children
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> q its children came from

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        return len(self.tokens) - 1

    def ancestors(self, node: int) -> list[int]:
        """The node's ancestors, root-down (the root itself excluded)."""
        chain = []
        while (node := self.parents[node]) >= 0:
            chain.append(node)
        return chain[::-1]

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)


class DraftTreeCache:
    """Feeds tree nodes to a draft whose cache holds the committed prefix, level by level.

    `model` has `length` and `keep_path` (a Model, or a drafter that forwards them to every replica).
    `forward(token_ids, positions, mask)` runs the draft on new tokens with a mask over its whole cache
    (exact_forward for `tree`, a layer-parallel forward for `easyspec`) and returns their logits. Remembers which
    cache slot holds which node, so each new node sees the prefix, its ancestors and itself only."""

    def __init__(self, model, forward: Callable, prefix_len: int):
        self.model, self.forward, self.prefix_len = model, forward, prefix_len
        self.slots: dict[int, int] = {}

    def __call__(self, nodes: list[int], tree: TokenTree) -> torch.Tensor:
        start, n = self.model.length, len(nodes)
        mask = torch.zeros(n, start + n, dtype=torch.bool)
        mask[:, : self.prefix_len] = True
        for row, node in enumerate(nodes):
            for ancestor in tree.ancestors(node):
                mask[row, self.slots[ancestor]] = True
            mask[row, start + row] = True
        positions = [self.prefix_len - 1 + tree.depths[node] for node in nodes]
        logits = self.forward([tree.tokens[node] for node in nodes], positions, mask)
        for row, node in enumerate(nodes):
            self.slots[node] = start + row
        return logits

    def accept(self, path: list[int]) -> None:
        """Keep the prefix and the cached part of the accepted path (always a leading part of it)."""
        self.model.keep_path(self.prefix_len, [self.slots[node] for node in path if node in self.slots])


def draft_tree(
    root_logits: torch.Tensor,
    expand: Callable,
    params: SamplingParams,
    generator: torch.Generator,
    vocab_size: int,
    width: int,
    depth: int,
    budget: int,
    mask: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None,
) -> TokenTree:
    """Grow a tree of at most `width` nodes per level from the root's draft logits.

    Greedy: each level keeps the `width` most probable paths among the top-`width` children of the nodes of
    the level above (any tree is exact for greedy verification). Sampling: the level's `width` slots are dealt
    one at a time to the nodes above in order of path probability, and each node draws its children i.i.d.
    from its q -- the root gets `width` children, and every later node one (SpecInfer's <W, 1, 1, ...>), so
    which node gets children never depends on the children drawn. `expand(nodes, tree)` returns the draft
    logits after each of `nodes`. `mask(logits, path)`: a request's grammar on the draft logits after a node's path
    of tokens (Drafter.grammar), applied before anything is drawn or ranked, so q is still what was drawn from; a
    child it rules out (probability 0) is not kept.
    """
    tree = TokenTree()
    masked = mask or (lambda logits, path: logits)
    root = masked(root_logits[:vocab_size], [])
    frontier = [(-1, root, 1.0)]  # (node, draft logits after it, path probability)
    for level in range(1, depth + 1):
        slots = min(width, budget - len(tree))
        if slots <= 0 or not frontier:
            break
        if params.greedy:
            # frontier[0] is the draft's own greedy chain: its top child always stays, so a tree never
            # accepts less than the chain of the same depth
            candidates = []
            for rank, (node, logits, path_prob) in enumerate(frontier):
                probs = torch.softmax(logits.float(), -1)
                top = torch.topk(probs, min(slots, probs.shape[0]))
                candidates += [
                    (rank == 0 and j == 0, path_prob * p, rank, node, t)
                    for j, (p, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()))
                    if mask is None or p > 0
                ]
            candidates.sort(key=lambda c: (not c[0], -c[1], c[2]))
            new_nodes = [(tree.add(token, node), prob) for _, prob, _, node, token in candidates[:slots]]
        else:
            frontier.sort(key=lambda f: -f[2])
            counts = [slots // len(frontier) + (rank < slots % len(frontier)) for rank in range(len(frontier))]
            new_nodes = []
            for (node, logits, path_prob), m in zip(frontier, counts):
                if m == 0:
                    continue
                q = logits_to_probs(logits, params)
                tree.draft_probs[node] = q
                # drawn on the CPU, where the generator is (sampling.make_generator): one read-back of q, and a
                # seed gives the same tree on every device
                q_cpu = q.cpu()
                for token in torch.multinomial(q_cpu, m, replacement=True, generator=generator).tolist():
                    new_nodes.append((tree.add(token, node), path_prob * float(q_cpu[token])))
        if level == depth or len(tree) >= budget:
            break
        logits = expand([node for node, _ in new_nodes], tree)
        frontier = [
            (node, masked(logits[row, :vocab_size], [tree.tokens[n] for n in tree.ancestors(node) + [node]]), prob)
            for row, (node, prob) in enumerate(new_nodes)
        ]
    return tree
