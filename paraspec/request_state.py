"""The request in flight (`RequestState`): its prompt, sampling parameters, committed tokens, counters and trace.

The Engine makes one per request; a strategy's decode() commits tokens through `RequestState.commit` (the one place
that enforces stop tokens, stop strings, `max_new_tokens` and the context) and counts each verification round through
`RequestState.count_round` (every strategy, workers included); stats (stats.py) and the benchmarks read the finished
RequestState. Worker loops (amusd's verifier and drafter, dsi's drafters and servers) keep no RequestState: the
caller's counts what they report and folds their traces and reports in (`RequestState.merge_worker_reports`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from paraspec.runtime.devices import sync
from paraspec.sampling import SamplingParams, adjust_logits
from paraspec.structured import GrammarMatcher
from paraspec.trace import Trace, TraceEvent
from paraspec.verify import judge_in_hand


def top2_margins(logits: torch.Tensor) -> list[float]:
    """Each row's top-1 minus top-2 logit: how near a tie the target's greedy choice was (a bf16 difference
    between strategies is only allowed where this is small)."""
    top2 = logits.float().topk(2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]).reshape(-1).tolist()


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of an output token (log-softmax of its logits, before any sampling
    processor: vLLM's raw logprobs) and the `SamplingParams.logprobs` likeliest tokens at that position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprob(row: torch.Tensor, token: int, n: int) -> TokenLogprob:
    """`token`'s TokenLogprob from one row of log-softmax, with the n likeliest tokens of that row."""
    top = row.topk(n) if n else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
    return TokenLogprob(token, float(row[token]), pairs)


@dataclass
class RequestState:
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    max_context: int  # the smallest cache among the models in use
    trace: Trace = field(default_factory=Trace)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "context"
    first_token_s: float | None = None
    # stop strings (the caller's tokenizer): tokens -> the stop string their text now contains, or None
    stop_check: Callable[[list[int]], str | None] | None = field(default=None, repr=False)
    stop_string: str | None = None  # the stop string that ended the run (finish_reason "stop")
    # counters for the stats (names as in docs/ARCHITECTURE.md)
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0  # verification forwards
    verified_tokens: int = 0  # tokens committed by verification rounds (bonus included)
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: judgements that kept their draft i
    rollbacks: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    # optional: the target's top-1 minus top-2 logit for each output index it scored (to tell near-ties
    # from real divergences when comparing strategies in bf16)
    margins: dict[int, float] | None = None
    worker_reports: dict = field(default_factory=dict)  # raw reports of worker loops (amusd, dsi)
    # with params.logprobs: each output token's TokenLogprob, from the target's rows observed before its commit
    logprobs: list[TokenLogprob] | None = None
    _logprob_rows: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _logprobs_from_worker: bool = field(default=False, repr=False)  # expect_worker_logprobs
    # with params.prompt_logprobs: each prompt token's TokenLogprob given the tokens before it (the first: None)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # with params.structured: the grammar's state after the committed output (the Engine builds it; its end ids are
    # stop_ids), masking the target's rows before the bias and penalties (adjust, adjust_tree)
    grammar: GrammarMatcher | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.tokens

    @property
    def remaining(self) -> int:
        """Tokens still allowed: by max_new_tokens and by the room left in the KV caches."""
        return min(self.params.max_new_tokens - len(self.tokens), self.max_context - len(self.sequence))

    def adjust(self, logits: torch.Tensor, row_tokens: Sequence[int] = ()) -> torch.Tensor:
        """The target's logits after the request's grammar (-inf where it forbids a token) and its logit bias and
        penalties (sampling.adjust_logits): row i follows the committed output and `row_tokens[:i]` (a
        verification's drafts); unchanged without them."""
        if self.grammar is not None:
            logits = self.grammar.mask_rows(logits, row_tokens)
        return adjust_logits(logits, self.params, self.prompt_ids, self.tokens, row_tokens)

    def adjust_tree(self, logits: torch.Tensor, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """`adjust` for a tree's rows: row 0 after the committed output, row i + 1 after node i's path."""
        if self.grammar is not None:
            logits = self.grammar.mask_tree(logits, tokens, parents)
        if not self.params.adjusts_logits:
            return logits
        paths: list[list[int]] = []
        for token, parent in zip(tokens, parents):
            paths.append((paths[parent] if parent >= 0 else []) + [token])
        rows = [adjust_logits(logits[0], self.params, self.prompt_ids, self.tokens)] + [
            adjust_logits(logits[i + 1], self.params, self.prompt_ids, self.tokens + path)
            for i, path in enumerate(paths)
        ]
        return torch.stack(rows)

    def observe_target(self, first_index: int, logits) -> None:
        """Record the target's rows for output indices first_index, first_index + 1, ...: their top-2 margins
        (record_margins) and, with params.logprobs, their log-softmax until the token there is committed."""
        if self.logprobs is not None:
            rows = torch.log_softmax(logits.float().reshape(-1, logits.shape[-1]), -1)
            for i, row in enumerate(rows):
                self._logprob_rows[first_index + i] = row  # the last observation is the one on the committed prefix
        if self.margins is None:
            return
        for i, gap in enumerate(top2_margins(logits)):
            self.margins[first_index + i] = gap  # the last observation is the one on the committed prefix

    def commit(self, new_tokens: list[int]) -> list[int]:
        """Append verified tokens, cut at the first stop token or the token budget; return what was kept."""
        kept = []
        for token in new_tokens:
            if self.done:
                break
            kept.append(token)
            self.tokens.append(token)
            if self.grammar is not None:
                self.grammar.consume(token)  # not an end token: the request ends there
            if self.logprobs is not None and not self._logprobs_from_worker:
                self.logprobs.append(self._logprob_of(len(self.tokens) - 1, token))
            if token in self.stop_ids:
                self.finish_reason = "stop"
            elif self.stop_check is not None and (matched := self.stop_check(self.tokens)) is not None:
                self.finish_reason, self.stop_string = "stop", matched
            elif len(self.tokens) >= self.params.max_new_tokens:
                self.finish_reason = "length"
            elif len(self.sequence) >= self.max_context:
                self.finish_reason = "context"
        if kept:
            now = self.trace.now()
            if self.first_token_s is None:
                self.first_token_s = now
            self.trace.commit(len(self.tokens), now)
        return kept

    def _logprob_of(self, index: int, token: int) -> TokenLogprob:
        row = self._logprob_rows.pop(index, None)
        if row is None:
            raise RuntimeError(
                f"no target row was observed for output token {index}: this strategy cannot report logprobs"
            )
        return token_logprob(row, token, self.params.logprobs or 0)

    def expect_worker_logprobs(self) -> None:
        """The target's rows stay in a worker that computes each committed token's TokenLogprob there and reports them
        when the request ends (amusd's verifier): commits stop looking for rows observed here (worker_logprobs)."""
        self._logprobs_from_worker = True

    def worker_logprobs(self, reported: list[TokenLogprob]) -> None:
        """The worker's TokenLogprobs of the tokens it committed, in order; the output keeps those of its tokens (a
        stop token or string may have ended it before the worker's last commit)."""
        if self.logprobs is None:
            return
        kept = reported[: len(self.tokens)]
        if [lp.token for lp in kept] != self.tokens:
            raise RuntimeError("the worker's logprobs are not those of the committed tokens")
        self.logprobs = list(kept)

    def settle_in_hand(self, draft: int | None, q, target) -> tuple[int, bool]:
        """verify.judge_in_hand on this run, counted: p for the next position is in hand after a full acceptance,
        so the draft there (if any) is judged at once -- a round that no forward of its own verified. Returns
        (the token to commit, judged): judged is False when there was no draft (the target's own token, a bonus)."""
        token, verdict = judge_in_hand(draft, q, target, self.params, self.generator)
        if verdict is not None:
            self.count_round(1, verdict, verified=False)
        return token, verdict is not None

    def count_round(self, drafted: int, accepted: int, verified: bool = True, tree_nodes: int | None = None) -> None:
        """The one place a verification round is counted: `drafted` tokens judged, `accepted` of them kept, a
        rollback when some were rejected. `verified=False` for a judgement that ran no verification forward of
        its own (a draft judged from a distribution already in hand, a chunk verified inside the prefill): its
        drafts count toward the acceptance rate, not as a round. The accepted drafts are positions 0 .. accepted - 1
        of the judgement (accepted_per_position). A token tree counts its depth as `drafted`
        (the most one round can accept, so the rate compares with a chain's) and its node count apart, in
        worker_reports["tree_nodes"]."""
        self.drafted += drafted
        self.accepted += accepted
        self.rollbacks += accepted < drafted
        per_position = self.accepted_per_position  # vLLM's num_accepted_tokens_per_pos: the kept drafts' positions
        per_position.extend([0] * (accepted - len(per_position)))
        for position in range(accepted):
            per_position[position] += 1
        if verified:
            self.rounds += 1
            self.verified_tokens += accepted + 1
        if tree_nodes is not None:
            self.worker_reports["tree_nodes"] = self.worker_reports.get("tree_nodes", 0) + tree_nodes

    def merge_worker_reports(self, draft_reports: dict[str, dict], target_events: list[TraceEvent], **reports) -> None:
        """Fold in what the worker loops of amusd and dsi sent back once they have ended: each drafter's trace
        (its draft_loop report, keyed by worker name) and the target's events join this run's trace in time order,
        draft_s becomes the drafters' drafting time and verify_s the target's verifying time, and the raw reports
        (the drafters', then `reports`) go to worker_reports."""
        draft_events = [e for report in draft_reports.values() for e in Trace.from_dict(report["trace"]).events]
        self.draft_s = sum(e.duration_s for e in draft_events if e.kind == "draft")
        self.verify_s = sum(e.duration_s for e in target_events if e.kind == "verify")
        self.trace.events = sorted(self.trace.events + draft_events + target_events, key=lambda e: e.start_s)
        self.worker_reports.update(draft_reports, **reports)

    @contextmanager
    def timed(self, device: str, kind: str, tokens: int = 0, on=None):
        """Trace.span around a block, its duration added to draft_s / verify_s. The block may set `event.tokens`
        when it learns the count only at its end.

        `on`: the torch device the block computes on (what runtime.devices.sync takes), waited for at both
        ends: a GPU forward returns once queued, and its time must not land in the next event. A block that
        reads its result back as numbers (tokens, an accepted path) has waited already and needs none."""
        event = None
        try:
            with self.trace.span(kind, tokens, device, sync=None if on is None else partial(sync, on)) as event:
                yield event
        finally:
            if event is not None and kind == "draft":
                self.draft_s += event.seconds
            elif event is not None and kind == "verify":
                self.verify_s += event.seconds


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences (lists or arrays)."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n
