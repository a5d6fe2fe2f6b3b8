"""Messages between a caller and a worker over a stream socket: pickled control data, bulk arrays out-of-band.

A message is a small frame header, a protocol-5 pickle, then every large buffer raw: numpy arrays (and torch
tensors, sent as numpy arrays, bfloat16 as its int16 bits) are written straight from their memory and read
straight into a fresh writable bytearray that the unpickled array wraps, so a logits result costs one
user-space copy per side plus the kernel's socket copy. A shared-memory result arena would remove the socket
copy; for [8, 151936] float32 logits the socket path costs a few ms (see tests/runtime/test_latency.py), which
is small next to the forward pass that produced them.
"""

from __future__ import annotations

import io
import pickle
import socket
import struct
import sys
import threading
from collections.abc import Callable

import numpy as np

_HEADER = struct.Struct("<QQI")  # envelope bytes, body bytes, number of out-of-band buffers


def _tensor_from_numpy(array: np.ndarray, dtype: str):
    import torch

    if not array.flags.writeable:
        array = array.copy()
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == "torch.bfloat16" else tensor


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            tensor = obj.detach().cpu().contiguous()
            if tensor.dtype == torch.bfloat16:
                tensor = tensor.view(torch.int16)
            return _tensor_from_numpy, (tensor.numpy(), str(obj.dtype))
        return NotImplemented


def dumps(obj) -> tuple[bytes, list[memoryview]]:
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(obj)
    return out.getvalue(), [b.raw() for b in buffers]


class Wire:
    """One end of a socket pair carrying whole messages; send() is thread-safe, recv() is for one reader.

    A message is an envelope (a small tuple: what it is, which request) and a body (arguments, a result).
    The receiver gets the envelope at once and the body as a loader, so a body that cannot be unpickled
    (a module missing on this side, a channel already unlinked) fails only the request it belongs to.
    """

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, envelope: tuple, body=None) -> None:
        head = pickle.dumps(envelope, protocol=5)
        payload, buffers = dumps(body)
        header = _HEADER.pack(len(head), len(payload), len(buffers)) + struct.pack(
            f"<{len(buffers)}Q", *(b.nbytes for b in buffers)
        )
        with self._send_lock:
            self.sock.sendall(header + head + payload)
            for buffer in buffers:
                self.sock.sendall(buffer)

    def recv(self) -> tuple[tuple, Callable[[], object]]:
        """Block for the next message; return (envelope, load_body). EOFError when the other end is gone."""
        n_head, n_payload, n_buffers = _HEADER.unpack(self._recv_exact(_HEADER.size))
        sizes = struct.unpack(f"<{n_buffers}Q", self._recv_exact(8 * n_buffers)) if n_buffers else ()
        envelope = pickle.loads(self._recv_exact(n_head))
        payload = self._recv_exact(n_payload)
        buffers = [self._recv_exact(size) for size in sizes]
        return envelope, lambda: pickle.loads(payload, buffers=buffers)

    def _recv_exact(self, n: int) -> bytearray:
        out = bytearray(n)
        view = memoryview(out)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise EOFError("the other end of the worker connection closed")
            got += k
        return out

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def wire_pair() -> tuple[Wire, socket.socket]:
    """A connected pair: a Wire for this side and a raw socket to hand to the worker (process arg or thread)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Wire(ours), theirs
