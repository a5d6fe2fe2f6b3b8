"""Where paraspec keeps what it makes on disk, and how a folder appears there whole: cache paths, file hashes,
the `paraspec_source.json` marker, and atomic publishing (build in a hidden sibling folder, then rename).

A leaf: it imports nothing from paraspec, so the loader, the GGUF converter, the llama.cpp backend and
scripts/fetch_models.py all use it without importing one another.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

MARKER = "paraspec_source.json"
MARKER_FORMAT = 1


def cache_dir() -> Path:
    return Path(os.environ.get("PARASPEC_CACHE", Path.home() / ".cache" / "paraspec"))


def sha256_prefix(path: Path, chunk: int = 1 << 24) -> str:
    """Hash of the size and the first and last 16 MiB: enough to key a conversion cache, fast on GBs."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(chunk))
        f.seek(max(0, path.stat().st_size - chunk))
        h.update(f.read(chunk))
    return h.hexdigest()[:16]


def file_sha256(path: str | os.PathLike, progress: bool = False, chunk: int = 1 << 22) -> str:
    """The sha256 hex digest of a file, read in chunks (optionally with a tqdm bar)."""
    path = Path(path)
    h = hashlib.sha256()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=path.stat().st_size,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"sha256 {path.name}",
            leave=False,
        )
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            if bar is not None:
                bar.update(len(block))
    if bar is not None:
        bar.close()
    return h.hexdigest()


def read_marker(folder: str | os.PathLike) -> dict | None:
    """The `paraspec_source.json` record of a folder made by this module (or scripts/fetch_models.py), if it is
    there and every file it lists exists with the recorded size; otherwise None."""
    folder = Path(folder)
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict):
        return None
    for name, size in (marker.get("files") or {}).items():
        p = folder / name
        try:
            if p.stat().st_size != size:
                return None
        except OSError:
            return None
    return marker


def made_by_paraspec(folder: Path) -> bool:
    """Whether `folder` carries a paraspec_source.json (complete or not): then it is ours to replace."""
    try:
        return "paraspec_format" in json.loads((folder / MARKER).read_text())
    except (OSError, ValueError, TypeError):
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _partial_prefix(out_dir: Path) -> str:
    return f".{out_dir.name}.partial-"


def clean_stale_partials(out_dir: str | os.PathLike) -> None:
    """Remove temporary folders left next to `out_dir` by conversions whose process is gone."""
    out_dir = Path(out_dir)
    if not out_dir.parent.exists():
        return
    prefix = _partial_prefix(out_dir)
    for p in out_dir.parent.glob(prefix + "*"):
        pid = p.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def make_partial_dir(out_dir: str | os.PathLike) -> Path:
    """A fresh hidden folder next to `out_dir` to build it in (same filesystem, so the final rename is atomic)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_partials(out_dir)
    tmp = out_dir.parent / f"{_partial_prefix(out_dir)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def publish_dir(tmp: Path, out_dir: str | os.PathLike) -> Path:
    """Move the finished `tmp` folder to `out_dir`, replacing what is there (the caller decided it may)."""
    out_dir = Path(out_dir)
    old = None
    if out_dir.exists() or out_dir.is_symlink():
        if out_dir.is_dir() and not out_dir.is_symlink() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        else:
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
    return out_dir


def write_marker(folder: Path, record: dict) -> None:
    """Write `paraspec_source.json` last, listing every file in the folder with its size."""
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != MARKER}
    record = {
        "paraspec_format": MARKER_FORMAT,
        **record,
        "files": files,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    (folder / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    _fix_modes(folder)


def _fix_modes(folder: Path) -> None:
    """Files as the umask allows (safetensors creates its files 0600), so a shared cache stays readable."""
    umask = os.umask(0)
    os.umask(umask)
    for p in folder.iterdir():
        if p.is_file():
            os.chmod(p, 0o666 & ~umask)


def write_json(path: Path, record) -> None:
    """`record` as JSON at `path`, whole or not at all (a per-process temporary file, then a rename: two processes
    writing the same verdict do not interleave)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)
