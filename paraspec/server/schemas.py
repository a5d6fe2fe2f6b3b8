"""Request bodies of the OpenAI API as paraspec serves them (pydantic models, checked before anything queues).

A value paraspec cannot honour is refused with a message naming the field and the fix, never ignored: `n` > 1,
`logprobs`, `tools` and the other parameters in UNSUPPORTED, unknown parameters, roles other than
system/developer/user/assistant. Integers are strict (`max_tokens: 5.5` or `"5"` is an error, not 5).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

# parameters of the OpenAI API that paraspec does not implement: a request that sets them gets a 400 saying so
UNSUPPORTED = (
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "response_format",
    "best_of",
    "echo",
    "suffix",
    "audio",
    "modalities",
    "prediction",
    "reasoning_effort",
    "web_search_options",
)
IGNORED = ("user", "metadata", "store", "service_tier")  # bookkeeping fields that change no output


class UnsupportedParameter(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    """The parameters both endpoints share."""

    model_config = ConfigDict(extra="allow")  # checked in _refuse_extras, to name what is not supported

    model: StrictStr
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1)  # vLLM's extension: -1 or 0 = off
    seed: StrictInt | None = Field(None, ge=0, lt=2**64)
    max_tokens: StrictInt | None = Field(None, ge=1)
    stop: StrictStr | list[StrictStr | StrictInt] | None = None  # token ids: an extension
    stop_token_ids: list[StrictInt] | None = None  # vLLM's extension
    n: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    return_token_ids: StrictBool = False  # vLLM's extension: choices[].token_ids

    @model_validator(mode="after")
    def _refuse_extras(self):
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED:
                continue
            if name in UNSUPPORTED:
                if value in (None, False, [], {}) or (name == "logprobs" and value == 0):
                    continue  # the default value asks for nothing
                raise UnsupportedParameter(name, f"'{name}' is not supported by paraspec serve; drop it")
            raise UnsupportedParameter(
                name, f"unknown parameter '{name}'; paraspec serve takes {', '.join(sorted(self.model_fields))}"
            )
        if self.n is not None and self.n != 1:
            raise UnsupportedParameter(
                "n",
                f"n must be 1 (paraspec serve returns one choice per request), got "
                f"{self.n}; send several requests instead",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise UnsupportedParameter(
                    name,
                    f"'{name}' is not supported by paraspec serve (lossless "
                    f"speculation samples the model's own distribution); drop it or "
                    f"pass 0",
                )
        if self.stream_options is not None and not self.stream:
            raise UnsupportedParameter("stream_options", "stream_options applies only with stream: true")
        return self

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value):
        if value is None:
            return value
        items = [value] if isinstance(value, str) else value
        if any(item == "" for item in items):
            raise ValueError("stop strings must be non-empty")
        if any(isinstance(item, int) and item < 0 for item in items):
            raise ValueError("stop token ids must be >= 0")
        return value

    def stop_strings(self) -> list[str]:
        items = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in items if isinstance(s, str)]

    def stop_ids(self) -> list[int]:
        items = [] if isinstance(self.stop, str) or self.stop is None else self.stop
        return [t for t in items if isinstance(t, int)] + list(self.stop_token_ids or [])

    def new_token_limit(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_Sampling):
    # a string, token ids, or a batch of one of them (the openai client sends either form)
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError(
                    f"paraspec serve takes one prompt per request, got {len(value)}; send one request per prompt"
                )
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. "name": accepted, not used by the template
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]

    def as_template_message(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)

    def new_token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: Any = None) -> dict:
    """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
