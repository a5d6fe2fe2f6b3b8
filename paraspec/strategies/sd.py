"""Synchronous speculative decoding (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

Each round: the drafter proposes up to `lookahead` tokens, the target scores all of them in one forward, the
longest acceptable prefix is kept plus one target token (correction or bonus), and both KV caches roll back to
the kept prefix.

The drafter is a draft model, a model-free drafter ("ngram": prompt lookup; "suffix": suffix tries), or several
in order (`draft=["ngram", MODEL]`: the model drafts where the n-gram has nothing). With `adaptive=True` each
round's length is the rule's k* (drafters/adaptive.py), 0 when speculation does not pay.
"""
from __future__ import annotations

from paraspec.drafters import Drafter, Hybrid, ModelDrafter
from paraspec.strategies.registry import DRAFTER_OPTIONS, register
from paraspec.strategies.base import LocalStrategy, Placement
from paraspec.run import Run
from paraspec.verify import verify_chain


@register
class SD(LocalStrategy):
    name = "sd"
    summary = "synchronous speculative decoding (draft k, verify in one forward)"
    options = ("lookahead", "draft_confidence", "adaptive") + DRAFTER_OPTIONS
    several_drafts = True              # drafters in order: a model-free one first, the model where it has nothing
    model_free_drafts = True

    def setup(self, placement: Placement) -> None:
        super().setup(placement)
        confidence = self.options["draft_confidence"]
        self.make_hybrid(lambda m: ModelDrafter(m, self.target.vocab_size, confidence), self.options["lookahead"])

    def decode(self, run: Run):
        yield from chain_rounds(run, self.target, self.hybrid, self.options["lookahead"])


def chain_rounds(run: Run, target, drafter: Drafter, lookahead: int):
    # The target's cache starts empty: the first round drafts from the prompt and the target's prefill verifies
    # the first drafts in the same forward (as HF assisted generation does), so every round looks alike.
    drafter = drafter if isinstance(drafter, Hybrid) else Hybrid([drafter])
    target.rollback(0)
    drafter.reset()
    try:
        while not run.done:
            sequence = run.sequence
            pending = sequence[target.length:]      # the prompt, then each round's correction/bonus token
            k = min(lookahead, run.remaining - 1)   # the round adds one target token after the drafts
            with run.timed("draft", "draft") as event:
                proposal = drafter.propose(sequence, k, run.params, run.generator, pending=len(pending))
                drafts = proposal.tokens
                k = event.tokens = len(drafts)      # fewer than asked: the drafter stopped early (or had none)
            record_plan(run, drafter, k)
            with run.timed("target", "verify", len(pending) + k) as verify:
                target_logits = target.forward(pending + drafts, last_n=k + 1)
            run.observe_target(len(run.tokens), target_logits)
            accepted, next_tok = verify_chain(drafts, proposal.q, target_logits, run.params, run.generator)

            # keep only the accepted prefix in both caches; next_tok is fed at the start of the next round
            target.rollback(len(sequence) + accepted)
            drafter.accept(len(sequence), list(range(accepted)))
            drafter.observe(len(pending) + k, verify.seconds, drafts[:accepted] + [next_tok])
            run.rounds += 1
            run.drafted += k
            run.accepted += accepted
            run.verified_tokens += accepted + 1
            run.rollbacks += accepted < k
            yield run.commit(drafts[:accepted] + [next_tok])
    finally:
        drafter.finish(run.sequence)
        if drafter.adaptive:
            run.worker_reports["adaptive"] = drafter.report()


def record_plan(run: Run, drafter: Hybrid, k: int) -> None:
    """With the adaptive rule, the round's decision goes into the trace: a "plan" event of k tokens."""
    if drafter.adaptive:
        now = run.trace.now()
        run.trace.add("draft", "plan", now, now, k)
