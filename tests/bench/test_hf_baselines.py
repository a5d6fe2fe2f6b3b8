"""The transformers baselines: same weights, same tokens as ar, same stopping rules, consistent stats."""

import pytest
import torch

from paraspec import Engine, SamplingParams
from paraspec.bench.hf_baselines import HFBaseline, hf_causal_lm
from paraspec.models.loader import resolve_checkpoint

PROMPTS = ["def add(a, b):", "Once upon a time", "import os\n"]
COPY = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add("  # lookup finds n-grams
EOS_AT_ONCE = "x = [1, 2, 3]\n"  # the tiny target answers this with its EOS id


@pytest.fixture(scope="module")
def setup(bench_target, bench_draft):
    with (
        Engine(bench_target, bench_draft, strategy="sd", dtype="float32") as sd,
        Engine(bench_target, strategy="ar", dtype="float32") as ar,
    ):
        target = hf_causal_lm(sd.target, resolve_checkpoint(bench_target))
        draft = hf_causal_lm(sd.draft, resolve_checkpoint(bench_draft))
        yield ar, sd, HFBaseline("hf-ar", target), HFBaseline("hf-assisted", target, draft)


@pytest.fixture(scope="module")
def lookup(setup):
    return HFBaseline("hf-prompt-lookup", setup[2].target, prompt_lookup_tokens=4)


def test_weights_are_shared_not_copied(setup):
    _, sd, hf_ar, hf_assisted = setup
    native = sd.target.decoder.state_dict()
    hf = hf_ar.target.state_dict()
    assert set(hf) == set(native)
    for name, p in hf.items():
        assert p.data_ptr() == native[name].data_ptr(), name
    draft_embed = sd.draft.decoder.model.embed_tokens.weight
    assert hf_assisted.draft.model.embed_tokens.weight.data_ptr() == draft_embed.data_ptr()
    assert hf_ar.dtype == torch.float32 and hf_ar.settings()["dtype"] == "float32"
    assert hf_assisted.settings()["num_assistant_tokens"] == 20  # transformers' default, recorded


@pytest.mark.parametrize("prompt", PROMPTS + [COPY])
def test_greedy_tokens_equal_ar(setup, lookup, prompt):
    ar, sd, hf_ar, hf_assisted = setup
    params = SamplingParams(max_new_tokens=20)
    ids = ar.encode(prompt)
    expected = ar.generate(ids, params, record_margins=True)
    for baseline in (hf_ar, hf_assisted, lookup):
        got = baseline.generate(ids, params, record_margins=True)
        assert got.token_ids == expected.token_ids, baseline.name
        assert len(got.token_ids) == 20 and got.finish_reason == "length"
        assert got.margins[0] == pytest.approx(expected.margins[0], abs=1e-3)
        assert sorted(got.margins) == list(range(20))


def test_hf_assisted_stats_add_up(setup):
    ar, _, _, hf_assisted = setup
    result = hf_assisted.generate(ar.encode(PROMPTS[0]), SamplingParams(max_new_tokens=24))
    s, trace = result.stats, result.trace
    forwards = [e for e in trace.events if e.device == "target"]
    assert forwards[0].kind == "prefill" and {e.kind for e in forwards[1:]} == {"verify"}  # the prompt's forward
    verifies = forwards[1:]
    drafts = [e for e in trace.events if e.kind == "draft"]
    assert s.rounds == len(forwards) > 1 and s.drafted == len(drafts) > 0
    assert s.accepted + s.rounds == s.new_tokens == 24  # each round: accepted drafts + one target token
    assert s.acceptance_rate == pytest.approx(s.accepted / s.drafted)
    assert s.mean_accepted_length == pytest.approx(24 / s.rounds)
    assert s.verify_s == pytest.approx(sum(e.duration_s for e in verifies))
    assert s.draft_s == pytest.approx(sum(e.duration_s for e in drafts))
    assert trace.progress[-1][1] == 24 and s.ttft_s == pytest.approx(trace.progress[0][0])
    assert s.total_s > s.verify_s + s.draft_s


def test_hf_prompt_lookup_copies_candidates_and_its_stats_add_up(setup, lookup):
    ar = setup[0]
    ids = ar.encode(COPY)
    result = lookup.generate(ids, SamplingParams(max_new_tokens=24))
    s, trace = result.stats, result.trace
    forwards = trace.events
    assert [e.device for e in forwards] == ["target"] * len(forwards) and s.rounds == len(forwards)
    assert [e.kind for e in forwards] == ["prefill"] + ["verify"] * (len(forwards) - 1)
    verifies = forwards[1:]
    # the first forward holds the prompt and its candidates, every later one the last token and its candidates
    drafted = [forwards[0].tokens - len(ids)] + [e.tokens - 1 for e in verifies]
    assert s.drafted == sum(drafted) > 0 and max(drafted) <= 4  # prompt_lookup_num_tokens=4
    assert s.accepted + s.rounds == s.new_tokens == 24 and 0 <= s.accepted <= s.drafted
    assert s.draft_s == 0 and s.verify_s == pytest.approx(sum(e.duration_s for e in verifies))
    assert lookup.settings()["prompt_lookup_num_tokens"] == 4
    assert lookup.settings()["max_matching_ngram_size"] == 2  # transformers' default, recorded
    with pytest.raises(ValueError, match="hf-prompt-lookup needs >= 1 candidate tokens"):
        HFBaseline("hf-prompt-lookup", lookup.target, prompt_lookup_tokens=0)


def test_hf_ar_trace_and_stats(setup):
    ar, _, hf_ar, _ = setup
    result = hf_ar.generate(ar.encode(PROMPTS[1]), SamplingParams(max_new_tokens=10))
    kinds = [e.kind for e in result.trace.events]
    assert kinds[0] == "prefill" and kinds[1:] == ["decode"] * 9  # one forward per token, no extra
    assert [n for _, n in result.trace.progress] == list(range(1, 11))
    assert result.stats.acceptance_rate is None and result.stats.new_tokens == 10


def test_stops_at_a_stop_token_like_the_engine(setup, lookup):
    ar, _, hf_ar, hf_assisted = setup
    ids = ar.encode(PROMPTS[2])
    free = ar.generate(ids, SamplingParams(max_new_tokens=20)).token_ids
    stop = free[6]
    cut = free.index(stop) + 1
    params = SamplingParams(max_new_tokens=20, stop_token_ids=[stop])
    expected = ar.generate(ids, params)
    assert expected.finish_reason == "stop" and len(expected.token_ids) == cut
    for baseline in (hf_ar, hf_assisted, lookup):
        got = baseline.generate(ids, params)
        assert got.token_ids == expected.token_ids and got.finish_reason == "stop", baseline.name


def test_stops_at_eos_like_the_engine(setup, lookup):
    ar, _, hf_ar, hf_assisted = setup
    ids = ar.encode(EOS_AT_ONCE)
    expected = ar.generate(ids, SamplingParams(max_new_tokens=20))
    assert expected.finish_reason == "stop" and expected.token_ids[-1] in ar.target.eos_token_ids
    for baseline in (hf_ar, hf_assisted, lookup):
        got = baseline.generate(ids, SamplingParams(max_new_tokens=20))
        assert got.token_ids == expected.token_ids and got.finish_reason == "stop", baseline.name


def test_hf_assisted_needs_a_draft(setup):
    _, _, hf_ar, _ = setup
    with pytest.raises(ValueError, match="hf-assisted needs a draft model"):
        HFBaseline("hf-assisted", hf_ar.target)


def test_prompt_goes_to_the_models_gpu_and_forwards_are_timed_whole(monkeypatch):
    """A model on a GPU gets its prompt there, and each forward hook (and the total) waits for the GPU before
    reading the clock. tests/fake_cuda.py stands in for the GPU (a CPU prompt would raise there)."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from tests.fake_cuda import CUDA, Timeline, fake_cuda

    class OnGPU(torch.nn.Module):
        device = CUDA
        generation_config = GenerationConfig(eos_token_id=[0], pad_token_id=0)

        def forward(self, input_ids):
            timeline.work()
            return input_ids + 1

        def generate(self, input_ids, attention_mask, generation_config, streamer):
            assert input_ids.device == attention_mask.device == CUDA
            streamer.put(input_ids)
            for _ in range(3):
                input_ids = torch.cat((input_ids, self(input_ids)[:, -1:]), dim=-1)
                streamer.put(input_ids[0, -1:])
            return SimpleNamespace(sequences=input_ids)

    timeline = Timeline(monkeypatch)
    with fake_cuda(timeline.events):
        result = HFBaseline("hf-ar", OnGPU()).generate([5, 6], SamplingParams(max_new_tokens=3))
    assert result.token_ids == [7, 8, 9]
    assert [e.kind for e in result.trace.events] == ["prefill", "decode", "decode"]
    assert timeline.unsynced_clocks() == 0, timeline.events
