import json

import pytest

from paraspec.sim.costs import Profile
from paraspec.sim.planner import plan

ENGINE_STRATEGIES = {"ar", "sd", "amusd", "dsi"}


def make_profile(target_ms=376.0, draft_ms=133.0, a=0.8, devices=("cpu:0", "cpu:1")):
    return Profile.from_dict(
        {
            "target": {"model": "t", "device": devices[-1], "tpot_ms": target_ms, "ttft_ms": 900.0},
            "draft": {"model": "d", "device": devices[0], "tpot_ms": draft_ms, "ttft_ms": 300.0},
            "acceptance_rate": a,
            "devices": list(devices),
        }
    )


def quick(profile, **kw):
    return plan(profile, tokens=48, repeats=1, lookaheads=range(1, 5), **kw)


def test_fast_accurate_draft_recommends_speculation():
    p = quick(make_profile())
    assert set(p.choices) == ENGINE_STRATEGIES
    assert p.recommended.strategy in ENGINE_STRATEGIES - {"ar"}
    assert p.choices["ar"].tpot_ms == pytest.approx(376.0)
    assert p.recommended.tpot_ms < 0.8 * 376.0
    assert p.recommended.tpot_ms == min(c.tpot_ms for c in p.choices.values())
    assert p.choices["sd"].lookahead in range(1, 5)
    assert p.choices["amusd"].draft_device == "cpu:0" and p.choices["amusd"].target_devices == ("cpu:1",)
    assert "recommended:" in p.render() and "ms/token" in p.render()


def test_when_speculation_does_not_pay_it_says_so_and_picks_ar():
    p = quick(make_profile(draft_ms=300.0, a=0.3))
    assert p.choices["sd"].tpot_ms > p.choices["ar"].tpot_ms
    assert p.recommended.strategy == "ar"
    text = p.render()
    assert "sd is slower than ar" in text and "speculation does not pay" in text


def test_one_device_rules_out_the_concurrent_strategies():
    p = quick(make_profile(devices=("cpu:0",)))
    assert p.choices["amusd"] is None and p.choices["dsi"] is None
    assert p.recommended.strategy in {"ar", "sd"}
    assert any("different devices" in n for n in p.notes)


def test_dsi_servers_come_from_the_devices():
    devices = tuple(f"cuda:{i}" for i in range(5))
    p = quick(make_profile(target_ms=20.0, draft_ms=2.0, a=0.8, devices=devices))
    dsi = p.choices["dsi"]
    assert 1 <= dsi.servers <= 4 and len(dsi.target_devices) == dsi.servers
    assert dsi.draft_device == "cuda:0" and "cuda:0" not in dsi.target_devices
    # many servers pay with a drafter 10x faster than the target (the paper's regime)
    assert dsi.servers >= 2 and dsi.tpot_ms < p.choices["sd"].tpot_ms


def test_plan_is_json_serialisable():
    d = json.loads(json.dumps(quick(make_profile()).to_dict()))
    assert d["recommended"]["strategy"] in ENGINE_STRATEGIES
    assert set(d["strategies"]) == ENGINE_STRATEGIES


def test_plan_rejects_bad_settings():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        plan(make_profile(), tokens=1)
    with pytest.raises(ValueError, match="comm_ms"):
        plan(make_profile(), comm_ms=-1)


def test_remote_servers_come_after_local_ones_and_the_break_even_is_stated():
    devices = ("cpu:0", "cpu:1", "nodeB/cpu:0", "nodeC/cpu:0")
    p = quick(make_profile(target_ms=60.0, draft_ms=6.0, a=0.8, devices=devices), link_ms=1.0)
    dsi = p.choices["dsi"]
    assert dsi.target_devices[0] == "cpu:1"  # the caller's node first
    assert p.remote_break_even_ms is not None and p.remote_break_even_ms >= 1.0
    assert any("remote target servers pay while" in n for n in p.notes)
    assert json.loads(json.dumps(p.to_dict()))["remote_break_even_ms"] == p.remote_break_even_ms


def test_a_slow_link_makes_remote_servers_useless():
    devices = ("cpu:0", "cpu:1", "nodeB/cpu:0", "nodeC/cpu:0")
    fast = quick(make_profile(target_ms=60.0, draft_ms=6.0, a=0.8, devices=devices), link_ms=0.0)
    slow = quick(make_profile(target_ms=60.0, draft_ms=6.0, a=0.8, devices=devices), link_ms=200.0)
    # at 0 ms remote servers are as good as local ones; at 200 ms per message dsi keeps to the caller's node
    assert fast.choices["dsi"].servers >= 2
    assert all("/" not in d for d in slow.choices["dsi"].target_devices)
    assert slow.remote_break_even_ms == fast.remote_break_even_ms  # a property of the profile, not of link_ms


def test_a_drafter_on_another_node_is_refused():
    with pytest.raises(ValueError, match="caller's node"):
        quick(make_profile(devices=("nodeB/cpu:0", "cpu:1")))
