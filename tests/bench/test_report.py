"""The markdown table: one row per variant, references named where budgets differ, divergences listed."""

from paraspec.bench.datasets import BenchPrompt
from paraspec.bench.metrics import Variant, summarize
from paraspec.bench.report import markdown_table
from paraspec.bench.runner import BenchConfig, BenchResult
from paraspec.config import EngineConfig
from paraspec.sampling import SamplingParams
from tests.bench.conftest import record, stats


def test_table_rows_references_and_divergences():
    ar1, ar2, amusd = Variant("ar", 1), Variant("ar", 2), Variant("amusd")
    variants = [ar1, ar2, amusd]
    records = [
        record(ar1, 0, [1, 2, 3], stats(10, 4.0), margins={2: 0.031}),
        record(ar2, 0, [1, 2, 3], stats(10, 2.0)),
        record(
            amusd, 0, [1, 2, 7], stats(10, 1.0, drafted=8, accepted=6, rounds=3, speculative=True), margins={2: 0.029}
        ),
    ]
    contenders = {
        "ar@1t": {
            "strategy": "ar",
            "devices": "target cpu",
            "threads": "1",
            "cores": 1,
            "dtype": "float32",
            "settings": {},
        },
        "ar@2t": {
            "strategy": "ar",
            "devices": "target cpu",
            "threads": "2",
            "cores": 2,
            "dtype": "float32",
            "settings": {},
        },
        "amusd": {
            "strategy": "amusd",
            "devices": "target cpu:1, draft cpu:0",
            "threads": "2 (workers)",
            "cores": 2,
            "dtype": "float32",
            "settings": {"max_ahead": 16},
        },
    }
    config = BenchConfig(
        EngineConfig("T", "D", strategy="sd"), variants, SamplingParams(max_new_tokens=10), options={"max_ahead": 16}
    )
    result = BenchResult("demo", config, [BenchPrompt("p0", ())], [[0]], True, records, contenders)
    rows = summarize(records, variants, True, {v: contenders[v.name]["cores"] for v in variants})
    table = markdown_table(result, rows)
    lines = table.splitlines()
    assert lines[0] == "### demo: 1 prompts × 10 new tokens, greedy, dtype auto (paraspec float32)"
    assert "chat template on; amusd: max_ahead=16" in lines[2]
    header = next(line for line in lines if line.startswith("| strategy"))
    assert "| × vs ar@1t |" in header and "hf-assisted" not in header  # hf-assisted did not run: no column
    amusd_row = next(line for line in lines if line.startswith("| amusd |")).split(" | ")
    assert amusd_row[1:5] == ["target cpu:1, draft cpu:0", "2 (workers)", "100.0", "10.00"]
    assert amusd_row[5] == "2.00×" and amusd_row[6] == "4.00×"  # vs ar@2t (same cores), vs ar@1t
    assert amusd_row[-1].strip(" |") == "0/1"
    assert "- amusd on p0 at output token 2: ar@2t 3 vs 7, gap — (ar@2t) / 0.0290 (amusd)" in table


def test_a_reference_on_other_cores_is_named():
    ar1, sd2 = Variant("ar", 1), Variant("sd", 2)
    records = [record(ar1, 0, [1], stats(10, 2.0)), record(sd2, 0, [1], stats(10, 1.0))]
    contenders = {
        "ar@1t": {"strategy": "ar", "devices": "cpu", "threads": "1", "cores": 1, "dtype": "float32", "settings": {}},
        "sd@2t": {"strategy": "sd", "devices": "cpu", "threads": "2", "cores": 2, "dtype": "float32", "settings": {}},
    }
    config = BenchConfig(EngineConfig("T", "D", strategy="sd"), [ar1, sd2], SamplingParams(max_new_tokens=10))
    result = BenchResult("demo", config, [BenchPrompt("p0", ())], [[0]], False, records, contenders)
    table = markdown_table(result, summarize(records, [ar1, sd2], True, {ar1: 1, sd2: 2}))
    sd_row = next(line for line in table.splitlines() if line.startswith("| sd@2t |")).split(" | ")
    assert sd_row[5] == "2.00× (vs ar@1t)"


def two_prompt_result(records, variants, contenders, params):
    config = BenchConfig(EngineConfig("T", "D", strategy="sd"), variants, params)
    return BenchResult(
        "demo", config, [BenchPrompt("p0", ()), BenchPrompt("p1", ())], [[0], [0]], True, records, contenders
    )


def contender(strategy, threads="2"):
    return {
        "strategy": strategy,
        "devices": "cpu:0,1 (in-process)",
        "threads": threads,
        "cores": 2,
        "dtype": "float32",
        "settings": {},
    }


def table_columns(table):
    header = next(line for line in table.splitlines() if line.startswith("| strategy"))
    return [cell.strip() for cell in header.strip("|").split("|")]


def test_columns_no_variant_fills_are_left_out():
    """No hf-assisted: no `× vs hf-assisted`; no speculative variant: no acceptance or draft/verify columns;
    sampling: no `= ar` (there is no token check)."""
    ar, sd = Variant("ar", 2), Variant("sd", 2)
    records = [record(ar, i, [1], stats(10, 1.0)) for i in range(2)]
    contenders = {"ar@2t": contender("ar"), "sd@2t": contender("sd")}
    plain = two_prompt_result(records, [ar], contenders, SamplingParams(max_new_tokens=10))
    columns = table_columns(markdown_table(plain, summarize(records, [ar], True, {ar: 2})))
    assert columns == ["strategy", "devices", "threads", "ms/token", "tokens/s", "× vs ar", "TTFT ms", "TPOT ms"]
    records += [
        record(sd, i, [1], stats(10, 0.5, drafted=8, accepted=6, rounds=3, draft_s=0.1, verify_s=0.3, speculative=True))
        for i in range(2)
    ]
    sampled = two_prompt_result(records, [ar, sd], contenders, SamplingParams(temperature=0.8, max_new_tokens=10))
    columns = table_columns(markdown_table(sampled, summarize(records, [ar, sd], False, {ar: 2, sd: 2})))
    assert columns == [
        "strategy",
        "devices",
        "threads",
        "ms/token",
        "tokens/s",
        "× vs ar",
        "TTFT ms",
        "TPOT ms",
        "acceptance",
        "mean acc. len",
        "draft s/100 tok",
        "verify s/100 tok",
    ]
    greedy = two_prompt_result(records, [ar, sd], contenders, SamplingParams(max_new_tokens=10))
    assert table_columns(markdown_table(greedy, summarize(records, [ar, sd], True, {ar: 2, sd: 2})))[-1] == "= ar"


def test_tokens_per_second_is_the_same_figure_as_ms_per_token():
    """Two prompts at 100 and 300 ms/token: ms/token is their median, 200, and tokens/s says the same, 5.00 (the
    median of per-prompt tokens/s, 6.67, would contradict it)."""
    ar = Variant("ar", 2)
    records = [record(ar, 0, [1], stats(10, 1.0)), record(ar, 1, [1], stats(10, 3.0))]
    result = two_prompt_result(records, [ar], {"ar@2t": contender("ar")}, SamplingParams(max_new_tokens=10))
    rows = summarize(records, [ar], True, {ar: 2})
    assert rows[0]["ms_per_token"] == 200.0 and rows[0]["tokens_per_s"] == 5.0
    row = next(line for line in markdown_table(result, rows).splitlines() if line.startswith("| ar@2t |"))
    assert row.split(" | ")[3:5] == ["200.0", "5.00"]
