"""Before anything loads: an EngineConfig's checkpoints resolved (once each; a .gguf converted), the backend "auto"
chosen, whether requests can share forwards (and so how many sequences each model holds), and the vocabularies
checked to agree -- the Placement a strategy's setup() gets (strategies/base.py)."""

from __future__ import annotations

from dataclasses import replace

from paraspec.config import EngineConfig
from paraspec.errors import IncompatibleModelsError
from paraspec.models.loader import load_tokenizer_if_any, output_rows, parse_dtype, resolve_models, widened_draft
from paraspec.strategies.base import Placement


def place(config: EngineConfig) -> Placement:
    """Each checkpoint resolved (and, for a .gguf, converted) once, in this process: a bad path fails before any
    worker starts; the backend "auto" chosen from them (models.loader.resolve_models). Requests share forwards (the
    models load with max_num_seqs sequences: `load["n_seqs"]`) where the strategy's loop runs here on models with a
    sequence each: llama.cpp, and the native decoder's dynamic forward (models/native/sequences.py)."""
    target_devices, draft_devices = list(config.target_devices), config.used_draft_devices
    draft_dtype = parse_dtype(config.dtype, draft_devices[0].torch_device) if draft_devices else None
    specs = [config.target] + config.draft_checkpoints
    dtypes = [parse_dtype(config.dtype, target_devices[0].torch_device)] + [draft_dtype] * (len(specs) - 1)
    backend, resolved = resolve_models(specs, dtypes, config.model_backend, target_devices + draft_devices)
    if backend == "llamacpp":  # drafts' Q5_0 matrices as Q8_0 where that is faster (measured)
        threads = draft_devices[0].num_threads if draft_devices else target_devices[0].num_threads
        resolved = resolved[:1] + [widened_draft(f, threads) for f in resolved[1:]]
    batches = config.strategy_class.caps.batches and (
        backend == "llamacpp" or (backend == "native" and native_dynamic(config))
    )
    seqs = {"n_seqs": config.max_num_seqs} if batches and config.max_num_seqs > 1 else {}
    folders = iter(resolved[1:])
    drafts = [d if d.model_free else replace(d, spec=next(folders)) for d in config.draft_specs]  # in order
    load = dict(
        dtype=config.dtype,
        backend=backend,
        max_context=config.max_context,
        padded_width=config.padded_width,
        compile_step=config.compile_step,
        **seqs,
    )
    return Placement(
        resolved[0],
        drafts,
        target_devices,
        draft_devices,
        load,
        config.runtime_kind,
        config.worker_timeout,
        config.runtime_options,
    )


def native_dynamic(config: EngineConfig) -> bool:
    """Native checkpoints on the dynamic forward: no padded width (None, or "auto" on CPUs only), no compile, no
    simulated model (their forwards are not a decoder's)."""
    from paraspec.models.simulated import SimulatedSpec

    if any(isinstance(m, SimulatedSpec) for m in [config.target] + config.draft_checkpoints):
        return False
    devices = list(config.target_devices) + config.used_draft_devices
    on_cpu = all(d.torch_device.startswith("cpu") for d in devices)
    return not config.compile_step and (config.padded_width is None or (config.padded_width == "auto" and on_cpu))


def check_vocabularies(placement: Placement, tokenizer) -> list[tuple[int, object]]:
    """Draft and target share one token space: checked from their tokenizers and config.json (output_rows) before
    any model loads. Returns what only the loaded models can tell: (draft index, its tokenizer) for a checkpoint
    whose config.json does not state its output rows."""
    target_rows, late = output_rows(placement.target), []
    for i, folder in enumerate(placement.draft_checkpoints):
        draft_tokenizer, rows = load_tokenizer_if_any(folder), output_rows(folder)
        check_compatible(target_rows, rows, tokenizer, draft_tokenizer)
        if target_rows is None or rows is None:
            late.append((i, draft_tokenizer))
    return late


def check_compatible(target_rows: int | None, draft_rows: int | None, target_tok, draft_tok) -> None:
    """Draft and target must share one token space; only the padding rows of the output layers may differ.
    `*_rows` are the output layers' rows (None: not known yet, that part is left for later)."""
    rows = [r for r in (target_rows, draft_rows) if r is not None]
    if target_tok is not None and draft_tok is not None:
        tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
        if tv != dv:
            raise IncompatibleModelsError(
                f"draft and target tokenizers differ (vocab {len(dv)} vs {len(tv)}); pass a draft from the "
                f"same family or allow_vocab_mismatch=True (--allow-vocab-mismatch)"
            )
        if rows and min(rows) < len(tv):
            raise IncompatibleModelsError(
                f"a model's output layer ({min(rows)} rows) is smaller than its tokenizer ({len(tv)} tokens); the "
                f"checkpoint and tokenizer do not belong together"
            )
    elif len(rows) == 2 and target_rows != draft_rows:
        raise IncompatibleModelsError(
            f"draft and target vocabularies differ ({draft_rows} vs {target_rows}) and there is no "
            f"tokenizer to show they agree; pass a draft from the same family or allow_vocab_mismatch=True"
        )
