"""The registries: decoding strategies (name -> Strategy class) and their options (name -> Option).

Each strategy module registers its class with `register`; `paraspec.strategies` imports the modules once. A
strategy that is not implemented is absent here, and therefore absent from the CLI choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paraspec.strategies.base import Strategy


@dataclass(frozen=True)
class Option:
    """A strategy option: an Engine keyword argument and a CLI flag (`tree_width` <-> `--tree-width`)."""

    name: str
    type: type
    default: Any
    help: str
    minimum: int | None = 1  # ints and floats: the smallest valid value
    maximum: float | None = None  # and the largest
    none: str = ""  # what None means, where the option takes it ("" : it does not)

    def check(self, value):
        if value is None and self.none:
            return None
        if self.type is int and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{self.name} must be an integer, got {value!r}")
        if self.type is float and not isinstance(value, (int, float)):
            raise ValueError(f"{self.name} must be a number, got {value!r}")
        if self.type is bool and not isinstance(value, bool):
            raise ValueError(f"{self.name} must be True or False{' or None' if self.none else ''}, got {value!r}")
        if self.minimum is not None and self.type in (int, float) and value < self.minimum:
            raise ValueError(f"{self.name} must be >= {self.minimum}, got {value!r}")
        if self.maximum is not None and self.type in (int, float) and value > self.maximum:
            raise ValueError(f"{self.name} must be <= {self.maximum}, got {value!r}")
        return value


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        Option(
            "lookahead",
            int,
            5,
            "sd: most drafted tokens per verification; dsi: drafted tokens per chunk",
            none="auto: 32 where the adaptive rule decides the round, 5 where every round drafts them all",
        ),
        Option(
            "max_ahead",
            int,
            16,
            "amusd, dsi: how far the draft may run past the verified prefix "
            "(dsi: servers x lookahead keeps every server busy)",
        ),
        Option("verify_chunk", int, 8, "amusd: most drafts verified in one forward"),
        Option(
            "lend_cores",
            bool,
            True,
            "amusd, dsi: the target's prompt runs on every worker's cores while the others wait (its first token "
            "comes as soon as ar's would), then the draft models read theirs while the target decodes alone, where "
            "every device is a core set of one machine (False: every prompt at once, each on its own cores)",
        ),
        Option(
            "draft_confidence",
            float,
            0.0,
            "sd: stop a round's drafting early once the draft's probability "
            "of its token falls below this (0 = always draft --lookahead tokens; HF assisted uses 0.4)",
            minimum=0,
        ),
        Option(
            "draft_window",
            int,
            0,
            "sd, amusd, dsi: the draft model reads at most the last N tokens of the context it has not cached -- a "
            "long prompt's catch-up costs N tokens, not the prompt, and the draft loses the rest of the context "
            "(0 = all of it, the default: code drafts need it; docs/DRAFTERS.md, 'The draft's window')",
            minimum=0,
        ),
        Option("tree_width", int, 4, "tree, easyspec: most nodes per tree level (1 = a chain)"),
        Option("tree_depth", int, 5, "tree, easyspec: levels of the draft tree (tokens one round can accept)"),
        Option("tree_budget", int, 64, "tree, easyspec: most tree nodes verified in one target forward"),
        Option(
            "layer_parallel_size", int, 2, "easyspec: layers per parallel group (first and last layer alone; 1 = exact)"
        ),
        Option(
            "layer_groups",
            str,
            "",
            "easyspec: explicit layer groups such as '0,1-3,4-7,...,23' (overrides --layer-parallel-size)",
            minimum=None,
        ),
        Option("calibration", bool, True, "easyspec: recompute the draft's KV exactly after each verification"),
        Option("ngram_min", int, 2, "sd, tree, dsi with --draft ngram: shortest n-gram matched (prompt lookup)"),
        Option(
            "ngram_max", int, 4, "sd, tree, dsi with --draft ngram: longest n-gram matched (the longest match wins)"
        ),
        Option(
            "suffix_depth",
            int,
            16,
            "sd, tree, dsi with --draft suffix: longest substring the suffix tries keep "
            "(matched context up to half of it, then the proposal)",
            minimum=2,
        ),
        Option(
            "suffix_cache",
            int,
            128,
            "sd, tree, dsi with --draft suffix: earlier outputs kept in the shared suffix cache (0: this request only)",
            minimum=0,
        ),
        Option(
            "suffix_factor",
            float,
            0.0,
            "sd, tree, dsi with --draft suffix: a proposal is at most this many times "
            "as long as the matched context (SuffixDecoding's alpha, vLLM's 1.0; "
            "0: no cap, the default: the adaptive rule's acceptance by match length "
            "decides)",
            minimum=0,
        ),
        Option(
            "suffix_min_prob",
            float,
            0.1,
            "sd, tree, dsi with --draft suffix: stop a proposal where the empirical "
            "probability of its path (counts in the suffix tries) falls below this",
            minimum=0,
            maximum=1,
        ),
        Option(
            "draft_memory",
            bool,
            True,
            "sd, tree with --draft ngram/suffix: remember per matched pattern how far "
            "its last proposal was right; cut the next one there, or let it run past "
            "--suffix-factor when it was right throughout",
        ),
        Option(
            "adaptive",
            bool,
            False,
            "sd, tree: choose each round's draft length (tree: depth) maximising expected "
            "tokens per second from measured verification costs and acceptance; 0 drafts "
            "when speculation does not pay (lookahead / tree_depth is the most). None "
            "(auto, sd's default): the rule for greedy and unseeded requests, `lookahead` "
            "every round for a sampled request with a seed (its answer then repeats, "
            "alone or batched)",
            none="auto",
        ),
    )
}

DRAFTER_OPTIONS = ("ngram_min", "ngram_max", "suffix_depth", "suffix_cache", "suffix_factor", "suffix_min_prob")
# the round strategies tell their drafters what each round committed (Drafter.committed), which the memory reads
ROUND_DRAFTER_OPTIONS = DRAFTER_OPTIONS + ("draft_memory",)


STRATEGIES: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Add a Strategy class under its `name` (a class decorator). Its options must be in OPTIONS."""
    unknown = [o for o in cls.option_names if o not in OPTIONS]
    if unknown:
        raise ValueError(f"strategy {cls.name!r} takes unknown options {unknown}; add them to OPTIONS")
    STRATEGIES[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    STRATEGIES.pop(name, None)


def option_default(strategy: type[Strategy], name: str):
    """The value option `name` takes in `strategy` when it is not given: the strategy's own default, if it has one
    (sd's adaptive=None, auto), else the option's."""
    return strategy.option_defaults.get(name, OPTIONS[name].default)


def get_strategy(name: str) -> type[Strategy]:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}") from None
