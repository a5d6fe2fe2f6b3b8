"""A request as the Engine receives it, checked and made ready to decode: its parameters refused where this
Engine's strategy cannot honour them (RefusedParameter, naming the fix; the server calls it before queueing), its
prompt encoded, its stop conditions and grammar set -- the RequestState a strategy decodes (request_state.py)."""

from __future__ import annotations

from paraspec.errors import RefusedParameter
from paraspec.prompts import encode_prompt, stop_string_check
from paraspec.request_state import RequestState
from paraspec.sampling import PROCESSOR_PARAMS, SamplingParams, make_generator
from paraspec.strategies.registry import STRATEGIES
from paraspec.structured import GrammarMatcher

# why a strategy without the capability refuses a request's parameter (check_params)
REFUSALS = {
    "processors": "does not apply logit_bias or penalties; drop them",
    "logprobs": "does not report logprobs; drop logprobs",
    "structured": "does not apply structured outputs; drop structured",
}


def check_params(params: SamplingParams, strategy, tokenizer, vocab_size: int) -> None:
    """Refuse what an Engine cannot honour: a logit bias, a penalty, logprobs or a structured output where the
    strategy does not apply it, a structured output without a tokenizer, a bias beyond the target's ids."""
    asked = {  # the strategy's capability -> the parameter that asks for it (None: not asked)
        "processors": next((n for n in PROCESSOR_PARAMS if getattr(params, n) != getattr(SamplingParams, n)), None),
        "logprobs": next((n for n in ("logprobs", "prompt_logprobs") if getattr(params, n) is not None), None),
        "structured": "structured" if params.structured is not None else None,
    }
    for capability, param in asked.items():
        if param is not None and not getattr(strategy.caps, capability):
            accepting = ", ".join(name for name, cls in STRATEGIES.items() if getattr(cls.caps, capability))
            raise RefusedParameter(
                param, f"strategy {strategy.name!r} {REFUSALS[capability]} or use one of {accepting}"
            )
    if params.structured is not None and tokenizer is None:
        raise RefusedParameter(
            "structured",
            "structured outputs need the target's tokenizer (its grammar is matched on token text), and this "
            "checkpoint has none; pass a checkpoint folder with its tokenizer files",
        )
    if params.logit_bias is not None and params.logit_bias[-1][0] >= vocab_size:
        raise RefusedParameter(
            "logit_bias",
            f"logit_bias names token {params.logit_bias[-1][0]}, but the target's vocabulary has {vocab_size} ids",
        )


def new_run(
    prompt, params: SamplingParams | None, strategy, tokenizer, max_context: int, record_margins: bool = False
) -> RequestState:
    """The checked request: its prompt (a str, token ids or chat messages) encoded, its stop tokens (the target's
    end-of-sequence ids and the request's), its generator, stop strings and grammar (compiled once per tokenizer,
    kind and spec; this request's state)."""
    params = params or SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError("params must be a paraspec.SamplingParams")
    target = strategy.target
    check_params(params, strategy, tokenizer, target.vocab_size)
    stop = frozenset(target.eos_token_ids) | frozenset(params.stop_token_ids or ())
    grammar = None
    if params.structured is not None:
        grammar = GrammarMatcher.for_request(tokenizer, params.structured, target.vocab_size, stop)
    return RequestState(
        prompt_ids=encode_prompt(prompt, tokenizer, target.vocab_size, max_context),
        params=params,
        stop_ids=stop,
        generator=make_generator(params.seed),
        max_context=max_context,
        margins={} if record_margins else None,
        stop_check=stop_string_check(tokenizer, params.stop) if params.stop else None,
        grammar=grammar,
    )
