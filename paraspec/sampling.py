"""Sampling parameters and the pure functions that turn logits into the distribution we sample from.

Every strategy samples the target through `logits_to_probs`; speculative strategies sample the draft through the
same function, and the probabilities it returns are exactly the q that acceptance divides by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request; checked when built and immutable after (dataclasses.replace() builds a new,
    checked one), so a value cannot change between the check and its use."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_new_tokens: int = 128
    seed: int | None = None  # 0 .. 2**64 - 1 (torch.Generator's range); None: a fresh seed per request
    stop_token_ids: tuple[int, ...] | None = None  # in addition to the model's EOS ids (a list is taken too)
    stop: tuple[str, ...] | None = None  # stop strings: the text ends before the first one (a str is taken too)

    def __post_init__(self):
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and not (
            isinstance(self.seed, int) and not isinstance(self.seed, bool) and 0 <= self.seed < 2**64
        ):
            raise ValueError(f"seed must be an integer in 0 .. 2**64 - 1 or None, got {self.seed!r}")
        if self.stop_token_ids is not None:
            stop = self.stop_token_ids
            stop = (stop,) if isinstance(stop, int) else tuple(stop) if isinstance(stop, (list, tuple)) else None
            if stop is None or not all(isinstance(t, int) and t >= 0 for t in stop):
                raise ValueError(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}")
            object.__setattr__(self, "stop_token_ids", stop)
        if self.stop is not None:
            stop = (
                (self.stop,)
                if isinstance(self.stop, str)
                else tuple(self.stop)
                if isinstance(self.stop, (list, tuple))
                else None
            )
            if stop is None or not all(isinstance(s, str) and s for s in stop):
                raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
            object.__setattr__(self, "stop", stop or None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed distribution for each row of `logits` ([..., vocab]): temperature, then top-k, then top-p.

    Greedy (temperature 0) returns the one-hot of the argmax, so greedy decoding is the limit of sampling and
    the acceptance code needs no special case to stay exact.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the top token always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Draw one token id from a 1-D vector of probabilities (or weights: it need not sum to 1).

    Inverse CDF: the first token whose running sum (float64) exceeds u x the total, u uniform in [0, 1) from
    `generator`; a token of probability 0 is never drawn (its running sum equals its predecessor's). Exact as
    torch.multinomial is, and cheaper on a real vocabulary (timed in docs/results/, "Costs around the
    kernels").

    `generator` is a CPU generator (make_generator) wherever `probs` are: u is drawn on the CPU and searched for
    as a number, so one seed gives the same token on every device. On a GPU this reads back twice (the total
    and the minimum in one transfer, then the index): the index is needed as an int anyway."""
    cdf = probs.reshape(-1).double().cumsum(0)
    if not len(cdf):
        raise ValueError("cannot sample from an empty vector of probabilities")
    total, smallest = torch.stack((cdf[-1], probs.min().double())).tolist()
    if not (total > 0 and math.isfinite(total)) or smallest < 0:
        raise ValueError(
            f"cannot sample from these probabilities (sum {total}, min {smallest}): "
            f"they must be finite, >= 0 and not all 0"
        )
    u = torch.rand((), dtype=torch.float64, generator=generator, device="cpu").item()
    i = int(torch.searchsorted(cdf, u * total, right=True))
    if i >= len(cdf):  # u x total rounded up to the total: the last token with mass
        i = int(torch.nonzero(probs.reshape(-1))[-1])
    return i


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """The target's own token from one row of logits: its argmax (greedy) or a draw from the processed p."""
    if params.greedy:
        return int(logits.argmax())
    return sample(logits_to_probs(logits, params), generator)


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed % 2**64 if seed is not None else torch.seed())  # derived seeds (seed + 1) wrap around
    return g
