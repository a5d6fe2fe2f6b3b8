"""RemoteModel: the Model protocol over a worker: the caller's handle on a model that lives in a worker process
(dsi's target servers and drafters, amusd's workers between requests). Every method is one round trip."""

from __future__ import annotations

from typing import Any

import torch

from paraspec.runtime.workers import Handle, Worker


class RemoteModel:
    def __init__(self, worker: Worker, timeout: float | None = None):
        info = worker.wait_ready(timeout)
        vocab_size, eos_token_ids, max_context = info.vocab_size, info.eos_token_ids, info.max_context
        if vocab_size is None or eos_token_ids is None or max_context is None:
            missing = [k for k in ("vocab_size", "eos_token_ids", "max_context") if getattr(info, k) is None]
            raise TypeError(
                f"worker {worker.name!r} serves a {info.model_type}, which lacks {missing}: not a paraspec Model"
            )
        self.worker = worker
        self.vocab_size: int = vocab_size
        self.eos_token_ids: tuple[int, ...] = eos_token_ids
        self.max_context: int = max_context
        self.exact: bool | None = info.exact  # llama.cpp: exact kernels (a target) or the fastest (a draft)
        self.splits_prompts: bool = info.splits_prompts

    @property
    def length(self) -> int:
        return self.worker.call("length")

    def prefill(self, token_ids) -> torch.Tensor:
        return self.worker.call("prefill", token_ids)

    def forward(self, token_ids, positions=None, tree_mask=None, last_n: int | None = None) -> torch.Tensor:
        return self.submit_forward(token_ids, positions, tree_mask, last_n).result()

    def submit_forward(self, token_ids, positions=None, tree_mask=None, last_n: int | None = None) -> Handle:
        """forward() as a Handle: the caller may work while the worker computes."""
        extra: dict[str, Any] = {} if last_n is None else {"last_n": last_n}  # a model may serve forward without last_n
        return self.worker.submit("forward", token_ids, positions, tree_mask, **extra)

    def rollback(self, length: int) -> None:
        self.worker.call("rollback", length)

    def keep_path(self, prefix_len: int, slots: list[int]) -> None:
        self.worker.call("keep_path", prefix_len, list(slots))

    def __repr__(self) -> str:
        return f"<RemoteModel on {self.worker!r}>"
