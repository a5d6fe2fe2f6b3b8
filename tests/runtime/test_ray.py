"""The Ray runtime: the same workers as Ray actors on a local ray.init(num_cpus=2); the token protocol and the
results are unchanged (dsi with simulated and with tiny real models), a killed actor is reported, close()
leaves no actor process and no shared-memory segment behind."""

import os
import signal
import time
from pathlib import Path

import pytest

ray = pytest.importorskip(
    "ray", reason="the Ray runtime is optional (pip install 'paraspec[ray]'); CI installs only .[test,bench]"
)

from paraspec import Engine, SamplingParams  # noqa: E402
from paraspec.models.simulated import SimulatedModel, SimulatedSpec  # noqa: E402
from paraspec.runtime import WorkerError  # noqa: E402
from paraspec.sim.costs import ForwardCost  # noqa: E402
from tests.conftest import PROMPT, error_while_running  # noqa: E402


def own_segments():
    """Shared-memory segments this test process created (other test runs on the machine create their own)."""
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(f"paraspec_{os.getpid()}_")}


@pytest.fixture(scope="module", autouse=True)
def local_ray(ray_cluster):
    """The session's Ray cluster (tests/conftest.py): every node is on this host, so these workers use shared
    memory wherever Ray puts them."""
    yield


def test_ray_runtime_joins_ray_or_names_the_fix(monkeypatch):
    """Without a running Ray the Ray runtime joins one (the address given, RAY_ADDRESS, or a local Ray); a cluster it
    cannot reach is an error that says how to start one."""
    from paraspec.runtime import Runtime

    joined = []

    def unreachable(address=None, **kwargs):
        joined.append(address)
        raise ConnectionError(f"could not connect to {address}")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", unreachable)
    with Runtime("ray", address="127.0.0.9:6379") as rt, pytest.raises(WorkerError, match="ray start --head"):
        rt.add_worker("w", "cpu", dict, {})
    assert joined == ["127.0.0.9:6379"]
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.8:6379")
    with Runtime("ray") as rt, pytest.raises(WorkerError, match="127.0.0.8:6379"):
        rt.add_worker("w", "cpu", dict, {})
    with pytest.raises(TypeError, match="takes no option"):
        with Runtime("process", address="127.0.0.9:6379") as rt:
            rt.add_worker("w", "cpu", dict, {})


def test_the_ray_paraspec_started_stops_with_its_last_worker(monkeypatch):
    """A Ray that paraspec joined or started itself (no Ray in the process before) is shut down when its last
    worker stops, so a local one's processes do not outlive the Engine; a Ray the caller initialised is left
    alone. (The actors run on the session's cluster: only the bookkeeping is faked.)"""
    import paraspec.runtime.ray_backend as ray_backend
    from paraspec.runtime import Runtime

    calls = []
    monkeypatch.setattr(ray_backend.ray, "shutdown", lambda: calls.append("shutdown"))
    with Runtime("ray") as rt:  # the caller's Ray (the fixture's): never shut down
        rt.add_worker("w", "cpu", dict, {})
        rt["w"].wait_ready(60)
    assert calls == []
    joined = []  # as if no Ray ran here until paraspec's ray.init
    monkeypatch.setattr(ray_backend.ray, "is_initialized", lambda: bool(joined))
    monkeypatch.setattr(ray_backend.ray, "init", lambda **kwargs: joined.append(1) or calls.append("init"))
    with Runtime("ray") as rt:
        rt.add_worker("a", "cpu", dict, {})
        rt.add_worker("b", "cpu", dict, {})
        rt["a"].wait_ready(60)
        rt["b"].wait_ready(60)
        rt["a"].close()
        assert calls == ["init"]  # one worker still runs on it
    assert calls == ["init", "shutdown"]


def test_dsi_with_simulated_models_and_a_killed_actor():
    before = own_segments()
    target = SimulatedSpec(seed=7, cost=ForwardCost.constant(0.002))
    draft = SimulatedSpec(role="draft", seed=7, acceptance_rate=0.6)
    engine = Engine(
        target, draft, strategy="dsi", runtime_kind="ray", target_devices=["cpu", "cpu"], lookahead=2, max_ahead=6
    )
    try:
        workers = engine.runtime.workers
        assert {w.kind for w in workers.values()} == {"ray"} and len({w.pid for w in workers.values()}) == 3
        assert os.getpid() not in {w.pid for w in workers.values()}
        result = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=80))
        assert result.token_ids == SimulatedModel(target).predicted[3:83].tolist()
        assert result.worker_reports["dsi"]["preempted"] > 0
        # long requests (simulated models have no tokenizer, so they run in a thread rather than as a stream)
        error, after_s = error_while_running(
            lambda: engine.generate([1, 2, 3], SamplingParams(max_new_tokens=3000)),
            lambda: os.kill(workers["target0"].pid, signal.SIGKILL),
        )
        assert isinstance(error, WorkerError) and "target0" in str(error)
        assert after_s < 3.0
    finally:
        pids = [w.pid for w in engine.runtime.workers.values()]
        engine.close()
    time.sleep(0.5)
    assert all(not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text() for pid in pids)
    assert own_segments() <= before


def test_dsi_with_tiny_real_models_equals_ar(qwen2_target, qwen2_partial):
    params = SamplingParams(max_new_tokens=24)
    with Engine(qwen2_target, strategy="ar", dtype="float32") as ar:
        expected = ar.generate(PROMPT, params).token_ids
    with Engine(
        qwen2_target,
        qwen2_partial,
        strategy="dsi",
        dtype="float32",
        runtime_kind="ray",
        target_devices=["cpu:1"],
        draft_devices=["cpu:0"],
        lookahead=3,
        max_ahead=6,
    ) as engine:
        assert engine.runtime["target0"].info.cores == (1,)  # the actor is pinned to its device
        assert engine.generate(PROMPT, params).token_ids == expected
