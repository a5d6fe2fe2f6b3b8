"""Autoregressive decoding of the target: the baseline every other strategy must reproduce exactly."""
from __future__ import annotations

from paraspec.sampling import logits_to_probs, sample
from paraspec.strategies.base import Run


def next_token(logits, run: Run) -> int:
    if run.params.greedy:
        return int(logits.argmax())
    return sample(logits_to_probs(logits, run.params), run.generator)


def decode(run: Run, target, draft=None):
    with run.timed("target", "prefill", len(run.prompt_ids)):
        logits = target.prefill(run.prompt_ids)
    run.observe_target(0, logits)
    yield run.commit([next_token(logits, run)])
    while not run.done:
        with run.timed("target", "decode", 1):
            logits = target.forward([run.tokens[-1]])[-1]
        run.observe_target(len(run.tokens), logits)
        yield run.commit([next_token(logits, run)])
