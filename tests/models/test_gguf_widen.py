"""A draft's Q5_0 matrices rewritten as Q8_0 (models/gguf_widen.py): the same weights bit for bit, a file llama.cpp
loads with the same metadata, cached, and wired into the Engine for llama.cpp drafts only."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, dequantize, quantize

from paraspec import Engine, SamplingParams
from paraspec.models import gguf_widen
from paraspec.models.gguf_widen import q5_0_to_q8_0, widen_drafts, widen_q5_0, widened
from paraspec.models.cpu import cpu_flags
from tests.tiny_gguf import tiny_hf_model, tiny_vocab, write_gguf


def test_every_q5_0_block_is_the_same_q8_0_block():
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    weights[3, :32] = 0.0                                       # an all-zero block (d = 0)
    weights[5, 32:64] = -7.0                                    # a block at the extreme q = -16
    q5 = quantize(weights, Q.Q5_0)
    q8 = q5_0_to_q8_0(q5)
    assert q8.shape == (48, 256 // 32 * 34)
    assert np.array_equal(dequantize(q5, Q.Q5_0), dequantize(q8, Q.Q8_0))
    with pytest.raises(ValueError, match="not whole blocks"):
        q5_0_to_q8_0(q5[:, :-1])


@pytest.fixture(scope="module")
def q5_pair(tmp_path_factory):
    """A tiny Qwen2 GGUF whose matrices are Q5_0, and a draft (the same model: acceptance is high)."""
    folder = tmp_path_factory.mktemp("widen")
    model = tiny_hf_model("qwen2", len(tiny_vocab()[0]), tied=True, seed=13, scale=5, max_position_embeddings=2048)
    q5 = {name: "Q5_0" for name, t in model.state_dict().items() if t.ndim == 2 and "embed" not in name}
    write_gguf(folder / "q5.gguf", model, quantize=q5)
    return folder / "q5.gguf"


def test_the_widened_file_holds_the_same_weights_and_metadata(q5_pair, tmp_path):
    out = tmp_path / "wide.gguf"
    assert widen_q5_0(q5_pair, out) > 0
    a, b = GGUFReader(q5_pair), GGUFReader(out)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert list(ta.shape) == list(tb.shape)
        assert tb.tensor_type == (Q.Q8_0 if ta.tensor_type == Q.Q5_0 else ta.tensor_type)
        assert np.array_equal(dequantize(np.asarray(ta.data), ta.tensor_type),
                              dequantize(np.asarray(tb.data), tb.tensor_type)), ta.name
    assert {k: f.contents() for k, f in a.fields.items() if not k.startswith("GGUF.")} == \
        {k: f.contents() for k, f in b.fields.items() if not k.startswith("GGUF.")}
    assert not list(tmp_path.glob("*.partial"))


def test_llama_cpp_computes_nearly_the_same_logits_on_the_widened_file(q5_pair, tmp_path):
    """Same weights, other kernels (Q8_0's): close, not bitwise (the draft's numbers never reach the output)."""
    from paraspec.models.llamacpp import LlamaCppModel
    out = tmp_path / "wide.gguf"
    widen_q5_0(q5_pair, out)
    prompt = list(range(5, 45))
    logits = [LlamaCppModel(p, 2048, (), n_threads=1, probe=False).prefill(prompt) for p in (q5_pair, out)]
    assert float((logits[0] - logits[1]).abs().max()) < 0.05 * float(logits[0].std())


def test_widened_copies_are_made_once_and_files_without_q5_0_are_left_alone(q5_pair, gguf_pair, monkeypatch,
                                                                           tmp_path):
    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    first = widened(q5_pair)
    assert first != q5_pair and first.exists()
    assert widened(gguf_pair["target"]) == gguf_pair["target"]          # f32 matrices: nothing to widen

    def fail(*a, **k):
        raise AssertionError("converted or read again")
    monkeypatch.setattr(gguf_widen, "widen_q5_0", fail)
    monkeypatch.setattr(gguf_widen, "tensor_types", fail)
    assert widened(q5_pair) == first
    assert widened(gguf_pair["target"]) == gguf_pair["target"]          # the verdict is cached too


def test_the_switch(monkeypatch):
    monkeypatch.setenv("PARASPEC_LLAMACPP_WIDEN_Q5_0", "sometimes")
    with pytest.raises(ValueError, match="use auto, 0 or 1"):
        widen_drafts()
    monkeypatch.setenv("PARASPEC_LLAMACPP_WIDEN_Q5_0", "0")
    assert widen_drafts() is False
    monkeypatch.setenv("PARASPEC_LLAMACPP_WIDEN_Q5_0", "1")
    assert widen_drafts() is True
    monkeypatch.delenv("PARASPEC_LLAMACPP_WIDEN_Q5_0")
    assert widen_drafts() == ("amx_int8" in cpu_flags())


@pytest.mark.parametrize("switch", ["1", "0"])
def test_the_engine_widens_llama_cpp_drafts_only(q5_pair, monkeypatch, tmp_path, switch):
    """sd on llama.cpp with the Q5_0 file as target and as draft: the draft runs on the widened copy where the switch
    says so, the target on the file as given, and the tokens are ar's."""
    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("PARASPEC_LLAMACPP_WIDEN_Q5_0", switch)
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    prompt = list(range(5, 45))
    with Engine(str(q5_pair), strategy="ar", backend="llamacpp", max_num_seqs=1) as engine:
        reference = engine.generate(prompt, params).token_ids
    with Engine(str(q5_pair), draft=str(q5_pair), strategy="sd", backend="llamacpp", lookahead=4,
                max_num_seqs=1) as engine:
        assert engine.strategy.target.path == q5_pair
        draft = engine.strategy.draft_models[0].path
        assert (draft != q5_pair and "q5_0-as-q8_0" in draft.name) == (switch == "1")
        assert engine.generate(prompt, params).token_ids == reference


def test_a_failed_widening_leaves_the_draft_as_it_is(q5_pair, monkeypatch, tmp_path, caplog):
    """A full disk or an unreadable file must not stop the Engine: the draft runs from its own file, with a warning
    that names the switch."""
    from paraspec.models.loader import gguf_source, resolve_checkpoint, widened_draft
    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("PARASPEC_LLAMACPP_WIDEN_Q5_0", "1")
    folder = resolve_checkpoint(q5_pair, backend="llamacpp")

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(gguf_widen, "widen_q5_0", full)
    with caplog.at_level("WARNING"):
        assert widened_draft(folder) == folder
    assert "No space left" in caplog.text and "PARASPEC_LLAMACPP_WIDEN_Q5_0=0" in caplog.text
    assert gguf_source(folder) == q5_pair.resolve()
