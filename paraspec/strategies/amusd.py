"""AMUSD (McDanel 2024, Algorithm 1): the draft and the target run at the same time on separate devices.

    draft worker   drafters/draft_worker.py's `draft_loop`: drafts continuously from the latest sequence in the
                   channel, up to `max_ahead` tokens past the verified prefix, publishing each token (and its q
                   when sampling); when the version moves (a rejection) it rolls its KV cache back to the
                   longest prefix still valid and continues from the verifier's correction token.
    target worker  takes every drafted token past the verified prefix (up to `verify_chunk`), verifies them in
                   one forward, and commits the accepted tokens plus its correction (the channel bumps the
                   version on a mismatch). After a full acceptance the distribution it already computed for the
                   next position judges the draft's token there at once, or, if the draft has not reached that
                   position yet, supplies the token itself (the bonus) instead of waiting.
    caller         streams the committed tokens as they appear and merges both workers' traces and counters.

Two corrections to the published code: after a rollback the draft never re-feeds a token it has already cached
(draft_loop's cache length always equals the tokens it really processed), and the verifier's bonus token is kept
rather than dropped. A draft judged at once from a distribution in hand counts toward drafted/accepted (and a
rollback when rejected), not as a round: no forward verified it. Every drafted token is judged against exactly the prefix it was
drafted from: a token is published only under the version it was drafted at, and any change to an earlier
position bumps the version and drops it.
"""
from __future__ import annotations

import torch

from paraspec.drafters.draft_worker import CHANNEL, draft_loop
from paraspec.run import Run
from paraspec.runtime.channels import ChannelStopped
from paraspec.sampling import SamplingParams, make_generator
from paraspec.strategies.registry import register
from paraspec.strategies.base import Placement, WorkerStrategy
from paraspec.trace import Trace
from paraspec.verify import verify_chain


@register
class AMUSD(WorkerStrategy):
    name = "amusd"
    summary = "draft and verify at the same time on separate devices (AMUSD)"
    options = ("max_ahead", "verify_chunk")
    no_model_free_reason = ("its draft worker overlaps a draft model's forwards with verification on another "
                            "device, and a model-free drafter costs microseconds, so there is nothing to overlap "
                            "(use sd with the same draft, or dsi to put it beside a draft model)")

    def setup(self, placement: Placement) -> None:
        self.start_workers(placement, [("target", placement.target, placement.target_devices[0]),
                                       ("draft", placement.model_drafts[0], placement.draft_devices[0])])
        self.target, self.drafts = self.remote("target"), [self.remote("draft")]
        self.channel = self.runtime.channel(CHANNEL, capacity=min(self.target.max_context, self.drafts[0].max_context),
                                            vocab_size=self.target.vocab_size, q_window=64)

    def decode(self, run: Run):
        return run_request(run, self.runtime, self.channel, self.options["max_ahead"],
                           self.options["verify_chunk"])


def verify_loop(target, ctx, prompt_ids: list[int], params: SamplingParams, stop_ids: frozenset[int],
                max_context: int, verify_chunk: int, seed: int | None, t0: float,
                record_margins: bool = False) -> dict:
    """Runs in the target worker: verifies drafts and commits tokens until the request is done."""
    run = Run(prompt_ids, params, stop_ids, make_generator(seed), max_context, trace=Trace(t0=t0),
              margins={} if record_margins else None)
    verifier = Verifier(target, ctx, run, verify_chunk)
    try:
        verifier.run_to_end()
    except ChannelStopped:                  # the caller cancelled the request
        run.finish_reason = "cancelled"
    finally:
        verifier.channel.stop("done")
    return verifier.report()


class Verifier:
    """AMUSD's verification side, in the target worker: take whatever the draft has put in the channel (up to
    `verify_chunk` tokens, waiting only for the first), verify it in one forward, commit the accepted prefix and
    the target's token; the drafter sees the commit and rolls back on its own (McDanel 2024, Algorithm 1)."""

    def __init__(self, target, ctx, run: Run, verify_chunk: int):
        self.target, self.ctx, self.run, self.verify_chunk = target, ctx, run, verify_chunk
        self.channel = ctx.channels[CHANNEL]
        self.device = f"target:{ctx.device}"
        self.sampling = not run.params.greedy
        self.judged_at_once = self.bonus = 0      # tokens settled from a distribution already in hand

    def run_to_end(self) -> None:
        run = self.run
        with run.timed(self.device, "prefill", len(run.prompt_ids), on=self.ctx.device):
            in_hand = self.target.prefill(run.prompt_ids)   # the target distribution at the first open position
        while not run.done:
            if in_hand is not None:
                self.settle_in_hand(in_hand)
                in_hand = None
            else:
                in_hand = self.verify_next_chunk()

    def commit(self, tokens: list[int]) -> None:
        kept = self.run.commit(tokens)
        if kept:
            self.channel.commit(kept, start=len(self.run.sequence) - len(kept))

    def settle_in_hand(self, logits: torch.Tensor) -> None:
        """A full acceptance (or the prefill) left p for the next position in hand: judge the draft's token there
        at once, or take the target's own token if the draft has not got that far."""
        run, position = self.run, len(self.run.sequence)
        snap = self.channel.snapshot(position, position + 1)
        draft = int(snap.tokens[0]) if len(snap.tokens) else None
        q = torch.from_numpy(self.channel.read_q(position, position + 1, version=snap.version)[0]) \
            if self.sampling and draft is not None else None
        token, judged = run.settle_in_hand(draft, q, logits)
        self.judged_at_once += judged
        self.bonus += not judged
        self.commit([token])

    def verify_next_chunk(self) -> torch.Tensor | None:
        """Wait for a draft, verify what is there in one forward, commit; p for the position after the chunk
        when every draft was accepted (Algorithm 1's bonus), else None."""
        run, channel, position = self.run, self.channel, len(self.run.sequence)
        room = min(self.verify_chunk, run.remaining - 1)   # the forward also yields one target token
        drafts, q = [], None
        if room > 0:
            start = run.trace.now()
            snap = channel.wait_for_draft(position + 1, start=position, max_length=position + room)
            run.trace.add(self.device, "wait", start, run.trace.now())
            drafts = [int(t) for t in snap.tokens]
            if self.sampling and drafts:
                q = torch.from_numpy(channel.read_q(position, position + len(drafts), version=snap.version))
        pending = run.sequence[self.target.length:]      # committed tokens the target has not cached yet
        with run.timed(self.device, "verify", len(pending) + len(drafts), on=self.ctx.device):
            logits = self.target.forward(pending + drafts, last_n=len(drafts) + 1)
        run.observe_target(len(run.tokens), logits)
        accepted, correction = verify_chain(drafts, q, logits, run.params, run.generator)
        self.target.rollback(position + accepted)
        run.count_round(len(drafts), accepted)
        if accepted == len(drafts):
            self.commit(drafts)
            return logits[-1]
        self.commit(drafts[:accepted] + [correction])
        return None

    def report(self) -> dict:
        run = self.run
        return {"tokens": run.tokens, "finish_reason": run.finish_reason, "drafted": run.drafted,
                "accepted": run.accepted, "rounds": run.rounds, "verified_tokens": run.verified_tokens,
                "rollbacks": run.rollbacks, "verify_s": run.verify_s, "trace": run.trace.to_dict(),
                "margins": run.margins, "judged_at_once": self.judged_at_once, "bonus": self.bonus}


def run_request(run: Run, runtime, channel, max_ahead: int = 16, verify_chunk: int = 8):
    """Caller side: start both loops, stream committed tokens, then merge the workers' reports into `run`."""
    channel.reset(run.prompt_ids)
    t0 = run.trace.t0
    target, draft = runtime["target"], runtime["draft"]
    verify = target.start_loop(verify_loop, prompt_ids=run.prompt_ids, params=run.params, stop_ids=run.stop_ids,
                               max_context=run.max_context, verify_chunk=verify_chunk, seed=run.params.seed, t0=t0,
                               record_margins=run.margins is not None)
    drafting = draft.start_loop(draft_loop, params=run.params, max_ahead=max_ahead,
                                vocab_size=target.info.vocab_size, seed=run.params.seed, t0=t0)
    seen = len(run.prompt_ids)
    finished = False
    try:
        while True:
            try:
                state = channel.wait_for_commit(seen + 1)
            except ChannelStopped:
                break
            new = [int(t) for t in channel.tokens(seen, state.committed)]
            seen = state.committed
            yield run.commit(new)
            if run.stop_string is not None:     # a stop string (the caller's tokenizer): end the workers' loops
                channel.stop("stop string")
                break
        finished = True
    finally:
        if not finished:                    # the consumer stopped early (or failed): end both loops first
            channel.stop("cancelled by the caller")
        reports = runtime.gather(verify, drafting)
    merge_reports(run, *reports)


def merge_reports(run: Run, verify_report: dict, draft_report: dict) -> None:
    # a cancelled verifier may have counted a batch that its stopped channel then refused: the stream is the record
    # a stop string ends the stream early: the verifier's record then only starts with it
    record = verify_report["tokens"][:len(run.tokens)] if run.stop_string is not None else verify_report["tokens"]
    if record != run.tokens and verify_report["finish_reason"] != "cancelled":
        raise RuntimeError("amusd: the streamed tokens differ from the verifier's record")
    for key in ("drafted", "accepted", "rounds", "verified_tokens", "rollbacks", "verify_s"):
        setattr(run, key, verify_report[key])
    draft_trace = Trace.from_dict(draft_report["trace"])
    run.draft_s = draft_trace.busy_s("draft")
    verify_trace = Trace.from_dict(verify_report["trace"])
    run.trace.events = sorted(verify_trace.events + draft_trace.events, key=lambda e: e.start_s)
    if verify_report["margins"] is not None and run.margins is not None:
        run.margins.update(verify_report["margins"])
    run.worker_reports = {"target": verify_report, "draft": draft_report}
