"""Synchronous speculative decoding (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

Each round: the drafter proposes up to `lookahead` tokens, the target scores all of them in one forward, the
longest acceptable prefix is kept plus one target token (correction or bonus), and both KV caches roll back to
the kept prefix. This module gives the round's draft and verify steps; the loop is strategies/rounds.py's.

The drafter is a draft model, a model-free drafter ("ngram": prompt lookup; "suffix": suffix tries), or several
in order (`draft=["ngram", MODEL]`: the model drafts where the n-gram has nothing). With `adaptive=True` each
round's length is the rule's k* (drafters/adaptive.py), 0 when speculation does not pay; a draft model's chain then
ends where its confidence says the next draft does not pay (ChainStop), up to `lookahead`; `adaptive=False` drafts
`lookahead` tokens every round (Algorithm 1 as written); the default, None (auto), is the rule except for a
sampled request with a seed, which drafts fixed lengths (the rule's choices follow measured times, and a sampled
answer depends on where rounds end).
"""

from __future__ import annotations

from collections.abc import Callable

from paraspec.drafters import DraftPolicy, ModelDrafter, Proposal
from paraspec.request_state import RequestState
from paraspec.strategies.base import Capabilities, LocalStrategy, Seat
from paraspec.strategies.registry import ROUND_DRAFTER_OPTIONS, register
from paraspec.strategies.rounds import speculative_rounds
from paraspec.verify import verify_chain

# sd's default lookahead: where the adaptive rule decides a round, its chain stop ends a draft model's chain where the
# draft doubts (a long chain costs only where the text is predictable), so the cap is wide; a fixed round drafts
# every one of its tokens, so it drafts few
RULE_LOOKAHEAD = 32
FIXED_LOOKAHEAD = 5


@register
class SD(LocalStrategy):
    name = "sd"
    summary = "synchronous speculative decoding (draft k, verify in one forward)"
    option_names = ("lookahead", "draft_confidence", "draft_window", "adaptive") + ROUND_DRAFTER_OPTIONS
    # auto: the adaptive rule decides each round's length (up to lookahead) for greedy and unseeded requests,
    # measured to decide better than a fixed lookahead on every CPU tried (docs/DRAFTERS.md, "sd's default");
    # a seeded sampled request drafts `lookahead` every round, so its seed reproduces it
    option_defaults = {"adaptive": None, "lookahead": None}
    # drafters in order: a model-free one first, the model where it has nothing
    caps = Capabilities(drafts="several", model_free=True, batches=True)

    def build_policy(self, seat: Seat) -> DraftPolicy:
        confidence, window = self.options["draft_confidence"], self.options["draft_window"]
        widest = self.lookahead(self.options["adaptive"] is not False)
        return self.make_policy(lambda m: ModelDrafter(m, self.target.vocab_size, confidence, window), widest, seat)

    def lookahead(self, rule: bool) -> int:
        """The most tokens a round drafts: the option, or by default RULE_LOOKAHEAD where the adaptive rule decides
        the round (its chain stop ends a draft model's chains, adaptive.py) and FIXED_LOOKAHEAD where every round
        drafts that many (adaptive=False, a seeded sampled request)."""
        given = self.options["lookahead"]
        return given if given is not None else RULE_LOOKAHEAD if rule else FIXED_LOOKAHEAD

    def decode(self, run: RequestState, seat: Seat | None = None):
        seat = seat or self.seat
        policy = self.kept_policy(seat)
        yield from chain_rounds(run, seat.target, policy, lambda: self.lookahead(policy.adaptive))


def chain_rounds(run: RequestState, target, policy: DraftPolicy, lookahead: Callable[[], int]):
    """Leviathan et al. Algorithm 1, one round per loop of strategies/rounds.py; `lookahead()`: the round's most
    drafts (the request's: read once it began)."""

    def draft(policy: DraftPolicy, sequence: list[int], pending: int) -> Proposal:
        k = min(lookahead(), run.remaining - 1)  # the round adds one target token after the drafts
        if pending > 1 and pending == len(sequence) and target.splits_prompts:
            # the prompt round on a target that runs the tokens after a prompt in forwards of their own (llama.cpp):
            # drafts there cost the verification they would one round later, but only after it would the first
            # token stream, so they wait a round (the first token comes as soon as `ar`'s)
            k = 0
        return policy.propose(sequence, k, run.params, run.generator, pending=pending, remaining=run.remaining)

    def verify(sequence: list[int], pending: list[int], proposal: Proposal) -> tuple[list[int], int]:
        drafts = proposal.tokens
        target_logits = target.forward(pending + drafts, last_n=len(drafts) + 1)
        run.observe_target(len(run.tokens), target_logits)
        target_logits = run.adjust(target_logits, drafts)  # the request's logit bias and penalties, row by row
        accepted, next_token = verify_chain(drafts, proposal.q, target_logits, run.params, run.generator)
        target.rollback(len(sequence) + accepted)  # the accepted prefix; next_token is fed in the next round
        return list(range(accepted)), next_token

    return speculative_rounds(run, target, policy, draft, verify)
