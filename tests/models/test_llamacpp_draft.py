"""A draft model on llama.cpp's fastest kernels (LlamaCppModel exact=False) beside an exact target in one process.

paraspec's build compiles llamafile's tinyBLAS in behind a switch of each context (scripts/patches/*gated-llamafile*):
a draft's context turns it on, a target's never does. These tests check that the switch really changes the draft's
arithmetic, that a target beside a fast draft (in the same process, their forwards interleaved) is still
batch-invariant, and that the Engine opens drafts -- and only drafts -- that way.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paraspec import Engine, SamplingParams
from paraspec.models.llamacpp import model as llamacpp
from paraspec.models.llamacpp.model import LlamaCppModel
from tests.llamacpp_checks import assert_forwards_are_one_token_forwards

pytest.importorskip("llama_cpp")


class Interleaved:
    """A target whose every prefill and forward is preceded by a forward of the fast draft (same process)."""

    def __init__(self, target: LlamaCppModel, draft: LlamaCppModel):
        self.target, self.draft = target, draft
        self.vocab_size = target.vocab_size

    def _draft_step(self) -> None:
        if self.draft.length > 1500:
            self.draft.rollback(0)
        self.draft.forward([11, 12, 13, 14, 15][: 1 + self.draft.length % 5])

    def prefill(self, ids):
        self._draft_step()
        return self.target.prefill(ids)

    def forward(self, ids, **kwargs):
        self._draft_step()
        return self.target.forward(ids, **kwargs)

    def rollback(self, length):
        self.target.rollback(length)


def test_paraspecs_build_gates_tinyblas_per_context():
    """make setup's build carries tinyBLAS behind the switch; a build with it in every context is refused."""
    assert llamacpp.tinyblas_available()


def test_a_draft_context_runs_tinyblas_and_an_exact_target_beside_it_stays_exact(gguf_pair):
    # the f32 file: tinyBLAS takes its products too, so the target's exactness would break if the switch leaked
    target = LlamaCppModel(gguf_pair["target"], 2048, (), n_threads=2)
    draft = LlamaCppModel(gguf_pair["target"], 2048, (), n_threads=2, exact=False)
    try:
        assert (draft.tinyblas, draft.exact, target.tinyblas, target.exact) == (True, False, False, True)
        assert draft.exact_width == draft.n_batch and target.exact_width >= 8  # a draft's forwards are not split
        ids = np.random.default_rng(3).integers(0, target.vocab_size, size=120).tolist()
        target.prefill(ids[:100])
        draft.prefill(ids[:100])
        exact, fast = target.forward(ids[100:108]), draft.forward(ids[100:108])
        # the same weights and tokens: close, but other arithmetic (tinyBLAS ran in the draft's context only)
        assert not torch.equal(exact, fast)
        assert float((exact - fast).abs().max()) < 0.05 * float(exact.std())
        assert_forwards_are_one_token_forwards(Interleaved(target, draft), ids[:116], 100, "beside a fast draft")
    finally:
        target.close()
        draft.close()


def test_a_fast_drafts_answer_repeats(gguf_pair):
    """The draft's kernels are not batch-invariant, but one sequence of forwards gives one answer: a draft's tokens
    and logits are the same every time the same request runs."""
    runs = []
    for _ in range(2):
        draft = LlamaCppModel(gguf_pair["draft"], 512, (), n_threads=2, exact=False)
        try:
            first = draft.forward(list(range(5, 70)), last_n=1)  # a prompt into the empty cache
            steps = [draft.forward([int(first.argmax())])]
            steps.append(draft.forward([3, 4, 5, 6], last_n=4))  # a catch-up of several tokens
            runs.append(torch.cat([first, *steps]))
        finally:
            draft.close()
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize(
    "config",
    [
        dict(strategy="sd", adaptive=False, lookahead=3),
        # a draft worker; the prompts at once: lent cores would leave a tiny target to decode alone most of the answer
        dict(strategy="amusd", target_devices=["cpu:1"], draft_devices=["cpu:0"], lend_cores=False),
        dict(strategy="dsi", lookahead=3, target_devices=["cpu:1"], draft_devices=["cpu:0"]),  # drafter worker
    ],
    ids=["sd", "amusd", "dsi"],
)
def test_the_engine_opens_drafts_fast_and_targets_exact(gguf_pair, config):
    prompt, params = [5, 17, 33, 90, 12, 7], SamplingParams(max_new_tokens=24)
    with Engine(gguf_pair["target"], strategy="ar", backend="llamacpp") as ar:
        want = ar.generate(prompt, params).token_ids
    with Engine(gguf_pair["target"], gguf_pair["draft"], backend="llamacpp", **config) as engine:
        assert engine.strategy.target.exact is True
        assert [d.exact for d in engine.strategy.draft_models] == [False]
        if config["strategy"] == "sd":  # in this process: tinyBLAS really is on for the draft only
            assert engine.strategy.draft_models[0].tinyblas and not engine.strategy.target.tinyblas
        result = engine.generate(prompt, params)
    assert result.token_ids == want and result.stats.drafted > 0


def test_a_build_running_tinyblas_in_every_context_is_refused(monkeypatch):
    """llama.cpp's own build (tinyBLAS compiled in, no per-context switch) would make every target inexact."""
    import sys
    import types

    fake = types.ModuleType("llama_cpp")
    fake.llama_print_system_info = lambda: b"CPU : AVX2 = 1 | LLAMAFILE = 1 | OPENMP = 1 |"
    fake.llama_cpp = types.SimpleNamespace(_lib=types.SimpleNamespace())  # no llama_paraspec_set_llamafile
    monkeypatch.setattr(llamacpp, "_lib", None)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.delenv("GGML_CPU_TILED_MM", raising=False)
    with pytest.raises(llamacpp.LlamaCppUnavailable, match="build_llamacpp.py wheel --force"):
        llamacpp._llama_cpp()
