"""Notebook 02's tables and conclusion lines: Tables 2-6 (:func:`budget_table`, stacked across models by
:func:`stacked_budget_tables` over :func:`combine`), Table 12 (:func:`table12`, :func:`table12_concordance`), the
declared families decided (:func:`paired_differences`, :func:`decide_families`, :func:`ablation_table`) and the
generated conclusion (:func:`conclusion`), and the report's printouts (:func:`geometry_table`,
:func:`selection_cost`, :func:`reference_line`, :func:`concordance_line`). The figures are
:mod:`~sur_lab.studies.niah.figures`'s, Table 14 :mod:`~sur_lab.studies.niah.matched`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from sur_lab.analysis.conclusions import arm_labels, paired_outcomes
from sur_lab.analysis.decisions import (
    COLUMNS,
    DIFF_COLUMNS,
    Family,
    best_of,
    family_lines,
    in_units,
    kind_of,
    paired_family,
)
from sur_lab.repair import REFERENCE_METHODS as REFERENCES
from sur_lab.studies.niah.design import (
    ABLATION,
    ABLATION_FAMILY,
    ALL_AGAINST_REFERENCES,
    BEYOND,
    BEYOND_PAPER,
    FAMILY_BUDGETS,
    JOINT_ARM,
    PAPER_ALLOCATORS,
    PRIMARY,
    PRIMARY_BUDGET,
    RIVALS,
    SUR_FACTORS,
)
from sur_lab.sweeps.record import CONFIG_FIELDS, MODEL_FIELDS
from sur_lab.sweeps.store import read_records

__all__ = ["METRIC_UNITS", "ablation_factor", "ablation_table", "TABLE12_RULES", "PAPER_TABLE12", "paper_table12",
    "table12", "order_concordance", "table12_concordance", "budget_table", "paired_differences", "family_pairs",
    "decide_families", "conclusion", "combine", "stacked_budget_tables", "ENDPOINT_LABELS", "geometry_table",
    "selection_cost", "ablation", "reference_line", "concordance_line"]

def _decided(records: pd.DataFrame, pairs: Sequence[tuple[str, str]], metric: str, family: Family, *,
             decide: bool, n_boot: int, seed: int) -> pd.DataFrame:
    """:func:`sur_lab.analysis.decisions.paired_family` of ``pairs`` (arm labels, :func:`arm_labels`) on ``metric``,
    cases paired, with the differences in their printed unit (:func:`sur_lab.analysis.decisions.in_units`: ``delta``,
    ``delta_low``, ``delta_high``, ``delta_mde`` and ``unit``, "pp" for a 0/1 metric, :data:`METRIC_UNITS` else)."""
    df = records.assign(arm=arm_labels(records), _m=records[metric].astype(np.float64))
    outcomes, _ = paired_outcomes(df, pairs, "_m")
    if not outcomes:
        return pd.DataFrame(columns=[*COLUMNS, *DIFF_COLUMNS])
    kind = kind_of(df["_m"])
    if kind != family.kind:
        family = replace(family, kind=kind)
    out = paired_family(outcomes, family=family, n_boot=n_boot, seed=seed, decide=decide)
    return in_units(out, unit=METRIC_UNITS.get(metric, ""))


#: The printed unit of a continuous record field's paired difference (a 0/1 field's is "pp").
METRIC_UNITS = {"nll_reprefill": "nats", "gold_nll": "nats", "gold_margin": "logits", "tv_reprefill": "TV",
                "nr_tv": "NR_TV"}


# ---------------------------------------------------------------------------------------------------------------------
# SUR's design variants and the boundary controls, one factor at a time (appendix 9.3; issue 28)


def ablation_factor(method: str) -> tuple[str, str]:
    """``(factor, change)`` of an ablation method: a SUR factor (:data:`SUR_FACTORS`), appendix 9.3's joint arm, a
    boundary control (:data:`~sur_lab.studies.niah.design.BOUNDARY_CONTROLS`), or ``("other", method)``."""
    for factor, paper, changed, name in SUR_FACTORS:
        if method == name:
            return factor, f"{paper} -> {changed}"
    if method == JOINT_ARM:
        return "9.3 joint arm", "mean + prefix + prompt"
    if method == "Fixed blocks":
        return "boundaries", "text units -> equal token blocks"
    if method == "Multiple local windows":
        return "boundaries", "text units -> windows around top tokens"
    return "other", method


def ablation_table(records: pd.DataFrame, *, metric: str = "em", reference: str = "SUR",
                   methods: Sequence[str] | None = None, n_boot: int = 10_000, seed: int = 20260928,
                   decide: bool = True) -> pd.DataFrame:
    """SUR's variants and the boundary controls against SUR, one factor at a time, case-paired at each budget.

    Every method changes one thing from ``reference`` (:func:`ablation_factor`) and runs on the same cases at the
    same budget. The controls and every variant but the whole-prompt allowance select exactly SUR's B positions
    (matched token counts); ``mean_tokens`` beside ``reference_tokens`` shows where the count differs. The rows are
    the :data:`ABLATION_FAMILY` on ``metric``, decided together (:func:`sur_lab.analysis.decisions.paired_family`:
    Holm over every (method, budget) row).

    Args:
        records: :meth:`STUDY.sweep` records holding ``reference`` and the methods.
        metric: a 0/1 or numeric record field (differences of a 0/1 field ×100, pp).
        reference: the method every row is compared with (the paper's SUR).
        methods: the methods to compare (default: those of :data:`ABLATION` present, in that order).
        n_boot, seed, decide: as :func:`paired_differences`.

    Returns:
        One row per (method, budget): ``method``, ``factor``, ``change``, ``budget_pct``, ``mean_tokens``,
        ``reference_tokens``, ``mean_intervals``, ``value`` and ``reference_value`` (mean ×100), ``delta``,
        ``delta_low``, ``delta_high``, ``unit``, ``n`` (cases), ``p_adj``, ``verdict`` (method minus SUR), then every
        other column of :func:`sur_lab.analysis.decisions.paired_family` and
        :func:`~sur_lab.analysis.decisions.in_units` (for :func:`~sur_lab.analysis.decisions.sentence`).

    Raises:
        ValueError: naming ``metric`` when it is not a record field, ``reference`` when it has no records, or
            ``records`` when a case of a method lacks SUR's row.
    """
    if metric not in records.columns:
        raise ValueError(f"metric={metric!r} is not a record field")
    if not (records["method"] == reference).any():
        raise ValueError(f"reference={reference!r} has no records")
    present = set(records["method"])
    methods = [m for m in ABLATION if m in present] if methods is None else list(methods)
    cols = ["method", "factor", "change", "budget_pct", "mean_tokens", "reference_tokens", "mean_intervals", "value",
            "reference_value", "delta", "delta_low", "delta_high", "unit", "n", "p_adj", "verdict"]
    rows, pairs = [], []
    for method in methods:
        arm_all = records[records["method"] == method]
        for budget in sorted(arm_all["budget_pct"].dropna().unique()):
            arm = arm_all[arm_all["budget_pct"] == budget]
            ref = records[(records["method"] == reference) & (records["budget_pct"] == budget)]
            ref = ref[ref["case_id"].isin(arm["case_id"])]
            if ref.empty:
                continue
            factor, change = ablation_factor(method)
            rows.append({"method": method, "factor": factor, "change": change, "budget_pct": float(budget),
                         "mean_tokens": float(arm["allowance"].mean()), "reference_tokens": float(ref["allowance"]
                                                                                                   .mean()),
                         "mean_intervals": float(arm["num_intervals"].mean()),
                         "value": 100 * float(arm[metric].astype(float).mean()),
                         "reference_value": 100 * float(ref[metric].astype(float).mean())})
            pairs.append((f"{method} {budget:g}%", f"{reference} {budget:g}%"))
    table = pd.DataFrame(rows, columns=cols[:9])
    if not pairs:
        return table.reindex(columns=cols)
    res = _decided(records, pairs, metric, ABLATION_FAMILY, decide=decide, n_boot=n_boot, seed=seed)
    return pd.concat([table, res[cols[9:] + [c for c in res.columns if c not in cols]]], axis=1)


# ---------------------------------------------------------------------------------------------------------------------
# Table 12: allocation geometry at a fixed relevance score

#: Table 12's rows (paper label -> allocator name).
TABLE12_RULES = {
    "SUR": "SUR",
    "Same-score tokens": "Dense tokens",
    "Single relevance window": "Max-relevance contiguous",
    "Same-unit BM25": "BM25 (same units)",
    "Random units": "Random semantic units",
}
#: Table 12 as published: strict EM (%) on 96 cases per model at 2 % and 5 %, rows in :data:`TABLE12_RULES` order.
PAPER_TABLE12 = {
    "Qwen3-8B": ((89.6, 99.0), (7.3, 14.6), (75.0, 86.5), (82.3, 94.8), (2.1, 5.2)),
    "Qwen3-30B": ((95.8, 96.9), (89.6, 91.7), (84.4, 79.2), (90.6, 94.8), (16.7, 17.7)),
    "Llama-70B": ((90.6, 99.0), (7.3, 8.3), (65.6, 72.9), (75.0, 94.8), (2.1, 5.2)),
    "GLM-Air": ((100.0, 100.0), (43.8, 57.3), (89.6, 88.5), (94.8, 100.0), (18.8, 19.8)),
    "Qwen3-235B": ((97.9, 100.0), (83.3, 91.7), (72.9, 77.1), (99.0, 100.0), (78.1, 83.3)),
}


def paper_table12() -> "pd.DataFrame":
    """Table 12 as a DataFrame: rows are allocator names, columns ``(model, "2%"|"5%")``, values EM %."""
    cols = pd.MultiIndex.from_product([list(PAPER_TABLE12), ["2%", "5%"]], names=["model", "budget"])
    rows = [[PAPER_TABLE12[m][i][j] for m in PAPER_TABLE12 for j in range(2)] for i in range(len(TABLE12_RULES))]
    return pd.DataFrame(rows, index=list(TABLE12_RULES.values()), columns=cols)


def table12(
    records: "pd.DataFrame", value: str = "agree_reprefill", budgets: Sequence[float] = (2, 5)
) -> "pd.DataFrame":
    """Our Table 12: mean ``value`` (×100) of the five allocation rules at ``budgets``, rows in paper order.

    Raises:
        ValueError: naming ``records`` when a rule or budget is missing.
    """
    rows = list(TABLE12_RULES.values())
    df = records[records["method"].isin(rows) & records["budget_pct"].isin([float(b) for b in budgets])]
    table = df.assign(_v=df[value].astype(float) * 100).pivot_table(
        index="method", columns="budget_pct", values="_v", aggfunc="mean"
    )
    missing = [r for r in rows if r not in table.index] + [b for b in budgets if float(b) not in table.columns]
    if missing:
        raise ValueError(f"records lack {missing} for Table 12")
    table = table.loc[rows, [float(b) for b in budgets]]
    table.columns = [f"{b:g}%" for b in budgets]
    return table


def order_concordance(ours: Sequence[float], paper: Sequence[float]) -> tuple[int, int, int]:
    """Pairwise ordering agreement between two score lists over the same rules.

    Returns:
        ``(concordant, discordant, tied)`` rule pairs; a pair tied in either list counts as tied.

    Raises:
        ValueError: if the lengths differ.
    """
    if len(ours) != len(paper):
        raise ValueError(f"ours has {len(ours)} scores and paper {len(paper)}")
    con = dis = tie = 0
    for i in range(len(ours)):
        for j in range(i + 1, len(ours)):
            a, b = np.sign(ours[i] - ours[j]), np.sign(paper[i] - paper[j])
            if a == 0 or b == 0:
                tie += 1
            elif a == b:
                con += 1
            else:
                dis += 1
    return con, dis, tie


def table12_concordance(ours: "pd.DataFrame") -> "pd.DataFrame":
    """For each budget column of ``ours`` (from :func:`table12`) and each paper model: concordant / discordant / tied
    rule pairs against the published Table 12 (10 pairs of 5 rules)."""
    paper = paper_table12()
    rows = []
    for budget in ours.columns:
        for model in PAPER_TABLE12:
            con, dis, tie = order_concordance(ours[budget].tolist(), paper[(model, budget)].tolist())
            rows.append({"budget": budget, "paper_model": model, "concordant": con, "discordant": dis, "tied": tie})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------------------------------
# Tables (Tables 2-6) and the declared families' conclusion


def budget_table(records: pd.DataFrame, value: str = "agree_reprefill", *, scale: float = 100.0) -> pd.DataFrame:
    """Method × budget table of the mean of ``value`` (×``scale``), references in a ``"Reference"`` column
    (Tables 2–6).

    Rows follow :data:`REFERENCES` then :data:`PAPER_ALLOCATORS` order (others after), for the methods present.

    Raises:
        ValueError: if ``value`` is not a column of ``records``.
    """
    if value not in records.columns:
        raise ValueError(f"value={value!r} is not a record field; fields: {', '.join(records.columns)}")
    df = records.assign(_v=records[value].astype(float) * scale)
    is_ref = df["budget_pct"].isna()
    table = df[~is_ref].pivot_table(index="method", columns="budget_pct", values="_v", aggfunc="mean")
    table.columns = [f"{b:g}%" for b in table.columns]
    refs = df[is_ref].groupby("method")["_v"].mean().rename("Reference")
    table = pd.concat([refs, table], axis=1)
    order = [m for m in REFERENCES + PAPER_ALLOCATORS if m in table.index]
    order += [m for m in table.index if m not in order]
    return table.loc[order]


def paired_differences(
    records: pd.DataFrame,
    *,
    metric: str = "em",
    baselines: Sequence[str] = ("Shift", "Re-prefill"),
    methods: Sequence[str] | None = None,
    n_boot: int = 10_000,
    seed: int = 20260928,
    decide: bool = True,
) -> pd.DataFrame:
    """Each budgeted method minus each baseline reference, case-paired, in percentage points: the
    :data:`ALL_AGAINST_REFERENCES` family (the figure of notebook 02), decided together.

    Every (method, budget) row of ``records`` is compared with the same cases' rows of each baseline by
    :func:`sur_lab.analysis.decisions.paired_family` (a 0/1 metric: exact sign test on the discordant cases and
    Newcombe's interval; a numeric one: percentile bootstrap and sign-flip test), Holm over every row.

    Args:
        records: sweep records (one row per case × method × budget), with ``case_id``, ``method``, ``budget_pct``
            (NaN for references) and ``metric``.
        metric: a 0/1 or numeric record field (``"em"``, ``"agree_reprefill"``); 0/1 differences are ×100 (pp).
        baselines: reference methods to compare against, in this order; those absent from ``records`` are skipped.
        methods: budgeted methods to compare (default: all present, in record order).
        n_boot, seed: bootstrap replicates and sign-flip resamples (>= 100), generator seed.
        decide: ``False`` at a plumbing-check size (:func:`sur_lab.analysis.decisions.decides`).

    Returns:
        One row per (method, budget_pct, baseline): ``delta``, ``delta_low``, ``delta_high``, ``unit`` ("pp" for a
        0/1 metric), ``n`` (cases), ``p_adj``, ``verdict``, then every other column of
        :func:`sur_lab.analysis.decisions.paired_family` and :func:`~sur_lab.analysis.decisions.in_units`.

    Raises:
        ValueError: naming ``metric`` when it is not a record field, or ``records`` when a case of a method lacks
            the baseline's row.
    """
    if metric not in records.columns:
        raise ValueError(f"metric={metric!r} is not a record field; fields: {', '.join(records.columns)}")
    is_ref = records["budget_pct"].isna()
    budgeted = records[~is_ref]
    if methods is None:
        methods = list(dict.fromkeys(budgeted["method"]))
    bases = [base for base in baselines if (is_ref & (records["method"] == base)).any()]
    rows, pairs = [], []
    for method in methods:
        for budget in sorted(budgeted.loc[budgeted["method"] == method, "budget_pct"].unique()):
            for base in bases:
                rows.append({"method": method, "budget_pct": float(budget), "baseline": base})
                pairs.append((f"{method} {budget:g}%", base))
    cols = ["method", "budget_pct", "baseline", "delta", "delta_low", "delta_high", "unit", "n", "p_adj", "verdict"]
    table = pd.DataFrame(rows, columns=cols[:3])
    if not pairs:
        return table.reindex(columns=cols)
    res = _decided(records, pairs, metric, ALL_AGAINST_REFERENCES, decide=decide, n_boot=n_boot, seed=seed)
    return pd.concat([table, res[cols[3:] + [c for c in res.columns if c not in cols]]], axis=1)


def family_pairs(records: pd.DataFrame, family: Family, *, focus: str = "SUR") -> list[tuple[str, str]]:
    """The comparisons ``(a, b)`` (arm labels, :func:`sur_lab.analysis.conclusions.arm_labels`) that ``family``
    (:data:`PRIMARY`, :data:`RIVALS` or :data:`BEYOND`) holds in ``records``: its rule applied to the methods and
    budgets that ran (absent arms are left out).

    Raises:
        ValueError: naming ``family`` when it is not one of the three.
    """
    if family not in (PRIMARY, RIVALS, BEYOND):
        raise ValueError(f"family={family.name!r}: family_pairs knows PRIMARY, RIVALS and BEYOND")
    arms = set(arm_labels(records))
    budgets = sorted(records.loc[(records["method"] == focus) & records["budget_pct"].notna(), "budget_pct"].unique())
    budgets = [b for b in budgets if b in FAMILY_BUDGETS] or budgets
    primary = (f"{focus} {PRIMARY_BUDGET:g}%", "Shift")
    candidates = [primary] if family == PRIMARY else []
    for b in budgets if family != PRIMARY else ():
        at = f"{focus} {b:g}%"
        if family == RIVALS:
            candidates += [(at, r) for r in ("Shift", "Re-prefill") if (at, r) != primary]
            candidates += [(at, f"{m} {b:g}%") for m in PAPER_ALLOCATORS if m != focus]
        else:
            candidates += [(f"{m} {b:g}%" if m != "Erratum" else m, at) for m in BEYOND_PAPER]
    return [p for p in candidates if p[0] in arms and p[1] in arms]


def decide_families(records: pd.DataFrame, *, metric: str, decide: bool = True, n_boot: int = 10_000,
                    seed: int = 20260928) -> pd.DataFrame:
    """Notebook 02's primary comparison and its secondary families :data:`RIVALS` and :data:`BEYOND`, on ``metric``
    (the lead endpoint), each decided as declared (:func:`sur_lab.analysis.decisions.paired_family`; the ablation
    family is :func:`ablation_table`'s).

    Args:
        records: :meth:`STUDY.sweep` records.
        metric: the lead endpoint (a 0/1 record field).
        decide: ``False`` at a plumbing-check size (``decisions.decides(preset)``).
        n_boot, seed: as :func:`paired_differences`.

    Returns:
        :func:`sur_lab.analysis.decisions.paired_family` rows of the three families (``family`` names each), with
        the columns of :func:`sur_lab.analysis.decisions.in_units`.
    """
    parts = [_decided(records, pairs, metric, fam, decide=decide, n_boot=n_boot, seed=seed)
             for fam in (PRIMARY, RIVALS, BEYOND) if (pairs := family_pairs(records, fam))]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["family", "verdict"])


def conclusion(records: pd.DataFrame, decided: pd.DataFrame, *, metric: str, allocators: Sequence[str],
               decide: bool = True, n_boot: int = 10_000, seed: int = 20260928) -> list[str]:
    """The generated conclusion's verdict lines: at each budget the allocator with the highest point estimate on
    ``metric`` with the selection named (:func:`sur_lab.analysis.decisions.best_of`), then the primary comparison
    and every comparison of the secondary families (:func:`decide_families`), each naming its family and size.

    Args:
        records: :meth:`STUDY.sweep` records.
        decided: :func:`decide_families` of the same records.
        metric: the lead endpoint; allocators: the budgeted methods ranked (those that ran).
        decide, n_boot, seed: as :func:`decide_families`.
    """
    df = records.assign(arm=arm_labels(records))
    lines = []
    for b in sorted(records.loc[records["method"].isin(allocators), "budget_pct"].dropna().unique()):
        at = df[(df["budget_pct"] == b) & df["method"].isin(allocators)]
        wide = at.pivot(index="case_id", columns="method", values=metric).astype(float)
        lines.append(f"At {b:g} %: " + best_of({m: wide[m].to_numpy() for m in allocators if m in wide.columns},
                                                kind="binary", what="allocators", decide=decide, n_boot=n_boot,
                                                seed=seed))
    if decided.empty:
        return lines + ["No declared comparison ran (the primary needs SUR at 5 % and Shift)."]
    return lines + family_lines(decided)


# ---------------------------------------------------------------------------------------------------------------------
# Across models: Tables 2-6 stacked (issue 28)


def combine(folders: Sequence[Path | str]) -> pd.DataFrame:
    """The records of several NIAH sweep folders, one model each, as one table for the cross-model figure and tables.

    Each folder is read from its ``records.parquet`` (:func:`sur_lab.sweeps.store.read_records`). The folders must
    differ only in the model: every configuration fingerprint field outside :data:`~sur_lab.sweeps.record.MODEL_FIELDS` (seed, executor,
    decoding limit and rule, evaluation batch, allocator options, versions) must hold one value, the same in every
    folder, and the folders must hold the same case ids (the same roster, tokenized by each model: the case
    fingerprints differ) and the same (method, budget) grid, as every panel of Figure 3 uses the same cases and
    methods.

    Args:
        folders: two or more sweep folders (e.g. notebook 02's or ``sur-lab sweep niah``'s, one per model).

    Returns:
        The concatenated records, in folder order (the ``model`` column tells them apart).

    Raises:
        ValueError: naming ``folders`` when fewer than one is given or two name the same folder, a folder that holds
            more than one model or the same model as another, or a field whose value differs (the first differing
            field and the two folders), a case roster or method grid that differs.
        FileNotFoundError: for a folder without ``records.parquet`` (its sweep has not finished).
    """
    paths = [Path(f) for f in folders]
    if not paths:
        raise ValueError("folders is empty: give one sweep folder per model")
    if len({p.resolve() for p in paths}) != len(paths):
        raise ValueError(f"folders repeat a folder: {[str(p) for p in paths]}")
    frames = [read_records(p) for p in paths]
    shared = [f for f in CONFIG_FIELDS if f not in MODEL_FIELDS]
    first, first_path = frames[0], paths[0]
    seen_models: dict[str, Path] = {}
    for path, df in zip(paths, frames):
        models = sorted(set(df["model_weights"]))
        if len(models) != 1:
            raise ValueError(f"folders: {path} holds {len(models)} models ({sorted(set(df['model']))}); one per folder")
        if models[0] in seen_models:
            raise ValueError(f"folders: {path} and {seen_models[models[0]]} hold the same model "
                             f"({df['model'].iloc[0]})")
        seen_models[models[0]] = path
        for name in shared:
            values = sorted(set(map(str, df[name])))
            if len(values) != 1:
                raise ValueError(f"folders: {path} holds several values of {name!r} ({values})")
            ref = str(first[name].iloc[0])
            if values[0] != ref:
                raise ValueError(f"folders: {name!r} differs between {first_path} ({ref!r}) and {path} "
                                 f"({values[0]!r}); only the model ({', '.join(MODEL_FIELDS)}) may differ")
        if set(df["case_id"]) != set(first["case_id"]):
            raise ValueError(f"folders: {path} and {first_path} hold different cases; every panel needs the same "
                             "roster")
        grid = {(m, "ref" if pd.isna(b) else float(b)) for m, b in zip(df["method"], df["budget_pct"])}
        first_grid = {(m, "ref" if pd.isna(b) else float(b)) for m, b in zip(first["method"], first["budget_pct"])}
        if grid != first_grid:
            raise ValueError(f"folders: {path} and {first_path} hold different (method, budget) grids: "
                             f"{sorted(map(str, grid ^ first_grid))[:6]}")
    return pd.concat(frames, ignore_index=True)


def stacked_budget_tables(records: pd.DataFrame, value: str = "em", *, scale: float = 100.0) -> pd.DataFrame:
    """Tables 2-6 stacked: :func:`budget_table` per model, indexed by ``(model, method)`` in the models' order of
    appearance.

    Raises:
        ValueError: as :func:`budget_table`.
    """
    models = list(dict.fromkeys(records["model"]))
    return pd.concat({m: budget_table(records[records["model"] == m], value, scale=scale) for m in models},
                     names=["model", "method"])


# ---------------------------------------------------------------------------------------------------------------------
# Notebook 02's report: one function per table or printout (issue 39)

#: The endpoints' printed names in notebook 02's tables and figures.
ENDPOINT_LABELS = {"em": "strict EM (%)", "agree_reprefill": "agreement with Re-prefill (%)",
                   "tv_reprefill": "first-token TV to Re-prefill"}


def geometry_table(records: pd.DataFrame, budgets: Sequence[float]) -> pd.DataFrame:
    """Table 12 on four endpoints side by side: agreement and strict EM (%), mean first-token TV and mean interval
    count R of the five allocation rules at ``budgets`` (:func:`table12` of each).

    Returns:
        Rows are allocator names (paper order), columns ``(endpoint, "2%"|"5%")``: ``"agreement (%)"``, ``"strict EM
        (%)"``, ``"mean TV"``, ``"mean R"``.

    Raises:
        ValueError: as :func:`table12`.
    """
    return pd.concat({"agreement (%)": table12(records, "agree_reprefill", budgets),
                      "strict EM (%)": table12(records, "em", budgets),
                      "mean TV": table12(records, "tv_reprefill", budgets) / 100,
                      "mean R": table12(records, "num_intervals", budgets) / 100}, axis=1)


def selection_cost(records: pd.DataFrame, allocators: Sequence[str]) -> pd.DataFrame:
    """Support geometry and selection cost per allocator over its budgeted records: ``median_R`` (intervals),
    ``extra_forward_tokens`` (mean), ``extra_forward_layers`` (max), ``select_ms`` and ``refresh_ms`` (medians),
    ``median_nr_tv``, ``mean_nll`` (of Re-prefill's continuation, nats); one row per allocator in ``allocators``'
    order, ``method`` a column.

    Raises:
        ValueError: naming ``allocators`` when one has no budgeted record.
    """
    alloc = records[records["budget_pct"].notna()]
    missing = [m for m in allocators if m not in set(alloc["method"])]
    if missing:
        raise ValueError(f"allocators {missing} have no budgeted record")
    cost = alloc.groupby("method").agg(
        median_R=("num_intervals", "median"), extra_forward_tokens=("extra_forward_tokens", "mean"),
        extra_forward_layers=("extra_forward_layers", "max"), select_ms=("select_ms", "median"),
        refresh_ms=("refresh_ms", "median"), median_nr_tv=("nr_tv", "median"),
        mean_nll=("nll_reprefill", "mean")).loc[list(allocators)]
    return cost.reset_index()


def ablation(records: pd.DataFrame, *, metrics: Sequence[str], methods: Sequence[str], decide: bool = True,
             n_boot: int = 10_000, seed: int = 20260928) -> pd.DataFrame:
    """:func:`ablation_table` of each of ``metrics`` (duplicates dropped), stacked with a ``metric`` column: the
    ablation family decided per endpoint (Holm within each)."""
    return pd.concat([ablation_table(records, metric=m, methods=methods, decide=decide, n_boot=n_boot,
                                     seed=seed).assign(metric=m) for m in dict.fromkeys(metrics)],
                     ignore_index=True)


def reference_line(records: pd.DataFrame, references: Sequence[str], metric: str) -> str:
    """The references' mean ``metric`` (%) in words: ``"References (strict EM): Shift 40 %, Re-prefill 100 %."``"""
    label = ENDPOINT_LABELS.get(metric, metric).removesuffix(" (%)")
    refs = records[records["method"].isin(references)].groupby("method")[metric].mean().mul(100)
    return f"References ({label}): " + ", ".join(f"{m} {refs[m]:.0f} %" for m in references if m in refs) + "."


def concordance_line(concordance: pd.DataFrame) -> str:
    """:func:`table12_concordance` summed over the paper's models, per budget, in words."""
    c = concordance.groupby("budget")[["concordant", "discordant", "tied"]].sum()
    return ("Table 12 ordering against the paper's, pairs summed over its five models: " + "; ".join(
        f"{b}: {r.concordant} concordant, {r.discordant} discordant, {r.tied} tied" for b, r in c.iterrows()) + ".")
