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


def verdict(diff: float, low: float, high: float) -> str:
    """Whether a paired difference ``a - b`` separates from 0.

    Args:
        diff: the observed difference (any unit).
        low, high: its interval's endpoints, ``low <= diff <= high`` up to rounding.

    Returns:
        :data:`HIGHER` when the interval lies above 0 (``low > 0``), :data:`LOWER` when below (``high < 0``), else
        :data:`NOT_SEPARATED` (the interval contains or touches 0).

    Raises:
        ValueError: naming ``diff``, ``low`` or ``high`` when it is NaN, or ``low`` when ``low > high``.
    """
    for name, value in (("diff", diff), ("low", low), ("high", high)):
        if value is None or math.isnan(float(value)):
            raise ValueError(f"{name}={value!r} must be a number, not NaN")
    if float(low) > float(high):
        raise ValueError(f"low={low!r} must be <= high={high!r}")
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
    v = verdict(diff, low, high)
    u = f" {unit}" if unit else ""
    size = f"; {n} {what}" if n is not None else ""
    numbers = f"{diff:+.{digits}f}{u} ({ci:g} % CI {low:+.{digits}f} to {high:+.{digits}f}{size})"
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
                         "verdict": verdict(res.diff, res.low, res.high)})
    return pd.DataFrame(rows, columns=["focus", "rival", "budget_pct", "diff_pp", "ci_low_pp", "ci_high_pp",
                                       "n_cases", "verdict"])
