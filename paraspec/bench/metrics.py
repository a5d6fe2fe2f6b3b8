"""The arithmetic of a benchmark report: per-variant medians, paired speedups, pooled acceptance, token checks.

Pure functions over `Record`s (one generation of one prompt by one variant), so every figure in the table can be
checked by hand on a few built records. Conventions (docs/BENCHMARKS.md, EasySpec Table 2):
- times are medians over prompts; tokens/s is 1000 / that ms/token (one figure, two units: a median of per-prompt
  tokens/s would contradict it); a speedup is the median over prompts of the per-prompt ratio of ms/token (both
  runs of a prompt are adjacent in time, so the ratio cancels most machine drift);
- acceptance rate and mean accepted length are pooled over prompts (sums of counts, not a mean of ratios);
- draft and verify time are seconds per 100 generated tokens, summed over prompts.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from paraspec.stats import GenerationStats
from paraspec.trace import Trace


@dataclass(frozen=True)
class Variant:
    """A strategy at a thread count, with its drafters: `ar@2t` runs `ar` with torch.set_num_threads(2) in this
    process; `sd[ngram,model]` runs `sd` with the drafters ngram and the bench's --draft model (runner.py)."""

    strategy: str
    threads: int | None = None  # None: the thread count the engine set up (from its devices)
    drafts: tuple[str, ...] | None = None  # None: the bench's --draft as it is
    options: tuple[tuple[str, object], ...] = ()  # its own strategy options over the bench's: sd{adaptive}

    @property
    def name(self) -> str:
        label = self.strategy if self.drafts is None else f"{self.strategy}[{','.join(self.drafts)}]"
        if self.options:
            label += (
                "{"
                + ",".join(k if v is True else f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.options)
                + "}"
            )
        return label if self.threads is None else f"{label}@{self.threads}t"


@dataclass
class Record:
    variant: Variant
    prompt_index: int
    prompt_id: str
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats
    trace: Trace = field(repr=False)
    margins: dict[int, float] | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        return {
            "variant": self.variant.name,
            "strategy": self.variant.strategy,
            "threads": self.variant.threads,
            "drafts": None if self.variant.drafts is None else list(self.variant.drafts),
            "options": dict(self.variant.options),
            "prompt_index": self.prompt_index,
            "prompt_id": self.prompt_id,
            "prompt_tokens": self.prompt_tokens,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
            "margins": None if self.margins is None else {str(k): v for k, v in sorted(self.margins.items())},
            "trace": self.trace.to_dict(),
        }


@dataclass(frozen=True)
class Divergence:
    """Where a variant's tokens first differ from its reference's, and the target's top-1 minus top-2 logit
    there as each of the two computed it: a small gap is a near-tie that rounding can flip."""

    prompt_id: str
    index: int
    reference_token: int | None  # None: the reference stopped before this index
    token: int | None
    reference_margin: float | None
    margin: float | None


def first_divergence(reference: list[int], tokens: list[int]) -> int | None:
    """The first output index where the two token lists differ (a shorter list differs where it ends)."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


def check_tokens(reference: Record, record: Record) -> Divergence | None:
    index = first_divergence(reference.token_ids, record.token_ids)
    if index is None:
        return None

    def at(tokens, margins):
        return (tokens[index] if index < len(tokens) else None, margins.get(index) if margins is not None else None)

    ref_token, ref_margin = at(reference.token_ids, reference.margins)
    token, margin = at(record.token_ids, record.margins)
    return Divergence(record.prompt_id, index, ref_token, token, ref_margin, margin)


def reference_variant(
    variant: Variant, variants: list[Variant], strategy: str, cores: dict[Variant, int] | None = None
) -> Variant | None:
    """The `strategy` variant to compare `variant` with: the one on the same hardware budget (`cores`, by
    default the thread count), else the first."""
    budget = (lambda v: cores.get(v, v.threads)) if cores else (lambda v: v.threads)
    same = [v for v in variants if v.strategy == strategy and budget(v) == budget(variant)]
    any_ = [v for v in variants if v.strategy == strategy]
    return (same or any_)[0] if same or any_ else None


def paired_speedup(reference: list[Record], records: list[Record]) -> float | None:
    """Median over shared prompts of reference ms/token / this ms/token (> 1: faster than the reference)."""
    ref = {r.prompt_index: r.stats.ms_per_token for r in reference}
    ratios = [
        ref[r.prompt_index] / r.stats.ms_per_token
        for r in records
        if r.prompt_index in ref and r.stats.ms_per_token > 0
    ]
    return statistics.median(ratios) if ratios else None


def pooled_acceptance(stats: list[GenerationStats]) -> tuple[float | None, float | None]:
    """(accepted / drafted, tokens per verification) summed over prompts; None for non-speculative runs, and an
    acceptance of None where a speculative variant drafted nothing (the adaptive rule decoding plainly: no draft
    was judged, which a rate of 0% would misreport as every draft rejected)."""
    speculative = [s for s in stats if s.acceptance_rate is not None]
    if not speculative:
        return None, None
    drafted = sum(s.drafted for s in speculative)
    rounds = sum(s.rounds for s in speculative)
    verified = sum((s.mean_accepted_length or 0.0) * s.rounds for s in speculative)  # set where speculative
    return (sum(s.accepted for s in speculative) / drafted if drafted else None, verified / rounds if rounds else 0.0)


def per_100_tokens(seconds: list[float], tokens: list[int]) -> float:
    total = sum(tokens)
    return 100 * sum(seconds) / total if total else 0.0


def busy_fraction(trace: Trace, total_s: float) -> dict[str, float]:
    """Per device: the share of the request's wall time it spent in recorded work (not idle, not waiting)."""
    busy: dict[str, float] = {}
    for e in trace.events:
        if e.kind not in ("idle", "wait"):
            busy[e.device] = busy.get(e.device, 0.0) + e.duration_s
    return {d: (s / total_s if total_s > 0 else 0.0) for d, s in sorted(busy.items())}


def summarize(
    records: list[Record], variants: list[Variant], greedy: bool, cores: dict[Variant, int] | None = None
) -> list[dict]:
    """One row per variant: the figures of the markdown table (see module docstring for conventions).
    `cores` is each variant's hardware budget (threads, or the cores of a worker strategy's devices); a
    speedup compares variants of equal budget."""
    by_variant = {v: sorted((r for r in records if r.variant == v), key=lambda r: r.prompt_index) for v in variants}
    budget = (lambda v: cores.get(v, v.threads)) if cores else (lambda v: v.threads)
    first_ar = next((v for v in variants if v.strategy == "ar"), None)
    ar_budgets = [budget(v) for v in variants if v.strategy == "ar" and budget(v) is not None]
    smallest_ar = (
        next((v for v in variants if v.strategy == "ar" and budget(v) == min(ar_budgets)), None) if ar_budgets else None
    )
    rows = []
    for v in variants:
        runs = by_variant[v]
        if not runs:
            continue
        stats = [r.stats for r in runs]
        acceptance, accepted_length = pooled_acceptance(stats)
        ar = reference_variant(v, variants, "ar", cores)
        hf_assisted = reference_variant(v, variants, "hf-assisted", cores)
        ms_per_token = statistics.median(s.ms_per_token for s in stats)
        row: dict[str, Any] = {
            "variant": v.name,
            "strategy": v.strategy,
            "threads": v.threads,
            "prompts": len(runs),
            "new_tokens": sum(s.new_tokens for s in stats),
            "ms_per_token": ms_per_token,
            "tokens_per_s": 1000.0 / ms_per_token if ms_per_token > 0 else 0.0,
            "speedup_vs_ar": paired_speedup(by_variant[ar], runs) if ar else None,
            "speedup_vs_hf_assisted": paired_speedup(by_variant[hf_assisted], runs) if hf_assisted else None,
            "speedup_references": {
                "ar": ar.name if ar else None,
                "hf-assisted": hf_assisted.name if hf_assisted else None,
            },
            "ttft_ms": statistics.median(s.ttft_s * 1000 for s in stats),
            "tpot_ms": statistics.median(s.tpot_ms for s in stats),
            "acceptance_rate": acceptance,
            "mean_accepted_length": accepted_length,
            "draft_s_per_100_tokens": per_100_tokens([s.draft_s for s in stats], [s.new_tokens for s in stats]),
            "verify_s_per_100_tokens": per_100_tokens([s.verify_s for s in stats], [s.new_tokens for s in stats]),
            "busy_fraction": _median_busy(runs),
        }
        if smallest_ar is not None and smallest_ar.threads is not None and len({budget(x) for x in variants}) > 1:
            # the one-device comparison next to the same-budget one (docs/BENCHMARKS.md: both matter)
            row[f"speedup_vs_{smallest_ar.name}"] = paired_speedup(by_variant[smallest_ar], runs)
        # identical-to-ar: ar variants are checked against the first ar (do thread counts change tokens?)
        reference = first_ar if v.strategy == "ar" else ar
        row["reference"] = reference.name if reference else None
        row["identical"], row["divergences"] = None, []
        if greedy and reference is not None and reference != v:
            ref_runs = {r.prompt_index: r for r in by_variant[reference]}
            checks = [(r, check_tokens(ref_runs[r.prompt_index], r)) for r in runs if r.prompt_index in ref_runs]
            row["identical"] = sum(d is None for _, d in checks)
            row["compared"] = len(checks)
            row["divergences"] = [d.__dict__ for _, d in checks if d is not None]
        rows.append(row)
    return rows


def _median_busy(runs: list[Record]) -> dict[str, float]:
    per_run = [busy_fraction(r.trace, r.stats.total_s) for r in runs]
    devices = sorted({d for b in per_run for d in b})
    return {d: statistics.median(b.get(d, 0.0) for b in per_run) for d in devices}
