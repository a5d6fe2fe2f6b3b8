"""A tiny deterministic Model for runtime tests, importable by spawned workers (built by `make_toy`).

Logits depend only on (position, token): row i of forward() is cos(arange(vocab) * (token + 1) + position),
so a test can recompute any answer locally. The "KV cache" is a list of tokens.
"""

from __future__ import annotations

import os
import sys
import time

import torch


class ToyModel:
    def __init__(self, vocab_size: int = 64, max_context: int = 512, eos_token_ids=(1,)):
        self.vocab_size, self.max_context, self.eos_token_ids = vocab_size, max_context, tuple(eos_token_ids)
        self.cache: list[int] = []

    @property
    def length(self) -> int:
        return len(self.cache)

    def logits_for(self, tokens, positions) -> torch.Tensor:
        t = torch.as_tensor(tokens, dtype=torch.float32)[:, None]
        p = torch.as_tensor(positions, dtype=torch.float32)[:, None]
        return torch.cos(torch.arange(self.vocab_size, dtype=torch.float32)[None, :] * (t + 1) + p)

    def prefill(self, token_ids):
        self.cache = []
        return self.forward(token_ids)[-1]

    def forward(self, token_ids, positions=None, tree_mask=None, last_n=None):
        token_ids = [int(t) for t in token_ids]
        if positions is None:
            positions = list(range(len(self.cache), len(self.cache) + len(token_ids)))
        if len(self.cache) + len(token_ids) > self.max_context:
            raise ValueError(f"cache full: {len(self.cache)} + {len(token_ids)} > {self.max_context}")
        self.cache.extend(token_ids)
        logits = self.logits_for(token_ids, positions)
        if tree_mask is not None:  # lets a test see that the mask arrived intact
            logits = logits + tree_mask.to(torch.float32).sum(dim=1, keepdim=True)
        return logits if last_n is None else logits[-last_n:]

    def rollback(self, length: int) -> None:
        del self.cache[length:]

    # --- test hooks -----------------------------------------------------------------------------------------
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def fail(self, message: str):
        raise ValueError(message)

    def echo(self, *args, **kwargs):
        return args, kwargs

    def big_logits(self, rows: int, vocab: int) -> torch.Tensor:
        return torch.full((rows, vocab), 0.5, dtype=torch.float32)

    def pid(self) -> int:
        return os.getpid()

    def unpicklable(self):
        return lambda: None

    def environment(self, name: str) -> str | None:
        return os.environ.get(name)

    def say(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def parent_pid(self) -> int:
        return os.getppid()


def make_toy(**kwargs) -> ToyModel:
    return ToyModel(**kwargs)


def broken_factory(**kwargs):
    raise RuntimeError("factory exploded on purpose")


def illegal_instruction_factory(delay_s=0.0, **kwargs):
    """A model whose loading kills its process the way a kernel the CPU refuses does (SIGILL), after `delay_s`.
    Not dumpable, so that no core dump (seconds for a process that imported torch, longer on a loaded machine)
    delays its exit status past the caller's wait: the test is about the report, not the dump."""
    import ctypes
    import os
    import signal
    import time

    time.sleep(delay_s)

    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4: no core dump, pipe handlers included
    os.kill(os.getpid(), signal.SIGILL)
