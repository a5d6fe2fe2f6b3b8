"""EasySpec studies on a tiny model: the similarity table is 1 where layer-parallel == exact and below 1 elsewhere; the
ablation produces one row per configuration and two PNG plots; the CLI wires both."""

import json

import pytest
import torch

from paraspec import Engine, SamplingParams
from paraspec.cli.main import main
from paraspec.models.loader import load_native
from paraspec.study.layer_parallel_drafting import ablation, plot_ablation, similarity, similarity_table


def test_similarity_is_one_for_exact_and_lower_for_layer_parallel(deep_pair):
    draft = load_native(deep_pair[1], torch.float32)
    rows = similarity(
        draft, [list(range(10, 30)), list(range(40, 52))], layer_parallel_sizes=(1, 2, 4), tokens_per_prompt=5
    )
    by_size = {r["layer_parallel_size"]: r for r in rows}
    for quantity in ("hidden", "attn", "q", "k", "v"):
        assert by_size[1][quantity] == pytest.approx(1.0, abs=1e-5)
        assert by_size[4][quantity] < by_size[2][quantity] < 1.0 - 1e-4
    assert "| 2 |" in similarity_table(rows)


def test_ablation_rows_and_plots(deep_pair, tmp_path):
    factory = lambda: Engine(*deep_pair, strategy="easyspec", dtype="float32")
    rows = ablation(
        factory,
        ["def f(x):"],
        SamplingParams(max_new_tokens=8),
        widths=(1, 3),
        layer_parallel_sizes=(1, 2),
        calibrations=(True, False),
        tree_depth=3,
    )
    assert len(rows) == 8 and {r["tree_width"] for r in rows} == {1, 3}
    assert all(0 <= r["acceptance_rate"] <= 1 and r["ms_per_token"] > 0 for r in rows)
    # layer-parallel size 1 is the exact draft: calibration on or off drafts the same tokens, so acceptance is the same
    size1 = {(r["tree_width"], r["calibration"]): r["acceptance_rate"] for r in rows if r["layer_parallel_size"] == 1}
    assert all(size1[(w, True)] == size1[(w, False)] for w in (1, 3))
    paths = plot_ablation(rows, tmp_path)
    assert [p.name for p in paths] == ["easyspec_ablation_acceptance_rate.png", "easyspec_ablation_ms_per_token.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_study_cli_similarity(deep_pair, tmp_path, monkeypatch, capsys):
    from paraspec.cli import study as study_cli

    monkeypatch.setattr(study_cli, "_prompts", lambda args, tok: [[{"role": "user", "content": "def f(x): return"}]])
    assert (
        main(
            [
                "study",
                "easyspec",
                "--draft",
                str(deep_pair[1]),
                "--layer-parallel-sizes",
                "2",
                "3",
                "--tokens-per-prompt",
                "4",
                "--dtype",
                "float32",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    rows = json.loads((tmp_path / "similarity.json").read_text())
    assert [r["layer_parallel_size"] for r in rows] == [2, 3]
    assert "| layer-parallel size |" in capsys.readouterr().out
