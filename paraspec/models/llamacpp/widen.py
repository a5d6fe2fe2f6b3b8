"""A draft model's Q5_0 matrices rewritten as Q8_0 holding the same values, for CPUs where Q8_0 has fast kernels.

A Q5_0 block is 32 weights q·d with q in -16..15 (5 bits) and one f16 scale d; a Q8_0 block is 32 weights q·d with
q in -127..127 and one f16 scale. Every Q5_0 block is therefore a Q8_0 block with the same d and the same q: the
weights are unchanged, bit for bit (tests/models/test_gguf_widen.py dequantizes both). What changes is the kernel:
llama.cpp has no AMX or repacked kernel for Q5_0, so on a CPU with AMX a draft made mostly of Q5_0 matrices (the
reference draft, Qwen2.5-Coder-0.5B Q4_K_M: 133 of them, because its 896 columns are not a multiple of 256) can
decode its prompt slower than its target (`benchmarks/llamacpp_prefill.py --compare-models`; docs/LLAMACPP.md).
The file is larger (Q8_0 blocks hold 34 bytes per 32 weights, Q5_0 blocks 22).

Only drafts are widened (the Engine, for the llamacpp backend): a draft's numbers do not enter the output, which
stays the target's; the target runs the user's file as llama.cpp would. Whether to widen is measured, not guessed
from the CPU's name (`widen_verdict`): once per (llama.cpp build, CPU, file, threads), a child process times the
draft's prompt and one-token forwards on both files, and the verdict is cached. PARASPEC_LLAMACPP_WIDEN_Q5_0=1/0
decides without measuring.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

from paraspec.models.cache import cache_dir, sha256_prefix, write_json

logger = logging.getLogger(__name__)

Q5_0_BLOCK, Q8_0_BLOCK = 22, 34  # bytes per 32 weights: f16 d + 4 bytes of high bits + 16 of nibbles; f16 d + 32

# the race behind the verdict: what a draft does for sd per request, in small: one prompt, then one-token forwards
RACE = {"prompt_tokens": 64, "steps": 16, "rounds": 3}
# the work the verdict weighs: a prompt and this many one-token forwards per prompt token (a 150-token prompt and 64
# new tokens drafted 5 at a time is ~0.7; longer answers, or amusd's draft decoding all along, are several)
DECODE_PER_PROMPT_TOKEN = 2
# the widened file must be this much faster at that work to be used: a verdict is kept for good, and a 3%
# difference is within the noise of one race
WIDEN_MARGIN = 0.97


def widen_switch() -> str:
    """PARASPEC_LLAMACPP_WIDEN_Q5_0: "1" widens, "0" never does, "auto" (the default) measures (`widen_verdict`)."""
    asked = os.environ.get("PARASPEC_LLAMACPP_WIDEN_Q5_0", "auto")
    if asked not in ("auto", "0", "1"):
        raise ValueError(f"PARASPEC_LLAMACPP_WIDEN_Q5_0={asked!r}: use auto, 0 or 1")
    return asked


def widening_pays(race: dict, prompt_tokens: int = RACE["prompt_tokens"]) -> bool:
    """From a race's timings (file as given first, widened second): whether a prompt of `prompt_tokens` and
    DECODE_PER_PROMPT_TOKEN one-token forwards per prompt token cost at most WIDEN_MARGIN as much on the widened
    file."""
    (p0, p1), (s0, s1) = race["prompt_s"], race["step_s"]
    steps = DECODE_PER_PROMPT_TOKEN * prompt_tokens
    return p1 + steps * s1 <= WIDEN_MARGIN * (p0 + steps * s0)


def _verdict_path(source: Path, n_threads: int) -> Path:
    from paraspec.models.llamacpp.model import _library_fingerprint  # the build and the CPU's flags

    key = hashlib.sha256(
        "\n".join(
            [
                _library_fingerprint(),
                "draft kernels",
                sha256_prefix(source),
                str(n_threads),
                json.dumps(RACE, sort_keys=True),
                str(WIDEN_MARGIN),
                str(DECODE_PER_PROMPT_TOKEN),
            ]
        ).encode()
    )
    return cache_dir() / "widened" / "verdicts" / f"{source.stem}-{key.hexdigest()[:20]}.json"


def widen_verdict(source: Path, wide: Path, n_threads: int) -> dict:
    """Whether the draft `source` runs faster as `wide` (its Q5_0 matrices as Q8_0) with `n_threads` threads here:
    {"widen": bool, "race": timings, ...}, measured once in a child process (the widened file's first Q8_0 products
    on this CPU; a crash there is a verdict against it, with the reason) and cached."""
    from paraspec.models.llamacpp.child import run_child

    path = _verdict_path(source, n_threads)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    print(
        f"paraspec: timing {source.name} as given and with its Q5_0 matrices as Q8_0 at {n_threads} thread(s), "
        f"once for this llama.cpp build and CPU (PARASPEC_LLAMACPP_WIDEN_Q5_0=0/1 decides without it)",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    try:
        race = run_child(
            ["race", json.dumps({"files": [str(source), str(wide)], "n_threads": n_threads, **RACE})],
            f"timing {source.name} against its widened copy",
            timeout=600,
        )
        verdict = {"widen": widening_pays(race), "race": race}
        (p0, p1), (s0, s1) = race["prompt_s"], race["step_s"]
        print(
            f"paraspec: {source.name}: prompt of {RACE['prompt_tokens']} {p0 * 1e3:.0f} -> {p1 * 1e3:.0f} ms, "
            f"one-token forward {s0 * 1e3:.1f} -> {s1 * 1e3:.1f} ms widened: "
            f"{'widening' if verdict['widen'] else 'kept as it is'}",
            file=sys.stderr,
            flush=True,
        )
    except RuntimeError as e:  # NativeCrash included: the draft runs from its own file
        verdict = {"widen": False, "error": str(e)}
        logger.warning("%s: the widened copy could not be timed (%s); the draft runs from its own file", source.name, e)
    verdict.update(seconds=round(time.perf_counter() - start, 2), threads=n_threads)
    write_json(path, verdict)
    return verdict


def q5_0_to_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Raw Q5_0 bytes (any shape whose last axis holds whole blocks) -> raw Q8_0 bytes of the same weights."""
    rows = blocks.reshape(-1, blocks.shape[-1])
    if rows.shape[-1] % Q5_0_BLOCK:
        raise ValueError(f"a Q5_0 row of {rows.shape[-1]} bytes is not whole blocks of {Q5_0_BLOCK}")
    b = rows.reshape(-1, Q5_0_BLOCK)
    bits = np.unpackbits(b[:, 2:6], axis=1, bitorder="little")  # bit j: the 5th bit of weight j
    nibbles = b[:, 6:]
    low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1)  # weights 0..15, then 16..31
    out = np.empty((b.shape[0], Q8_0_BLOCK), np.uint8)
    out[:, :2] = b[:, :2]  # the same f16 scale
    out[:, 2:] = (low | (bits << 4)) - np.uint8(16)  # 0..31 - 16, as int8's two's complement
    return out.reshape(*blocks.shape[:-1], -1)


def widen_q5_0(src: str | os.PathLike, dst: str | os.PathLike) -> int:
    """Write `src` with every Q5_0 tensor as Q8_0 (same values) to `dst`; returns how many tensors were widened."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = Path(f"{dst}.partial")
    writer = GGUFWriter(tmp, arch=arch)
    alignment = reader.fields.get("general.alignment")
    if alignment is not None:
        writer.data_alignment = int(alignment.contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        writer.add_key_value(
            name, field.contents(), kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None
        )
    widened = 0
    for t in reader.tensors:
        data, quant = t.data, t.tensor_type
        if quant == GGMLQuantizationType.Q5_0:
            data, quant = q5_0_to_q8_0(np.asarray(data)), GGMLQuantizationType.Q8_0
            widened += 1
        writer.add_tensor(t.name, data, raw_dtype=quant)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, dst)  # whole or not at all: a failed conversion leaves no file that looks done
    finally:
        tmp.unlink(missing_ok=True)
    return widened


def tensor_types(path: str | os.PathLike) -> set[str]:
    """The quantization types of a GGUF file's tensors ("Q5_0", "Q4_K", "F32", ...)."""
    from gguf import GGUFReader

    return {t.tensor_type.name for t in GGUFReader(path).tensors}


def widened(path: str | os.PathLike) -> Path:
    """`path`, or its widened copy if it holds Q5_0 tensors: made once (seconds; docs/LLAMACPP.md), cached by the
    source's content, like the verdict that a file has none (reading a GGUF's vocabulary takes seconds)."""
    path = Path(path)
    folder = cache_dir() / "widened"
    key = f"{path.stem}-{sha256_prefix(path)}"
    out, none = folder / f"{key}-q5_0-as-q8_0.gguf", folder / f"{key}.no-q5_0"
    if out.exists():
        return out
    if none.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    if "Q5_0" not in tensor_types(path):
        none.touch()
        return path
    print(
        f"paraspec: writing {path.name}'s Q5_0 matrices as Q8_0 (the same weights; llama.cpp has faster kernels "
        f"for Q8_0 on some CPUs), once, into {out} (PARASPEC_LLAMACPP_WIDEN_Q5_0=0 keeps the file as it is)",
        file=sys.stderr,
        flush=True,
    )
    widen_q5_0(path, out)
    return out
