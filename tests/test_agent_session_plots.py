"""Notebook 07's figures (sur_lab.studies.agent_session): what they draw for the values that break a log axis."""

from __future__ import annotations


def test_agent_session_cost_axes_draw_shift_at_zero():
    """Shift forwards nothing: notebook 07's cost axes are symmetric-log, so its zero is drawn at 0, not clipped to a
    made-up small value on a log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from sur_lab.studies.agent_session import plot_cost_quality, plot_cumulative_cost

    table = pd.DataFrame([{"arm": arm, "edit": e, "cum_forwarded_tokens": 0 if arm == "Shift" else 100 * e,
                           "cum_refresh_ms": 0.0 if arm == "Shift" else 12.5 * e}
                          for arm in ("Shift", "SUR 5%") for e in (1, 2)])
    fig = plot_cumulative_cost(table)
    for ax in fig.axes:
        assert ax.get_yscale() == "symlog"
        shift = next(line for line in ax.get_lines() if line.get_label() == "Shift")
        assert list(shift.get_ydata()) == [0, 0]
        assert ax.get_ylim()[0] < 0  # the zero line lies inside the frame
    plt.close(fig)
    fig = plot_cost_quality(pd.DataFrame([{"arm": "Shift", "cost_ratio": 0.0, "agree_pct": 50.0},
                                          {"arm": "SUR 5%", "cost_ratio": 0.05, "agree_pct": 70.0}]))
    ax = fig.axes[0]
    assert ax.get_xscale() == "symlog" and ax.collections[0].get_offsets()[0][0] == 0.0
    plt.close(fig)
