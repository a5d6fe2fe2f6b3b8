"""The native decoder with several sequences (models/native/sequences.py): a KV cache per sequence, rows of several
sequences in one forward_batch, each row's logits those of its sequence alone wherever the load-time probe says so
-- and the probe's verdict is what this machine's kernels really do."""

import numpy as np
import pytest
import torch

import paraspec.models.native.sequences as native_seqs
from paraspec.models.loader import load_native


def model(folder, n_seqs=4, **kwargs):
    return load_native(folder, torch.float32, padded_width=None, n_seqs=n_seqs, **kwargs)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 100, size=n).tolist()


@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_batched_rows_equal_alone_exactly_where_the_probe_says(qwen2_target, kind):
    """Contexts and tokens other than the probe's: rows shared by 4 sequences against each alone. Where the
    verdict admits the width, bitwise; where it does not, the rows really differ somewhere (the verdict is not
    just cautious) or are the same -- either way the Scheduler keeps them alone."""
    m = model(qwen2_target)
    prompts = [tokens(s, p) for s, p in zip(range(4), (23, 4, 31, 10))]
    widths = [1, 1, 1, 1] if kind == "decode" else [2, 5, 3, 8]
    steps = [tokens(10 + s, w) for s, w in enumerate(widths)]
    alone = []
    for sequence_id, prompt in enumerate(prompts):
        m.prefill(prompt, sequence_id)
        alone.append(m.forward(steps[sequence_id], sequence_id=sequence_id))
        m.rollback(len(prompt), sequence_id)
    got = m.forward_batch([(sequence_id, steps[sequence_id], widths[sequence_id]) for sequence_id in range(4)])
    assert m._lengths == [len(p) + w for p, w in zip(prompts, widths)]
    admitted = m.batch_exact and m.min_shared_width <= min(widths) and max(widths) <= m.exact_width
    same = all(torch.equal(g, a) for g, a in zip(got, alone))
    if admitted:
        assert same, "the probe admitted this width, but batched rows differ from alone"
    for g, a in zip(got, alone):  # the same numbers to rounding either way
        assert (g - a).abs().max() < 1e-3


def test_sequences_are_independent_and_move_bitwise(qwen2_target):
    m = model(qwen2_target, n_seqs=3)
    single = load_native(qwen2_target, torch.float32, padded_width=None)
    a, b = tokens(1, 12), tokens(2, 7)
    m.prefill(a, 0)
    m.prefill(b, 2)
    m.forward(tokens(3, 4), sequence_id=2)
    m.rollback(9, 2)  # per sequence: sequence 0 keeps its 12
    assert m._lengths == [12, 0, 9]
    m.move_sequence(2, 1)  # the caches trade places
    assert m._lengths == [12, 9, 0]
    single.prefill(b)
    single.forward(tokens(3, 4))
    single.rollback(9)
    assert torch.equal(m.forward([5, 6], sequence_id=1), single.forward([5, 6]))
    assert torch.equal(m.forward([7], sequence_id=0), (single.prefill(a), single.forward([7]))[1])


def test_bad_calls_are_refused(qwen2_target):
    m = model(qwen2_target, n_seqs=2)
    m.prefill([1, 2, 3], 0)
    m.prefill([4, 5], 1)
    with pytest.raises(ValueError, match="at most once"):
        m.forward_batch([(0, [1], 1), (0, [2], 1)])
    with pytest.raises(ValueError, match="at most once"):
        m.forward_batch([(2, [1], 1)])
    with pytest.raises(ValueError, match="exact_width"):
        m.forward_batch([(0, list(range(m.exact_width + 1)), 1)])
    with pytest.raises(ValueError, match="outside this model's vocabulary"):
        m.forward_batch([(0, [10**6], 1)])
    with pytest.raises(ValueError, match="sequence 5 of 2"):
        m.forward([1], sequence_id=5)
    with pytest.raises(ValueError, match="two different sequences"):
        m.move_sequence(1, 1)
    assert m._lengths == [3, 2]  # nothing refused changed a cache
    with pytest.raises(ValueError, match="n_seqs=1"):
        native_seqs.NativeSequences(m.decoder, 64, n_seqs=1)


@pytest.mark.parametrize("verdict", [(False, True), (True, False), (False, False)])
def test_the_verdict_sets_what_shares_and_says_so(qwen2_target, monkeypatch, capfd, verdict):
    decode_exact, verify_exact = verdict
    rows = [
        {"kind": "decode", "max_abs_diff": 0.0 if decode_exact else 1e-6},
        {"kind": "verify", "max_abs_diff": 0.0 if verify_exact else 1e-6},
    ]
    monkeypatch.setattr(native_seqs, "measure_batch_exact", lambda m, width, prompts: rows)
    m = model(qwen2_target, n_seqs=2)
    assert m.batch_exact == (decode_exact or verify_exact)
    assert m.min_shared_width == (1 if decode_exact else 2)
    assert m.exact_width == (native_seqs.PROBE_WIDTH if verify_exact else 1)
    err = capfd.readouterr().err
    assert {
        (False, True): "one-token steps run alone",
        (True, False): "verifications run alone",
        (False, False): "every forward runs alone",
    }[verdict] in err
