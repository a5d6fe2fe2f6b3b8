"""The worker drafting loop: a model Drafter in its own worker drafts continuously into a token channel while
others verify (amusd's draft worker, dsi's drafters).

    draft_loop   runs in the draft worker until the channel stops: drafts from the latest sequence in the
                 channel, up to `max_ahead` tokens past the verified prefix, publishing each token (and its q
                 when sampling); when the version moves (a rejection) it rolls its KV cache back to the longest
                 prefix still valid and continues from the verifier's correction token.

Each token comes from `ModelDrafter.propose` (one token, q the distribution it was drawn from: drafters/model.py
`draw`), so a worker drafts exactly as sd's drafter does. The loop never re-feeds a token its cache already
holds (`cached` is exactly the tokens in the cache), and it publishes a token only under the version it was
drafted at: any change to an earlier position bumps the version and drops it, so every drafted token is judged
against exactly the prefix it was drafted from.
"""

from __future__ import annotations

from paraspec.drafters.model import ModelDrafter
from paraspec.request_state import common_prefix
from paraspec.runtime.channels import ChannelFull, ChannelStopped
from paraspec.sampling import SamplingParams, make_generator
from paraspec.structured import WorkerGrammar
from paraspec.trace import Trace

CHANNEL = "tokens"  # the first drafter's channel (dsi's further drafters: tokens1, tokens2, ...)


def draft_loop(
    draft,
    ctx,
    params: SamplingParams,
    max_ahead: int,
    vocab_size: int,
    seed: int | None,
    t0: float,
    channel_name: str = CHANNEL,
    label: str = "draft",
    prompt_length: int = 0,
    grammar: WorkerGrammar | None = None,
    window: int = 0,
    after_first_token: bool = False,
) -> dict:
    """Runs in the draft worker (`draft`: the worker's model) until the channel stops (the request ended or a
    worker failed). `channel_name` and `label` (its trace row) tell several drafters apart (dsi's drafters).
    `grammar`: the request's structured output, which masks each draft on the output its cache holds. `window`: the
    draft reads at most the last `window` tokens it has not cached (ModelDrafter's window; 0: all). `after_first_token`:
    the verifier's prompt runs on this worker's cores too (amusd's lend_cores), so the draft reads its own only
    after the verifier's first token, and the channel hears when it has read it (`draft_ready`)."""
    channel = ctx.channels[channel_name]
    drafter = ModelDrafter(draft, vocab_size, window=window)
    drafter.prompt_length = prompt_length  # the request's penalties count the output after it
    drafter.grammar = None if grammar is None else grammar.matcher(vocab_size)
    generator = make_generator(None if seed is None else seed + 1)
    trace = Trace(t0=t0)
    device = f"{label}:{ctx.device}"
    cached: list[int] = []  # the sequence the draft's KV cache accounts for (with a window: the tokens it holds,
    # cached[drafter.offset:], after those the window skipped), in order
    version = None
    drafted = published = rollbacks = fed = discarded = 0
    drafter.reset()
    snap = None  # the read for the next step, when the last publish brought it along
    try:
        if after_first_token:
            start = trace.now()
            channel.wait_for_commit(prompt_length + 1)
            trace.add(device, "wait", start, trace.now())
        while True:
            if snap is None:
                snap = channel.read_since(len(cached), version)  # one round trip on the network transport
            if snap.version != version:  # a new request or a rejection: the read is the whole sequence
                dropped = roll_back_to(snap.tokens, drafter, cached, trace, device)
                discarded += dropped
                rollbacks += dropped > 0
                version = snap.version
                snap = snap._replace(
                    start=len(cached), tokens=snap.tokens[len(cached) :], stamps=snap.stamps[len(cached) :]
                )
            if snap.length - snap.committed >= max_ahead:
                start = trace.now()
                snap = channel.wait_below_ahead(max_ahead, len(cached), version)
                trace.add(device, "wait", start, trace.now())
                continue
            feed = [int(t) for t in snap.tokens]
            snap = None
            if not feed:  # everything is cached: re-run the last token for its logits
                drafter.rollback(len(cached) - 1)
                feed = [cached.pop()]
                discarded += 1
            position = len(cached) + len(feed)
            if (
                not params.greedy
                and channel.wait_for_room(position + 1, version=version, timeout=None).version != version
            ):
                continue
            start = trace.now()
            proposal = draft_next(drafter, cached, feed, params, generator)
            if after_first_token and not drafted:
                channel.mark_draft_ready()  # its prompt is read: the verifier stops decoding alone
            fed += len(feed)
            trace.add(device, "draft", start, trace.now(), len(feed))
            drafted += 1
            try:
                ok, snap = channel.publish_and_read(position, proposal.tokens, q=proposal.q, version=version)
                published += ok
            except ChannelFull:  # the context is full: the verifier is about to finish
                channel.wait_for_version_change(version)
    except ChannelStopped:
        pass
    # "cached" is this loop's record of the cache; tests check it against the channel's sequence and the cache
    return {
        "drafted": drafted,
        "published": published,
        "rollbacks": rollbacks,
        "fed": fed,
        "discarded": discarded,
        "cache_length": drafter.length,
        "offset": drafter.offset,  # the window's: the cache holds cached[offset:]
        "cached": list(cached),
        "trace": trace.to_dict(),
    }


def draft_next(drafter: ModelDrafter, cached: list[int], feed: list[int], params: SamplingParams, generator):
    """Feed what the cache lacks (`feed`, appended to `cached`) and draw the next token with its q; a structured
    output's state first follows the cache's output, rolled back with the cache where the verifier disagreed."""
    cached.extend(feed)  # the drafter feeds what it has not cached: exactly `feed` (no copy)
    if drafter.grammar is not None:
        drafter.grammar.follow(cached[drafter.prompt_length :])
    return drafter.propose(cached, 1, params, generator)


def roll_back_to(sequence, drafter: ModelDrafter, cached: list[int], trace: Trace, device: str) -> int:
    """Keep the longest cached prefix that is still `sequence` (the draft's cache and `cached` both); returns how
    many cached tokens were dropped."""
    keep = common_prefix(cached, sequence)
    dropped = len(cached) - keep
    if dropped:
        start = trace.now()
        drafter.rollback(keep)
        trace.add(device, "rollback", start, trace.now(), dropped)
        del cached[keep:]
    return dropped
