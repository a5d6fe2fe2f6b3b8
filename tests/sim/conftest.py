import pytest


@pytest.fixture
def profile_dict():
    """A profile as `paraspec profile` writes it (the schema documented in paraspec/sim/costs.py)."""
    return {
        "target": {
            "model": "t",
            "device": "cpu:1",
            "ttft_ms": 900.0,
            "tpot_ms": 376.0,
            "forward_ms": {"1": 376.0, "4": 390.0, "8": 410.0},
        },
        "draft": {
            "model": "d",
            "device": "cpu:0",
            "ttft_ms": 300.0,
            "tpot_ms": 133.0,
            "forward_ms": {"1": 133.0, "8": 152.0},
        },
        "acceptance_rate": 0.8,
        "mean_match_length": 4.0,
        "devices": ["cpu:0", "cpu:1"],
    }
