import argparse
import json

import pytest

from paraspec.cli.simulate import add_commands


@pytest.fixture
def parser():
    p = argparse.ArgumentParser(prog="paraspec")
    add_commands(p.add_subparsers(dest="command", required=True))
    return p


def run(parser, *argv):
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_every_command_sets_func(parser):
    for argv in (
        ["simulate", "heatmap", "--out", "x"],
        ["simulate", "table1"],
        ["simulate", "point", "--c", "0.1", "--a", "0.5", "--k", "3"],
        ["plan", "--profile", "p.json"],
    ):
        assert callable(parser.parse_args(argv).func)


def test_point_prints_the_three_costs(parser, capsys):
    assert (
        run(
            parser,
            "simulate",
            "point",
            "--c",
            "0.05",
            "--a",
            "0.5",
            "--k",
            "5",
            "--tokens",
            "200",
            "--repeats",
            "2",
            "--events",
        )
        == 0
    )
    out = capsys.readouterr().out
    for word in ("non-SI", "SI", "DSI", "needs 4 target servers", "event simulator", "amusd"):
        assert word in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--c", "0", "--a", "0.5", "--k", "5"], r"c=0.0 is outside (0, 1]"),
        (["--c", "1.2", "--a", "0.5", "--k", "5"], r"outside (0, 1]"),
        (["--c", "0.5", "--a", "1", "--k", "5"], r"a=1.0 is outside [0, 1)"),
        (["--c", "0.5", "--a", "0.5", "--k", "0"], "k=0 must be an integer >= 1"),
    ],
)
def test_point_bad_input_exits_2_naming_the_fix(parser, capsys, argv, message):
    assert run(parser, "simulate", "point", *argv) == 2
    assert message in capsys.readouterr().err


def test_table1_prints_the_ten_rows_in_three_models(parser, capsys):
    assert run(parser, "simulate", "table1", "--repeats", "20", "--event-repeats", "2") == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) == 1 + 10 + 1
    for word in (
        "Vicuna-7B",
        "Starcoder-168M",
        "Phi3-4B",
        "1.92x",
        "offline",
        "online",
        "events",
        "k/k/N",
        "variant paper",
    ):
        assert word in out
    assert run(parser, "simulate", "table1", "--restart-ms", "-1") == 2
    assert "--restart-ms -1.0 must be >= 0" in capsys.readouterr().err


def test_heatmap_writes_pngs_and_csv(parser, capsys, tmp_path):
    assert (
        run(parser, "simulate", "heatmap", "--ndim", "2", "--tokens", "50", "--repeats", "1", "--out", str(tmp_path))
        == 0
    )
    names = {p.name for p in tmp_path.iterdir()}
    assert {"si_vs_nonsi.png", "dsi_vs_si.png", "dsi_vs_nonsi.png", "dsi_vs_baseline.png", "heatmap.csv"} <= names
    assert (tmp_path / "dsi_vs_si.png").read_bytes()[:4] == b"\x89PNG"
    assert len((tmp_path / "heatmap.csv").read_text().splitlines()) == 1 + 3 * 3
    assert "SI is slower than non-SI" in capsys.readouterr().out
    assert (
        run(
            parser,
            "simulate",
            "heatmap",
            "--ndim",
            "2",
            "--tokens",
            "50",
            "--repeats",
            "1",
            "--lookahead",
            "5",
            "--out",
            str(tmp_path),
        )
        == 0
    )
    assert (tmp_path / "dsi_vs_baseline_k5.png").exists()
    assert run(parser, "simulate", "heatmap", "--lookahead", "0", "--out", str(tmp_path)) == 2


def test_plan_from_a_profile_file(parser, capsys, tmp_path, profile_dict):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_dict))
    assert run(parser, "plan", "--profile", str(path), "--tokens", "24", "--json") == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["recommended"]["strategy"] in {"ar", "sd", "amusd", "dsi"}
    assert plan["strategies"]["ar"]["tpot_ms"] == pytest.approx(376.0)


def test_plan_from_flags(parser, capsys):
    assert (
        run(
            parser,
            "plan",
            "--target-tpot-ms",
            "376",
            "--draft-tpot-ms",
            "300",
            "--acceptance-rate",
            "0.3",
            "--devices",
            "cpu:0",
            "cpu:1",
            "--tokens",
            "24",
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "recommended: ar" in out and "speculation does not pay" in out


def test_plan_with_devices_on_other_nodes(parser, capsys):
    assert (
        run(
            parser,
            "plan",
            "--target-tpot-ms",
            "60",
            "--draft-tpot-ms",
            "3",
            "--acceptance-rate",
            "0.8",
            "--devices",
            "cpu:0",
            "cpu:1",
            "nodeB/cpu:0",
            "--link-ms",
            "2",
            "--tokens",
            "64",
            "--json",
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["remote_break_even_ms"] is not None
    assert any("2 ms more across nodes" in n for n in plan["notes"])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--target-tpot-ms", "376"], "missing --draft-tpot-ms, --acceptance-rate, --devices"),
        (["--profile", "p.json", "--acceptance-rate", "0.5"], "either --profile or"),
        (["--profile", "/nonexistent/profile.json"], "cannot read profile"),
        (
            ["--target-tpot-ms", "376", "--draft-tpot-ms", "100", "--acceptance-rate", "1.5", "--devices", "cpu:0"],
            "--acceptance-rate 1.5 must be in [0, 1)",
        ),
        (
            ["--target-tpot-ms", "-1", "--draft-tpot-ms", "100", "--acceptance-rate", "0.5", "--devices", "cpu:0"],
            "--target-tpot-ms -1.0 must be positive",
        ),
    ],
)
def test_plan_bad_input_exits_2(parser, capsys, argv, message):
    assert run(parser, "plan", *argv) == 2
    assert message in capsys.readouterr().err


def test_plan_profile_missing_field_exits_2(parser, capsys, tmp_path, profile_dict):
    d = profile_dict
    del d["target"]["tpot_ms"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    assert run(parser, "plan", "--profile", str(path)) == 2
    assert "missing target.tpot_ms" in capsys.readouterr().err
