"""SAFE-KV figures (Figures 2-5 analogues): composition, document-only, windows and the suffix from one start; the
position sweep; preservation against time to first logit; the robustness checks. Each reads the tables of
:mod:`~sur_lab.studies.noprefix.reporting`.

Source: SAFE-KV (Zhang, 2026), Figures 2-5.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from sur_lab.studies.noprefix.reporting import _pick
from sur_lab.studies.noprefix.selection import PROTOCOL_LABELS, PROTOCOLS, UNITS

# ---------------------------------------------------------------------------------------------------------------------
# Figures (SAFE-KV Figures 2, 3, 4, 5 analogues)

LOCAL_VS_SUFFIX = ("Prefix composition", "Doc K1 · risk", "w2 K1 · risk", "w3 K1 · risk", "w4 K1 · risk",
                   "Suffix K1 · risk")
#: Marker style per protocol: filled for actual forwarding, open for the donor-copy diagnostic.
_PROTOCOL_STYLE = {"forward": ("o", True), "donor": ("s", False)}


def _short(label: str) -> str:
    return label.replace("Prefix composition", "Composition").replace(" · risk", "").replace(" · ", "\n")


def plot_local_vs_suffix(summary: pd.DataFrame, *, labels: Sequence[str] = LOCAL_VS_SUFFIX, title: str = ""):
    """Figure 2 analogue: preservation (95 % CI) of composition, document-only, windows and the suffix from one start.

    Args:
        summary: :func:`~sur_lab.studies.noprefix.reporting.summarize` rows with ``workload`` (one panel each),
            ``label`` and ``protocol`` columns.
        labels: the labels to draw, left to right (local units first, then the suffix).
        title: figure title (a default names the selector and the interval).

    Returns:
        The matplotlib figure: methods on the x axis with their mean repair ratio under the name; filled circles for
        actual forwarding, open squares for donor-copy (diagnostic upper bound), side by side.
    """
    workloads = list(dict.fromkeys(summary["workload"]))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.0 * len(workloads), 3.8), sharey=True, squeeze=False)
    xs = np.arange(len(labels))
    for ax, wl in zip(axes[0], workloads):
        sub = summary[summary["workload"] == wl]
        for j, proto in enumerate(p for p in PROTOCOLS if p in set(sub["protocol"])):
            marker, fill = _PROTOCOL_STYLE[proto]
            pts = sub[sub["protocol"] == proto].set_index("label").reindex(list(labels))
            ax.errorbar(xs + (j - 0.5) * 0.22, pts["preservation"],
                        yerr=[pts["preservation"] - pts["ci_low"], pts["ci_high"] - pts["preservation"]],
                        fmt=marker, color=f"C{j}", mfc=f"C{j}" if fill else "white", capsize=2, lw=1,
                        label=PROTOCOL_LABELS[proto])
        ratio = sub[sub["protocol"] == "forward"].set_index("label").reindex(list(labels))["repair_ratio"]
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{_short(lab)}\n{r:.0%}" if np.isfinite(r) else _short(lab)
                            for lab, r in zip(labels, ratio)], fontsize=7)
        ax.set_title(wl)
        ax.set_ylim(-0.05, 1.05)
    axes[0][0].set_ylabel("answer preservation vs full prefill")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=8, bbox_to_anchor=(0.5, -0.06))
    fig.suptitle(title or "Local repair vs causal suffix repair from the same start (risk K1); under each method: "
                 "mean repair ratio; error bars: 95 % bootstrap CI", fontsize=10)
    fig.tight_layout()
    return fig


def plot_position_sweep(summary: pd.DataFrame, *, title: str = ""):
    """Figure 3 analogue: preservation against the evidence slot, one line per method, one panel per protocol.

    Args:
        summary: :func:`~sur_lab.studies.noprefix.reporting.summarize` rows with ``slot``, ``label`` and ``protocol``
            columns (and ``ci_low``/``ci_high``).
        title: figure title.

    Returns:
        The matplotlib figure.
    """
    protocols = [p for p in PROTOCOLS if p in set(summary["protocol"])]
    fig, axes = plt.subplots(1, len(protocols), figsize=(4.8 * len(protocols), 3.6), sharey=True, squeeze=False)
    for ax, proto in zip(axes[0], protocols):
        sub = summary[summary["protocol"] == proto]
        groups = list(sub.groupby("label", sort=False))
        for j, (lab, g) in enumerate(groups):
            g = g.sort_values("slot")
            err = [g["preservation"] - g["ci_low"], g["ci_high"] - g["preservation"]]
            # Side-by-side offsets keep coinciding points and intervals readable.
            ax.errorbar(g["slot"] + (j - (len(groups) - 1) / 2) * 0.06, g["preservation"], yerr=err, marker="o",
                        capsize=2, lw=1.2, elinewidth=0.8, label=lab)
        ax.set_title(PROTOCOL_LABELS[proto])
        ax.set_xlabel("slot of the first gold document")
        ax.set_xticks(sorted(sub["slot"].unique()))
        ax.set_ylim(-0.05, 1.05)
    axes[0][0].set_ylabel("answer preservation vs full prefill")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(title or "Evidence position sweep (oracle selector); error bars: 95 % bootstrap CI", fontsize=10)
    fig.tight_layout()
    return fig


_UNIT_NAMES = {"none": "prefix composition", "doc": "document-only", "window": "window w2–w4",
               "suffix": "causal suffix", "adaptive": "adaptive suffix", "linked": "linked intervals", "sur": "SUR", "full": "full prefill"}
_SELECTOR_MARKERS = {"": "o", "risk": "o", "query": "^", "hybrid": "v", "oracle": "D"}


def plot_pareto_ttfl(summary: pd.DataFrame, *,
                     highlight: Sequence[str] = ("Suffix K1 · risk", "Suffix K2 · risk", "Suffix K2 · query"),
                     title: str = ""):
    """Figure 5 analogue: quality–budget operating points (left) and median TTFL against full prefill (right).

    Args:
        summary: :func:`~sur_lab.studies.noprefix.reporting.summarize` rows per workload with ``workload``, ``label``,
            ``unit``, ``selector``, ``protocol``.
        highlight: reuse paths drawn against full prefill in the TTFL panel (actual forwarding).
        title: figure title.

    Returns:
        The matplotlib figure. Left: mean over workloads of each configuration's repair ratio and preservation; colour =
        repair unit, marker = selector (circle risk / none, triangle query, diamond oracle), filled = actual
        forwarding, open = donor-copy (diagnostic upper bound); inverted triangle hybrid. Right: median TTFL per workload, labels = mean ratio.
    """
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [1.15, 1]})
    keys = ["label", "protocol", "unit", "selector"]
    pooled = summary.groupby(keys, sort=False)[["repair_ratio", "preservation"]].mean().reset_index()
    units = [u for u in UNITS if u in set(pooled["unit"])]
    colors = {u: f"C{i}" for i, u in enumerate(units)}
    for _, r in pooled.iterrows():
        marker = _SELECTOR_MARKERS.get(r["selector"], "o")
        fill = r["protocol"] == "forward"
        left.scatter(r["repair_ratio"], r["preservation"], marker=marker, s=46 if fill else 70, zorder=3 if fill else 2,
                     facecolors=colors[r["unit"]] if fill else "none", edgecolors=colors[r["unit"]], linewidths=1.2)
    handles = [plt.Line2D([], [], marker="s", ls="", color=colors[u], label=_UNIT_NAMES[u]) for u in units]
    handles += [plt.Line2D([], [], marker=m, ls="", color="0.4", label=f"selector: {s}")
                for s, m in (("risk", "o"), ("query", "^"), ("hybrid", "v"), ("oracle", "D"))]
    handles += [plt.Line2D([], [], marker="o", ls="", color="0.4", label=PROTOCOL_LABELS["forward"]),
                plt.Line2D([], [], marker="o", ls="", color="0.4", mfc="none", label=PROTOCOL_LABELS["donor"])]
    left.legend(handles=handles, fontsize=6.5, loc="upper left", ncol=2)
    left.set_xlabel("mean repair ratio (fraction of document tokens re-encoded)")
    left.set_ylabel("answer preservation (mean over workloads)")
    left.set_xlim(-0.03, 1.05)
    left.set_ylim(-0.05, 1.35)
    left.set_yticks(np.linspace(0, 1, 6))
    left.set_title("quality–budget operating points", fontsize=10)

    workloads = list(dict.fromkeys(summary["workload"]))
    names = ["Full prefill", *highlight]
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        vals, ratios = [], []
        for wl in workloads:
            r = _pick(summary[summary["workload"] == wl], name)
            vals.append(np.nan if r is None else r["ttfl_ms"])
            ratios.append(np.nan if r is None else r["repair_ratio"])
        xs = np.arange(len(workloads)) + (j - (len(names) - 1) / 2) * width
        right.bar(xs, vals, width, label=name + ("" if name == "Full prefill" else " (actual forwarding)"))
        if name != "Full prefill":
            for x, v, q in zip(xs, vals, ratios):
                if np.isfinite(v):
                    right.annotate(f"{q:.0%}", (x, v), ha="center", va="bottom", fontsize=6.5)
    right.set_xticks(np.arange(len(workloads)))
    right.set_xticklabels(workloads, fontsize=8)
    right.set_ylabel("median time to first logit (ms, CPU)")
    right.set_title("TTFL vs full prefill (labels: mean repair ratio)", fontsize=10)
    right.legend(fontsize=7)
    fig.suptitle(title or "Quality–budget Pareto and time to first logit", fontsize=11)
    fig.tight_layout()
    return fig

def plot_robustness(table: pd.DataFrame, *, title: str = ""):
    """Figure 4 analogue: preservation (95 % CI) of each path over all requests and over the EM-correct stratum, one
    panel per model (the study model and the robustness model).

    Args:
        table: :func:`~sur_lab.studies.noprefix.reporting.robustness_table` rows.
        title: figure title.

    Returns:
        The matplotlib figure: paths on the x axis; circles all requests, diamonds the EM-correct stratum (its size
        under the panel title); filled actual forwarding, open donor-copy (diagnostic upper bound). A panel whose
        model has no EM-correct request says so.
    """
    models = list(dict.fromkeys(table["model"]))
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 3.9), sharey=True, squeeze=False)
    for ax, model in zip(axes[0], models):
        sub = table[table["model"] == model]
        labels = list(dict.fromkeys(sub["label"]))
        xs = np.arange(len(labels))
        series = [(p, stratum) for stratum in ("", "_correct") for p in PROTOCOLS if p in set(sub["protocol"])]
        for j, (proto, sfx) in enumerate(series):
            pts = sub[sub["protocol"] == proto].set_index("label").reindex(labels)
            y = pts[f"preservation{sfx}"].astype(float)
            err = [y - pts[f"ci_low{sfx}"].astype(float), pts[f"ci_high{sfx}"].astype(float) - y]
            color = "C0" if sfx == "" else "C1"
            ax.errorbar(xs + (j - (len(series) - 1) / 2) * 0.16, y, yerr=err, fmt="o" if sfx == "" else "D",
                        color=color, mfc=color if proto == "forward" else "white", capsize=2, lw=1,
                        label=f"{'all requests' if sfx == '' else 'EM-correct'} · {PROTOCOL_LABELS[proto]}")
        n_all = int(sub["n"].max()) if len(sub) else 0
        n_ok = int(sub["n_correct"].max()) if len(sub) else 0
        ax.set_title(f"{model}\n{n_all} requests; EM-correct {n_ok}" + ("" if n_ok else " (none)"), fontsize=9)
        ax.set_xticks(xs)
        ax.set_xticklabels([_short(lab) for lab in labels], fontsize=7)
        ax.set_ylim(-0.05, 1.05)
    axes[0][0].set_ylabel("answer preservation vs full prefill")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=7, bbox_to_anchor=(0.5, -0.1))
    fig.suptitle(title or "Robustness checks: all requests vs the EM-correct stratum, per model; error bars: 95 % "
                 "bootstrap CI", fontsize=10)
    fig.tight_layout()
    return fig


__all__ = [
    "LOCAL_VS_SUFFIX",
    "plot_local_vs_suffix",
    "plot_pareto_ttfl",
    "plot_position_sweep",
    "plot_robustness",
]
