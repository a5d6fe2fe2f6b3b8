"""Prompts in, text out: what the Engine does with a tokenizer.

    encode_prompt      a str (raw text, no template), token ids, or chat messages (the chat template applied) ->
                       token ids, checked against the vocabulary and the context
    stop_string_check  RequestState.commit's test for stop strings (decodes only the last tokens)
    output_text        a run's text: without a final stop token, cut before a stop string

A tokenizer is None for a weights-only checkpoint: token-id prompts still work, everything that needs text says so.
"""

from __future__ import annotations

from collections.abc import Callable

from paraspec.request_state import RequestState


def require_tokenizer(tokenizer, what: str):
    """The tokenizer, or a ValueError saying that `what` needs one."""
    if tokenizer is None:
        raise ValueError(
            f"the target checkpoint has no tokenizer, so {what} cannot be encoded; pass a list of token ids"
        )
    return tokenizer


def encode_prompt(prompt, tokenizer, vocab_size: int, max_context: int, tools: list[dict] | None = None) -> list[int]:
    """A str (raw text, no template), a list of token ids, or chat messages (chat template applied, with `tools`:
    OpenAI-style function definitions the template renders), as token ids that fit the vocabulary and leave room in
    the context for at least one new token."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        ids = require_tokenizer(tokenizer, "a text prompt").encode(prompt, add_special_tokens=False)
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        ids = _apply_chat_template(require_tokenizer(tokenizer, "chat messages"), prompt, tools)
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    else:
        raise ValueError(
            "prompt must be a non-empty str, list of token ids, or list of chat messages "
            "({'role': ..., 'content': ...})"
        )
    if not ids:
        raise ValueError("the prompt encodes to zero tokens")
    if len(ids) >= max_context:
        raise ValueError(
            f"the prompt has {len(ids)} tokens but the context holds {max_context}; shorten the "
            f"prompt or create the engine with a larger max_context"
        )
    return ids


def _apply_chat_template(tokenizer, messages, tools: list[dict] | None = None) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; pass a plain string prompt (no --chat)")
    for m in messages:
        if "role" not in m or ("content" not in m and "tool_calls" not in m):
            raise ValueError(f"chat message {m!r} needs 'role' and 'content'")
    ids = tokenizer.apply_chat_template(list(messages), tools=tools, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def decode_text(tokenizer, token_ids: list[int]) -> str:
    """The text of token ids, special tokens skipped ("" without a tokenizer)."""
    if tokenizer is None:
        return ""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def stop_string_check(tokenizer, stop: tuple[str, ...]) -> Callable[[list[int]], str | None]:
    """RequestState.commit's test for stop strings: decode only the last tokens (enough for the longest stop string
    even at one byte per token), so that the check per committed token stays short."""
    require_tokenizer(tokenizer, "stop strings")
    window = 4 * max(map(len, stop)) + 4

    def check(tokens: list[int]) -> str | None:
        tail = decode_text(tokenizer, tokens[-window:])
        return next((s for s in stop if s in tail), None)

    return check


def output_text(tokenizer, run: RequestState, decoder=None) -> str:
    """The output text of a run: without a final stop token, and cut before a stop string. `decoder` (a
    text_stream.IncrementalText) decodes only what is new since its last call: a stream asks after every commit."""
    decode = decoder.of if decoder is not None else lambda tokens: decode_text(tokenizer, tokens)
    if run.stop_string is not None:
        text = decode(run.tokens)
        return text[: min((i for s in run.params.stop or () if (i := text.find(s)) >= 0), default=len(text))]
    return decode(run.tokens[:-1] if run.finish_reason == "stop" else run.tokens)
