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

When sampling, how many children a node gets depends only on tokens already drawn (never on the children
themselves), so the children of every node are i.i.d. draws from its q, as the acceptance rule requires.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from paraspec.sampling import logits_to_probs
from paraspec.strategies.base import Run
from paraspec.verify import verify_tree


@dataclass
class TokenTree:
    """Nodes in breadth-first order: a parent always comes before its children. Parent -1 is the root (the
    last committed token, whose successor distribution the draft already gave)."""
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)        # 1 for the root's children
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)   # node -> q its children came from

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


def tree_mask(parents: list[int]) -> torch.Tensor:
    """Bool [n, n]: node i sees node j iff j is i itself or one of its ancestors."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]       # parents come first, so their rows are complete
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


class DraftTreeCache:
    """Feeds tree nodes to a draft whose cache holds the committed prefix, level by level.

    `forward(token_ids, positions, mask)` runs the draft on new tokens with a mask over its whole cache
    (exact_forward for `tree`, a fuzzy forward for `easyspec`) and returns their logits. Remembers which
    cache slot holds which node, so each new node sees the prefix, its ancestors and itself only."""

    def __init__(self, model, forward: Callable, prefix_len: int):
        self.model, self.forward, self.prefix_len = model, forward, prefix_len
        self.slots: dict[int, int] = {}

    def __call__(self, nodes: list[int], tree: TokenTree) -> torch.Tensor:
        start, n = self.model.length, len(nodes)
        mask = torch.zeros(n, start + n, dtype=torch.bool)
        mask[:, :self.prefix_len] = True
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
        cached = [self.slots[node] for node in path if node in self.slots]
        keep = getattr(self.model, "keep_path", None)     # a multi-device drafter compacts every replica
        if keep is not None:
            keep(self.prefix_len, cached)
        else:
            keep_path(self.model, self.prefix_len, cached)


def draft_tree(root_logits: torch.Tensor, expand: Callable, run: Run, vocab_size: int, width: int, depth: int,
               budget: int) -> TokenTree:
    """Grow a tree of at most `width` nodes per level from the root's draft logits.

    Greedy: each level keeps the `width` most probable paths among the top-`width` children of the nodes of
    the level above (any tree is exact for greedy verification). Sampling: the level's `width` slots are dealt
    one at a time to the nodes above in order of path probability, and each node draws its children i.i.d.
    from its q -- the root gets `width` children, and every later node one (SpecInfer's <W, 1, 1, ...>), so
    which node gets children never depends on the children drawn. `expand(nodes, tree)` returns the draft
    logits after each of `nodes`.
    """
    tree = TokenTree()
    frontier = [(-1, root_logits[:vocab_size], 1.0)]        # (node, draft logits after it, path probability)
    for level in range(1, depth + 1):
        slots = min(width, budget - len(tree))
        if slots <= 0 or not frontier:
            break
        if run.params.greedy:
            # frontier[0] is the draft's own greedy chain: its top child always stays, so a tree never
            # accepts less than the chain of the same depth
            candidates = []
            for rank, (node, logits, path_prob) in enumerate(frontier):
                probs = torch.softmax(logits.float(), -1)
                top = torch.topk(probs, min(slots, probs.shape[0]))
                candidates += [(rank == 0 and j == 0, path_prob * p, rank, node, t)
                               for j, (p, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()))]
            candidates.sort(key=lambda c: (not c[0], -c[1], c[2]))
            new_nodes = [(tree.add(token, node), prob) for _, prob, _, node, token in candidates[:slots]]
        else:
            frontier.sort(key=lambda f: -f[2])
            counts = [slots // len(frontier) + (rank < slots % len(frontier)) for rank in range(len(frontier))]
            new_nodes = []
            for (node, logits, path_prob), m in zip(frontier, counts):
                if m == 0:
                    continue
                q = logits_to_probs(logits, run.params)
                tree.draft_probs[node] = q
                for token in torch.multinomial(q, m, replacement=True, generator=run.generator).tolist():
                    new_nodes.append((tree.add(token, node), path_prob * float(q[token])))
        if level == depth or len(tree) >= budget:
            break
        logits = expand([node for node, _ in new_nodes], tree)
        frontier = [(node, logits[row, :vocab_size], prob) for row, (node, prob) in enumerate(new_nodes)]
    return tree


def keep_path(model, prefix_len: int, slots: list[int]) -> None:
    """Move the KV entries at `slots` (ascending, all >= prefix_len) to prefix_len, prefix_len + 1, ... and cut
    the cache there. Only the moved entries are copied (KVCache.keep would also copy the whole prefix)."""
    cache = getattr(model, "cache", None)
    if cache is None or not hasattr(cache, "k"):
        raise ValueError("token trees need the native backend (a KV cache with slots); pass backend='native'")
    if slots:
        src = torch.tensor(slots, device=cache.k.device)
        dst = torch.arange(prefix_len, prefix_len + len(slots), device=cache.k.device)
        if not torch.equal(src, dst):
            cache.k[:, :, dst] = cache.k[:, :, src]       # the right side is gathered first: overlap is safe
            cache.v[:, :, dst] = cache.v[:, :, src]
    cache.length = prefix_len + len(slots)


def check_native(*models) -> None:
    for model in models:
        if not hasattr(getattr(model, "cache", None), "k"):
            raise ValueError("tree verification needs the native backend (explicit positions and a tree mask); "
                             "pass backend='native' (--backend native)")


def tree_shape(run: Run, sequence_len: int, depth: int, budget: int) -> tuple[int, int]:
    """Depth and node budget for this round: the round adds at most depth + 1 tokens, and every node takes a
    target cache slot for the verification forward."""
    room = run.max_context - sequence_len - 1
    depth = max(0, min(depth, run.remaining - 1, room))
    return depth, max(0, min(budget, room))


def verify_round(run: Run, target, sequence: list[int], tree: TokenTree) -> tuple[list[int], int]:
    """One target forward over the pending tokens and the whole tree; compact the target's cache to the
    accepted path. Returns (accepted node indices, the next token)."""
    pending = sequence[target.length:]
    tokens, positions, mask = verification_inputs(pending, tree, target.length)
    with run.timed("target", "verify", len(tokens)):
        target_logits = target.forward(tokens, positions=positions, tree_mask=mask, last_n=len(tree) + 1)
    path, next_token = verify_tree(tree.tokens, tree.parents, tree.draft_probs, target_logits, run.params,
                                   run.generator)
    run.observe_target(len(run.tokens), target_logits[[0] + [node + 1 for node in path]])
    keep_path(target, len(sequence), [len(sequence) + node for node in path])
    return path, next_token


def count_round(run: Run, tree: TokenTree, path: list[int]) -> None:
    """acceptance_rate = accepted / drafted counts tokens along the deepest path (the most that one round can
    accept), so it compares with sd's; the node count is kept apart in worker_reports['tree_nodes']."""
    run.rounds += 1
    run.drafted += tree.depth
    run.accepted += len(path)
    run.verified_tokens += len(path) + 1
    run.rollbacks += len(path) < tree.depth
    run.worker_reports["tree_nodes"] = run.worker_reports.get("tree_nodes", 0) + len(tree)


class ExactDrafter:
    """The draft as `tree` drives it: exact forwards over its own cache. easyspec's drafters subclass it and
    change how the root and the tree levels are computed (fuzzy) and what the cache keeps after a round."""

    def __init__(self, model):
        self.model = model

    @property
    def length(self) -> int:
        return self.model.length

    def root(self, pending: list[int]) -> torch.Tensor:
        """Run the committed tokens the draft has not cached; the draft logits after the last one."""
        return self.model.forward(pending, last_n=1)[-1]

    def expand(self, token_ids, positions, mask) -> torch.Tensor:
        from paraspec.models.fuzzy import exact_forward
        return exact_forward(self.model, token_ids, positions, mask)

    def settle(self, prefix_len: int, cache: DraftTreeCache, path: list[int]) -> None:
        """After verification: keep the prefix and the accepted path's cached nodes."""
        cache.accept(path)

    def rollback(self, length: int) -> None:
        self.model.rollback(length)

    def keep_path(self, prefix_len: int, slots: list[int]) -> None:
        keep_path(self.model, prefix_len, slots)

    def drafting(self):
        """Context held while drafting (a multi-device drafter narrows this process's threads and cores)."""
        return nullcontext()


def tree_rounds(run: Run, target, drafter: ExactDrafter, tree_width: int, tree_depth: int, tree_budget: int):
    """The round loop of `tree` and `easyspec`: draft a tree, verify it in one target forward, settle the draft
    cache, commit the accepted path plus the correction/bonus token."""
    target.rollback(0)
    drafter.rollback(0)
    while not run.done:
        sequence = run.sequence
        depth, budget = tree_shape(run, len(sequence), tree_depth, tree_budget)
        tree = TokenTree()
        with run.timed("draft", "draft", depth), drafter.drafting():
            if depth > 0:
                root_logits = drafter.root(sequence[drafter.length:])
                cache = DraftTreeCache(drafter, drafter.expand, len(sequence))
                tree = draft_tree(root_logits, cache, run, target.vocab_size, tree_width, depth, budget)
        path, next_token = verify_round(run, target, sequence, tree)
        if depth > 0:
            drafter.settle(len(sequence), cache, path)
        count_round(run, tree, path)
        yield run.commit([tree.tokens[node] for node in path] + [next_token])


def decode(run: Run, target, draft, tree_width: int = 4, tree_depth: int = 5, tree_budget: int = 64):
    check_native(target, draft)
    yield from tree_rounds(run, target, ExactDrafter(draft), tree_width, tree_depth, tree_budget)
