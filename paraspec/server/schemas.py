"""Request bodies of the OpenAI API as paraspec serves them (pydantic models, checked before anything queues).

Served: `n` (1..MAX_N choices per prompt), a list of prompts on /v1/completions, and on chat `tools`,
`tool_choice` "auto"/"none", `parallel_tool_calls`, assistant messages with `tool_calls` and `tool` messages.
A value paraspec cannot honour is refused with a message naming the field and the fix, never ignored: `logprobs`,
`logit_bias`, `response_format` and the other parameters in UNSUPPORTED, penalties other than 0, a `tool_choice`
that forces a call ("required", a named function: that needs constrained decoding), unknown parameters, roles other
than system/developer/user/assistant/tool. Integers are strict (`max_tokens: 5.5` or `"5"` is an error, not 5).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

# parameters of the OpenAI API that paraspec does not implement: a request that sets them gets a 400 saying so
UNSUPPORTED = (
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "tools",  # on /v1/completions; chat takes them (ChatCompletionRequest)
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
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
MAX_N = 16  # choices per prompt: each is a generation of its own in the queue


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
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise UnsupportedParameter(
                "n", f"n must be between 1 and {MAX_N} (choices per prompt), got {self.n}; send several requests"
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

    def choices_per_prompt(self) -> int:
        return self.n or 1


class CompletionRequest(_Sampling):
    # a string, token ids, or a list of either (several prompts: n choices each, in prompt order)
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]

    @field_validator("prompt")
    @classmethod
    def _prompts_not_empty(cls, value):
        if not value:
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and isinstance(value[0], (str, list)):
            empty = [i for i, prompt in enumerate(value) if not prompt]
            if empty:
                raise ValueError(f"prompt {empty[0]} of the list is empty")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or the list it sent."""
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list)):
            return list(self.prompt)  # type: ignore[arg-type]
        return [self.prompt]  # type: ignore[list-item]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr
    arguments: StrictStr  # JSON, as the model wrote it (OpenAI's form)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. "name": accepted, not used by the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None  # None: only an assistant message with tool_calls
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # a tool message: the call it answers

    def as_template_message(self) -> dict:
        """The message as chat templates read it: text content, a call's arguments as an object (Qwen's template
        writes them with `tojson`, so a JSON string would be quoted twice; vLLM parses them too)."""
        content = "".join(p.text for p in self.content) if isinstance(self.content, list) else self.content or ""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _json(c.function)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _json(function: FunctionCall) -> Any:
    try:
        return json.loads(function.arguments)
    except ValueError:
        return function.arguments  # not JSON: the template gets the text as it came


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, passed to the chat template as it is
    strict: StrictBool | None = None

    @field_validator("strict")
    @classmethod
    def _not_strict(cls, value):
        if value:
            raise ValueError(
                "strict: true needs constrained decoding (arguments forced to match the schema), which paraspec "
                "serve does not have yet; drop it"
            )
        return value


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None  # "auto" (the default with tools) or "none"
    parallel_tool_calls: StrictBool = True  # false: the first call only

    @field_validator("messages")
    @classmethod
    def _messages_complete(cls, messages):
        for i, m in enumerate(messages):
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise UnsupportedParameter(f"messages[{i}].content", f"'messages[{i}].content' is required")
            if m.role == "tool" and m.tool_call_id is None:
                raise UnsupportedParameter(
                    f"messages[{i}].tool_call_id",
                    f"'messages[{i}].tool_call_id' is required: a tool message answers the call with that id",
                )
            if m.tool_calls and m.role != "assistant":
                raise UnsupportedParameter(f"messages[{i}].tool_calls", "only an assistant message has tool_calls")
        return messages

    @model_validator(mode="after")
    def _tool_choice_served(self):
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none"):
            return self
        if choice == "required" or isinstance(choice, dict):
            raise UnsupportedParameter(
                "tool_choice",
                f"tool_choice {json.dumps(choice)} forces a tool call, which needs constrained decoding; paraspec "
                f"serve does not have it yet: use 'auto' (the model decides) or 'none'",
            )
        raise UnsupportedParameter("tool_choice", f"tool_choice must be 'auto' or 'none', got {choice!r}")

    def new_token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_tools(self) -> list[dict] | None:
        """The tools the chat template gets: none with tool_choice 'none' (paraspec cannot forbid a call while
        decoding, so the model is not told of tools it may not call: vLLM's --exclude-tools-when-tool-choice-none)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: Any = None) -> dict:
    """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
