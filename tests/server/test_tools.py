"""Tool calls: the parser on canned model output (every format of tools.FORMATS, malformed JSON, calls cut off,
several calls, the text fed in deltas of every size), the format found from a chat template, the 400s of what
paraspec cannot serve, and a tools request end to end on the reference pair (Qwen2.5-Coder's template, `<tool_call>`)
through the official `openai` client."""

import json

import pytest

from paraspec.models.cache import cache_dir
from paraspec.server.tools import FORMATS, ToolCallParser, fold, format_of
from tests.server.conftest import KEY, MODEL, Server

HERMES, LLAMA3 = (next(f for f in FORMATS if f.name == name) for name in ("hermes", "llama3_json"))
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


NAMES = frozenset({"get_weather", "get_time", "f"})  # the tools a request offered


def parse(text: str, fmt=HERMES, max_calls=None):
    parser = ToolCallParser(fmt, max_calls, NAMES)
    return fold(parser.feed(text) + parser.finish())


def parse_in_pieces(text: str, size: int, fmt=HERMES, max_calls=None):
    """The same text fed `size` characters at a time: what a stream sees."""
    parser = ToolCallParser(fmt, max_calls, NAMES)
    events = [e for i in range(0, len(text), size) for e in parser.feed(text[i : i + size])] + parser.finish()
    return events


def names_and_arguments(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


CASES = [  # (text, format, content, [(name, arguments)])
    (WEATHER, HERMES, None, [("get_weather", {"city": "Paris", "unit": "C"})]),
    ("Let me look.\n" + WEATHER, HERMES, "Let me look.", [("get_weather", {"city": "Paris", "unit": "C"})]),
    (WEATHER + "\n" + TIME, HERMES, None, [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {})]),
    (  # "parameters" (Llama's word) and text after the call
        '<tool_call>{"name": "f", "parameters": {"x": [1, 2]}}</tool_call> done',
        HERMES,
        "done",
        [("f", {"x": [1, 2]})],
    ),
    ('{"name": "get_time", "parameters": {"zone": "UTC"}}', LLAMA3, None, [("get_time", {"zone": "UTC"})]),
    ('It is: {"name": "get_time", "parameters": {}}', LLAMA3, "It is:", [("get_time", {})]),
    # Qwen2.5-Coder's bare calls: the reply is only JSON objects naming offered tools
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}\n', HERMES, None, [("get_weather", {"city": "Paris"})]),
    (
        ' {"name": "get_time", "arguments": {}}\n{"name": "f", "arguments": {"x": 1}}',
        HERMES,
        None,
        [("get_time", {}), ("f", {"x": 1})],
    ),
]
PLAIN = [  # text that is no call: the content is the text exactly, no call
    ("def fib(n):\n    return n  \n\n", HERMES),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>', HERMES),  # malformed JSON
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', HERMES),  # no name
    ('<tool_call>\n["get_weather"]\n</tool_call>', HERMES),  # not an object
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', HERMES),  # cut off by max_tokens
    ("a <tool_ca", HERMES),  # the start of a marker, never finished
    ('{"name": "get_time", "parameters": {', LLAMA3),
    ("", HERMES),
    ('{"name": "rm_rf", "arguments": {}}', HERMES),  # a bare object naming no offered tool
    ('{"name": "get_time", "arguments": {}} and then', HERMES),  # not only calls
    ('```json\n{"name": "get_time", "arguments": {}}\n```', HERMES),  # fenced: an answer about JSON
    ('{"name": "get_weather", "arguments": {"city": "Pa', HERMES),  # a bare call cut off
    ("{}", HERMES),
]


@pytest.mark.parametrize("text, fmt, content, calls", CASES)
def test_calls_are_parsed(text, fmt, content, calls):
    got_content, got_calls = parse(text, fmt)
    assert got_content == content
    assert names_and_arguments(got_calls) == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) > 10 for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("text, fmt", PLAIN)
def test_text_that_is_no_call_stays_content(text, fmt):
    assert parse(text, fmt) == (text or None, [])


def test_a_malformed_call_beside_good_ones_is_content_and_the_good_ones_calls():
    bad = '<tool_call>\n{"name": "x", "arguments": {oops}}\n</tool_call>'
    content, calls = parse(WEATHER + "\n" + bad + "\n" + TIME)
    assert content == bad and [n for n, _ in names_and_arguments(calls)] == ["get_weather", "get_time"]


def test_parallel_tool_calls_false_keeps_the_first_call():
    content, calls = parse(WEATHER + "\n" + TIME, max_calls=1)
    assert content is None and [n for n, _ in names_and_arguments(calls)] == ["get_weather"]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("text, fmt", [(c[0], c[1]) for c in CASES] + PLAIN)
def test_streamed_in_pieces_equals_whole(text, fmt, size):
    """Whatever the deltas, the events fold to the whole answer; a call's text never leaks out as content, and
    no content is held back longer than a marker's length."""
    events = parse_in_pieces(text, size, fmt)
    content, calls = fold(events)
    want_content, want_calls = parse(text, fmt)
    assert content == want_content
    assert names_and_arguments(calls) == names_and_arguments(want_calls)
    if want_calls:
        assert not any(kind == "content" and "get_" in value for kind, value in events)


def test_content_streams_before_the_call_closes():
    parser = ToolCallParser(HERMES, None, NAMES)
    assert parser.feed("Sure, ") == [("content", "Sure,")]  # the space is held: a call may follow it
    assert parser.feed("checking. <tool") == [("content", " checking.")]  # "<tool" may open a call: held
    assert parser.feed('_call>\n{"name": "get_time", "arguments": {}}') == []  # inside a call: held until it closes
    (kind, value), *rest = parser.feed("\n</tool_call>")
    assert kind == "call" and value["function"] == {"name": "get_time", "arguments": "{}"} and rest == []
    assert parser.finish() == []
    bare = ToolCallParser(HERMES, None, NAMES)  # a reply that begins with "{" is held: it may be a bare call
    assert bare.feed(" {") == [] and bare.feed('"name": "x"} ok') == []
    assert bare.finish() == [("content", ' {"name": "x"} ok')]


def tokenizer_with(tmp_path, template: str, special_marker: bool = False):
    from transformers import AutoTokenizer

    from tests.tiny import write_tokenizer

    write_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    tokenizer.chat_template = template
    if special_marker:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>"]})
    return tokenizer


def test_the_format_is_read_from_the_chat_template(tmp_path):
    hermes = "{% if tools %}{{ tools | tojson }} <tool_call>{% endif %}{{ messages[0]['content'] }}"
    llama = '{% if tools %}Respond as {"name": function name, "parameters": ...}{% endif %}'
    assert format_of(tokenizer_with(tmp_path / "a", hermes)) is HERMES
    assert format_of(tokenizer_with(tmp_path / "b", llama)) is LLAMA3
    with pytest.raises(ValueError, match="does not render tools"):
        format_of(tokenizer_with(tmp_path / "c", "{{ messages[0]['content'] }}"))
    with pytest.raises(ValueError, match="does not know this model's tool-call format"):
        format_of(tokenizer_with(tmp_path / "d", "{{ tools }} [TOOL_CALLS]"))
    with pytest.raises(ValueError, match="special token"):
        format_of(tokenizer_with(tmp_path / "e", hermes, special_marker=True))


# --- the reference pair: Qwen2.5-Coder's chat template renders the tools, its calls come back parsed ---

TARGET = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
# Qwen2.5-Coder answers this with a bare call (the JSON object without <tool_call> tags)
SHOT = [
    {"role": "system", "content": "You are a function-calling AI. You answer only with <tool_call> blocks."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture(scope="module")
def qwen_server():
    if not (cache_dir() / "models" / TARGET.replace("/", "--") / "config.json").exists():
        pytest.skip("reference pair missing: run `make models`")
    server = Server((TARGET, None), "ar", "--api-key", KEY)
    yield server
    code, err = server.stop()
    assert code == 0, err


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(cache_dir() / "models" / TARGET.replace("/", "--")))


def rendered(tokenizer, messages, tools=None) -> list[int]:
    from paraspec.prompts import encode_prompt

    return encode_prompt(messages, tokenizer, len(tokenizer), 32768, tools)


@pytest.mark.real_pair
def test_tools_reach_the_template_and_calls_come_back(qwen_server, qwen_tokenizer):
    client = qwen_server.client()
    # the template got the tools: the server's prompt is the one rendered with them, which names the tool
    with_tools = rendered(qwen_tokenizer, SHOT, TOOLS)
    assert "get_weather" in qwen_tokenizer.decode(with_tools) and "The current weather" in qwen_tokenizer.decode(
        with_tools
    )
    reply = client.chat.completions.create(model=MODEL, messages=SHOT, tools=TOOLS, temperature=0, max_tokens=60)
    assert reply.usage.prompt_tokens == len(with_tools) > len(rendered(qwen_tokenizer, SHOT))
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (tool_call,) = choice.message.tool_calls
    assert tool_call.type == "function" and tool_call.id.startswith("call_")
    assert tool_call.function.name == "get_weather" and json.loads(tool_call.function.arguments)["city"] == "Paris"

    # streamed: the same call in one delta, none of its text as content
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=SHOT, tools=TOOLS, temperature=0, max_tokens=60, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""
    (streamed,) = [t for d in deltas for t in d.tool_calls or []]
    assert streamed.index == 0 and streamed.id.startswith("call_") and streamed.type == "function"
    assert (streamed.function.name, streamed.function.arguments) == ("get_weather", tool_call.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    # the next turn: the assistant's call and the tool's answer go through the template
    answer_of_tool = {"role": "tool", "tool_call_id": tool_call.id, "content": "18 C, sunny"}
    follow = [*SHOT, choice.message.model_dump(exclude_none=True), answer_of_tool]
    answer = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, temperature=0, max_tokens=20)
    arguments = json.loads(tool_call.function.arguments)
    as_template = {"name": "get_weather", "arguments": arguments}
    call_turn = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": tool_call.id, "type": "function", "function": as_template}],
    }
    prompt = qwen_tokenizer.decode(rendered(qwen_tokenizer, [*SHOT, call_turn, answer_of_tool], TOOLS))
    assert "<tool_call>\n" + json.dumps(as_template) + "\n</tool_call>" in prompt  # arguments an object, not a string
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    assert answer.usage.prompt_tokens == len(rendered(qwen_tokenizer, [*SHOT, call_turn, answer_of_tool], TOOLS))

    # tool_choice "none": the template does not get the tools, nothing is parsed
    plain = client.chat.completions.create(
        model=MODEL, messages=SHOT, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=30
    )
    assert plain.usage.prompt_tokens == len(rendered(qwen_tokenizer, SHOT))
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason != "tool_calls"


@pytest.mark.real_pair
def test_strict_and_forced_calls_on_the_reference_model(qwen_server):
    """A strict tool's call follows its schema (here closed: the city and a unit of two); tool_choice "required"
    gives calls of the offered tool."""
    client = qwen_server.client()
    closed = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "parameters": closed, "strict": True}}]
    reply = client.chat.completions.create(model=MODEL, messages=SHOT, tools=strict, temperature=0, max_tokens=60)
    (call,) = reply.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(arguments) == {"city", "unit"} and arguments["unit"] in "CF"
    required = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60
    )
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and calls
    assert all(c.function.name == "get_weather" and "city" in json.loads(c.function.arguments) for c in calls)


BAD_TOOLS = [  # (path, body changes, the param named, words of the message); forced calls: test_tool_choice.py
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'auto', 'none'"),
    ("/v1/chat/completions", {"tools": TOOLS}, "tools", "does not render tools"),  # the tiny model's template
    ("/v1/chat/completions", {"tools": [{"type": "code_interpreter"}]}, "tools[0].type", "'function'"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "tool", "content": "18 C"}]},
        "messages[0].tool_call_id",
        "is required",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "assistant"}]}, "messages[0].content", "is required"),
    ("/v1/completions", {"prompt": "x", "tools": TOOLS}, "tools", "not supported"),
]


@pytest.fixture(scope="module")
def tiny_server(long_pair):
    server = Server(long_pair, "ar", "--api-key", KEY)
    yield server
    code, err = server.stop()
    assert code == 0, err


@pytest.mark.parametrize("path, changes, param, words", BAD_TOOLS, ids=[b[2] for b in BAD_TOOLS])
def test_what_cannot_be_served_is_a_400(tiny_server, path, changes, param, words):
    server = tiny_server
    body = {"model": MODEL, **({"messages": ASK} if "chat" in path else {}), **changes}
    status, reply = server.post(path, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param and words in reply["error"]["message"], reply
