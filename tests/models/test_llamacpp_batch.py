"""Several sequences in one llama.cpp context (LlamaCppModel(n_seqs=...)): what batching requests rests on.

- each sequence has its own KV cache, length and rollback; `sequence(i)` is the Model protocol on sequence i;
- rows of several sequences decoded in one forward (forward_batch) are bitwise the rows each sequence gets alone,
  where the probe says so (`batch_exact`, measured in the child with the width probe and cached per sequence count);
- bad batches are refused with errors that say what is allowed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paraspec.models.llamacpp import model as llamacpp
from paraspec.models.llamacpp.model import LlamaCppModel, probe_batch

pytest.importorskip("llama_cpp")

PROMPTS = [[5, 17, 33, 90, 12, 7], list(range(20, 95)), [3], list(range(200, 140, -1))]


def alone(path, prompt: list[int], steps: list[list[int]], kernels: str) -> list[torch.Tensor]:
    """The prompt's last row, then each step's rows, on a context holding this one sequence."""
    model = LlamaCppModel(path, 512, (), n_threads=2, probe=False, kernels=kernels)
    try:
        rows = [model.prefill(prompt)[None]]
        return rows + [model.forward(step) for step in steps]
    finally:
        model.close()


@pytest.mark.parametrize("kernels", ["repacked", "plain"])
def test_sequences_batched_are_bitwise_alone_where_the_probe_says_so(gguf_pair, kernels):
    model = LlamaCppModel(gguf_pair["target"], 512, (), n_threads=2, probe=False, kernels=kernels, n_seqs=4)
    rows = probe_batch(model, 8)
    assert {r["sequences"] for r in rows} == {2, 3, 4} and {r["kind"] for r in rows} == {"decode", "verify"}
    if any(r["max_abs_diff"] != 0.0 for r in rows):
        pytest.skip(
            f"llama.cpp's {kernels} kernels do not batch sequences exactly on this CPU (the probe refuses "
            f"batching here; tests/strategies/test_batched.py covers that path)"
        )
    rng = np.random.default_rng(5)
    # decode steps (one token each) and verify-like steps (different widths per sequence), sequences joining late
    steps = [
        [rng.integers(0, model.vocab_size, size=w).tolist() for w in widths]
        for widths in ([1, 1, 4, 1], [3, 1, 1, 2], [1, 2, 1, 1], [2, 1, 3, 1])
    ]
    expected = [alone(gguf_pair["target"], p, s, kernels) for p, s in zip(PROMPTS, steps)]
    got = [[] for _ in PROMPTS]
    for sequence_id in (0, 1):
        got[sequence_id].append(model.sequence(sequence_id).prefill(PROMPTS[sequence_id])[None])
    for i in range(4):
        if i == 1:  # two sequences join after the first step
            for sequence_id in (2, 3):
                got[sequence_id].append(model.sequence(sequence_id).prefill(PROMPTS[sequence_id])[None])
        running = [0, 1] if i == 0 else [0, 1, 2, 3]
        step = [seq_steps[i if sequence_id < 2 else i - 1] for sequence_id, seq_steps in enumerate(steps)]
        out = model.forward_batch([(sequence_id, step[sequence_id], len(step[sequence_id])) for sequence_id in running])
        for sequence_id, logits in zip(running, out):
            got[sequence_id].append(logits)
    for sequence_id in range(4):
        want = expected[sequence_id][: len(got[sequence_id])]
        for g, w in zip(got[sequence_id], want):
            assert torch.equal(g, w), f"sequence {sequence_id}: batched rows differ from alone"
    assert [model.sequence(s).length for s in range(4)] == [
        len(p) + sum(map(len, s[: len(got[i]) - 1])) for i, (p, s) in enumerate(zip(PROMPTS, steps))
    ]
    model.close()


def test_rollback_and_prefill_touch_only_their_sequence(gguf_pair):
    model = LlamaCppModel(gguf_pair["target"], 512, (), n_threads=1, probe=False, kernels="plain", n_seqs=2)
    a, b = model.sequence(0), model.sequence(1)
    a.prefill(PROMPTS[0])
    b.prefill(PROMPTS[1])
    before = b.forward([7, 8], last_n=1)
    b.rollback(len(PROMPTS[1]))
    a.rollback(2)  # sequence 0's cut leaves sequence 1's cache whole
    a.prefill(PROMPTS[2])  # and so does a new prompt on sequence 0
    assert (a.length, b.length) == (1, len(PROMPTS[1]))
    assert torch.equal(b.forward([7, 8], last_n=1), before)
    model.close()


def test_a_moved_sequence_goes_on_bitwise_and_any_order_is_one_forward(gguf_pair):
    """move_sequence copies a cache to another sequence, cells in place: its next rows are those it would have had;
    forward_batch takes its items in any order (llama.cpp needs them by increasing sequence: sorted inside)."""
    model = LlamaCppModel(gguf_pair["target"], 512, (), n_threads=1, probe=False, kernels="plain", n_seqs=3)
    for sequence_id, prompt in enumerate(PROMPTS[:3]):
        model.sequence(sequence_id).prefill(prompt)
    want = model.forward_batch([(2, [9, 10], 2), (0, [4], 1)])
    model.rollback(len(PROMPTS[2]), 2)
    model.rollback(len(PROMPTS[0]), 0)
    assert [torch.equal(a, b) for a, b in zip(model.forward_batch([(0, [4], 1), (2, [9, 10], 2)]), want[::-1])] == [
        True,
        True,
    ]
    model.rollback(len(PROMPTS[2]), 2)
    model.move_sequence(2, 1)  # sequence 2's request now decodes on sequence 1
    assert (model.sequence(1).length, model.sequence(2).length) == (len(PROMPTS[2]), 0)
    assert torch.equal(model.sequence(1).forward([9, 10]), want[0])
    with pytest.raises(ValueError, match="two different sequences"):
        model.move_sequence(1, 1)
    model.close()


def test_forward_batch_refuses_what_it_cannot_do_exactly(gguf_pair):
    model = LlamaCppModel(gguf_pair["target"], 64, (), n_threads=1, probe=False, kernels="plain", n_seqs=2)
    model.exact_width = 4
    for sequence_id in (0, 1):
        model.sequence(sequence_id).prefill([1, 2, 3])
    with pytest.raises(ValueError, match="at most once"):
        model.forward_batch([(0, [1], 1), (0, [2], 1)])
    with pytest.raises(ValueError, match="at most once"):
        model.forward_batch([(2, [1], 1)])
    with pytest.raises(ValueError, match="exact_width"):
        model.forward_batch([(0, [1] * 5, 1)])
    with pytest.raises(ValueError, match="context full"):
        model.sequence(1).forward([1] * 62)
    with pytest.raises(ValueError, match="outside this context's 2"):
        model.sequence(2)
    with pytest.raises(ValueError, match="n_seqs must be a positive integer"):
        LlamaCppModel(gguf_pair["target"], 64, (), n_threads=1, probe=False, n_seqs=0)
    model.close()


def test_the_batch_verdict_is_probed_in_the_child_and_cached_per_sequence_count(gguf_pair, monkeypatch, tmp_path):
    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    three = LlamaCppModel(gguf_pair["target"], 512, (), n_threads=1, kernels="plain", n_seqs=3)
    in_process = LlamaCppModel(gguf_pair["target"], 512, (), n_threads=1, probe=False, kernels="plain", n_seqs=3)
    in_process.exact_width = three.exact_width
    assert three.batch_exact == all(r["max_abs_diff"] == 0.0 for r in probe_batch(in_process, three.exact_width))
    in_process.close()

    def fail(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(llamacpp, "run_probe", fail)
    assert (
        LlamaCppModel(gguf_pair["target"], 512, (), n_threads=1, kernels="plain", n_seqs=3).batch_exact
        == three.batch_exact
    )  # from the cache
    with pytest.raises(AssertionError, match="measured again"):  # another sequence count: another key
        LlamaCppModel(gguf_pair["target"], 512, (), n_threads=1, kernels="plain", n_seqs=2)
    three.close()


def test_an_inexact_batch_verdict_is_said(gguf_pair, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    real = llamacpp.run_probe

    def rows_differ(model):
        width, rows = real(model)
        return width, rows + [{"sequences": 2, "kind": "decode", "max_abs_diff": 1e-3}]

    monkeypatch.setattr(llamacpp, "run_probe", rows_differ)
    model = LlamaCppModel(gguf_pair["target"], 512, (), n_threads=1, kernels="plain", n_seqs=2)
    assert model.batch_exact is False
    assert "one sequence per forward" in capsys.readouterr().err
    model.close()


@pytest.mark.parametrize("kernels", ["repacked", "plain"])
def test_a_prompt_in_steps_between_other_sequences_forwards_leaves_the_alone_kv(gguf_pair, kernels):
    """prompt_steps: a prompt's forwards one per next(), other sequences decoding between them (as the Scheduler runs
    them), leave the KV cache the same prompt leaves alone on a context of one sequence: the logits of the prompt's
    last token and of the tokens decoded after it are bitwise equal (a chunk decoded with other boundaries, or
    beside other rows, would not be: PROMPT_CHUNK vs n_batch chunks differ by ~0.5 on the reference pair)."""
    prompt = [(11 * j) % 180 + 3 for j in range(3 * llamacpp.PROMPT_CHUNK + 5)]
    after = [[40], [41, 42, 43], [9]]
    expected = alone(gguf_pair["target"], prompt, after, kernels)
    model = LlamaCppModel(gguf_pair["target"], 512, (), n_threads=2, probe=False, kernels=kernels, n_seqs=3)
    try:
        for sequence_id in (1, 2):
            model.prefill(PROMPTS[sequence_id], sequence_id)
        steps, forwards = model.prompt_steps(prompt, 0), 0
        while True:
            try:
                next(steps)
            except StopIteration as done:
                last = done.value
                break
            forwards += 1
            model.forward([forwards % 50 + 1], sequence_id=1)  # the others' steps between the prompt's forwards
            model.forward([forwards % 40 + 2, 7], sequence_id=2)
        # several forwards; one on the plain kernels' fast prefill (the head on the repacked copy, then the last token)
        assert forwards == 1 if model.fast_prefills else forwards >= 3
        got = [last] + [model.forward(step, sequence_id=0) for step in after]
    finally:
        model.close()
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
