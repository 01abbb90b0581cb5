"""Figure and table output shared by every notebook: one seaborn style, PNG + PDF figures, CSV/Parquet tables.

Files go under ``outputs/figures`` and ``outputs/tables`` (or ``$SUR_LAB_OUTPUTS_DIR``) with the run's parameter
values in their names (:func:`run_tag`), so runs with other parameters do not overwrite each other. Every file is
written to a temporary name and renamed into place (:func:`sur_lab.paths.atomic_path`), so a failed or
interrupted run never leaves a torn figure or table and never destroys the previous one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from sur_lab.paths import atomic_path, outputs_dir


def setup_style() -> None:
    """Apply the house plot style (seaborn ``whitegrid``, ``talk``-sized fonts scaled for reports)."""
    import matplotlib as mpl
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook", palette="colorblind")
    mpl.rcParams.update({"figure.dpi": 110, "savefig.dpi": 200, "savefig.bbox": "tight", "pdf.fonttype": 42})


def run_tag(**params: Any) -> str:
    """A file-name-safe tag from parameter values, e.g. ``run_tag(model="x/y", n=10)`` -> ``"model-x-y_n-10"``."""
    parts = []
    for key, value in params.items():
        if isinstance(value, (list, tuple)):
            value = "-".join(str(v) for v in value)
        parts.append(f"{key}-{value}")
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", "_".join(parts)).strip("-")


def save_figure(fig, name: str, *, tag: str = "", outputs: Path | None = None) -> list[Path]:
    """Write ``fig`` as ``figures/{name}[_{tag}].png`` and ``.pdf`` (each atomically); returns the paths."""
    folder = (outputs or outputs_dir()) / "figures"
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{name}_{tag}" if tag else name
    paths = [folder / f"{stem}.png", folder / f"{stem}.pdf"]
    for path in paths:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=path.suffix[1:])
    return paths


#: Separator between the levels of a MultiIndex column name in a written table ("agreement (%) / 2%").
LEVEL_SEPARATOR = " / "


def flat_columns(df):
    """``df`` with MultiIndex columns joined into one header row, e.g. ``("agreement (%)", "2%")`` ->
    ``"agreement (%) / 2%"``; empty levels are left out (``("rule", "")`` -> ``"rule"``, as ``reset_index`` makes).

    A two-row CSV header reads back with ``pd.read_csv`` as ``agreement (%).1`` columns and a NaN first row, and
    Parquet refuses non-string column names, so every written table has one level of string names. A frame whose
    columns are not a MultiIndex is returned unchanged (the same object).

    Raises:
        ValueError: naming ``df`` when two flattened names coincide.
    """
    import pandas as pd

    if not isinstance(df.columns, pd.MultiIndex):
        return df
    names = [LEVEL_SEPARATOR.join(str(level) for level in col if str(level) != "") for col in df.columns]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"df: flattening its MultiIndex columns gives duplicate names {duplicates}")
    out = df.copy()
    out.columns = names
    return out


def save_table(df, name: str, *, tag: str = "", outputs: Path | None = None, parquet: bool = False) -> list[Path]:
    """Write ``df`` as ``tables/{name}[_{tag}].csv`` (and ``.parquet`` when asked), each atomically; returns the
    paths.

    The index is not written (reset it first when it holds data). MultiIndex columns are flattened to one header
    row (:func:`flat_columns`), so ``pd.read_csv`` and ``pd.read_parquet`` read the table back as written.
    """
    df = flat_columns(df)
    folder = (outputs or outputs_dir()) / "tables"
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{name}_{tag}" if tag else name
    paths = [folder / f"{stem}.csv"]
    with atomic_path(paths[0]) as tmp:
        df.to_csv(tmp, index=False)
    if parquet:
        paths.append(folder / f"{stem}.parquet")
        with atomic_path(paths[1]) as tmp:
            df.to_parquet(tmp, index=False)
    return paths


def plot_relevance_and_supports(token_scores, units, supports: dict, *, title: str = "", tokens=None):
    """Token relevance along the suffix with semantic-unit boundaries and the selected positions per budget.

    Args:
        token_scores: ``[S]`` SUR token scores (Eq. 7).
        units: semantic units (``start``/``end`` suffix-local).
        supports: ``{label: Support}``, e.g. ``{"SUR 5%": support}``, drawn as rows under the score trace.
        title: figure title.
        tokens: optional ``[S]`` token strings (unused for long suffixes; kept for small ones as x tick labels).

    Returns:
        The matplotlib Figure.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    S = len(token_scores)
    fig, (ax, bx) = plt.subplots(
        2, 1, figsize=(11, 3.2 + 0.35 * len(supports)), sharex=True,
        gridspec_kw={"height_ratios": [3, max(1, len(supports)) * 0.6]},
    )
    x = np.arange(S)
    for i, u in enumerate(units):
        ax.axvspan(u.start - 0.5, u.end - 0.5, color="0.92" if i % 2 else "white", zorder=0)
        if i:
            ax.axvline(u.start - 0.5, color="0.55", lw=0.7, ls="--", zorder=1)
    ax.plot(x, token_scores, lw=1.0, color="C0", label="token relevance $r_i$ (Eq. 7)")
    ax.set_ylabel("relevance")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    for row, (label, support) in enumerate(supports.items()):
        pos = np.asarray(support.positions)
        bx.scatter(pos, np.full(len(pos), row), marker="|", s=60, color=f"C{row + 1}")
    bx.set_yticks(range(len(supports)), list(supports))
    bx.set_ylim(-0.7, len(supports) - 0.3)
    bx.set_xlabel("suffix position (tokens); shaded bands = semantic units")
    bx.set_xlim(-1, S)
    if tokens is not None and S <= 60:
        bx.set_xticks(x, tokens, rotation=90, fontsize=6)
    fig.tight_layout()
    return fig


def plot_latency_breakdown(df, *, label_col: str = "label", title: str = ""):
    """Stacked post-edit latency per method (Eq. 20: select, shift, refresh, answer), in ms.

    Args:
        df: records with ``select_ms``, ``shift_ms``, ``refresh_ms``, ``answer_ms`` and a label column.
    """
    import matplotlib.pyplot as plt

    parts = ["select_ms", "shift_ms", "refresh_ms", "answer_ms"]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(df) + 1.5))
    left = None
    for i, part in enumerate(parts):
        values = df[part].fillna(0.0).to_numpy()
        ax.barh(df[label_col], values, left=left, color=f"C{i}", label=part.removesuffix("_ms"))
        left = values if left is None else left + values
    ax.invert_yaxis()
    ax.set_xlabel("post-edit latency (ms): selection + position correction + refresh + query/answer")
    ax.legend(loc="lower right", fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def method_label(method: str, budget_pct) -> str:
    """``"SUR 5%"`` for budgeted methods, the plain name for reference operators (NaN budget)."""
    import math

    if budget_pct is None or (isinstance(budget_pct, float) and math.isnan(budget_pct)):
        return method
    return f"{method} {budget_pct:g}%"
