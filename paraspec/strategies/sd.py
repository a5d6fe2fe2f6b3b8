"""Synchronous speculative decoding (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

Each round: the draft proposes `lookahead` tokens one by one, the target scores all of them in one forward,
the longest acceptable prefix is kept plus one target token (correction or bonus), and both KV caches roll back
to the kept prefix.
"""
from __future__ import annotations

import torch

from paraspec.sampling import logits_to_probs, sample
from paraspec.strategies.base import Run
from paraspec.verify import verify_chain


def draft_chain(draft, sequence: list[int], k: int, run: Run, vocab_size: int,
                min_confidence: float = 0.0) -> tuple[list[int], torch.Tensor | None]:
    """Sample k tokens from the draft continuing `sequence`; return them and the q each was drawn from.

    The draft first catches up on the tokens of `sequence` it has not cached (e.g. the last round's bonus token).
    Only the first `vocab_size` ids (those the target can score) are proposed: a padding row of a wider draft
    head could otherwise win. The returned q rows are the distributions actually sampled from (None if greedy).
    With `min_confidence`, drafting stops after a token whose draft probability is below it (the rule of HF's
    assisted generation): where the draft is unsure the target will likely reject, so drafting on is waste.
    Stopping early only shortens the chain, so acceptance stays exact.
    """
    tokens, probs = [], []
    if k <= 0:
        return tokens, None
    logits = draft.forward(sequence[draft.length:], last_n=1)[-1, :vocab_size]
    for i in range(k):
        if run.params.greedy:
            token = int(logits.argmax())
        else:
            q = logits_to_probs(logits, run.params)
            token = sample(q, run.generator)
            probs.append(q)
        tokens.append(token)
        if min_confidence > 0 and float(logits.softmax(-1)[token]) < min_confidence:
            break
        if i < k - 1:
            logits = draft.forward([token])[-1, :vocab_size]
    return tokens, (torch.stack(probs) if probs else None)


def decode(run: Run, target, draft, lookahead: int = 5, draft_confidence: float = 0.0):
    # Both caches start empty: the first round drafts from the prompt and the target's prefill verifies the
    # first drafts in the same forward (as HF assisted generation does), so every round looks alike.
    target.rollback(0)
    draft.rollback(0)
    while not run.done:
        sequence = run.sequence
        k = min(lookahead, run.remaining - 1)       # the round adds one target token after the drafts
        with run.timed("draft", "draft") as event:
            drafts, q = draft_chain(draft, sequence, k, run, target.vocab_size, draft_confidence)
            k = event.tokens = len(drafts)         # fewer than asked when the confidence stop ended the round
        pending = sequence[target.length:]          # the prompt, then each round's correction/bonus token
        with run.timed("target", "verify", len(pending) + k):
            target_logits = target.forward(pending + drafts, last_n=k + 1)
        run.observe_target(len(run.tokens), target_logits)
        accepted, next_tok = verify_chain(drafts, q, target_logits, run.params, run.generator)

        # keep only the accepted prefix in both caches; next_tok is fed at the start of the next round
        target.rollback(len(sequence) + accepted)
        draft.rollback(min(draft.length, len(sequence) + accepted))
        run.rounds += 1
        run.drafted += k
        run.accepted += accepted
        run.verified_tokens += accepted + 1
        run.rollbacks += accepted < k
        yield run.commit(drafts[:accepted] + [next_tok])
