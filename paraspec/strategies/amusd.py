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
    caller         streams the committed tokens as they appear through its RequestState (the one record of the request),
                   then counts the verifier's verdicts and merges both workers' traces and reports.

Two corrections to the published code: after a rollback the draft never re-feeds a token it has already cached
(draft_loop's cache length always equals the tokens it really processed), and the verifier's bonus token is kept
rather than dropped. A draft judged at once from a distribution in hand counts toward drafted/accepted (and a
rollback when rejected), not as a round: no forward verified it. Every drafted token is judged against exactly the
prefix it was drafted from: a token is published only under the version it was drafted at, and any change to an earlier
position bumps the version and drops it.

The prompts (`lend_cores`, on by default where both devices are core sets of one machine): the target reads its
prompt on both workers' cores while the draft waits, so the first token comes as soon as ar's would; then the draft
reads its own on its cores while the target decodes on its own, one token a forward, until the draft has read it
(the channel's `draft_ready`); from there the verifier waits for drafts as in Algorithm 1. Run at the same time
instead, each prompt has only its own cores, and the first token waits for the target's prompt on those.

A request's processors, grammar and logprobs: the verifier adjusts its rows as the caller's RequestState would (the
grammar's mask on the committed output, then bias and penalties) and computes each committed token's logprobs from the
raw row that committed it, reported when the request ends; the draft worker masks and adjusts its own q the same way,
its grammar's state following its cache (rolled back with it), so q is always the distribution it drew from.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from paraspec.drafters.draft_worker import CHANNEL, draft_loop
from paraspec.request_state import RequestState, TokenLogprob, token_logprob, top2_margins
from paraspec.runtime.channels import ChannelStopped
from paraspec.runtime.devices import lend_cores, shared_cores, sync
from paraspec.sampling import SamplingParams, adjust_logits, make_generator
from paraspec.strategies.base import WITH_RAY, Capabilities, Placement, WorkerStrategy
from paraspec.strategies.registry import register
from paraspec.structured import GrammarMatcher, WorkerGrammar
from paraspec.trace import Trace
from paraspec.verify import judge_in_hand, verify_chain


@register
class AMUSD(WorkerStrategy):
    name = "amusd"
    summary = "draft and verify at the same time on separate devices (AMUSD)"
    option_names = ("max_ahead", "verify_chunk", "draft_window", "lend_cores")
    caps = Capabilities(
        runtime_kinds=WITH_RAY,
        in_workers=True,
        across_nodes=True,
        why_not_model_free=(
            "its draft worker overlaps a draft model's forwards with verification on another device, and a model-free "
            "drafter costs microseconds, so there is nothing to overlap (use sd with the same draft, or dsi to put it "
            "beside a draft model)"
        ),
    )

    def setup(self, placement: Placement) -> None:
        runtime = self.start_workers(
            placement,
            [
                ("target", placement.target, placement.target_devices[0]),
                ("draft", placement.draft_checkpoints[0], placement.draft_devices[0]),
            ],
            drafts=("draft",),
        )
        self.target, self.draft_models = self.remote("target"), [self.remote("draft")]
        self.prompt_cores = (
            shared_cores([placement.target_devices[0], placement.draft_devices[0]], placement.runtime_kind)
            if self.options["lend_cores"]
            else None
        )
        self.tokenizer_folder = str(placement.target)  # the workers' grammars: the Engine's tokenizer
        self.channel = runtime.channel(
            CHANNEL,
            capacity=min(self.target.max_context, self.draft_models[0].max_context),
            vocab_size=self.target.vocab_size,
            q_window=64,
        )

    def decode(self, run: RequestState, seat=None):  # one request at a time, on its workers: no seat
        grammar = None
        if run.params.structured is not None:
            grammar = WorkerGrammar(self.tokenizer_folder, run.params.structured, tuple(sorted(run.stop_ids)))
        options = self.options
        return run_request(
            run,
            self.runtime,
            self.channel,
            options["max_ahead"],
            options["verify_chunk"],
            grammar,
            options["draft_window"],
            self.prompt_cores,
        )


def verify_loop(
    target,
    ctx,
    prompt_ids: list[int],
    params: SamplingParams,
    stop_ids: frozenset[int],
    end: int,
    verify_chunk: int,
    seed: int | None,
    record_margins: bool = False,
    grammar: WorkerGrammar | None = None,
    prompt_cores: tuple[int, ...] | None = None,
) -> dict:
    """Runs in the target worker: verifies drafts and commits tokens until the request is done (or cancelled).
    `grammar`: the request's structured output, masking the target's rows as the caller's RequestState would.
    `prompt_cores`: the prompt runs on these (its own and the draft worker's, which waits for it), the rest on its
    own."""
    matcher = None if grammar is None else grammar.matcher(target.vocab_size)
    if grammar is not None and matcher is None:
        raise RuntimeError(f"the target worker finds no tokenizer in {grammar.folder}: it cannot apply structured")
    verifier = Verifier(
        target,
        ctx,
        prompt_ids,
        params,
        stop_ids,
        end,
        verify_chunk,
        make_generator(seed),
        margins={} if record_margins else None,
        grammar=matcher,
        prompt_cores=prompt_cores,
    )
    try:
        verifier.run_to_end()
    except ChannelStopped:  # the caller cancelled the request, or its RequestState matched a stop string
        pass
    finally:
        verifier.channel.stop("done")
    return verifier.report()


class Verifier:
    """AMUSD's verify process, in the target worker (McDanel 2024, Algorithm 1, lines 15-31): take whatever the
    draft has put in the channel (up to `verify_chunk` tokens, waiting only for the first), verify it in one
    forward, commit the accepted prefix and the target's token; the drafter sees the commit and rolls back on its
    own. It keeps what verifying needs and no RequestState: the verified sequence V (prompt included), where it ends
    (a stop token, or `end`: the token budget or the context), the generator that rejection sampling draws from, and
    its verdicts, which the caller's RequestState counts (`count_verdicts`). The caller's RequestState.commit applies
    the stop rules to the stream, so tokens committed here after a stop token in the same commit are cut there.

    The rows are the caller's: a structured output's grammar (its state the committed output's) masks them first,
    then the request's bias and penalties (`adjust`), as RequestState.adjust does for sd; with SamplingParams.logprobs
    each committed token's TokenLogprob comes from the raw row that committed it, reported at the end."""

    def __init__(
        self,
        target,
        ctx,
        prompt_ids: list[int],
        params: SamplingParams,
        stop_ids: frozenset[int],
        end: int,
        verify_chunk: int,
        generator: torch.Generator,
        margins: dict[int, float] | None = None,
        grammar: GrammarMatcher | None = None,
        prompt_cores: tuple[int, ...] | None = None,
    ):
        self.target, self.ctx, self.params, self.verify_chunk = target, ctx, params, verify_chunk
        self.channel, self.trace = ctx.channels[CHANNEL], ctx.trace  # the trace's rows: target:<device>
        self.sync = partial(sync, ctx.device)  # waits for the target's device around a timed forward
        self.sequence = list(prompt_ids)  # V after the prompt; its length is p_v
        self.prompt_length = len(prompt_ids)
        self.stop_ids, self.end = stop_ids, end
        self.stop_token_seen = False
        self.generator = generator
        self.sampling = not params.greedy
        self.verdicts: list[tuple[int, int, bool]] = []  # (drafted, accepted, by a forward of its own)
        self.margins = margins  # the target's top-2 margins by output index, if asked
        self.judged_at_once = self.bonus = 0  # tokens judged from a distribution already in hand
        self.grammar = grammar  # the committed output's state
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        self.prompt_cores = prompt_cores  # the prompt's cores (lend_cores): the draft reads its own after it
        self.drafting = (
            prompt_cores is None
        )  # the draft has read its prompt: from then on the verifier waits for drafts
        self.alone = 0  # tokens the target decoded on its own while the draft read its prompt

    @property
    def done(self) -> bool:
        """Algorithm 1, line 28: a stop token is in V, or V has reached `end`."""
        return self.stop_token_seen or len(self.sequence) >= self.end

    def run_to_end(self) -> None:
        with lend_cores(self.prompt_cores), self.trace.span("prefill", len(self.sequence), sync=self.sync):
            in_hand = self.target.prefill(self.sequence)  # the target distribution at the first open position
        while not self.done:
            if in_hand is not None:
                self.settle_in_hand(in_hand)
                in_hand = None
            else:
                in_hand = self.verify_next_chunk()

    def commit(self, tokens: list[int], rows: torch.Tensor) -> None:
        """Append verified tokens to V and the channel (which bumps its version on a mismatch: Algorithm 1's R);
        `rows`: the target's raw logits that committed them (their logprobs). The grammar follows V up to a stop."""
        self.channel.commit(tokens, start=len(self.sequence))
        self.sequence += tokens
        if self.logprobs is not None:
            n = self.params.logprobs or 0
            logprobs = torch.log_softmax(rows.float().reshape(-1, rows.shape[-1]), -1)
            self.logprobs += [token_logprob(row, token, n) for row, token in zip(logprobs, tokens)]
        for token in tokens:
            if self.stop_token_seen:
                break  # the request ends at the stop token: nothing after it is verified against the grammar
            if self.grammar is not None:
                self.grammar.consume(token)
            self.stop_token_seen = token in self.stop_ids

    def settle_in_hand(self, logits: torch.Tensor) -> None:
        """A full acceptance (or the prefill) left p for the next position in hand: judge the draft's token there
        at once, or take the target's own token if the draft has not got that far."""
        position = len(self.sequence)
        snap = self.channel.snapshot(position, position + 1)
        draft = int(snap.tokens[0]) if len(snap.tokens) else None
        q = (
            torch.from_numpy(self.channel.read_q(position, position + 1, version=snap.version)[0])
            if self.sampling and draft is not None
            else None
        )
        token, verdict = judge_in_hand(draft, q, self.adjust(logits), self.params, self.generator)
        if verdict is not None:
            self.verdicts.append((1, verdict, False))  # judged, but no forward of its own verified it
        self.judged_at_once += verdict is not None
        self.bonus += verdict is None
        self.commit([token], logits)

    def verify_next_chunk(self) -> torch.Tensor | None:
        """Lines 17-26: wait for drafts past p_v, verify them in one forward, commit; p for the position after the
        chunk when every draft was accepted (Algorithm 1's bonus), else None."""
        position = len(self.sequence)
        drafts, q = self.take_drafts(position, min(self.verify_chunk, self.end - position - 1))  # + one target token
        pending = self.sequence[self.target.length :]  # committed tokens the target has not cached yet
        with self.trace.span("verify", len(pending) + len(drafts), sync=self.sync):
            logits = self.target.forward(pending + drafts, last_n=len(drafts) + 1)
        if self.margins is not None:
            self.margins.update(enumerate(top2_margins(logits), start=position - self.prompt_length))
        accepted, correction = verify_chain(drafts, q, self.adjust(logits, drafts), self.params, self.generator)
        self.target.rollback(position + accepted)
        self.verdicts.append((len(drafts), accepted, True))
        if accepted == len(drafts):
            self.commit(drafts, logits[:accepted])
            return logits[-1]
        self.commit(drafts[:accepted] + [correction], logits[: accepted + 1])
        return None

    def adjust(self, logits: torch.Tensor, drafts: Sequence[int] = ()) -> torch.Tensor:
        """The grammar's mask, then the request's logit bias and penalties on the target's rows (row i after V and
        drafts[:i]), as RequestState.adjust does in the caller; the raw rows stay in hand for the next position."""
        if self.grammar is not None:
            logits = self.grammar.mask_rows(logits, drafts)
        prompt, output = self.sequence[: self.prompt_length], self.sequence[self.prompt_length :]
        return adjust_logits(logits, self.params, prompt, output, drafts)

    def take_drafts(self, position: int, room: int) -> tuple[list[int], torch.Tensor | None]:
        """T_d = D[p_v:p_d], at most `room` tokens (waiting for the first), and their q when sampling. Until the
        draft has read its prompt the verifier does not wait: the target decodes on its own meanwhile (a forward of
        no drafts commits its own token)."""
        if room <= 0:
            return [], None
        if not self.drafting:
            if not self.channel.draft_ready():
                self.alone += 1
                return [], None
            self.drafting = True
        start = self.trace.now()
        snap = self.channel.wait_for_draft(position + 1, start=position, max_length=position + room)
        self.trace.add(None, "wait", start, self.trace.now())
        drafts = [int(t) for t in snap.tokens]
        q = (
            torch.from_numpy(self.channel.read_q(position, position + len(drafts), version=snap.version))
            if self.sampling and drafts
            else None
        )
        return drafts, q

    def report(self) -> dict:
        return {
            "verdicts": self.verdicts,
            "margins": self.margins,
            "judged_at_once": self.judged_at_once,
            "bonus": self.bonus,
            "logprobs": self.logprobs,
            "alone": self.alone,
        }


def run_request(
    run: RequestState,
    runtime,
    channel,
    max_ahead: int = 16,
    verify_chunk: int = 8,
    grammar: WorkerGrammar | None = None,
    window: int = 0,
    prompt_cores: tuple[int, ...] | None = None,
):
    """Caller side: start both loops, stream committed tokens, then count the verifier's verdicts and fold both
    workers' reports and traces into `run` (the logprobs the verifier computed among them). `grammar`: the request's
    structured output, for the verifier's rows and the drafter's q. `window`: the draft's (draft_loop).
    `prompt_cores`: the target's prompt runs on these, and the draft reads its own after the first token."""
    channel.reset(run.prompt_ids)
    run.expect_worker_logprobs()
    target, draft = runtime["target"], runtime["draft"]
    verify = target.start_loop(
        verify_loop,
        trace=Trace(t0=run.trace.t0),
        prompt_ids=run.prompt_ids,
        params=run.params,
        stop_ids=run.stop_ids,
        end=len(run.sequence) + run.remaining,
        verify_chunk=verify_chunk,
        seed=run.params.seed,
        record_margins=run.margins is not None,
        grammar=grammar,
        prompt_cores=prompt_cores,
    )
    drafting = draft.start_loop(
        draft_loop,
        params=run.params,
        prompt_length=len(run.prompt_ids),
        max_ahead=max_ahead,
        vocab_size=target.info.vocab_size,
        seed=run.params.seed,
        t0=run.trace.t0,
        grammar=grammar,
        window=window,
        after_first_token=bool(prompt_cores),
    )
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
            if run.stop_string is not None:  # a stop string (the caller's tokenizer): end the workers' loops
                channel.stop("stop string")
                break
        finished = True
    finally:
        if not finished:  # the consumer stopped early (or failed): end both loops first
            channel.stop("cancelled by the caller")
        verify_report, draft_report = runtime.gather(verify, drafting)
    count_verdicts(run, verify_report)
    run.worker_logprobs(verify_report["logprobs"] or [])
    run.merge_worker_reports({"draft": draft_report}, verify.events, target=verify_report)


def count_verdicts(run: RequestState, verify_report: dict) -> None:
    """Count the verifier's judgements into the caller's RequestState, the one record of the request."""
    for drafted, accepted, by_forward in verify_report["verdicts"]:
        run.count_round(drafted, accepted, verified=by_forward)
    if run.margins is not None:
        run.margins.update(verify_report["margins"])
