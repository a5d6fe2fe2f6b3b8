"""Heatmap PNGs in the style of the DSI paper's Fig. 1: speedup over drafter latency x acceptance rate.

Slowdowns (speedup < 1) are pink, as in the paper; speedups get viridis bands of `step`, the last band open
ended ("> vmax"). Configurations that were not simulated (too many target servers needed) stay white.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# (file stem, title, band width, top of the colour scale): the paper's choices for its four panels
PANELS = {
    "si_vs_nonsi": ("SI speedup over non-SI", 1.0, 10.0),
    "dsi_vs_si": ("DSI speedup over SI", 0.2, 2.0),
    "dsi_vs_nonsi": ("DSI speedup over non-SI", 0.2, 3.0),
    "dsi_vs_baseline": ("DSI speedup over min(SI, non-SI)", 0.1, 1.6),
}
PINK = (248 / 256, 24 / 256, 148 / 256, 1.0)


def save_heatmap(
    speedup: np.ndarray, c: np.ndarray, a: np.ndarray, path: str | Path, title: str, step: float, vmax: float
) -> Path:
    """speedup: [len(c), len(a)]. Returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import BoundaryNorm, ListedColormap

    finite = speedup[np.isfinite(speedup)]
    top = min(float(finite.max()), vmax) if finite.size else vmax
    bounds = [0.0] + [round(b, 6) for b in np.arange(1.0, top + step / 2, step)]
    if len(bounds) < 3:
        bounds.append(bounds[-1] + step)
    bands = len(bounds) - 2
    colors = [PINK] + list(matplotlib.colormaps["viridis"](np.linspace(0, 1, max(bands, 1))))
    cmap = ListedColormap(colors[: len(bounds) - 1]).with_extremes(over=colors[-1])
    norm = BoundaryNorm(bounds, cmap.N)

    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    mesh = ax.pcolormesh(c, a, np.ma.masked_invalid(speedup.T), cmap=cmap, norm=norm, shading="nearest")
    bar = fig.colorbar(mesh, ax=ax, extend="max" if finite.size and finite.max() > bounds[-1] else "neither")
    bar.set_ticks(bounds)
    bar.set_ticklabels([f"{b:g}" for b in bounds])
    ax.set_xlabel("drafter latency c (fraction of a target forward)")
    ax.set_ylabel("acceptance rate a")
    best = float(finite.max()) if finite.size else float("nan")
    slow = float((finite < 1).mean()) if finite.size else 0.0
    ax.set_title(f"{title}\nmax {best:.2f}x; pink (< 1x): {slow:.0%} of the grid", fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
