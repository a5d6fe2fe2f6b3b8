#!/usr/bin/env python
"""Build llama.cpp once per (version, build options, CPU, compiler) and reuse the build afterwards.

    python scripts/build_llamacpp.py wheel  [--python .venv/bin/python]   # llama-cpp-python, paraspec's backend
    python scripts/build_llamacpp.py peer                                  # llama-server + llama-speculative-simple

Both come from the same pinned source: the llama-cpp-python sdist on PyPI (VERSION below) and the llama.cpp
it vendors.

* `wheel` builds llama-cpp-python natively for this CPU with the options paraspec's exact verification needs
  (llamafile's tinyBLAS off: it computes f16 attention products with other kernels for several tokens than for
  one, see docs/BENCHMARKS.md "llama.cpp exactness") and installs it into the given Python.
* `peer` builds llama.cpp's own programs with its **default** options: the peer is what a user would run.

Why a cache of our own: pip's wheel cache ignores CMAKE_ARGS and silently reuses a wheel built with other options;
and a native build (-march=native) made on an AVX-512 CPU dies with SIGILL on an AVX2-only one. The cache key
hashes the version, the CMake options, the CPU's feature flags, the compiler and the Python tag; builds live in
$PARASPEC_CACHE/llamacpp/<kind>-<version>-<key>/ (PARASPEC_CACHE defaults to ~/.cache/paraspec).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"
WHEEL_CMAKE_ARGS = [
    "-DGGML_NATIVE=ON",
    "-DGGML_LLAMAFILE=OFF",  # tinyBLAS is not batch-invariant (docs/BENCHMARKS.md)
    "-DLLAVA_BUILD=OFF",  # multimodal helpers: not used, and a third of the build time
]
PEER_CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",  # without these two the build downloads a web UI
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    # static: shared libraries would carry the temporary build folder as their RPATH; the kernels are the same
    "-DBUILD_SHARED_LIBS=OFF",
]
PEER_TARGETS = ["llama-server", "llama-speculative-simple"]


def cache_root() -> Path:
    return Path(os.environ.get("PARASPEC_CACHE", Path.home() / ".cache" / "paraspec")) / "llamacpp"


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def compiler_version() -> str:
    try:
        return subprocess.run(["c++", "--version"], capture_output=True, text=True, check=False).stdout.splitlines()[0]
    except (OSError, IndexError):
        return "unknown"


def build_key(kind: str, cmake_args: list[str], python_tag: str = "") -> str:
    parts = [kind, VERSION, " ".join(cmake_args), cpu_flags(), compiler_version(), python_tag]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def fetch_sdist(dest: Path) -> Path:
    """Download and unpack the pinned sdist; return its top folder."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-cache-dir",
         "-q", "-d", str(dest), f"llama-cpp-python=={VERSION}"],
        check=True,
    )
    archive = next(dest.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest / f"llama_cpp_python-{VERSION}"


def python_tag(python: str) -> str:
    code = "import sys, sysconfig; print(sys.implementation.cache_tag, sysconfig.get_platform())"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def installed_version(python: str) -> str | None:
    code = "import importlib.metadata as m; print(m.version('llama_cpp_python'))"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def build_wheel(python: str, force: bool) -> None:
    tag = python_tag(python)
    key = build_key("wheel", WHEEL_CMAKE_ARGS, tag)
    out = cache_root() / f"wheel-{VERSION}-{key}"
    wheels = sorted(out.glob("llama_cpp_python-*.whl"))
    if force or not wheels:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        print(f"building llama-cpp-python {VERSION} ({' '.join(WHEEL_CMAKE_ARGS)}); ~10-25 min on 2 cores",
              flush=True)
        start = time.time()
        env = dict(os.environ, CMAKE_ARGS=" ".join(WHEEL_CMAKE_ARGS),
                   CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
        subprocess.run(
            [python, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w", str(out),
             f"llama-cpp-python=={VERSION}"],
            check=True, env=env,
        )
        wheels = sorted(out.glob("llama_cpp_python-*.whl"))
        (out / "build.json").write_text(json.dumps({
            "version": VERSION, "cmake_args": WHEEL_CMAKE_ARGS, "python": tag, "compiler": compiler_version(),
            "seconds": round(time.time() - start), "cpu_flags": cpu_flags()}, indent=1))
    else:
        print(f"llama-cpp-python {VERSION}: cached build {out.name}")
    # the record of what was installed lives in the environment (its sys.prefix), so two venvs do not fight
    prefix = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                            check=True).stdout.strip()
    marker = Path(prefix) / ".paraspec-llamacpp-build"
    stamp = str(wheels[-1])      # the build folder's name carries the key (options, CPU, compiler, Python)
    if installed_version(python) == VERSION and marker.exists() and marker.read_text() == stamp:
        return
    # uninstall first: pip would keep an installed 0.3.36 built with other options ("already satisfied")
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "llama-cpp-python"], check=False,
                   capture_output=True)
    subprocess.run([python, "-m", "pip", "install", "-q", str(wheels[-1])], check=True)   # + its dependencies
    marker.write_text(stamp)


def peer_dir() -> Path:
    """Where `peer` puts (or has put) llama-server and llama-speculative-simple for this CPU and compiler."""
    return cache_root() / f"peer-{VERSION}-{build_key('peer', PEER_CMAKE_ARGS)}" / "bin"


def build_peer(force: bool = False) -> Path:
    """Build the peer programs unless this very build is cached; return the folder holding them."""
    out = peer_dir()
    if not force and all((out / t).exists() for t in PEER_TARGETS):
        return out
    print(f"building llama.cpp {', '.join(PEER_TARGETS)} from llama-cpp-python {VERSION}'s source "
          f"(default options) into {out}; ~5-10 min on 2 cores", file=sys.stderr, flush=True)
    start = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent.parent) as tmp:
        src = fetch_sdist(Path(tmp)) / "vendor" / "llama.cpp"
        build = Path(tmp) / "build"
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), *PEER_CMAKE_ARGS], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *PEER_TARGETS],
                       check=True, stdout=subprocess.DEVNULL)
        # assemble next to the destination and move it in at once: a killed build leaves no half folder
        staged = Path(tmp) / "bin"
        staged.mkdir()
        for target in PEER_TARGETS:
            shutil.copy2(build / "bin" / target, staged / target)
        shutil.rmtree(out, ignore_errors=True)
        staged.rename(out)
    (out.parent / "build.json").write_text(json.dumps({
        "version": VERSION, "cmake_args": PEER_CMAKE_ARGS, "compiler": compiler_version(),
        "seconds": round(time.time() - start), "cpu_flags": cpu_flags()}, indent=1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["wheel", "peer"])
    parser.add_argument("--python", default=sys.executable, help="interpreter to install the wheel into")
    parser.add_argument("--force", action="store_true", help="rebuild even if a cached build exists")
    args = parser.parse_args()
    if args.kind == "wheel":
        build_wheel(args.python, args.force)
    else:
        print(build_peer(args.force))


if __name__ == "__main__":
    main()
