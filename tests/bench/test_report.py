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
    records = [record(ar1, 0, [1, 2, 3], stats(10, 4.0), margins={2: 0.031}),
               record(ar2, 0, [1, 2, 3], stats(10, 2.0)),
               record(amusd, 0, [1, 2, 7], stats(10, 1.0, drafted=8, accepted=6, rounds=3, speculative=True),
                      margins={2: 0.029})]
    contenders = {"ar@1t": {"strategy": "ar", "devices": "target cpu", "threads": "1", "cores": 1,
                            "dtype": "float32", "settings": {}},
                  "ar@2t": {"strategy": "ar", "devices": "target cpu", "threads": "2", "cores": 2,
                            "dtype": "float32", "settings": {}},
                  "amusd": {"strategy": "amusd", "devices": "target cpu:1, draft cpu:0", "threads": "2 (workers)",
                            "cores": 2, "dtype": "float32", "settings": {"max_ahead": 16}}}
    config = BenchConfig(EngineConfig("T", "D", strategy="sd"), variants, SamplingParams(max_new_tokens=10),
                         options={"max_ahead": 16})
    result = BenchResult("demo", config, [BenchPrompt("p0", ())], [[0]], True, records, contenders)
    rows = summarize(records, variants, True, {v: contenders[v.name]["cores"] for v in variants})
    table = markdown_table(result, rows)
    lines = table.splitlines()
    assert lines[0] == "### demo: 1 prompts × 10 new tokens, greedy, dtype auto (paraspec float32)"
    assert "chat template on; amusd: max_ahead=16" in lines[2]
    header = next(line for line in lines if line.startswith("| strategy"))
    assert "| × vs ar@1t |" in header
    amusd_row = next(line for line in lines if line.startswith("| amusd |")).split(" | ")
    assert amusd_row[1:5] == ["target cpu:1, draft cpu:0", "2 (workers)", "100.0", "10.00"]
    assert amusd_row[5] == "2.00×" and amusd_row[7] == "4.00×"       # vs ar@2t (same cores), vs ar@1t
    assert amusd_row[-1].strip(" |") == "0/1"
    assert "- amusd on p0 at output token 2: ar@2t 3 vs 7, gap — (ar@2t) / 0.0290 (amusd)" in table


def test_a_reference_on_other_cores_is_named():
    ar1, sd2 = Variant("ar", 1), Variant("sd", 2)
    records = [record(ar1, 0, [1], stats(10, 2.0)), record(sd2, 0, [1], stats(10, 1.0))]
    contenders = {"ar@1t": {"strategy": "ar", "devices": "cpu", "threads": "1", "cores": 1, "dtype": "float32",
                            "settings": {}},
                  "sd@2t": {"strategy": "sd", "devices": "cpu", "threads": "2", "cores": 2, "dtype": "float32",
                            "settings": {}}}
    config = BenchConfig(EngineConfig("T", "D", strategy="sd"), [ar1, sd2], SamplingParams(max_new_tokens=10))
    result = BenchResult("demo", config, [BenchPrompt("p0", ())], [[0]], False, records, contenders)
    table = markdown_table(result, summarize(records, [ar1, sd2], True, {ar1: 1, sd2: 2}))
    sd_row = next(line for line in table.splitlines() if line.startswith("| sd@2t |")).split(" | ")
    assert sd_row[5] == "2.00× (vs ar@1t)"
