"""EasySpec across devices: each draft rank loads its replica on the device it was given."""

from types import SimpleNamespace

import torch

from paraspec.drafters import layer_parallel
from paraspec.drafters.layer_parallel import DeviceGroupDrafter, DraftRank
from paraspec.runtime.devices import Device


def test_a_draft_rank_loads_its_replica_on_its_device(monkeypatch):
    loads = []

    def load_model(spec, **kwargs):
        loads.append(kwargs)
        return SimpleNamespace(vocab_size=8, eos_token_ids=(0,), max_context=64)

    monkeypatch.setattr(layer_parallel, "load_model", load_model)
    monkeypatch.setattr(layer_parallel.ShmExchange, "attach", lambda *args, **kwargs: None)
    DraftRank("draft", "bfloat16", 64, [[0]], "segment", rank=1, world=2, max_bytes=1024, device="cuda:1")
    assert loads == [dict(dtype="bfloat16", max_context=64, device="cuda:1")]


def test_each_rank_worker_is_given_its_device():
    """The ranks past the first are workers of the strategy's Runtime: each gets its own device to load on."""
    started = {}

    class Runtime:
        def add_worker(self, name, device, factory, factory_args):
            started[name] = (device, factory, factory_args)
            return SimpleNamespace(wait_ready=lambda: None, alive=True)

    model = SimpleNamespace(
        vocab_size=8, max_context=16, dtype=torch.float32, cfg=SimpleNamespace(num_layers=4, hidden_size=8)
    )
    devices = [Device("cuda", index=0), Device("cuda", index=1), Device("cuda", index=3)]
    drafter = DeviceGroupDrafter(model, [[0], [1, 2], [3]], devices, "draft", Runtime())
    try:
        assert {name: (str(device), factory, args["device"]) for name, (device, factory, args) in started.items()} == {
            "draft1": ("cuda:1", DraftRank, "cuda:1"),
            "draft2": ("cuda:3", DraftRank, "cuda:3"),
        }
    finally:
        drafter.close()
