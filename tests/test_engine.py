"""Engine API: prompts of every kind, streaming, and a clear error for every bad input at the boundary."""

import json
from pathlib import Path

import pytest
import torch

from paraspec import Engine, SamplingParams
from paraspec.engine import IncompatibleModelsError
from paraspec.models.loader import CheckpointError
from paraspec.runtime.devices import DeviceError
from tests.conftest import busy_s
from tests.tiny import make_checkpoint

PROMPT_IDS = [5, 17, 33, 90]


@pytest.fixture(scope="module")
def engine(qwen2_target, qwen2_partial):
    # fixed lengths: the stats below need drafts, which sd's default (the rule) may rightly not make here
    with Engine(qwen2_target, qwen2_partial, strategy="sd", adaptive=False, dtype="float32") as e:
        yield e


def test_prompt_kinds(engine):
    params = SamplingParams(max_new_tokens=8)
    text = engine.generate("abc", params)
    ids = engine.generate(engine.tokenizer.encode("abc"), params)
    assert text.token_ids == ids.token_ids
    assert text.prompt_ids == engine.tokenizer.encode("abc")  # raw text: no template
    chat = engine.generate([{"role": "user", "content": "abc"}], params)
    assert chat.prompt_ids[:2] == engine.tokenizer.convert_tokens_to_ids(["<|im_start|>", "u"])
    assert chat.prompt_ids[-len("assistant\n") :] == engine.tokenizer.encode("assistant\n")
    assert isinstance(text.text, str) and text.stats.new_tokens == 8


def test_stream_deltas_add_up_to_the_text(engine):
    params = SamplingParams(max_new_tokens=24)
    stream = engine.stream("def f(x):", params)
    assert stream.result is None  # not started: the request begins at the first next()
    deltas = list(stream)
    assert len(deltas) > 1
    assert stream.result is not None and stream.result.finish_reason == "length"
    assert "".join(deltas) == stream.result.text == engine.generate("def f(x):", params).text


def test_stats_and_trace(engine):
    result = engine.generate("hello", SamplingParams(max_new_tokens=20))
    s = result.stats
    assert s.new_tokens == 20 and s.rounds > 0
    assert s.ms_per_token == pytest.approx(s.total_s * 1000 / 20)
    assert s.tpot_ms == pytest.approx((s.total_s - s.ttft_s) * 1000 / 19)
    assert s.acceptance_rate == pytest.approx(s.accepted / s.drafted)
    kinds = {e.kind for e in result.trace.events}
    assert {"draft", "verify"} <= kinds
    assert result.trace.progress[-1][1] == 20
    assert s.draft_s == pytest.approx(busy_s(result.trace, "draft"))


def test_sd_without_draft(qwen2_target):
    with pytest.raises(ValueError, match="needs a draft model"):
        Engine(qwen2_target, strategy="sd")


def test_unknown_strategy(qwen2_target):
    with pytest.raises(ValueError, match="unknown strategy 'nope'; choose one of ar, sd"):
        Engine(qwen2_target, strategy="nope")


# the first GPU index this machine lacks (cuda:0 where it has none)
MISSING_GPU = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"


@pytest.mark.parametrize(
    "device,match",
    [("gpu:0", "unknown device"), ("cpu:99", "names core"), (MISSING_GPU, "not available"), ("cpu:x", "bad device")],
)
def test_bad_devices(qwen2_target, device, match):
    with pytest.raises(DeviceError, match=match):
        Engine(qwen2_target, strategy="ar", target_devices=[device])


def other_tokenizer(folder):
    """A checkpoint whose tokenizer spells one token differently from the tiny models'."""
    other = make_checkpoint(folder, "qwen2", seed=9)
    vocab = json.loads((other / "tokenizer.json").read_text())
    vocab["model"]["vocab"] = {("Z" + k if k == "a" else k): v for k, v in vocab["model"]["vocab"].items()}
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    return other


def test_different_tokenizers(tmp_path, qwen2_target):
    other = other_tokenizer(tmp_path / "other")
    with pytest.raises(IncompatibleModelsError, match="tokenizers differ.*--allow-vocab-mismatch"):
        Engine(qwen2_target, other, strategy="sd")
    Engine(qwen2_target, other, strategy="sd", allow_vocab_mismatch=True).close()


def test_padded_embedding_with_same_tokenizer_is_allowed(tmp_path, qwen2_target, engine):
    """Only the padding rows of the output layer differ: allowed, and still exactly ar."""
    padded = make_checkpoint(tmp_path / "padded", "qwen2", seed=1, scale=20, vocab_size=300)
    assert Engine(qwen2_target, strategy="ar").target.vocab_size != 300
    params = SamplingParams(max_new_tokens=16)
    with Engine(qwen2_target, padded, strategy="sd", dtype="float32") as sd:
        assert (
            sd.generate("xyz", params).token_ids
            == Engine(qwen2_target, dtype="float32").generate("xyz", params).token_ids
        )


def test_vocab_size_mismatch_without_tokenizers(tmp_path):
    a = make_checkpoint(tmp_path / "a", "qwen2", seed=1, tokenizer=False, vocab_size=32)
    b = make_checkpoint(tmp_path / "b", "qwen2", seed=2, tokenizer=False, vocab_size=48)
    with pytest.raises(IncompatibleModelsError, match="vocabularies differ \\(48 vs 32\\)"):
        Engine(a, b, strategy="sd")


@pytest.mark.parametrize("strategy", ["sd", "amusd"])
def test_a_vocab_mismatch_is_refused_before_any_model_loads(tmp_path, qwen2_target, monkeypatch, strategy):
    """Tokenizers and config.json are compared before the strategy loads a model or starts a worker (its setup()
    would fail here), with the same messages."""
    from paraspec.strategies import STRATEGIES

    def setup(self, placement):
        raise AssertionError("a model was loaded or a worker started before the vocabularies were checked")

    monkeypatch.setattr(STRATEGIES[strategy], "setup", setup)
    devices = dict(target_devices=["cpu:1"], draft_devices=["cpu:0"]) if strategy == "amusd" else {}
    a = make_checkpoint(tmp_path / "a", "qwen2", seed=1, tokenizer=False, vocab_size=32)
    b = make_checkpoint(tmp_path / "b", "qwen2", seed=2, tokenizer=False, vocab_size=48)
    short = make_checkpoint(tmp_path / "short", "qwen2", seed=3, vocab_size=16)  # fewer rows than its tokenizer
    with pytest.raises(IncompatibleModelsError, match="tokenizers differ"):
        Engine(qwen2_target, other_tokenizer(tmp_path / "other"), strategy=strategy, **devices)
    with pytest.raises(IncompatibleModelsError, match="vocabularies differ \\(48 vs 32\\)"):
        Engine(a, b, strategy=strategy, **devices)
    with pytest.raises(IncompatibleModelsError, match="output layer \\(16 rows\\) is smaller than its tokenizer"):
        Engine(qwen2_target, short, strategy=strategy, **devices)
    with pytest.raises(AssertionError, match="before the vocabularies were checked"):  # agreeing: setup() next
        Engine(a, a, strategy=strategy, **devices)


def test_prompt_longer_than_context(qwen2_target):
    with Engine(qwen2_target, max_context=32) as e:
        with pytest.raises(ValueError, match="prompt has 40 tokens but the context holds 32"):
            e.generate("x" * 40)


def test_generation_stops_at_the_context_limit(qwen2_target, qwen2_partial):
    with Engine(qwen2_target, qwen2_partial, strategy="sd", max_context=24, dtype="float32") as e:
        result = e.generate("x" * 10, SamplingParams(max_new_tokens=100))
    assert result.finish_reason == "context" and len(result.token_ids) == 14


@pytest.mark.parametrize(
    "prompt,match",
    [
        ("", "empty"),
        ([], "non-empty"),
        ([10**6], "outside the vocabulary"),
        ([{"content": "x"}], "'role'"),
        (3.5, "must be a non-empty"),
    ],
)
def test_bad_prompts(engine, prompt, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(prompt)


def test_text_prompt_without_tokenizer(tmp_path):
    bare = make_checkpoint(tmp_path / "bare", "qwen2", seed=1, tokenizer=False, vocab_size=32)
    with Engine(bare) as e:
        assert len(e.generate([1, 2, 3], SamplingParams(max_new_tokens=4)).token_ids) == 4
        with pytest.raises(ValueError, match="no tokenizer.*token ids"):
            e.generate("hello")


def test_missing_and_corrupt_checkpoints(tmp_path, qwen2_target):
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        Engine(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        Engine(empty)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((qwen2_target / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        Engine(no_weights)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((qwen2_target / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes((qwen2_target / "model.safetensors").read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        Engine(corrupt)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((qwen2_target / "config.json").read_text())
    (sharded / "model-00001-of-00002.safetensors").write_bytes((qwen2_target / "model.safetensors").read_bytes())
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="missing shard"):
        Engine(sharded)
    text_file = tmp_path / "weights.bin"
    text_file.write_text("x")
    with pytest.raises(CheckpointError, match="not a .gguf"):
        Engine(text_file)


def test_unreachable_hub_names_the_offline_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(CheckpointError, match="make models"):
        Engine("nobody/no-such-model")


def test_bad_engine_values(qwen2_target, qwen2_partial):
    with pytest.raises(ValueError, match="lookahead must be >= 1"):
        Engine(qwen2_target, qwen2_partial, strategy="sd", lookahead=0)
    with pytest.raises(ValueError, match="unknown dtype"):
        Engine(qwen2_target, dtype="int3")
    with pytest.raises(ValueError, match="unknown backend"):
        Engine(qwen2_target, backend="tpu")


def test_hf_backend_sd_equals_ar(qwen2_target, qwen2_partial):
    params = SamplingParams(max_new_tokens=20)
    with (
        Engine(qwen2_target, dtype="float32") as ar,
        Engine(qwen2_target, qwen2_partial, strategy="sd", backend="hf", dtype="float32") as sd,
    ):
        assert sd.generate("abc", params).token_ids == ar.generate("abc", params).token_ids


def test_unknown_and_bad_strategy_options(qwen2_target, qwen2_partial):
    with pytest.raises(TypeError, match="unknown Engine option.*'lookahed'"):
        Engine(qwen2_target, qwen2_partial, strategy="sd", lookahed=3)
    with pytest.raises(ValueError, match="lookahead must be an integer"):
        Engine(qwen2_target, qwen2_partial, strategy="sd", lookahead=2.5)


def test_in_process_pinning_is_undone_by_close(qwen2_target):
    import os

    before = os.sched_getaffinity(0)
    with Engine(qwen2_target, target_devices=["cpu:0"]) as e:
        assert os.sched_getaffinity(0) == {0}
        e.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
    assert os.sched_getaffinity(0) == before
    Engine(qwen2_target, target_devices=["cpu:1"]).close()  # cpu:1 still counts as available


def test_each_checkpoint_is_resolved_once_and_the_draft_order_kept(qwen2_target, qwen2_partial, monkeypatch):
    """EngineConfig reads no checkpoint, also for backend "auto"; the Engine resolves them all in one call, each
    once, before the strategy loads anything."""
    import paraspec.models.loader as loader
    import paraspec.placement as engine_module
    from paraspec.config import EngineConfig
    from paraspec.drafters import DraftSpec

    def refused(*args, **kwargs):
        raise AssertionError("EngineConfig resolved a checkpoint")

    with monkeypatch.context() as m:
        m.setattr(loader, "resolve_checkpoint", refused)
        config = EngineConfig(qwen2_target, ["ngram", qwen2_partial], strategy="sd")  # dtype and backend "auto"
    assert config.model_backend == "auto"
    calls, resolve_models = [], engine_module.resolve_models

    def counting(specs, *args):
        calls.append([str(s) for s in specs])
        return resolve_models(specs, *args)

    monkeypatch.setattr(engine_module, "resolve_models", counting)
    with Engine.from_config(config) as engine:
        assert calls == [[str(qwen2_target), str(qwen2_partial)]] and engine.backend == "native"
        assert engine.config.draft_specs == (DraftSpec("ngram", True), DraftSpec(qwen2_partial, False))
        placement = engine._placement
        assert placement.draft_specs == [DraftSpec("ngram", True), DraftSpec(qwen2_partial, False)]
        assert placement.draft_checkpoints == [qwen2_partial]
        assert engine.strategy.draft_specs == placement.draft_specs and len(engine.draft_models) == 1
        assert engine.health() is None
        engine.set_options(lookahead=3)  # a new config: still nothing resolved again
        assert len(calls) == 1
    assert engine.health() == "the Engine is closed"


def test_a_gguf_is_converted_once_whichever_backend_auto_picks(gguf_pair, tmp_path, monkeypatch):
    """ "auto" with .gguf files: llama.cpp gets one folder without weights per file; without llama.cpp the native
    decoder gets one conversion to weights per file, and no weightless folder is made first."""
    import paraspec.models.gguf as gguf
    import paraspec.models.loader as loader
    from paraspec.runtime.devices import parse_devices

    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    converted, convert = [], gguf.convert_gguf

    def counting(path, out, *args, weights=True, **kwargs):
        converted.append((Path(path).name, weights))
        return convert(path, out, *args, weights=weights, **kwargs)

    monkeypatch.setattr(gguf, "convert_gguf", counting)
    monkeypatch.setattr(loader, "llamacpp_installed", lambda: True)
    backend, (folder,) = loader.resolve_models([gguf_pair["target"]], [torch.float32], "auto", parse_devices(["cpu"]))
    assert backend == "llamacpp" and loader.gguf_source(folder) == gguf_pair["target"]
    assert converted == [("gguf-target.gguf", False)]
    converted.clear()
    monkeypatch.setattr(loader, "llamacpp_installed", lambda: False)
    with Engine(gguf_pair["target"], gguf_pair["draft"], strategy="sd") as engine:
        assert engine.backend == "native" and engine.generate(PROMPT_IDS, SamplingParams(max_new_tokens=4)).token_ids
    assert sorted(converted) == [("gguf-draft.gguf", True), ("gguf-target.gguf", True)]
