"""Forced and strict tool calls: tool_choice "required" and a named function (vLLM's JSON constraint, read back by
ForcedCallParser), tools with `strict: true` (the family's format constrained by tools.strict_grammar) -- the
constraints on canned text through the tiny tokenizer's grammar matcher, the parser whole and in pieces, and end to
end through the official `openai` client on the tiny model (`sd`: the answer is constrained `ar`'s), the 400s."""

import json

import openai
import pytest

from paraspec import SamplingParams
from paraspec.errors import RefusedParameter
from paraspec.server.app import APIError, sampling_params
from paraspec.server.schemas import ChatCompletionRequest
from paraspec.server.tools import FORMATS, ForcedCallParser, fold, forced_call_schema, strict_grammar
from paraspec.structured import GrammarMatcher
from tests.server.conftest import MODEL
from tests.tiny import EOS_ID

HERMES, LLAMA3 = (next(f for f in FORMATS if f.name == name) for name in ("hermes", "llama3_json"))
FORECAST = {  # arguments a random tiny model ends quickly: enums, no free strings or numbers
    "type": "object",
    "properties": {"unit": {"enum": ["C", "F"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "forecast", "parameters": FORECAST}},
    {
        "type": "function",
        "function": {
            "name": "alarm",
            "parameters": {
                "type": "object",
                "properties": {"on": {"type": "boolean"}},
                "required": ["on"],
                "additionalProperties": False,
            },
        },
    },
]
NAMES = frozenset({"forecast", "alarm"})
ASK = [{"role": "user", "content": "Will it rain in Paris?"}]


def valid(name: str, arguments: dict) -> bool:
    """The arguments follow the offered tool's schema (both are closed objects of enums / a boolean)."""
    if name == "forecast":
        return set(arguments) == {"unit", "days"} and arguments["unit"] in ("C", "F") and arguments["days"] in (1, 2, 3)
    return name == "alarm" and set(arguments) == {"on"} and isinstance(arguments["on"], bool)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    from tests.tiny import write_tokenizer

    write_tokenizer(tiny_dir / "tool-choice-tokenizer")
    return AutoTokenizer.from_pretrained(str(tiny_dir / "tool-choice-tokenizer"))


def accepts(tokenizer, structured: tuple[str, str], text: str) -> bool:
    """Whether the constraint lets the whole `text` be generated and then end (its tokens one by one, then EOS)."""
    matcher = GrammarMatcher.for_request(tokenizer, structured, len(tokenizer), {EOS_ID})
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.allowed()[token]:
            return False
        matcher.consume(token)
    return bool(matcher.allowed()[EOS_ID])


CALL = '{"name": "forecast", "arguments": {"unit": "C", "days": 2}}'
STRICT_HERMES = [  # (text, allowed) with forecast strict and alarm not
    ("It will rain.", True),
    ("", True),
    (f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>", True),
    (
        f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n"
        + '{"name": "alarm", "arguments": {"x": [1]}}\n</tool_call> ok',
        True,
    ),
    ('<tool_call>\n{"name": "forecast", "arguments": {"unit": "K", "days": 2}}\n</tool_call>', False),
    ('<tool_call>\n{"name": "forecast", "arguments": {"unit": "C"}}\n</tool_call>', False),
    ('<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>', False),  # not an offered tool
    ("a <tool_call> b", False),  # a block that is no call
    (f"<tool_call>\n{CALL}\n</tool_call> then <tool_call>", False),
    (CALL, True),  # Qwen2.5-Coder's bare call
    (' {"name": "forecast", "arguments": {"unit": "C", "days": 7}}', False),
    ('{"a": 1}', False),  # a reply that begins like a bare call is one
    ('x {"a": 1}', True),
]


@pytest.mark.parametrize("text, allowed", STRICT_HERMES)
def test_strict_tools_constrain_every_call_and_leave_text_free(tiny_tokenizer, text, allowed):
    tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}, TOOLS[1]]
    assert accepts(tiny_tokenizer, ("grammar", strict_grammar(HERMES, tools)), text) is allowed
    if allowed:  # what the constraint lets through, the parser reads as calls that validate
        for _, call in [e for e in fold_events(text) if e[0] == "call"]:
            function = call["function"]
            assert function["name"] == "alarm" or valid(function["name"], json.loads(function["arguments"]))


def fold_events(text: str):
    from paraspec.server.tools import ToolCallParser

    parser = ToolCallParser(HERMES, None, NAMES)
    return parser.feed(text) + parser.finish()


def test_strict_llama3_calls_are_the_whole_reply(tiny_tokenizer):
    tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}]
    grammar = ("grammar", strict_grammar(LLAMA3, tools))
    assert accepts(tiny_tokenizer, grammar, '{"name": "forecast", "parameters": {"unit": "F", "days": 1}}')
    assert accepts(tiny_tokenizer, grammar, "No call needed.")
    assert not accepts(tiny_tokenizer, grammar, '{"name": "forecast", "parameters": {"unit": "F"}}')
    assert not accepts(tiny_tokenizer, grammar, 'See {"name": "forecast", "parameters": {}}')


def test_forced_schemas_are_vllms(tiny_tokenizer):
    assert {k: v for k, v in forced_call_schema(TOOLS, "forecast").items() if k != "x-guidance"} == FORECAST
    required = forced_call_schema(TOOLS, None)
    assert required["type"] == "array" and required["minItems"] == 1 and "maxItems" not in required
    assert forced_call_schema(TOOLS, None, max_calls=1)["maxItems"] == 1
    structured = ("json_schema", json.dumps(required))
    both = (
        '[{"name": "forecast", "parameters": {"unit": "C", "days": 3}}, {"name": "alarm", "parameters": {"on": true}}]'
    )
    assert accepts(tiny_tokenizer, structured, both)
    assert not accepts(tiny_tokenizer, structured, "[]")
    assert not accepts(tiny_tokenizer, structured, '[{"name": "alarm", "parameters": {"on": 1}}]')
    assert not accepts(tiny_tokenizer, structured, '[{"name": "rm", "parameters": {}}]')
    shared = {"$defs": {"Unit": {"enum": ["C", "F"]}}, "properties": {"u": {"$ref": "#/$defs/Unit"}}}
    tools = [{"type": "function", "function": {"name": n, "parameters": shared}} for n in ("a", "b")]
    assert forced_call_schema(tools, None)["$defs"] == shared["$defs"]  # moved to the top, where refs point
    clash = [tools[0], {"type": "function", "function": {"name": "c", "parameters": {"$defs": {"Unit": {}}}}}]
    with pytest.raises(ValueError, match="define '\\$defs/Unit' differently"):
        forced_call_schema(clash, None)


LISTED = (
    '[{"name": "forecast", "parameters": {"unit": "C", "days": 2}},\n {"name": "alarm", "parameters": {"on": false}}]'
)


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_forced_answers_parse_whole_and_in_pieces(size):
    for function, text, content, calls in [
        (None, LISTED, None, [("forecast", {"unit": "C", "days": 2}), ("alarm", {"on": False})]),
        # cut off by max_tokens: the text after the last whole call is content
        (None, LISTED[:70], LISTED[LISTED.index("},") + 1 : 70], [("forecast", {"unit": "C", "days": 2})]),
        (None, "not a list", "not a list", []),
        ("forecast", ' {"unit": "F", "days": 1}', None, [("forecast", {"unit": "F", "days": 1})]),
    ]:
        parser = ForcedCallParser(function, NAMES)
        events = [e for i in range(0, len(text), size) for e in parser.feed(text[i : i + size])] + parser.finish()
        got_content, got_calls = fold(events)
        assert got_content == content
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    one = ForcedCallParser(None, NAMES, max_calls=1)
    assert len(fold(one.feed(LISTED) + one.finish())[1]) == 1


def test_a_strategy_without_grammars_refuses_a_forced_call_naming_tool_choice():
    class NoGrammars:
        max_context = 256

        def check_params(self, params: SamplingParams) -> None:
            if params.structured is not None:
                raise RefusedParameter("structured", "strategy 'dsi' does not apply structured outputs; drop it")

    body = ChatCompletionRequest(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required")
    constraint = ("tool_choice", ("json_schema", json.dumps(forced_call_schema(TOOLS, None))))
    with pytest.raises(APIError) as refused:
        sampling_params(NoGrammars(), body, [1, 2], True, constraint)
    assert refused.value.status == 400 and refused.value.param == "tool_choice"
    assert "'tool_choice' is served by constraining the answer" in refused.value.message


# --- end to end on the tiny model (its chat template ignores tools: a forced call needs no format) ---


def test_a_named_function_is_called_with_valid_arguments(sd_server, ar_engine):
    client = sd_server.client()
    choice = {"type": "function", "function": {"name": "forecast"}}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,
        temperature=0,
        max_tokens=80,
        extra_body={"return_token_ids": True},
    )
    message, finish = reply.choices[0].message, reply.choices[0].finish_reason
    (call,) = message.tool_calls
    assert finish == "tool_calls" and message.content is None and call.id.startswith("call_")
    assert call.function.name == "forecast" and valid("forecast", json.loads(call.function.arguments))
    schema = json.dumps(forced_call_schema(TOOLS, "forecast"))
    # the tiny template ignores tools: the prompt is the messages'
    want = ar_engine.generate(ASK, SamplingParams(max_new_tokens=80, structured=("json_schema", schema)))
    assert reply.choices[0].model_extra["token_ids"] == want.token_ids and want.text.strip() == call.function.arguments
    streamed = list(
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=80, stream=True
        )
    )
    (delta_call,) = [t for c in streamed if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert (delta_call.index, delta_call.function.name) == (0, "forecast")
    assert delta_call.function.arguments == call.function.arguments
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "tool_calls"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_yields_calls_of_offered_tools(sd_server, parallel):
    client = sd_server.client()
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=200)
    reply = client.chat.completions.create(parallel_tool_calls=parallel, **kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert 1 <= len(calls) and (parallel or len(calls) == 1)
    assert all(valid(c.function.name, json.loads(c.function.arguments)) for c in calls)
    streamed = client.chat.completions.create(parallel_tool_calls=parallel, stream=True, **kwargs)
    deltas = [t for c in streamed if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(t.index, t.function.name, t.function.arguments) for t in deltas] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(calls)
    ]


BAD = [  # (body changes, the param named, words of the message)
    ({"tool_choice": "required"}, "tool_choice", "the request has no tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}}, "tool_choice", "'rm'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "alarm"}}, "tool_choice", "must be 'auto'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'required'"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
        "keep one",
    ),
    (  # strict under auto needs the family's format, which the tiny template does not render
        {"tools": [{"type": "function", "function": {"name": "alarm", "strict": True}}]},
        "tools",
        "does not render tools",
    ),
]


@pytest.mark.parametrize("changes, param, words", BAD, ids=[b[2] for b in BAD])
def test_bad_tool_choices_are_400s_naming_the_fix(sd_server, changes, param, words):
    status, reply = sd_server.post("/v1/chat/completions", {"model": MODEL, "messages": ASK, **changes})
    assert status == 400, reply
    assert reply["error"]["param"] == param and words in reply["error"]["message"], reply
    with pytest.raises(openai.BadRequestError):
        sd_server.client().chat.completions.create(model=MODEL, messages=ASK, **changes)
