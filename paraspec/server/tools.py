"""Tool calls in a chat model's generated text: each family's format (FORMATS, recognised in its chat template) and
the parser that turns the text into OpenAI `tool_calls`, whole or delta by delta while streaming.

    format_of(tokenizer)   the family's ToolCallFormat, or a ValueError saying why tools cannot be served
    ToolCallParser         feed(text delta) / finish() -> ("content", text) and ("call", tool call) events
    forced_call_schema     tool_choice "required" / a named function: the JSON schema the answer is constrained to
                           (vLLM's: the function's arguments, or a JSON list of calls), read by ForcedCallParser
    strict_grammar         tools with `strict: true`: a Lark grammar that leaves text free and constrains every call
                           the family's format writes to an offered tool, a strict one's arguments to its schema

The parser never guesses: a call is a marked block whose body parses as JSON naming a function, or, for a family
that also writes calls bare (Qwen2.5-Coder-*-Instruct answers with the JSON object alone, without the tags), a
reply that is nothing but such objects, each naming one of the request's tools. Anything else (a block that does
not parse, one cut off by max_tokens) stays content, so with no call the content is the text as it was generated.
Whitespace next to a call is dropped; other text before, between and after calls is content. The same parser
serves both answers (a whole one is its events folded), so a stream and a whole answer agree.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

Event = tuple[str, Any]  # ("content", text) or ("call", an OpenAI tool call)


@dataclass(frozen=True)
class ToolCallFormat:
    """One family's way of writing a call."""

    name: str
    template_mark: str  # text of the family's chat template that says it writes calls this way
    start: str  # the text that opens a call
    end: str | None  # the text that closes it; None: the call runs to the end of the generated text
    start_in_body: bool = False  # the start is the body's own first characters (a bare JSON object)
    bare: bool = False  # a reply of only JSON objects naming offered tools is calls too (held while it may be)
    arguments_key: str = "arguments"  # the call object's key for the arguments (strict_grammar writes it)


FORMATS = (
    # Qwen2/2.5/3, Hermes 2/3: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, one block per call
    # (Qwen2.5-Coder 0.5B/1.5B-Instruct, greedy, write the object alone: measured, so bare=True)
    ToolCallFormat("hermes", "<tool_call>", "<tool_call>", "</tool_call>", bare=True),
    # Llama 3.1-3.3 JSON tool calling: the whole answer is {"name": ..., "parameters": {...}}
    ToolCallFormat(
        "llama3_json", '{"name": function name', '{"name"', None, start_in_body=True, arguments_key="parameters"
    ),
)


def format_of(tokenizer) -> ToolCallFormat:
    """The tool-call format of the model whose tokenizer this is; a ValueError naming the reason when paraspec
    cannot serve tools for it (no chat template that renders tools, no known format, markers lost in decoding)."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not isinstance(template, str) or "tools" not in template:
        raise ValueError(
            "this model's chat template does not render tools, so the model would never see them; serve a model "
            "whose template takes tools (e.g. Qwen2.5-*-Instruct) or drop 'tools'"
        )
    for fmt in FORMATS:
        if fmt.template_mark in template:
            # a marker that is a special token vanishes from the decoded text (skip_special_tokens): no call could
            # ever be found, so refuse rather than return calls as nothing
            decoded = tokenizer.decode(tokenizer.encode(fmt.start, add_special_tokens=False), skip_special_tokens=True)
            if decoded != fmt.start:
                raise ValueError(
                    f"this model writes tool calls in the {fmt.name} format, whose marker {fmt.start!r} is a special "
                    f"token dropped from the generated text; paraspec serve cannot parse its calls yet"
                )
            return fmt
    raise ValueError(
        f"paraspec serve does not know this model's tool-call format (it parses {', '.join(f.name for f in FORMATS)}"
        f"); drop 'tools' or add the family's format to paraspec/server/tools.py FORMATS"
    )


def parse_call(body: str) -> dict | None:
    """An OpenAI tool call ({"id", "type", "function": {"name", "arguments"}}) from a call's JSON body, or None
    when the body is not a JSON object naming a function. `arguments` is a JSON string, as OpenAI sends it."""
    try:
        return call_of(json.loads(body))
    except ValueError:
        return None


def call_of(call: Any, tool_names: frozenset[str] | None = None) -> dict | None:
    """parse_call's answer for a decoded JSON value; with tool_names, only a call of one of them."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    if tool_names is not None and call["name"] not in tool_names:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, (dict, str)):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
            "name": call["name"],
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
        },
    }


class ToolCallParser:
    """Events from a generation's text, fed delta by delta: ("content", text) as soon as it cannot be part of a
    call, ("call", tool call) once a call's block has closed and parsed. At most `max_calls` calls are returned
    (parallel_tool_calls: false -> 1); further blocks are dropped."""

    def __init__(self, fmt: ToolCallFormat, max_calls: int | None = None, tool_names: frozenset[str] = frozenset()):
        self.fmt, self.max_calls, self.tool_names = fmt, max_calls, tool_names
        self.calls = 0
        # bare calls: None until the reply's first non-blank character says (True: "{", held to the end)
        self._bare: bool | None = None if fmt.bare and tool_names else False
        self._head = ""  # the text held while _bare is not False
        self._pending = ""  # text not yet classified: a possible start of a call, or an open call
        self._in_call = False
        self._blank = ""  # whitespace held back: dropped if a call follows it, content if text does
        self._after_call = False  # whitespace that follows a call is dropped too

    def feed(self, text: str) -> list[Event]:
        if self._bare is not False:
            self._head += text
            if not self._head.strip() or self._head.lstrip()[0] == "{":
                self._bare = bool(self._head.strip()) or None
                return []
            self._bare, text, self._head = False, self._head, ""
        self._pending += text
        events: list[Event] = []
        while True:
            if not self._in_call:
                at = self._pending.find(self.fmt.start)
                if at < 0:  # hold back only what could still become the start marker
                    keep = _longest_prefix_suffix(self._pending, self.fmt.start)
                    self._content(self._pending[: len(self._pending) - keep], events)
                    self._pending = self._pending[len(self._pending) - keep :]
                    return events
                self._content(self._pending[:at], events)
                self._pending, self._in_call = self._pending[at:], True
            if self.fmt.end is None:
                return events  # the call runs to the end of the text: finish() parses it
            close = self._pending.find(self.fmt.end, len(self.fmt.start))
            if close < 0:
                return events
            block, self._pending = (
                self._pending[: close + len(self.fmt.end)],
                self._pending[close + len(self.fmt.end) :],
            )
            self._in_call = False
            self._block(block, block[0 if self.fmt.start_in_body else len(self.fmt.start) : close], events)

    def finish(self) -> list[Event]:
        """The events of the text still held at the end of the generation."""
        if self._bare is not False:
            self._bare, head, self._head = False, self._head, ""
            calls = self._bare_calls(head)
            if calls:
                self.calls = len(calls)
                return [("call", call) for call in calls[: self.max_calls]]
            return self.feed(head) + self.finish()
        events: list[Event] = []
        rest, self._pending = self._pending, ""
        if self._in_call and self.fmt.end is None:
            self._block(rest, rest if self.fmt.start_in_body else rest[len(self.fmt.start) :], events)
        else:  # an unclosed block (cut off by max_tokens) or a partial marker: content as generated
            self._content(rest, events)
        self._in_call = False
        if self.calls == 0 and self._blank:
            events.append(("content", self._blank))
        self._blank = ""
        return events

    def _bare_calls(self, text: str) -> list[dict]:
        """The calls of a reply made only of JSON objects, each naming one of the tools; [] if it is not one."""
        decoder, calls, at = json.JSONDecoder(), [], 0
        while text[at:].strip():
            at = len(text) - len(text[at:].lstrip())
            try:
                value, at = decoder.raw_decode(text, at)
            except ValueError:
                return []
            call = call_of(value, self.tool_names)
            if call is None:
                return []
            calls.append(call)
        return calls

    def _block(self, block: str, body: str, events: list[Event]) -> None:
        call = parse_call(body)
        if call is None:
            self._content(block, events)
            return
        self._blank, self._after_call = "", True
        if self.max_calls is None or self.calls < self.max_calls:
            events.append(("call", call))
        self.calls += 1

    def _content(self, text: str, events: list[Event]) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if not text:
            return
        if not text.strip():
            self._blank += text
            return
        stripped = text.rstrip()
        events.append(("content", self._blank + stripped))
        self._blank = text[len(stripped) :]


def _longest_prefix_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (the part that may still become it)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def fold(events: list[Event]) -> tuple[str | None, list[dict]]:
    """A whole answer's (content, tool calls) from its events: content None when empty, as OpenAI sends it."""
    content = "".join(value for kind, value in events if kind == "content")
    return content or None, [value for kind, value in events if kind == "call"]


# --- constrained calls: tool_choice "required" or a named function, and tools with strict: true ---


# a constrained call's JSON is written as json.dumps writes it (the models' own style): flexible whitespace would let
# a model pad it with blanks until max_tokens (vLLM's --structured-outputs-config.disable_any_whitespace)
COMPACT = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


def _arguments_schema(function: dict, constrained: bool = True) -> dict:
    """A function's arguments schema (a copy); any JSON object where it has none or is not constrained."""
    parameters = function.get("parameters") if constrained else None
    return json.loads(json.dumps(parameters)) if parameters else {"type": "object"}


def _with_defs(schema: dict, arguments: list[dict]) -> dict:
    """`schema` with the arguments schemas' `$defs` moved to its top, where their `#/$defs/...` references point
    once the arguments are nested in it (as vLLM does); a name defined twice differently is a ValueError."""
    defs: dict = {}
    for part in arguments:
        for name, definition in part.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise ValueError(f"two tools define '$defs/{name}' differently; give the definitions distinct names")
    return {**schema, "$defs": defs} if defs else schema


def forced_call_schema(tools: list[dict], function: str | None, max_calls: int | None = None) -> dict:
    """The JSON schema of a forced answer, as vLLM builds it: with a named function, that function's arguments
    (the answer is the arguments object); with tool_choice "required", a list of 1 .. max_calls calls
    {"name", "parameters"} of the offered tools."""
    if function is not None:
        (named,) = [t["function"] for t in tools if t["function"]["name"] == function]
        return {**_arguments_schema(named), **COMPACT}
    arguments = [_arguments_schema(t["function"]) for t in tools]
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,  # (vLLM's leaves other keys open: a model may fill them until max_tokens)
        }
        for t, schema in zip(tools, arguments)
    ]
    listed = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}, **COMPACT}
    if max_calls is not None:
        listed["maxItems"] = max_calls
    return _with_defs(listed, arguments)


def strict_grammar(fmt: ToolCallFormat, tools: list[dict]) -> str:
    """A Lark grammar (llguidance's) for an answer to tools some of which are strict: text stays free, and every
    call the family's format writes (what ToolCallParser would read as one) names an offered tool, with a strict
    tool's arguments following its schema (other tools' any JSON object). Hermes: text and <tool_call> blocks, or
    a reply of bare call objects (the parser's rule: the reply's first non-blank character "{"); Llama 3 JSON: text
    that neither begins like a JSON object nor holds a call, or the reply one call object."""
    arguments = [_arguments_schema(t["function"], bool(t["function"].get("strict"))) for t in tools]
    call = {
        **COMPACT,
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t["function"]["name"]}, fmt.arguments_key: schema},
                "required": ["name", fmt.arguments_key],
                "additionalProperties": False,
            }
            for t, schema in zip(tools, arguments)
        ],
    }
    lines = [f"call: %json {json.dumps(_with_defs(call, arguments))}", r"WS: /[ \t\r\n]*/"]
    no_start = rf"~/(?s:.*){_regex_literal(fmt.start)}(?s:.*)/"
    no_object = r"~/[ \t\r\n]*\{(?s:.*)/"  # text that begins like a JSON object is a call
    if fmt.end is None:  # the call runs to the end: the reply is one call, or text in which none starts
        lines += ["start: PLAIN | WS call WS", f"PLAIN: /(?s:.*)/ & {no_object} & {no_start}"]
    else:
        start, end = json.dumps(fmt.start), json.dumps(fmt.end)
        lines += [
            "start: LEAD_ONLY | first_head body (head body)* TAIL" + (" | bare" if fmt.bare else ""),
            "bare: WS call (WS call)* WS",
            f"body: WS call WS {end}",
            f"first_head[lazy]: LEAD {start}",
            f"head[lazy]: /(?s:.*)/ {start}",
            # with bare calls, text that begins like one ("{" after blanks) is one: the parser holds it as such
            "LEAD: /(?s:.*)/" + (f" & {no_object}" if fmt.bare else ""),
            f"LEAD_ONLY: LEAD & {no_start}",
            f"TAIL: /(?s:.*)/ & {no_start}",
        ]
    return "\n".join(lines) + "\n"


def _regex_literal(text: str) -> str:
    """`text` as a literal inside a Lark /.../ regex."""
    return "".join(f"\\{c}" if c in r"\.^$|?*+()[]{}/" else c for c in text)


class ForcedCallParser:
    """The calls of a forced answer, whose text forced_call_schema's constraint shaped: a named function's
    arguments (one call of it, at the end, its arguments as generated even when max_tokens cut them), or a JSON
    list of calls (each one event once its object has closed). Text left that is no call (a list cut off) is
    content at the end. The same events as ToolCallParser."""

    def __init__(self, function: str | None, tool_names: frozenset[str], max_calls: int | None = None):
        self.function, self.tool_names, self.max_calls = function, tool_names, max_calls
        self.calls = 0
        self._text = ""
        self._at: int | None = None  # where the next list item starts (None: before the list's "[")
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> list[Event]:
        self._text += text
        if self.function is not None:
            return []  # the arguments: one call at the end
        if self._at is None:  # the list's "[" first
            head = self._text.lstrip(" \t\r\n")
            if not head:
                return []
            self._at = len(self._text) - len(head) + 1 if head[0] == "[" else -1  # -1: no list, content at the end
        events: list[Event] = []
        while self._at >= 0:
            at = len(self._text) - len(self._text[self._at :].lstrip(" \t\r\n,"))
            try:
                value, end = self._decoder.raw_decode(self._text, at)
            except ValueError:  # not closed yet (or not JSON: finish says)
                break
            call = call_of(value, self.tool_names)
            if call is None:
                break
            self._at = end
            if self.max_calls is None or self.calls < self.max_calls:
                events.append(("call", call))
            self.calls += 1
        return events

    def finish(self) -> list[Event]:
        if self.function is not None:
            arguments = self._text.strip()
            self.calls = 1
            return [
                (
                    "call",
                    {
                        "id": f"call_{uuid.uuid4().hex[:24]}",
                        "type": "function",
                        "function": {"name": self.function, "arguments": arguments},
                    },
                )
            ]
        rest = self._text[self._at :] if self.calls else self._text
        if self.calls and rest.strip() == "]":
            return []
        return [("content", rest)] if rest.strip() else []
