"""scripts/build_llamacpp.py: the wheel's cache key follows its patches' content, and a patch that does not apply
stops the build (no download or build here: the key and the patching alone)."""
from __future__ import annotations

import importlib.util
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
    assert [p.name for p in build.PATCHES] == ["llamacpp-0.3.36-invariant-gemv.patch",
                                               "llamacpp-0.3.36-invariant-tiled-kquants.patch"]
    assert "+++ b/vendor/llama.cpp/ggml/src/ggml-cpu/arch/x86/repack.cpp" in build.PATCHES[0].read_text()
    tiled = build.PATCHES[1].read_text()
    assert "+++ b/vendor/llama.cpp/ggml/src/ggml-cpu/arch/x86/quants.c" in tiled
    assert "+__paraspec_tiled_kquants__ = True" in tiled      # the mark the backend trusts the tiled matmul by
    args = build.WHEEL_CMAKE_ARGS
    one, same, other = tmp_path / "one.patch", tmp_path / "renamed.patch", tmp_path / "other.patch"
    one.write_text(PATCH)
    same.write_text(PATCH)
    other.write_text(PATCH.replace("x + 2", "x + 3"))
    key = build.build_key("wheel", args, "tag", [one])
    assert key == build.build_key("wheel", args, "tag", [same])          # by content, not by name
    assert key != build.build_key("wheel", args, "tag", [other])         # a changed patch is another build
    assert key != build.build_key("wheel", args, "tag")                  # and so is no patch
    assert build.build_key("peer", build.PEER_CMAKE_ARGS) == build.build_key("peer", build.PEER_CMAKE_ARGS, "", [])
    assert build.wheel_dir(build.python_tag(sys.executable)).name.endswith(
        build.build_key("wheel", args, build.python_tag(sys.executable), build.PATCHES))


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
    with pytest.raises(SystemExit, match="good.patch does not apply"):     # already applied: not silently skipped
        build.apply_patches(src, [good])
    assert (src / "src" / "kernel.c").read_text().count("x + 2") == 1
