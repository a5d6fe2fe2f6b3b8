"""The two pictures of a benchmark, drawn from traces (so real and simulated runs draw alike):

- token progress: tokens committed over time for one prompt, one line per variant (AMUSD Fig. 4);
- device timeline: a Gantt chart per (variant, device) of what each device did — prefill, draft, verify,
  decode, rollback — with the gaps between recorded work drawn as idle.
"""

from __future__ import annotations

from pathlib import Path

from paraspec.bench.metrics import Record

KIND_COLORS = {
    "prefill": "#6a3d9a",
    "decode": "#1f78b4",
    "draft": "#33a02c",
    "verify": "#e31a1c",
    "rollback": "#ff7f00",
    "idle": "#d9d9d9",
    "wait": "#bdbdbd",
}
OTHER_COLOR = "#b15928"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def idle_gaps(events, total_s: float, min_gap_s: float = 0.0) -> list[tuple[float, float]]:
    """(start, end) of the stretches in [0, total_s] that no event of this device covers."""
    gaps, cursor = [], 0.0
    for e in sorted(events, key=lambda e: e.start_s):
        if e.start_s - cursor > min_gap_s:
            gaps.append((cursor, e.start_s))
        cursor = max(cursor, e.end_s)
    if total_s - cursor > min_gap_s:
        gaps.append((cursor, total_s))
    return gaps


def plot_progress(records: list[Record], path: Path, title: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in records:
        points = [(0.0, 0)] + [(t, n) for t, n in r.trace.progress]
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        ax.step(xs, ys, where="post", label=f"{r.variant.name} ({r.stats.ms_per_token:.0f} ms/token)")
    ax.set_xlabel("seconds since the request started")
    ax.set_ylabel("tokens committed")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_timeline(records: list[Record], path: Path, title: str) -> Path:
    plt = _pyplot()
    fig = timeline_figure(records, title)
    # bbox_inches="tight": the legend sits outside the axes, right of them
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def timeline_figure(records: list[Record], title: str):
    """The device timeline as a figure: one lane per (variant, device); the legend right of the axes, clear of the
    x-axis label and of the lanes."""
    plt = _pyplot()
    lanes = []  # (label, events, total_s)
    for r in records:
        devices = list(dict.fromkeys(e.device for e in r.trace.events)) or ["(no events)"]
        for device in devices:
            events = [e for e in r.trace.events if e.device == device]
            lanes.append((f"{r.variant.name} · {device}", events, r.stats.total_s))
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(lanes) + 1.6))
    seen = set()
    for y, (_, events, total) in enumerate(reversed(lanes)):
        for start, end in idle_gaps([e for e in events if e.kind not in ("idle", "wait")], total):
            ax.barh(
                y,
                end - start,
                left=start,
                color=KIND_COLORS["idle"],
                height=0.6,
                label=None if "idle" in seen else "idle",
            )
            seen.add("idle")
        for e in events:
            color = KIND_COLORS.get(e.kind, OTHER_COLOR)
            ax.barh(
                y,
                max(e.duration_s, 1e-6),
                left=e.start_s,
                color=color,
                height=0.6,
                label=None if e.kind in seen else e.kind,
            )
            seen.add(e.kind)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([label for label, _, _ in reversed(lanes)], fontsize=8)
    ax.set_xlabel("seconds since the request started")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig
