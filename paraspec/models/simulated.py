"""Simulated models: the Model protocol with a configured latency and a known answer, for scale tests and for
measuring what the runtime itself costs.

    truth       a fixed sequence: the target's greedy token for absolute position i is truth[i], whatever the
                context (drawn once from `seed`, never an EOS id unless `eos_every` asks for one)
    target      predicts truth[i] for every position i
    draft       predicts truth[i] with probability `acceptance_rate`, independently per position (drawn once from
                `draft_seed`), else a different token -- the event simulator's acceptance model (sim/events.py)
    latency     every forward sleeps cost(n) seconds for n new tokens (a `sim.profile.ForwardCost`; None: no
                sleep, which isolates the orchestration overhead)
    shape       every forward also runs a real forward of the same tokens through a random-weight native decoder
                of that shape (models/native/shapes.py) on the model's device, and waits for it; its logits are
                dropped. The runs then pay a real model's compute (and its padded width: load_simulated takes
                `padded_width` like load_model) while acceptance stays the configured one (`make gpu-check`).

The logits are a peak of height `peak` on the predicted token, so greedy decoding and acceptance behave as in the
simulator; with sampling the acceptance rate is not `acceptance_rate`. The KV "cache" is just a length.

Simulated models run through the real Engine, runtime, workers and channels (pass a `SimulatedSpec` where a
checkpoint goes: `Engine(SimulatedSpec(...), SimulatedSpec(role="draft", ...), strategy="dsi", ...)`), so dsi,
amusd and sd can be exercised with 8+ servers on 2 cores. They supplement real-model tests; they never replace them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from paraspec.models.base import check_rollback
from paraspec.models.native.shapes import check_shape
from paraspec.sim.costs import ForwardCost

if TYPE_CHECKING:
    from paraspec.models.native.decoder import NativeModel


@dataclass(frozen=True)
class SimulatedSpec:
    """What a simulated model is; picklable, so a worker builds the model from it (see `load_simulated`)."""

    role: str = "target"  # "target" (predicts the truth) or "draft"
    acceptance_rate: float = 1.0  # draft: P(its token is the truth's), per position
    cost: ForwardCost | None = None  # seconds per forward of n new tokens; None: no sleep
    vocab_size: int = 64
    seed: int = 0  # the truth sequence (share it between draft and target)
    draft_seed: int = 1  # where the draft agrees with the truth
    max_context: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    peak: float = 20.0
    shape: str | None = None  # also pay a real forward of this decoder shape (models/native/shapes.py)
    compile_step: bool = False  # that real forward's padded step through torch.compile

    def __post_init__(self):
        if self.shape is not None:
            check_shape(self.shape)
        if self.role not in ("target", "draft"):
            raise ValueError(f"simulated role {self.role!r} must be 'target' or 'draft'")
        if not 0 <= self.acceptance_rate <= 1:
            raise ValueError(f"acceptance_rate {self.acceptance_rate} must be in [0, 1]")
        if self.vocab_size < 2 + len(self.eos_token_ids):
            raise ValueError(f"vocab_size {self.vocab_size} is too small for a wrong draft token besides the EOS ids")


class SimulatedModel:
    splits_prompts = False  # prompt and tokens after it: one forward (models.base.Model)

    def __init__(
        self,
        spec: SimulatedSpec,
        max_context: int | None = None,
        device="cpu",
        dtype=None,
        padded_width: int | str | None = None,
    ):
        self.spec = spec
        self.vocab_size = spec.vocab_size
        self.eos_token_ids = tuple(spec.eos_token_ids)
        self.max_context = min(spec.max_context, max_context or spec.max_context)
        rng = np.random.default_rng(spec.seed)
        allowed = np.array([t for t in range(spec.vocab_size) if t not in self.eos_token_ids])
        truth = allowed[rng.integers(len(allowed), size=self.max_context + 1)]
        if spec.role == "draft":
            draft_rng = np.random.default_rng([spec.seed, spec.draft_seed])
            agree = draft_rng.random(self.max_context + 1) < spec.acceptance_rate
            shift = 1 + draft_rng.integers(len(allowed) - 1, size=self.max_context + 1)
            index = np.searchsorted(allowed, truth)
            wrong = allowed[(index + shift) % len(allowed)]  # always a different non-EOS token
            truth = np.where(agree, truth, wrong)
        self.predicted = truth  # predicted[i]: the token this model says at i
        self._length = 0
        self.forwards = 0
        self.real = None  # the NativeModel whose forwards it pays
        if spec.shape is not None:
            from paraspec.models.native.decoder import NativeModel
            from paraspec.models.native.shapes import random_decoder

            self.real = NativeModel(
                random_decoder(spec.shape, device, dtype, seed=spec.seed),
                self.max_context,
                padded_width=padded_width,
                compile_step=spec.compile_step,
            )

    @property
    def length(self) -> int:
        return self._length

    def rollback(self, length: int) -> None:
        check_rollback(length, self._length)
        self._length = length
        if self.real is not None:
            self.real.rollback(length)

    def keep_path(self, prefix_len: int, slots: list[int]) -> None:
        """Predictions depend only on positions, so moving entries is just the new length."""
        if not 0 <= prefix_len <= self._length or any(not prefix_len <= s < self._length for s in slots):
            raise ValueError(f"keep_path({prefix_len}, {slots}) outside the cache of {self._length} tokens")
        self._length = prefix_len + len(slots)
        if self.real is not None:
            self.real.keep_path(prefix_len, slots)

    def prefill(self, token_ids) -> torch.Tensor:
        self._length = 0
        return self.forward(token_ids, last_n=1)[-1]

    def forward(self, token_ids, positions=None, tree_mask=None, last_n: int | None = None) -> torch.Tensor:
        n = len(token_ids)
        if n < 1:
            raise ValueError("a forward needs at least one token")
        if tree_mask is not None:
            raise ValueError("simulated models do not support tree masks")
        if self._length + n > self.max_context:
            raise ValueError(f"the cache holds {self.max_context} tokens; {self._length} + {n} do not fit")
        if self.spec.cost is not None:
            time.sleep(self.spec.cost(n))
        if self.real is not None:
            self._pay_real_forward(self.real, token_ids, last_n)
        rows = n if last_n is None else min(last_n, n)
        # the row of the input token at position p predicts position p + 1
        end = self._length + n
        predicted = self.predicted[end - rows + 1 : end + 1]
        logits = torch.zeros(rows, self.vocab_size)
        logits[torch.arange(rows), torch.from_numpy(predicted)] = self.spec.peak
        self._length = end
        self.forwards += 1
        return logits

    def _pay_real_forward(self, real: NativeModel, token_ids, last_n: int | None) -> None:
        real.rollback(self._length)  # a prefill starts over
        real.forward([int(t) % real.vocab_size for t in token_ids], last_n=last_n)
        if real.device.type == "cuda":
            torch.cuda.synchronize(real.device)  # a real strategy reads the logits: the forward is paid now


def load_simulated(
    spec: SimulatedSpec,
    dtype=None,
    backend: str = "native",
    max_context: int | None = None,
    device: str = "cpu",
    padded_width: int | str | None = "auto",
    compile_step: bool = False,
    draft: bool = False,
) -> SimulatedModel:
    """load_model's signature, so the Engine and the runtime build a simulated model like a real one. `device`,
    `dtype` and `padded_width` apply to the real decoder of a spec with a `shape` ("auto" dtype: bfloat16 on
    CUDA, float32 on CPU)."""
    if compile_step and not spec.compile_step:
        spec = replace(spec, compile_step=True)
    return SimulatedModel(spec, max_context, device=device, dtype=dtype, padded_width=padded_width)
