"""Notebook 10's figures: cost and agreement per turn (:func:`plot_cost_agreement`), per region of the first change
(:func:`plot_regions`) and per question kind (:func:`plot_kinds`).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from sur_lab.studies.agent_traces.cases import QUESTION_KINDS
from sur_lab.studies.agent_traces.design import REGIONS

__all__ = ["plot_cost_agreement", "plot_regions", "plot_kinds"]


def _styles(paths: Sequence[str]) -> dict:
    return {p: {"color": f"C{i}", "marker": "os^vDP*X"[i % 8]} for i, p in enumerate(paths)}


def plot_cost_agreement(table: pd.DataFrame):
    """Per turn: cumulative tokens recomputed (left, log), cumulative TTFT (middle, log) and agreement with
    re-prefill (right), one line per path (``table``: :func:`per_turn_table`)."""
    paths = list(dict.fromkeys(table["path"]))
    style = _styles(paths)
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), sharex=True)
    panels = ((axes[0], "cum_recomputed", "cumulative tokens recomputed", True),
              (axes[1], "cum_ttft_ms", "cumulative time to first token (ms)", True),
              (axes[2], "agree_pct", "agreement with re-prefill (%)", False))
    for ax, col, label, log in panels:
        for path in paths:
            t = table[table["path"] == path]
            ax.plot(t["turn"], t[col], label=path, lw=1.4, ms=5, **style[path])
        ax.set_xlabel("turn (0: first prefill)")
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        else:
            ax.set_ylim(-3, 103)
    axes[2].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def _plot_groups(table: pd.DataFrame, by: str, names: Sequence[str], xlabel: str, panels: Sequence[tuple[str, str]]):
    paths = list(dict.fromkeys(table["path"]))
    names = [g for g in names if g in set(table[by])]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.8))
    width = 0.8 / max(1, len(paths))
    for i, path in enumerate(paths):
        t = table[table["path"] == path].set_index(by).reindex(names)
        x = np.arange(len(names)) + i * width
        for ax, (col, _) in zip(axes, panels):
            ax.bar(x, t[col], width, label=path, color=f"C{i}")
    for ax, (col, label) in zip(axes, panels):
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        if col.endswith("_pct"):
            ax.set_ylim(0, 105)
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def plot_regions(regions: pd.DataFrame):
    """Median TTFT (left) and agreement with re-prefill (right) per region of the first change, one bar per path
    (``regions``: :func:`region_table`)."""
    return _plot_groups(regions, "region", (*REGIONS, "all"), "first change of the turn",
                        (("ttft_ms", "median time to first token (ms)"),
                         ("agree_pct", "agreement with re-prefill (%)")))


def plot_kinds(kinds: pd.DataFrame):
    """Agreement with re-prefill (left) and EM (right) per question kind, one bar per path (``kinds``:
    :func:`kind_table`)."""
    return _plot_groups(kinds, "kind", (*QUESTION_KINDS, "reaching", "all"), "question kind",
                        (("agree_pct", "agreement with re-prefill (%)"), ("em_pct", "exact match (%)")))
