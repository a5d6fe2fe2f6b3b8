"""EasySpec studies (Wu et al. 2025): how far the layer-parallel draft (the paper's "fuzzy" one) is from the exact
one, and what each knob buys.

similarity   (Table 5) cosine similarity between the layer-parallel and the exact forward of the draft,
             per layer-parallel size:
             layer outputs (hidden states), attention outputs, and the q/k/v that the attention reads.
             Each measured token is run on top of an exact cache of its prefix -- the situation bonus
             calibration creates -- once exactly and once layer-parallel; values average over tokens and layers.
ablation     (Fig. 4) tree width x layer-parallel size x calibration on/off: acceptance rate and ms/token of the
             easyspec strategy on real prompts, drawn as two line plots.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from paraspec.models.native.layer_parallel import layer_parallel_forward, layer_parallel_groups

QUANTITIES = ("hidden", "attn", "q", "k", "v")
_RECORD_KEY = {"hidden": "h_out", "attn": "attn", "q": "q", "k": "k", "v": "v"}


@torch.inference_mode()
def similarity(
    draft, prompts: list[list[int]], layer_parallel_sizes=(2, 3, 4), tokens_per_prompt: int = 16
) -> list[dict]:
    """Rows {layer_parallel_size, quantity: mean cosine similarity}. `draft` is a NativeModel; prompts are token ids."""
    n_layers = draft.cfg.num_layers
    exact_groups = layer_parallel_groups(1, n_layers)
    sums = {size: {k: 0.0 for k in QUANTITIES} for size in layer_parallel_sizes}
    counts = {size: 0 for size in layer_parallel_sizes}
    for ids in prompts:
        measured = min(tokens_per_prompt, len(ids) - 1)
        draft.prefill(ids[: len(ids) - measured])
        for token in ids[len(ids) - measured :]:
            length = draft.length
            exact: dict[int, dict[str, torch.Tensor]] = {}  # layer -> its recorded activations
            layer_parallel_forward(draft, [token], exact_groups, record=exact, head=False)
            for size in layer_parallel_sizes:
                draft.rollback(length)
                parallel: dict[int, dict[str, torch.Tensor]] = {}
                layer_parallel_forward(
                    draft, [token], layer_parallel_groups(size, n_layers), record=parallel, head=False
                )
                for quantity in QUANTITIES:
                    key = _RECORD_KEY[quantity]
                    sims = [
                        torch.nn.functional.cosine_similarity(parallel[i][key].float(), exact[i][key].float(), dim=-1)
                        .mean()
                        .item()
                        for i in range(n_layers)
                    ]
                    sums[size][quantity] += sum(sims) / n_layers
                counts[size] += 1
            draft.rollback(length)  # advance exactly, as calibration would
            layer_parallel_forward(draft, [token], exact_groups, head=False)
    return [
        {"layer_parallel_size": size, **{q: sums[size][q] / max(counts[size], 1) for q in QUANTITIES}}
        for size in layer_parallel_sizes
    ]


def similarity_table(rows: list[dict]) -> str:
    lines = ["| layer-parallel size | hidden states | attention output | q | k | v |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer_parallel_size']} | " + " | ".join(f"{r[q]:.4f}" for q in QUANTITIES) + " |")
    return "\n".join(lines)


def ablation(
    engine_factory,
    prompts,
    params,
    widths=(1, 4, 8, 12),
    layer_parallel_sizes=(1, 2, 3, 4, 5),
    calibrations=(True, False),
    tree_depth: int = 5,
    progress=None,
) -> list[dict]:
    """Run easyspec for every (width, layer-parallel size, calibration); engine_factory(**options) returns an Engine.

    One engine is reused (Engine.set_options between configurations, checked like the Engine's arguments) so
    models load once."""
    rows = []
    engine = engine_factory()
    try:
        engine.generate(prompts[0], type(params)(max_new_tokens=4))  # warm-up
        for size in layer_parallel_sizes:  # the size outermost: a multi-device drafter restarts per layout
            for calibration in calibrations:
                for width in widths:
                    engine.set_options(
                        tree_width=width,
                        layer_parallel_size=size,
                        calibration=calibration,
                        tree_depth=tree_depth,
                        tree_budget=width * tree_depth,
                    )
                    accepted = drafted = tokens = 0
                    start = time.perf_counter()
                    for prompt in prompts:
                        stats = engine.generate(prompt, params).stats
                        accepted, drafted, tokens = (
                            accepted + stats.accepted,
                            drafted + stats.drafted,
                            tokens + stats.new_tokens,
                        )
                    elapsed = time.perf_counter() - start
                    row = dict(
                        tree_width=width,
                        layer_parallel_size=size,
                        calibration=calibration,
                        acceptance_rate=accepted / max(drafted, 1),
                        ms_per_token=elapsed * 1000 / tokens,
                        tokens=tokens,
                    )
                    rows.append(row)
                    if progress:
                        progress(row)
    finally:
        engine.close()
    return rows


def plot_ablation(rows: list[dict], out_dir: Path) -> list[Path]:
    """Two line plots (the paper's Fig. 4): acceptance rate and ms/token against layer-parallel size, one line per
    (tree width, calibration)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric, label in (("acceptance_rate", "acceptance rate"), ("ms_per_token", "ms / token")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        widths = sorted({r["tree_width"] for r in rows})
        for width, calibration in sorted({(r["tree_width"], r["calibration"]) for r in rows}):
            line = sorted(
                (r for r in rows if r["tree_width"] == width and r["calibration"] == calibration),
                key=lambda r: r["layer_parallel_size"],
            )
            ax.plot(
                [r["layer_parallel_size"] for r in line],
                [r[metric] for r in line],
                marker="o" if calibration else "x",
                color=f"C{widths.index(width)}",
                linestyle="-" if calibration else "--",
                label=f"width {width}, calibration {'on' if calibration else 'off'}",
            )
        ax.set_xticks(sorted({r["layer_parallel_size"] for r in rows}))
        ax.set_xlabel("layer-parallel size (layers per parallel group)")
        ax.set_ylabel(label)
        ax.set_title(f"EasySpec ablation: {label}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"easyspec_ablation_{metric}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
