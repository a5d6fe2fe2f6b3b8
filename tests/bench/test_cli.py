"""Smoke runs of `paraspec bench` and `paraspec profile` on tiny models: every output is written and sane."""

import json
import os

import pytest

from paraspec.cli.main import build_parser, main
from paraspec.runtime.devices import available_cores

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ONE_CORE = f"cpu:{available_cores()[0]}"  # one thread per model: no oversubscription on a busy machine


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory, bench_target, bench_draft):
    out = tmp_path_factory.mktemp("bench")
    code = main(
        [
            "bench",
            "--target",
            str(bench_target),
            "--draft",
            str(bench_draft),
            "--dtype",
            "float32",
            "--strategies",
            "ar,sd,hf-ar,hf-assisted",
            "--threads",
            "1",
            "--dataset",
            "humaneval",
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "12",
            "--lookahead",
            "3",
            "--no-adaptive",
            "--out",
            str(out),
            "--no-progress",
        ]
    )  # fixed lengths: the tiny draft is judged every round
    assert code == 0
    return out


def test_bench_prints_and_writes_the_table(bench_out, capsys):
    table = (bench_out / "report.md").read_text()
    assert (
        "### humaneval: 2 prompts × 12 new tokens, greedy, dtype float32 (paraspec float32, transformers "
        "float32)" in table
    )
    header = next(line for line in table.splitlines() if line.startswith("| strategy"))
    for column in (
        "devices",
        "threads",
        "ms/token",
        "tokens/s",
        "× vs ar",
        "× vs hf-assisted",
        "TTFT ms",
        "TPOT ms",
        "acceptance",
        "mean acc. len",
        "draft s/100 tok",
        "verify s/100 tok",
        "= ar",
    ):
        assert f"| {column} |" in header
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ")
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| strategy")
    }
    assert list(rows) == ["ar@1t", "sd@1t", "hf-ar@1t", "hf-assisted@1t"]
    assert rows["ar@1t"][-1].strip(" |") == "ref"
    for name in ("sd@1t", "hf-ar@1t", "hf-assisted@1t"):
        assert rows[name][-1].strip(" |") == "2/2", name  # greedy: every strategy returns ar's tokens
    everywhere = "cpu:" + ",".join(map(str, sorted(os.sched_getaffinity(0))))  # @Nt: every core it may use
    assert rows["sd@1t"][1] == f"{everywhere} (in-process, target and draft)" and rows["sd@1t"][2] == "1"
    assert rows["ar@1t"][1] == f"{everywhere} (in-process)"
    assert "; sd: lookahead=3" in table
    assert rows["hf-assisted@1t"][1].startswith("cpu (in-process, transformers)")


def test_bench_results_json(bench_out):
    results = json.loads((bench_out / "results.json").read_text())
    data = results["datasets"]["humaneval"]
    assert results["meta"]["variants"] == ["ar@1t", "sd@1t", "hf-ar@1t", "hf-assisted@1t"]
    assert [p["id"] for p in data["prompts"]] == ["HumanEval/0", "HumanEval/1"]
    records = data["records"]
    assert len(records) == 8
    assert [r["prompt_id"] for r in records[:4]] == ["HumanEval/0"] * 4  # interleaved
    ar = {r["prompt_id"]: r["token_ids"] for r in records if r["variant"] == "ar@1t"}
    for r in records:
        assert len(r["token_ids"]) == 12 and r["token_ids"] == ar[r["prompt_id"]]
        assert r["stats"]["new_tokens"] == 12 and r["trace"]["progress"][-1][1] == 12
        assert r["trace"]["events"] and r["margins"]
    summary = {row["variant"]: row for row in data["summary"]}
    assert summary["sd@1t"]["acceptance_rate"] is not None and summary["ar@1t"]["acceptance_rate"] is None
    assert data["variants"]["hf-assisted@1t"]["dtype"] == "float32"


def test_bench_writes_both_plots(bench_out):
    for name in ("humaneval-progress.png", "humaneval-timeline.png"):
        data = (bench_out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name


def test_bench_flag_errors(capsys, bench_target, tmp_path):
    code = main(["bench", "--target", str(bench_target), "--strategies", "ar,sd", "--out", str(tmp_path)])
    assert code == 2 and "sd need a draft model; pass --draft" in capsys.readouterr().err
    code = main(["bench", "--target", str(bench_target), "--strategies", "ar,nope", "--out", str(tmp_path)])
    assert code == 2 and "unknown strategy 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--target", "t", "--threads", "0", "--out", "x"])


def test_profile_cli_writes_the_json(tmp_path, bench_target, bench_draft):
    path = tmp_path / "profile.json"
    code = main(
        [
            "profile",
            "--target",
            str(bench_target),
            "--draft",
            str(bench_draft),
            "--dtype",
            "float32",
            "--num-prompts",
            "1",
            "--tokens",
            "4",
            "--match-tokens",
            "8",
            "--widths",
            "1,4",
            "--target-devices",
            ONE_CORE,
            "--draft-devices",
            ONE_CORE,
            "--out",
            str(path),
        ]
    )
    profile = json.loads(path.read_text())
    assert code == 0 and set(profile["target"]["forward_ms"]) == {"1", "4"}
    assert profile["target"]["model"] == str(bench_target) and profile["draft"]["model"] == str(bench_draft)
    assert profile["target"]["device"] == ONE_CORE and profile["devices"] == [ONE_CORE]


def test_bench_runs_every_registered_strategy(tmp_path, bench_target, bench_draft):
    """`all` picks up whatever the registry holds (worker strategies included), with no change here."""
    from paraspec.strategies import STRATEGIES

    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench",
                "--target",
                str(bench_target),
                "--draft",
                str(bench_draft),
                "--dtype",
                "float32",
                "--strategies",
                "all",
                "--dataset",
                str(prompts),
                "--num-prompts",
                "1",
                "--max-new-tokens",
                "8",
                "--target-devices",
                ONE_CORE,
                "--draft-devices",
                ONE_CORE,
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    summary = json.loads((out / "results.json").read_text())["datasets"][str(prompts)]["summary"]
    assert [row["strategy"] for row in summary] == list(STRATEGIES)
    assert all(row["identical"] == 1 for row in summary if row["strategy"] != "ar")


def test_bench_runs_prompt_lookup_on_code_edit(tmp_path, bench_target):
    """No draft model needed; transformers' settings are recorded; greedy tokens equal ar's."""
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench",
                "--target",
                str(bench_target),
                "--dtype",
                "float32",
                "--strategies",
                "ar,hf-prompt-lookup",
                "--threads",
                "1",
                "--dataset",
                "code-edit",
                "--num-prompts",
                "1",
                "--max-new-tokens",
                "8",
                "--hf-prompt-lookup-tokens",
                "3",
                "--hf-prompt-lookup-ngram",
                "4",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    data = json.loads((out / "results.json").read_text())["datasets"]["code-edit"]
    assert [p["id"] for p in data["prompts"]] == ["code-edit/HumanEval/0"]
    settings = data["variants"]["hf-prompt-lookup@1t"]["settings"]
    assert settings["prompt_lookup_num_tokens"] == 3 and settings["max_matching_ngram_size"] == 4
    summary = {row["variant"]: row for row in data["summary"]}
    assert summary["hf-prompt-lookup@1t"]["identical"] == 1
