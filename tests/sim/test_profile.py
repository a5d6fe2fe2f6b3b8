import json

import pytest

from paraspec.sim.costs import ForwardCost, Profile


def test_forward_cost_interpolates_and_extends_the_measured_points():
    cost = ForwardCost.from_ms(376.0, {"1": 376.0, "4": 390.0, "8": 410.0})
    assert cost(1) == pytest.approx(0.376)
    assert cost(2) == pytest.approx(0.376 + 0.014 / 3)
    assert cost(8) == pytest.approx(0.410)
    assert cost(12) == pytest.approx(0.410 + 4 * 0.005)  # slope of the last two points


def test_forward_cost_falls_back_to_tpot_and_a_line():
    only_tpot = ForwardCost.from_ms(100.0, None, per_token_fraction=0.02)
    assert only_tpot(1) == pytest.approx(0.1)
    assert only_tpot(11) == pytest.approx(0.1 * (1 + 0.02 * 10))
    wide_only = ForwardCost.from_ms(100.0, {"8": 120.0})  # n = 1 comes from tpot
    assert wide_only(1) == pytest.approx(0.1) and wide_only(8) == pytest.approx(0.12)
    assert ForwardCost.constant(0.5)(1000) == 0.5
    with pytest.raises(ValueError, match="at least one token"):
        only_tpot(0)


def test_profile_reads_the_documented_schema(tmp_path, profile_dict):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_dict))
    p = Profile.load(path)
    assert p.target.tpot_ms == 376.0 and p.draft.device == "cpu:0"
    assert p.acceptance_rate == 0.8 and p.devices == ("cpu:0", "cpu:1") and p.mean_match_length == 4.0
    assert p.target.cost()(4) == pytest.approx(0.390)
    no_forward = json.loads(json.dumps(profile_dict))
    del no_forward["draft"]["forward_ms"]
    assert Profile.from_dict(no_forward).draft.cost()(1) == pytest.approx(0.133)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: d["target"].pop("tpot_ms"), r"missing target\.tpot_ms"),
        (lambda d: d.pop("draft"), "missing draft"),
        (lambda d: d.pop("acceptance_rate"), "missing acceptance_rate"),
        (lambda d: d.update(acceptance_rate=1.0), r"must be in \[0, 1\)"),
        (lambda d: d["draft"].update(tpot_ms=-3), "must be positive"),
        (lambda d: d["target"].update(forward_ms={"eight": 1.0}), "token count"),
    ],
)
def test_profile_errors_name_the_field(mutate, match, profile_dict):
    d = json.loads(json.dumps(profile_dict))
    mutate(d)
    with pytest.raises(ValueError, match=match):
        Profile.from_dict(d)


def test_profile_file_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot read profile"):
        Profile.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Profile.load(bad)
