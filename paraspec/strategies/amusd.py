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
from paraspec.verify import judge_in_hand, verify_chain


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
        return decode(run, self.runtime, self.channel, self.options["max_ahead"], self.options["verify_chunk"])


def verify_loop(target, ctx, prompt_ids: list[int], params: SamplingParams, stop_ids: frozenset[int],
                max_context: int, verify_chunk: int, seed: int | None, t0: float,
                record_margins: bool = False) -> dict:
    """Runs in the target worker: verifies drafts and commits tokens until the request is done."""
    channel = ctx.channels[CHANNEL]
    run = Run(prompt_ids, params, stop_ids, make_generator(seed), max_context, trace=Trace(t0=t0),
              margins={} if record_margins else None)
    device = f"target:{ctx.device}"
    sampling = not params.greedy
    judged_at_once = bonus = 0              # tokens settled from a distribution already in hand

    def commit(tokens: list[int]) -> None:
        kept = run.commit(tokens)
        if kept:
            channel.commit(kept, start=len(run.sequence) - len(kept))

    try:
        with run.timed(device, "prefill", len(prompt_ids), on=ctx.device):
            next_logits = target.prefill(prompt_ids)   # the target distribution at the first open position
        while not run.done:
            position = len(run.sequence)
            if next_logits is not None:
                # a full acceptance (or the prefill) left p for `position` in hand: judge the draft's token
                # there at once, or take the target's own token if the draft has not got that far
                snap = channel.snapshot(position, position + 1)
                draft = int(snap.tokens[0]) if len(snap.tokens) else None
                q = torch.from_numpy(channel.read_q(position, position + 1, version=snap.version)[0]) \
                    if sampling and draft is not None else None
                token, verdict = judge_in_hand(draft, q, next_logits, params, run.generator)
                if verdict is None:
                    bonus += 1
                else:
                    run.count_round(1, verdict, verified=False)   # judged without a forward of its own
                    judged_at_once += 1
                commit([token])
                next_logits = None
                continue

            room = min(verify_chunk, run.remaining - 1)   # the forward also yields one target token
            if room > 0:
                start = run.trace.now()
                snap = channel.wait_for_draft(position + 1, start=position, max_length=position + room)
                run.trace.add(device, "wait", start, run.trace.now())
                drafts = [int(t) for t in snap.tokens]
            else:
                drafts = []
            q = torch.from_numpy(channel.read_q(position, position + len(drafts), version=snap.version)) \
                if sampling and drafts else None
            pending = run.sequence[target.length:]      # committed tokens the target has not cached yet
            with run.timed(device, "verify", len(pending) + len(drafts), on=ctx.device):
                logits = target.forward(pending + drafts, last_n=len(drafts) + 1)
            run.observe_target(len(run.tokens), logits)
            accepted, correction = verify_chain(drafts, q, logits, params, run.generator)
            target.rollback(position + accepted)
            run.count_round(len(drafts), accepted)
            if accepted == len(drafts):
                commit(drafts)
                next_logits = logits[-1]              # p for the position after the chunk (Alg. 1's bonus)
            else:
                commit(drafts[:accepted] + [correction])
    except ChannelStopped:                  # the caller cancelled the request
        run.finish_reason = "cancelled"
    finally:
        channel.stop("done")
    return {"tokens": run.tokens, "finish_reason": run.finish_reason, "drafted": run.drafted,
            "accepted": run.accepted, "rounds": run.rounds, "verified_tokens": run.verified_tokens,
            "rollbacks": run.rollbacks, "verify_s": run.verify_s, "trace": run.trace.to_dict(),
            "margins": run.margins, "judged_at_once": judged_at_once, "bonus": bonus}


def decode(run: Run, runtime, channel, max_ahead: int = 16, verify_chunk: int = 8):
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
