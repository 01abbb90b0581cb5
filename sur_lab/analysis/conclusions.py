"""Inputs of a notebook's generated conclusion: arm labels, and the paired outcomes of declared comparisons.

A notebook's conclusion prints its numbers from this run's tables (never typed into markdown, issue 29), and its words
from :mod:`sur_lab.analysis.decisions` (issue 36): this module only turns long record tables into the aligned
per-case outcomes a family of comparisons needs (:func:`paired_outcomes`), so every study builds them the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd


def arm_labels(records: pd.DataFrame, *, method_col: str = "method", budget_col: str = "budget_pct") -> pd.Series:
    """A label per record: the method, with its budget for budgeted methods (``"SUR 5%"``); a reference (budget
    NaN) keeps its name (``"Erratum"``)."""
    return pd.Series([m if pd.isna(b) else f"{m} {b:g}%" for m, b in zip(records[method_col], records[budget_col])],
                     index=records.index, dtype=object)


def paired_outcomes(records: pd.DataFrame, pairs: Sequence[tuple[str, str]], metric: str, *, arm_col: str = "arm",
                    case_col: str = "case_id", cluster_col: str | None = None
                    ) -> tuple[dict[tuple[str, str], tuple[np.ndarray, np.ndarray]], dict[tuple[str, str], np.ndarray]]:
    """The aligned per-case outcomes of each ``(a, b)`` arm pair, for :func:`sur_lab.analysis.decisions.paired_family`.

    Args:
        records: one row per (case, arm), with ``arm_col``, ``case_col`` and ``metric`` (a 0/1, bool or numeric
            column; NaN where the endpoint is undefined on a case, e.g. a stale rate on a case without a stale value:
            :func:`~sur_lab.analysis.decisions.paired_family` leaves such units out).
        pairs: the comparisons, ``(a, b)`` arm labels; a pair whose arm has no record is skipped (it did not run).
        metric: the compared column.
        arm_col, case_col: the columns naming the arm (:func:`arm_labels`) and the paired unit.
        cluster_col: a column naming the unit's cluster (a source whose placements are cases); ``None``: none.

    Returns:
        ``(outcomes, clusters)``: ``{(a, b): (a_values, b_values)}`` float64 arrays over the cases of ``a`` (which
        ``b`` must cover; ``b``'s other cases are left out), sorted by case, and ``{(a, b): cluster ids}`` of those
        cases (empty without ``cluster_col``).

    Raises:
        ValueError: naming ``metric``, ``arm_col``, ``case_col`` or ``cluster_col`` when it is not a column, or
            ``records`` when an arm has several rows for one case or a case of ``a`` lacks ``b``'s row.
    """
    for name, col in (("metric", metric), ("arm_col", arm_col), ("case_col", case_col), ("cluster_col", cluster_col)):
        if col is not None and col not in records.columns:
            raise ValueError(f"{name}={col!r} is not a column; columns: {', '.join(map(str, records.columns))}")
    present = set(records[arm_col])
    by_arm: dict[str, pd.DataFrame] = {}
    outcomes, clusters = {}, {}
    for a, b in pairs:
        if a not in present or b not in present:
            continue
        for arm in (a, b):
            if arm not in by_arm:
                rows = records[records[arm_col] == arm].set_index(case_col)
                if not rows.index.is_unique:
                    raise ValueError(f"records: arm {arm!r} has several rows for one {case_col}")
                by_arm[arm] = rows
        unpaired = by_arm[a].index.difference(by_arm[b].index)
        if len(unpaired):
            raise ValueError(f"records: {case_col} {unpaired[0]!r} of arm {a!r} lacks rows for arm {b!r} (an unpaired "
                             "case; the first arm of a pair defines the cases)")
        shared = by_arm[a].index.sort_values()
        values = [by_arm[arm].loc[shared, metric].astype(np.float64).to_numpy() for arm in (a, b)]
        outcomes[(a, b)] = (values[0], values[1])
        if cluster_col is not None:
            clusters[(a, b)] = by_arm[a].loc[shared, cluster_col].astype(str).to_numpy()
    return outcomes, clusters
