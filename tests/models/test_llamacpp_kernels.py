"""llama.cpp's repacked weight kernels, made batch-invariant by scripts/patches/ (docs/LLAMACPP.md,
"The exact configuration").

- AMX CPUs: tests/llamacpp_kernels/amx_invariance.c, the same for the weights llama.cpp puts in its AMX buffer
  (one row on AVX512-VNNI, more on AMX tiles), skipped with its reason elsewhere;
- the kernels alone: tests/llamacpp_kernels/repack_invariance.c, compiled against the installed llama-cpp-python's
  ggml, multiplies repacked weights with 1..16 activation rows: every row of an M-row product (4-row gemm + one-row
  gemv for the rest) must be bitwise the row computed alone (gemv), for Q4_K (patched) and Q4_0 / IQ4_NL; and
  Q6_K and Q4_K weights that are not repacked, whose products of 8 rows and more go to the tiled matmul: on
  AVX512-VNNI builds the patched one-row kernels must round like it (elsewhere paraspec turns the tiled matmul off);
- whole models: tiny GGUF files quantized by llama.cpp itself to Q4_K and Q4_0 (all matrices repacked on an
  AVX2 CPU), Q6_K (none repacked: the tiled matmul where it is on) and Q4_K_M (llama.cpp's mix, as the reference
  pair): a forward of k tokens gives the logits of k one-token forwards, bitwise;
- the backend keeps the repacked kernels only where the probe finds them exact, and otherwise falls back to
  repacking off.
On an unpatched build the Q4_K cases fail (rows of the 4-row groups differ by ~1e-5 in the kernels).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from paraspec.models.llamacpp import model as llamacpp
from paraspec.models.llamacpp.model import PROBE_WIDTH, LlamaCppModel
from tests.llamacpp_checks import assert_forwards_are_one_token_forwards, one_at_a_time
from tests.tiny_gguf import quantize_gguf, tiny_hf_model, tiny_vocab, write_gguf

KERNELS_DIR = Path(__file__).resolve().parents[1] / "llamacpp_kernels"


def build_kernel_program(tmp_path_factory, name: str) -> Path:
    """tests/llamacpp_kernels/NAME.c built against the ggml that llama-cpp-python ships (headers and libraries)."""
    spec = importlib.util.find_spec("llama_cpp")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if spec is None or compiler is None:
        pytest.skip("needs llama-cpp-python and a C compiler")
    package = Path(spec.origin).parent
    lib, include = package / "lib", package.parent / "include"
    if not (include / "ggml-backend.h").exists() or not list(lib.glob("libggml-cpu.so*")):
        pytest.skip(f"llama-cpp-python's ggml headers or libraries are not installed ({include}, {lib})")
    exe = tmp_path_factory.mktemp("kernels") / name
    subprocess.run(
        [
            compiler,
            "-O2",
            "-o",
            str(exe),
            str(KERNELS_DIR / f"{name}.c"),
            f"-I{include}",
            f"-L{lib}",
            "-lggml",
            "-lggml-base",
            "-lggml-cpu",
            "-lm",
            f"-Wl,-rpath,{lib}",
        ],
        check=True,
    )
    return exe


@pytest.fixture(scope="module")
def kernel_program(tmp_path_factory) -> Path:
    return build_kernel_program(tmp_path_factory, "repack_invariance")


@pytest.fixture(scope="module")
def amx_program(tmp_path_factory) -> Path:
    return build_kernel_program(tmp_path_factory, "amx_invariance")


def tiled_build() -> bool:
    """Whether this build and CPU run the tiled matmul paraspec's patch makes invariant (else it is turned off)."""
    lib = llamacpp._llama_cpp()
    return llamacpp.tiled_matmul_patched(lib, lib.llama_print_system_info().decode(errors="replace"))


@pytest.mark.parametrize("kind", ["q4_K", "q4_0", "iq4_nl", "q6_K", "q4_K-tiled"])
@pytest.mark.parametrize("n,nc", [(256, 8), (1536, 256), (8960, 64)])  # (columns of the weight, its rows)
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_equal_one_row_products(kernel_program, kind, n, nc, threads):
    env = dict(os.environ)
    if kind in ("q6_K", "q4_K-tiled"):
        if not tiled_build():
            pytest.skip("the tiled matmul is made invariant on AVX512-VNNI builds only (paraspec turns it off here)")
        env["GGML_CPU_TILED_MM"] = "1"
    for seed in (1, 2):
        proc = subprocess.run(
            [str(kernel_program), kind, str(n), str(nc), str(threads), str(seed)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        if proc.returncode == 2:
            pytest.skip(proc.stdout.strip())  # not repacked on this CPU (no AVX2): nothing to check
        lines = proc.stdout.splitlines()
        assert len([x for x in lines if x.startswith("width ")]) == 16, proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{kind} {nc}x{n}, {threads} thread(s), seed {seed}:\n{proc.stdout}"
        # the product is the product: near a double-precision one of the same quantized values
        assert lines[-1].startswith("reference_max_rel_diff") and float(lines[-1].split()[-1]) < 1e-4, proc.stdout


AMX_SHAPES = [(256, 96), (1536, 256), (8960, 64)]  # (columns of the weight: K, its rows); rows % 32 == 0


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0", "q4_K", "q5_K", "q6_K", "iq4_xs"])
@pytest.mark.parametrize("n,nc", AMX_SHAPES + [(32, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_rows_equal_one_row_products(amx_program, kind, n, nc, threads):
    """On CPUs with AMX, llama.cpp multiplies the weights it places in its AMX buffer with AVX512-VNNI for one
    activation row and with AMX tiles (blocks of 32 rows, a tail unpacked) for more: M = 1..40 rows, every row
    bitwise the row alone. K = 32 (one block of the 32-value types) is the case paraspec's patch
    (scripts/patches/*invariant-amx*) fixes: a full 32-row block added its product to stale memory."""
    if n % 256 and kind not in ("q4_0", "q4_1", "q8_0"):
        pytest.skip(f"{kind} rows hold 256-value super blocks")
    for seed in (1, 2):
        proc = subprocess.run(
            [str(amx_program), kind, str(n), str(nc), str(threads), str(seed)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode == 2:
            pytest.skip(f"no AMX here: {proc.stdout.strip()}")
        lines = proc.stdout.splitlines()
        assert len([x for x in lines if x.startswith("width ")]) == 40, proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{kind} {nc}x{n}, {threads} thread(s), seed {seed}:\n{proc.stdout}"
        # q4_1's min term uses the activations' block sums as q8_1 stores them (s, in fp16), which the reference
        # (dequantized weights times dequantized activations) does not round: ~1e-3 there, ~1e-7 for the others
        tolerance = 3e-3 if kind == "q4_1" else 1e-4
        assert lines[-1].startswith("reference_max_rel_diff") and float(lines[-1].split()[-1]) < tolerance, proc.stdout


# -- whole models on repacked kernels ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repacked_files(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen2 (rows of 256 values: Q4_K's super block) quantized by llama.cpp to pure Q4_K and Q4_0."""
    folder = tmp_path_factory.mktemp("repacked")
    model = tiny_hf_model(
        "qwen2",
        len(tiny_vocab()[0]),
        tied=True,
        seed=21,
        scale=5,
        hidden_size=256,
        intermediate_size=512,
        max_position_embeddings=2048,
    )
    f32 = folder / "f32.gguf"
    write_gguf(f32, model)
    return {kind: quantize_gguf(f32, folder / f"{kind}.gguf", kind) for kind in ("Q4_K", "Q4_0", "Q6_K", "Q4_K_M")}


REPACKED = {"Q4_K": "q4_K_8x8", "Q4_0": "q4_0_8x8"}  # x86 with AVX2 (CPU_REPACK)


def repacked(log: str, kind: str) -> bool:
    """Whether llama.cpp's log says it repacked `kind` weights: for the CPU_REPACK kernels, or (CPUs with AMX) for
    its AMX kernels (`amx repack tensor ... of type q4_K`)."""
    amx_type = kind.lower().replace("_k", "_K")
    return f"with {REPACKED[kind]}" in log or f"amx repack tensor blk.0.attn_q.weight of type {amx_type}" in log


@pytest.mark.parametrize("kind", ["Q4_K", "Q4_0"])
@pytest.mark.parametrize("threads", [1, 2])
def test_repacked_forward_is_bitwise_one_token_forwards(repacked_files, kind, threads, monkeypatch, capsys):
    monkeypatch.setenv("PARASPEC_LLAMACPP_LOG", "all")  # llama.cpp says which tensors it repacks
    model = LlamaCppModel(repacked_files[kind], 2048, (), n_threads=threads, probe=False, kernels="repacked")
    monkeypatch.delenv("PARASPEC_LLAMACPP_LOG")
    assert repacked(capsys.readouterr().err, kind), f"no {kind} weight was repacked on this CPU"
    assert model.kernels == "repacked" and model.exact_width == PROBE_WIDTH  # no probe: no split either
    for context in (40, 600):
        ids = np.random.default_rng(context).integers(0, model.vocab_size, size=context + 16).tolist()
        assert_forwards_are_one_token_forwards(model, ids, context, kind)
    model.close()


def test_auto_keeps_the_repacked_kernels_where_they_are_exact(repacked_files, monkeypatch, tmp_path):
    """By default the model runs repacked if the probe finds every width exact, without the fast-prefill copy
    (its context already has llama.cpp's prompt kernels)."""
    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    model = LlamaCppModel(repacked_files["Q4_K"], 2048, (), n_threads=2)
    assert model.kernels == "repacked" and model.exact_width == PROBE_WIDTH and model._fast is None
    prompt = list(range(3, 50))
    model.prefill(prompt)
    assert model.fast_prefills == 0 and model.length == len(prompt)
    records = list((tmp_path / "llamacpp" / "exactness").glob("*.json"))
    assert len(records) == 1 and '"kernels": "repacked"' in records[0].read_text()


def test_auto_falls_back_to_plain_kernels_where_repacked_ones_are_not_exact(gguf_pair, monkeypatch, tmp_path):
    """A build or CPU whose repacked kernels the probe finds inexact (here: the probe made to say so) runs with
    repacking off, measured again; asked for explicitly, the repacked kernels stay, split to their width."""
    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    real = llamacpp.run_probe

    def repacked_inexact(model):
        width, rows = real(model)
        return (3 if model.kernels == "repacked" else width), rows

    monkeypatch.setattr(llamacpp, "run_probe", repacked_inexact)
    auto = LlamaCppModel(gguf_pair["target"], 2048, (), n_threads=1)
    assert auto.kernels == "plain" and auto.exact_width == PROBE_WIDTH and auto._fast is not None
    asked = LlamaCppModel(gguf_pair["target"], 2048, (), n_threads=1, kernels="repacked")
    assert asked.kernels == "repacked" and asked.exact_width == 3
    monkeypatch.setenv("PARASPEC_LLAMACPP_KERNELS", "plain")
    assert LlamaCppModel(gguf_pair["target"], 2048, (), n_threads=1).kernels == "plain"
    monkeypatch.setenv("PARASPEC_LLAMACPP_KERNELS", "fast")
    with pytest.raises(ValueError, match="kernels 'fast'"):
        LlamaCppModel(gguf_pair["target"], 2048, (), n_threads=1)


def test_probe_cache_tells_kernels_apart(gguf_pair, monkeypatch, tmp_path):
    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    plain = LlamaCppModel(gguf_pair["target"], 2048, (), n_threads=1, kernels="plain")
    repacked = LlamaCppModel(gguf_pair["target"], 2048, (), n_threads=1, kernels="repacked")
    assert llamacpp._probe_cache(plain) != llamacpp._probe_cache(repacked)
    assert len(list((tmp_path / "llamacpp" / "exactness").glob("*.json"))) == 2
    assert os.environ.get("GGML_CPU_TILED_MM") == ("1" if tiled_build() else "0")


@pytest.mark.parametrize("kind", ["Q6_K", "Q4_K_M"])
@pytest.mark.parametrize("threads", [1, 2])
def test_tiled_forward_is_bitwise_one_token_forwards(repacked_files, kind, threads):
    """Q6_K matrices are not repacked on x86: from 8 tokens on they go to the tiled matmul where paraspec leaves it
    on (patched AVX512-VNNI builds), and its rows must be the one-row kernel's; elsewhere the tiled matmul is off."""
    assert llamacpp.tiled_matmul() == tiled_build()
    model = LlamaCppModel(repacked_files[kind], 2048, (), n_threads=threads, probe=False, kernels="repacked")
    for context in (40, 600):
        ids = np.random.default_rng(context + 1).integers(0, model.vocab_size, size=context + 16).tolist()
        assert_forwards_are_one_token_forwards(model, ids, context, kind)
    model.close()


def test_the_tiled_matmul_is_on_only_where_the_patch_covers_it():
    """On a build without the tiled patch's mark, or one compiled without AVX512-VNNI, it is not trusted."""
    marked, unmarked = type("lib", (), {"__paraspec_tiled_kquants__": True}), type("lib", (), {})
    assert llamacpp.tiled_matmul_patched(marked, "AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | REPACK = 1")
    assert not llamacpp.tiled_matmul_patched(marked, "AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 0 | REPACK = 1")
    assert not llamacpp.tiled_matmul_patched(marked, "AVX2 = 1 | FMA = 1 | REPACK = 1")
    assert not llamacpp.tiled_matmul_patched(unmarked, "AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | REPACK = 1")


def test_profile_says_which_kernels_ran(gguf_pair, tmp_path):
    """`paraspec profile` on the llamacpp backend records each model's kernels and exact width: the target's exact
    configuration, the draft's fastest (tinyBLAS; its forwards unsplit: n_batch)."""
    import json

    from paraspec.cli.main import main
    from paraspec.runtime.devices import available_cores

    core = f"cpu:{available_cores()[0]}"
    out = tmp_path / "profile.json"
    assert (
        main(
            [
                "profile",
                "--target",
                str(gguf_pair["target"]),
                "--draft",
                str(gguf_pair["draft"]),
                "--backend",
                "llamacpp",
                "--num-prompts",
                "1",
                "--tokens",
                "4",
                "--match-tokens",
                "8",
                "--widths",
                "1,4",
                "--target-devices",
                core,
                "--draft-devices",
                core,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    profile = json.loads(out.read_text())
    for role in ("target", "draft"):
        assert profile[role]["llamacpp"]["kernels"] in ("repacked", "plain")
        assert profile[role]["llamacpp"]["tiled_matmul"] == tiled_build()
    target, draft = profile["target"]["llamacpp"], profile["draft"]["llamacpp"]
    assert (target["exact"], target["tinyblas"], target["exact_width"]) == (True, False, PROBE_WIDTH)
    assert (draft["exact"], draft["tinyblas"], draft["kernels"]) == (False, True, "repacked")
    assert draft["exact_width"] > PROBE_WIDTH


def test_repacked_one_thread_equals_two_threads(repacked_files):
    """amusd's target runs on one core, ar's on two: on the repacked kernels too their logits agree bitwise."""
    ids = list(range(3, 60))
    runs = [
        one_at_a_time(
            LlamaCppModel(repacked_files["Q4_K"], 2048, (), n_threads=t, probe=False, kernels="repacked"),
            ids[:40],
            ids[40:],
        )
        for t in (1, 2)
    ]
    assert torch.equal(*runs)


def test_a_tiled_matmul_asked_for_where_it_is_not_exact_is_refused():
    """GGML_CPU_TILED_MM=1 on a build or CPU the patch does not cover (here: the check made to say so, in a fresh
    process, as ggml reads the switch once per process) is an error that names the fix, not a near-exact run."""
    import sys

    code = (
        "import paraspec.models.llamacpp.model as L\nL.tiled_matmul_patched = lambda lib, info: False\nL._llama_cpp()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, GGML_CPU_TILED_MM="1"),
    )
    assert proc.returncode != 0 and "GGML_CPU_TILED_MM=1" in proc.stderr and "unset it" in proc.stderr, proc.stderr
    unset = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
    proc = subprocess.run(
        [sys.executable, "-c", code + "import os; print(os.environ['GGML_CPU_TILED_MM'])"],
        capture_output=True,
        text=True,
        timeout=120,
        env=unset,
    )
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "0", proc.stderr
