"""What the adaptive rule's own work costs a round (DraftPolicy.propose + observe), with no model: one stand-in
draft model (it drafts without a forward), the costs given in milliseconds by width, 200 tokens of context, the
draft right every time it was judged. On a CPU where the draft model cannot pay, this is all `sd` adds to `ar`.

    python benchmarks/rule_round_cost.py --target-ms 1:32.9,5:119,16:252,32:423 --draft-ms 1:19 --lookahead 32
    python benchmarks/rule_round_cost.py ... --profile        # where the time goes (cProfile, top 15)
"""

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from paraspec import SamplingParams
from paraspec.drafters import DraftPolicy, Proposal
from paraspec.drafters.adaptive import Acceptance, ForwardCost
from paraspec.drafters.base import Drafter


class Idle(Drafter):
    """A draft model that drafts token 7 without running anything, 200 tokens into the sequence."""

    name, free, length = "model", False, 200

    def behind(self, sequence):
        return len(sequence) - self.length

    def propose(self, sequence, k, params, generator):
        return Proposal([7] * k)


def costs(text: str) -> ForwardCost:
    """`1:32.9,5:119` (width:milliseconds) -> a ForwardCost in seconds."""
    try:
        pairs = [item.split(":") for item in text.split(",")]
        return ForwardCost({int(w): float(ms) / 1e3 for w, ms in pairs})
    except ValueError:
        raise SystemExit(f"costs {text!r}: write width:milliseconds pairs, e.g. 1:32.9,5:119") from None


def round_us(target: ForwardCost, draft: ForwardCost, lookahead: int, judged: int, rounds: int) -> float:
    rule = DraftPolicy([Idle()], ForwardCost(dict(target.seconds)), {0: ForwardCost(dict(draft.seconds))})
    rule.acceptance[(0, 0)] = Acceptance(judged=judged, accepted=judged)
    sequence, params, generator = list(range(200)), SamplingParams(max_new_tokens=64), torch.Generator()
    start = time.perf_counter()
    for _ in range(rounds):
        drafts = rule.propose(sequence, lookahead, params, generator, pending=1, remaining=60).tokens
        rule.observe(1 + len(drafts), rule.cost(1 + len(drafts)), drafts + [3])
    return (time.perf_counter() - start) / rounds * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-ms", required=True, help="the target's forward by width, e.g. 1:32.9,5:119,16:252")
    ap.add_argument("--draft-ms", required=True, help="the draft model's forward by width, e.g. 1:19")
    ap.add_argument("--lookahead", type=int, default=32, help="the most a round drafts (sd's rule default: 32)")
    ap.add_argument("--judged", type=int, default=4, help="drafts judged so far, all accepted")
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of --rounds each; the median is printed")
    ap.add_argument("--profile", action="store_true", help="print cProfile's top 15 functions by own time")
    args = ap.parse_args()
    target, draft = costs(args.target_ms), costs(args.draft_ms)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(round_us, target, draft, args.lookahead, args.judged, args.rounds)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    runs = [round_us(target, draft, args.lookahead, args.judged, args.rounds) for _ in range(args.repeats)]
    print(
        f"the rule's round: {statistics.median(runs):.0f} us median of {args.repeats} runs "
        f"({min(runs):.0f}-{max(runs):.0f}), lookahead {args.lookahead}, {args.rounds} rounds each"
    )


if __name__ == "__main__":
    main()
