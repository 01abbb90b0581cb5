"""Words for a notebook's generated conclusion: who wins, who loses, and which differences are null.

A notebook's conclusion prints its numbers from this run's tables (never typed into markdown, issue 29). The study
notebooks (02, 03, 06) compare arms by paired differences with percentile bootstrap intervals (appendix 8.3); these
functions turn one such difference into a sentence that says plainly which arm is better, which is worse, or that
the interval does not separate them (a null result at this sample size, reported as such, never dropped), and run
the paired comparison of one arm against several rivals at each budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

#: Verdict of :func:`verdict`: the interval lies above 0.
HIGHER = "higher"
#: Verdict of :func:`verdict`: the interval lies below 0.
LOWER = "lower"
#: Verdict of :func:`verdict`: the interval contains or touches 0 (a null result at this sample size).
NOT_SEPARATED = "not separated"
#: Fewest paired units (cases, sources) on which a difference may separate. Below six, even pairs that all differ in
#: the same direction cannot reach two-sided 5 % significance (sign test: 2 * 0.5**5 = 0.0625), and the percentile
#: bootstrap's interval over so few units is degenerate (one case gives ``[d, d]``), so it is never read as a result.
MIN_PAIRED_UNITS = 6


def separates(low: float, high: float, n: int | None = None) -> bool:
    """Whether an interval ``[low, high]`` of a paired difference excludes 0 on enough paired units: ``low > 0`` or
    ``high < 0``, and ``n >= MIN_PAIRED_UNITS`` when ``n`` is given (NaN endpoints never separate)."""
    if n is not None and int(n) < MIN_PAIRED_UNITS:
        return False
    low, high = float(low), float(high)
    return bool(low > 0 or high < 0)


def verdict(diff: float, low: float, high: float, n: int | None = None) -> str:
    """Whether a paired difference ``a - b`` separates from 0.

    Args:
        diff: the observed difference (any unit).
        low, high: its interval's endpoints, ``low <= diff <= high`` up to rounding.
        n: the number of paired units behind it (optional); fewer than :data:`MIN_PAIRED_UNITS` never separate.

    Returns:
        :data:`HIGHER` when the interval lies above 0 (``low > 0``), :data:`LOWER` when below (``high < 0``), else
        :data:`NOT_SEPARATED` (the interval contains or touches 0, or ``n`` is too small).

    Raises:
        ValueError: naming ``diff``, ``low`` or ``high`` when it is NaN, or ``low`` when ``low > high``.
    """
    for name, value in (("diff", diff), ("low", low), ("high", high)):
        if value is None or math.isnan(float(value)):
            raise ValueError(f"{name}={value!r} must be a number, not NaN")
    if float(low) > float(high):
        raise ValueError(f"low={low!r} must be <= high={high!r}")
    if not separates(low, high, n):
        return NOT_SEPARATED
    if float(low) > 0:
        return HIGHER
    if float(high) < 0:
        return LOWER
    return NOT_SEPARATED


def difference_sentence(a: str, b: str, diff: float, low: float, high: float, *, unit: str = "pp",
                        n: int | None = None, what: str = "cases", higher_is_better: bool = True,
                        ci: float = 95.0, digits: int = 1) -> str:
    """One paired difference ``a - b`` in words: who wins, who loses, or that the interval does not separate them.

    Example: ``"SUR 5% beats Shift: +12.5 pp (95 % CI +4.2 to +20.8; 24 cases)"``, ``"SUR 5% loses to Re-prefill:
    -29.2 pp (...)"``, ``"SUR 5% vs Shift: not separated, +4.2 pp (...), a null result at this size"``.

    Args:
        a, b: the two arms' labels (the difference is a minus b).
        diff, low, high: the difference and its interval (as :func:`verdict`).
        unit: the difference's unit, printed after each number ("pp", "ms", "" for none).
        n: the number of paired units (cases, sources), printed with ``what`` when given.
        what: what ``n`` counts.
        higher_is_better: False for endpoints where lower is better (first-token TV, NLL, latency).
        ci: the interval's coverage, in %, for the label.
        digits: decimals of the printed numbers (>= 0).

    Returns:
        The sentence, without a final period.

    Raises:
        ValueError: as :func:`verdict`; naming ``digits`` when negative.
    """
    if digits < 0:
        raise ValueError(f"digits={digits!r} must be >= 0")
    v = verdict(diff, low, high, n)
    u = f" {unit}" if unit else ""
    size = f"; {n} {what}" if n is not None else ""
    numbers = f"{diff:+.{digits}f}{u} ({ci:g} % CI {low:+.{digits}f} to {high:+.{digits}f}{size})"
    if n is not None and int(n) < MIN_PAIRED_UNITS:
        return (f"{a} vs {b}: not separated, {numbers}: fewer than {MIN_PAIRED_UNITS} {what} cannot separate "
                "(a smoke-sized run)")
    if v == NOT_SEPARATED:
        return f"{a} vs {b}: not separated, {numbers}, a null result at this size"
    better = (v == HIGHER) == higher_is_better
    return f"{a} {'beats' if better else 'loses to'} {b}: {numbers}"


def against_rivals(records: pd.DataFrame, focus: str, rivals: Sequence[str], metric: str, *,
                   case_col: str = "case_id", strata_col: str = "context_len", method_col: str = "method",
                   budget_col: str = "budget_pct", n_boot: int = 10_000, seed: int = 20260928,
                   ci: float = 95.0) -> pd.DataFrame:
    """Paired bootstrap of one budgeted arm against each rival at the same budget, on the same cases.

    For each budget of ``focus`` and each rival with records at that budget, the rows of both on their shared cases
    go to :func:`sur_lab.analysis.stats.paired_bootstrap` (cases resampled within each ``strata_col`` value; the
    percentile interval of appendix 8.3).

    Args:
        records: one row per (case, method, budget); references (no budget) are ignored.
        focus: the method compared (e.g. ``"SUR"``).
        rivals: the other budgeted methods; those absent, or equal to ``focus``, are skipped.
        metric: a numeric or 0/1 column; differences of 0/1 metrics are reported ×100 (pp) like every other
            column of the output, so pass ``em`` or ``agree_reprefill`` as they are.
        case_col, strata_col, method_col, budget_col: the columns naming the case, its stratum, the method and
            the budget (%).
        n_boot, seed, ci: as :func:`~sur_lab.analysis.stats.paired_bootstrap`.

    Returns:
        One row per (budget_pct, rival): ``focus``, ``rival``, ``budget_pct``, ``diff_pp``, ``ci_low_pp``,
        ``ci_high_pp`` (focus minus rival, ×100), ``n_cases`` and ``verdict`` (:func:`verdict` of focus minus rival).

    Raises:
        ValueError: naming ``metric`` or a column argument when it is not a column of ``records``, ``focus`` when it
            has no budgeted records; as ``paired_bootstrap`` otherwise.
    """
    from sur_lab.analysis.stats import paired_bootstrap

    for name, col in (("metric", metric), ("case_col", case_col), ("strata_col", strata_col),
                      ("method_col", method_col), ("budget_col", budget_col)):
        if col not in records.columns:
            raise ValueError(f"{name}={col!r} is not a column; columns: {', '.join(map(str, records.columns))}")
    budgeted = records[records[budget_col].notna()]
    mine = budgeted[budgeted[method_col] == focus]
    if mine.empty:
        raise ValueError(f"focus={focus!r} has no budgeted records; methods: "
                         f"{', '.join(dict.fromkeys(budgeted[method_col]))}")
    rows = []
    for budget in sorted(mine[budget_col].unique()):
        a = mine[mine[budget_col] == budget]
        for rival in dict.fromkeys(rivals):
            b = budgeted[(budgeted[method_col] == rival) & (budgeted[budget_col] == budget)]
            if rival == focus or b.empty:
                continue
            shared = set(a[case_col]) & set(b[case_col])
            pair = pd.concat([a[a[case_col].isin(shared)], b[b[case_col].isin(shared)]])
            pair = pair.assign(**{metric: pair[metric].astype(float)})
            res = paired_bootstrap(pair, metric_col=metric, method_a=focus, method_b=rival, source_col=case_col,
                                   strata_col=strata_col, method_col=method_col, n_boot=n_boot, seed=seed, ci=ci)
            rows.append({"focus": focus, "rival": rival, "budget_pct": float(budget), "diff_pp": 100 * res.diff,
                         "ci_low_pp": 100 * res.low, "ci_high_pp": 100 * res.high, "n_cases": res.n_sources,
                         "verdict": verdict(res.diff, res.low, res.high, res.n_sources)})
    return pd.DataFrame(rows, columns=["focus", "rival", "budget_pct", "diff_pp", "ci_low_pp", "ci_high_pp",
                                       "n_cases", "verdict"])


def arm_labels(records: pd.DataFrame, *, method_col: str = "method", budget_col: str = "budget_pct") -> pd.Series:
    """A label per record: the method, with its budget for budgeted methods (``"SUR 5%"``); a reference (budget
    NaN) keeps its name (``"Erratum"``)."""
    return pd.Series([m if pd.isna(b) else f"{m} {b:g}%" for m, b in zip(records[method_col], records[budget_col])],
                     index=records.index, dtype=object)


def arm_differences(records: pd.DataFrame, *, metrics: Sequence[str], compared: Sequence[str],
                    baselines: Sequence[str] = ("Shift", "Re-prefill"), strata_col: str = "context_len",
                    case_col: str = "case_id", scale: float = 100.0, n_boot: int = 10_000, seed: int = 20260928,
                    ci: float = 95.0) -> pd.DataFrame:
    """Case-paired bootstrap differences of several arms against each other and against baseline references, at
    each budget, times ``scale`` (percentage points by default; percentile intervals of appendix 8.3: 10,000 replicates, seed 20260928; cases
    resampled within each ``strata_col`` value).

    At budget b the arms are each budgeted method of ``compared`` at b and the unbudgeted ones (a reference operator
    such as Erratum, whose records have budget NaN); every pair of them is compared once (``a`` minus ``b`` in
    ``compared`` order), and each budgeted arm against each baseline (``a`` minus the baseline). An unbudgeted arm
    is compared with the baselines once, with budget NaN. A metric's NaN rows are left out of its comparisons (e.g.
    a stale rate on cases without a stale value), so ``n_cases`` may differ by metric.

    Args:
        records: one row per (case, method, budget) with ``method``, ``budget_pct`` (NaN for references),
            ``case_col``, ``strata_col`` and the metrics.
        metrics: 0/1 or numeric record columns (``"em"``, ``"agree_reprefill"``, ``"stale"``, ``"gold_margin"``).
        compared: the arms' method names, budgeted or not; those absent from ``records`` are skipped.
        baselines: reference methods each arm is compared with; those absent are skipped.
        strata_col, case_col: the columns naming a case's stratum and the case.
        scale: the differences' multiplier: 100 (default) turns 0/1 metrics into percentage points; 1 keeps a metric
            in its own unit (the gold margin in logits), the ``_pp`` columns then holding that unit. > 0.
        n_boot, seed, ci: as :func:`sur_lab.analysis.stats.paired_bootstrap`.

    Returns:
        One row per (metric, budget_pct, a, b): ``diff_pp``, ``ci_low_pp``, ``ci_high_pp`` (times ``scale``),
        ``n_cases``, ``separates`` (the interval excludes 0), ``kind`` (``"arms"`` or ``"baseline"``).

    Raises:
        ValueError: naming ``metrics`` when a metric is not a column, ``strata_col`` or ``case_col`` when not a
            column, ``scale`` when not > 0; as :func:`sur_lab.analysis.stats.paired_bootstrap` otherwise.
    """
    from sur_lab.analysis.stats import paired_bootstrap

    bad = [m for m in metrics if m not in records.columns]
    if bad:
        raise ValueError(f"metrics {bad} are not record columns")
    for name, col in (("strata_col", strata_col), ("case_col", case_col)):
        if col not in records.columns:
            raise ValueError(f"{name}={col!r} is not a record column")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r} must be a finite number > 0")
    df = records.assign(arm=arm_labels(records))
    present = set(df["method"])
    budgets = sorted(df.loc[df["budget_pct"].notna() & df["method"].isin(compared), "budget_pct"].unique())
    rows = []
    for metric in metrics:
        sub = df[df[metric].notna()]
        budgeted = set(sub.loc[sub["budget_pct"].notna(), "method"])
        fixed = [m for m in compared if m in present and m not in budgeted and m in set(sub["arm"])]
        bases = [base for base in baselines if base in set(sub["arm"])]
        grid = [(float("nan"), [(x, base, "baseline") for x in fixed for base in bases])]
        for b in budgets:
            arms = [m if m not in budgeted else f"{m} {b:g}%" for m in compared if m in present]
            arms = [a for a in arms if a in set(sub["arm"])]
            pairs = [(x, y, "arms") for i, x in enumerate(arms) for y in arms[i + 1:]]
            pairs += [(x, base, "baseline") for x in arms if x not in fixed for base in bases]
            grid.append((b, pairs))
        for b, pairs in grid:
            for x, y, kind in pairs:
                cases_ = set(sub.loc[sub["arm"] == x, case_col]) & set(sub.loc[sub["arm"] == y, case_col])
                pair = sub[sub["arm"].isin([x, y]) & sub[case_col].isin(cases_)]
                if pair.empty:
                    continue
                res = paired_bootstrap(pair, metric_col=metric, method_a=x, method_b=y, source_col=case_col,
                                       strata_col=strata_col, method_col="arm", n_boot=n_boot, seed=seed, ci=ci)
                rows.append({"metric": metric, "budget_pct": float(b), "a": x, "b": y, "kind": kind,
                             "diff_pp": scale * res.diff, "ci_low_pp": scale * res.low,
                             "ci_high_pp": scale * res.high, "n_cases": res.n_sources,
                             "separates": separates(res.low, res.high, res.n_sources)})
    return pd.DataFrame(rows, columns=["metric", "budget_pct", "a", "b", "kind", "diff_pp", "ci_low_pp",
                                       "ci_high_pp", "n_cases", "separates"])
