"""Lossless acceptance of drafted tokens: pure functions of distributions and a random generator.

Notation follows Leviathan et al. 2023 (Algorithm 1) and Chen et al. 2023: q_i is the draft distribution the i-th
drafted token was sampled from, p_i the target distribution at the same position (both already processed by
temperature / top-k / top-p), p_{k+1} the target distribution after the last draft.
"""
from __future__ import annotations

import torch

from paraspec.sampling import sample


def greedy_accept(draft_tokens: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Longest prefix of `draft_tokens` equal to the target's argmax, and the target's next token.

    target_logits: [len(draft_tokens) + 1, vocab]. Returns (accepted, next_token): next_token is the target's
    correction at the first mismatch, or its bonus token after a full acceptance.
    """
    target_tokens = target_logits.argmax(-1).tolist()
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == target_tokens[accepted]:
        accepted += 1
    return accepted, target_tokens[accepted]


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): the distribution to resample from after rejecting a draft drawn from q."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    # total == 0 only when p == q, where a rejection has probability 0; fall back to p for numerical safety
    return r / total if total > 0 else p


def accept_one(token: int, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator) -> int | None:
    """One step of speculative sampling: keep `token` (drawn from q) with probability min(1, p/q).

    Returns None when kept, or the replacement drawn from the residual when rejected. The output is then
    distributed exactly as p (Leviathan et al., Theorem 3.5).
    """
    p_x, q_x = float(p[token]), float(q[token])
    if q_x <= 0:
        raise ValueError(f"draft token {token} has q = 0: it was not sampled from this q")
    if p_x >= q_x or torch.rand((), generator=generator).item() * q_x < p_x:
        return None
    return sample(residual(p, q), generator)


def speculative_accept(draft_tokens: list[int], q: torch.Tensor, p: torch.Tensor,
                       generator: torch.Generator) -> tuple[int, int]:
    """Speculative sampling over a chain of drafts.

    q: [k, vocab] distributions the drafts were sampled from; p: [k + 1, vocab] target distributions.
    Returns (accepted, next_token): the resampled token at the first rejection, or a bonus token from p_{k+1}.
    """
    for i, token in enumerate(draft_tokens):
        replacement = accept_one(token, p[i], q[i], generator)
        if replacement is not None:
            return i, replacement
    return len(draft_tokens), sample(p[len(draft_tokens)], generator)


def _same_vocab(q: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad the narrower distribution: models of one tokenizer may pad their output layers differently."""
    n = max(q.shape[-1], p.shape[-1])
    pad = lambda t: torch.nn.functional.pad(t, (0, n - t.shape[-1])) if t.shape[-1] < n else t
    return pad(q), pad(p)


def verify_chain(draft_tokens: list[int], draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                 params, generator: torch.Generator) -> tuple[int, int]:
    """Accept a chain of drafts against the target's logits [k + 1, vocab] under `params`.

    Greedy compares with the target's argmax; sampling runs speculative sampling with the processed target
    distribution and `draft_probs`, the exact q each draft was drawn from.
    """
    if params.greedy:
        return greedy_accept(draft_tokens, target_logits)
    from paraspec.sampling import logits_to_probs
    p = logits_to_probs(target_logits, params)
    if not draft_tokens:
        return 0, sample(p[0], generator)
    q, p = _same_vocab(draft_probs, p)
    return speculative_accept(draft_tokens, q, p, generator)


def verify_token(token: int, draft_probs: torch.Tensor | None, target_logits: torch.Tensor, params,
                 generator: torch.Generator) -> int | None:
    """Judge one drafted token against a target distribution computed earlier (one row of logits).

    Returns None when the token stands, else the target's replacement (greedy: its argmax; sampling: a draw
    from the residual). Used where a full acceptance left the next position's target distribution in hand.
    """
    if params.greedy:
        best = int(target_logits.argmax())
        return None if best == token else best
    from paraspec.sampling import logits_to_probs
    q, p = _same_vocab(draft_probs, logits_to_probs(target_logits, params))
    return accept_one(token, p, q, generator)
