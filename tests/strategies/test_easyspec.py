"""easyspec: greedy equality with ar (chain and tree, layer-parallel sizes 1-3, calibration on/off, one device and two
worker processes), layer-parallel size 1 == exact, calibration rebuilds the exact draft cache, sampling distribution."""

import os
import signal
import time

import numpy as np
import pytest
import torch

from paraspec import Engine, SamplingParams
from paraspec.drafters.layer_parallel import DeviceGroupDrafter, LayerParallelDrafter
from paraspec.models.loader import load_native
from paraspec.models.native.decoder import NativeModel
from paraspec.models.native.layer_parallel import (
    exact_forward,
    layer_parallel_forward,
    layer_parallel_groups,
    parse_layer_groups,
)
from paraspec.runtime import Runtime, WorkerDied, WorkerError
from tests.conftest import PROMPT, VOCAB, assert_matches, exact_joint
from tests.tiny import make_checkpoint

DEVICES = ["cpu:0", "cpu:1"]


def format_groups(groups: list[list[int]]) -> str:
    """parse_layer_groups's notation: `0,1-2,3-4,5`."""
    return ",".join(str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in groups)


def test_layer_groups():
    assert layer_parallel_groups(1, 6) == [[0], [1], [2], [3], [4], [5]]
    assert layer_parallel_groups(3, 8) == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert layer_parallel_groups(4, 8) == [[0], [1, 2, 3, 4], [5, 6], [7]]
    assert parse_layer_groups("0,1-3,4-6,7", 8) == layer_parallel_groups(3, 8)
    assert format_groups(layer_parallel_groups(2, 6)) == "0,1-2,3-4,5"
    for bad in ("0,1-3,5-7", "0-2,1-7", "0,x,1-7"):
        with pytest.raises(ValueError, match="layer group"):
            parse_layer_groups(bad, 8)


def test_layer_parallel_size1_equals_exact_and_size2_differs(deep_pair):
    _, draft_dir = deep_pair
    model = load_native(draft_dir, torch.float32)
    other = NativeModel(model.decoder, model.max_context)
    ids = [5, 9, 14, 3, 22, 40, 41]
    exact = exact_forward(model, ids)
    parallel = layer_parallel_forward(other, ids, layer_parallel_groups(1, model.cfg.num_layers))
    assert torch.equal(exact, parallel)
    assert torch.equal(model.cache.k[:, :, :7], other.cache.k[:, :, :7])
    other.rollback(0)
    assert not torch.allclose(
        exact, layer_parallel_forward(other, ids, layer_parallel_groups(2, model.cfg.num_layers)), atol=1e-3
    )


@pytest.fixture(scope="module")
def ar_engine(deep_pair):
    with Engine(deep_pair[0], strategy="ar", dtype="float32") as engine:
        yield engine


@pytest.mark.parametrize("layer_parallel_size", [1, 2, 3])
@pytest.mark.parametrize("calibration", [True, False])
@pytest.mark.parametrize("tree_width", [1, 4])
def test_easyspec_greedy_equals_ar(ar_engine, deep_pair, layer_parallel_size, calibration, tree_width):
    params = SamplingParams(max_new_tokens=30)
    with Engine(
        *deep_pair,
        strategy="easyspec",
        dtype="float32",
        layer_parallel_size=layer_parallel_size,
        calibration=calibration,
        tree_width=tree_width,
        tree_depth=4,
    ) as engine:
        result = engine.generate(PROMPT, params)
    assert result.token_ids == ar_engine.generate(PROMPT, params).token_ids
    assert result.stats.rounds > 0 and 0 < result.stats.accepted < result.stats.drafted


def test_calibration_rebuilds_the_exact_cache(deep_pair):
    """After layer-parallel drafting and calibration, the draft cache equals one built by exact decoding of the same
    tokens; without calibration it does not."""
    _, draft_dir = deep_pair
    model = load_native(draft_dir, torch.float32)
    groups = layer_parallel_groups(2, model.cfg.num_layers)
    drafter = LayerParallelDrafter(model, groups)
    prompt, accepted, bonus = [5, 9, 14, 3], [22, 40], 41
    drafter.forward(prompt, exact=True)
    drafter.forward(accepted + [77])  # a layer-parallel chain: two kept drafts and a rejected one
    drafter.rollback(len(prompt))  # calibration: drop every layer-parallel entry...
    drafter.forward(accepted + [bonus], exact=True)  # ...and recompute the accepted tokens + the bonus
    reference = NativeModel(model.decoder, model.max_context)
    reference.prefill(prompt + accepted + [bonus])
    n = len(prompt) + len(accepted) + 1
    assert model.length == n
    # equal up to fp32 rounding of different batch shapes (values up to ~10 in this peaked tiny model)
    assert torch.allclose(model.cache.k[:, :, :n], reference.cache.k[:, :, :n], rtol=1e-5, atol=1e-4)
    assert torch.allclose(model.cache.v[:, :, :n], reference.cache.v[:, :, :n], rtol=1e-5, atol=1e-4)
    drafter.rollback(len(prompt))
    drafter.forward(accepted + [bonus])  # no calibration: layer-parallel entries stay
    assert not torch.allclose(model.cache.k[:, :, :n], reference.cache.k[:, :, :n], rtol=1e-2, atol=1e-2)


# -- two draft worker processes -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_device_engine(deep_pair):
    with Engine(*deep_pair, strategy="easyspec", dtype="float32", draft_devices=DEVICES) as engine:
        yield engine  # the tests set options between requests (set_options): a strategy reads them at each decode


@pytest.mark.parametrize(
    "layer_parallel_size,calibration,tree_width", [(2, True, 4), (3, False, 1), (3, True, 1), (2, False, 4)]
)
def test_easyspec_two_processes_equals_one(
    ar_engine, deep_pair, two_device_engine, layer_parallel_size, calibration, tree_width
):
    """Across two CPU worker processes: ar's tokens, and the very same drafts as on one device (the all-gather
    sums attention outputs in the same order, so layer-parallel logits are bit-identical)."""
    params = SamplingParams(max_new_tokens=30)
    options = dict(
        layer_parallel_size=layer_parallel_size, calibration=calibration, tree_width=tree_width, tree_depth=4
    )
    two_device_engine.set_options(**options)
    result = two_device_engine.generate(PROMPT, params)
    with Engine(*deep_pair, strategy="easyspec", dtype="float32", **options) as one:
        single = one.generate(PROMPT, params)
    assert result.token_ids == ar_engine.generate(PROMPT, params).token_ids
    assert (result.stats.accepted, result.stats.drafted) == (single.stats.accepted, single.stats.drafted)


def test_replicas_hold_the_same_cache(two_device_engine):
    """After a request, rank 1's calibrated prefix equals rank 0's."""
    two_device_engine.set_options(layer_parallel_size=2, calibration=True, tree_width=4)
    two_device_engine.generate(PROMPT, SamplingParams(max_new_tokens=12))
    drafter = two_device_engine.strategy.device_group
    n = drafter.length
    k, v = drafter.workers[0].call("cache_entries", n)
    k0, v0 = drafter.model.cache_entries(n)
    assert torch.allclose(torch.as_tensor(k), k0, atol=1e-6)
    assert torch.allclose(torch.as_tensor(v), v0, atol=1e-6)


def test_killed_draft_rank_is_reported_and_nothing_leaks(deep_pair, shm_segments):
    before = shm_segments()
    model = load_native(deep_pair[1], torch.float32)
    with Runtime() as runtime:
        drafter = DeviceGroupDrafter(model, layer_parallel_groups(2, 6), DEVICES, str(deep_pair[1]), runtime)
        drafter.forward([1, 2, 3], exact=True)
        os.kill(drafter.workers[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerError):
            drafter.forward([4])
        assert time.monotonic() - start < 3.0
        drafter.close()
    assert shm_segments() <= before


def test_draft_ranks_are_the_engines_workers(ar_engine, deep_pair):
    """The ranks run in the strategy's own Runtime, under the Engine's watchdog: a killed rank is named by
    health(), the next request raises WorkerDied, and restart_workers() brings the ranks back."""
    with Engine(
        *deep_pair,
        strategy="easyspec",
        dtype="float32",
        draft_devices=DEVICES,
        runtime_kind="process",
        worker_timeout=30.0,
    ) as engine:
        runtime = engine.strategy.runtime
        assert runtime.worker_timeout == 30.0 and list(runtime.workers) == ["draft1"]
        assert engine.health() is None
        os.kill(runtime["draft1"].pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while engine.health() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "'draft1'" in engine.health()
        with pytest.raises(WorkerDied, match="draft1"):
            engine.generate(PROMPT, SamplingParams(max_new_tokens=8))
        engine.restart_workers()
        params = SamplingParams(max_new_tokens=12)
        assert engine.generate(PROMPT, params).token_ids == ar_engine.generate(PROMPT, params).token_ids


# -- sampling --------------------------------------------------------------------------------------------------

N_SAMPLES = 2_000


def test_easyspec_sampling_matches_target_distribution(tmp_path_factory):
    d = tmp_path_factory.mktemp("es-small-vocab")
    target = make_checkpoint(
        d / "t", "qwen2", seed=21, scale=5, tokenizer=False, vocab_size=VOCAB, eos_token_id=None, num_hidden_layers=4
    )
    draft = make_checkpoint(
        d / "d", "qwen2", seed=22, scale=5, tokenizer=False, vocab_size=VOCAB, eos_token_id=None, num_hidden_layers=4
    )
    prompt, sampling = [1, 2, 3], dict(temperature=1.0)
    with Engine(
        target,
        draft,
        strategy="easyspec",
        dtype="float32",
        layer_parallel_size=2,
        tree_width=3,
        tree_depth=2,
        calibration=False,
    ) as engine:
        joint = exact_joint(engine, prompt, SamplingParams(**sampling))
        counts, accepted = np.zeros((VOCAB, VOCAB)), 0
        for seed in range(N_SAMPLES):
            result = engine.generate(prompt, SamplingParams(max_new_tokens=3, seed=seed, **sampling))
            counts[result.token_ids[0], result.token_ids[1]] += 1
            accepted += result.stats.accepted
    assert 0.2 * N_SAMPLES < accepted < 1.8 * N_SAMPLES
    assert_matches(counts, joint)
