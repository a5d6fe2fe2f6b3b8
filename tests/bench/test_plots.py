"""The two plots: drawn from traces, and readable (the timeline's legend clear of the axis label and lanes)."""

import pytest

from paraspec.bench.metrics import Variant
from paraspec.bench.plots import timeline_figure
from paraspec.trace import Trace
from tests.bench.conftest import record, stats


def traced(variant, lanes):
    trace = Trace()
    for device in range(lanes):
        trace.add(f"dev{device}", "prefill", 0.0, 0.4)
        trace.add(f"dev{device}", "draft", 0.4, 0.5)
        trace.add(f"dev{device}", "verify", 0.6, 0.9)
        trace.add(f"dev{device}", "wait", 0.9, 1.0)
    return record(variant, 0, [1], stats(10, 1.0), trace=trace)


@pytest.mark.parametrize("lanes", [1, 3, 8])
def test_timeline_legend_is_clear_of_the_axis_label_and_the_lanes(lanes):
    import matplotlib.pyplot as plt

    fig = timeline_figure([traced(Variant("sd", 2), lanes), traced(Variant("ar", 2), 1)], "Device timeline")
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        legend = ax.get_legend().get_window_extent(renderer)
        assert not legend.overlaps(ax.xaxis.label.get_window_extent(renderer))
        assert not legend.overlaps(ax.get_window_extent(renderer))
        assert not legend.overlaps(ax.title.get_window_extent(renderer))
        assert {t.get_text() for t in ax.get_legend().get_texts()} == {"prefill", "draft", "verify", "idle", "wait"}
    finally:
        plt.close(fig)
