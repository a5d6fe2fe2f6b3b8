"""Stop strings (SamplingParams.stop): every strategy ends where ar's text first contains one, with the same tokens
up to the one that completes it; streamed deltas never show text a stop string then claims."""

import pytest

from paraspec import Engine, SamplingParams
from tests.conftest import PROMPT

FULL = SamplingParams(max_new_tokens=40)
STRATEGIES = {
    "ar": dict(strategy="ar"),
    "sd": dict(strategy="sd", adaptive=False, draft="qwen2_partial"),
    "amusd": dict(strategy="amusd", draft="qwen2_partial", target_devices=["cpu:1"], draft_devices=["cpu:0"]),
    "dsi": dict(strategy="dsi", draft="qwen2_partial", target_devices=["cpu", "cpu"], runtime_kind="inprocess"),
}


@pytest.fixture(scope="module")
def reference(qwen2_target):
    with Engine(qwen2_target, strategy="ar", dtype="float32") as engine:
        return engine.generate(PROMPT, FULL), engine


@pytest.fixture(scope="module", params=list(STRATEGIES))
def engine(request, qwen2_target):
    kwargs = dict(STRATEGIES[request.param])
    if "draft" in kwargs:
        kwargs["draft"] = request.getfixturevalue(kwargs["draft"])
    with Engine(qwen2_target, dtype="float32", **kwargs) as engine:
        yield engine


def test_stop_string_cuts_like_ar(engine, reference):
    full, ar = reference
    stop = full.text[12:15]  # three characters from the middle of ar's output
    cut = full.text.index(stop)
    # the token whose text completes the first occurrence of the stop string
    end = next(n for n in range(1, len(full.token_ids) + 1) if stop in ar.decode_text(full.token_ids[:n]))
    params = SamplingParams(max_new_tokens=40, stop=[stop, "never-there"])
    result = engine.generate(PROMPT, params)
    assert (result.text, result.finish_reason) == (full.text[:cut], "stop")
    assert result.token_ids == full.token_ids[:end] and result.stats.new_tokens == end
    stream = engine.stream(PROMPT, params)
    assert "".join(stream) == full.text[:cut] and stream.result.token_ids == full.token_ids[:end]
    after = engine.generate(PROMPT, FULL)  # the engine is exact for the next request
    assert after.token_ids == full.token_ids


def test_a_stop_string_never_met_changes_nothing(engine, reference):
    full, _ = reference
    result = engine.generate(PROMPT, SamplingParams(max_new_tokens=40, stop="\x00never"))
    assert result.token_ids == full.token_ids and result.finish_reason == full.finish_reason


@pytest.mark.parametrize("stop", [[""], [3], "", 5])
def test_bad_stop_strings(stop):
    with pytest.raises(ValueError, match="stop must be non-empty strings"):
        SamplingParams(stop=stop)
