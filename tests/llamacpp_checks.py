"""The batch-invariance check the llamacpp tests share: a forward of w tokens against w one-token forwards."""

from __future__ import annotations

import torch


def one_at_a_time(model, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    model.prefill(prefix)
    return torch.cat([model.forward([t]) for t in tokens])


def assert_forwards_are_one_token_forwards(model, ids: list[int], context: int, what: str = "", widths=None) -> None:
    """After ids[:context], every forward of the next w tokens (w in `widths`; all of 1..len(ids) - context by
    default) gives, bitwise, the logits those tokens get decoded one at a time."""
    reference = one_at_a_time(model, ids[:context], ids[context:])
    for w in widths or range(1, len(ids) - context + 1):
        model.rollback(context)
        got = model.forward(ids[context : context + w])
        assert torch.equal(got, reference[:w]), (
            f"{what} P={context}, width {w}: max |diff| {float((got - reference[:w]).abs().max()):.3g}"
        )
