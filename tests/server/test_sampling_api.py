"""The sampling parameters clients send, through the official `openai` client against `paraspec serve`: logprobs
(chat's top_logprobs; completions' count and echo), penalties, logit_bias, min_p, structured outputs
(response_format, vLLM's guided_regex) -- each answer the one `ar` gives through the Python API with the same
parameters, from `sd` and `amusd` servers; strategies that cannot honour one refuse it with a 400 naming it.
Streamed, each chunk carries its own tokens' logprobs; the request's acceptance per draft position is in its usage
and on /metrics."""

import json
import re

import openai
import pytest

from paraspec import SamplingParams
from tests.server.conftest import KEY, MODEL, Server

PROMPT = "def fib(n):\n    return"
TOKENS = 16
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=1.5)
EXTRA = dict(repetition_penalty=1.5, min_p=0.05)


@pytest.fixture(scope="module")
def amusd_server(long_pair):
    server = Server(long_pair, "amusd", "--api-key", KEY)
    yield server
    code, err = server.stop()
    assert code == 0, err


def test_chat_logprobs_are_ars(sd_server, ar_engine):
    messages = [{"role": "user", "content": "hello"}]
    client = sd_server.client()
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=TOKENS,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True},
    )
    want = ar_engine.generate(messages, SamplingParams(max_new_tokens=TOKENS, logprobs=2))
    choice = reply.choices[0]
    assert choice.model_extra["token_ids"] == want.token_ids
    content = choice.logprobs.content
    assert [c.logprob for c in content] == pytest.approx([t.logprob for t in want.logprobs], abs=1e-4)
    assert [len(c.top_logprobs) for c in content] == [2] * TOKENS
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy: the likeliest
    assert all(bytes(c.bytes).decode() == c.token for c in content)
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=TOKENS, logprobs=True, top_logprobs=2, stream=True
    )
    chunks = [chunk.choices[0] for chunk in streamed if chunk.choices]
    gathered = [entry for c in chunks if c.logprobs for entry in c.logprobs.content]
    assert [(c.token, c.logprob, c.top_logprobs) for c in gathered] == [
        (c.token, c.logprob, c.top_logprobs) for c in content
    ]
    # each chunk carries the logprobs of the tokens of its delta, not all on the last one
    with_text = [c for c in chunks if c.delta.content]
    assert len(with_text) > 1 and all(c.logprobs for c in with_text)
    assert all("".join(e.token for e in c.logprobs.content) == c.delta.content for c in with_text)


def test_streamed_completion_logprobs_are_the_whole_answers_chunk_by_chunk(sd_server):
    client = sd_server.client()
    # printable ASCII, so that each token's text is its own (the tiny tokenizer's bytes above 127 are half characters)
    ascii_only = {"guided_regex": "[ -~\n]*"}
    ask = dict(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=TOKENS, logprobs=2, echo=True, extra_body=ascii_only
    )
    whole = client.completions.create(**ask).choices[0]
    chunks = [chunk.choices[0] for chunk in client.completions.create(stream=True, **ask)]
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[0].text == PROMPT  # the echo first, with the prompt's logprobs
    scored = [c for c in chunks if c.logprobs]
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in scored for x in getattr(c.logprobs, name)] == getattr(whole.logprobs, name), name
    assert all("".join(c.logprobs.tokens) == c.text for c in scored) and len(scored) > 2


def test_completions_echo_with_logprobs_scores_the_prompt(sd_server, ar_engine):
    """lm-evaluation-harness's log-likelihood request: echo, logprobs=1, max_tokens=1."""
    reply = sd_server.client().completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=1, logprobs=1, echo=True
    )
    want = ar_engine.generate(PROMPT, SamplingParams(max_new_tokens=1, logprobs=1, prompt_logprobs=1))
    lp = reply.choices[0].logprobs
    assert reply.choices[0].text.startswith(PROMPT) and len(lp.tokens) == len(want.prompt_ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [t.logprob for t in want.prompt_logprobs[1:]] + [want.logprobs[0].logprob]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    plain = sd_server.client().completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=1)
    assert plain.choices[0].logprobs is None and not plain.choices[0].text.startswith(PROMPT)


@pytest.mark.parametrize("strategy", ["sd", "amusd"])
def test_penalties_and_bias_give_ars_answer(request, ar_engine, strategy):
    server = request.getfixturevalue(f"{strategy}_server")
    plain = ar_engine.generate(PROMPT, SamplingParams(max_new_tokens=TOKENS))
    banned = plain.token_ids[0]
    params = SamplingParams(max_new_tokens=TOKENS, logit_bias={banned: -100.0}, **PENALTIES, **EXTRA)
    want = ar_engine.generate(PROMPT, params)
    assert want.token_ids != plain.token_ids and banned not in want.token_ids
    reply = server.client().completions.create(
        model=MODEL,
        prompt=PROMPT,
        temperature=0,
        max_tokens=TOKENS,
        logit_bias={str(banned): -100},
        **PENALTIES,
        extra_body={**EXTRA, "return_token_ids": True},
    )
    assert reply.choices[0].model_extra["token_ids"] == want.token_ids


@pytest.mark.parametrize("strategy", ["sd", "amusd"])
def test_a_regex_and_a_json_object_constrain_the_answer(request, ar_engine, strategy):
    client = request.getfixturevalue(f"{strategy}_server").client()
    regex = r"[a-z][a-z ]{5,20}\."
    reply = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        temperature=0,
        max_tokens=40,
        extra_body={"guided_regex": regex, "return_token_ids": True},
    )
    want = ar_engine.generate(PROMPT, SamplingParams(max_new_tokens=40, structured=("regex", regex)))
    assert reply.choices[0].model_extra["token_ids"] == want.token_ids
    assert re.fullmatch(regex, reply.choices[0].text)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "an object"}],
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_object"},
    )
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(chat.choices[0].message.content), dict)
    else:  # the budget ended it: a prefix of an object
        assert chat.choices[0].message.content.lstrip().startswith("{")


def test_amusd_reports_ars_logprobs(amusd_server, ar_engine):
    """amusd's target worker scores the tokens it commits: the same numbers as ar's, streamed or not."""
    want = ar_engine.generate(PROMPT, SamplingParams(max_new_tokens=TOKENS, logprobs=1))
    client = amusd_server.client()
    reply = client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=TOKENS, logprobs=1, extra_body={"return_token_ids": True}
    )
    assert reply.choices[0].model_extra["token_ids"] == want.token_ids
    got = reply.choices[0].logprobs
    assert got.token_logprobs == pytest.approx([t.logprob for t in want.logprobs], abs=1e-4)
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=TOKENS, logprobs=1, stream=True
    )
    gathered = [lp for chunk in streamed for c in chunk.choices if c.logprobs for lp in c.logprobs.token_logprobs]
    # (not bitwise: amusd's verification widths follow the two workers' timing, and the native decoder's rows
    # round differently at other widths -- the tokens do not change)
    assert gathered == pytest.approx(got.token_logprobs, abs=1e-4)


def test_what_cannot_be_honoured_is_a_400_naming_it(sd_server):
    sd = sd_server.client()
    with pytest.raises(openai.BadRequestError, match="one structured output at a time"):
        sd.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=2,
            extra_body={"guided_regex": "a+", "guided_json": {"type": "object"}},
        )
    with pytest.raises(openai.BadRequestError, match="logit_bias keys must be token ids"):
        sd.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias={"x": 1})
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
        sd.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="regex"):
        sd.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"guided_regex": "[ab"})


def test_acceptance_per_position_in_usage_and_metrics(sd_server):
    """vLLM's spec_decode_num_accepted_tokens_per_pos on /metrics, and the request's acceptance in its usage: the
    positions sum to the accepted drafts, and in a chain a draft is kept only after every one before it."""
    name = "paraspec:spec_decode_num_accepted_tokens_per_pos_total"
    before = [sd_server.metric(name, position=str(p)) for p in range(4)]
    accepted_before = sd_server.metric("paraspec:spec_decode_num_accepted_tokens_total")
    reply = sd_server.client().completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=48, n=2)
    spec = reply.usage.model_extra["spec_decode"]
    figures = reply.model_extra["paraspec"]
    assert spec["num_accepted_tokens"] == figures["accepted"] > 0 and spec["num_draft_tokens"] == figures["drafted"]
    assert spec["num_drafts"] == figures["rounds"] and spec["acceptance_rate"] == pytest.approx(
        figures["acceptance_rate"]
    )
    per_position = spec["num_accepted_tokens_per_pos"]
    assert sum(per_position) == spec["num_accepted_tokens"] and len(per_position) <= 4  # lookahead 4
    assert per_position == sorted(per_position, reverse=True)
    after = [sd_server.metric(name, position=str(p)) for p in range(4)]
    assert [a - b for a, b in zip(after, before)] == per_position + [0] * (4 - len(per_position))
    accepted = sd_server.metric("paraspec:spec_decode_num_accepted_tokens_total") - accepted_before
    assert sum(after) - sum(before) == accepted == spec["num_accepted_tokens"]
