"""A draft's Q5_0 matrices rewritten as Q8_0 (models/llamacpp/widen.py): the same weights bit for bit, a file llama.cpp
loads with the same metadata, cached, and wired into the Engine for llama.cpp drafts only."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, dequantize, quantize

from paraspec import Engine, SamplingParams
from paraspec.models.llamacpp import widen as gguf_widen
from paraspec.models.llamacpp.widen import q5_0_to_q8_0, widen_q5_0, widen_switch, widen_verdict, widened, widening_pays
from tests.tiny_gguf import tiny_hf_model, tiny_vocab, write_gguf


def test_every_q5_0_block_is_the_same_q8_0_block():
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    weights[3, :32] = 0.0  # an all-zero block (d = 0)
    weights[5, 32:64] = -7.0  # a block at the extreme q = -16
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
        assert np.array_equal(
            dequantize(np.asarray(ta.data), ta.tensor_type), dequantize(np.asarray(tb.data), tb.tensor_type)
        ), ta.name
    assert {k: f.contents() for k, f in a.fields.items() if not k.startswith("GGUF.")} == {
        k: f.contents() for k, f in b.fields.items() if not k.startswith("GGUF.")
    }
    assert not list(tmp_path.glob("*.partial"))


def test_llama_cpp_computes_nearly_the_same_logits_on_the_widened_file(q5_pair, tmp_path):
    """Same weights, other kernels (Q8_0's): close, not bitwise (the draft's numbers never reach the output)."""
    from paraspec.models.llamacpp.model import LlamaCppModel

    out = tmp_path / "wide.gguf"
    widen_q5_0(q5_pair, out)
    prompt = list(range(5, 45))
    logits = [LlamaCppModel(p, 2048, (), n_threads=1, probe=False).prefill(prompt) for p in (q5_pair, out)]
    assert float((logits[0] - logits[1]).abs().max()) < 0.05 * float(logits[0].std())


def test_widened_copies_are_made_once_and_files_without_q5_0_are_left_alone(q5_pair, gguf_pair, monkeypatch, tmp_path):
    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    first = widened(q5_pair)
    assert first != q5_pair and first.exists()
    assert widened(gguf_pair["target"]) == gguf_pair["target"]  # f32 matrices: nothing to widen

    def fail(*a, **k):
        raise AssertionError("converted or read again")

    monkeypatch.setattr(gguf_widen, "widen_q5_0", fail)
    monkeypatch.setattr(gguf_widen, "tensor_types", fail)
    assert widened(q5_pair) == first
    assert widened(gguf_pair["target"]) == gguf_pair["target"]  # the verdict is cached too


def test_the_switch(monkeypatch):
    monkeypatch.setenv("PARASPEC_LLAMACPP_WIDEN_Q5_0", "sometimes")
    with pytest.raises(ValueError, match="use auto, 0 or 1"):
        widen_switch()
    for value in ("0", "1", "auto"):
        monkeypatch.setenv("PARASPEC_LLAMACPP_WIDEN_Q5_0", value)
        assert widen_switch() == value
    monkeypatch.delenv("PARASPEC_LLAMACPP_WIDEN_Q5_0")
    assert widen_switch() == "auto"


def race(prompt: tuple[float, float], step: tuple[float, float]) -> dict:
    return {"prompt_s": list(prompt), "step_s": list(step)}


def test_widening_pays_where_a_prompt_and_its_decode_cost_less():
    # measured with the reference draft (s): Zen 3 at 2 threads (64-token prompt: both faster), an AMX Xeon (157
    # tokens: both faster, the prompt 5x), Zen 3 at 1 thread (a faster prompt, a 9% slower step: amusd's one-core
    # draft would lose)
    assert widening_pays(race((1.137, 0.852), (0.0384, 0.0382)))
    assert widening_pays(race((1.563, 0.305), (0.0371, 0.0300)))
    assert not widening_pays(race((2.317, 1.770), (0.0616, 0.0672)))
    assert not widening_pays(race((1.0, 1.0), (0.030, 0.030)))  # a tie is not worth a 1.4x larger file
    assert not widening_pays(race((1.0, 0.5), (0.030, 0.045)))  # a faster prompt, a much slower decode
    # the margin: 2% faster is noise, 4% is not
    assert not widening_pays(race((1.0, 0.98), (0.01, 0.0098)))
    assert widening_pays(race((1.0, 0.96), (0.01, 0.0096)))


def test_the_verdict_is_measured_once_per_threads_and_cached(q5_pair, monkeypatch, tmp_path):
    from paraspec.models.llamacpp import child as crashes

    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    wide = widened(q5_pair)
    asked = []

    def child(args, what, timeout=None):
        assert args[0] == "race"
        asked.append(args[1])
        return race((1.0, 0.5), (0.03, 0.02)) if '"n_threads": 1' in args[1] else race((1.0, 1.2), (0.03, 0.04))

    monkeypatch.setattr(crashes, "run_child", child)
    assert widen_verdict(q5_pair, wide, 1)["widen"] is True
    assert widen_verdict(q5_pair, wide, 2)["widen"] is False
    assert len(asked) == 2 and str(wide) in asked[0]
    assert widen_verdict(q5_pair, wide, 1)["widen"] is True and widen_verdict(q5_pair, wide, 2)["widen"] is False
    assert len(asked) == 2  # read from the cache


def test_the_race_runs_both_files_in_a_child(q5_pair, monkeypatch, tmp_path):
    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    verdict = widen_verdict(q5_pair, widened(q5_pair), 1)
    assert "error" not in verdict, verdict
    for key in ("prompt_s", "step_s"):
        assert len(verdict["race"][key]) == 2 and all(0 < t < 10 for t in verdict["race"][key])
    assert verdict["widen"] == widening_pays(verdict["race"]) and verdict["threads"] == 1


def test_a_race_killed_by_a_signal_keeps_the_file_and_says_why(q5_pair, monkeypatch, tmp_path, caplog):
    """The widened file's first products on this CPU run in a child: an instruction the CPU refuses there is a verdict
    against widening (cached: the next Engine does not crash the same child again), not a dead caller."""
    import sys

    from paraspec.models.llamacpp import child as crashes

    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(
        crashes, "CHILD_COMMAND", [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"]
    )
    with caplog.at_level("WARNING"):
        verdict = widen_verdict(q5_pair, widened(q5_pair), 1)
    assert verdict["widen"] is False and "SIGILL" in verdict["error"] and "SIGILL" in caplog.text
    monkeypatch.setattr(crashes, "CHILD_COMMAND", [sys.executable, "-c", "raise SystemExit('ran again')"])
    assert widen_verdict(q5_pair, widened(q5_pair), 1) == verdict


@pytest.mark.parametrize(
    "switch, verdict, widens", [("1", None, True), ("0", None, False), ("auto", True, True), ("auto", False, False)]
)
def test_the_engine_widens_llama_cpp_drafts_only(q5_pair, monkeypatch, tmp_path, switch, verdict, widens):
    """sd on llama.cpp with the Q5_0 file as target and as draft: the draft runs on the widened copy where the switch
    (or, on auto, the measured verdict) says so, the target on the file as given, and the tokens are ar's."""
    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("PARASPEC_LLAMACPP_WIDEN_Q5_0", switch)

    def measured(source, wide, n_threads):
        assert switch == "auto", "measured although the switch decides"
        return {"widen": verdict}

    monkeypatch.setattr(gguf_widen, "widen_verdict", measured)
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    prompt = list(range(5, 45))
    with Engine(str(q5_pair), strategy="ar", backend="llamacpp", max_num_seqs=1) as engine:
        reference = engine.generate(prompt, params).token_ids
    with Engine(
        str(q5_pair), draft=str(q5_pair), strategy="sd", backend="llamacpp", lookahead=4, max_num_seqs=1
    ) as engine:
        assert engine.strategy.target.path == q5_pair
        draft = engine.strategy.draft_models[0].path
        assert (draft != q5_pair and "q5_0-as-q8_0" in draft.name) == widens
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
        assert widened_draft(folder, 1) == folder
    assert "No space left" in caplog.text and "PARASPEC_LLAMACPP_WIDEN_Q5_0=0" in caplog.text
    assert gguf_source(folder) == q5_pair.resolve()
