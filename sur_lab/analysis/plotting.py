"""Figure and table output shared by every notebook: one seaborn style, PNG + PDF figures, CSV/Parquet tables, and
the token view (:func:`token_view`: the edited context as HTML, where a repair goes and what stays stale).

Files go under ``outputs/figures`` and ``outputs/tables`` (or ``$SUR_LAB_OUTPUTS_DIR``) with the run's parameter
values in their names (:func:`run_tag`), so runs with other parameters do not overwrite each other. Every file is
written to a temporary name and renamed into place (:func:`sur_lab.paths.atomic_path`), so a failed or
interrupted run never leaves a torn figure or table and never destroys the previous one. The formats follow
``$SUR_LAB_FIGURE_FORMATS`` and ``$SUR_LAB_TABLE_FORMATS`` when a runner sets them (the results release,
:mod:`sur_lab.runtime.release`, writes PNG + SVG figures and CSV + Parquet tables); by default PNG + PDF and CSV.
"""

from __future__ import annotations

import hashlib
import html as _html
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from IPython.display import display

from sur_lab.budget import Support
from sur_lab.paths import atomic_path, outputs_dir, run_tag  # noqa: F401  (run_tag: re-exported for notebooks)


def setup_style() -> None:
    """Apply the house plot style (seaborn ``whitegrid``, ``talk``-sized fonts scaled for reports)."""
    sns.set_theme(style="whitegrid", context="notebook", palette="colorblind")
    mpl.rcParams.update({"figure.dpi": 110, "savefig.dpi": 200, "savefig.bbox": "tight", "pdf.fonttype": 42})


#: Environment variables a runner sets for the kernels it starts (comma-separated suffixes): the figure formats
#: :func:`save_figure` writes (default ``png,pdf``) and the table formats :func:`save_table` writes besides CSV
#: (``parquet`` makes every table also a Parquet file).
FIGURE_FORMATS_ENV = "SUR_LAB_FIGURE_FORMATS"
TABLE_FORMATS_ENV = "SUR_LAB_TABLE_FORMATS"
#: The resolution of raster figures, dots per inch, when a runner sets it (default: the style's ``savefig.dpi``).
FIGURE_DPI_ENV = "SUR_LAB_FIGURE_DPI"
FIGURE_FORMATS = ("png", "pdf", "svg")


def figure_formats() -> tuple[str, ...]:
    """The figure formats :func:`save_figure` writes: ``$SUR_LAB_FIGURE_FORMATS`` (e.g. ``"png,svg"``) or PNG + PDF.

    Raises:
        ValueError: naming ``SUR_LAB_FIGURE_FORMATS`` when it names a format outside ``png``, ``pdf``, ``svg`` or none.
    """
    value = os.environ.get(FIGURE_FORMATS_ENV, "png,pdf")
    formats = tuple(dict.fromkeys(f.strip().lower() for f in value.split(",") if f.strip()))
    if not formats or any(f not in FIGURE_FORMATS for f in formats):
        raise ValueError(f"{FIGURE_FORMATS_ENV}={value!r}: give a comma-separated subset of {', '.join(FIGURE_FORMATS)}")
    return formats


def save_figure(fig, name: str, *, tag: str = "", outputs: Path | None = None) -> list[Path]:
    """Write ``fig`` as ``figures/{name}[_{tag}].png`` and ``.pdf`` (each atomically; the formats of
    :func:`figure_formats`, PNGs at ``$SUR_LAB_FIGURE_DPI`` when set); returns the paths.

    Raises:
        ValueError: naming ``SUR_LAB_FIGURE_FORMATS`` or ``SUR_LAB_FIGURE_DPI`` when either is set to something
            unusable (before anything is written).
    """
    formats = figure_formats()
    dpi = os.environ.get(FIGURE_DPI_ENV)
    try:
        dpi = float(dpi) if dpi else "figure"
    except ValueError:
        dpi = -1.0
    if dpi != "figure" and not 10 <= dpi <= 1200:
        raise ValueError(f"{FIGURE_DPI_ENV}={os.environ[FIGURE_DPI_ENV]!r}: give dots per inch in [10, 1200]")
    folder = (outputs or outputs_dir()) / "figures"
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{name}_{tag}" if tag else name
    paths = [folder / f"{stem}.{fmt}" for fmt in formats]
    for path in paths:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=path.suffix[1:], **({} if dpi == "figure" else {"dpi": dpi}))
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
    """Write ``df`` as ``tables/{name}[_{tag}].csv`` (and ``.parquet`` when asked, or when ``$SUR_LAB_TABLE_FORMATS``
    includes ``parquet``), each atomically; returns the paths.

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
    if parquet or "parquet" in os.environ.get(TABLE_FORMATS_ENV, "").lower().split(","):
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
    if budget_pct is None or (isinstance(budget_pct, float) and math.isnan(budget_pct)):
        return method
    return f"{method} {budget_pct:g}%"


# ---------------------------------------------------------------------------------------------------------------------
# Token view: the edited context as HTML

#: Set (to "1") by the notebook runner while papermill executes a notebook: :meth:`TokenView.show` then writes the
#: static HTML only (an executed copy keeps no widget state, so a widget would render as an error there).
STATIC_OUTPUTS_ENV = "SUR_LAB_STATIC_OUTPUTS"
#: Decades of K/V deviation below the largest one that the deviation shading spans (log scale; smaller is blank).
DEVIATION_DECADES = 3.0
#: Tokens of a longer deleted span shown (its first ones and the last :data:`DELETED_TAIL`); the middle is elided.
MAX_DELETED_SHOWN = 60
DELETED_TAIL = 10
#: Prefix tokens shown before the deleted span when nothing earlier was recomputed or left stale.
PREFIX_CONTEXT = 48
_RELEVANCE_RGB = "31,119,180"
_DEVIATION_RGB = "214,39,40"


def _key_label(key) -> str:
    if isinstance(key, str):
        return key
    method, budget = key
    return method_label(method, budget)


def token_pieces(tokenizer, ids) -> list[str]:
    """The text of each token id (``tokenizer.decode`` of one id at a time), for :func:`token_view`.

    Args:
        tokenizer: a transformers tokenizer.
        ids: ``[N]`` token ids (tensor, array or list).

    Returns:
        N strings; a character split across tokens shows as the replacement character in each piece.
    """
    return [tokenizer.decode([int(i)]) for i in list(ids)]


@dataclass(frozen=True)
class TokenView:
    """The edited context rendered as HTML: relevance, units, the deleted span and each repair's refreshed rows.

    Built by :func:`token_view` (which checks its inputs); displays itself in Jupyter (static HTML, see :meth:`html`),
    or as an ipywidgets control (:meth:`widget`, :meth:`show`).

    Attributes:
        pieces: text of the ``p + d + S`` tokens of the original context, in order.
        prefix_len: p, tokens before the deleted span.
        deleted_len: d, deleted tokens (struck through at their place).
        relevance: float64 ``[S]`` token relevance (Eq. 7), or None.
        unit_starts: suffix-local starts of the semantic units after the first (boundaries drawn before them).
        refreshed: label -> sorted int64 rows of the edited context ``[0, p + S)`` that the repair recomputed.
        deviation: label -> float64 ``[p + S]`` K/V deviation of the repaired cache from Re-prefill per row (any
            non-negative scale, e.g. the relative L2 over layers), or an empty mapping.
        query: text shown after the context (the query that follows the repair), or None.
        title: heading line.
        methods: label -> ``(method, budget_pct)`` (budget NaN for reference operators), for the widget's controls.
        max_deleted: deleted tokens shown; a longer span shows its first ``max_deleted - DELETED_TAIL`` and last
            :data:`DELETED_TAIL` tokens around a count of the elided ones.
        prefix_context: prefix tokens shown before the deletion; earlier ones are elided (with their count) unless a
            repair recomputed them or left them deviating from Re-prefill (then the view starts a few tokens before
            the first such row).
    """

    pieces: tuple[str, ...]
    prefix_len: int
    deleted_len: int
    relevance: np.ndarray | None
    unit_starts: tuple[int, ...]
    refreshed: dict[str, np.ndarray]
    deviation: dict[str, np.ndarray] = field(default_factory=dict)
    query: str | None = None
    title: str = ""
    methods: dict[str, tuple[str, float]] = field(default_factory=dict)
    max_deleted: int = MAX_DELETED_SHOWN
    prefix_context: int = PREFIX_CONTEXT

    @property
    def labels(self) -> list[str]:
        """The repairs shown, in the order given."""
        return list(self.refreshed)

    @property
    def suffix_len(self) -> int:
        """S, retained suffix tokens."""
        return len(self.pieces) - self.prefix_len - self.deleted_len

    def _uid(self) -> str:
        digest = hashlib.sha1()
        for part in (*self.pieces, *self.labels, self.title):
            digest.update(part.encode("utf-8", "replace") + b"\0")
        return "tv" + digest.hexdigest()[:10]

    def _deviation_levels(self) -> dict[str, np.ndarray]:
        """Per label, shading in [0, 1]: log10 of the deviation relative to the largest over all labels, spanning
        :data:`DEVIATION_DECADES` decades (rows within float rounding of Re-prefill's are blank)."""
        if not self.deviation:
            return {}
        top = max((float(np.max(d)) for d in self.deviation.values() if len(d)), default=0.0)
        if top <= 0:
            return {k: np.zeros_like(v) for k, v in self.deviation.items()}
        out = {}
        for label, dev in self.deviation.items():
            with np.errstate(divide="ignore"):
                level = 1.0 + np.log10(np.maximum(dev, 0.0) / top) / DEVIATION_DECADES
            out[label] = np.clip(np.nan_to_num(level, neginf=0.0), 0.0, 1.0)
        return out

    def html(self, selected: str | None = None, *, controls: bool = True) -> str:
        """Static HTML: every repair in one document, switched by radio buttons styled with CSS (no script).

        Args:
            selected: the repair shown first (default: the first label that recomputes any row).
            controls: draw the radio buttons (the widget hides them and switches ``selected`` instead).

        Returns:
            An HTML fragment (a ``<div>`` with its ``<style>``): each token a ``<span class="tok">``; suffix tokens are
            shaded by relevance (blue background), rows refreshed by the selected repair are underlined (class
            ``r<i>`` for label ``i``), each row's K/V deviation from Re-prefill is a red bar above the token (CSS
            variable ``--d<i>``), unit boundaries are a grey bar before the unit's first token (class ``ub``) and the
            deleted span is struck through (``<del>``) at its place, its middle elided when it is longer than
            :attr:`max_deleted` tokens.

        Raises:
            ValueError: naming ``selected`` when it is not one of :attr:`labels`.
        """
        labels = self.labels
        if selected is None:  # the first repair that recomputes anything (Shift alone shows no underline)
            selected = next((label for label in labels if len(self.refreshed[label])), labels[0])
        elif selected not in labels:
            raise ValueError(f"selected={selected!r} is not one of the repairs shown: {labels}")
        uid, p, d = self._uid(), self.prefix_len, self.deleted_len
        levels = self._deviation_levels()
        rows_of = {i: set(self.refreshed[label].tolist()) for i, label in enumerate(labels)}
        rel = None
        if self.relevance is not None and len(self.relevance):
            r = np.asarray(self.relevance, dtype=np.float64)
            lo, hi = float(np.min(r)), float(np.max(r))
            rel = (r - lo) / (hi - lo) if hi > lo else np.zeros_like(r)
        starts = set(self.unit_starts)
        css = [
            f"#{uid}{{font-family:ui-monospace,monospace;font-size:12px;line-height:1.9}}",
            f"#{uid} .body{{white-space:pre-wrap;border:1px solid #ddd;padding:6px;max-height:44em;overflow:auto}}",
            f"#{uid} .tok{{border-radius:2px}}",
            f"#{uid} .pre{{color:#666}}",
            f"#{uid} .ub{{border-left:2px solid #888;margin-left:1px}}",
            f"#{uid} del{{color:#b00;background:#fde8e8;text-decoration:line-through}}",
            f"#{uid} .q{{color:#555;font-style:italic}}",
            f"#{uid} .skip{{color:#b00;font-style:italic}}",
            f"#{uid} .cap{{display:none;margin:4px 0}}",
            f"#{uid} input{{margin-left:10px}}",
        ]
        for i, label in enumerate(labels):
            on = f"#{uid} input.c{i}:checked"
            css.append(f"{on} ~ .body .r{i}{{text-decoration:underline 2px;text-underline-offset:3px}}")
            css.append(f"{on} ~ .cap{i}{{display:block}}")
            if label in levels:
                css.append(f"{on} ~ .body .tok{{box-shadow:inset 0 3px 0 rgba({_DEVIATION_RGB},var(--d{i},0))}}")
        out = [f'<div id="{uid}" class="sur-token-view"><style>{"".join(css)}</style>']
        if self.title:
            out.append(f"<div><b>{_html.escape(self.title)}</b></div>")
        out.append(
            f'<div style="color:#555">Background: token relevance r<sub>i</sub> (Eq. 7, blue, min to max over the '
            f"suffix). Underlined: rows the selected repair recomputed. Red bar above a token: its K/V deviation from "
            f"Re-prefill (log scale, {DEVIATION_DECADES:g} decades below the largest). Grey bar: semantic-unit "
            f"boundary. Struck through: the deleted span. Grey text: the prefix.</div>"
            if levels else
            '<div style="color:#555">Background: token relevance r<sub>i</sub> (Eq. 7, blue, min to max over the '
            "suffix). Underlined: rows the selected repair recomputed. Grey bar: semantic-unit boundary. Struck "
            "through: the deleted span. Grey text: the prefix.</div>"
        )
        for i, label in enumerate(labels):
            checked = " checked" if label == selected else ""
            hidden = "" if controls else ' style="display:none"'
            out.append(f'<input type="radio" name="{uid}" id="{uid}-{i}" class="c{i}"{checked}{hidden}>'
                       + (f'<label for="{uid}-{i}">{_html.escape(label)}</label>' if controls else ""))
        for i, label in enumerate(labels):
            rows = self.refreshed[label]
            in_suffix = int(np.sum(rows >= p))
            intervals = int(np.sum(np.diff(rows) != 1) + 1) if len(rows) else 0
            out.append(f'<div class="cap cap{i}">{_html.escape(label)}: {len(rows)} of {p + self.suffix_len} rows '
                       f"recomputed ({in_suffix} in the suffix of {self.suffix_len}), in {intervals} "
                       f"interval{'' if intervals == 1 else 's'}</div>")
        body = ['<div class="body">']
        dev_cols = {i: levels[label] for i, label in enumerate(labels) if label in levels}
        first = self.first_row_shown(levels)
        if first:
            body.append(f'<span class="skip pre"> … {first} earlier tokens … </span>')
        for pos, piece in enumerate(self.pieces):
            if pos < first:
                continue
            text = _html.escape(piece)
            if p <= pos < p + d:
                k = pos - p
                if k == 0:
                    body.append("<del>")
                if k < self.max_deleted - DELETED_TAIL or k >= d - DELETED_TAIL or d <= self.max_deleted:
                    body.append(text)
                elif k == self.max_deleted - DELETED_TAIL:
                    body.append(f'</del><span class="skip"> … {d - self.max_deleted} more deleted tokens … </span><del>')
                if k == d - 1:
                    body.append("</del>")
                continue
            row = pos if pos < p else pos - d
            classes = ["tok"] + (["pre"] if pos < p else []) + [f"r{i}" for i, rows in rows_of.items() if row in rows]
            style = []
            if pos >= p + d:
                j = pos - p - d
                if j in starts:
                    classes.append("ub")
                if rel is not None:
                    style.append(f"background:rgba({_RELEVANCE_RGB},{0.05 + 0.6 * rel[j]:.2f})")
            style += [f"--d{i}:{col[row]:.2f}" for i, col in dev_cols.items() if col[row] > 0]
            attr = f' style="{";".join(style)}"' if style else ""
            body.append(f'<span class="{" ".join(classes)}"{attr}>{text}</span>')
        if self.query:
            body.append(f'<span class="q">{_html.escape(self.query)}</span>')
        body.append("</div>")
        # radio inputs and captions must precede the body as siblings for the ~ selectors
        out.extend(body)
        out.append("</div>")
        return "".join(out)

    def first_row_shown(self, levels: dict[str, np.ndarray] | None = None) -> int:
        """The first prefix row the static view shows (see :attr:`prefix_context`)."""
        p = self.prefix_len
        levels = self._deviation_levels() if levels is None else levels
        marked = [int(r[0]) for r in self.refreshed.values() if len(r) and r[0] < p]
        marked += [int(np.argmax(v[:p] > 0)) for v in levels.values() if np.any(v[:p] > 0)]
        start = min([p - self.prefix_context] + [m - DELETED_TAIL for m in marked])
        return max(0, start)

    def _repr_html_(self) -> str:
        return self.html()

    def widget(self):
        """An ipywidgets control (method and budget drop-downs) over the same rendering, for JupyterLab.

        Returns:
            ``ipywidgets.VBox`` of two ``Dropdown`` s and an ``HTML`` widget.

        Raises:
            ImportError: when ipywidgets is not installed.
        """
        methods = {label: self.methods.get(label, (label, float("nan"))) for label in self.labels}
        names = list(dict.fromkeys(m for m, _ in methods.values()))

        def budgets_of(name):
            return [("–" if math.isnan(b) else f"{b:g}%", label) for label, (m, b) in methods.items() if m == name]

        method = widgets.Dropdown(options=names, description="method")
        budget = widgets.Dropdown(options=budgets_of(names[0]), description="budget")
        view = widgets.HTML(self.html(budget.value, controls=False))

        def on_method(change):
            budget.options = budgets_of(change["new"])
            budget.value = budget.options[0][1]

        def on_budget(change):
            if change["new"] is not None:
                view.value = self.html(change["new"], controls=False)

        method.observe(on_method, names="value")
        budget.observe(on_budget, names="value")
        return widgets.VBox([widgets.HBox([method, budget]), view])

    def show(self) -> None:
        """Display the view: the ipywidgets control in a live Jupyter session, with the static HTML as its fallback;
        only the static HTML while the notebook runner executes the notebook (``$SUR_LAB_STATIC_OUTPUTS``), so that
        executed copies and the documentation keep a rendering that needs no kernel."""
        bundle = {"text/html": self.html()}
        if os.environ.get(STATIC_OUTPUTS_ENV) != "1":
            try:
                bundle = {**self.widget()._repr_mimebundle_(), **bundle}
            except ImportError:
                pass
        display(bundle, raw=True)


def token_view(
    pieces: Sequence[str],
    *,
    prefix_len: int,
    deleted_len: int,
    refreshed: Mapping[Any, Any],
    relevance=None,
    units: Sequence[Any] = (),
    deviation: Mapping[Any, Any] | None = None,
    query: str | None = None,
    title: str = "",
) -> TokenView:
    """Check and assemble a :class:`TokenView` of one deletion edit and several repairs of it.

    Args:
        pieces: text of each of the ``N = p + d + S`` tokens of the original context (:func:`token_pieces`).
        prefix_len: p, tokens before the deleted span (``0 <= p``).
        deleted_len: d, deleted tokens (``d >= 1``, ``p + d <= N``).
        refreshed: one entry per repair shown, keyed by ``(method, budget_pct)`` (budget None or NaN for reference
            operators; the label is :func:`method_label`'s) or by a label string. Each value is a
            :class:`~sur_lab.budget.Support` (suffix-local positions, mapped to rows ``p + i``) or the int rows of the
            edited context ``[0, p + S)`` that the repair recomputed (e.g. an edit record's ``refreshed_rows``).
        relevance: ``[S]`` token relevance (Eq. 7; SUR's ``token_scores`` diagnostics), or None.
        units: the suffix's semantic units (objects with a suffix-local ``start``, as :func:`sur_lab.units.segment_units`
            returns), in order.
        deviation: optional, keyed like ``refreshed`` (a subset): ``[p + S]`` or ``[S]`` non-negative K/V deviation
            of that repair's cache from Re-prefill's per row (an ``[S]`` array covers the suffix; the prefix is then 0).
        query: text shown after the context, or None.
        title: heading line.

    Returns:
        The :class:`TokenView` (display it, or call ``.html()``, ``.widget()`` or ``.show()``).

    Raises:
        ValueError: naming ``prefix_len``/``deleted_len`` outside their ranges, ``refreshed`` when empty or a row lies
            outside ``[0, p + S)``, ``relevance`` or ``deviation`` of the wrong length or negative, ``units`` when a
            start lies outside ``[0, S)``, or ``deviation`` keyed by a repair not in ``refreshed``.
    """
    pieces = tuple(str(x) for x in pieces)
    n = len(pieces)
    if not (isinstance(prefix_len, (int, np.integer)) and 0 <= prefix_len <= n):
        raise ValueError(f"prefix_len={prefix_len!r} must be an integer in [0, {n}] (len(pieces))")
    if not (isinstance(deleted_len, (int, np.integer)) and 1 <= deleted_len <= n - prefix_len):
        raise ValueError(f"deleted_len={deleted_len!r} must be an integer in [1, {n - prefix_len}] (N - prefix_len)")
    p, d = int(prefix_len), int(deleted_len)
    S, rows_total = n - p - d, n - d
    if not refreshed:
        raise ValueError("refreshed is empty; give at least one repair to show")
    rows: dict[str, np.ndarray] = {}
    methods: dict[str, tuple[str, float]] = {}
    for key, value in refreshed.items():
        label = _key_label(key)
        if isinstance(value, Support):
            if value.suffix_len != S:
                raise ValueError(f"refreshed[{label!r}] is a Support over S={value.suffix_len}; the edit has S={S}")
            r = np.asarray(value.absolute(p), dtype=np.int64)
        else:
            r = np.unique(np.asarray(value, dtype=np.int64).reshape(-1))
        if len(r) and (r[0] < 0 or r[-1] >= rows_total):
            raise ValueError(f"refreshed[{label!r}] has rows outside [0, {rows_total}) (p + S)")
        rows[label] = np.sort(r)
        if isinstance(key, str):
            methods[label] = (key, float("nan"))
        else:
            methods[label] = (key[0], float("nan") if key[1] is None else float(key[1]))
    rel = None
    if relevance is not None:
        rel = np.asarray(relevance, dtype=np.float64).reshape(-1)
        if len(rel) != S:
            raise ValueError(f"relevance has {len(rel)} entries; the suffix has S={S}")
    starts = []
    for u in units:
        start = int(getattr(u, "start", u[0] if isinstance(u, (tuple, list)) else u))
        if not 0 <= start < max(S, 1):
            raise ValueError(f"units: a unit starts at {start}, outside the suffix [0, {S})")
        starts.append(start)
    devs: dict[str, np.ndarray] = {}
    for key, value in (deviation or {}).items():
        label = _key_label(key)
        if label not in rows:
            raise ValueError(f"deviation[{label!r}] has no entry in refreshed ({list(rows)})")
        v = np.asarray(value, dtype=np.float64).reshape(-1)
        if len(v) == S:
            v = np.concatenate((np.zeros(p), v))
        if len(v) != rows_total:
            raise ValueError(f"deviation[{label!r}] has {len(v)} entries; expected p + S = {rows_total} or S = {S}")
        if np.any(v < 0) or not np.all(np.isfinite(v)):
            raise ValueError(f"deviation[{label!r}] must be finite and non-negative")
        devs[label] = v
    return TokenView(pieces, p, d, rel, tuple(s for s in starts if s > 0), rows, devs, query, title, methods)
