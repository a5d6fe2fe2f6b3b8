"""scripts/build_llamacpp.py: the wheel's cache key follows its patches' content, and a patch that does not apply
stops the build (no download or build here: the key and the patching alone)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_llamacpp.py"


@pytest.fixture(scope="module")
def build():
    spec = importlib.util.spec_from_file_location("build_llamacpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PATCH = """a comment about why, which patch ignores

--- a/src/kernel.c
+++ b/src/kernel.c
@@ -1,3 +1,3 @@
 int f(int x) {
-    return x + 1;
+    return x + 2;
 }
"""


def test_the_wheel_is_patched_and_its_key_follows_the_patches(build, tmp_path):
    names = {p.name.removeprefix("llamacpp-0.3.36-").removesuffix(".patch"): p for p in build.PATCHES}
    assert list(names) == [
        "fix-amx-tile-config",
        "gated-llamafile",
        "invariant-amx",
        "invariant-flash-attn",
        "invariant-gemv",
        "invariant-tiled-kquants",
    ]
    # the peer gets the crash fix and none of the exactness patches: it stays llama.cpp's defaults
    assert [p.name for p in build.PEER_PATCHES] == ["llamacpp-0.3.36-fix-amx-tile-config.patch"]
    assert "+++ b/vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp" in build.PEER_PATCHES[0].read_text()
    assert "+++ b/vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp" in names["invariant-amx"].read_text()
    gated = names["gated-llamafile"].read_text()
    # tinyBLAS only where a context asks for it: the switch, and the symbol the backend finds it by
    assert "+    if (src1_cont && params->use_llamafile) {" in gated
    assert "+    LLAMA_API bool llama_paraspec_set_llamafile(struct llama_context * ctx, bool on);" in gated
    flash = names["invariant-flash-attn"].read_text()
    assert "+++ b/vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp" in flash
    assert "+__paraspec_flash_attn__ = True" in flash  # the mark the backend turns flash attention on by
    assert "+++ b/vendor/llama.cpp/ggml/src/ggml-cpu/arch/x86/repack.cpp" in names["invariant-gemv"].read_text()
    tiled = names["invariant-tiled-kquants"].read_text()
    assert "+++ b/vendor/llama.cpp/ggml/src/ggml-cpu/arch/x86/quants.c" in tiled
    assert "+__paraspec_tiled_kquants__ = True" in tiled  # the mark the backend trusts the tiled matmul by
    args = build.WHEEL_CMAKE_ARGS
    one, same, other = tmp_path / "one.patch", tmp_path / "renamed.patch", tmp_path / "other.patch"
    one.write_text(PATCH)
    same.write_text(PATCH)
    other.write_text(PATCH.replace("x + 2", "x + 3"))
    key = build.build_key("wheel", args, "tag", [one])
    assert key == build.build_key("wheel", args, "tag", [same])  # by content, not by name
    assert key != build.build_key("wheel", args, "tag", [other])  # a changed patch is another build
    assert key != build.build_key("wheel", args, "tag")  # and so is no patch
    assert build.build_key("peer", build.PEER_CMAKE_ARGS) == build.build_key("peer", build.PEER_CMAKE_ARGS, "", [])
    assert build.peer_dir().parent.name.endswith(build.build_key("peer", build.PEER_CMAKE_ARGS, "", build.PEER_PATCHES))
    assert build.wheel_dir(build.python_tag(sys.executable)).name.endswith(
        build.build_key("wheel", args, build.python_tag(sys.executable), build.PATCHES)
    )


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the patch program")
def test_patches_apply_or_stop_the_build(build, tmp_path):
    src = tmp_path / "sdist"
    (src / "src").mkdir(parents=True)
    (src / "src" / "kernel.c").write_text("int f(int x) {\n    return x + 1;\n}\n")
    good, bad = tmp_path / "good.patch", tmp_path / "bad.patch"
    good.write_text(PATCH)
    bad.write_text(PATCH.replace("x + 1;", "x - 1;"))
    build.apply_patches(src, [good])
    assert "x + 2" in (src / "src" / "kernel.c").read_text()
    with pytest.raises(SystemExit, match="bad.patch does not apply"):
        build.apply_patches(src, [bad])
    with pytest.raises(SystemExit, match="good.patch does not apply"):  # already applied: not silently skipped
        build.apply_patches(src, [good])
    assert (src / "src" / "kernel.c").read_text().count("x + 2") == 1


FAKE_PYTHON = """#!/bin/sh
# stands for a venv's python: `-c ...` succeeds; the smoke run dies with SIGILL while a build named in $CRASHING
# is installed (install_wheel, replaced below, writes the installed wheel's path to $INSTALLED)
case "$*" in
  *smoke*) if grep -q -e "$CRASHING" "$INSTALLED"; then kill -ILL $$; fi
           echo '{"ok": true, "ran": ["Q4_K_M@1t"]}';;
esac
exit 0
"""


def fake_builds(build, monkeypatch, tmp_path, crashing: str):
    """Builds that only write a wheel file named after their variant, and a python whose smoke run dies with
    SIGILL for the variants matching `crashing`. Returns (python, the variants built in order)."""
    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path / "cache"))
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    installed = tmp_path / "installed"
    installed.write_text("")
    monkeypatch.setenv("INSTALLED", str(installed))
    monkeypatch.setenv("CRASHING", crashing)
    monkeypatch.setattr(build, "python_tag", lambda python: "tag")
    built = []

    def fake_build(python, out, cmake_args):
        name = next(n for n, a in build.WHEEL_VARIANTS.items() if a == cmake_args)
        built.append(name)
        out.mkdir(parents=True)
        (out / f"llama_cpp_python-0.3.36-{name}.whl").write_text("")

    monkeypatch.setattr(build, "_build_wheel_into", fake_build)
    monkeypatch.setattr(build, "install_wheel", lambda python, wheel: installed.write_text(wheel.name))
    return str(python), built


def test_a_build_the_cpu_kills_is_built_again_without_the_crashing_instructions(build, monkeypatch, tmp_path, capsys):
    """The native build's smoke run dies with SIGILL (injected): the build without AMX is made, checked and kept;
    the user is told; the verdicts are recorded, so the next run goes straight to the build that works."""
    python, built = fake_builds(build, monkeypatch, tmp_path, crashing="-native.whl")
    wheel = build.build_wheel(python, force=False)
    assert built == ["native", "native-no-amx"] and wheel.name.endswith("-native-no-amx.whl")
    told = capsys.readouterr().err
    assert "'native' build of llama.cpp died on this CPU in its smoke run (signal SIGILL" in told
    assert "building it again as 'native-no-amx' (without AMX instructions)" in told
    native = build.wheel_dir("tag", build.WHEEL_VARIANTS["native"])
    assert json.loads((native / "smoke.json").read_text())["signal"] == "SIGILL"
    assert build.build_wheel(python, force=False) == wheel and built == ["native", "native-no-amx"]
    assert "died" not in capsys.readouterr().err  # the crash is not run again


def test_a_build_that_survives_its_smoke_run_is_kept(build, monkeypatch, tmp_path):
    python, built = fake_builds(build, monkeypatch, tmp_path, crashing="no build matches this")
    assert build.build_wheel(python, force=False).name.endswith("-native.whl") and built == ["native"]
    native = build.wheel_dir("tag", build.WHEEL_VARIANTS["native"])
    assert json.loads((native / "smoke.json").read_text()) == {"ok": True, "ran": ["Q4_K_M@1t"]}


def test_every_variant_crashing_stops_with_the_way_out(build, monkeypatch, tmp_path):
    python, built = fake_builds(build, monkeypatch, tmp_path, crashing=".whl")
    with pytest.raises(SystemExit, match="every llama.cpp build variant crashed on this CPU.*backend='native'"):
        build.build_wheel(python, force=False)
    assert built == list(build.WHEEL_VARIANTS)


def test_no_amx_variant_leaves_amx_out_and_keeps_the_exact_options(build):
    native, no_amx = build.WHEEL_VARIANTS["native"], build.WHEEL_VARIANTS["native-no-amx"]
    assert native == build.WHEEL_CMAKE_ARGS and set(native) < set(no_amx)
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-tile" in no_amx  # -mno-amx-tile drops AMX-INT8/BF16 with it
    # tinyBLAS compiled in everywhere, behind the gated-llamafile patch's per-context switch (drafts only)
    assert all("-DGGML_LLAMAFILE=ON" in args for args in build.WHEEL_VARIANTS.values())
    assert len({build.build_key("wheel", a, "tag") for a in build.WHEEL_VARIANTS.values()}) == 3
