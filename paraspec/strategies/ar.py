"""Autoregressive decoding of the target: the baseline every other strategy must reproduce exactly."""

from __future__ import annotations

from paraspec.request_state import RequestState
from paraspec.sampling import next_token
from paraspec.strategies.base import Capabilities, LocalStrategy, Seat
from paraspec.strategies.registry import register


@register
class AR(LocalStrategy):
    name = "ar"
    summary = "autoregressive decoding of the target"
    caps = Capabilities(drafts="none", batches=True)

    def decode(self, run: RequestState, seat: Seat | None = None):
        target = (seat or self.seat).target
        on = getattr(target, "device", None)  # llama.cpp and simulated models have none: they return when done
        with run.timed("target", "prefill", len(run.prompt_ids), on=on):
            logits = target.prefill(run.prompt_ids)
        run.observe_target(0, logits)
        yield run.commit([next_token(run.adjust(logits), run.params, run.generator)])
        while not run.done:
            with run.timed("target", "decode", 1, on=on):
                logits = target.forward([run.tokens[-1]])[-1]
            run.observe_target(len(run.tokens), logits)
            yield run.commit([next_token(run.adjust(logits), run.params, run.generator)])
