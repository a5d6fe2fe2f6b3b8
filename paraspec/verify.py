"""Lossless acceptance of drafted tokens: pure functions of distributions and a random generator.

Notation follows Leviathan et al. 2023 (Algorithm 1) and Chen et al. 2023: q_i is the draft distribution the i-th
drafted token was sampled from, p_i the target distribution at the same position (both already processed by
temperature / top-k / top-p), p_{k+1} the target distribution after the last draft.

Devices: p is on the target's device; q may arrive elsewhere (a channel's q, read from shared memory, is on the
CPU), so each entry point brings q to p's device once. The generator is a CPU generator (sampling.make_generator):
its uniforms are drawn on the CPU and compared as numbers, so a seed gives the same tokens on every device.
"""

from __future__ import annotations

import torch

from paraspec.sampling import logits_to_probs, next_token, sample


def greedy_accept(draft_tokens: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Longest prefix of `draft_tokens` equal to the target's argmax, and the target's next token.

    target_logits: [len(draft_tokens) + 1, vocab]. Returns (accepted, next_token): next_token is the target's
    correction at the first mismatch, or its bonus token after a full acceptance.
    """
    return greedy_match(draft_tokens, target_logits.argmax(-1).tolist())


def greedy_match(draft_tokens: list[int], target_tokens: list[int]) -> tuple[int, int]:
    """greedy_accept when only the target's argmax tokens are at hand ([len(draft_tokens) + 1] of them)."""
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
    q = q.to(p.device)
    p_x, q_x = float(p[token]), float(q[token])
    if q_x <= 0:
        raise ValueError(f"draft token {token} has q = 0: it was not sampled from this q")
    if p_x >= q_x or torch.rand((), generator=generator, device="cpu").item() * q_x < p_x:
        return None
    return sample(residual(p, q), generator)


def speculative_accept(
    draft_tokens: list[int], q: torch.Tensor, p: torch.Tensor, generator: torch.Generator
) -> tuple[int, int]:
    """Speculative sampling over a chain of drafts.

    q: [k, vocab] distributions the drafts were sampled from; p: [k + 1, vocab] target distributions.
    Returns (accepted, next_token): the resampled token at the first rejection, or a bonus token from p_{k+1}.
    """
    q = q.to(p.device)  # all k rows at once, not one per accept_one
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


def verify_chain(
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params,
    generator: torch.Generator,
) -> tuple[int, int]:
    """Accept a chain of drafts against the target's logits [k + 1, vocab] under `params`.

    Greedy compares with the target's argmax; sampling runs speculative sampling with the processed target
    distribution and `draft_probs`, the exact q each draft was drawn from (None: each draft's point mass, a
    deterministic drafter's; see point_mass_accept).
    """
    if params.greedy:
        return greedy_accept(draft_tokens, target_logits)
    p = logits_to_probs(target_logits, params)
    if not draft_tokens:
        return 0, sample(p[0], generator)
    if draft_probs is None:
        for i, token in enumerate(draft_tokens):
            kept, replacement = point_mass_accept([token], p[i], generator)
            if kept is None:
                return i, replacement
        return len(draft_tokens), sample(p[len(draft_tokens)], generator)
    q, p = _same_vocab(draft_probs, p)
    return speculative_accept(draft_tokens, q, p, generator)


def verify_token(
    token: int, draft_probs: torch.Tensor | None, target_logits: torch.Tensor, params, generator: torch.Generator
) -> int | None:
    """Judge one drafted token against a target distribution computed earlier (one row of logits).

    Returns None when the token stands, else the target's replacement (greedy: its argmax; sampling: a draw
    from the residual; draft_probs None: the token's point mass). Used where a full acceptance left the next
    position's target distribution in hand.
    """
    if params.greedy:
        best = int(target_logits.argmax())
        return None if best == token else best
    if draft_probs is None:  # a deterministic drafter's token: its point mass
        kept, replacement = point_mass_accept([token], logits_to_probs(target_logits, params), generator)
        return None if kept is not None else replacement
    q, p = _same_vocab(draft_probs, logits_to_probs(target_logits, params))
    return accept_one(token, p, q, generator)


def judge_in_hand(
    draft_token: int | None, draft_probs: torch.Tensor | None, target, params, generator: torch.Generator
) -> tuple[int, bool | None]:
    """The step after a full acceptance (AMUSD Alg. 1's bonus; DSI's next position): the verifying forward
    also computed the target's distribution for the next position, so a draft there is judged at once, and
    without a draft the target supplies its own token instead of waiting.

    target: that position's logits row; under greedy it may be the target's argmax token (an int) instead.
    Returns (the token to commit, verdict): True = the draft stood, False = it was replaced, None = there was no
    draft (the token is the target's own, the bonus).
    """
    if params.greedy and isinstance(target, int):
        return target, (None if draft_token is None else draft_token == target)
    if draft_token is None:
        return next_token(target, params, generator), None
    replacement = verify_token(draft_token, draft_probs, target, params, generator)
    return (draft_token, True) if replacement is None else (replacement, False)


# -- token trees (SpecInfer, Miao et al. 2024) ------------------------------------------------------------------


def multi_step_accept(
    candidates: list[int], p: torch.Tensor, q: torch.Tensor, generator: torch.Generator
) -> tuple[int | None, int]:
    """SpecInfer's multi-step speculative sampling over siblings drawn i.i.d. (with replacement) from q.

    Child i is kept with probability min(1, p_i(x_i) / q(x_i)), where p_1 = p and, after each rejection,
    p_{i+1} = norm(max(0, p_i - q)). Every step divides by the same q, because every sibling was drawn from that
    same q independently of the others; only the target side becomes the residual. When all are rejected the
    token is drawn from the last residual. Returns (index of the kept child or None, the token).

    Why it is exact: by induction from the last step, if steps i+1.. output p_{i+1}, step i outputs
    min(q, p_i)(x) + (sum_y max(0, p_i - q)(y)) * p_{i+1}(x) = min(q, p_i)(x) + max(0, p_i - q)(x) = p_i(x).
    """
    q = q.to(p.device)
    for i, token in enumerate(candidates):
        p_x, q_x = float(p[token]), float(q[token])
        if q_x <= 0:
            raise ValueError(f"draft token {token} has q = 0: it was not sampled from this q")
        if p_x >= q_x or torch.rand((), generator=generator, device="cpu").item() * q_x < p_x:
            return i, token
        p = residual(p, q)
    return None, sample(p, generator)


def point_mass_accept(candidates: list[int], p: torch.Tensor, generator: torch.Generator) -> tuple[int | None, int]:
    """Siblings chosen deterministically (distinct tokens, q_i = the point mass on candidate i): candidate i is
    kept with probability p_i(x_i), where p_1 = p and after each rejection p_{i+1} = p_i with x_i removed and
    renormalised (norm(max(0, p_i - q_i))); when all are rejected the token is drawn from the last residual.

    Exact by the same induction as multi_step_accept, with q_i fixed before the round (a function of the
    sequence, never of the target's draws): step i outputs min(q_i, p_i)(x) + max(0, p_i - q_i)(x) = p_i(x).
    """
    for i, token in enumerate(candidates):
        p_x = float(p[token]) if token < p.shape[-1] else 0.0
        if p_x >= 1.0 or torch.rand((), generator=generator, device="cpu").item() < p_x:
            return i, token
        if p_x > 0:
            p = p.clone()
            p[token] = 0
            p = p / p.sum()
    return None, sample(p, generator)


def verify_tree(
    tokens: list[int],
    parents: list[int],
    draft_probs: dict[int, torch.Tensor] | None,
    target_logits: torch.Tensor,
    params,
    generator: torch.Generator,
) -> tuple[list[int], int]:
    """Accept a path of a token tree against the target's logits for the root and every node.

    tokens[i], parents[i]: node i's token and its parent's index (-1: a child of the root); parents come before
    children. target_logits: [len(tokens) + 1, vocab], row 0 at the root, row i + 1 at node i.
    draft_probs[v]: the q the children of v (v = -1: the root) were drawn from (sampling only); a node absent
    from it has children chosen deterministically (a model-free drafter): each child's q is the point mass on
    itself, and they are judged one after another (point_mass_accept).
    Greedy: follow the child equal to the target's argmax while there is one. Sampling: multi-step
    speculative sampling over each node's children. Returns (accepted node indices root-down, next token):
    the next token is the target's correction, or its bonus token after a leaf.
    """
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    path: list[int] = []
    node = -1
    if params.greedy:
        best = target_logits.argmax(-1).tolist()
        while True:
            match = next((c for c in children.get(node, ()) if tokens[c] == best[node + 1]), None)
            if match is None:
                return path, best[node + 1]
            path.append(match)
            node = match
    while True:
        p = logits_to_probs(target_logits[node + 1], params)
        kids = children.get(node)
        if not kids:
            return path, sample(p, generator)
        candidates = [tokens[c] for c in kids]
        if draft_probs is None or node not in draft_probs:
            kept, token = point_mass_accept(candidates, p, generator)
        else:
            q, p = _same_vocab(draft_probs[node], p)
            kept, token = multi_step_accept(candidates, p, q, generator)
        if kept is None:
            return path, token
        node = kids[kept]
        path.append(node)
