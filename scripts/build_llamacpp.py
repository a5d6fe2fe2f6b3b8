#!/usr/bin/env python
"""Build llama.cpp once per (version, build options, CPU, compiler) and reuse the build afterwards.

    python scripts/build_llamacpp.py wheel  [--python .venv/bin/python]   # llama-cpp-python, paraspec's backend
    python scripts/build_llamacpp.py peer                                  # llama-server + llama-speculative-simple

Both come from the same pinned source: the llama-cpp-python sdist on PyPI (VERSION below) and the llama.cpp
it vendors.

* `wheel` builds llama-cpp-python natively for this CPU with the options paraspec's exact verification needs
  (llamafile's tinyBLAS off: it computes f16 attention products with other kernels for several tokens than for
  one, see docs/LLAMACPP.md, "The exact configuration"), from the sdist with the patches in scripts/patches/
  applied (they make llama.cpp's repacked weight kernels batch-invariant; each file's header says why), and
  installs it into the given Python. A patch that does not apply stops the build. The installed build is then
  run on tiny GGUF files in a child process (its "smoke run"); a build the CPU kills (SIGILL) is built again
  without the instructions that crash (WHEEL_VARIANTS), and the user is told.
* `peer` builds llama.cpp's own programs with its **default** options: the peer is what a user would run. It gets
  only the crash fixes (`*-fix-*.patch`: llama.cpp's AMX matmul dies with SIGILL without them), none of the
  exactness patches.

Why a cache of our own: pip's wheel cache ignores CMAKE_ARGS and silently reuses a wheel built with other options;
and a native build (-march=native) made on an AVX-512 CPU dies with SIGILL on an AVX2-only one. The cache key
hashes the version, the CMake options, the patches' content (wheel), the CPU's feature flags, the compiler and
the Python tag; builds live in
$PARASPEC_CACHE/llamacpp/<kind>-<version>-<key>/ (PARASPEC_CACHE defaults to ~/.cache/paraspec).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"
WHEEL_CMAKE_ARGS = [
    "-DGGML_NATIVE=ON",
    # tinyBLAS is not batch-invariant (docs/LLAMACPP.md): compiled in, but the gated-llamafile patch runs it only
    # in contexts that ask for it (draft models), so a target computes what a build without it computes
    "-DGGML_LLAMAFILE=ON",
    "-DLLAVA_BUILD=OFF",  # multimodal helpers: not used, and a third of the build time
]
# The builds `wheel` tries, in order, until one survives its smoke run on this CPU: native; native without AMX
# (-mno-amx-tile also drops AMX-INT8/BF16: llama.cpp then compiles no AMX kernel); portable (no -march=native).
WHEEL_VARIANTS = {
    "native": WHEEL_CMAKE_ARGS,
    "native-no-amx": WHEEL_CMAKE_ARGS + ["-DCMAKE_C_FLAGS=-mno-amx-tile", "-DCMAKE_CXX_FLAGS=-mno-amx-tile"],
    "portable": [a for a in WHEEL_CMAKE_ARGS if a != "-DGGML_NATIVE=ON"] + ["-DGGML_NATIVE=OFF"],
}
VARIANT_WHY = {"native-no-amx": "without AMX instructions", "portable": "without -march=native: slower kernels"}
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
# applied to the unpacked sdist (paths relative to its top folder, `patch -p1`), in name order: every patch to the
# wheel; to the peer only the crash fixes (`-fix-`), which change no result: the peer stays llama.cpp's defaults
PATCHES = sorted((Path(__file__).parent / "patches").glob(f"llamacpp-{VERSION}-*.patch"))
PEER_PATCHES = [p for p in PATCHES if p.name.startswith(f"llamacpp-{VERSION}-fix-")]


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


def patches_digest(patches: list[Path]) -> str:
    """What the patches change, by content (a renamed or moved file with the same content is the same build)."""
    return hashlib.sha256(b"".join(hashlib.sha256(p.read_bytes()).digest() for p in patches)).hexdigest()


def build_key(kind: str, cmake_args: list[str], python_tag: str = "", patches: list[Path] = ()) -> str:
    parts = [kind, VERSION, " ".join(cmake_args), cpu_flags(), compiler_version(), python_tag]
    if patches:  # no patches: the key of an unpatched build stays what it was
        parts.append(patches_digest(list(patches)))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def apply_patches(src: Path, patches: list[Path]) -> None:
    """Apply each patch to the unpacked sdist at `src`; stop with the patch's name if one does not apply cleanly
    (a dry run first, so a failing patch leaves no half-patched file)."""
    if patches and not shutil.which("patch"):
        raise SystemExit("applying llama.cpp's patches needs the `patch` program (apt-get install patch)")
    for patch in patches:
        for dry in (True, False):
            # --fuzz=0: a patch whose context has moved is refused, not placed where it seems to fit
            proc = subprocess.run(
                ["patch", "-p1", "--forward", "--batch", "--fuzz=0", "-d", str(src), "-i", str(patch)]
                + (["--dry-run"] if dry else []),
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise SystemExit(
                    f"{patch.name} does not apply to llama-cpp-python {VERSION}'s source:\n{proc.stdout}{proc.stderr}"
                )


def fetch_sdist(dest: Path) -> Path:
    """Download and unpack the pinned sdist; return its top folder."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--no-cache-dir",
            "-q",
            "-d",
            str(dest),
            f"llama-cpp-python=={VERSION}",
        ],
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


def wheel_dir(tag: str, cmake_args: list[str] = WHEEL_CMAKE_ARGS) -> Path:
    """Where `wheel` puts (or has put) the wheel for the Python of `tag` (python_tag), this CPU, compiler, options
    and patches."""
    return cache_root() / f"wheel-{VERSION}-{build_key('wheel', cmake_args, tag, PATCHES)}"


def _build_wheel_into(python: str, out: Path, cmake_args: list[str]) -> None:
    print(
        f"building llama-cpp-python {VERSION} ({' '.join(cmake_args)}; patches: "
        f"{', '.join(p.name for p in PATCHES) or 'none'}); ~10-25 min on 2 cores",
        flush=True,
    )
    start = time.time()
    tag = python_tag(python)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CMAKE_ARGS=" ".join(cmake_args), CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = fetch_sdist(Path(tmp))
        apply_patches(src, PATCHES)
        staged = Path(tmp) / "wheel"
        subprocess.run(
            [python, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w", str(staged), str(src)],
            check=True,
            env=env,
        )
        (staged / "build.json").write_text(
            json.dumps(
                {
                    "version": VERSION,
                    "cmake_args": cmake_args,
                    "patches": [p.name for p in PATCHES],
                    "patches_sha256": patches_digest(PATCHES),
                    "python": tag,
                    "compiler": compiler_version(),
                    "seconds": round(time.time() - start),
                    "cpu_flags": cpu_flags(),
                },
                indent=1,
            )
        )
        # moved in at once: a killed build leaves no folder without its wheel
        shutil.rmtree(out, ignore_errors=True)
        staged.rename(out)


def install_wheel(python: str, wheel: Path) -> None:
    """Install `wheel` into `python`'s environment unless it is the one installed there."""
    # the record of what was installed lives in the environment (its sys.prefix), so two venvs do not fight
    prefix = subprocess.run(
        [python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    marker = Path(prefix) / ".paraspec-llamacpp-build"
    stamp = str(wheel)  # the build folder's name carries the key (options, CPU, compiler, Python)
    if installed_version(python) == VERSION and marker.exists() and marker.read_text() == stamp:
        return
    # uninstall first: pip would keep an installed 0.3.36 built with other options ("already satisfied")
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "llama-cpp-python"], check=False, capture_output=True)
    subprocess.run([python, "-m", "pip", "install", "-q", str(wheel)], check=True)  # + its dependencies
    marker.write_text(stamp)


def smoke_verdict(python: str, out: Path, force: bool = False) -> dict:
    """Whether the build installed in `python` survives its smoke run (paraspec/models/llamacpp/child_tasks.py `smoke`:
    tiny GGUF files on the repacked/AMX kernels at widths 1 and 8, 1 and 2 threads, after a oneDNN matmul), run
    in a child process; recorded next to the wheel (the build's key includes this CPU's flags)."""
    known = {} if force else recorded_verdict(out)
    if known:
        return known
    check = subprocess.run([python, "-c", "import paraspec.models.llamacpp.child_tasks"], capture_output=True)
    if check.returncode != 0:
        print(
            "llama-cpp-python: paraspec is not installed in this environment; the build's smoke run is skipped",
            file=sys.stderr,
            flush=True,
        )
        return {"ok": None}
    proc = subprocess.run(
        [python, "-m", "paraspec.models.llamacpp.child_tasks", "smoke"], capture_output=True, text=True
    )
    if proc.returncode == 0:
        verdict = {"ok": True, "ran": json.loads(proc.stdout.strip().splitlines()[-1]).get("ran")}
    else:
        name = signal_name(proc.returncode)
        verdict = {
            "ok": False,
            "returncode": proc.returncode,
            "signal": name,
            "stderr": "\n".join(proc.stderr.strip().splitlines()[-10:]),
        }
        if name is None:  # not a crash of the kernels: a bug to see, not a build to change
            raise SystemExit(f"llama-cpp-python's smoke run failed (exit code {proc.returncode}):\n{proc.stderr}")
    (out / "smoke.json").write_text(json.dumps(verdict, indent=1))
    return verdict


def recorded_verdict(out: Path) -> dict:
    """The smoke run's verdict recorded next to the build in `out` ({} if none)."""
    record = out / "smoke.json"
    return json.loads(record.read_text()) if record.exists() else {}


def signal_name(returncode: int) -> str | None:
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def build_wheel(python: str, force: bool, install: bool = True) -> Path:
    """Build the patched wheel unless this very build is cached; install it into `python` and check it there in
    a child process. A build whose smoke run is killed by a signal (SIGILL: an instruction this CPU or VM refuses)
    is replaced by the next of WHEEL_VARIANTS, and the user is told."""
    tag = python_tag(python)
    names = list(WHEEL_VARIANTS)
    for i, name in enumerate(names):
        out = wheel_dir(tag, WHEEL_VARIANTS[name])
        if recorded_verdict(out).get("ok") is False and not force:
            continue  # this CPU already killed this build
        wheels = sorted(out.glob("llama_cpp_python-*.whl"))
        if force or not wheels:
            _build_wheel_into(python, out, WHEEL_VARIANTS[name])
            wheels = sorted(out.glob("llama_cpp_python-*.whl"))
        else:
            print(f"llama-cpp-python {VERSION}: cached build {out.name} ({name})")
        if not install:
            return wheels[-1]
        install_wheel(python, wheels[-1])
        verdict = smoke_verdict(python, out, force)
        if verdict.get("ok") is not False:
            return wheels[-1]
        after = f"building it again as '{names[i + 1]}' ({VARIANT_WHY[names[i + 1]]})" if i + 1 < len(names) else ""
        print(
            f"\nparaspec: the '{name}' build of llama.cpp died on this CPU in its smoke run (signal "
            f"{verdict['signal']}: an instruction this CPU or VM refuses, or a fault in a kernel); {after}\n"
            f"{verdict.get('stderr', '')}\n",
            file=sys.stderr,
            flush=True,
        )
    raise SystemExit("every llama.cpp build variant crashed on this CPU (see above); use backend='native'")


def peer_dir() -> Path:
    """Where `peer` puts (or has put) llama-server and llama-speculative-simple for this CPU and compiler."""
    return cache_root() / f"peer-{VERSION}-{build_key('peer', PEER_CMAKE_ARGS, patches=PEER_PATCHES)}" / "bin"


def build_peer(force: bool = False) -> Path:
    """Build the peer programs unless this very build is cached; return the folder holding them."""
    out = peer_dir()
    if not force and all((out / t).exists() for t in PEER_TARGETS):
        return out
    print(
        f"building llama.cpp {', '.join(PEER_TARGETS)} from llama-cpp-python {VERSION}'s source "
        f"(default options; patches: {', '.join(p.name for p in PEER_PATCHES) or 'none'}) into {out}; "
        f"~5-10 min on 2 cores",
        file=sys.stderr,
        flush=True,
    )
    start = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent.parent) as tmp:
        sdist = fetch_sdist(Path(tmp))
        apply_patches(sdist, PEER_PATCHES)
        src = sdist / "vendor" / "llama.cpp"
        build = Path(tmp) / "build"
        subprocess.run(
            ["cmake", "-S", str(src), "-B", str(build), *PEER_CMAKE_ARGS], check=True, stdout=subprocess.DEVNULL
        )
        subprocess.run(
            ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *PEER_TARGETS],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        # assemble next to the destination and move it in at once: a killed build leaves no half folder
        staged = Path(tmp) / "bin"
        staged.mkdir()
        for target in PEER_TARGETS:
            shutil.copy2(build / "bin" / target, staged / target)
        shutil.rmtree(out, ignore_errors=True)
        staged.rename(out)
    (out.parent / "build.json").write_text(
        json.dumps(
            {
                "version": VERSION,
                "cmake_args": PEER_CMAKE_ARGS,
                "patches": [p.name for p in PEER_PATCHES],
                "compiler": compiler_version(),
                "seconds": round(time.time() - start),
                "cpu_flags": cpu_flags(),
            },
            indent=1,
        )
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["wheel", "peer"])
    parser.add_argument("--python", default=sys.executable, help="interpreter to install the wheel into")
    parser.add_argument("--force", action="store_true", help="rebuild even if a cached build exists")
    parser.add_argument(
        "--no-install", action="store_true", help="wheel: build (or find) the wheel and print its path; install nothing"
    )
    args = parser.parse_args()
    if args.kind == "wheel":
        wheel = build_wheel(args.python, args.force, install=not args.no_install)
        if args.no_install:
            print(wheel)
    else:
        print(build_peer(args.force))


if __name__ == "__main__":
    main()
