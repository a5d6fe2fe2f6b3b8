"""Request bodies of the OpenAI API as paraspec serves them (pydantic models, checked before anything queues).

Served: `n` (1..MAX_N choices per prompt), a list of prompts on /v1/completions, `logprobs` (chat: with
`top_logprobs`; completions: a count, and `echo` with the prompt's), `presence_penalty`, `frequency_penalty`,
`logit_bias`, `response_format` (json_object, json_schema), vLLM's `repetition_penalty`, `min_p`, `guided_json`,
`guided_regex`, `guided_grammar` and `structured_outputs`, and on chat `tools` (`strict` ones too), `tool_choice`
("auto", "none", "required", a named function), `parallel_tool_calls`, assistant messages with `tool_calls` and
`tool` messages.
A value paraspec cannot honour is refused with a message naming the field and the fix, never ignored: the
parameters in UNSUPPORTED, unknown parameters, a `tool_choice` that forces a call without tools or names a function
that is not offered, roles other than system/developer/user/assistant/tool. Integers are strict (`max_tokens: 5.5`
or `"5"` is an error, not 5).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

# parameters of the OpenAI API that paraspec does not implement: a request that sets them gets a 400 saying so
UNSUPPORTED = (
    "top_logprobs",  # on /v1/completions (a chat parameter)
    "echo",  # on chat (a completions parameter)
    "tools",  # on /v1/completions; chat takes them (ChatCompletionRequest)
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "best_of",
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
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)  # vLLM's extension (1 = off)
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM's extension (0 = off)
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | StrictStr | None = None  # vLLM's extensions: one constraint at a time
    guided_regex: StrictStr | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's newer form: {"json": ...} | {"regex": ...} | ...
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
        self.structured()  # one constraint at most, of a known kind
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

    def bias(self) -> dict[int, float] | None:
        """logit_bias with integer token ids (JSON keys are strings)."""
        if not self.logit_bias:
            return None
        try:
            return {int(token): value for token, value in self.logit_bias.items()}
        except ValueError:
            raise UnsupportedParameter(
                "logit_bias", f"logit_bias keys must be token ids, got {sorted(self.logit_bias)!r}"
            ) from None

    def structured(self) -> tuple[str, str] | None:
        """The request's structured output as SamplingParams.structured's (kind, spec): from response_format or
        vLLM's guided_* / structured_outputs; more than one is refused."""
        asked: list[tuple[str, tuple[str, str]]] = []
        if self.response_format is not None and self.response_format.type != "text":
            asked.append(("response_format", self.response_format.structured()))
        if self.guided_json is not None:
            asked.append(("guided_json", ("json_schema", _schema_text(self.guided_json))))
        if self.guided_regex is not None:
            asked.append(("guided_regex", ("regex", self.guided_regex)))
        if self.guided_grammar is not None:
            asked.append(("guided_grammar", ("grammar", self.guided_grammar)))
        if self.structured_outputs:
            asked.append(("structured_outputs", _structured_outputs(self.structured_outputs)))
        if len(asked) > 1:
            names = ", ".join(name for name, _ in asked)
            raise UnsupportedParameter(asked[1][0], f"one structured output at a time, got {names}; keep one")
        return asked[0][1] if asked else None

    def logprobs_count(self) -> int | None:
        """How many likeliest tokens to list beside each output token's logprob (None: no logprobs)."""
        return None

    def prompt_logprobs_count(self) -> int | None:
        return None


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: StrictStr
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format: json_schema goes with type 'json_schema' (and only there)")
        return self

    def structured(self) -> tuple[str, str]:
        if self.type == "json_object":
            return ("json_object", "")
        assert self.json_schema is not None
        return ("json_schema", _schema_text(self.json_schema.schema_ or {"type": "object"}))


def _schema_text(schema) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


STRUCTURED_OUTPUT_KINDS = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "json_object": "json_object"}


def _structured_outputs(value: dict[str, Any]) -> tuple[str, str]:
    given = [key for key in value if value[key] not in (None, False)]
    if len(given) != 1 or given[0] not in STRUCTURED_OUTPUT_KINDS:
        raise UnsupportedParameter(
            "structured_outputs",
            f"structured_outputs takes one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, got {sorted(value)!r}",
        )
    key = given[0]
    if key == "json_object":
        return ("json_object", "")
    spec = value[key]
    return (STRUCTURED_OUTPUT_KINDS[key], _schema_text(spec) if key == "json" else str(spec))


class CompletionRequest(_Sampling):
    # a string, token ids, or a list of either (several prompts: n choices each, in prompt order)
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(None, ge=0, le=20)  # the likeliest tokens listed beside each token's
    echo: StrictBool = False  # the prompt before the completion, with its logprobs when logprobs is set

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_count(self) -> int | None:
        return self.logprobs if self.echo else None

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
    strict: StrictBool | None = None  # true: a call's arguments are constrained to the schema (tools.strict_grammar)


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    # "auto" (the default with tools), "none", "required" or {"type": "function", "function": {"name": ...}}
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True  # false: the first call only
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

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
    def _top_logprobs_with_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedParameter("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tool_choice_served(self):
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none"):
            return self
        shape = '{"type": "function", "function": {"name": ...}}'
        if choice != "required" and not (
            isinstance(choice, dict)
            and choice.get("type") == "function"
            and set(choice) == {"type", "function"}
            and isinstance(choice["function"], dict)
            and set(choice["function"]) == {"name"}
            and isinstance(choice["function"]["name"], str)
        ):
            raise UnsupportedParameter(
                "tool_choice", f"tool_choice must be 'auto', 'none', 'required' or {shape}, got {json.dumps(choice)}"
            )
        if not self.tools:
            raise UnsupportedParameter(
                "tool_choice",
                f"tool_choice {json.dumps(choice)} forces a tool call, but the request has no tools; "
                "send the tools it may call, or drop tool_choice",
            )
        named = self.named_function()
        offered = [tool.function.name for tool in self.tools]
        if named is not None and named not in offered:
            raise UnsupportedParameter(
                "tool_choice",
                f"tool_choice names the function {named!r}, which is not among the tools ({', '.join(offered)}); "
                f"name one of them or add its definition to tools",
            )
        return self

    def forces_call(self) -> bool:
        """tool_choice "required" or a named function: the answer is constrained to calls (tools.forced_call_schema)."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, dict))

    def named_function(self) -> str | None:
        """The function a named tool_choice forces, or None."""
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None

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
