"""Synchronous speculative decoding (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

Each round: the drafter proposes `lookahead` tokens, the target scores all of them in one forward, the longest
acceptable prefix is kept plus one target token (correction or bonus), and both KV caches roll back to the kept
prefix.
"""
from __future__ import annotations

from paraspec.drafters import Drafter, ModelDrafter
from paraspec.strategies import register
from paraspec.strategies.base import LocalStrategy, Run
from paraspec.verify import verify_chain


@register
class SD(LocalStrategy):
    name = "sd"
    summary = "synchronous speculative decoding (draft k, verify in one forward)"
    options = ("lookahead", "draft_confidence")

    def drafter(self) -> Drafter:
        return ModelDrafter(self.drafts[0], self.target.vocab_size, self.options["draft_confidence"])

    def decode(self, run: Run):
        yield from chain_rounds(run, self.target, self.drafter(), self.options["lookahead"])


def chain_rounds(run: Run, target, drafter: Drafter, lookahead: int):
    # The target's cache starts empty: the first round drafts from the prompt and the target's prefill verifies
    # the first drafts in the same forward (as HF assisted generation does), so every round looks alike.
    target.rollback(0)
    drafter.reset()
    while not run.done:
        sequence = run.sequence
        k = min(lookahead, run.remaining - 1)       # the round adds one target token after the drafts
        with run.timed("draft", "draft") as event:
            proposal = drafter.propose(sequence, k, run.params, run.generator)
            drafts = proposal.tokens
            k = event.tokens = len(drafts)         # fewer than asked: the drafter stopped early (or had none)
        pending = sequence[target.length:]          # the prompt, then each round's correction/bonus token
        with run.timed("target", "verify", len(pending) + k):
            target_logits = target.forward(pending + drafts, last_n=k + 1)
        run.observe_target(len(run.tokens), target_logits)
        accepted, next_tok = verify_chain(drafts, proposal.q, target_logits, run.params, run.generator)

        # keep only the accepted prefix in both caches; next_tok is fed at the start of the next round
        target.rollback(len(sequence) + accepted)
        drafter.accept(len(sequence), list(range(accepted)))
        run.rounds += 1
        run.drafted += k
        run.accepted += accepted
        run.verified_tokens += accepted + 1
        run.rollbacks += accepted < k
        yield run.commit(drafts[:accepted] + [next_tok])
