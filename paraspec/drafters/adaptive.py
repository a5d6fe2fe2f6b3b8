"""Adaptive draft length: each round, draft the number of tokens that maximises expected tokens per second.

The rule (Leviathan et al. 2023, Section 3.3, with measured costs instead of a constant cost ratio, and an
acceptance per draft position instead of one constant):

    a_j        P(draft j is accepted | the drafts before it were), estimated from every round so far (accepted
               drafts / drafts judged, a draft after the first rejection is not judged), recent rounds weighted
               more (decay DECAY per round), prior Beta(1, 1). A draft model has one a for every position; a
               model-free drafter has one per length of the context its token continues (`match_bucket`): its
               j-th token continues the n matched tokens and the j - 1 drafted before it, and a 12-token match in
               copied text is right far more often than a 1-token one. A bucket's prior is the estimate of the
               next shorter one (a longer context is taken to be as good until its own rounds say otherwise:
               without it, the tokens deep in a proposal would never be drafted, so never judged). The rule
               uses a model-free drafter's estimates less LOWER_Z of their standard deviation (`Acceptance.lower`):
               where few drafts were judged, a lucky one or two must not buy a long draft (on a CPU, where
               verification is compute-bound, a wrong draft of k tokens costs about k plain steps). A draft
               model's one estimate, judged on every token it drafts, is used as it is: less LOWER_Z, one early
               rejection in a new request (its evidence faded) could take it below what drafting needs where a
               wider verification costs two steps, and the request then decoded plainly to its end;
    E(k)       tokens one round commits with k drafts = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k (the correction or
               bonus token is always there);
    T(k)       k * d + c(w + k): d the draft model's measured seconds for a one-token forward (0 for a
               model-free drafter), c(n) the target's measured seconds for a forward of n tokens (ForwardCost:
               measured at start-up for each width, refined by every round), w the committed tokens the target
               has not cached yet (usually 1);
    k*         argmax over k in 0..lookahead of E(k) / T(k).

k* = 0 means speculation does not pay: the round decodes plainly (a forward of w tokens). A model-free drafter
still proposes its tokens for free, and whether the target's token equals the first is one more observation of its
a (under sampling too: the probability that the target samples x is p(x), exactly the probability that a
point-mass draft of x is accepted). A model drafter is not run while k* = 0; it is probed with one draft after 8,
16, 32, ... plain rounds (doubling while the probes keep failing), so a change of text can bring it back. The
estimates are kept across requests (and shared by the seats of a Scheduler: the pair's, not a sequence's) but
faded to a quarter at each new request. In the prompt round (many pending tokens) the drafts must save time at the
margin instead (best_length), and a draft model does not draft at all: the first token comes as soon as plain
decoding's, and the draft reads the prompt after it, as a catch-up.

A draft model that has not seen the latest tokens (the prompt, tokens another drafter drafted, plain rounds) must
first feed them: a catch-up forward of D(behind) seconds (the draft's own ForwardCost) before its first draft.
That is paid once and then saves time on every later round, so it is drafted through only when the steady-state
saving over the request's remaining tokens exceeds it (`catch_up_pays`), and a probe only when what it adds to a
plain round (the catch-up, its draft, a verification one token wider) costs at most PROBE_SHARE of the plain rounds
since the last one: a bound on what probing a drafter that does not pay may cost.

A model drafter nobody has judged yet is tried (its trial): from the prior alone a draft model costing a third of a
target step never looks worth a round, nor its catch-up, so it would never be judged. Until TRIAL_JUDGED of its
drafts have been judged it drafts at least 1, 2, 4, ... tokens (doubling while a round's drafts are all accepted,
back to 1 at a rejection), its catch-up paid once, in a request with TRIAL_REMAINING tokens or more left. A draft
that is never right costs a few one-token rounds; a good one then drafts by its own estimate.

Under the rule a draft model's chain ends where its own confidence says the next draft does not pay (ChainStop);
k* > 0 then only decides that the round drafts.

The choice depends only on rounds already verified, on timings and on the draft's own distributions, never on the
draft being judged, so the output is exactly as lossless as with a fixed length.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from paraspec.runtime.devices import sync

DECAY = 0.9  # weight of a round's observation after each later round (about the last 10 rounds)
COST_EMA = 0.2  # weight of a new measurement of a forward width
PROBE_START = 8  # plain rounds before a model drafter is probed again
PROBE_SHARE = 0.03  # most a probe may add to a plain round, as a share of the plain rounds since the last one
FADE = 0.25  # evidence kept from earlier requests
TRIAL_JUDGED = 4.0  # judged drafts (decayed) that end a model drafter's trial
TRIAL_REMAINING = 32  # a trial starts only in a request with at least this many tokens left
# the best case a look at a draft model is judged by (DraftPolicy._could_pay): its drafts accepted this often, as the
# best drafts are on the most predictable text -- not every draft right, a case no draft reaches, and one that puts a
# long chain's cost within a few percent of plain decoding on CPUs where drafting cannot pay, inside the noise of a
# start-up cost table (docs/DRAFTERS.md, "Only where drafting could pay")
BEST_ALPHA = 0.99
PRIOR_WEIGHT = 2.0  # judged drafts a prior is worth (Beta(1, 1) for a drafter's first bucket)
LOWER_Z = 0.5  # the rule drafts by a model-free drafter's estimates less this many standard deviations
OBSERVED_WIDTHS = 64  # a forward wider than this (a prompt) does not move the per-width costs
REPEAT_UNDER_S = 0.2  # start-up: a forward timed under this is timed again (the fastest kept); longer, once
# context lengths grouped for the per-position acceptance of model-free drafters: 1, 2, 3, 4, 5-7, 8-11, 12-15, 16+
MATCH_BUCKETS = (1, 2, 3, 4, 5, 8, 12, 16)
SOURCE_STRIDE = 1000  # bucket ids of a drafter's second source of evidence start here (Drafter.sources)


def match_bucket(n: int) -> int:
    """The bucket of a context length n (0: no match, a draft model): the largest MATCH_BUCKETS entry <= n."""
    return MATCH_BUCKETS[bisect.bisect_right(MATCH_BUCKETS, n) - 1] if n >= 1 else 0


def bucket_label(bucket: int) -> str:
    """`match5-7`, `match16+`, `match1` (report keys)."""
    i = MATCH_BUCKETS.index(bucket) if bucket in MATCH_BUCKETS else -1
    if i < 0:
        return "match0"
    if i == len(MATCH_BUCKETS) - 1:
        return f"match{bucket}+"
    top = MATCH_BUCKETS[i + 1] - 1
    return f"match{bucket}" if top == bucket else f"match{bucket}-{top}"


def _alphas(alpha: float | Sequence[float], k: int) -> list[float]:
    return [float(alpha)] * k if isinstance(alpha, (int, float)) else [float(a) for a in alpha[:k]]


def expected_tokens(alpha: float | Sequence[float], k: int) -> float:
    """1 + a_1 + a_1 a_2 + ... + a_1 ... a_k: the tokens a round commits with k drafts, `alpha` the acceptance of
    each position (one number: the same for every position)."""
    return expected_tokens_upto(alpha, k)[-1]


def expected_tokens_upto(alpha: float | Sequence[float], k: int) -> list[float]:
    """expected_tokens(alpha, j) for j = 0..k (fewer where `alpha` holds fewer positions), in one pass."""
    totals, reach = [1.0], 1.0
    for a in _alphas(alpha, k):
        reach *= a
        totals.append(totals[-1] + reach)
    return totals


@dataclass(frozen=True)
class Load:
    """What the other requests bring to a step of the target (scheduler.py): `rows`, the widths of their asks that
    share its forwards; `apart`, the rows of the forwards they run alone in it (a prompt's next chunk), which
    commit no token."""

    rows: tuple[int, ...] = ()
    apart: tuple[int, ...] = ()


def best_length(
    alpha: float | Sequence[float],
    draft_s: float,
    verify_s,
    pending: int,
    max_k: int,
    load: Load = Load(),
    split: Callable[[list[int]], list[int]] | None = None,
    draft_step: Callable[[int], float] | None = None,
) -> tuple[int, float]:
    """k in 0..max_k maximising expected_tokens(alpha, k) / (k * draft_s + verify_s(pending + k)); (k, its
    tokens per second). Ties go to the shorter draft. `alpha`: one acceptance for every position, or one per
    position (then max_k is at most its length).

    Many requests at once (scheduler.py): `load.rows` = the rows each other request brings to this verification's
    step, `split` the forwards the model runs a step of these per-request widths as (llama.cpp's several sequences:
    equal rows of each per forward, Sequences.step_forwards; default one forward of them all). The step then
    costs S(widths) = the sum of verify_s over its forwards -- the cost table by rows -- plus A, the seconds of the
    forwards the others run alone in it (`load.apart`: a prompt's chunks, which commit nothing; they run in the
    target's steps, not in a draft model's).

    A model-free drafter's drafts take no step: its k maximises (their tokens + E(k)) / (S(theirs + [pending + k])
    + A), where a request's r rows commit what r - 1 drafts at this acceptance would, E(r - 1). Each extra row of
    mine slows every request in the step, so where rows cost compute (a CPU) a busy step drafts less.

    A draft model's drafts are steps: the Scheduler runs the draft models' asks first, so requests draft in the
    same steps and verify together (scheduler.py), while those that decode plainly (p of them: a last ask of one
    row) wait out the draft steps. The n - 1 others that drafted last round (rows > 1) decide by this same rule on
    the same shared acceptance, so k is theirs too:

        (n E(k) + p) / (k D(n) + S([pending + k] * n + [1] * p) + A)

    with D(n) = `draft_step(n)`, the draft model's step of n one-token rows (default: draft_s, whatever n). Beside
    requests that decode plainly a draft holds them back (a draft model rarely pays there); among requests that
    draft, where rows cost compute (a CPU) a verification of n(k + 1) rows can cost less per row than n-row plain
    steps do, and where rows are nearly free (a GPU's small forwards) they draft as one request alone would. A
    population that decodes plainly stays so: nobody's draft pays beside the others' plain rows.

    A round with many pending tokens (the prompt round) would make any draft look free next to its prefill, so
    there the drafts must pay for themselves at the margin: k maximises the seconds saved, (E(k) - 1) * c(1) -
    (c(pending + k) - c(pending)) - k * draft_s, against decoding those tokens one by one."""
    if not isinstance(alpha, (int, float)):
        max_k = min(max_k, len(alpha))
    shared, apart = (list(load.rows), load.apart) if pending == 1 else ([], ())

    def step(widths: list[int]) -> float:
        if split is None:
            return verify_s(sum(widths))  # one forward of them all
        return sum(verify_s(rows) for rows in split(widths))

    alone = sum(verify_s(rows) for rows in apart)
    together = draft_s > 0 and bool(shared)  # a draft model beside other requests: drafting in the same steps
    plain = [r for r in shared if r == 1] if together else []  # they wait out the draft steps
    n = 1 + len(shared) - len(plain)  # the requests that draft (their last rounds verified drafts) and mine
    others = len(plain) if together else sum(expected_tokens(alpha, min(r - 1, max_k)) for r in shared)
    draft_n = draft_step(n) if together and draft_step is not None else draft_s
    best, best_rate, best_saved = 0, -1.0, 0.0
    totals = expected_tokens_upto(alpha, max(0, max_k))
    for k in range(max(0, max_k) + 1):
        tokens = totals[k]
        if together:
            widths, tokens = [pending + k] * n + plain, n * tokens
        else:
            widths = shared + [pending + k]
        # the draft models' steps run first, and alone: the others' prompt chunks wait for the verification's step
        seconds = k * draft_n + step(widths) + alone
        rate = (others + tokens) / max(seconds, 1e-9)
        if pending > 1:
            saved = (tokens - 1) * verify_s(1) - (verify_s(pending + k) - verify_s(pending)) - k * draft_s
            if saved > best_saved + 1e-12:
                best, best_rate, best_saved = k, rate, saved
        elif rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best, best_rate


def catch_up_pays(catch_up_s: float, rate: float, plain_s: float, remaining: int | None) -> bool:
    """Whether feeding a draft model the tokens it has not seen (`catch_up_s` seconds, once) pays for itself:
    drafting at `rate` tokens per second instead of decoding plainly at `plain_s` seconds a token saves
    remaining * (plain_s - 1 / rate) seconds over the request's `remaining` tokens (None: unknown, assume it
    pays). A drafter that is no faster than plain decoding never pays."""
    if catch_up_s <= 0 or remaining is None:
        return True
    return rate > 0 and remaining * (plain_s - 1.0 / rate) > catch_up_s


@dataclass
class ForwardCost:
    """Seconds of one forward of a model by its width (tokens fed), from measurements: interpolated linearly
    between measured widths, extrapolated from the last two beyond them. The target's (verification) and a draft
    model's (its catch-up and its drafts)."""

    seconds: dict[int, float] = field(default_factory=dict)

    def __call__(self, width: int) -> float:
        measured = self.seconds.get(width)
        if measured is not None:
            return measured
        widths = sorted(self.seconds)
        if not widths:
            return 1.0  # nothing measured: every width costs the same (drafting is free)
        if len(widths) == 1:
            return self.seconds[widths[0]] * max(width, 1) / widths[0]
        i = bisect.bisect_left(widths, width)
        lo, hi = (
            (widths[0], widths[1])
            if i == 0
            else (widths[-2], widths[-1])
            if i == len(widths)
            else (widths[i - 1], widths[i])
        )
        slope = (self.seconds[hi] - self.seconds[lo]) / (hi - lo)
        return max(self.seconds[lo] + slope * (width - lo), 1e-6)

    @property
    def measured(self) -> bool:
        return bool(self.seconds)

    def observe(self, width: int, seconds: float) -> float:
        """A measured forward of `width` tokens. Its own estimate moves toward it, and every other width's by the
        same factor (the shape measured at start-up, the level of now): a long context makes every width
        slower, and a rule that saw only 1-token rounds at 2,000 tokens of context must not price a 5-token
        verification at its start-up (32-token context) cost. Returns that factor (1.0: nothing moved)."""
        if width > OBSERVED_WIDTHS:  # a prompt: its cost says nothing about verification widths
            return 1.0
        predicted = self(width) if self.seconds else seconds
        old = self.seconds.get(width)
        level = 1 + COST_EMA * (seconds / predicted - 1) if predicted > 0 else 1.0
        self.rescale(level)
        self.seconds[width] = seconds if old is None else (1 - COST_EMA) * old + COST_EMA * seconds
        return level

    def rescale(self, level: float) -> None:
        """Every width by `level`: another model's forwards on the same cores and context moved so (a draft model
        that has not run lately follows its target's level, DraftPolicy.observe)."""
        for w in self.seconds:
            self.seconds[w] *= level

    @classmethod
    def measure(cls, model, widths, context: int = 32, repeats: int = 2, last_only: bool = False) -> ForwardCost:
        """Time forwards of each width after a `context`-token prefix; the model's cache is left empty. `last_only`:
        each forward asks for its last row's logits only, as a draft model's catch-ups and drafts do (a verification
        reads every row's, and on a 150k vocabulary the output matrix is a large share of a wide forward). A forward
        that took under REPEAT_UNDER_S seconds is timed again, up to `repeats` times, and the fastest kept (a short
        forward is the one a stray interruption distorts most); a longer one once (it is start-up time, and the
        rule rescales every width by what the rounds measure, `observe`). A GPU is waited for before each clock read (a
        forward returns once queued). In a small context (max_context 24) the prefix is shorter and widths that would
        not fit are left out (the rule extrapolates; no round can verify more than the context holds)."""
        room = getattr(model, "max_context", None) or context + max(widths)
        widths = [w for w in widths if w < room] or [1]
        context = max(1, min(context, room - max(widths)))
        tokens = [i % max(model.vocab_size, 1) for i in range(context + max(widths))]
        device = getattr(model, "device", None)  # llama.cpp, simulated and remote models return when done
        model.rollback(0)
        model.forward(tokens[:context], last_n=1)
        cost = cls()
        for width in sorted(set(widths)):
            best = float("inf")
            for _ in range(repeats):
                sync(device)
                start = time.perf_counter()
                model.forward(tokens[context : context + width], last_n=1 if last_only else width)
                sync(device)
                best = min(best, time.perf_counter() - start)
                model.rollback(context)
                if best >= REPEAT_UNDER_S:
                    break
            cost.seconds[width] = best
        model.rollback(0)
        return cost


# A draft model's chain under the rule stops by the draft's confidence (ChainStop): its acceptance is kept by the
# top probability of the distribution each draft is drawn from, in these buckets (a bucket's prior: its middle)
CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.995, 1.0)
CONFIDENCE_BASE = 1  # bucket ids of a draft model's confidence buckets start here (bucket 0: every position)


def confidence_bucket(m: float) -> int:
    """The acceptance bucket of a draft drawn from a distribution whose top probability is m."""
    return CONFIDENCE_BASE + min(bisect.bisect_right(CONFIDENCE_EDGES, m) - 1, len(CONFIDENCE_EDGES) - 2)


def confidence_prior(bucket: int) -> float:
    """A confidence bucket's prior acceptance: its middle (a draft as sure as the target is as often right)."""
    b = bucket - CONFIDENCE_BASE
    return (CONFIDENCE_EDGES[b] + CONFIDENCE_EDGES[b + 1]) / 2


@dataclass
class ChainStop:
    """Where a draft model's chain stops, token by token (the round's k* only decides that it drafts). Drafting
    the chain's token j, whose distribution is known (the forward after token j - 1 gave it), adds
    P_{j-1} a(m_j) expected tokens for the verification's wider forward, c(w + j + 1) - c(w + j); computing the
    next distribution adds one draft step more. Each is worth it where its expected tokens per second beat the
    round's rate R (the rule's best rate for this round, what the time could buy otherwise: Dinkelbach's
    criterion for a ratio of expectations), over the best of the horizons still open (a CPU's cost by width has
    steps: one row more can cost more than several after it):

        include j   P_{j-1} a(m_j) (1 + E_n) >= R (c(w + j + 1 + n) - c(w + j) + n d)     for some n >= 0
        feed j      P_j E_n >= R (c(w + j + 1 + n) - c(w + j + 1) + n d)                  for some n >= 1

    with P_j = a(m_1) ... a(m_j), a(m) the acceptance measured for drafts of confidence m (confidence_bucket),
    E_n = a + a^2 + ... + a^n the drafts after it at a, the draft's acceptance at any position (their confidence is
    not known yet), and n up to the chain's limit. The first draft is always included: k* > 0 chose it. A draft
    the model is sure of is nearly always right, one it doubts often wrong: a long chain where the text is
    predictable, a short one where it is not, at one k*.

    Only the draft's own distributions (functions of the prefix and of the drafts before) and past rounds decide,
    never the token about to be drawn, so acceptance stays exact (the q contract)."""

    accept_rate: Callable[[float], float]  # a(m)
    mean: float  # a_mean
    rate: float  # R, tokens per second
    verify_s: Callable[[int], float]  # c(n)
    draft_s: float  # d
    pending: int = 1  # w
    limit: int = 1  # the chain's most drafts
    reach: float = 1.0  # P_j of the drafts included so far

    def include(self, j: int, m: float) -> bool:
        a = self.accept_rate(m)
        if j > 0 and not self._pays(self.reach * a, self.pending + j, j + 1, with_draft=True):
            return False
        self.reach *= a
        return True

    def feed(self, j: int) -> bool:
        return self._pays(self.reach, self.pending + j + 1, j + 1, with_draft=False)

    def _pays(self, reach: float, width: int, drafted: int, with_draft: bool) -> bool:
        """Whether `reach` times (1 + a + ... + a^n with the draft, a + ... + a^n without) tokens pay R times what
        a verification `width` rows wide grows by for them (n draft steps), for some n (n >= 1 without the draft)
        that keeps the chain's `drafted` drafts and the n within the limit."""
        first = int(with_draft)
        base, tokens, gain = self.verify_s(width), float(first), 1.0
        for n in range(1 - first, self.limit - drafted + 1):
            if n:
                gain *= self.mean
                tokens += gain
            grown = self.verify_s(width + first + n) - base
            if reach * tokens >= self.rate * (grown + n * self.draft_s):
                return True
        return False


CALIBRATE_EVERY_WIDTH = 9  # widths measured one by one at start-up (one past an 8-row tile)
CALIBRATE_BLOCK = 16  # beyond: both sides of each edge of this many rows, and every CALIBRATE_BLOCK // 2


def calibration_widths(max_k: int, pending: int = 1) -> list[int]:
    """Widths measured at start-up: every width up to CALIBRATE_EVERY_WIDTH, then the rows either side of each
    multiple of CALIBRATE_BLOCK and every half block, up to pending + max_k; the others are interpolated and then
    refined by the rounds that verify them (ForwardCost.observe keeps each width it sees). A CPU's cost by width
    need not be smooth: llama.cpp's AVX-512 kernels take activations in 16-row blocks, so a 16-token forward can
    cost less than a 15-token one, which an interpolation across the edge would miss
    (benchmarks/llamacpp_forward_widths.py prints the cost of every width). The wide widths are most of the start-up
    timing, so only these of them are timed."""
    top = pending + max_k
    edges = {CALIBRATE_BLOCK - 1, 0, 1, CALIBRATE_BLOCK // 2}  # w % CALIBRATE_BLOCK of the widths timed beyond
    beyond = {w for w in range(CALIBRATE_EVERY_WIDTH + 1, top + 1) if w % CALIBRATE_BLOCK in edges}
    return sorted(set(range(1, min(top, CALIBRATE_EVERY_WIDTH) + 1)) | beyond | {top})


# a draft model's widths measured at start-up (its last row's logits only: ForwardCost.measure's last_only): one-token
# drafts, tree levels, and catch-ups; a prompt's catch-up (hundreds of tokens) is extrapolated from the last two,
# and on llama.cpp's prompt kernels (tinyBLAS) a forward of 16 costs less per token than a prompt does, so 64 is
# timed too (benchmarks/draft_kernels.py prints what each width costs)
DRAFT_WIDTHS = (1, 2, 4, 8, 16, 64)


@dataclass
class Acceptance:
    """Decayed counts of judged and accepted drafts: a = (accepted + 1) / (judged + 2). One per drafter and
    position bucket; a model drafter's also holds its probing state."""

    judged: float = 0.0
    accepted: float = 0.0
    plain_rounds: int = 0  # consecutive rounds without drafting (model drafters)
    probe_after: int = PROBE_START
    trial_k: int = 1  # a model drafter's next trial length (doubles while all accepted)
    tried: bool = False  # its trial is over: TRIAL_JUDGED drafts judged (never faded back)

    def __post_init__(self) -> None:
        self.tried = self.tried or self.judged >= TRIAL_JUDGED

    @property
    def alpha(self) -> float:
        return self.posterior(0.5)

    def posterior(self, prior: float) -> float:
        """The acceptance estimate with a prior of mean `prior` worth PRIOR_WEIGHT judged drafts."""
        return (self.accepted + PRIOR_WEIGHT * prior) / (self.judged + PRIOR_WEIGHT)

    def lower(self, prior: float) -> float:
        """The estimate the rule drafts by: the posterior mean less LOWER_Z of its standard deviation, so a bucket
        judged a few times (or only through its prior) must look clearly good before drafts in it are bet on."""
        mean = self.posterior(prior)
        return max(0.0, mean - LOWER_Z * math.sqrt(mean * (1.0 - mean) / (self.judged + PRIOR_WEIGHT)))

    def observe(self, judged: int, accepted: int) -> None:
        """One round: `judged` of this bucket's drafts were judged, `accepted` of them accepted."""
        self.judged = DECAY * self.judged + judged
        self.accepted = DECAY * self.accepted + accepted
        self.tried = self.tried or self.judged >= TRIAL_JUDGED

    def fade(self) -> None:
        """A new request: keep a quarter of the evidence, so what held for the last text (copying) must be seen
        again in this one before it drives long drafts (it comes back within a few rounds if it still holds)."""
        self.judged *= FADE
        self.accepted *= FADE
