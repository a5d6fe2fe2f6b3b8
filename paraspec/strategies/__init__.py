"""The registry of decoding strategies: name -> decode loop, whether it needs a draft, which options it takes.

A strategy that is not implemented is absent here, and therefore absent from the CLI choices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from paraspec.strategies import amusd, ar, sd


@dataclass(frozen=True)
class StrategySpec:
    name: str
    decode: Callable
    needs_draft: bool
    options: tuple[str, ...] = ()     # Engine keyword arguments passed to decode (named like the CLI flags)
    summary: str = ""
    workers: bool = False             # runs its models in worker processes: decode(run, runtime, channel, ...)


STRATEGIES: dict[str, StrategySpec] = {
    "ar": StrategySpec("ar", ar.decode, needs_draft=False, summary="autoregressive decoding of the target"),
    "sd": StrategySpec("sd", sd.decode, needs_draft=True, options=("lookahead",),
                       summary="synchronous speculative decoding (draft k, verify in one forward)"),
    "amusd": StrategySpec("amusd", amusd.decode, needs_draft=True, options=("max_ahead", "verify_chunk"),
                          summary="draft and verify at the same time on separate devices (AMUSD)", workers=True),
}


def get_strategy(name: str) -> StrategySpec:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}") from None
