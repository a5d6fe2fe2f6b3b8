"""The Model protocol every strategy talks to, and the EOS ids every loader uses (normalised; a checkpoint's
generation_config.json).

Implemented by the native decoder (`models/native/decoder.py`), the Hugging Face fallback (`models/hf.py`), a remote
worker proxy (`runtime/remote.py`) and the simulated model (`models/simulated.py`); a new backend implements
every method below. Logits come back as float32 tensors of shape [n_tokens, vocab_size] on the CPU-side of the
caller's device.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class Model(Protocol):
    vocab_size: int  # rows of the output layer (may exceed the tokenizer's vocabulary: padding)
    eos_token_ids: tuple[int, ...]
    max_context: int  # positions the KV cache can hold
    # a forward into an empty cache runs its prompt (the tokens before the first wanted row) in forwards of its own
    # and the tokens after it in others (llama.cpp), rather than all in one forward (native, HF): the prompt round's
    # drafts then cost a verification forward of their own (strategies/sd.py drafts none there)
    splits_prompts: bool

    @property
    def length(self) -> int:
        """Tokens currently in the KV cache."""

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        """Reset the cache, run the prompt, return logits [vocab] for its last position."""

    def forward(
        self,
        token_ids: list[int],
        positions: list[int] | None = None,
        tree_mask: torch.Tensor | None = None,
        last_n: int | None = None,
    ) -> torch.Tensor:
        """Append tokens to the cache and return logits [len(token_ids), vocab] for each of them
        (only for the last `last_n` when given: a long prompt's LM head is the costliest part of a prefill).

        positions default to length, length+1, ...; tree_mask [n, n] (bool, True = may attend) restricts
        attention among the new tokens (they always see the whole cache before them).
        """

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens (0 <= length <= self.length, else ValueError)."""

    def keep_path(self, prefix_len: int, slots: list[int]) -> None:
        """Keep the first `prefix_len` cached tokens, then the entries at `slots` (ascending, all >= prefix_len)
        moved to positions prefix_len, prefix_len + 1, ...; drop the rest. This is how a token tree's accepted
        path is compacted after verification. A backend that cannot move entries must still accept a chain
        (slots == prefix_len, prefix_len + 1, ...: a rollback) and raise ValueError naming the fix otherwise."""


def eos_ids(value) -> tuple[int, ...]:
    """An `eos_token_id` as configs spell it (an int, a list of ints, or None) as a tuple of ids."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def keep_chain(model, prefix_len: int, slots: list[int]) -> None:
    """keep_path for backends whose cache can only be cut: a chain of slots right after the prefix is a
    rollback; anything else needs entries moved, which they cannot do."""
    if list(slots) != list(range(prefix_len, prefix_len + len(slots))):
        raise ValueError(
            f"{type(model).__name__} cannot move KV entries (token trees need the native backend); "
            f"pass backend='native' (--backend native)"
        )
    model.rollback(prefix_len + len(slots))


class _Sequences(Protocol):
    @property
    def _lengths(self) -> list[int]: ...  # cached tokens per sequence
    @property
    def max_context(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


@runtime_checkable
class Sequences(Protocol):
    """What a model of several sequences offers the Scheduler (scheduler.py): llama.cpp's (LlamaCppModel with
    n_seqs > 1) and the native decoder's dynamic forward (NativeSequences). The Model protocol's methods take a
    `sequence_id`; beside them:

        n_seqs, n_batch       sequences held; tokens one forward may carry
        exact                 its rows are the target's exact configuration (a draft's may not be: llama.cpp's
                              fastest kernels)
        batch_exact           the load-time probe's verdict: a row's logits are the same alone and beside other
                              sequences' rows, for forwards of min_shared_width..exact_width tokens each
        length_of(s)          tokens cached for sequence s
        check_forward(t, s)   raise the ValueError a forward of tokens t on sequence s would (room, vocabulary)
        forward_batch(items)  one forward of several sequences' tokens: [(sequence_id, tokens, outputs)] -> rows
        step_forwards(w)      the rows of each forward it runs one forward_batch of these per-sequence widths as
                              (what the adaptive rule prices a shared step by)
        prompt_steps(t, s)    a prompt's forwards into sequence s, one per next() (a generator returning the logits
                              [1, vocab] of its last token): the same forwards alone and batched
        splits_prompts        its forward into an empty cache runs the tokens before the first wanted row as a
                              prompt (prompt_steps), then the rest (llama.cpp); else as one forward (native)
        move_sequence(a, b)   sequence a's cache becomes b's, bitwise; a is left empty
    """

    n_seqs: int
    n_batch: int
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    exact: bool
    batch_exact: bool
    exact_width: int
    min_shared_width: int
    splits_prompts: bool

    def length_of(self, sequence_id: int) -> int: ...
    def check_forward(self, token_ids: list[int], sequence_id: int) -> None: ...
    def forward_batch(self, items: list[tuple[int, list[int], int]]) -> list: ...
    def step_forwards(self, widths: list[int]) -> list[int]: ...
    def move_sequence(self, src: int, dst: int) -> None: ...
    def rollback(self, length: int, sequence_id: int = 0) -> None: ...
    def keep_path(self, prefix_len: int, slots: list[int], sequence_id: int = 0) -> None: ...
    def prefill(self, token_ids: list[int], sequence_id: int = 0) -> Any: ...
    def prompt_steps(self, token_ids: list[int], sequence_id: int = 0) -> Generator[None, None, Any]: ...
    def forward(
        self, token_ids: list[int], positions=None, tree_mask=None, last_n=None, sequence_id: int = 0
    ) -> Any: ...


class SequenceChecks:
    """The checks a model of several sequences (llama.cpp's, models/native/sequences.py) runs before a forward of one
    of them, and its length per sequence; it has `_lengths` (cached tokens per sequence), `max_context` and
    `vocab_size`."""

    def length_of(self: _Sequences, sequence_id: int) -> int:
        return self._lengths[sequence_id]

    def check_forward(self: Any, token_ids: list[int], sequence_id: int) -> None:
        """The ValueError a forward of `token_ids` on `sequence_id` would raise: no room left, ids outside the
        vocabulary (the Scheduler raises it in the asking request, not in the step)."""
        self._check_room(len(token_ids), sequence_id)
        self._check_vocabulary(token_ids)

    def _check_room(self: _Sequences, n: int, sequence_id: int = 0) -> None:
        if self._lengths[sequence_id] + n > self.max_context:
            raise ValueError(
                f"context full: {self._lengths[sequence_id]} cached + {n} new tokens exceed max_context "
                f"{self.max_context}; create the engine with a larger max_context"
            )

    def _check_vocabulary(self: _Sequences, token_ids: list[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside this model's vocabulary [0, {self.vocab_size})")


def check_batch(model, items: list[tuple[int, list[int], int]]) -> None:
    """forward_batch's items (sequence_id, token_ids, outputs) on a model of several sequences: each sequence at most
    once, 1..exact_width tokens each, n_batch in all, 1..len(tokens) outputs, room in its cache, ids in the
    vocabulary."""
    sequence_ids = [sequence_id for sequence_id, _, _ in items]
    if not items or len(set(sequence_ids)) != len(sequence_ids) or any(not 0 <= s < model.n_seqs for s in sequence_ids):
        raise ValueError(f"forward_batch takes each of the {model.n_seqs} sequences at most once, got {sequence_ids}")
    total = sum(len(tokens) for _, tokens, _ in items)
    if total > model.n_batch or any(not 0 < len(t) <= model.exact_width for _, t, _ in items):
        raise ValueError(
            f"forward_batch: {total} tokens (at most n_batch={model.n_batch}), each sequence's "
            f"1..{model.exact_width} (exact_width)"
        )
    for sequence_id, tokens, outputs in items:
        if not 0 < outputs <= len(tokens):
            raise ValueError(f"forward_batch: {outputs} outputs of {len(tokens)} tokens")
        model._check_room(len(tokens), sequence_id)
        model._check_vocabulary(tokens)


def measure_batch_exact(model, width: int, prompts: tuple[int, ...], shortest: int = 2) -> list[dict]:
    """The load-time probe of a model of several sequences (llama.cpp's, models/native/sequences.py): rows of several
    sequences in one forward_batch against the rows each sequence gets alone (max |diff|, 0.0 where bitwise equal).
    Every sequence at its own context length (`prompts`, cycled), 2..n_seqs of them, decode steps (one token each)
    and verify-like steps (`shortest`..`width` tokens each). The sequences are left empty."""
    rng = np.random.default_rng(1)
    n = model.n_seqs
    lengths = [max(1, min(p, model.max_context - width)) for p in prompts]
    lengths = (lengths * (n // len(lengths) + 1))[:n]
    steps = [rng.integers(0, model.vocab_size, size=width).tolist() for _ in range(n)]
    for sequence_id, p in enumerate(lengths):
        model.prefill(rng.integers(0, model.vocab_size, size=p).tolist(), sequence_id)
    span = max(1, width - shortest + 1)
    rows = []
    for group in range(2, n + 1):
        for kind in ("decode", "verify"):
            widths = [1 if kind == "decode" else min(width, shortest + (i + group) % span) for i in range(group)]
            alone = []
            for sequence_id in range(group):
                alone.append(model.forward(steps[sequence_id][: widths[sequence_id]], sequence_id=sequence_id))
                model.rollback(lengths[sequence_id], sequence_id)
            got = model.forward_batch(
                [
                    (sequence_id, steps[sequence_id][: widths[sequence_id]], widths[sequence_id])
                    for sequence_id in range(group)
                ]
            )
            for sequence_id in range(group):
                model.rollback(lengths[sequence_id], sequence_id)
            diff = max(float((g - a).abs().max()) for g, a in zip(got, alone))
            rows.append({"sequences": group, "kind": kind, "widths": widths, "max_abs_diff": diff})
    for sequence_id in range(n):
        model.rollback(0, sequence_id)
    return rows


def check_rollback(length: int, cached: int) -> None:
    """The one rule of `rollback`: a cache can only be cut back to a length it holds."""
    if not 0 <= length <= cached:
        raise ValueError(f"cannot roll back to {length}: the cache holds {cached} tokens")


# -- a draft whose vocabulary is narrower than the target's (same tokenizer, fewer embedding rows) ---------------


def embeddable(token_ids: list[int], rows: int) -> list[int]:
    """`token_ids` as a model with `rows` embedding rows can take them: an id past its rows (a target's padding
    row, which a smaller draft lacks) is fed as id 0. Only draft inputs go through here: the draft's guesses
    after such an id are worse, but the target judges every draft, so the output stays exact."""
    return [t if t < rows else 0 for t in token_ids]


def widen(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits over the target's `vocab_size` ids: columns the draft lacks are -inf (probability 0), so
    q and the target's p have one shape and the draft never proposes an id it has no row for."""
    missing = vocab_size - logits.shape[-1]
    return torch.nn.functional.pad(logits, (0, missing), value=float("-inf")) if missing > 0 else logits


def generation_eos_ids(folder: Path, default: tuple[int, ...]) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present (chat models stop on several ids), else the config's."""
    gen = folder / "generation_config.json"
    ids = set(default)
    if gen.exists():
        ids |= set(eos_ids(json.loads(gen.read_text()).get("eos_token_id")))
    return tuple(sorted(ids))
