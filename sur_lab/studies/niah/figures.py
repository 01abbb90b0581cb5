"""Notebook 02's figures: budget-quality curves (Figure 3, :func:`plot_budget_curves`, one panel per model
:func:`plot_model_panels`), the paired differences' forest plot (:func:`plot_paired_differences`), the interval
counts (:func:`plot_intervals`) and Tables 2-6 as heatmaps (:func:`plot_budget_heatmap`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

from sur_lab.analysis.decisions import SEPARATED
from sur_lab.repair import REFERENCE_METHODS as REFERENCES
from sur_lab.studies.niah.design import PAPER_ALLOCATORS

__all__ = ["REFERENCE_STYLES", "PERCENT_FIELDS", "plot_budget_curves", "plot_paired_differences", "plot_intervals",
    "plot_model_panels", "plot_budget_heatmap"]

#: Line styles of the reference operators in budget curves.
REFERENCE_STYLES = {
    "Dirty": ("tab:red", "--"), "Shift": ("0.45", ":"), "Replay": ("tab:blue", "-."), "Re-prefill": ("tab:green", "--"),
}
#: Record fields shown as percentages of cases.
PERCENT_FIELDS = ("em", "agree_reprefill")


def plot_budget_curves(
    records: pd.DataFrame,
    metrics: Sequence[str],
    titles: Sequence[str] | None = None,
    *,
    agg: str | Mapping[str, str] = "mean",
):
    """Budget–quality curves (Figure 3 style): one panel per metric, one line per allocator aggregated over cases
    (SUR drawn thick and black), references as horizontal lines, log-scaled budget axis.

    Boolean endpoints (:data:`PERCENT_FIELDS`) are shown in percent. ``agg`` is a pandas aggregation name for every
    metric or per metric (e.g. ``{"nr_tv": "median"}``: Eq. 14 ratios are unbounded below, and the paper reports
    medians of the defined ones); missing metrics default to the mean.

    Returns:
        The matplotlib figure.

    Raises:
        ValueError: naming ``metrics`` when a metric is not a record field.
    """
    missing = [m for m in metrics if m not in records.columns]
    if missing:
        raise ValueError(f"metrics {missing} are not record fields")
    titles = list(titles or metrics)
    alloc = records[records["budget_pct"].notna()]
    refs = records[records["budget_pct"].isna()]
    order, palette = _allocator_palette(alloc)
    budgets = sorted(alloc["budget_pct"].unique())
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.6 * len(metrics) + 2.4, 4.0), squeeze=False)
    for ax, metric, title in zip(axes[0], metrics, titles):
        how = agg if isinstance(agg, str) else agg.get(metric, "mean")
        _budget_panel(ax, alloc, refs, metric, order, palette, budgets, how=how)
        ax.set_title(title)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def plot_paired_differences(table: pd.DataFrame, *, metric_label: str = "strict EM"):
    """Forest plot of :func:`~sur_lab.studies.niah.report.paired_differences`: one panel per baseline, one row per
    (method, budget), the observed difference (in the table's ``unit``) with its 95 % interval; filled markers are the
    differences the family decides ("beats" or "loses to" after Holm over the family).

    Args:
        table: the output of :func:`~sur_lab.studies.niah.report.paired_differences` (non-empty).
        metric_label: the compared endpoint's name for the axis label.

    Returns:
        The matplotlib ``Figure``.

    Raises:
        ValueError: if ``table`` is empty.
    """
    if table.empty:
        raise ValueError("table is empty: no (method, budget, baseline) pair to plot")
    baselines = list(dict.fromkeys(table["baseline"]))
    labels = list(dict.fromkeys(f"{m} {b:g}%" for m, b in zip(table["method"], table["budget_pct"])))
    fig, axes = plt.subplots(1, len(baselines), figsize=(5.2 * len(baselines), 0.32 * len(labels) + 1.4),
                             sharey=True, squeeze=False)
    for ax, base in zip(axes[0], baselines):
        sub = table[table["baseline"] == base]
        y = [labels.index(f"{m} {b:g}%") for m, b in zip(sub["method"], sub["budget_pct"])]
        err = [sub["delta"] - sub["delta_low"], sub["delta_high"] - sub["delta"]]
        ax.errorbar(sub["delta"], y, xerr=err, fmt="none", ecolor="0.4", capsize=3)
        sep = sub["verdict"].isin(SEPARATED).to_numpy(bool)
        ax.scatter(sub["delta"][sep], [v for v, k in zip(y, sep) if k], color="tab:blue", zorder=3,
                   label="separated (Holm over the family)")
        ax.scatter(sub["delta"][~sep], [v for v, k in zip(y, sep) if not k], facecolor="white",
                   edgecolor="tab:blue", zorder=3, label="not separated or not decided")
        ax.axvline(0, color="0.2", lw=0.8)
        ax.set_title(f"minus {base}")
        unit = str(sub["unit"].iloc[0]) if "unit" in sub.columns and len(sub) else "pp"
        ax.set_xlabel(f"{metric_label} difference ({unit + ', ' if unit else ''}95 % CI)")
        ax.set_yticks(range(len(labels)), labels)
    axes[0][0].invert_yaxis()
    axes[0][-1].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def plot_intervals(records: pd.DataFrame):
    """Distribution of interval counts R per allocator and budget (box plots, log scale); returns the figure."""
    alloc = records[records["budget_pct"].notna()].copy()
    alloc["budget"] = [f"{b:g}%" for b in alloc["budget_pct"]]
    present = list(dict.fromkeys(alloc["method"]))
    order = [m for m in PAPER_ALLOCATORS if m in present] + [m for m in present if m not in PAPER_ALLOCATORS]
    hue_order = [f"{b:g}%" for b in sorted(alloc["budget_pct"].unique())]
    fig, ax = plt.subplots(figsize=(11, 4.6))
    sns.boxplot(data=alloc, x="method", y="num_intervals", hue="budget", order=order, hue_order=hue_order, ax=ax,
                fliersize=2, linewidth=0.8, palette="crest")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("intervals R")
    ax.set_xlabel("")
    ax.tick_params(axis="x", rotation=60, labelsize=8)
    ax.legend(title="budget", fontsize=8, ncol=len(hue_order))
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------------------------
# Across models: Figure 3 one panel per model (issue 28)


def plot_model_panels(records: pd.DataFrame, metric: str = "em", *, title: str | None = None):
    """Figure 3 across models: one panel per model (order of appearance), one line per allocator over the budgets
    (SUR thick and black), the reference operators as horizontal lines, shared allocator colours.

    Returns:
        The matplotlib figure.

    Raises:
        ValueError: naming ``metric`` when it is not a record field.
    """
    if metric not in records.columns:
        raise ValueError(f"metric={metric!r} is not a record field")
    models = list(dict.fromkeys(records["model"]))
    alloc_all = records[records["budget_pct"].notna()]
    order, palette = _allocator_palette(alloc_all)
    budgets = sorted(alloc_all["budget_pct"].unique())
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models) + 2.4, 4.0), squeeze=False, sharey=True)
    for ax, model in zip(axes[0], models):
        sub = records[records["model"] == model]
        alloc, refs = sub[sub["budget_pct"].notna()], sub[sub["budget_pct"].isna()]
        _budget_panel(ax, alloc, refs, metric, order, palette, budgets, how="mean")
        ax.set_title(f"{model} (n = {sub['case_id'].nunique()})")
    axes[0][0].set_ylabel(title or metric)
    handles, labels = [], []
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def _budget_panel(ax, alloc: pd.DataFrame, refs: pd.DataFrame, metric: str, order: Sequence[str],
                  palette: Mapping[str, Any], budgets: Sequence[float], *, how: str = "mean") -> None:
    """One Figure-3 panel: ``metric`` (×100 for a 0/1 field) aggregated by ``how`` per allocator and budget, a line
    per allocator of ``order`` present in ``alloc`` (SUR thick), each reference of ``refs`` a horizontal line; the
    budget axis logarithmic when there are several budgets."""
    scale = 100.0 if metric in PERCENT_FIELDS else 1.0
    curve = alloc.assign(_v=alloc[metric].astype(float) * scale).groupby(["method", "budget_pct"])["_v"].agg(how)
    for method in [m for m in order if m in curve.index.get_level_values(0)]:
        c = curve.loc[method]
        ax.plot(c.index, c.values, marker="o", ms=4, color=palette[method], label=method,
                lw=2.8 if method == "SUR" else 1.2, zorder=3 if method == "SUR" else 2)
    ref_means = refs.assign(_v=refs[metric].astype(float) * scale).groupby("method")["_v"].agg(how)
    for method in [m for m in REFERENCES if m in ref_means.index]:
        color, style = REFERENCE_STYLES[method]
        ax.axhline(ref_means[method], color=color, ls=style, lw=1.3, label=f"{method} (reference)")
    if len(budgets) > 1:
        ax.set_xscale("log")
    ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
    ax.xaxis.set_minor_formatter(NullFormatter())
    if scale == 100.0:
        ax.set_ylim(-4, 104)
    ax.set_xlabel("suffix budget b (%)")


def _allocator_palette(alloc: pd.DataFrame) -> tuple[list[str], dict[str, Any]]:
    """The allocators of ``alloc`` in Table 2-6 order (others after, in order of appearance) and one colour each
    (SUR black, the others from seaborn's ``tab20``), shared by every Figure-3 panel."""
    present = list(dict.fromkeys(alloc["method"]))
    order = [m for m in PAPER_ALLOCATORS if m in present] + [m for m in present if m not in PAPER_ALLOCATORS]
    others = [m for m in order if m != "SUR"]
    return order, dict(zip(others, sns.color_palette("tab20", max(1, len(others)))), SUR="black")


# ---------------------------------------------------------------------------------------------------------------------
# Notebook 02's figures (issue 39)


def plot_budget_heatmap(agree: pd.DataFrame, em: pd.DataFrame):
    """Tables 2–6 as two heatmaps side by side: agreement with Re-prefill and strict EM (%) of every method at every
    budget (:func:`~sur_lab.studies.niah.report.budget_table` of each; references in their ``"Reference"`` column).
    Returns the figure."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.42 * len(agree) + 1.5), sharey=True)
    for ax, table, title in zip(axes, [agree, em], ["agreement with Re-prefill (%)", "strict EM (%)"]):
        sns.heatmap(table, annot=True, fmt=".0f", cmap="viridis", vmin=0, vmax=100, cbar=False, ax=ax,
                    annot_kws={"fontsize": 8})
        ax.set_title(title)
        ax.set_xlabel("budget")
        ax.set_ylabel("")
        ax.grid(False)
    fig.tight_layout()
    return fig
