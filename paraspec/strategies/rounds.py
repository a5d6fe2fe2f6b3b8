"""The round of synchronous speculative decoding, shared by `sd` (a chain), `tree` and `easyspec` (a token tree):
each strategy supplies its draft step and its verify step, this skeleton runs them.

    the target's cache starts empty; the drafter forgets the last request (reset)
    until the run is done:
        draft    the strategy's step: the round's length (the rule's k* when adaptive), then a chain or a tree
        verify   the strategy's step: ONE target forward over the pending committed tokens and every draft,
                 the accepted path and the correction/bonus token, the target's cache kept to that path
        update   the drafter keeps the accepted path in its cache (accept) and learns from the round (observe)
        count    RequestState.count_round: drafted = the drafts' depth (a chain's length), accepted = the path's length
        commit   the accepted drafts plus the correction/bonus token (RequestState.commit)
    at the end: the drafter keeps the output (finish); with the adaptive rule, its report

The first round drafts from the prompt and the target's prefill verifies those drafts in the same forward (as
HF assisted generation does), so every round looks alike; its forward is traced as the prefill. On a target that
splits prompts (llama.cpp: the tokens after a prompt run in forwards of their own) `sd` drafts nothing there: the
drafts would cost the same verification one round later, and the first token streams before it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TypeVar

from paraspec.drafters import DraftPolicy, Proposal, TokenTree
from paraspec.request_state import RequestState

# draft(policy, sequence, pending): the round's proposal (a chain or a tree); `pending` = committed tokens the target
# has not cached
P = TypeVar("P", Proposal, TokenTree)  # the proposal's kind: a chain (sd) or a tree (tree, easyspec)
DraftStep = Callable[[DraftPolicy, list[int], int], P]
# verify(sequence, pending tokens, proposal): (accepted path as indices into proposal.tokens, the next token)
VerifyStep = Callable[[list[int], list[int], P], tuple[list[int], int]]


def speculative_rounds(
    run: RequestState, target, policy: DraftPolicy, draft: DraftStep[P], verify: VerifyStep[P]
) -> Generator[list[int], None, None]:
    """Yield each round's committed tokens until the run is done. `policy` picks who proposes each round and how
    much (DraftPolicy([drafter]): that drafter every round, at the fixed length)."""
    target.rollback(0)
    policy.reset()
    policy.begin(run.params, len(run.prompt_ids), run.grammar)
    try:
        while not run.done:
            sequence = run.sequence
            pending = sequence[target.length :]  # the prompt, then each round's correction/bonus token
            with run.timed("draft", "draft") as event:
                proposal = draft(policy, sequence, len(pending))
                event.tokens = proposal.depth
            record_plan(run, policy, proposal.depth)
            # the first round's forward takes the prompt: the target's prefill (it verifies proposal too)
            kind = "prefill" if target.length == 0 else "verify"
            with run.timed("target", kind, len(pending) + len(proposal)) as verifying:
                path, next_token = verify(sequence, pending, proposal)
            if len(proposal):
                policy.accept(len(sequence), path)
            committed = [proposal.tokens[node] for node in path] + [next_token]
            policy.observe(len(pending) + len(proposal), verifying.seconds, committed)
            run.count_round(
                proposal.depth, len(path), tree_nodes=len(proposal) if isinstance(proposal, TokenTree) else None
            )
            yield run.commit(committed)
    finally:
        policy.finish(run.sequence)
        if policy.adaptive:
            run.worker_reports["adaptive"] = policy.report()


def record_plan(run: RequestState, policy: DraftPolicy, k: int) -> None:
    """With the adaptive rule, the round's decision goes into the trace: a "plan" event of k tokens."""
    if policy.adaptive:
        now = run.trace.now()
        run.trace.add("draft", "plan", now, now, k)
