"""The runner's variants, its interleaved schedule, and what it hands every contender."""

import os
from dataclasses import replace
from types import SimpleNamespace

import pytest

from paraspec.bench.datasets import BenchPrompt, encode_prompt
from paraspec.bench.metrics import Variant
from paraspec.bench.runner import (
    BenchConfig,
    Contender,
    _run,
    interleave,
    parse_variants,
    variant_cpu_devices,
    variant_drafts,
    variant_engine_config,
)
from paraspec.config import EngineConfig
from paraspec.engine import GenerationResult
from paraspec.sampling import SamplingParams
from paraspec.stats import GenerationStats
from paraspec.strategies import STRATEGIES
from paraspec.trace import Trace


def test_parse_variants():
    names = [v.name for v in parse_variants("ar,sd,hf-assisted", [1, 2])]
    assert names == ["ar@1t", "ar@2t", "sd@1t", "sd@2t", "hf-assisted@1t", "hf-assisted@2t"]
    assert [v.name for v in parse_variants("ar, sd@2t", [1])] == ["ar@1t", "sd@2t"]
    assert [v.name for v in parse_variants("ar,hf-ar")] == ["ar", "hf-ar"]
    assert [v.strategy for v in parse_variants("all,hf-assisted")] == list(STRATEGIES) + ["hf-assisted"]
    assert [v.name for v in parse_variants("ar,ar@1t", [1])] == ["ar@1t"]  # no duplicates


def test_drafters_in_brackets():
    variants = parse_variants("ar,sd[ngram],sd[suffix]@2t,sd[ngram, model],dsi[ngram,model],sd[model],sd", [1])
    assert [v.name for v in variants] == [
        "ar@1t",
        "sd[ngram]@1t",
        "sd[suffix]@2t",
        "sd[ngram,model]@1t",
        "dsi[ngram,model]",
        "sd[model]@1t",
        "sd@1t",
    ]  # the text as written
    assert variants[3] == Variant("sd", 1, ("ngram", "model")) and variants[-1].drafts is None
    assert [v.name for v in parse_variants("sd[ngram],sd[ngram]@1t", [1, 2])] == ["sd[ngram]@1t", "sd[ngram]@2t"]


@pytest.mark.parametrize(
    "spec,message",
    [
        ("sd[tree]", "bad drafter 'tree' in 'sd\\[tree\\]'; name drafters among ngram, suffix, model"),
        ("sd[]", "bad drafter ''"),
        ("sd[ngram,,model]", "bad drafter ''"),
        ("ar[ngram]", "ar takes no drafters, so 'ar\\[ngram\\]' does not apply; brackets go with sd"),
        ("hf-ar[ngram]", "hf-ar takes no drafters"),
        ("sd[ngram,ngram]", "names a drafter twice"),
        ("sd[ngram", "unbalanced brackets"),
        ("sd[ngram]]", "unbalanced brackets"),
        ("sd[[ngram]]", "unbalanced brackets"),
        ("sd@2t[ngram]", "bad variant 'sd@2t\\[ngram\\]'"),
    ],
)
def test_drafter_errors_name_the_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_variants(spec)


def test_drafters_go_to_the_engine_config_with_model_replaced_by_the_draft():
    def drafts(spec, draft="/models/draft"):
        return variant_drafts(parse_variants(spec)[0], draft)

    assert drafts("sd") == "/models/draft" and drafts("sd[model]") == "/models/draft"
    assert drafts("sd[ngram]") == "ngram" and drafts("sd[suffix]", None) == "suffix"  # one drafter: itself
    assert drafts("sd[ngram,model]") == ["ngram", "/models/draft"]  # order kept
    assert drafts("dsi[model,suffix]") == ["/models/draft", "suffix"]
    assert drafts("dsi[ngram,model]", ["/a", "/b"]) == ["ngram", "/a", "/b"]  # model: every --draft
    with pytest.raises(ValueError, match="sd\\[ngram,model\\] names the draft model; pass --draft"):
        drafts("sd[ngram,model]", None)


def test_variant_engine_config_keeps_the_bench_settings(bench_target, bench_draft):
    base = EngineConfig(bench_target, str(bench_draft), strategy="sd", dtype="float32", max_context=512)
    bench = BenchConfig(base, [], SamplingParams(max_new_tokens=4), options={"lookahead": 3, "verify_chunk": 2})
    config = variant_engine_config(bench, Variant("dsi", None, ("model", "model")))
    assert config.strategy == "dsi" and config.draft == [str(bench_draft), str(bench_draft)]
    assert (config.dtype, config.max_context, config.options) == ("float32", 512, {"lookahead": 3})  # dsi's own
    assert variant_engine_config(bench, Variant("sd", 1)).draft == str(bench_draft)
    assert variant_engine_config(bench, Variant("ar", 1)).draft is None
    assert base.strategy == "sd" and base.draft == str(bench_draft)  # not modified


def test_variants_with_their_own_options(bench_target, bench_draft):
    """`sd{adaptive,lookahead=16}` beside `sd` in one interleaved run: its options over the bench's, checked."""
    variants = parse_variants("sd,sd{adaptive,lookahead=16},sd[suffix]{adaptive=0}@2t", [1])
    assert [v.name for v in variants] == ["sd@1t", "sd{adaptive,lookahead=16}@1t", "sd[suffix]{adaptive=0}@2t"]
    base = EngineConfig(bench_target, str(bench_draft), strategy="sd", dtype="float32", max_context=512)
    bench = BenchConfig(base, [], SamplingParams(max_new_tokens=4), options={"lookahead": 3, "adaptive": True})
    assert [variant_engine_config(bench, v).options for v in variants] == [
        {"lookahead": 3, "adaptive": True},
        {"lookahead": 16, "adaptive": True},
        {"lookahead": 3, "adaptive": False},
    ]


def test_in_process_variants_are_built_with_their_own_threads(bench_target, bench_draft):
    """--target-devices cpu:1 is for the worker strategies: an in-process `sd@2t` decodes with 2 threads on this
    process's cores, so its engine is built (and the adaptive rule's costs timed) on 2 of them, `sd@1t` on one;
    a worker strategy, a variant without a thread count and a GPU keep the devices given."""
    from paraspec.runtime.devices import Device, available_cores

    cores = available_cores()
    base = EngineConfig(
        bench_target,
        str(bench_draft),
        strategy="sd",
        dtype="float32",
        max_context=512,
        target_devices=[f"cpu:{cores[-1]}"],
        draft_devices=[f"cpu:{cores[0]}"],
    )
    bench = BenchConfig(base, [], SamplingParams(max_new_tokens=4))
    for threads in sorted({1, len(cores)}):
        config = variant_engine_config(bench, Variant("sd", threads))
        assert config.target_devices == config.draft_devices == (Device("cpu", tuple(cores[:threads])),)
    assert variant_engine_config(bench, Variant("sd", None)).target_devices == base.target_devices
    assert variant_engine_config(bench, Variant("amusd", None)).target_devices == base.target_devices
    gpu = SimpleNamespace(target_devices=(Device("cuda", index=0),), draft_devices=(Device("cuda", index=0),))
    assert variant_cpu_devices(gpu, Variant("sd", 2)) == {}  # this machine need not have the GPU


@pytest.mark.parametrize(
    "spec,message",
    [
        ("ar{adaptive}", "ar takes no options"),
        ("sd{tree_width=2}", "bad option 'tree_width'.*sd takes lookahead"),
        ("sd{lookahead}", "needs a value: write lookahead="),
        ("sd{lookahead=many}", "is not an integer"),
        ("sd{lookahead=0}", "lookahead must be >= 1"),
        ("sd{adaptive=maybe}", "write adaptive, adaptive=1 or"),
        ("sd{adaptive", "unbalanced brackets"),
    ],
)
def test_variant_option_errors_name_the_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_variants(spec)


def test_bracket_variants_without_draft_need_none_and_model_needs_one(bench_target):
    from paraspec.bench.runner import build_contenders

    config = BenchConfig(
        EngineConfig(bench_target, dtype="float32"),
        parse_variants("sd[ngram,model]"),
        SamplingParams(max_new_tokens=4),
        progress=False,
    )
    with pytest.raises(ValueError, match="sd\\[ngram,model\\] need a draft model; pass --draft"):
        build_contenders(config)


def test_worker_strategies_run_once_on_their_devices(monkeypatch):
    from paraspec.bench import runner

    pipelined = type(
        "Pipelined", (STRATEGIES["sd"],), {"name": "pipelined", "caps": replace(STRATEGIES["sd"].caps, in_workers=True)}
    )
    monkeypatch.setitem(runner.STRATEGIES, "pipelined", pipelined)
    assert [v.name for v in parse_variants("ar,pipelined", [1, 2])] == ["ar@1t", "ar@2t", "pipelined"]
    with pytest.raises(ValueError, match="pipelined runs in worker processes .* no @Nt thread count"):
        parse_variants("pipelined@2t")


@pytest.mark.parametrize(
    "spec,threads,message",
    [
        ("ar,nope", None, "unknown strategy 'nope' in --strategies; choose from ar, sd"),
        ("sd@xt", None, "bad thread count in 'sd@xt'; write it like sd@2t"),
        ("sd@0t", None, "it must be >= 1"),
        (" , ", None, "--strategies is empty"),
        ("ar", [0], "--threads takes positive integers"),
    ],
)
def test_parse_variants_errors(spec, threads, message):
    with pytest.raises(ValueError, match=message):
        parse_variants(spec, threads)


def test_interleave_runs_every_variant_on_a_prompt_before_the_next():
    variants = [Variant("ar"), Variant("sd"), Variant("hf-ar")]
    order = interleave(4, variants)
    assert len(order) == 12
    for i in range(4):
        block = order[3 * i : 3 * i + 3]
        assert {p for p, _ in block} == {i}
        assert {v for _, v in block} == set(variants)
        assert block[0][1] == variants[i % 3]  # who goes first rotates with the prompt


def fake_contender(variant, calls, tokenizer, answer="ANSWER"):
    """A contender that logs (variant, prompt ids) and 'generates' the given text."""

    def generate(prompt_ids, params, record_margins=False):
        calls.append((variant.name, list(prompt_ids)))
        tokens = tokenizer.encode(answer if variant.strategy == "ar" else "other", add_special_tokens=False)
        n = len(tokens)
        stats = GenerationStats(
            "x", len(prompt_ids), n, 1.0, 0.1, 900 / (n - 1), 1000 / n, n, None, None, 0.0, 0.0, 0, 0, 0, 0
        )
        trace = Trace()
        trace.commit(n, 1.0)
        return GenerationResult("", tokens, stats, trace, "length", list(prompt_ids), {})

    return Contender(variant, generate, "cpu", None, 1)


def test_run_interleaves_and_feeds_the_first_answer_to_turn_two(bench_tokenizer):
    first = BenchPrompt("q1/turn1", ({"role": "user", "content": "Write a poem."},), text="Write a poem.")
    prompts = [
        first,
        BenchPrompt(
            "q1/turn2",
            first.messages + ({"role": "assistant", "content": None}, {"role": "user", "content": "Shorter."}),
            answer_of=first.id,
        ),
        BenchPrompt("q2/turn1", ({"role": "user", "content": "Hi."},), text="Hi."),
    ]
    variants = [Variant("sd"), Variant("ar"), Variant("hf-ar")]
    calls = []
    contenders = [fake_contender(v, calls, bench_tokenizer) for v in variants]
    config = BenchConfig(
        EngineConfig("t", "d", strategy="sd"), variants, SamplingParams(max_new_tokens=8), progress=False
    )
    result = _run(config, prompts, bench_tokenizer, True, contenders, "two-turn", 4096)

    expected_ids = [
        encode_prompt(bench_tokenizer, prompts[0].as_input(True)),
        encode_prompt(bench_tokenizer, prompts[1].as_input(True, {prompts[0].id: "ANSWER"})),
    ]
    assert [name for name, _ in calls] == [v.name for _, v in interleave(3, variants)]
    for k, (_, ids) in enumerate(calls[:6]):  # every variant got the very same prompt ids
        assert ids == expected_ids[k // 3]
    assert "ANSWER<|im_end|>" in bench_tokenizer.decode(expected_ids[1])  # ar's answer, not sd's "other"
    assert [r.prompt_id for r in result.records][:3] == ["q1/turn1"] * 3
    assert result.prompt_ids[:2] == expected_ids
    assert len(result.records) == 9 and result.contenders["ar"]["threads"] == "1"


def test_run_refuses_prompts_that_leave_no_room(bench_tokenizer):
    prompts = [BenchPrompt("long", ({"role": "user", "content": "x" * 100},), text="x" * 100)]
    calls = []
    config = BenchConfig(EngineConfig("t"), [Variant("ar")], SamplingParams(max_new_tokens=50), progress=False)
    with pytest.raises(ValueError, match="needs a context of 150, but the models hold 120"):
        _run(config, prompts, bench_tokenizer, False, [fake_contender(Variant("ar"), calls, bench_tokenizer)], "x", 120)
    assert calls == []


def test_bracket_variants_get_their_own_engine_on_the_shared_models(bench_target, bench_draft):
    from paraspec.bench.runner import build_contenders

    config = BenchConfig(
        EngineConfig(bench_target, str(bench_draft), strategy="sd", dtype="float32"),
        parse_variants("ar,sd,sd[model]", [1, 2]),
        SamplingParams(max_new_tokens=4),
        progress=False,
    )
    contenders, engines, _ = build_contenders(config)
    try:
        assert [c.variant.name for c in contenders] == [
            "ar@1t",
            "ar@2t",
            "sd@1t",
            "sd@2t",
            "sd[model]@1t",
            "sd[model]@2t",
        ]
        assert len(engines) == 3  # one per (strategy, drafters), not per thread
        ar, sd, sd_model = engines
        assert sd is not sd_model and sd.draft is sd_model.draft and sd.target is ar.target  # one copy each
        settings = {c.variant.name: c.settings for c in contenders}
        assert settings["sd[model]@2t"]["draft"] == [str(bench_draft)] and settings["ar@1t"]["draft"] == []
        # the devices column says where a variant really runs: @Nt on every core this process may use
        devices = {c.variant.name: c.devices for c in contenders}
        everywhere = "cpu:" + ",".join(map(str, sorted(os.sched_getaffinity(0))))
        assert devices["ar@2t"] == f"{everywhere} (in-process)"
        assert devices["sd@2t"] == f"{everywhere} (in-process, target and draft)"
        ids = list(range(5, 20))
        tokens = {
            c.variant.name: c.generate(ids, SamplingParams(max_new_tokens=6), False).token_ids for c in contenders
        }
        assert len(set(map(tuple, tokens.values()))) == 1
    finally:
        for engine in engines:
            engine.close()


def test_model_free_variants_need_no_draft_checkpoint(bench_target):
    """sd[suffix] drafts without a model: the bench builds it without --draft (the variant's drafters are in its
    config before the config is checked)."""
    bench = BenchConfig(
        EngineConfig(bench_target, dtype="float32"),
        [],
        SamplingParams(max_new_tokens=4),
        options={"adaptive": True, "lookahead": 8},
    )
    config = variant_engine_config(bench, Variant("sd", 2, ("suffix",)))
    assert config.draft == "suffix" and config.options == {"adaptive": True, "lookahead": 8}
    assert variant_engine_config(bench, Variant("ar", 2)).draft is None
    with pytest.raises(ValueError, match="needs a draft model"):
        variant_engine_config(bench, Variant("sd", 2))
