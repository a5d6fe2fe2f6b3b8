"""Per-request statistics, named as the field names them (vLLM, the AMUSD/DSI/EasySpec papers)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    strategy: str
    prompt_tokens: int
    new_tokens: int
    total_s: float
    ttft_s: float  # time to the first generated token (prefill included)
    tpot_ms: float  # time per output token after the first
    ms_per_token: float  # total time / generated tokens
    tokens_per_s: float
    acceptance_rate: float | None  # accepted drafts / drafted tokens (None without a draft)
    mean_accepted_length: float | None  # tokens gained per verification, bonus included
    draft_s: float
    verify_s: float
    drafted: int
    accepted: int
    rounds: int
    rollbacks: int
    # [i]: judgements (rounds, drafts judged in hand) that accepted their draft at position i (vLLM's
    # num_accepted_tokens_per_pos); sums to `accepted`
    accepted_per_position: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        parts = [
            f"{self.new_tokens} tokens",
            f"{self.ms_per_token:.1f} ms/token",
            f"{self.tokens_per_s:.2f} tok/s",
            f"TTFT {self.ttft_s * 1000:.0f} ms",
            f"TPOT {self.tpot_ms:.1f} ms",
        ]
        if self.acceptance_rate is not None:
            parts += [f"acceptance {self.acceptance_rate:.1%}", f"mean accepted length {self.mean_accepted_length:.2f}"]
        return f"[{self.strategy}] " + ", ".join(parts)


def compute_stats(run, strategy: str, total_s: float) -> GenerationStats:
    n = len(run.tokens)
    ttft = run.first_token_s if run.first_token_s is not None else total_s
    speculative = run.drafted > 0 or run.rounds > 0
    return GenerationStats(
        strategy=strategy,
        prompt_tokens=len(run.prompt_ids),
        new_tokens=n,
        total_s=total_s,
        ttft_s=ttft,
        tpot_ms=(total_s - ttft) * 1000 / (n - 1) if n > 1 else 0.0,
        ms_per_token=total_s * 1000 / n if n else 0.0,
        tokens_per_s=n / total_s if total_s > 0 else 0.0,
        acceptance_rate=(run.accepted / run.drafted if run.drafted else 0.0) if speculative else None,
        mean_accepted_length=(run.verified_tokens / run.rounds if run.rounds else 0.0) if speculative else None,
        draft_s=run.draft_s,
        verify_s=run.verify_s,
        drafted=run.drafted,
        accepted=run.accepted,
        rounds=run.rounds,
        rollbacks=run.rollbacks,
        accepted_per_position=list(run.accepted_per_position),
    )
