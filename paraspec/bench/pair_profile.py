"""`paraspec profile`: the DSI paper's measurements of a target/draft pair, as the planner's JSON.

- TTFT and TPOT of each model over N prompts x 20 tokens (greedy, one model at a time, on its own device);
- `forward_ms`: one forward of n tokens on a warm cache, n in {1, 2, 4, 8, 16} (verifying k drafts is such a
  forward, so the planner needs its width cost);
- the acceptance rate as 1 - 1/(1 + n̄): the target generates 256 tokens greedily, the draft predicts each of
  them from the target's prefix, and n̄ is the mean number of consecutive draft hits before a miss (the
  DSI code's windows, dsi/offline/acceptance/experiment.py).

The schema (all times in ms) is read by `paraspec.sim.costs.Profile`:
    {"target": {"model", "device", "ttft_ms", "tpot_ms", "forward_ms": {"1": ..., "8": ...}},
     "draft": {...same...}, "acceptance_rate", "mean_match_length", "devices"}
"""

from __future__ import annotations

import statistics
import time

import torch

from paraspec.runtime.devices import Device, pinned, sync

WIDTHS = (1, 2, 4, 8, 16)


def _argmax(logits) -> int:
    return int(logits.reshape(-1, logits.shape[-1])[-1].argmax())


@torch.inference_mode()
def time_generation(model, prompt_ids: list[int], tokens: int) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds for `tokens` greedy tokens: prefill + argmax, then one-token forwards (each
    argmax is read back, so every clock read after one finds the GPU done)."""
    sync(getattr(model, "device", None))
    start = time.perf_counter()
    token = _argmax(model.prefill(prompt_ids))
    ttft = time.perf_counter() - start
    for _ in range(tokens - 1):
        token = _argmax(model.forward([token]))
    total = time.perf_counter() - start
    return ttft, (total - ttft) / (tokens - 1) if tokens > 1 else 0.0


@torch.inference_mode()
def time_forwards(model, prompt_ids: list[int], widths=WIDTHS, repeats: int = 3) -> dict[str, float]:
    """Median seconds of one forward of n tokens after the prompt (rolled back after each); a GPU is waited for
    before each clock read (a forward returns once queued)."""
    device = getattr(model, "device", None)  # llama.cpp and simulated models return when done
    model.prefill(prompt_ids)
    base = model.length
    out = {}
    for n in widths:
        if base + n > model.max_context:
            raise ValueError(
                f"a {n}-token forward after a {base}-token prompt exceeds the context "
                f"({model.max_context}); pass a larger --max-context or drop that width"
            )
        chunk = (prompt_ids * n)[:n]
        times = []
        for _ in range(repeats):
            sync(device)
            start = time.perf_counter()
            model.forward(chunk)
            sync(device)
            times.append(time.perf_counter() - start)
            model.rollback(base)
        out[str(n)] = statistics.median(times)
    return out


@torch.inference_mode()
def greedy_tokens(model, prompt_ids: list[int], tokens: int) -> list[int]:
    """The target's greedy continuation, up to `tokens` long (shorter where it emits an EOS id)."""
    out = [_argmax(model.prefill(prompt_ids))]
    while len(out) < tokens and out[-1] not in model.eos_token_ids and model.length + 1 < model.max_context:
        out.append(_argmax(model.forward([out[-1]])))
    return out


@torch.inference_mode()
def draft_hits(draft, prompt_ids: list[int], target_tokens: list[int]) -> list[bool]:
    """For each target token: does the draft's greedy prediction from the target's prefix equal it?"""
    first = _argmax(draft.prefill(prompt_ids))
    rest = []
    if len(target_tokens) > 1:
        logits = draft.forward(target_tokens[:-1])
        rest = logits.argmax(-1).tolist()
    return [p == t for p, t in zip([first] + rest, target_tokens)]


def match_windows(hits: list[bool]) -> tuple[int, int]:
    """(draft hits, windows closed by a miss). n̄ = hits / closed windows is the mean run of hits before a miss;
    a run still open at the end adds its hits but closes no window (it would have gone on)."""
    return sum(hits), sum(not h for h in hits)


def acceptance_from_windows(hits: int, misses: int) -> tuple[float, float]:
    """(acceptance rate 1 - 1/(1 + n̄), n̄). With no miss at all n̄ is taken as the whole run (one window)."""
    mean_match = hits / misses if misses else float(hits)
    return 1 - 1 / (1 + mean_match), mean_match


def profile_pair(
    target,
    draft,
    target_device: Device,
    draft_device: Device,
    prompts: list[list[int]],
    target_name: str,
    draft_name: str,
    tokens: int = 20,
    match_tokens: int = 256,
    widths=WIDTHS,
    progress=None,
) -> dict:
    """The profile JSON (see module docstring) of two loaded Models on their devices, over token-id prompts."""
    if tokens < 2:
        raise ValueError(f"--tokens must be >= 2 (TPOT is the time per token after the first), got {tokens}")
    if match_tokens < 1:
        raise ValueError(f"--match-tokens must be >= 1, got {match_tokens}")
    if not prompts:
        raise ValueError("profile needs at least one prompt")
    step = progress or (lambda what: None)
    entries = {}
    for role, model, device, name in (
        ("target", target, target_device, target_name),
        ("draft", draft, draft_device, draft_name),
    ):
        with pinned(device):
            time_generation(model, prompts[0], min(tokens, 4))  # warm-up
            ttfts, tpots = [], []
            for ids in prompts:
                step(f"{role} TTFT/TPOT")
                ttft, tpot = time_generation(model, ids, tokens)
                ttfts.append(ttft)
                tpots.append(tpot)
            step(f"{role} forward widths")
            forward = time_forwards(model, prompts[0], widths)
        entries[role] = {
            "model": name,
            "device": str(device),
            "ttft_ms": statistics.median(ttfts) * 1000,
            "tpot_ms": statistics.median(tpots) * 1000,
            "forward_ms": {n: s * 1000 for n, s in forward.items()},
        }
    hits = misses = 0
    for ids in prompts:
        step("acceptance")
        with pinned(target_device):
            reference = greedy_tokens(target, ids, match_tokens)
        with pinned(draft_device):
            h, m = match_windows(draft_hits(draft, ids, reference))
        hits, misses = hits + h, misses + m
    acceptance, mean_match = acceptance_from_windows(hits, misses)
    devices = list(dict.fromkeys(str(d) for d in (draft_device, target_device)))
    return {
        "target": entries["target"],
        "draft": entries["draft"],
        "acceptance_rate": acceptance,
        "mean_match_length": mean_match,
        "devices": devices,
    }
