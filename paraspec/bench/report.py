"""Benchmark outputs: the markdown table (printed and written), results.json, and the two plots per dataset."""

from __future__ import annotations

import json
import platform
import re
from pathlib import Path

from paraspec.bench.metrics import summarize
from paraspec.bench.plots import plot_progress, plot_timeline
from paraspec.bench.runner import BenchResult
from paraspec.strategies import OPTIONS

NONE = "—"


def _num(value, fmt: str) -> str:
    return NONE if value is None else format(value, fmt)


def _identical(row: dict) -> str:
    if row["variant"] == row["reference"]:
        return "ref"
    if row["identical"] is None:
        return NONE
    return f"{row['identical']}/{row['compared']}"


def markdown_table(result: BenchResult, rows: list[dict]) -> str:
    cfg = result.config
    params = cfg.params
    mode = "greedy" if params.greedy else f"sampling T={params.temperature:g}"
    dtypes = {
        kind: sorted({c["dtype"] for c in result.contenders.values() if _runs_on(c["strategy"]) == kind})
        for kind in ("paraspec", "transformers", "llama.cpp")
    }
    dtype_text = ", ".join(f"{kind} {'/'.join(d)}" for kind, d in dtypes.items() if d)
    extra = [k for k in (rows[0] if rows else {}) if k.startswith("speedup_vs_ar@")]
    table = [_cells(result, row, extra) for row in rows]
    # a column no variant fills (× vs hf-assisted without hf-assisted, acceptance without a speculative variant,
    # `= ar` when sampling) is left out
    header = [
        column for column in (table[0] if table else {}) if any(cells[column] not in (NONE, "ref") for cells in table)
    ]
    lines = [
        f"### {result.dataset}: {len(result.prompts)} prompts × {params.max_new_tokens} new tokens, {mode}, "
        f"dtype {cfg.engine.dtype} ({dtype_text})",
        "",
        f"target `{cfg.engine.target}`"
        + (f", draft `{cfg.engine.draft}`" if cfg.engine.draft else "")
        + f", chat template {'on' if result.chat else 'off'}"
        + _options_text(result),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    lines += ["| " + " | ".join(cells[column] for column in header) + " |" for cells in table]
    lines += [
        "",
        "Times are medians over prompts (tokens/s = 1000 / ms/token); speedups are medians of per-prompt "
        "ratios of ms/token against the variant on the same number of cores (threads; a worker strategy: the "
        "cores of its devices); acceptance and mean accepted length are pooled over prompts."
        + (
            " `= ar`: prompts whose tokens equal those of that ar (ar variants: equal to the first ar variant)."
            if "= ar" in header
            else ""
        ),
    ]
    divergences = [(row["variant"], row["reference"], d) for row in rows for d in row["divergences"]]
    if divergences:
        lines += ["", "First divergences (top-1 minus top-2 target logit there; a small gap is a near-tie):"]
        for variant, reference, d in divergences:
            lines.append(
                f"- {variant} on {d['prompt_id']} at output token {d['index']}: {reference} "
                f"{_tok(d['reference_token'])} vs {_tok(d['token'])}, gap {_num(d['reference_margin'], '.4f')}"
                f" ({reference}) / {_num(d['margin'], '.4f')} ({variant})"
            )
    programs = sorted(
        {info["settings"]["program"] for info in result.contenders.values() if "program" in info.get("settings", {})}
    )
    if programs:
        lines += ["", f"The llama.cpp peers ran {', '.join(programs)}."]
    lines += _spec_grid_lines(result)
    return "\n".join(lines) + "\n"


def _cells(result: BenchResult, row: dict, extra: list[str]) -> dict[str, str]:
    """One table row, column name -> cell."""
    info = result.contenders[row["variant"]]
    # llama-server reports no split of its generation time into drafting and verifying
    split = row["mean_accepted_length"] is not None and _runs_on(row["strategy"]) != "llama.cpp"
    cells = {
        "strategy": row["variant"],
        "devices": info["devices"],
        "threads": str(info["threads"]),
        "ms/token": _num(row["ms_per_token"], ".1f"),
        "tokens/s": _num(row["tokens_per_s"], ".2f"),
        "× vs ar": _speedup(result, row, "ar"),
        "× vs hf-assisted": _speedup(result, row, "hf-assisted"),
    }
    cells.update(
        {
            f"× vs {k.removeprefix('speedup_vs_')}": _num(row.get(k), ".2f") + ("×" if row.get(k) is not None else "")
            for k in extra
        }
    )
    cells.update(
        {
            "TTFT ms": _num(row["ttft_ms"], ".0f"),
            "TPOT ms": _num(row["tpot_ms"], ".1f"),
            "acceptance": NONE if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.1%}",
            "mean acc. len": _num(row["mean_accepted_length"], ".2f"),
            "draft s/100 tok": _num(row["draft_s_per_100_tokens"], ".2f") if split else NONE,
            "verify s/100 tok": _num(row["verify_s_per_100_tokens"], ".2f") if split else NONE,
            "= ar": _identical(row),
        }
    )
    return cells


def _runs_on(strategy: str) -> str:
    return (
        "transformers"
        if strategy.startswith("hf-")
        else "llama.cpp"
        if strategy.startswith("llamacpp-")
        else "paraspec"
    )


def _spec_grid_lines(result: BenchResult) -> list[str]:
    """The llama.cpp peers' settings as tuned (llamacpp_peers.LlamaCppPeer.tune: llamacpp-spec's draft max and
    p-min, llamacpp-ngram's n-gram type, n and m), the kept one in bold."""
    from paraspec.bench.llamacpp_peers import SETTING_FIELDS, setting_label

    lines = []
    for name, info in result.contenders.items():
        grid, settings = info["settings"].get("spec_grid"), info["settings"]
        if not grid:
            continue
        tuned, fields = settings["tuned_on"], [k for k in SETTING_FIELDS if k in grid[0]]
        kind = "n-gram" if "spec_type" in fields else "draft"
        lines += [
            "",
            f"{name}: llama.cpp's {kind} settings, timed on {tuned['prompts']} prompt(s) × "
            f"{tuned['max_new_tokens']} new tokens before the run; kept "
            f"{setting_label({k: settings[k] for k in fields})}:",
            "",
            "| " + " | ".join(SETTING_FIELDS[k] for k in fields) + " | ms/token | acceptance |",
            "|" + "---|" * (len(fields) + 2),
        ]
        for row in grid:
            kept = all(row[k] == settings[k] for k in fields)
            cells = [f"{row[k]:g}" if isinstance(row[k], float) else str(row[k]) for k in fields]
            cells += [f"{row['ms_per_token']:.1f}", NONE if row["acceptance"] is None else f"{row['acceptance']:.1%}"]
            lines.append("| " + " | ".join(f"**{c}**" if kept else c for c in cells) + " |")
    return lines


def _speedup(result: BenchResult, row: dict, baseline: str) -> str:
    """`1.23×`; the reference is named when its hardware budget differs from this variant's (no variant of
    the baseline ran on the same number of cores)."""
    value = row["speedup_vs_" + baseline.replace("-", "_")]
    if value is None:
        return NONE
    reference = row["speedup_references"][baseline]
    cores = {name: info["cores"] for name, info in result.contenders.items()}
    return f"{value:.2f}×" + (f" (vs {reference})" if cores[reference] != cores[row["variant"]] else "")


def _options_text(result: BenchResult) -> str:
    """`; sd: lookahead=5; amusd: max_ahead=16, verify_chunk=8` (the options each strategy ran with)."""
    parts = {}
    for info in result.contenders.values():
        options = {k: v for k, v in info["settings"].items() if k in OPTIONS}
        if options:
            parts[info["strategy"]] = ", ".join(
                f"{k}={OPTIONS[k].none if v is None else v}" for k, v in options.items()
            )
    return "".join(f"; {name}: {text}" for name, text in parts.items())


def _tok(token) -> str:
    return "(ended)" if token is None else str(token)


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(name).stem if name.endswith(".jsonl") else name).strip("-")


def write_report(results: dict[str, BenchResult], out_dir: str | Path, plot_prompt: int = 0) -> str:
    """Write report.md, results.json and the PNGs to out_dir; return the markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    markdown, payload = [], {"meta": _meta(next(iter(results.values()))), "datasets": {}}
    for name, result in results.items():
        cores = {v: result.contenders[v.name]["cores"] for v in result.config.variants}
        rows = summarize(result.records, result.config.variants, result.config.params.greedy, cores)
        markdown.append(markdown_table(result, rows))
        index = min(plot_prompt, len(result.prompts) - 1)
        shown = [r for r in result.records if r.prompt_index == index]
        shown.sort(key=lambda r: result.config.variants.index(r.variant))
        what = f"{name}, prompt {result.prompts[index].id}"
        plots = {
            "progress": str(plot_progress(shown, out / f"{slug(name)}-progress.png", f"Tokens over time — {what}")),
            "timeline": str(plot_timeline(shown, out / f"{slug(name)}-timeline.png", f"Device timeline — {what}")),
        }
        payload["datasets"][name] = {
            "chat": result.chat,
            "variants": result.contenders,
            "summary": rows,
            "plots": plots,
            "prompts": [{"id": p.id, "prompt_tokens": len(ids)} for p, ids in zip(result.prompts, result.prompt_ids)],
            "records": [r.to_dict() for r in result.records],
        }
    text = "\n".join(markdown)
    (out / "report.md").write_text(text)
    (out / "results.json").write_text(json.dumps(payload, indent=1))
    return text


def _meta(result: BenchResult) -> dict:
    import torch
    import transformers

    cfg = result.config
    return {
        "target": cfg.engine.target,
        "draft": cfg.engine.draft,
        "dtype": cfg.engine.dtype,
        "options": cfg.options,
        "target_devices": list(map(str, cfg.engine.target_devices)),
        "draft_devices": list(map(str, cfg.engine.draft_devices)),
        "backend": cfg.engine.backend,
        "max_context": cfg.engine.max_context,
        "sampling": dict(cfg.params.__dict__),
        "variants": [v.name for v in cfg.variants],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": _cpu_model(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()
