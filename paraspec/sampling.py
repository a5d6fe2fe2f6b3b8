"""Sampling parameters and the pure functions that turn logits into the distribution we sample from.

One processor chain, in this order (vLLM's): `adjust_logits` (logit bias, then the repetition, frequency and
presence penalties: functions of the tokens before each row), then `logits_to_probs` (temperature, min-p, top-k,
top-p). Every strategy samples the target through it; speculative strategies sample the draft through the same
chain on the draft's own context, and the probabilities it returns are exactly the q that acceptance divides by.
Greedy decoding takes the argmax of the adjusted logits, so a penalty or a bias changes greedy output alike for
every strategy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

PROCESSOR_PARAMS = ("logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty")  # adjust_logits'
MAX_LOGPROBS = 20  # the most alternatives a token's logprobs list (OpenAI's top_logprobs limit)


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
    presence_penalty: float = 0.0  # OpenAI's: subtracted from the logit of every token already in the output
    frequency_penalty: float = 0.0  # OpenAI's: times the number of times a token is already in the output
    repetition_penalty: float = 1.0  # HF's and vLLM's: a token in the prompt or output: logit / r if > 0, else * r
    min_p: float = 0.0  # drop tokens whose probability is below min_p times the most likely token's (0 = off)
    logit_bias: tuple[tuple[int, float], ...] | None = None  # (token id, bias) pairs, sorted (a dict is taken too)
    logprobs: int | None = None  # the target's log-probability of each token and of its N likeliest (None = off)
    prompt_logprobs: int | None = None  # the same for each prompt token given the ones before it (vLLM's name)
    # structured output, (kind, spec): ("json_object", ""), ("json_schema", schema as JSON text or a dict),
    # ("regex", pattern), ("grammar", a Lark grammar); the target's rows masked to it (paraspec/structured.py)
    structured: tuple[str, str] | None = None

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
        self._check_processors()
        if self.structured is not None:
            from paraspec.structured import check_structured

            object.__setattr__(self, "structured", check_structured(self.structured))

    def _check_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_number(value) and -2 <= value <= 2):
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off), got {value!r}")
        if not (_is_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a number > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_LOGPROBS
            ):
                raise ValueError(f"{name} must be an integer in 0 .. {MAX_LOGPROBS} or None, got {value!r}")
        if not (_is_number(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if self.logit_bias is not None:
            bias = self.logit_bias
            pairs = bias.items() if isinstance(bias, dict) else bias if isinstance(bias, (list, tuple)) else None
            try:
                checked = tuple(sorted((int(token), float(value)) for token, value in pairs or ()))
                ok = pairs is not None and all(
                    isinstance(token, int) and not isinstance(token, bool) and token >= 0 for token, _ in pairs
                )
            except (TypeError, ValueError):
                ok = False
            if not ok or not all(-100 <= value <= 100 for _, value in checked):
                raise ValueError(
                    f"logit_bias must map token ids (integers >= 0) to biases in [-100, 100], got {self.logit_bias!r}"
                )
            if len({token for token, _ in checked}) != len(checked):
                raise ValueError(f"logit_bias names a token twice: {self.logit_bias!r}")
            object.__setattr__(self, "logit_bias", checked or None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_history(self) -> bool:
        """Whether a row's distribution depends on the tokens before it (a penalty is on)."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether `adjust_logits` changes anything (a penalty or a logit bias)."""
        return self.uses_history or self.logit_bias is not None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def adjust_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    row_tokens: Sequence[int] = (),
) -> torch.Tensor:
    """The logits of each row after the logit bias and the penalties ([rows, vocab] or [vocab]).

    Row i is the distribution after `prompt`, `output` and `row_tokens[:i]` (a verification's rows: the drafts
    before each position; one row: nothing more). Frequency and presence penalties count the output (the
    generated tokens, as OpenAI and vLLM count them), the repetition penalty the prompt and the output. Returns
    `logits` itself when nothing applies, so requests without processors compute what they always did."""
    if not params.adjusts_logits:
        return logits
    one_row = logits.dim() == 1
    rows = logits.float().reshape(-1, logits.shape[-1]).clone()
    n, vocab = rows.shape
    if params.logit_bias is not None:
        tokens = [token for token, _ in params.logit_bias]
        if max(tokens) >= vocab:
            raise ValueError(f"logit_bias names token {max(tokens)}, but the vocabulary has {vocab} tokens")
        rows[:, tokens] += torch.tensor([bias for _, bias in params.logit_bias], device=rows.device)
    if params.uses_history:
        counts = _output_counts(output, row_tokens[: n - 1], n, vocab, rows.device)
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            if len(prompt):
                seen[:, torch.as_tensor(list(prompt), device=rows.device)] = True
            penalised = torch.where(rows > 0, rows / params.repetition_penalty, rows * params.repetition_penalty)
            rows = torch.where(seen, penalised, rows)
        rows -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return rows[0] if one_row else rows


def _output_counts(output: Sequence[int], row_tokens: Sequence[int], rows: int, vocab: int, device) -> torch.Tensor:
    """[rows, vocab]: how often each token occurs in the output before each row."""
    counts = torch.zeros(vocab, device=device)
    if len(output):
        counts += torch.bincount(torch.as_tensor(list(output)), minlength=vocab)[:vocab].to(device)
    counts = counts.expand(rows, vocab).clone()
    for i, token in enumerate(row_tokens):
        counts[i + 1 :, token] += 1
    return counts


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed distribution for each row of `logits` ([..., vocab]; adjusted first where the request has a
    bias or a penalty: `adjust_logits`): temperature, then min-p, then top-k, then top-p.

    Greedy (temperature 0) returns the one-hot of the argmax, so greedy decoding is the limit of sampling and
    the acceptance code needs no special case to stay exact.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
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
