"""Tool calls in a chat model's generated text: each family's format (FORMATS, recognised in its chat template) and
the parser that turns the text into OpenAI `tool_calls`, whole or delta by delta while streaming.

    format_of(tokenizer)   the family's ToolCallFormat, or a ValueError saying why tools cannot be served
    ToolCallParser         feed(text delta) / finish() -> ("content", text) and ("call", tool call) events

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


FORMATS = (
    # Qwen2/2.5/3, Hermes 2/3: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, one block per call
    # (Qwen2.5-Coder 0.5B/1.5B-Instruct, greedy, write the object alone: measured, so bare=True)
    ToolCallFormat("hermes", "<tool_call>", "<tool_call>", "</tool_call>", bare=True),
    # Llama 3.1-3.3 JSON tool calling: the whole answer is {"name": ..., "parameters": {...}}
    ToolCallFormat("llama3_json", '{"name": function name', '{"name"', None, start_in_body=True),
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
