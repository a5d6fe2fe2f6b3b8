"""The OpenAI API through the official `openai` client: every strategy's greedy output over HTTP is ar's through
the Python API (streamed and not); chat, stop strings, max_tokens, seeds, usage, the paraspec extension, metrics,
16 clients at once, the API key, and a 400 naming the field for every bad input."""

import openai
import pytest

from paraspec import SamplingParams
from tests.server.conftest import KEY, MODEL, Server

PROMPT = "def fib(n):\n    return"
TOKENS = 40
GREEDY = dict(temperature=0, max_tokens=TOKENS)


@pytest.fixture(scope="module")
def expected(ar_engine):
    return ar_engine.generate(PROMPT, SamplingParams(max_new_tokens=TOKENS))


@pytest.fixture(scope="module")
def ar_server(long_pair):
    server = Server(long_pair, "ar", "--api-key", KEY)
    yield server
    code, err = server.stop()
    assert code == 0, err


@pytest.fixture(scope="module", params=["ar", "sd", "amusd", "dsi"])
def any_server(request, long_pair):
    server = Server(long_pair, request.param, "--api-key", KEY)
    server.strategy = request.param
    yield server
    code, err = server.stop()
    assert code == 0, err


def streamed(stream) -> tuple[str, list]:
    chunks = list(stream)
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


def test_greedy_completions_equal_ar(any_server, expected):
    client = any_server.client()
    reply = client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"return_token_ids": True}, **GREEDY)
    choice = reply.choices[0]
    assert choice.token_ids == expected.token_ids and choice.text == expected.text
    assert choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        len(expected.prompt_ids),
        TOKENS,
        len(expected.prompt_ids) + TOKENS,
    )
    stats = reply.model_extra["paraspec"]
    assert stats["strategy"] == any_server.strategy and stats["ttft_s"] > 0 and stats["tpot_ms"] > 0
    if any_server.strategy == "ar":
        assert stats["acceptance_rate"] is None
    else:
        assert 0 <= stats["acceptance_rate"] <= 1 and stats["mean_accepted_length"] >= 1 and stats["draft_s"] > 0
    # token ids as the prompt, streamed: the deltas add up to the same text; the last chunk has the figures
    text, chunks = streamed(
        client.completions.create(
            model=MODEL, prompt=expected.prompt_ids, stream=True, extra_body={"return_token_ids": True}, **GREEDY
        )
    )
    assert text == expected.text and len(chunks) > 2
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices[0].model_extra["token_ids"] == expected.token_ids
    assert chunks[-1].model_extra["paraspec"]["strategy"] == any_server.strategy


def test_chat_equals_ar(ar_server, ar_engine):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    want = ar_engine.generate(messages, SamplingParams(max_new_tokens=12))
    client = ar_server.client()
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_completion_tokens=12)
    assert reply.choices[0].message.content == want.text and reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(want.prompt_ids)
    assert reply.usage.completion_tokens == 12 and reply.choices[0].finish_reason == "length"
    assert reply.id.startswith("chatcmpl-") and reply.model == MODEL and reply.object == "chat.completion"
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-2].choices[0].finish_reason == "length" and "paraspec" in chunks[-2].model_extra


def test_stop_strings_and_token_ids(ar_server, expected, ar_engine):
    client = ar_server.client()
    stop = expected.text[10:13]
    cut = expected.text.index(stop)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, stop=[stop], **GREEDY)
    assert reply.choices[0].text == expected.text[:cut] and reply.choices[0].finish_reason == "stop"
    text, chunks = streamed(client.completions.create(model=MODEL, prompt=PROMPT, stop=stop, stream=True, **GREEDY))
    assert text == expected.text[:cut] and chunks[-1].choices[0].finish_reason == "stop"
    token = expected.token_ids[5]  # a stop token id (extension): ends before it
    first = expected.token_ids.index(token)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"stop_token_ids": [token]}, **GREEDY)
    assert reply.choices[0].text == ar_engine.decode_text(expected.token_ids[:first])
    assert reply.usage.completion_tokens == first + 1 and reply.choices[0].finish_reason == "stop"


def test_max_tokens_and_defaults(ar_server, expected):
    client = ar_server.client()
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3
    # OpenAI's default max_tokens, 16. Greedy: its default temperature (1) may sample the end-of-text token sooner
    assert len(expected.token_ids) == TOKENS  # greedy runs past 16 tokens from this prompt
    reply = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0)
    assert reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5, max_completion_tokens=7, temperature=0
    )
    assert chat.usage.completion_tokens == 7  # max_completion_tokens wins, as in OpenAI's API


def test_seed_reproducible(ar_server):
    client = ar_server.client()
    sample = lambda seed: (
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=seed, extra_body={"return_token_ids": True}
        )
        .choices[0]
        .token_ids
    )
    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


def test_models_health_and_metrics(ar_server):
    assert [m.id for m in ar_server.client().models.list().data] == [MODEL]
    assert ar_server.get("/health") == (200, '{"status":"ok"}')
    before = ar_server.metric("paraspec:generation_tokens_total")
    ar_server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    assert ar_server.metric("paraspec:generation_tokens_total") == before + 5
    assert ar_server.metric("paraspec:num_requests_total", endpoint="/v1/completions", status="200") >= 1
    assert ar_server.metric("paraspec:time_to_first_token_seconds_count") >= 1


def test_sixteen_clients_at_once(ar_server, ar_engine):
    prompts = [f"client {i}: " for i in range(16)]
    want = [ar_engine.generate(p, SamplingParams(max_new_tokens=10)).token_ids for p in prompts]
    results = [None] * 16
    client = ar_server.client()

    def ask(i):
        results[i] = client.completions.create(
            model=MODEL,
            prompt=prompts[i],
            temperature=0,
            max_tokens=10,
            stream=i % 2 == 1,
            extra_body={"return_token_ids": True},
        )
        if i % 2:
            results[i] = list(results[i])[-1]

    depth = ar_server.at_once(16, ask, "paraspec:num_requests_waiting")
    assert [r.choices[0].model_extra["token_ids"] for r in results] == want
    assert max(depth) >= 2  # requests waited their turn, and /metrics showed it


def test_api_key(ar_server):
    for key in (None, "wrong"):
        status, body = ar_server.post("/v1/completions", {"model": MODEL, "prompt": "x"}, api_key=key)
        assert status == 401 and "API key" in body["error"]["message"]
        assert body["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        ar_server.client(api_key="wrong").models.list()
    assert ar_server.get("/health")[0] == 200  # health and metrics need no key


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
BAD = [  # (path, body, the param named, words of the message)
    ("/v1/chat/completions", b"{not json", None, "not valid JSON"),
    ("/v1/chat/completions", {"model": MODEL}, "messages", "'messages' is required"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages", "at least 1 item"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "function", "content": "x"}]},
        "messages[0].role",
        "'system', 'developer', 'user', 'assistant' or 'tool'",
    ),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, "messages[0].content", "required"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -1}, "max_tokens", "greater than or equal to 1"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2.5}, "max_tokens", "valid integer"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": "9"}, "max_completion_tokens", "valid integer"),
    ("/v1/chat/completions", {**CHAT, "temperature": -0.5}, "temperature", "greater than or equal to 0"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p", "greater than 0"),
    ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, "top_p", "less than or equal to 1"),
    ("/v1/chat/completions", {**CHAT, "n": 17}, "n", "n must be between 1 and 16"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 3}, "logprobs", "valid boolean"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 101}}, "logit_bias", "biases in [-100, 100]"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"99999": 1}}, "logit_bias", "vocabulary has"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format.type", "'text'"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ("/v1/chat/completions", {**CHAT, "echo": True}, "echo", "not supported"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions", "not supported"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools[0].function", "required"),
    ("/v1/chat/completions", {**CHAT, "frobnicate": 1}, "frobnicate", "unknown parameter"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, "model", "is not served here"),
    ("/v1/chat/completions", {**CHAT, "stop": [""]}, "stop", "non-empty"),
    ("/v1/chat/completions", {**CHAT, "seed": -1}, "seed", "greater than or equal to 0"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 5000}, "prompt", "the context holds 4096"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt", "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", ""]}, "prompt", "prompt 1 of the list is empty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": 1}, "echo", "valid boolean"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_logprobs": 2}, "top_logprobs", "not supported"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 2}, "best_of", "not supported"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "frequency_penalty": -3}, "frequency_penalty", "-2"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_p": 2}, "min_p", "less than or equal to 1"),
    ("/v1/completions", [1, 2], None, "must be a JSON object"),
]


@pytest.mark.parametrize("path, body, param, words", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(ar_server, path, body, param, words):
    status, reply = ar_server.post(path, body)
    assert status == 400, reply
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"]


def test_the_openai_client_sees_400s(ar_server):
    with pytest.raises(openai.BadRequestError, match="n must be between 1 and 16"):
        ar_server.client().completions.create(model=MODEL, prompt="x", n=17)


def test_dsi_served_across_ray_nodes(ray_cluster, start_server, expected):
    """`paraspec serve --runtime-kind ray --ray-address ...`: dsi with its two target servers on two nodes of a Ray
    cluster and the drafter on the head, every token over the network transport; the openai client gets ar's text."""
    server = start_server(
        "dsi",
        "--runtime-kind",
        "ray",
        "--ray-address",
        ray_cluster.address,
        "--transport",
        "tcp",
        "--target-devices",
        "box-a/cpu:0",
        "box-b/cpu:1",
        "--draft-devices",
        "head-box/cpu:0",
    )
    client = server.client()
    reply = client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"return_token_ids": True}, **GREEDY)
    assert reply.choices[0].token_ids == expected.token_ids and reply.choices[0].text == expected.text
    assert reply.model_extra["paraspec"]["strategy"] == "dsi"
    text, _ = streamed(client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **GREEDY))
    assert text == expected.text
