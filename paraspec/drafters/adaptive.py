"""Adaptive draft length: each round, draft the number of tokens that maximises expected tokens per second.

The rule (Leviathan et al. 2023, Section 3.3, with measured costs instead of a constant cost ratio):

    alpha      the drafter's per-token acceptance: P(draft i is accepted | drafts before it were), estimated
               from every round so far (accepted drafts / drafts judged, a draft after the first rejection is
               not judged), recent rounds weighted more (decay DECAY per round), prior Beta(1, 1);
    E(k)       tokens one round commits with k drafts = 1 + alpha + ... + alpha^k (the correction or bonus token
               is always there);
    T(k)       k * d + c(w + k): d the drafter's measured seconds per drafted token (0 for a model-free
               drafter), c(n) the target's measured seconds for a forward of n tokens (VerifyCost: measured
               at start-up for each width, refined by every round), w the committed tokens the target has not
               cached yet (usually 1);
    k*         argmax over k in 0..lookahead of E(k) / T(k).

k* = 0 means speculation does not pay: the round decodes plainly (a forward of w tokens). A model-free drafter
still proposes its token for free, and whether the target's token equals it is one more observation of alpha
(under sampling too: the probability that the target samples x is p(x), exactly the probability that a point-mass
draft of x is accepted). A model drafter is not run while k* = 0; it is probed with one draft after 8, 16, 32, ...
plain rounds (doubling while the probes keep failing), so a change of text can bring it back. The estimates are
kept across requests but faded to a quarter at each new request. In the prompt round (many pending tokens) the
drafts must save time at the margin instead (best_length).

The choice depends only on rounds already verified and on timings, never on the draft being judged, so the
output is exactly as lossless as with a fixed length.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

DECAY = 0.9                  # weight of a round's observation after each later round (about the last 10 rounds)
COST_EMA = 0.2               # weight of a new measurement of a verification width
PROBE_START = 8              # plain rounds before a model drafter is probed again
FADE = 0.25                  # evidence kept from earlier requests


def expected_tokens(alpha: float, k: int) -> float:
    """1 + alpha + ... + alpha^k: the tokens a round commits with k drafts, per-token acceptance alpha."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_length(alpha: float, draft_s: float, verify_s, pending: int, max_k: int) -> tuple[int, float]:
    """k in 0..max_k maximising expected_tokens(alpha, k) / (k * draft_s + verify_s(pending + k)); (k, its
    tokens per second). Ties go to the shorter draft.

    A round with many pending tokens (the prompt round) would make any draft look free next to its prefill, so
    there the drafts must pay for themselves at the margin: k maximises the seconds saved, (E(k) - 1) * c(1) -
    (c(pending + k) - c(pending)) - k * draft_s, against decoding those tokens one by one."""
    best, best_rate, best_saved = 0, -1.0, 0.0
    for k in range(max(0, max_k) + 1):
        rate = expected_tokens(alpha, k) / max(k * draft_s + verify_s(pending + k), 1e-9)
        if pending > 1:
            saved = (expected_tokens(alpha, k) - 1) * verify_s(1) - (verify_s(pending + k) - verify_s(pending)) \
                - k * draft_s
            if saved > best_saved + 1e-12:
                best, best_rate, best_saved = k, rate, saved
        elif rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best, best_rate


@dataclass
class VerifyCost:
    """Seconds of one target forward by its width (tokens fed), from measurements: interpolated linearly between
    measured widths, extrapolated from the last two beyond them."""
    seconds: dict[int, float] = field(default_factory=dict)

    def __call__(self, width: int) -> float:
        widths = sorted(self.seconds)
        if not widths:
            return 1.0                       # nothing measured: every width costs the same (drafting is free)
        if width in self.seconds:
            return self.seconds[width]
        if len(widths) == 1:
            return self.seconds[widths[0]] * max(width, 1) / widths[0]
        i = bisect.bisect_left(widths, width)
        lo, hi = (widths[0], widths[1]) if i == 0 else (widths[-2], widths[-1]) if i == len(widths) \
            else (widths[i - 1], widths[i])
        slope = (self.seconds[hi] - self.seconds[lo]) / (hi - lo)
        return max(self.seconds[lo] + slope * (width - lo), 1e-6)

    def observe(self, width: int, seconds: float) -> None:
        """A measured forward of `width` tokens. Its own estimate moves toward it, and every other width's by the
        same factor (the shape measured at start-up, the level of now): a long context makes every width
        slower, and a rule that saw only 1-token rounds at 2,000 tokens of context must not price a 5-token
        verification at its start-up (32-token context) cost."""
        if width > 64:                          # a prompt round: its cost says nothing about verification widths
            return
        predicted = self(width)
        old = self.seconds.get(width)
        self.seconds[width] = seconds if old is None else (1 - COST_EMA) * old + COST_EMA * seconds
        if predicted > 0 and self.seconds:
            level = 1 + COST_EMA * (seconds / predicted - 1)
            for w in self.seconds:
                if w != width:
                    self.seconds[w] *= level

    @classmethod
    def measure(cls, target, widths, context: int = 32, repeats: int = 2) -> "VerifyCost":
        """Time target forwards of each width after a `context`-token prefix (the fastest of `repeats`); the
        target's cache is left empty."""
        tokens = [i % max(target.vocab_size, 1) for i in range(context + max(widths))]
        target.rollback(0)
        target.forward(tokens[:context], last_n=1)
        cost = cls()
        for width in sorted(set(widths)):
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                target.forward(tokens[context:context + width], last_n=width)
                best = min(best, time.perf_counter() - start)
                target.rollback(context)
            cost.seconds[width] = best
        target.rollback(0)
        return cost


def calibration_widths(max_k: int, pending: int = 1) -> list[int]:
    """Widths measured at start-up: every width up to 4, then about every third up to pending + max_k."""
    top = pending + max_k
    return sorted({w for w in range(1, min(top, 4) + 1)} | set(range(6, top + 1, 3)) | {top})


@dataclass
class Acceptance:
    """Decayed counts of judged and accepted drafts of one drafter: alpha = (accepted + 1) / (judged + 2)."""
    judged: float = 0.0
    accepted: float = 0.0
    draft_s_per_token: float = 0.0
    plain_rounds: int = 0                    # consecutive rounds without drafting (model drafters)
    probe_after: int = PROBE_START

    @property
    def alpha(self) -> float:
        return (self.accepted + 1.0) / (self.judged + 2.0)

    def observe(self, drafted: int, accepted: int) -> None:
        """One round: `accepted` of `drafted` drafts were accepted (judged = accepted + 1 if one was rejected)."""
        judged = accepted + (1 if accepted < drafted else 0)
        self.judged = DECAY * self.judged + judged
        self.accepted = DECAY * self.accepted + accepted

    def fade(self) -> None:
        """A new request: keep a quarter of the evidence, so what held for the last text (copying) must be seen
        again in this one before it drives long drafts (it comes back within a few rounds if it still holds)."""
        self.judged *= FADE
        self.accepted *= FADE

    def observe_draft_time(self, seconds: float, tokens: int) -> None:
        if tokens > 0:
            per_token = seconds / tokens
            self.draft_s_per_token = per_token if self.draft_s_per_token == 0 else \
                (1 - COST_EMA) * self.draft_s_per_token + COST_EMA * per_token
