"""The layer-parallel forward's all-gather on a GPU: attention outputs leave the device for the exchange's shared
memory and come back to the hidden state's device. tests/fake_cuda.py raises where CUDA would mix devices."""

import torch

from paraspec.models.native.layer_parallel import _gather
from tests.fake_cuda import fake_cuda


class TwoRanks:
    """Rank 0 of 2 over shared memory (CPU tensors only, as ShmExchange): rank 1 sends ones."""

    rank, world = 0, 2

    def all_gather(self, tensor):
        assert type(tensor) is torch.Tensor and tensor.device.type == "cpu"
        return [tensor.clone(), torch.ones_like(tensor)]


def test_gathered_attention_outputs_are_added_on_the_hidden_states_device():
    group = [1, 2, 3]  # rank 0 computes layers 1 and 3, rank 1 layer 2
    with fake_cuda() as cuda:
        h = cuda.tensor(torch.zeros(2, 4))
        mine = {1: cuda.tensor(torch.full((2, 4), 1.0)), 3: cuda.tensor(torch.full((2, 4), 3.0))}
        gathered = _gather(TwoRanks(), group, mine, 2, h)
        assert all(gathered[i].device == h.device for i in group)
        for i in group:  # as layer_parallel_forward adds them
            h = h + gathered[i]
        assert torch.equal(h.cpu(), torch.full((2, 4), 5.0))
