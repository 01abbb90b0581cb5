"""Natural multi-hop QA's report (notebook 03): the long results table, Tables 7-11 (quality and latency, EM by
dataset, Table 9's paired differences), error transitions, Figure 4 and the conclusion lines.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd

from sur_lab.analysis.decisions import family_lines
from sur_lab.analysis.stats import (
    BOOTSTRAP_SEED,
    N_BOOT,
    agreement_rate,
    check_timing,
    error_transitions,
    paired_bootstrap,
    pooled_em,
    timed_records,
)
from sur_lab.studies.natural_qa.cases import DATASET_LABELS, PAPER_ALLOCATORS, REFERENCES, PlacementCase
from sur_lab.studies.presets import lead_endpoint

#: Eq. 20 components, in ms, as the sweep records them.
LATENCY_PARTS = ("select_ms", "shift_ms", "refresh_ms", "answer_ms")
#: Columns that identify one case (one placement of one source) in a results table.
CASE_KEYS = ("dataset", "source_id", "placement")


# ---------------------------------------------------------------------------------------------------------------------
# Results tables


def condition_label(method: str, budget_pct: Any) -> str:
    """``"SUR 5%"`` for a budgeted method, the plain name for a reference operator (NaN/None budget)."""
    if budget_pct is None or (isinstance(budget_pct, float) and math.isnan(budget_pct)):
        return method
    return f"{method} {float(budget_pct):g}%"


def results_table(records: pd.DataFrame | Sequence[dict]) -> pd.DataFrame:
    """Normalize sweep records into the long table the statistics use: one row per (case, condition[, trial]).

    Adds ``condition`` (:func:`condition_label`), ``correct`` (bool, from ``em``), ``answer`` (the extracted answer,
    from ``prediction``; the sweep's raw generated text moves to ``answer_text``) and ``latency_ms`` (Eq. 20,
    recomputed as the sum of :data:`LATENCY_PARTS` when absent), and keeps every other column. ``dataset``,
    ``source_id`` and ``placement`` must be present (from the case meta).

    Args:
        records: sweep records (DataFrame or list of dicts) with ``method``, ``budget_pct``, ``em``, ``prediction``,
            the Eq. 20 parts in ms and the case columns.

    Returns:
        A new DataFrame.

    Raises:
        ValueError: naming ``records`` when a required column is missing or a score is missing (None/NaN).
    """
    df = pd.DataFrame(records).copy()
    required = ["method", "budget_pct", "em", "prediction", *CASE_KEYS, *LATENCY_PARTS]
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ValueError(f"records lack columns {missing}")
    if df["em"].isna().any():
        raise ValueError("records hold unscored rows (em is None/NaN); run the sweep with the dataset scorer")
    df["condition"] = [condition_label(m, b) for m, b in zip(df["method"], df["budget_pct"])]
    df["correct"] = df["em"].astype(bool)
    if "answer" in df.columns:
        df = df.rename(columns={"answer": "answer_text"})
    df["answer"] = df["prediction"].fillna("").astype(str)
    if "latency_ms" not in df.columns:
        df["latency_ms"] = df[list(LATENCY_PARTS)].sum(axis=1)
    return df


def aggregate_trials(table: pd.DataFrame) -> pd.DataFrame:
    """Average the Eq. 20 timings over repeated trials of a case; answers come from trial 0.

    Tables without a ``trial`` column (or with one trial) are returned unchanged (copied). Greedy decoding is
    deterministic, so every trial gives the same answer; ``answers_consistent`` records whether it did.

    Raises:
        ValueError: naming ``table`` when a case/condition lacks trial 0, or when its trials were not all timed per
            request or were timed under different concurrency (``timed``/``workers``/``threads``;
            :func:`sur_lab.analysis.stats.check_timing`).
    """
    if "trial" not in table.columns or table["trial"].nunique() <= 1:
        return table.copy()
    # Only per-request timings are averaged; cases answered in batches carry none (their means stay NaN).
    check_timing(timed_records(table), what="trial timings (averaged per case)")
    if "timed" in table.columns:
        mixed = table.groupby([*CASE_KEYS, "condition"])["timed"].nunique() > 1
        if mixed.any():
            raise ValueError("table: some case's trial timings mix timed and batched (untimed) records; time every "
                             "trial of a case or none")
    keys = [*CASE_KEYS, "condition"]
    timing = [*LATENCY_PARTS, "latency_ms"]
    first = table[table["trial"] == 0].set_index(keys)
    if len(first) != table.groupby(keys).ngroups:
        raise ValueError("table: every (case, condition) needs a trial 0")
    means = table.groupby(keys)[timing].mean()
    consistent = table.groupby(keys)["answer"].nunique() == 1
    trials = table.groupby(keys).size()
    out = first.drop(columns=timing).join(means).assign(answers_consistent=consistent, trials=trials)
    return out.reset_index()


def _check_timing_concurrency(table: pd.DataFrame, mixed_concurrency: str, what: str) -> None:
    """Refuse or warn when ``table``'s timings were not all measured per request or mix concurrency settings; warn
    when they were measured by several workers sharing a machine."""
    if mixed_concurrency not in ("raise", "warn"):
        raise ValueError(f"mixed_concurrency={mixed_concurrency!r} must be 'raise' or 'warn'")
    check_timing(table, what=f"timings in one {what}", strict=mixed_concurrency == "raise")
    if "workers" in table.columns and (pd.to_numeric(table["workers"], errors="coerce") > 1).any():
        warnings.warn(
            f"{what}: timings were measured with {int(pd.to_numeric(table['workers']).max())} workers sharing the "
            "machine (contended); latency studies should run with workers=1", UserWarning, stacklevel=3,
        )


def _ordered_conditions(table: pd.DataFrame) -> list[str]:
    """Conditions in table order: allocators (given order, budgets ascending), then references."""
    conds = table.drop_duplicates("condition")[["condition", "method", "budget_pct"]]
    refs = [r for r in REFERENCES if r in set(conds["method"])] + sorted(
        set(conds.loc[conds["budget_pct"].isna(), "method"]) - set(REFERENCES)
    )
    alloc = conds[conds["budget_pct"].notna()]
    order = [m for m in PAPER_ALLOCATORS if m in set(alloc["method"])]
    order += sorted(set(alloc["method"]) - set(order))
    rank = {m: i for i, m in enumerate(order)}
    alloc = alloc.assign(rank=alloc["method"].map(rank)).sort_values(["rank", "budget_pct"])
    return list(alloc["condition"]) + refs


def quality_latency_table(
    table: pd.DataFrame, reference: str = "Re-prefill", *, mixed_concurrency: str = "raise"
) -> pd.DataFrame:
    """Tables 7-8: pooled EM (Eq. 9), agreement with ``reference`` and mean post-edit latency with its breakdown.

    Quality comes from every case; latency (Eq. 20) only from the records timed per request (``timed``): every case, or
    the declared subset a sweep timed (``timed_cases``). A condition without timed records gets NaN latency and a
    warning.

    Args:
        table: output of :func:`results_table` (after :func:`aggregate_trials` when trials were repeated).
        reference: condition whose extracted answers define agreement (Re-prefill).
        mixed_concurrency: what to do when the timed records were measured under different concurrency
            (``workers``/``threads`` differ, e.g. a sweep resumed with another worker count): ``"raise"`` (default)
            or ``"warn"`` (:func:`sur_lab.analysis.stats.check_concurrency`). Timings made by several workers sharing
            a machine are contended; run latency studies with one worker.

    Returns:
        One row per condition in table order: ``condition``, ``method``, ``budget_pct``, ``cases``, ``correct``,
        ``em_pct`` (unrounded), ``agree_pct`` (% of cases whose answer equals the reference's after normalization),
        ``timed_cases`` (cases whose latency is averaged), the mean Eq. 20 parts ``select_ms``, ``shift_ms``,
        ``refresh_ms``, ``answer_ms``, mean ``latency_ms`` and ``latency_s``, ``speedup_vs_reference`` (reference
        latency / latency), mean ``allowance`` and ``num_intervals`` where recorded.

    Raises:
        ValueError: naming ``reference`` when it is not a condition of ``table``, ``mixed_concurrency`` when not
            "raise"/"warn", or (``"raise"``) listing the concurrency settings the timed records mix.
    """
    timed = timed_records(table)
    _check_timing_concurrency(timed, mixed_concurrency, "latency table")
    if timed.empty:
        warnings.warn("latency table: no record was timed per request (timed=False everywhere); latency is NaN. Time "
                      "the cases (timed_cases) to fill it", UserWarning, stacklevel=2)
    conditions = _ordered_conditions(table)
    if reference not in conditions:
        raise ValueError(f"reference={reference!r} is not a condition of the table ({conditions})")
    ref_latency = timed.loc[timed["condition"] == reference, "latency_ms"].mean()
    rows = []
    for cond in conditions:
        sub = table[table["condition"] == cond]
        sub_timed = timed[timed["condition"] == cond]
        row = {
            "condition": cond,
            "method": sub["method"].iloc[0],
            "budget_pct": sub["budget_pct"].iloc[0],
            "cases": len(sub),
            "correct": int(sub["correct"].sum()),
            "em_pct": pooled_em(sub["correct"].to_numpy()),
            "agree_pct": agreement_rate(table, cond, reference, method_col="condition") if cond != reference else 100.0,
            "timed_cases": len(sub_timed),
        }
        for part in (*LATENCY_PARTS, "latency_ms"):
            row[part] = float(sub_timed[part].mean()) if len(sub_timed) else float("nan")
        row["latency_s"] = row["latency_ms"] / 1e3
        row["speedup_vs_reference"] = float(ref_latency / row["latency_ms"]) if row["latency_ms"] else float("nan")
        for extra in ("allowance", "num_intervals"):
            if extra in sub.columns:
                row[extra] = float(sub[extra].mean())
        rows.append(row)
    return pd.DataFrame(rows)


def dataset_em_table(table: pd.DataFrame, metric_col: str = "correct") -> pd.DataFrame:
    """Tables 10-11: EM (%) per dataset and pooled over datasets from unrounded counts (Eq. 9).

    Args:
        table: output of :func:`results_table`.
        metric_col: bool column to count (``"correct"`` for EM; ``"agree_reprefill"`` for agreement with
            Re-prefill).

    Returns:
        One row per condition in table order with ``condition``, one column per dataset present (labels of
        :data:`DATASET_LABELS`, in their order), ``Pooled`` and ``cases``.

    Raises:
        ValueError: naming ``metric_col`` when it is not a column.
    """
    if metric_col not in table.columns:
        raise ValueError(f"metric_col={metric_col!r} is not a column of table")
    rows = []
    present = [d for d in DATASET_LABELS if d in set(table["dataset"])]
    present += sorted(set(table["dataset"]) - set(present))
    for cond in _ordered_conditions(table):
        sub = table[table["condition"] == cond]
        counts = {d: (int(g[metric_col].astype(bool).sum()), len(g)) for d, g in sub.groupby("dataset")}
        row = {"condition": cond}
        for d in present:
            k, n = counts.get(d, (0, 0))
            row[DATASET_LABELS.get(d, d)] = 100.0 * k / n if n else float("nan")
        row["Pooled"] = pooled_em(counts)
        row["cases"] = len(sub)
        rows.append(row)
    return pd.DataFrame(rows)


def paired_difference_table(
    table: pd.DataFrame,
    method: str = "SUR",
    references: Sequence[str] = REFERENCES,
    *,
    budgets: Sequence[float] | None = None,
    metric_col: str = "correct",
    n_boot: int = N_BOOT,
    seed: int = BOOTSTRAP_SEED,
    ci: float = 95.0,
) -> pd.DataFrame:
    """Table 9: ``method`` at each budget minus each reference, in EM percentage points, with paired intervals.

    Uses :func:`sur_lab.analysis.stats.paired_bootstrap` (dataset-stratified, source-paired, the three placements of a source
    resampled together; 10,000 replicates, seed 20260928, linear-interpolated percentiles; appendix 8.3).

    Args:
        table: output of :func:`results_table`.
        method: the budgeted method (SUR).
        references: reference conditions.
        budgets: budgets to report (default: every budget ``method`` has in ``table``).
        metric_col: bool/0-1 column compared (``"correct"``: EM; ``"agree_reprefill"``: agreement).
        n_boot, seed, ci: bootstrap settings.

    Returns:
        Rows ``budget_pct``, ``reference``, ``delta``, ``delta_low``, ``delta_high`` (``method`` minus the reference),
        ``unit`` ("pp"), ``n`` (cases of ``method`` at the budget) and ``n_clusters`` (sources resampled): the
        paired-difference schema of :func:`sur_lab.analysis.decisions.in_units` (this table has no verdict and no
        ``delta_mde``).

    Raises:
        ValueError: naming ``method`` when it has no budgeted rows, or as :func:`sur_lab.analysis.stats.paired_bootstrap`.
    """
    have = sorted(table.loc[(table["method"] == method) & table["budget_pct"].notna(), "budget_pct"].unique())
    if not have:
        raise ValueError(f"method={method!r} has no budgeted rows in the table")
    rows = []
    for b in budgets if budgets is not None else have:
        cond = condition_label(method, float(b))
        for ref in references:
            res = paired_bootstrap(
                table, metric_col=metric_col, method_a=cond, method_b=ref, source_col="source_id",
                strata_col="dataset", method_col="condition", n_boot=n_boot, seed=seed, ci=ci,
            )
            rows.append({
                "budget_pct": float(b), "reference": ref, "delta": 100 * res.diff, "delta_low": 100 * res.low,
                "delta_high": 100 * res.high, "unit": "pp", "n": int((table["condition"] == cond).sum()),
                "n_clusters": res.n_sources,
            })
    return pd.DataFrame(rows)


def conclusion(decided: pd.DataFrame) -> list[str]:
    """The verdict lines of notebook 03's conclusion: each family of :func:`decide_families` with its size, then each
    of its comparisons (:func:`sur_lab.analysis.decisions.sentence`; latency ratios read "is faster than")."""
    return family_lines(decided, what="cases", clusters="sources")


def transition_table(table: pd.DataFrame, reference: str = "Shift", *, metric_col: str = "correct") -> pd.DataFrame:
    """Error transitions of every condition against ``reference`` (appendix 8.3), case-paired.

    Args:
        table: output of :func:`results_table`.
        reference: reference condition (Shift).
        metric_col: bool column (``"correct"``: EM transitions; ``"agree_reprefill"``: transitions of agreement with
            Re-prefill, e.g. Shift disagrees and the repair agrees).

    Returns:
        One row per other condition: ``condition``, ``repairs`` (reference wrong, condition right), ``regressions``
        (the reverse), ``both_correct``, ``both_wrong``, ``n`` and the rates ``repairs_pct``/``regressions_pct``
        (% of ``n``).

    Raises:
        ValueError: naming ``reference`` when it is not a condition of ``table``.
    """
    conditions = _ordered_conditions(table)
    if reference not in conditions:
        raise ValueError(f"reference={reference!r} is not a condition of the table ({conditions})")
    rows = []
    for cond in conditions:
        if cond == reference:
            continue
        t = error_transitions(
            table, cond, reference, metric_col=metric_col, method_col="condition", case_cols=CASE_KEYS
        )
        rows.append({
            "condition": cond, **t, "repairs_pct": 100 * t["repairs"] / t["n"],
            "regressions_pct": 100 * t["regressions"] / t["n"],
        })
    return pd.DataFrame(rows)


def latency_breakdown(summary: pd.DataFrame) -> pd.DataFrame:
    """The Eq. 20 breakdown of :func:`quality_latency_table` as a tidy frame for plotting.

    Returns:
        ``label`` plus the mean ``select_ms``, ``shift_ms``, ``refresh_ms``, ``answer_ms`` and ``latency_ms``
        per condition (the columns :func:`sur_lab.analysis.plotting.plot_latency_breakdown` reads).
    """
    return summary[["condition", *LATENCY_PARTS, "latency_ms"]].rename(columns={"condition": "label"})


def plot_quality_latency(summary: pd.DataFrame, *, title: str = "", em_col: str = "em_pct", ax=None):
    """Figure 4: EM (or another quality column) against mean post-edit latency.

    Budgeted methods are drawn as one line per method through their budgets, with the marker size growing with the
    budget (small = 2 %, large = 5 %); reference operators are single labelled markers.

    Args:
        summary: output of :func:`quality_latency_table`.
        title: axes title.
        em_col: y column (``"em_pct"``, or ``"agree_pct"`` for agreement with Re-prefill).
        ax: axes to draw into (a new figure when ``None``).

    Returns:
        The matplotlib Figure.
    """

    if ax is None:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
    else:
        fig = ax.figure
    budgeted = summary[summary["budget_pct"].notna()]
    budgets = sorted(budgeted["budget_pct"].unique())
    size = {b: 30 + 70 * i for i, b in enumerate(budgets)}
    markers = "os^Dvp<>"
    for i, (method, g) in enumerate(budgeted.groupby("method", sort=False)):
        g = g.sort_values("budget_pct")
        ax.plot(g["latency_s"], g[em_col], color=f"C{i}", lw=1.2, zorder=2)
        ax.scatter(g["latency_s"], g[em_col], s=[size[b] for b in g["budget_pct"]], color=f"C{i}",
                   marker=markers[i % len(markers)], label=method, zorder=3, edgecolor="white")
    refs = summary[summary["budget_pct"].isna()]
    for j, row in enumerate(refs.itertuples()):
        ax.scatter(row.latency_s, getattr(row, em_col), s=70, marker="X", color="0.25" if j % 2 else "0.55",
                   zorder=3, edgecolor="white")
        ax.annotate(row.condition, (row.latency_s, getattr(row, em_col)), textcoords="offset points", xytext=(5, 4),
                    fontsize=8)
    values = summary[em_col].to_numpy(dtype=float)
    pad = max(2.0, 0.08 * float(values.max() - values.min()))
    # A flat panel (e.g. EM 0 for every method) would otherwise get a meaningless +-0.05 % axis.
    ax.set_ylim(float(values.min()) - pad, float(values.max()) + pad)
    ax.set_xlabel("mean post-edit latency (s), Eq. 20")
    ax.set_ylabel({"em_pct": "exact match (%)", "agree_pct": "agreement with Re-prefill (%)"}.get(em_col, em_col))
    if budgets:
        sizes = " < ".join(f"{b:g}%" for b in budgets)
        ax.legend(title=f"budget by marker size: {sizes}", fontsize=8, title_fontsize=8, loc="best")
    if title:
        ax.set_title(title, fontsize=10)
    return fig


# ---------------------------------------------------------------------------------------------------------------------
# Notebook 03's report: one function per table, figure or printout (issue 39)


def panel_table(cases: Sequence[PlacementCase], timed: Iterable[str] = ()) -> pd.DataFrame:
    """The panel, one row per placement case: its meta (``dataset``, ``source_id``, ``placement``, ...), ``timed``
    (its id is among ``timed``), ``p``, ``d``, ``S``, ``N`` (tokens before the deleted passage, of it, after it, of
    the dirty prompt), ``gold`` (answers joined by ``" | "``) and ``question``."""
    timed = set(timed)
    return pd.DataFrame([{**c.meta, "timed": c.case_id in timed, "p": c.edit.prefix_len, "d": c.edit.deleted_len,
                          "S": c.edit.suffix_len, "N": c.edit.num_tokens, "gold": " | ".join(c.example.answers),
                          "question": c.example.question} for c in cases])


def plot_figure4(summary: pd.DataFrame, *, title: str = ""):
    """Figure 4 in two panels: exact match and agreement with Re-prefill against mean post-edit latency
    (:func:`plot_quality_latency` of each), ``title`` above them. Returns the figure."""

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    plot_quality_latency(summary, em_col="em_pct", ax=axes[0], title="exact match")
    plot_quality_latency(summary, em_col="agree_pct", ax=axes[1], title="agreement with Re-prefill")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def table9(table: pd.DataFrame, references: Sequence[str], *, method: str = "SUR", n_boot: int = N_BOOT,
           seed: int = BOOTSTRAP_SEED) -> pd.DataFrame:
    """Table 9 on both endpoints: :func:`paired_difference_table` on EM against every reference (``metric``
    ``"EM"``), then on agreement with Re-prefill against every reference but Re-prefill (``"agreement"``)."""
    return pd.concat([
        paired_difference_table(table, method, references, n_boot=n_boot, seed=seed).assign(metric="EM"),
        paired_difference_table(table, method, [r for r in references if r != "Re-prefill"],
                                metric_col="agree_reprefill", n_boot=n_boot, seed=seed).assign(metric="agreement"),
    ], ignore_index=True)


def transitions(table: pd.DataFrame, reference: str = "Shift") -> pd.DataFrame:
    """:func:`transition_table` against ``reference`` on EM (``metric`` ``"EM"``) and on agreement with Re-prefill
    (``"agreement"``), stacked."""
    return pd.concat([transition_table(table, reference).assign(metric="EM"),
                      transition_table(table, reference, metric_col="agree_reprefill").assign(metric="agreement")],
                     ignore_index=True)


def plot_transitions(transitions: pd.DataFrame, reference: str = "Shift"):
    """The error transitions of :func:`transitions`, one panel per metric: repairs (reference wrong, condition right)
    to the right, regressions to the left, in % of cases. Returns the figure."""

    metrics = list(dict.fromkeys(transitions["metric"]))
    fig, axes = plt.subplots(1, len(metrics), figsize=(12, 0.4 * len(transitions) / 2 + 1.8), sharey=True,
                             squeeze=False)
    axes = axes[0]
    for ax, (metric, t) in zip(axes, transitions.groupby("metric", sort=False)):
        y = range(len(t))
        ax.barh(y, t.repairs_pct, color="C2", label=f"repairs ({reference} wrong, method right)")
        ax.barh(y, -t.regressions_pct, color="C3", label=f"regressions ({reference} right, method wrong)")
        ax.set_yticks(list(y), t.condition)
        span = max(5.0, float(t[["repairs_pct", "regressions_pct"]].to_numpy().max()) * 1.1)
        ax.set_xlim(-span, span)
        ax.axvline(0, color="0.3", lw=0.8)
        ax.set_xlabel("% of cases")
        ax.set_title(f"{metric} vs {reference}", fontsize=10)
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    return fig


def lead_of(summary: pd.DataFrame) -> tuple[str, float]:
    """The lead endpoint of a run: ``("EM", em)`` when Re-prefill's EM reaches
    :data:`sur_lab.studies.presets.EM_LEAD_MIN`, else ``("agreement", em)``; ``em`` is Re-prefill's EM as a fraction
    (NaN without a Re-prefill row) from :func:`quality_latency_table`."""
    by_cond = summary.set_index("condition")
    em = by_cond.loc["Re-prefill", "em_pct"] / 100 if "Re-prefill" in by_cond.index else float("nan")
    return ("EM" if lead_endpoint(em, em="EM", agreement="agreement") == "EM" else "agreement"), float(em)


def condition_lines(summary: pd.DataFrame) -> list[str]:
    """Each condition of :func:`quality_latency_table` in words: EM, agreement and mean post-edit latency over its
    timed cases."""
    return [f"  {r.condition:>14}: EM {r.em_pct:.1f} %, agreement {r.agree_pct:.1f} %, mean post-edit latency "
            f"{r.latency_s:.2f} s over {int(r.timed_cases)} timed case(s)" for r in summary.itertuples()]


def dataset_lines(by_dataset: pd.DataFrame, budgets: Sequence[float], *, lead: str = "EM",
                  method: str = "SUR", reference: str = "Shift") -> list[str]:
    """Per budget, the datasets on which ``method``'s point estimate lies above and below ``reference``'s
    (:func:`dataset_em_table` of the lead endpoint; point estimates, not tested per dataset). A budget without both
    rows gives no line."""
    per = by_dataset.set_index("condition").drop(columns=["Pooled", "cases"], errors="ignore")
    lines = []
    for b in budgets:
        cond = condition_label(method, float(b))
        if cond not in per.index or reference not in per.index:
            continue
        mine, ref = per.loc[cond], per.loc[reference]
        above = [d for d in per.columns if mine[d] > ref[d]]
        below = [d for d in per.columns if mine[d] < ref[d]]
        lines.append(f"  by dataset at {float(b):g}% ({lead}, point estimates, not tested per dataset): {method} above "
                     f"{reference} on {', '.join(above) or 'none'}; below {reference} on {', '.join(below) or 'none'}")
    return lines
