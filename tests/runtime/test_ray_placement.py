"""The Ray options of a worker's actor, from its device (no Ray cluster needed): a GPU worker reserves one of Ray's
GPUs and still sees the node's GPUs by their own indices."""

import pytest

from paraspec.runtime.devices import Device
from paraspec.runtime.ray_backend import actor_options

NOSET = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}


def test_a_cpu_worker_reserves_nothing():
    assert actor_options(Device("cpu", cores=(0, 1))) == dict(name=None, max_concurrency=1, num_cpus=0)


@pytest.mark.parametrize("index", [0, 3])
def test_a_gpu_worker_reserves_one_gpu_and_keeps_the_nodes_numbering(index):
    assert actor_options(Device("cuda", index=index, node="gpu-box")) == dict(
        name=None, max_concurrency=1, num_cpus=0, num_gpus=1, runtime_env=NOSET
    )


def test_ray_takes_the_options():
    ray = pytest.importorskip("ray", reason="the Ray runtime is optional (pip install 'paraspec[ray]')")
    from paraspec.runtime.ray_backend import _WorkerActor

    options = actor_options(Device("cuda", index=1), node_id="ab" * 28)
    assert type(options["scheduling_strategy"]).__name__ == "NodeAffinitySchedulingStrategy"
    ray.remote(_WorkerActor).options(**options)  # raises on an option Ray does not take
    with pytest.raises(ValueError):
        ray.remote(_WorkerActor).options(**options, num_gpu=1)
