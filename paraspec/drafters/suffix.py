"""Suffix drafting (SuffixDecoding, Oliaro et al. 2024; vLLM's `suffix`): propose what most often followed the
current context, in this request's prompt and text and in the engine's earlier outputs.

Two suffix tries, each holding every substring of up to `depth` tokens of the sequences added to it with the
number of times it occurs (a suffix tree cut at depth `depth`, O(depth) to extend per token):

    request trie   the prompt and the tokens generated so far (rebuilt for every request);
    output cache   the outputs of the engine's last `cache_requests` requests, shared across requests (the
                   oldest output is removed, counts and all, when the cache is full).

Each round matches the longest suffix of the sequence (up to `depth // 2` tokens) in both tries and follows
the continuation from the deeper match (the request's on a tie): a chain takes the most frequent child at every
step; a tree (`propose_tree`) takes the `width` most frequent children of each node, best first by the
empirical probability of the path (count(child) / count(parent) multiplied down), so branches come ordered by
frequency. How long a proposal is comes from the evidence, as in SuffixDecoding:

    score        a path whose empirical probability falls below `min_prob` is not proposed (vLLM's
                 `suffix_decoding_min_token_prob`, 0.1): after a short, common context the continuations are too
                 spread to pay;
    match        at most `factor` x the matched length (SuffixDecoding's MAX_SPEC = alpha * p, vLLM's
                 `suffix_decoding_max_spec_factor`, 1.0 there): a 2-token match says little about 10 tokens on.
                 paraspec's default is 0, no cap: the adaptive rule keeps an acceptance per match length and cuts
                 each proposal where its tokens stop paying, and the cap only threw away the tokens it would have
                 kept (`benchmarks/draft_replay.py --variant suffix_factor=1` replays `ar` answers with and
                 without it; docs/DRAFTERS.md);
    memory       a pattern whose last proposal went wrong after r tokens proposes r; one whose last proposal was
                 right as far as it was checked is not held to the factor (drafters/memory.py; chains only);
    copy         a chain that followed the request's trie to the depth the trie holds continues, past it, as the
                 text continued after the latest earlier occurrence of its last COPY_KEY tokens (prompt lookup,
                 llama.cpp's ngram-simple): a copied span is longer than any trie depth, and the adaptive rule
                 verifies as much of it as pays (a forward's cost grows slower than its width:
                 benchmarks/llamacpp_forward_widths.py). A match as long as the trie
                 can see (depth // 2) is not held to the factor either.

q: proposals are deterministic functions of the sequence and the cache, so each token's q is the point mass on
it (q = None; a tree's siblings are distinct fixed tokens: verify_tree judges each with its own point mass).
"""

from __future__ import annotations

import heapq
import itertools
import math
import sys
from collections import deque

import torch

from paraspec.drafters.base import Drafter, Proposal
from paraspec.drafters.memory import PatternMemory
from paraspec.drafters.ngram import BULK, NGramIndex, gc_paused
from paraspec.drafters.token_tree import TokenTree
from paraspec.sampling import SamplingParams

MIN_PROB = 0.1  # vLLM's default suffix_decoding_min_token_prob
SPEC_FACTOR = 0.0  # no cap by the match length (vLLM's suffix_decoding_max_spec_factor is 1.0): see above
COPY_KEY = 8  # tokens whose latest earlier occurrence continues a chain past the trie's depth
# the tries' depth: indexing a prompt costs O(depth) per token (paid in the first round), and past the depth the
# copy takes over, so the depth is the shallowest that drafts as well as a deeper one (benchmarks/draft_replay.py
# --variant suffix_depth=32 replays `ar` answers at both)
DEPTH = 16


class _Node:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Every substring of up to `depth` tokens of the sequences added, with its number of occurrences."""

    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"suffix_depth must be >= 2 (a match and a proposed token), got {depth}")
        self.depth = depth
        self.root = _Node()

    def add(self, tokens, sign: int = 1) -> None:
        """Count every substring of `tokens` (up to `depth` long) once per occurrence; sign=-1 removes them."""
        active: list[_Node] = []  # active[d - 1]: the node of the last d tokens
        with gc_paused(len(tokens) >= BULK):
            for token in tokens:
                active = self._step(active, int(token), sign)

    def _step(self, active: list[_Node], token: int, sign: int) -> list[_Node]:
        new = []
        for parent in [self.root] + active[: self.depth - 1]:
            child = parent.children.get(token)
            if child is None:
                if sign < 0:
                    break  # never added (cannot happen for a sequence that was): nothing deeper
                child = parent.children[token] = _Node()
            child.count += sign
            if child.count <= 0:
                del parent.children[token]
            new.append(child)
        return new

    def match(self, sequence: list[int], longest: int) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `sequence` (at most `longest` tokens) that occurs with a
        continuation, and its length."""
        for m in range(min(longest, len(sequence), self.depth - 1), 0, -1):
            node = self.root
            for token in sequence[len(sequence) - m :]:
                child = node.children.get(token)
                if child is None:
                    break
                node = child
            else:
                if node.children:
                    return node, m
        return None, 0

    def size(self) -> int:
        count, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            count += len(node.children)
            stack.extend(node.children.values())
        return count


class RequestTrie(NGramIndex):
    """A SuffixTrie of the current request's sequence but its last token, extended as the sequence grows: a
    match of the sequence's suffix is then always an earlier occurrence (never the suffix itself). Beside it, the
    n-gram index of every COPY_KEY tokens (where the text after their latest occurrence starts: `lookup`), to copy
    past the trie's depth."""

    def __init__(self, depth: int):
        self.depth = depth
        super().__init__(COPY_KEY, COPY_KEY)

    def restart(self) -> None:
        super().restart()
        self.trie = SuffixTrie(self.depth)
        self._active: list[_Node] = []

    def append(self, token: int) -> None:
        super().append(token)
        if len(self.tokens) >= 2:
            self._active = self.trie._step(self._active, self.tokens[-2], 1)


class SuffixDrafter(Drafter):
    name = "suffix"
    free = True
    # the adaptive rule keeps an acceptance for proposals from the output cache apart from the request's own: other
    # requests' outputs are right less often at the same match length, and one acceptance for both sources cuts the
    # request's own proposals short (compared by replaying HumanEval answers, benchmarks/draft_replay.py;
    # docs/DRAFTERS.md)
    sources = ("", "cache")

    def __init__(
        self,
        vocab_size: int,
        depth: int = DEPTH,
        cache_requests: int = 128,
        factor: float = SPEC_FACTOR,
        min_prob: float = MIN_PROB,
        memory: bool = True,
    ):
        if cache_requests < 0:
            raise ValueError(f"suffix_cache must be >= 0 (earlier requests kept), got {cache_requests}")
        if factor < 0:
            raise ValueError(f"suffix_factor must be >= 0 (0: no cap by the match length), got {factor}")
        if not 0 <= min_prob <= 1:
            raise ValueError(f"suffix_min_prob must be a probability in [0, 1], got {min_prob}")
        self.vocab_size, self.depth, self.cache_requests = vocab_size, depth, cache_requests
        self.factor, self.min_prob = factor, min_prob
        self.memory = PatternMemory() if memory else None
        self.request = RequestTrie(depth)
        self.cache = SuffixTrie(depth)  # shared across requests
        self.cached: deque[list[int]] = deque()  # the outputs in the cache, oldest first
        self.prompt_len: int | None = None
        self.last_match = 0

    # -- requests ---------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.request.restart()
        self.prompt_len = None
        if self.memory is not None:
            self.memory.reset()

    def finish(self, sequence: list[int]) -> None:
        """The request ended: its output joins the cache (the oldest leaves when full)."""
        if self.prompt_len is None or self.cache_requests == 0:
            return
        output = [int(t) for t in sequence[self.prompt_len :]]
        self.prompt_len = None
        if len(output) < 2:
            return
        self.cache.add(output)
        self.cached.append(output)
        while len(self.cached) > self.cache_requests:
            self.cache.add(self.cached.popleft(), sign=-1)

    def _match(self, sequence: list[int]) -> tuple[_Node | None, int, bool]:
        """The deeper of the two tries' matches: (node, length, whether it is the request's)."""
        committed = sequence[: len(sequence) - self.uncommitted]  # the trie takes committed tokens only
        if self.prompt_len is None:
            self.prompt_len = len(committed)
        self.request.sync(committed)
        longest = self.depth // 2
        mine = self.request.trie.match(sequence, longest)
        theirs = self.cache.match(sequence, longest)
        from_request = mine[1] >= theirs[1]
        node, n = mine if from_request else theirs
        self.last_match, self.last_source = n, 0 if from_request else 1
        return node, n, from_request and node is not None

    # -- proposals --------------------------------------------------------------------------------------------
    def max_length(self, matched: int) -> int:
        """The factor's cap on a proposal after a `matched`-token match (at least one token)."""
        return max(1, math.ceil(self.factor * matched)) if self.factor > 0 else sys.maxsize

    def propose(
        self, sequence: list[int], k: int, params: SamplingParams, generator: torch.Generator, pending: int = 1
    ) -> Proposal:
        if k <= 0:
            return Proposal([])
        node, n, from_request = self._match(sequence)
        tokens: list[int] = []
        prob = 1.0
        while node is not None and node.children and len(tokens) < min(k, self.depth - n):
            token, child = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))
            prob *= child.count / max(node.count, 1)
            if prob < self.min_prob or token >= self.vocab_size:
                break
            tokens.append(token)
            node = child
        if from_request and tokens and len(tokens) == self.depth - n < k:
            # the trie's depth ended a confident chain: continue as the text did after its last occurrence
            copied, _ = self.request.lookup(k - len(tokens), sequence[-COPY_KEY:] + tokens)
            tokens += itertools.takewhile(lambda t: t < self.vocab_size, copied)
        cap, extend = self.memory.consult(sequence, n, tokens) if self.memory else (None, False)
        if not extend and n < self.depth // 2:  # a match as long as the trie sees is not capped
            tokens = tokens[: self.max_length(n)]
        if cap is not None:
            tokens = tokens[:cap]
        return Proposal(tokens)  # q = None: point masses

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
        """Best first by the path's empirical probability: at most `width` children a node (its most frequent),
        `depth` levels, `budget` nodes. The children of a node come out in decreasing frequency."""
        tree = TokenTree()
        root, n, _ = self._match(sequence)
        if root is None:
            return tree
        depth = min(depth, self.depth - n, self.max_length(n))
        heap: list = []
        order = 0

        def push(node: _Node, parent: int, level: int, prob: float) -> None:
            nonlocal order
            if level >= depth:
                return
            kids = sorted(node.children.items(), key=lambda kv: (-kv[1].count, kv[0]))[:width]
            for token, child in kids:
                p = prob * child.count / max(node.count, 1)
                if p >= self.min_prob and token < self.vocab_size:
                    heapq.heappush(heap, (-p, order, token, child, parent, level + 1))
                    order += 1

        push(root, -1, 0, 1.0)
        while heap and len(tree) < budget:
            neg_p, _, token, node, parent, level = heapq.heappop(heap)
            index = tree.add(token, parent)
            push(node, index, level, -neg_p)
        return tree  # no draft_probs: every node's children are fixed tokens (point masses)
