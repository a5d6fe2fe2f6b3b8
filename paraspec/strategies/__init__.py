"""The registry of decoding strategies: name -> decode loop, whether it needs a draft, which options it takes.

A strategy that is not implemented is absent here, and therefore absent from the CLI choices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from paraspec.strategies import amusd, ar, dsi, easyspec, sd, tree


@dataclass(frozen=True)
class Option:
    """A strategy option: an Engine keyword argument and a CLI flag (`lp_size` <-> `--lp-size`)."""
    name: str
    type: type
    default: Any
    help: str
    minimum: int | None = 1           # ints and floats: the smallest valid value

    def check(self, value):
        if self.type is int and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{self.name} must be an integer, got {value!r}")
        if self.type is float and not isinstance(value, (int, float)):
            raise ValueError(f"{self.name} must be a number, got {value!r}")
        if self.type is bool and not isinstance(value, bool):
            raise ValueError(f"{self.name} must be True or False, got {value!r}")
        if self.minimum is not None and self.type in (int, float) and value < self.minimum:
            raise ValueError(f"{self.name} must be >= {self.minimum}, got {value!r}")
        return value


OPTIONS: dict[str, Option] = {o.name: o for o in (
    Option("lookahead", int, 5, "sd: drafted tokens per verification; dsi: drafted tokens per chunk"),
    Option("max_ahead", int, 16, "amusd, dsi: how far the draft may run past the verified prefix "
                                  "(dsi: servers x lookahead keeps every server busy)"),
    Option("verify_chunk", int, 8, "amusd: most drafts verified in one forward"),
    Option("draft_confidence", float, 0.0, "sd: stop a round's drafting early once the draft's probability "
           "of its token falls below this (0 = always draft --lookahead tokens; HF assisted uses 0.4)",
           minimum=0),
    Option("tree_width", int, 4, "tree, easyspec: most nodes per tree level (1 = a chain)"),
    Option("tree_depth", int, 5, "tree, easyspec: levels of the draft tree (tokens one round can accept)"),
    Option("tree_budget", int, 64, "tree, easyspec: most tree nodes verified in one target forward"),
    Option("lp_size", int, 2, "easyspec: layers per parallel group (first and last layer alone; 1 = exact)"),
    Option("layer_groups", str, "", "easyspec: explicit layer groups such as '0,1-3,4-7,...,23' "
                                    "(overrides --lp-size)", minimum=None),
    Option("calibration", bool, True, "easyspec: recompute the draft's KV exactly after each verification"),
)}


@dataclass(frozen=True)
class StrategySpec:
    name: str
    decode: Callable
    needs_draft: bool
    options: tuple[str, ...] = ()     # names in OPTIONS passed to decode as keyword arguments
    summary: str = ""
    workers: bool = False             # runs its models in worker processes: decode(run, runtime, channel, ...)
    spreads_draft: bool = False       # in-process, but spreads the draft over draft_devices (easyspec)
    target_servers: bool = False      # workers only: one target worker per target device, target0..N-1
    several_drafts: bool = False      # workers only: takes a list of drafts (workers draft, draft1, ...)
    backends: tuple[str, ...] = ("native", "hf", "llamacpp")   # model backends its forwards can run on


STRATEGIES: dict[str, StrategySpec] = {
    "ar": StrategySpec("ar", ar.decode, needs_draft=False, summary="autoregressive decoding of the target"),
    "sd": StrategySpec("sd", sd.decode, needs_draft=True, options=("lookahead", "draft_confidence"),
                       summary="synchronous speculative decoding (draft k, verify in one forward)"),
    "amusd": StrategySpec("amusd", amusd.decode, needs_draft=True, options=("max_ahead", "verify_chunk"),
                          summary="draft and verify at the same time on separate devices (AMUSD)", workers=True),
    "dsi": StrategySpec("dsi", dsi.decode, needs_draft=True, options=("lookahead", "max_ahead"),
                        summary="drafters drafting, N target servers verifying chunks in parallel (DSI)",
                        workers=True, target_servers=True, several_drafts=True),
    "tree": StrategySpec("tree", tree.decode, needs_draft=True, options=("tree_width", "tree_depth", "tree_budget"),
                         summary="token-tree speculative decoding, one tree-masked target forward (SpecInfer)",
                         backends=("native",)),
    "easyspec": StrategySpec("easyspec", easyspec.decode, needs_draft=True,
                             options=("tree_width", "tree_depth", "tree_budget", "lp_size", "layer_groups",
                                      "calibration"),
                             summary="layer-parallel fuzzy drafting with bonus calibration (EasySpec)",
                             spreads_draft=True, backends=("native",)),
}


def get_strategy(name: str) -> StrategySpec:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}") from None
