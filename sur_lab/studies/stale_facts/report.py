"""The stale-facts study's report: the study's endpoints on its records (:func:`add_stale_endpoints`: answer class,
stale answer, margin recovery), the summary (:func:`summary_table`), the declared comparisons
(:func:`family_pairs`, :func:`paired_differences`), the descriptive gold-margin and old-value-pull intervals
(:func:`margin_differences`, :func:`old_margin_differences`), the stale rates per family (:func:`stale_rates`,
:func:`stale_rate_lines`), strata (:func:`stratified_table`), the generated conclusion (:func:`conclusion`) and the
summary figure (:func:`plot_summary`).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from sur_lab.analysis.conclusions import arm_labels, paired_outcomes
from sur_lab.analysis.decisions import (
    BEATS,
    COLUMNS,
    DIFF_COLUMNS,
    LOSES,
    Family,
    best_of,
    bound_claim,
    family_lines,
    in_units,
    paired_family,
    proportion_interval,
)
from sur_lab.analysis.endpoints import add_margin_recovery, margin_recovery_table
from sur_lab.studies.stale_facts.cases import classify_answer
from sur_lab.studies.stale_facts.design import (
    COMPARED,
    EM_FAMILY,
    LATE,
    MARGIN_ARMS,
    PLACEMENT_FAMILY,
    PRIMARY,
    PRIMARY_BUDGET,
    PULL_ARMS,
    STALE_FAMILY,
    STALE_REACH,
    STUDY_ALLOCATORS,
    STUDY_REFERENCES,
)

__all__ = ["add_stale_endpoints", "summary_table", "family_pairs", "paired_differences", "margin_differences",
    "stale_rates", "stale_rate_lines", "old_margin_differences", "stratified_table", "conclusion", "plot_summary"]


def add_stale_endpoints(records: pd.DataFrame) -> pd.DataFrame:
    """Records with the study's endpoints added (a new DataFrame): ``answer_class`` (:func:`classify_answer` of each
    record's answer with its case's values, read from the meta columns ``gold_value``, ``stale_value`` and
    ``distractor_values``), ``stale`` (float: 1.0 when the answer gives the superseded value; NaN for a query about
    an untouched key, which has no stale value) and ``margin_recovery``
    (:func:`sur_lab.analysis.endpoints.add_margin_recovery`: NaN where undefined).

    Raises:
        ValueError: naming ``records`` when a meta column or a case's Shift or Re-prefill record is missing.
    """
    missing = [c for c in ("answer", "gold_value", "stale_value", "distractor_values", "gold_margin")
               if c not in records.columns]
    if missing:
        raise ValueError(f"records lack the columns {missing} (stale-fact sweep records carry them)")
    classes = [
        classify_answer(a, g, s or None, tuple(v for v in str(d).split(",") if v))
        for a, g, s, d in zip(records["answer"], records["gold_value"], records["stale_value"].fillna(""),
                              records["distractor_values"].fillna(""))
    ]
    asks_old = records["stale_value"].fillna("").astype(str) != ""
    stale = np.where(asks_old, [float(c == "stale") for c in classes], np.nan)
    return add_margin_recovery(records.assign(answer_class=classes, stale=stale))


def _arm(records: pd.DataFrame) -> pd.Series:
    """A label per record: the method, with its budget for budgeted methods (``"SUR 5%"``;
    :func:`sur_lab.analysis.conclusions.arm_labels`)."""
    return arm_labels(records)


def summary_table(records: pd.DataFrame) -> pd.DataFrame:
    """One row per (method, budget): EM %, stale-answer rate % (over the cases asking the edited key), agreement
    with Re-prefill %, the margin recovery as a ratio of sums (``margin_recovery``, NaN when undefined, with the reason
    in ``margin_recovery_note``: :func:`sur_lab.analysis.endpoints.pooled_margin_recovery`) and, secondary, the
    median of the defined per-case ratios with their count, mean first-token TV to Re-prefill, mean forward tokens
    of the repair (``allowance + note_tokens``: suffix rows recomputed, or the Erratum note) and median refresh time
    (ms); references (budget NaN) first, then the allocators by budget.

    Args:
        records: :func:`add_stale_endpoints` records.
    """
    df = records.assign(_cost=records["allowance"] + records["note_tokens"], _em=records["em"].astype(float),
                        _agree=records["agree_reprefill"].astype(float))
    g = df.groupby(["method", "budget_pct"], dropna=False, sort=False)
    out = g.agg(n=("case_id", "size"), em_pct=("_em", "mean"), stale_pct=("stale", "mean"),
                n_stale_cases=("stale", "count"), agree_pct=("_agree", "mean"),
                margin_recovery_median=("margin_recovery", "median"), n_margin_defined=("margin_recovery", "count"),
                gold_margin_median=("gold_margin", "median"), tv_reprefill=("tv_reprefill", "mean"),
                forward_tokens=("_cost", "mean"), refresh_ms=("refresh_ms", "median")).reset_index()
    for col in ("em_pct", "stale_pct", "agree_pct"):
        out[col] = 100 * out[col]

    pooled = margin_recovery_table(records).reset_index()
    pooled = pooled.set_index([pooled["method"], pooled["budget_pct"].map(lambda b: "-" if pd.isna(b) else float(b))])
    keys = list(zip(out["method"], out["budget_pct"].map(lambda b: "-" if pd.isna(b) else float(b))))
    at = out.columns.get_loc("margin_recovery_median")
    out.insert(at, "margin_recovery_note", [pooled.loc[k, "note"] for k in keys])
    out.insert(at, "margin_recovery", [float(pooled.loc[k, "ratio"]) for k in keys])
    refs = [m for m in (*STUDY_REFERENCES,) if m in set(out["method"])]
    order = {m: i for i, m in enumerate([*refs, *STUDY_ALLOCATORS])}
    out["_r"] = out["budget_pct"].notna().astype(int)
    out["_o"] = out["method"].map(order).fillna(len(order))
    return out.sort_values(["_r", "budget_pct", "_o"], na_position="first").drop(columns=["_r", "_o"]) \
        .reset_index(drop=True)


def family_pairs(records: pd.DataFrame, family: Family) -> list[tuple[str, str]]:
    """The comparisons ``(a, b)`` (arm labels: ``"SUR 5%"``, ``"Erratum"``, ``"Shift (late)"``) that ``family``
    (:data:`PRIMARY`, :data:`EM_FAMILY`, :data:`STALE_FAMILY` or :data:`PLACEMENT_FAMILY`) holds among the arms of
    ``records``.

    Raises:
        ValueError: naming ``family`` when it is not one of the three.
    """
    if family not in (PRIMARY, EM_FAMILY, STALE_FAMILY, PLACEMENT_FAMILY):
        raise ValueError(f"family={family.name!r}: family_pairs knows PRIMARY, EM_FAMILY, STALE_FAMILY and "
                         "PLACEMENT_FAMILY")
    arms = set(_arm(records))
    budgets = sorted(records.loc[records["budget_pct"].notna(), "budget_pct"].unique())
    budgeted = [m for m in COMPARED if m != "Erratum"]
    if family == PRIMARY:
        candidates = [(f"SUR {PRIMARY_BUDGET:g}%", "Shift")]
    elif family == PLACEMENT_FAMILY:
        candidates = [(m + LATE, "Erratum") for m in ("Re-prefill", "Shift")]
    elif family == EM_FAMILY:
        candidates = [(f"{m} {b:g}%", f"SUR {b:g}%") for b in budgets for m in budgeted if m != "SUR"]
        candidates += [("Erratum", f"SUR {b:g}%") for b in budgets]
    else:
        candidates = [(f"{m} {b:g}%", "Shift") for b in budgets for m in budgeted] + [("Erratum", "Shift")]
    return [p for p in candidates if p[0] in arms and p[1] in arms]


def paired_differences(records: pd.DataFrame, *, n_boot: int = 10_000, seed: int = 20260928,
                       decide: bool = True) -> pd.DataFrame:
    """The study's declared comparisons, decided (:func:`sur_lab.analysis.decisions.paired_family`): the primary
    (SUR at 5 % minus Shift on EM, tested alone), :data:`EM_FAMILY`, :data:`STALE_FAMILY` and, where the placement
    control ran, :data:`PLACEMENT_FAMILY` (Holm within each; its pairs cover the replacement cases).
    ``stale`` is compared on the cases that ask the edited key (the others have no stale value: NaN, left out); a
    lower stale rate is better, so a negative difference favours ``a``.

    Args:
        records: :func:`add_stale_endpoints` records.
        n_boot, seed: sign-flip resamples (unused by binary endpoints' exact tests) and generator seed.
        decide: ``False`` at a plumbing-check size (``decisions.decides(preset)``).

    Returns:
        :func:`~sur_lab.analysis.decisions.paired_family` rows of the three families with ``metric`` (``"em"`` or
        ``"stale"``) and ``budget_pct`` (of ``a``; NaN for Erratum), and the differences in points
        (:func:`sur_lab.analysis.decisions.in_units`: ``delta``, ``delta_low``, ``delta_high``, ``delta_mde``, ``unit``
        "pp").

    Raises:
        ValueError: naming ``records`` when a case lacks a compared arm's row.
    """
    df = records.assign(arm=_arm(records), _em=records["em"].astype(float), _stale=records["stale"].astype(float))
    budget_of = dict(zip(df["arm"], df["budget_pct"]))
    parts = []
    for fam, metric in ((PRIMARY, "em"), (EM_FAMILY, "em"), (STALE_FAMILY, "stale"), (PLACEMENT_FAMILY, "em")):
        pairs = family_pairs(df, fam)
        if not pairs:
            continue
        outcomes, _ = paired_outcomes(df, pairs, f"_{metric}")
        out = paired_family(outcomes, family=fam, n_boot=n_boot, seed=seed, decide=decide)
        parts.append(out.assign(metric=metric, budget_pct=[budget_of[a] for a in out["a"]]))
    if not parts:
        return pd.DataFrame(columns=[*COLUMNS, "metric", "budget_pct", *DIFF_COLUMNS])
    return in_units(pd.concat(parts, ignore_index=True))


def margin_differences(records: pd.DataFrame, *, arms: Sequence[str] = MARGIN_ARMS, by: str = "answer_in",
                       n_boot: int = 10_000, seed: int = 20260928) -> pd.DataFrame:
    """The edit-local claim on the gold answer's first-token margin (``gold_margin``, logits): each of ``arms``
    minus SUR at each budget, case-paired, within each value of ``by`` (where the answer-bearing text sits:
    ``"inserted"`` or ``"suffix"``). Descriptive: percentile bootstrap intervals
    (:func:`sur_lab.analysis.decisions.paired_family`) without a verdict, as the margin is not a declared family of
    the study.

    The margin is continuous where EM saturates, so it shows whether the window moves the answer toward Re-prefill's
    more than SUR does, and whether that fades when the answer sits downstream ("Contiguity, Not Importance").

    Args:
        records: :func:`add_stale_endpoints` records (``gold_margin`` defined).
        arms: budgeted methods compared with SUR.
        by: the record column whose values split the cases.
        n_boot, seed: bootstrap replicates (>= 100) and generator seed.

    Returns:
        One row per (``by`` value, budget_pct, a): ``b`` (SUR at that budget), ``delta``, ``delta_low``, ``delta_high``
        (a minus b, 95 %; a positive difference favours ``a``), ``unit`` ("logits"), ``n`` (cases): the schema of
        :func:`sur_lab.analysis.decisions.in_units`.

    Raises:
        ValueError: naming ``by`` when it is not a record column.
    """
    if by not in records.columns:
        raise ValueError(f"by={by!r} is not a record column")
    df = records.assign(arm=_arm(records), _m=records["gold_margin"].astype(float))
    budget_of = dict(zip(df["arm"], df["budget_pct"]))
    budgets = sorted(df.loc[df["method"] == "SUR", "budget_pct"].dropna().unique())
    cols = [by, "budget_pct", "a", "b", "delta", "delta_low", "delta_high", "unit", "n"]
    parts = []
    for value, sub in df.groupby(by, sort=True):
        pairs = [(f"{m} {b:g}%", f"SUR {b:g}%") for b in budgets for m in arms]
        outcomes, _ = paired_outcomes(sub, [p for p in pairs if p[0] in set(sub["arm"])], "_m")
        if not outcomes:
            continue
        res = in_units(paired_family(outcomes, kind="continuous", n_boot=n_boot, seed=seed, decide=False),
                       unit="logits")
        parts.append(res.assign(**{by: value, "budget_pct": [budget_of[a] for a in res["a"]]})[cols])
    return pd.concat(parts, ignore_index=True)[cols] if parts else pd.DataFrame(columns=cols)


def stale_rates(records: pd.DataFrame, *, arms: Sequence[str] = ("Shift", "Re-prefill", "Dirty", "Erratum",
                                                                "Shift" + LATE),
                decide: bool = True) -> pd.DataFrame:
    """Each arm's stale-answer rate per family with its exact interval, and whether the family shows stale answers:
    the design requirement of issue 40 (Shift must answer the old value where the answer-bearing states are stale).

    Args:
        records: :func:`add_stale_endpoints` records (``stale`` NaN where the query has no stale value).
        arms: arm labels (:func:`_arm`) to tabulate; absent ones are skipped.
        decide: ``False`` at a plumbing-check size (the claim column then reads "not decided").

    Returns:
        One row per (family, arm): ``k`` stale answers of ``n`` stale-eligible cases, ``rate``, ``ci_low``,
        ``ci_high`` (Clopper-Pearson 95 %, :func:`sur_lab.analysis.decisions.proportion_interval`) and ``claim``:
        :func:`sur_lab.analysis.decisions.bound_claim` of "at least :data:`STALE_REACH`" (its verdict word).
    """
    df = records.assign(arm=_arm(records))
    rows = []
    for family, sub in df.groupby("family", sort=False):
        for arm in arms:
            st = sub.loc[sub["arm"] == arm, "stale"].dropna()
            if st.empty:
                continue
            k, n = int(st.sum()), int(st.size)
            rate, low, high = proportion_interval(k, n)
            rows.append({"family": family, "arm": arm, "k": k, "n": n, "rate": rate, "ci_low": low, "ci_high": high,
                         "claim": bound_claim(k, n, at_least=STALE_REACH, decide=decide)})
    cols = ["family", "arm", "k", "n", "rate", "ci_low", "ci_high", "claim"]
    return pd.DataFrame(rows, columns=cols)


def stale_rate_lines(rates: pd.DataFrame, *, arm: str = "Shift") -> list[str]:
    """:func:`stale_rates` of ``arm`` in words, one line per family: ``"derived_record: Shift answers the old value
    in 0 of 16 stale-eligible cases (0 %, 95 % CI 0 % to 21 %): at least 5 % not shown"``."""
    out = []
    for r in rates[rates["arm"] == arm].itertuples():
        out.append(f"{r.family}: {arm} answers the old value in {r.k} of {r.n} stale-eligible case"
                   f"{'s' if r.n != 1 else ''} ({100 * r.rate:.0f} %, 95 % CI {100 * r.ci_low:.0f} % to "
                   f"{100 * r.ci_high:.0f} %): at least {100 * STALE_REACH:g} % {r.claim}")
    return out


def old_margin_differences(records: pd.DataFrame, *, arms: Sequence[str] = PULL_ARMS, n_boot: int = 10_000,
                           seed: int = 20260928) -> pd.DataFrame:
    """The old value's pull (``old_margin``: the old value's first-token logit minus the gold one's, logits) of each
    of ``arms`` minus Re-prefill's, case-paired within each family, over the stale-eligible cases. Descriptive:
    percentile bootstrap intervals (:func:`sur_lab.analysis.decisions.paired_family`, continuous) without a verdict.

    A positive difference means the arm's states pull toward the superseded value more than a clean prefill does,
    even where its greedy answer is right (the stale rate can be 0 while the pull is not). A placement-control arm
    (``"Shift (late)"``) is compared with its own layout's Re-prefill (``"Re-prefill (late)"``).

    Args:
        records: :func:`add_stale_endpoints` records with ``old_margin``.
        arms: arm labels; absent ones are skipped.
        n_boot, seed: bootstrap replicates and generator seed.

    Returns:
        One row per (family, a): ``b``, ``mean_a``, ``mean_b`` (mean pulls, logits), ``delta``, ``delta_low``,
        ``delta_high`` (a minus b, 95 %), ``unit`` ("logits"), ``n`` (cases): the schema of
        :func:`sur_lab.analysis.decisions.in_units`.

    Raises:
        ValueError: naming ``records`` when it has no ``old_margin`` column.
    """
    if "old_margin" not in records.columns:
        raise ValueError("records lack the column 'old_margin' (sweep records carry it since issue 40)")
    cols = ["family", "a", "b", "mean_a", "mean_b", "delta", "delta_low", "delta_high", "unit", "n"]
    eligible = records["stale_value"].fillna("").astype(str) != ""
    df = records[eligible].assign(arm=lambda d: _arm(d), _m=lambda d: d["old_margin"].astype(float))
    parts = []
    for family, sub in df.groupby("family", sort=False):
        present = set(sub["arm"])
        pairs = [(a, "Re-prefill" + LATE if a.endswith(LATE) else "Re-prefill") for a in arms]
        outcomes, _ = paired_outcomes(sub, [p for p in pairs if p[0] in present and p[1] in present], "_m")
        if not outcomes:
            continue
        res = in_units(paired_family(outcomes, kind="continuous", n_boot=n_boot, seed=seed, decide=False),
                       unit="logits")
        means = {pair: (float(np.nanmean(x)), float(np.nanmean(y))) for pair, (x, y) in outcomes.items()}
        parts.append(res.assign(family=family,
                                mean_a=[means[(a, b)][0] for a, b in zip(res["a"], res["b"])],
                                mean_b=[means[(a, b)][1] for a, b in zip(res["a"], res["b"])])[cols])
    return pd.concat(parts, ignore_index=True)[cols] if parts else pd.DataFrame(columns=cols)


def stratified_table(records: pd.DataFrame, by: str = "family", value: str = "em") -> pd.DataFrame:
    """Mean ``value`` (x100 for 0/1 columns) per arm (rows) and ``by`` stratum (columns): e.g. EM by family, or the
    stale rate by ``answer_in`` / ``distance`` (where the edit-local claim is said to fade). ``"margin_recovery"`` is
    pooled per cell as a ratio of sums (:func:`sur_lab.analysis.endpoints.margin_recovery_table`; NaN when
    undefined), not a mean of per-case ratios."""
    if value == "margin_recovery":
        t = margin_recovery_table(records.assign(arm=_arm(records)), by=("arm", by)).reset_index()
        return t.set_index(["arm", by])["ratio"].unstack(by).reindex(list(dict.fromkeys(t["arm"])))
    df = records.assign(arm=_arm(records), _v=records[value].astype(float))
    table = df.pivot_table(index="arm", columns=by, values="_v", aggfunc="mean", sort=False)
    return 100 * table if value in ("em", "stale", "agree_reprefill") else table


def conclusion(summary: pd.DataFrame, diffs: pd.DataFrame, *, model: str, n_cases: int,
               records: pd.DataFrame | None = None, margins: pd.DataFrame | None = None, by: str = "answer_in",
               decide: bool = True, rates: pd.DataFrame | None = None,
               pulls: pd.DataFrame | None = None) -> list[str]:
    """The generated conclusion, from this run's tables: the references' EM and stale rates, at each budget the
    compared arm with the highest EM (ties are ties, the selection named: :func:`sur_lab.analysis.decisions.best_of`
    on ``records``), the primary comparison and each declared family's comparisons in words
    (:func:`paired_differences`), where SUR loses (a "beats" against it), and with ``margins`` the descriptive
    gold-margin intervals.

    Args:
        summary: :func:`summary_table` of the run.
        diffs: :func:`paired_differences` of the run.
        model: the model's name; n_cases: cases in the run.
        records: the run's :func:`add_stale_endpoints` records (for the best-arm lines; without them those lines are
            left out).
        margins: :func:`margin_differences` of the run (optional); by: its split column.
        decide: as :func:`paired_differences` (the best-arm lines' comparisons).
        rates: :func:`stale_rates` of the run (optional): Shift's stale rate per family with its exact interval
            and the :data:`STALE_REACH` claim.
        pulls: :func:`old_margin_differences` of the run (optional): the old value's pull against Re-prefill.
    """
    lines = [f"This run: {model}; {n_cases} stale-fact cases."]
    s = summary.assign(arm=_arm(summary))
    ref = s[s["budget_pct"].isna()].set_index("method")

    def fmt(m: str) -> str:
        r = ref.loc[m]
        stale = "n/a (no stale-eligible case)" if pd.isna(r.stale_pct) else f"{r.stale_pct:.0f} %"
        return f"{m} EM {r.em_pct:.0f} % (stale {stale})"

    lines.append("References: " + "; ".join(fmt(m) for m in ref.index) + ".")
    if records is not None:
        df = records.assign(arm=_arm(records))
        for b in sorted(df.loc[df["budget_pct"].notna(), "budget_pct"].unique()):
            arms = [a for a in [*(f"{m} {b:g}%" for m in COMPARED if m != "Erratum"), "Erratum"] if a in set(df["arm"])]
            if not arms:
                continue
            wide = df[df["arm"].isin(arms)].pivot(index="case_id", columns="arm", values="em").astype(float)
            lines.append(f"At {b:g} %, EM: " + best_of({a: wide[a].to_numpy() for a in arms}, kind="binary",
                                                      what="compared arms", decide=decide) + ".")
    na = "no stale-eligible case"
    lines += family_lines(diffs, na=na)
    losses = []
    for _, r in diffs.iterrows():
        loser = r["b"] if r["verdict"] == BEATS else (r["a"] if r["verdict"] == LOSES else None)
        if loser is not None and str(loser).startswith(("SUR ", "SUR-IDF ")):
            losses.append(f"{loser} against {r['a'] if loser == r['b'] else r['b']} on {r['metric']}")
    lines.append("Where SUR loses (a separated verdict against it): "
                 + ("; ".join(losses) if losses else "nowhere in this run" if decide else
                    "not decided at this size (a plumbing check)") + ".")
    if rates is not None and len(rates):
        lines.append("Stale answers under Shift, per family (exact intervals): " + "; ".join(stale_rate_lines(rates))
                     + ".")
    if pulls is not None and len(pulls):
        for family, block in pulls.groupby("family", sort=False):
            lines.append(f"Old-value pull (old minus gold first-token logit, descriptive intervals), {family}: " + "; ".join(
                f"{r.a} minus {r.b} {r.delta:+.3g}" + (
                    f" (95 % CI {r.delta_low:+.3g} to {r.delta_high:+.3g}" if not pd.isna(r.delta_low)
                    else " (no interval") + f"; {r.n} case{'s' if r.n != 1 else ''})"
                for r in block.itertuples()) + ".")
    if margins is not None and len(margins):
        for value, block in margins.groupby(by, sort=True):
            lines.append(f"Gold margin (logits, descriptive intervals, not a declared family), answer in the {value} "
                         "text: " + "; ".join(
                             f"{r.a} minus {r.b} {r.delta:+.3g} (95 % CI {r.delta_low:+.3g} to "
                             f"{r.delta_high:+.3g}; {r.n} case{'s' if r.n != 1 else ''})"
                             if not pd.isna(r.delta_low) else
                             f"{r.a} minus {r.b} {r.delta:+.3g} (no interval; {r.n} case"
                             f"{'s' if r.n != 1 else ''})"
                             for r in block.itertuples()) + ".")
    return lines


def plot_summary(summary: pd.DataFrame):
    """Bars of EM, stale-answer rate (%) and margin recovery (a ratio of sums; no bar where undefined) per arm,
    references and each budget's allocators; returns the figure."""
    s = summary.assign(arm=_arm(summary))
    fig, axes = plt.subplots(1, 3, figsize=(15, 0.32 * len(s) + 1.8), sharey=True)
    titles = ["EM (%)", "stale answers (%)", "margin recovery, ratio of sums (0 = Shift, 1 = Re-prefill)"]
    for ax, col, title in zip(axes, ["em_pct", "stale_pct", "margin_recovery"], titles):
        colors = ["0.5" if pd.isna(b) else "tab:blue" for b in s["budget_pct"]]
        ax.barh(s["arm"], s[col] if col == "margin_recovery" else s[col].fillna(0.0), color=colors)
        ax.set_title(title)
        ax.invert_yaxis() if ax is axes[0] else None
    fig.tight_layout()
    return fig
