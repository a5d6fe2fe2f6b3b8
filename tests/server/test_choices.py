"""Several choices per request through the official `openai` client: `n` on both endpoints and a list of prompts on
/v1/completions, each choice a generation of its own (seed + index), streamed interleaved by index, usage counting
each prompt once, refused whole (429) when the queue has no room for all of them, and cancelled whole when the
client leaves."""

import json
import threading
import urllib.request

import openai
import pytest

from paraspec import SamplingParams
from tests.conftest import wait_for
from tests.server.conftest import KEY, MODEL, Server

PROMPT = "def fib(n):\n    return"
TOKENS = 24


@pytest.fixture(scope="module")
def server(long_pair):
    """The native decoder's dynamic forward, 4 sequences: choices run batched."""
    server = Server(long_pair, "ar", "--api-key", KEY, "--backend", "native", "--max-num-seqs", "4")
    yield server
    code, err = server.stop()
    assert code == 0, err


def ids_of(choices) -> list[list[int]]:
    return [c.model_extra["token_ids"] for c in choices]


def test_greedy_choices_all_equal_the_single_answer(server, ar_engine):
    want = ar_engine.generate(PROMPT, SamplingParams(max_new_tokens=TOKENS))
    client = server.client()
    reply = client.completions.create(
        model=MODEL, prompt=PROMPT, n=3, temperature=0, max_tokens=TOKENS, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert ids_of(reply.choices) == [want.token_ids] * 3 and {c.text for c in reply.choices} == {want.text}
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(want.prompt_ids), 3 * TOKENS)
    assert reply.model_extra["paraspec"]["strategy"] == "ar"
    assert all(c.model_extra["paraspec"]["ttft_s"] > 0 for c in reply.choices)

    messages = [{"role": "user", "content": "hello"}]
    single = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
    chat = client.chat.completions.create(model=MODEL, messages=messages, n=3, temperature=0, max_tokens=12)
    assert [c.message.content for c in chat.choices] == [single.choices[0].message.content] * 3
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert chat.usage.prompt_tokens == single.usage.prompt_tokens and chat.usage.completion_tokens == 36


def test_seeded_choices_repeat_and_differ(server):
    client = server.client()

    def sample(n: int, seed: int) -> list[list[int]]:
        reply = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            n=n,
            temperature=1.0,
            seed=seed,
            max_tokens=TOKENS,
            extra_body={"return_token_ids": True},
        )
        return ids_of(reply.choices)

    first = sample(3, 7)
    assert sample(3, 7) == first  # a seeded request repeats
    assert len({tuple(ids) for ids in first}) == 3  # its choices differ from each other
    assert first[1] == sample(1, 8)[0] and first[2] == sample(1, 9)[0]  # choice i samples with seed + i
    assert sample(2, 2**64 - 1)[1] == sample(1, 0)[0]  # mod 2**64


def test_a_prompt_list_with_n(server, ar_engine):
    prompts = ["class A:\n", "print("]
    want = [ar_engine.generate(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    reply = server.client().completions.create(
        model=MODEL, prompt=prompts, n=2, temperature=0, max_tokens=10, extra_body={"return_token_ids": True}
    )
    # index = prompt_index * n + choice_index, as OpenAI numbers them
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert ids_of(reply.choices) == [want[0].token_ids] * 2 + [want[1].token_ids] * 2
    # each prompt counted once (vLLM's usage), every choice's tokens
    assert reply.usage.prompt_tokens == len(want[0].prompt_ids) + len(want[1].prompt_ids)
    assert reply.usage.completion_tokens == 40
    # token-id prompts in a list too
    ids = server.client().completions.create(
        model=MODEL, prompt=[w.prompt_ids for w in want], temperature=0, max_tokens=10
    )
    assert [c.text for c in ids.choices] == [w.text for w in want]


def raw_events(server, path: str, body: dict) -> list:
    """The SSE events of a streamed request as sent: parsed JSON, and "[DONE]" as it is."""
    request = urllib.request.Request(
        server.url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        lines = [line.decode().strip() for line in r]
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def test_streamed_choices_interleave_by_index(server):
    client = server.client()
    sampled = dict(model=MODEL, prompt=PROMPT, n=2, temperature=1.0, seed=11, max_tokens=TOKENS)
    whole = client.completions.create(**sampled)
    events = raw_events(
        server, "/v1/completions", {**sampled, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    chunks = events[:-1]
    text = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        text[choice["index"]] += choice["text"]
    assert [text[0], text[1]] == [c.text for c in whole.choices] and text[0] != text[1]
    finished = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(c["index"] for c in finished) == [0, 1] and all(c["finish_reason"] == "length" for c in finished)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole.usage.model_dump(exclude_none=True)

    # chat, through the client: every choice opens with the role, its deltas add up to its whole answer
    messages = [{"role": "user", "content": "hi"}]
    chat = dict(model=MODEL, messages=messages, n=2, temperature=1.0, seed=5, max_tokens=12)
    whole_chat = client.chat.completions.create(**chat)
    content, roles = {0: "", 1: ""}, []
    for chunk in client.chat.completions.create(stream=True, **chat):
        (choice,) = chunk.choices
        roles += [choice.index] if choice.delta.role == "assistant" else []
        content[choice.index] += choice.delta.content or ""
    assert roles == [0, 1] and [content[0], content[1]] == [c.message.content for c in whole_chat.choices]


def test_choices_run_together(server):
    """Each choice is a request of the Engine's own: with --max-num-seqs 4 the 4 choices run at once."""
    ask = lambda _: server.client().completions.create(model=MODEL, prompt=PROMPT, n=4, temperature=0, max_tokens=200)
    assert max(server.at_once(1, ask, "paraspec:num_requests_running")) == 4


def test_n_out_of_bounds_is_a_400(server):
    for n in (0, 17):
        status, body = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "n": n})
        assert status == 400 and body["error"]["param"] == "n" and "between 1 and 16" in body["error"]["message"]


def test_choices_beyond_the_queue_get_429_and_nothing_runs(start_server, ar_engine):
    """One slot, two places in the queue: with one generation running, a request of 3 choices has room for 2 and
    is refused whole; 2 choices fit; 4 choices never fit (400)."""
    server = start_server("ar", "--max-num-seqs", "1", "--max-queue", "2")
    client = server.client()
    status, body = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "n": 4})
    assert status == 400 and "at most 3" in body["error"]["message"] and body["error"]["param"] == "n"
    stream = client.completions.create(model=MODEL, prompt="long", temperature=0, max_tokens=3000, stream=True)
    next(iter(stream))  # it runs
    generated = server.metric("paraspec:generation_tokens_total")
    with pytest.raises(openai.RateLimitError, match="queue is full") as refused:
        client.completions.create(model=MODEL, prompt=PROMPT, n=3, temperature=0, max_tokens=5)
    assert refused.value.body["code"] == "queue_full"
    result = {}
    fits = threading.Thread(
        target=lambda: result.update(
            reply=client.completions.create(model=MODEL, prompt=PROMPT, n=2, temperature=0, max_tokens=5)
        )
    )
    fits.start()
    wait_for(lambda: server.metric("paraspec:num_requests_waiting") == 2, 60)
    stream.close()
    fits.join(120)
    want = ar_engine.generate(PROMPT, SamplingParams(max_new_tokens=5)).text
    assert [c.text for c in result["reply"].choices] == [want, want]
    assert server.metric("paraspec:num_requests_total", status="429") == 1
    wait_for(lambda: server.metric("paraspec:num_requests_running") == 0, 60)
    # the refused request generated nothing: only the long stream (cut short) and the 2 choices of 5 tokens did
    assert server.metric("paraspec:request_success_total") == 3
    assert server.metric("paraspec:generation_tokens_total") >= generated + 10


def test_a_client_leaving_cancels_every_choice(start_server, ar_engine):
    server = start_server("ar", "--backend", "native", "--max-num-seqs", "4")
    stream = server.client().completions.create(
        model=MODEL, prompt=PROMPT, n=3, temperature=0, max_tokens=3000, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 6:
            break
    stream.close()
    wait_for(lambda: server.metric("paraspec:request_success_total", finished_reason="disconnect") == 3, 60)
    assert 0 < server.metric("paraspec:generation_tokens_total") < 3 * 3000
    assert server.metric("paraspec:num_requests_running") == 0
