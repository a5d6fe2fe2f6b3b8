"""DraftPolicy: who drafts each round, and how much -- a strategy's drafters in order (one drafter, or a model-free
one first and a draft model where it has nothing or is not confident) and, optionally, the adaptive draft length
(drafters/adaptive.py).

Each round the drafters are asked in order and the first with a proposal drafts the round:

    fixed length   each drafter is asked for up to `k` tokens; the first non-empty proposal is the round's;
    adaptive       a model-free drafter proposes first (it costs nothing) and the rule then picks how much of
                   it to verify from that drafter's own acceptance at each position; k* = 0 (not confident)
                   passes the round to the next drafter. A model drafter is asked for exactly k* tokens, k* from
                   its acceptance and its measured forward costs, the catch-up on tokens it has not seen
                   included; with k* = 0 nobody drafts and the target decodes plainly.

After every round each drafter hears what was committed (`Drafter.committed`), whoever drafted it: a model-free
drafter judges its own last proposal by it (drafters/memory.py).

Under a grammar (structured outputs), the tokens it forces next come first and the drafters continue after them
(drafters/forced.py); the rule sizes only the drafter's part, and judges it only where the target kept them all.

q is each proposal's own (None, point masses, for a model-free drafter, the draft model's distributions otherwise), and
a round's drafts all come from one drafter, so acceptance divides by exactly what was drawn from. Which drafter
drafts, and how much, depends only on the sequence and on rounds already verified (lossless).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from paraspec.drafters.adaptive import (
    BEST_ALPHA,
    CONFIDENCE_BASE,
    CONFIDENCE_EDGES,
    MATCH_BUCKETS,
    PROBE_SHARE,
    PROBE_START,
    SOURCE_STRIDE,
    TRIAL_REMAINING,
    Acceptance,
    ChainStop,
    ForwardCost,
    Load,
    best_length,
    bucket_label,
    catch_up_pays,
    confidence_bucket,
    confidence_prior,
    match_bucket,
)
from paraspec.drafters.base import Drafter, Proposal
from paraspec.drafters.forced import graft_tree, join_chain
from paraspec.drafters.token_tree import TokenTree
from paraspec.sampling import SamplingParams
from paraspec.structured import GrammarMatcher


class DraftPolicy(Drafter):
    _asked: int | None
    _forced: list[int]
    _by_confidence: list[int]

    def __init__(
        self,
        drafters: list[Drafter],
        cost: ForwardCost | None = None,
        draft_costs: dict[int, ForwardCost] | None = None,
        auto: bool = False,
    ):
        """cost: the target's forward cost by width; None drafts fixed lengths (not adaptive). draft_costs: a draft
        model's forward cost by width, by its index in `drafters` (measured at start-up; else learned from its
        forwards). auto: the rule stands aside for a sampled request with a seed (begin)."""
        if not drafters:
            raise ValueError("DraftPolicy needs at least one drafter")
        self.drafters, self.cost, self.auto = list(drafters), cost, auto
        self._fixed = False  # this request drafts fixed lengths (auto, a seeded sampled one)
        self.draft_costs = {
            i: (draft_costs or {}).get(i) or ForwardCost() for i, d in enumerate(self.drafters) if not d.free
        }
        # acceptance per (drafter, bucket): a model-free drafter's by the context length each drafted token
        # continues (match_bucket), a model drafter's in bucket 0 (one for every position); kept across requests
        self.acceptance: dict[tuple[int, int], Acceptance] = {}
        self.decisions: list[dict] = []  # one per round: who drafted, k*, alpha (the trace's "plan")
        # many requests at once: () -> what the other requests bring to the target's step (scheduler.py)
        self.load: Callable[[], Load] | None = None
        # and the forwards the target runs a step of such per-request widths as (Sequences.step_forwards)
        self.split: Callable[[list[int]], list[int]] | None = None
        # and a view (the target's, `verifier`, or a draft model's) -> the (rows, seconds) of the forwards its asks
        # rode in: the costs are refined from those, not from a round's wall time, which holds the others' steps too
        self.timed: Callable[[Any], list[tuple[int, float]]] | None = None
        self.verifier: Any = None
        self.grammar: GrammarMatcher | None = None  # the request's structured-output state (begin)
        self._start_round()

    @property
    def adaptive(self) -> bool:
        """The rule decides this request's rounds."""
        return self.cost is not None and not self._fixed

    @property
    def _cost(self) -> ForwardCost:
        """The target's cost by width, read only where the rule is adaptive (so it is set)."""
        assert self.cost is not None
        return self.cost

    def begin(self, params: SamplingParams, prompt_length: int = 0, grammar: GrammarMatcher | None = None) -> None:
        """A request starts. With `auto`, a sampled request with a seed drafts fixed lengths: the rule's choices
        follow measured times (and a busy step's other rows), and where rounds end changes which draws a sampled
        answer spends, so only fixed lengths let the seed give the same tokens again, alone or batched. Greedy
        answers are the target's whatever the lengths; an unseeded request promises no repeat. `grammar`: the
        request's structured-output state (RequestState.grammar), which a draft model masks its chains with."""
        self._fixed = self.auto and not params.greedy and params.seed is not None
        self.grammar = grammar
        for d in self.drafters:
            d.prompt_length, d.grammar = prompt_length, grammar

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
    def propose(
        self,
        sequence: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        pending: int = 1,
        remaining: int | None = None,
    ) -> Proposal:
        """Up to k tokens: the grammar's forced tokens, then the first drafter's that drafts this round after them.
        `pending`: the committed tokens the target has not cached (they go into the same verification forward);
        `remaining`: the tokens the request may still add (a draft model's catch-up must pay for itself within them)."""
        self._start_round(len(sequence))
        forced = self._forced_tokens(k)
        with self._after(forced):
            proposal = self._propose_chain(
                sequence + forced, k - len(forced), params, generator, pending + len(forced), _less(remaining, forced)
            )
        return join_chain(forced, proposal)

    def _propose_chain(
        self,
        sequence: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        pending: int,
        remaining: int | None,
    ) -> Proposal:
        """Up to k tokens from the first drafter that drafts this round."""
        if k <= 0:
            return Proposal([])
        for i, drafter in enumerate(self.drafters):
            if not self.adaptive:
                proposal = drafter.propose(sequence, k, params, generator)
            elif drafter.free:
                proposal = drafter.propose(sequence, k, params, generator)  # q = None: point masses
                if not proposal.tokens:
                    continue
                chosen = self._choose(i, sequence, pending, len(proposal.tokens), remaining)
                self._would_draft(i, chosen, proposal.tokens)
                proposal = _truncate(proposal, chosen)
            else:
                chosen = self._choose(i, sequence, pending, k, remaining)
                if chosen == 0:
                    continue
                # the chain stop decides the length, up to k (a trial, a probe: its own length, to be judged)
                stop = drafter.stops_chains and not (self._trial or self._probing)
                if stop:
                    chosen, drafter.stop = k, self._chain_stop(i, pending, k)
                try:
                    proposal = drafter.propose(sequence, chosen, params, generator)
                finally:
                    drafter.stop = None
                self._by_confidence = [confidence_bucket(m) for m in drafter.confidences] if stop else []
                self._observe_forwards(i)
                self._asked = chosen
            if proposal.tokens:
                self._use(i, len(proposal.tokens))
                return proposal
        return Proposal([])

    def propose_tree(
        self,
        sequence: list[int],
        width: int,
        depth: int,
        budget: int,
        params: SamplingParams,
        generator: torch.Generator,
        pending: int = 1,
        remaining: int | None = None,
    ) -> TokenTree:
        """A trunk of the grammar's forced tokens, then a tree after them from the first drafter that drafts this
        round; adaptive: its depth is k*, with a tree of depth k costed as min(budget, k * width) nodes."""
        self._start_round(len(sequence))
        forced = self._forced_tokens(min(depth, budget))
        n, remaining = len(forced), _less(remaining, forced)
        with self._after(forced):
            tree = self._propose_tree(
                sequence + forced, (width, depth - n, budget - n), params, generator, pending + n, remaining
            )
        return graft_tree(forced, tree)

    def _propose_tree(self, sequence: list[int], shape: tuple[int, int, int], params, generator, pending, remaining):
        """A tree of `shape` (width, depth, budget) from the first drafter that drafts this round (none where depth or
        budget is spent)."""
        width, depth, budget = shape
        if depth <= 0 or budget <= 0:
            return TokenTree()
        for i, drafter in enumerate(self.drafters):
            if not self.adaptive:
                tree = drafter.propose_tree(sequence, width, depth, budget, params, generator)
            elif drafter.free:
                tree = drafter.propose_tree(sequence, width, depth, budget, params, generator)
                if not len(tree):
                    continue
                chosen = self._choose(i, sequence, pending, tree.depth, remaining, width, budget)
                if chosen == 0:
                    self._would_draft(i, 0, tree.tokens[:1])  # the first branch's first token
                tree = prune(tree, chosen)
            else:
                chosen = self._choose(i, sequence, pending, depth, remaining, width=width, budget=budget)
                if chosen == 0:
                    continue
                tree = drafter.propose_tree(sequence, width, chosen, budget, params, generator)
                self._observe_forwards(i)
            if len(tree):
                self._use(i, tree.depth)
                return tree
        return TokenTree()

    def _forced_tokens(self, limit: int) -> list[int]:
        """Up to `limit` tokens the request's grammar forces next (none without one)."""
        return [] if self.grammar is None else self.grammar.forced(limit)

    @contextlib.contextmanager
    def _after(self, forced: list[int]):
        """The drafters propose after the forced tokens: the grammar's state moved past them, each drafter told that
        the sequence ends in that many uncommitted tokens; both restored after."""
        self._forced = forced
        if not forced:
            yield
            return
        assert self.grammar is not None  # forced tokens come from it
        with self.grammar.ahead(forced):
            for d in self.drafters:
                d.uncommitted = len(forced)
            try:
                yield
            finally:
                for d in self.drafters:
                    d.uncommitted = 0

    def _start_round(self, prefix_len: int | None = None) -> None:
        self._prefix_len = prefix_len  # the length of the sequence this round's proposals continue
        self._forced = []  # the grammar's forced tokens the round drafted first (the drafters' after them)
        self._used: int | None = None  # the drafter that drafted the round
        self._buckets: list[int] = []  # the acceptance bucket of each drafted token
        self._accepted = 0
        self._would: tuple[int, int, int] | None = None  # (drafter, position, token): the first token of a
        # model-free proposal that the rule cut off
        self._probing = False
        self._trial = False  # the round is part of a model drafter's trial
        self._asked = None  # the tokens a model drafter was asked for (a chain)
        self._by_confidence = []  # a chain the stop ended: the confidence bucket of each of its drafts
        self._plan = (0.0, 0.0)  # the round's rate under the rule (tokens/s) and the draft's step (s), by _choose
        self._drafts_timed: set[int] = set()  # the draft models whose forwards this round timed

    def _use(self, i: int, drafted: int) -> None:
        self._used, self._buckets = i, self.buckets(i, drafted)

    def _chain_stop(self, i: int, pending: int, limit: int) -> ChainStop:
        """Where drafter i's chain stops this round (ChainStop), from the round's plan (_choose): its rate, the
        target's cost by width, the draft's step, and the acceptance by confidence."""
        rate, draft_s = self._plan
        return ChainStop(
            lambda m: self.alpha(i, confidence_bucket(m)),
            self.alpha(i, 0),
            rate,
            self._cost,
            draft_s,
            pending,
            limit,
        )

    def buckets(self, i: int, k: int) -> list[int]:
        """The acceptance bucket of each of drafter i's next k tokens: a model-free drafter's j-th token continues
        the matched context and the j - 1 tokens drafted before it (bucket ids of its second source of evidence
        start at SOURCE_STRIDE, and so on); a model drafter's are all bucket 0."""
        if not self.drafters[i].free:
            return [0] * k
        n, base = self.drafters[i].last_match, SOURCE_STRIDE * self.drafters[i].last_source
        return [base + match_bucket(n + j) for j in range(k)]

    def stats(self, i: int, bucket: int = 0) -> Acceptance:
        return self.acceptance.setdefault((i, bucket), Acceptance())

    def alpha(self, i: int, bucket: int) -> float:
        """Drafter i's acceptance estimate in `bucket` (its prior: the estimate of the next shorter bucket; a draft
        model's confidence bucket: its middle)."""
        if not self.drafters[i].free and bucket >= CONFIDENCE_BASE:
            return self.stats(i, bucket).posterior(confidence_prior(bucket))
        return self.alphas(i, bucket, lower=False)[bucket]

    def alphas(self, i: int, longest: int = MATCH_BUCKETS[-1], lower: bool = True) -> dict[int, float]:
        """Drafter i's acceptance in every bucket up to `longest`, shortest first, each bucket's estimate the
        prior of the next; `lower`: what the rule drafts by (Acceptance.lower), else the estimates."""
        out, prior = {}, 0.5
        base = longest - longest % SOURCE_STRIDE  # the buckets of the same source of evidence
        for bucket in (base + b for b in (0,) + MATCH_BUCKETS):
            if bucket > longest:
                break
            stats = self.acceptance.get((i, bucket)) or Acceptance()
            out[bucket] = stats.lower(prior) if lower else stats.posterior(prior)
            prior = stats.posterior(prior)
        return out

    def _would_draft(self, i: int, chosen: int, tokens: list[int]) -> None:
        """Remember the first token the rule cut from model-free drafter i's proposal: whether the target's token
        at its position equals it is one more observation of its acceptance, for free (the first free drafter's
        only: a later one's position may not be judged)."""
        if chosen < len(tokens) and self._would is None:
            self._would = (i, chosen, tokens[chosen])

    def _choose(
        self,
        i: int,
        sequence: list[int],
        pending: int,
        max_k: int,
        remaining: int | None,
        width: int = 1,
        budget: int | None = None,
    ) -> int:
        """k* for drafter i (see adaptive.py)."""
        drafter = self.drafters[i]
        prompt_round = pending > 1 and pending == len(sequence)  # the target has cached nothing yet
        if prompt_round and not drafter.free:
            # the prompt round: the target's prefill runs alone, so the first token comes as soon as `ar`'s; the
            # draft model reads the prompt after it, in a catch-up priced like any other (rather than before the
            # first token, where its prompt would add to the time to first token whatever it saves later)
            self.decisions.append(
                {
                    "drafter": drafter.name,
                    "k": 0,
                    "alpha": None,
                    "tokens_per_s": 0.0,
                    "probe": False,
                    "trial": False,
                    "prompt": True,
                }
            )
            return 0
        nodes = (lambda k: k) if width == 1 else (lambda k: min(budget, k * width))

        def verify(waiting: int):
            if width == 1:
                return self._cost  # one node a draft: waiting + (n - waiting) is n
            return lambda n: self._cost(waiting + nodes(n - waiting))

        buckets = self.buckets(i, max_k)
        by_bucket = self.alphas(i, max(buckets, default=0), lower=drafter.free)  # a draft model: its mean (adaptive.py)
        alphas = [by_bucket[b] for b in buckets]
        draft_cost = self.draft_costs.get(i)
        draft_s, draft_step = 0.0, None
        if draft_cost is not None and draft_cost.measured:
            cost = draft_cost
            draft_s = cost(width)

            def draft_step(n: int) -> float:  # the draft's step of n requests' drafts: one forward of their rows
                return cost(n * width)

        load = self.load() if self.load is not None else Load()
        k, rate = best_length(alphas, draft_s, verify(pending), pending, max_k, load, self.split, draft_step)
        self._plan = (rate, draft_s)
        if not drafter.free:
            state = self.stats(i)
            catch_up = self._catch_up_s(i, sequence, width)

            # a catch-up is paid once for the request's later rounds: priced by the steady load, the others' rows,
            # not by a prompt's chunks beside this step (they end within a few steps; counted per round, they would
            # make any round that commits more tokens look worth a catch-up)
            steady_load = Load(load.rows)

            def steady(most: int) -> float:  # tokens/s of a later round (one pending token) in the others' load
                return best_length(alphas, draft_s, verify(1), 1, most, steady_load, self.split, draft_step)[1]

            plain_s = 1.0 / steady(0)  # a token's seconds undrafted: a step alone, a share of a busy step
            if k > 0 and catch_up > 0:
                if not catch_up_pays(catch_up, steady(max_k), plain_s, remaining):
                    k = 0
            look = None  # a look at the drafter: its trial (never judged), or a probe
            if not state.tried and (remaining is None or remaining >= TRIAL_REMAINING) and max_k > 0:
                look = "trial"
            elif k == 0:
                state.plain_rounds += 1
                # probe a model drafter that has not drafted lately, if what the probe adds to a plain round (its
                # catch-up, its draft, the verification one token wider) is a small share of the plain rounds
                # since (a probe that has to feed it the whole prompt is not worth the look)
                if state.plain_rounds >= state.probe_after:
                    probe_s = catch_up + draft_s + self._cost(pending + nodes(1)) - self._cost(pending)
                    if probe_s <= PROBE_SHARE * state.plain_rounds * self._cost(1):
                        look = "probe"
            # a look only where drafting could pay were the drafts as good as drafts get (BEST_ALPHA): on a CPU where
            # the draft model's step costs most of the target's and verification grows with its width, no acceptance
            # pays, and the look would only buy the prompt's catch-up (docs/DRAFTERS.md;
            # test_a_draft_model_that_cannot_pay_even_when_always_right_is_never_tried,
            # test_a_look_needs_drafting_to_pay_with_drafts_as_good_as_they_get)
            if look and self._could_pay(
                draft_s, verify(1), max_k, catch_up, remaining, steady_load, plain_s, draft_step
            ):
                if look == "trial":
                    k, self._trial = max(k, min(max_k, state.trial_k)), True
                else:
                    k, self._probing = 1, True
            if k > 0:
                state.plain_rounds = 0
        self.decisions.append(
            {
                "drafter": drafter.name,
                "k": k,
                "alpha": round(alphas[0], 3) if alphas else None,
                "tokens_per_s": round(rate, 2),
                "probe": self._probing,
                "trial": self._trial,
            }
        )
        return k

    def _could_pay(
        self,
        draft_s: float,
        verify_s,
        max_k: int,
        catch_up: float,
        remaining: int | None,
        load: Load,
        plain_s: float,
        draft_step: Callable[[int], float] | None = None,
    ) -> bool:
        """Whether drafting would beat plain decoding in the best case (every draft accepted with BEST_ALPHA), in a
        step with the others' `load`, its catch-up paid within the request's remaining tokens: where even that
        loses, learning the drafter's acceptance is worth nothing (now: a busy Scheduler looks again when it is
        quieter)."""
        k, rate = best_length(BEST_ALPHA, draft_s, verify_s, 1, max_k, load, self.split, draft_step)
        return k > 0 and catch_up_pays(catch_up, rate, plain_s, remaining)

    def _catch_up_s(self, i: int, sequence: list[int], width: int) -> float:
        """Seconds drafter i spends feeding the tokens it has not seen, beyond a round's usual one-token feed."""
        cost = self.draft_costs.get(i)
        behind = self.drafters[i].behind(sequence)
        if cost is None or not cost.measured or behind <= 1:
            return 0.0
        return max(cost(behind) - cost(width), 0.0)

    def _observe_forwards(self, i: int) -> None:
        self._drafts_timed.add(i)
        drafter = self.drafters[i]
        for width, seconds in drafter.timings if self.timed is None else self.timed(drafter.model):
            self.draft_costs[i].observe(width, seconds)

    # -- after verification -----------------------------------------------------------------------------------
    def accept(self, prefix_len: int, path: list[int]) -> None:
        """Verification kept `path` (see Drafter.accept) of the round's proposal: the forced tokens, then the
        drafter's."""
        f = len(self._forced)
        self._accepted = len(path) - f  # the drafter's tokens kept; < 0: a forced token was not, nor any of them
        if self._used is None:
            return
        drafter = self.drafters[self._used]
        if self._accepted < 0:
            drafter.rollback(prefix_len + len(path))  # a draft model's cache took the forced tokens the target did not
        else:
            drafter.accept(prefix_len + f, [node - f for node in path[f:]])

    def observe(self, verify_width: int, verify_s: float, committed: list[int]) -> None:
        """Feedback after the round: the verification's width and seconds, and the tokens it committed. The drafters'
        proposals continued the forced tokens: they hear and are judged by what came after them, if the target kept
        them all."""
        f = len(self._forced)
        after = committed[f:] if committed[:f] == self._forced else None
        if self._prefix_len is not None and after is not None:
            for d in self.drafters:
                d.committed(self._prefix_len + f, after)
        if not self.adaptive:
            return
        level = 1.0
        for width, seconds in [(verify_width, verify_s)] if self.timed is None else self.timed(self.verifier):
            level *= self._cost.observe(width, seconds)
        # a draft model that did not run this round follows the target's level: the same cores and context make
        # both slower or faster, and a draft priced at its start-up cost while the target's rises would look
        # cheaper than it is (an untried draft then looks worth its trial and its catch-up of the prompt)
        for i, cost in self.draft_costs.items():
            if i not in self._drafts_timed:
                cost.rescale(level)
        if self._used is not None and self._accepted >= 0:
            judged = self._buckets[: self._accepted + 1]  # the accepted drafts and the first rejected one
            # a draft model that stopped short of k* (draft_confidence) and was right up to there failed the next
            # slot as a rejection would: the rule's a_j is then the chance that slot j is drafted and accepted,
            # what E(k) needs (judging only the drafts it let through would overstate the rounds it cuts short)
            # (a chain the rule's stop ended too: k* then reads a slot's chance to be drafted and kept, what a round
            # under the stop yields, not the acceptance of the drafts the stop let through, which is higher where
            # the stop cuts most; the confidence buckets judge the drafts made)
            declined = self._asked is not None and self._accepted == len(self._buckets) < self._asked
            if declined:
                judged = judged + [0]
            for bucket in dict.fromkeys(judged):
                self.stats(self._used, bucket).observe(
                    judged.count(bucket), self._buckets[: self._accepted].count(bucket)
                )
            # and by the draft's confidence: the accepted drafts and the first rejected one (a chain it stopped
            # has no slot after its last draft to judge)
            by_confidence = self._by_confidence[: self._accepted + 1]
            for bucket in dict.fromkeys(by_confidence):
                self.stats(self._used, bucket).observe(
                    by_confidence.count(bucket), self._by_confidence[: self._accepted].count(bucket)
                )
            state = self.stats(self._used)
            if self._probing:
                state.probe_after = PROBE_START if self._accepted else 2 * state.probe_after
            if self._trial:
                state.trial_k = 2 * state.trial_k if self._accepted == len(self._buckets) and not declined else 1
        if self._would is not None and after is not None:  # what a model-free drafter would have drafted next
            i, position, token = self._would
            # judged only if the target's token at that position is committed: every draft before it accepted
            if position == (self._accepted if self._used == i else 0) and position < len(after):
                self.stats(i, self.buckets(i, position + 1)[position]).observe(1, int(after[position] == token))

    def report(self) -> dict:
        """Per drafter: its acceptance estimates now; the rounds by k* (the rule's decisions); the costs."""
        by_k: dict[str, dict[int, int]] = {}
        for d in self.decisions:
            counts = by_k.setdefault(d["drafter"], {})
            counts[d["k"]] = counts.get(d["k"], 0) + 1
        return {
            "rule": "k* = argmax_k (1 + a1 + a1 a2 + ... + a1..ak) / (k d + c(w + k)), catch-up priced",
            "alpha": {self._label(i, b): round(self.alpha(i, b), 3) for (i, b) in sorted(self.acceptance)},
            "rounds_by_k": by_k,
            "verify_cost_ms": {w: round(s * 1e3, 2) for w, s in sorted(self._cost.seconds.items())},
            "draft_cost_ms": {
                self.drafters[i].name: {w: round(s * 1e3, 2) for w, s in sorted(c.seconds.items())}
                for i, c in self.draft_costs.items()
            },
        }

    def _label(self, i: int, bucket: int) -> str:
        """`suffix/match5-7`, `suffix/cache/match1` (a second source's), `model` (report keys)."""
        drafter = self.drafters[i]
        if not drafter.free:
            if bucket < CONFIDENCE_BASE:
                return drafter.name
            lo = CONFIDENCE_EDGES[bucket - CONFIDENCE_BASE]
            return f"{drafter.name}/confidence{lo:g}+"
        source = drafter.sources[bucket // SOURCE_STRIDE]
        return "/".join(filter(None, (drafter.name, source, bucket_label(bucket % SOURCE_STRIDE))))


def _less(remaining: int | None, forced: list[int]) -> int | None:
    """The tokens a request may still add after the forced ones."""
    return None if remaining is None else remaining - len(forced)


def _truncate(proposal: Proposal, k: int) -> Proposal:
    """The first k tokens of a proposal (a prefix of a deterministic proposal is the proposal for k)."""
    if k >= len(proposal.tokens):
        return proposal
    return Proposal(proposal.tokens[:k], None if proposal.q is None else proposal.q[:k])


def prune(tree: TokenTree, depth: int) -> TokenTree:
    """The nodes of `tree` at most `depth` deep (parents come first, so every kept node's parent is kept)."""
    if depth >= tree.depth:
        return tree
    kept = TokenTree()
    index: dict[int, int] = {}  # node of `tree` -> node of `kept`
    for node, (token, parent, d) in enumerate(zip(tree.tokens, tree.parents, tree.depths)):
        if d <= depth:
            index[node] = kept.add(token, index[parent] if parent >= 0 else -1)
    kept.draft_probs = {(index[n] if n >= 0 else -1): q for n, q in tree.draft_probs.items() if n < 0 or n in index}
    return kept
