"""Drafters: the only home of drafting -- where every strategy (sd, tree, amusd, dsi, easyspec) gets its drafts.

    base.py      the Drafter interface, Proposal, and the q contract (stated once, there)
    token_tree.py  TokenTree and draft_tree: growing a token tree from a drafter's logits
    model.py     ModelDrafter: a draft model (chains and trees); `draw`, the one place a draft token and its q
                 are drawn from the draft's logits
    layer_parallel.py  easyspec's drafters: LayerParallelDrafter (layer-parallel forwards, bonus calibration),
                 DraftRank and DeviceGroupDrafter (the draft's layers spread over ranks on several devices)
    draft_worker.py  draft_loop: a ModelDrafter drafting without pause in its own worker into a versioned token
                 channel, rolling back when the verifier rejects (amusd's and dsi's drafters); CHANNEL
    ngram.py     NGramDrafter: prompt lookup, the longest matching n-gram's continuation (model-free)
    suffix.py    SuffixDrafter: the most frequent continuation in suffix tries of the request and of earlier
                 outputs; trees of branches by frequency (model-free)
    memory.py    PatternMemory: how far a model-free drafter's last proposal from each pattern was right
    policy.py    DraftPolicy: the drafters in order (model-free first, the model where it has nothing)
    adaptive.py  the adaptive draft length rule: k* maximising expected tokens per second

A draft is named like a checkpoint: a model's folder / .gguf / hub id, or "ngram" / "suffix" (MODEL_FREE).
A new drafter subclasses Drafter and implements propose(); a model-free one is also named in MODEL_FREE (its
spec), built by `model_free` (its options) and listed in DRAFTER_OPTIONS (strategies/registry.py) if it takes
options of its own. Strategies need no edit.
"""

from dataclasses import dataclass
from typing import Any

from paraspec.drafters.base import Drafter, Proposal
from paraspec.drafters.model import ModelDrafter
from paraspec.drafters.ngram import NGramDrafter
from paraspec.drafters.policy import DraftPolicy
from paraspec.drafters.suffix import SuffixDrafter
from paraspec.drafters.token_tree import TokenTree

MODEL_FREE = {"ngram": NGramDrafter, "suffix": SuffixDrafter}


@dataclass(frozen=True)
class DraftSpec:
    """One draft as given, in order: a model-free drafter's name ("ngram", "suffix") or a model's checkpoint. Marked
    once (EngineConfig), then carried as it is: the Engine resolves the checkpoints, strategies read the mark."""

    spec: Any  # the name, or a checkpoint folder / .gguf / hub id / SimulatedSpec
    model_free: bool

    @classmethod
    def of(cls, spec) -> "DraftSpec":
        return cls(spec, is_model_free(spec))


def is_model_free(spec) -> bool:
    """A draft spec naming a model-free drafter ("ngram", "suffix") rather than a checkpoint."""
    return isinstance(spec, str) and spec in MODEL_FREE


def model_free(spec: str, vocab_size: int, options: dict) -> Drafter:
    """Build a model-free drafter from its name and the strategy's options (every strategy that takes model-free
    drafters takes DRAFTER_OPTIONS, so they are all there, defaults included; `draft_memory` only the round
    strategies, whose rounds tell the drafter what was committed)."""
    memory = options.get("draft_memory", False)
    if spec == "ngram":
        return NGramDrafter(vocab_size, options["ngram_min"], options["ngram_max"], memory)
    return SuffixDrafter(
        vocab_size,
        options["suffix_depth"],
        options["suffix_cache"],
        options["suffix_factor"],
        options["suffix_min_prob"],
        memory,
    )


__all__ = [
    "DraftSpec",
    "Drafter",
    "DraftPolicy",
    "MODEL_FREE",
    "ModelDrafter",
    "NGramDrafter",
    "Proposal",
    "SuffixDrafter",
    "TokenTree",
    "is_model_free",
    "model_free",
]
