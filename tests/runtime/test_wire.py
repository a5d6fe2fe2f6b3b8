"""Message framing: tensors and arrays keep dtype, shape and values, and arrive writable."""

import threading

import numpy as np
import pytest
import torch

from paraspec.runtime.wire import Wire, wire_pair


@pytest.fixture
def ends():
    ours, theirs = wire_pair()
    other = Wire(theirs)
    yield ours, other
    ours.close()
    other.close()


@pytest.mark.parametrize(
    "value",
    [
        torch.tensor(3.5),
        torch.zeros(0, 5),
        torch.arange(12).reshape(3, 4).t(),
        torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        torch.tensor([True, False]),
        torch.randn(4, requires_grad=True),
        torch.randn(8, 151_936),
    ],
)
def test_tensors_round_trip(ends, value):
    ours, other = ends
    sender = threading.Thread(target=ours.send, args=(("reply", 7), {"logits": value}))
    sender.start()  # 4.9 MB do not fit the socket buffer: read while it writes
    envelope, load = other.recv()
    sender.join()
    got = load()["logits"]
    assert envelope == ("reply", 7)
    assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value.detach())
    got.fill_(0)  # writable, not a view of a read-only buffer


def test_numpy_stays_numpy(ends):
    ours, other = ends
    ours.send(("x",), (np.arange(5, dtype=np.int32), [1, "a"]))
    array, rest = other.recv()[1]()
    assert isinstance(array, np.ndarray) and array.dtype == np.int32 and array.tolist() == [0, 1, 2, 3, 4]
    assert rest == [1, "a"]


def test_eof_when_the_other_end_closes(ends):
    ours, other = ends
    ours.close()
    with pytest.raises(EOFError):
        other.recv()
