"""Statistics: pooled EM, the source-paired bootstrap, error transitions (appendix 8), bootstrap p-values, Holm
correction and the factorial contrasts of the evidence-location experiment (Eq. 10-12, appendix 10.2).

Results are long tables (pandas DataFrames), one row per (method, case), where a case is one placement of one source
question: columns such as ``dataset``, ``source_id``, ``placement``, ``method``, ``correct`` and the extracted
``answer``. Placements of a source are not independent questions (appendix 7.5), so every interval here resamples
whole sources. ``docs/statistics.md`` states every definition in one place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from sur_lab.analysis.scoring import agreement
from sur_lab.checks import as_count

BOOTSTRAP_SEED = 20260928  # appendix 8.3
N_BOOT = 10_000  # appendix 8.3
CASE_COLS = ("dataset", "source_id", "placement")


@dataclass(frozen=True)
class BootstrapResult:
    """A paired difference ``method_a - method_b`` with its percentile bootstrap interval.

    Attributes:
        diff: observed difference of means over all paired rows, in the metric's units (for a 0/1 ``correct``
            column multiply by 100 for percentage points, as Table 9 reports).
        low, high: the interval's percentile endpoints (linear interpolation), same units.
        n_sources: number of distinct (stratum, source) pairs resampled.
        replicates: the ``n_boot`` replicate differences, shape (n_boot,), float64.
    """

    diff: float
    low: float
    high: float
    n_sources: int
    replicates: np.ndarray = field(repr=False, compare=False)

    @property
    def p_value(self) -> float:
        """Two-sided percentile-bootstrap p-value of ``diff = 0`` from the replicates (:func:`bootstrap_p_value`)."""
        return bootstrap_p_value(self.replicates)


def pooled_em(correct: Any) -> float:
    """Pooled exact match from unrounded correct counts (Eq. 9, appendix 8.2): ``100 * sum_d k_d / sum_d n_d``.

    Not a mean of per-dataset rounded percentages: rounding is for presentation only.

    Args:
        correct: either per-case outcomes (a sequence, numpy array or pandas Series of bools or 0/1), or a mapping
            ``{dataset: (k_d, n_d)}`` of correct counts and case counts.

    Returns:
        EM in percent (float, unrounded).

    Raises:
        ValueError: naming ``correct`` when it is empty, holds values other than 0/1, or a count pair has
            ``k_d < 0``, ``n_d < 0`` or ``k_d > n_d``.
    """
    if isinstance(correct, Mapping):
        k_total = n_total = 0
        for name, pair in correct.items():
            k, n = (int(v) for v in pair)
            if not 0 <= k <= n:
                raise ValueError(f"correct[{name!r}]=({k}, {n}) needs 0 <= k_d <= n_d")
            k_total += k
            n_total += n
    else:
        arr = np.asarray(correct, dtype=np.float64).reshape(-1)
        if not np.all((arr == 0) | (arr == 1)):
            raise ValueError("correct must hold only bools or 0/1 values")
        k_total, n_total = int(arr.sum()), arr.size
    if n_total == 0:
        raise ValueError("correct holds no cases")
    return 100.0 * k_total / n_total


def _draw_indices(sizes: Sequence[int], n_boot: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Resampled source indices, one (n_boot, n_d) int64 array per stratum, drawn in the order of ``sizes``.

    Each stratum's block is one ``rng.integers(0, n_d, size=(n_boot, n_d))`` call, so replicate ``b`` draws ``n_d``
    sources with replacement from stratum ``d``. Tests replay these draws in a plain loop.
    """
    return [rng.integers(0, n, size=(n_boot, n)) for n in sizes]


def _require_columns(df: pd.DataFrame, **cols: str) -> None:
    for arg, col in cols.items():
        if col not in df.columns:
            raise ValueError(f"{arg}={col!r} is not a column of df (columns: {list(df.columns)})")


def _require_methods(df: pd.DataFrame, method_col: str, **methods: str) -> None:
    present = set(df[method_col].unique())
    for arg, m in methods.items():
        if m not in present:
            raise ValueError(f"{arg}={m!r} is not a method in df[{method_col!r}] (found {sorted(map(str, present))})")


def paired_bootstrap(
    df: pd.DataFrame,
    *,
    metric_col: str,
    method_a: str,
    method_b: str,
    source_col: str = "source_id",
    strata_col: str = "dataset",
    method_col: str = "method",
    n_boot: int = N_BOOT,
    seed: int = BOOTSTRAP_SEED,
    ci: float = 95.0,
) -> BootstrapResult:
    """Dataset-stratified, source-paired percentile bootstrap of ``mean(metric | a) - mean(metric | b)`` (app. 8.3).

    Each replicate draws, within every stratum (dataset), as many sources as the stratum has, with replacement, and
    keeps all rows of a drawn source (its placements) for both methods together; the replicate statistic is
    ``sum(metric_a - metric_b) / (rows of a)`` over the drawn sources. Strata are visited in sorted order and sources
    in sorted order within a stratum; the draws come from :func:`_draw_indices` with ``np.random.default_rng(seed)``.
    Memory is one (n_boot, n_d) index array per stratum (8 MB for 10,000 x 100).

    Args:
        df: long table, one row per (method, case).
        metric_col: numeric or bool column to compare (e.g. ``"correct"``).
        method_a, method_b: values of ``method_col``; the result is a minus b.
        source_col: source-question id column; sources are identified by (stratum, source).
        strata_col: stratum column (dataset).
        method_col: method column.
        n_boot: number of replicates, >= 1 (appendix 8.3: 10,000).
        seed: generator seed (appendix 8.3: 20260928).
        ci: interval coverage in percent, in (0, 100).

    Returns:
        :class:`BootstrapResult` with the observed difference, the interval and the replicates.

    Raises:
        ValueError: naming the argument: ``metric_col``/``source_col``/``strata_col``/``method_col`` not a column;
            ``method_a``/``method_b`` not a method in the table (or equal); ``n_boot`` not an integer >= 1; ``seed``
            not an integer >= 0; ``ci`` outside (0, 100);
            ``metric_col`` when it is not numeric/bool; ``df`` when a source lacks rows for one method, has different
            row counts for the two, or the metric holds NaN.
    """
    _require_columns(df, metric_col=metric_col, source_col=source_col, strata_col=strata_col, method_col=method_col)
    if method_a == method_b:
        raise ValueError(f"method_b={method_b!r} must differ from method_a")
    _require_methods(df, method_col, method_a=method_a, method_b=method_b)
    try:
        n_boot = as_count(n_boot, "n_boot", minimum=1)
        seed = as_count(seed, "seed", minimum=0)
    except TypeError as err:  # documented as a ValueError naming the argument
        raise ValueError(str(err)) from None
    if not 0 < ci < 100:
        raise ValueError(f"ci={ci!r} must lie in (0, 100)")

    sub = df[df[method_col].isin([method_a, method_b])]
    try:
        metric = sub[metric_col].astype(np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"metric_col={metric_col!r} is not numeric or bool: {err}") from err
    if metric.isna().any():
        raise ValueError(f"df[{metric_col!r}] holds NaN for methods {method_a!r}/{method_b!r}")
    keys = [sub[strata_col], sub[source_col]]
    grouped = metric.groupby([*keys, sub[method_col]]).agg(["sum", "count"]).unstack(method_col)
    # grouped: index (stratum, source), columns (sum|count, method); NaN where a source lacks a method.
    if grouped.isna().to_numpy().any():
        bad = grouped.index[grouped.isna().any(axis=1)][0]
        raise ValueError(f"df: source {bad!r} lacks rows for {method_a!r} or {method_b!r}")
    n_a = grouped[("count", method_a)].to_numpy(np.int64)
    n_b = grouped[("count", method_b)].to_numpy(np.int64)
    if np.any(n_a != n_b):
        bad = grouped.index[np.flatnonzero(n_a != n_b)[0]]
        raise ValueError(f"df: source {bad!r} has unpaired rows ({method_a!r} vs {method_b!r} counts differ)")
    delta = (grouped[("sum", method_a)] - grouped[("sum", method_b)]).to_numpy(np.float64)  # (n_sources,)
    strata = grouped.index.get_level_values(0).to_numpy()
    # groupby sorts keys, so each stratum is one contiguous block.
    bounds = np.flatnonzero(np.r_[True, strata[1:] != strata[:-1], True])
    blocks = [slice(int(s), int(e)) for s, e in zip(bounds[:-1], bounds[1:])]

    rng = np.random.default_rng(seed)
    draws = _draw_indices([b.stop - b.start for b in blocks], int(n_boot), rng)
    num = np.zeros(int(n_boot))
    den = np.zeros(int(n_boot))
    for block, idx in zip(blocks, draws):
        num += delta[block][idx].sum(axis=1)
        den += n_a[block][idx].sum(axis=1)
    replicates = num / den
    alpha = (100.0 - ci) / 2.0
    low, high = np.percentile(replicates, [alpha, 100.0 - alpha])
    return BootstrapResult(
        diff=float(delta.sum() / n_a.sum()),
        low=float(low),
        high=float(high),
        n_sources=len(delta),
        replicates=replicates,
    )


def _paired_cases(
    df: pd.DataFrame,
    methods: Mapping[str, str],
    value_col: str,
    method_col: str,
    case_cols: Sequence[str],
) -> tuple[pd.Series, pd.Series]:
    """Values of ``value_col`` for two methods, aligned by case; ``methods`` maps argument names to methods."""
    method_a, method_b = methods.values()
    case_cols = list(case_cols)
    missing = [c for c in case_cols if c not in df.columns]
    if missing:
        raise ValueError(f"case_cols={tuple(case_cols)!r}: {missing} not columns of df")
    _require_columns(df, value_col=value_col, method_col=method_col)
    _require_methods(df, method_col, **methods)
    sides = []
    for m in (method_a, method_b):
        rows = df[df[method_col] == m].set_index(case_cols)[value_col]
        if not rows.index.is_unique:
            raise ValueError(f"df: method {m!r} has several rows for one case of case_cols={tuple(case_cols)!r}")
        sides.append(rows)
    a, b = sides
    if len(a) != len(b) or not a.index.isin(b.index).all():
        raise ValueError(f"df: methods {method_a!r} and {method_b!r} do not cover the same cases")
    return a, b.reindex(a.index)


def error_transitions(
    df: pd.DataFrame,
    method: str,
    reference: str = "Shift",
    *,
    metric_col: str = "correct",
    method_col: str = "method",
    case_cols: Sequence[str] = CASE_COLS,
) -> dict[str, int]:
    """Case-paired error transitions of ``method`` against ``reference`` (appendix 8.3).

    Args:
        df: long table, one row per (method, case).
        method: method whose transitions are counted.
        reference: reference method (default Shift).
        metric_col: bool or 0/1 correctness column.
        method_col: method column.
        case_cols: columns that identify a case (default dataset, source_id, placement).

    Returns:
        Counts ``{"repairs", "regressions", "both_correct", "both_wrong", "n"}``: repairs are cases the reference gets
        wrong and ``method`` right, regressions the reverse; ``n`` is the number of paired cases. Divide by ``n``
        for the rates the paper reports (e.g. 2.50% repairs, 0.75% regressions).

    Raises:
        ValueError: naming ``method``/``reference`` when absent (or equal), ``case_cols`` or ``metric_col`` when not
            columns,
            ``df`` when a case is duplicated or the two methods cover different cases.
    """
    _require_columns(df, metric_col=metric_col)
    if method == reference:
        raise ValueError(f"reference={reference!r} must differ from method")
    a, b = _paired_cases(df, {"method": method, "reference": reference}, metric_col, method_col, case_cols)
    a = a.astype(bool).to_numpy()
    b = b.astype(bool).to_numpy()
    return {
        "repairs": int(np.sum(a & ~b)),
        "regressions": int(np.sum(~a & b)),
        "both_correct": int(np.sum(a & b)),
        "both_wrong": int(np.sum(~a & ~b)),
        "n": int(a.size),
    }


def agreement_rate(
    df: pd.DataFrame,
    method_a: str,
    method_b: str,
    *,
    answer_col: str = "answer",
    method_col: str = "method",
    case_cols: Sequence[str] = CASE_COLS,
) -> float:
    """Percent of paired cases on which two methods' extracted answers agree (:func:`sur_lab.analysis.scoring.agreement`).

    Args:
        df: long table, one row per (method, case).
        method_a, method_b: the two methods (e.g. a repair and the clean reference).
        answer_col: column of extracted answers (str).
        method_col: method column.
        case_cols: columns that identify a case.

    Returns:
        Agreement in percent over the paired cases.

    Raises:
        ValueError: naming ``method_a``/``method_b`` when absent, ``case_cols`` or ``answer_col`` when not columns,
            ``df`` when a case is duplicated, the two methods cover different cases, or no case is paired.
    """
    _require_columns(df, answer_col=answer_col)
    a, b = _paired_cases(df, {"method_a": method_a, "method_b": method_b}, answer_col, method_col, case_cols)
    if len(a) == 0:
        raise ValueError("df has no paired cases")
    # A missing answer (None/NaN) is the empty answer, not the string "nan".
    agree = [agreement(x if isinstance(x, str) else "", y if isinstance(y, str) else "") for x, y in zip(a, b)]
    return 100.0 * float(np.mean(agree))


#: Record fields saying under what concurrency a sweep record was measured: ``workers`` (processes sharing the
#: machine, :mod:`sur_lab.sweeps.ray`) and ``threads`` (torch intra-op threads of the process).
CONCURRENCY_FIELDS = ("workers", "threads")


def check_concurrency(records: pd.DataFrame, *, what: str = "timings", strict: bool = True) -> None:
    """Refuse (or warn about) pooling timings measured under different concurrency.

    Records made by several workers sharing a machine, or with different torch thread counts, time different things;
    averaging them into one latency table mixes conditions. Records without the ``workers``/``threads`` fields (made
    before they existed) count as unknown and are treated as one setting.

    Args:
        records: sweep records (``workers``, ``threads`` columns when present).
        what: what is being pooled, for the message.
        strict: raise (``True``) or only warn (``False``).

    Raises:
        ValueError: when ``strict`` and the records mix settings; the message lists them and how to filter.
    """
    cols = [c for c in CONCURRENCY_FIELDS if c in records.columns]
    if not cols or records.empty:
        return
    settings = records[cols].astype("object").where(records[cols].notna(), None).drop_duplicates()
    if len(settings) <= 1:
        return
    listed = "; ".join(", ".join(f"{c}={row[c]}" for c in cols) for _, row in settings.iterrows())
    msg = (f"these records were measured under {len(settings)} concurrency settings ({listed}); pooling their {what} "
           f"mixes conditions. Filter to one setting (e.g. records[records.workers == 1]) or rerun the latency study "
           f"with workers=1")
    if strict:
        raise ValueError(msg)
    warnings.warn(msg, UserWarning, stacklevel=2)


def timed_records(records: pd.DataFrame) -> pd.DataFrame:
    """The records whose answer timings were measured per request (``timed``; every record when the field is absent:
    records made before it existed were all answered one at a time)."""
    if "timed" not in records.columns:
        return records
    return records[records["timed"].astype(bool)]


def check_timing(records: pd.DataFrame, *, what: str = "timings", strict: bool = True) -> None:
    """Refuse (or warn about) pooling timings that were not measured the same way.

    Latency (Eq. 20) is per request: a record answered in a batch (``timed`` False, :attr:`sur_lab.sweeps.Record.timed`)
    carries no answer timings (NaN), and pooling it with timed records would average a subset silently. So the records
    must all be timed, and measured under one concurrency setting (:func:`check_concurrency`). Filter with
    :func:`timed_records` first to pool the timed subset of a sweep that times a declared subset of its cases.

    Args:
        records: sweep records (``timed``, ``workers``, ``threads`` columns when present).
        what: what is being pooled, for the message.
        strict: raise (``True``) or only warn (``False``).

    Raises:
        ValueError: when ``strict`` and some records are not timed, listing how many and how to filter; or as
            :func:`check_concurrency`.
    """
    if "timed" in records.columns and len(records):
        untimed = int((~records["timed"].astype(bool)).sum())
        if untimed:
            msg = (f"{untimed} of these {len(records)} records were answered in a batch and carry no per-request "
                   f"timings (timed=False); pooling their {what} would average the timed subset only. Filter with "
                   "sur_lab.analysis.stats.timed_records(records), or time every case (timed=True / eval_batch=1)")
            if strict:
                raise ValueError(msg)
            warnings.warn(msg, UserWarning, stacklevel=2)
    check_concurrency(records, what=what, strict=strict)


# ---------------------------------------------------------------------------------------------------------------------
# Bootstrap p-values and Holm correction (appendix 10.2, Table 15)


def bootstrap_p_value(replicates, null: float = 0.0) -> float:
    """Two-sided p-value of ``theta = null`` from percentile-bootstrap replicates (appendix 10.2, Table 15).

    ``p = min(1, 2 * min(#{theta*_b <= null}, #{theta*_b >= null}) / n)`` over the n finite replicates
    ``theta*_b``. This inverts the percentile interval: ``null`` lies outside the central ``1 - alpha`` percentile
    interval about when ``alpha > p`` (exactly, for the empirical quantiles ``theta*_(k)`` of the sorted replicates:
    the interval ``[theta*_(k), theta*_(n+1-k)]`` excludes ``null`` iff ``2k/n`` exceeds p before its clip at 1).
    Replicates equal to ``null`` count on both sides, so a degenerate bootstrap at ``null`` gives 1. ``p = 0`` means
    no replicate fell on the other side of ``null``: report it as ``p < 2/n``, not as zero. NaN replicates (undefined
    statistics, e.g. a replicate that drew no source of a stratum) are left out of ``n``.

    Args:
        replicates: bootstrap replicates of the statistic, 1-D.
        null: the value tested (0 for a difference or contrast).

    Returns:
        p in [0, 1].

    Raises:
        ValueError: naming ``replicates`` when it holds no finite value or an infinite one, or ``null`` when not finite.
    """
    r = np.asarray(replicates, dtype=np.float64).reshape(-1)
    if not np.isfinite(null):
        raise ValueError(f"null={null!r} must be finite")
    if np.isinf(r).any():
        raise ValueError("replicates holds an infinite value")
    r = r[~np.isnan(r)]
    if r.size == 0:
        raise ValueError("replicates holds no finite value")
    tail = min(int(np.sum(r <= null)), int(np.sum(r >= null)))
    return min(1.0, 2.0 * tail / r.size)


def holm(pvalues: Mapping[str, float], family: Sequence[str] | None = None) -> dict[str, float]:
    """Holm step-down adjusted p-values over a named family of hypotheses (Holm, 1979; appendix 10.2).

    With the family's m raw p-values sorted ascending, ``p_(1) <= ... <= p_(m)``, the adjusted values are
    ``p~_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))``. Rejecting every hypothesis with ``p~ <= alpha`` is Holm's
    procedure at family-wise level alpha: reject ``H_(1), ..., H_(k)`` where k is the last i before the first
    ``p_(i) > alpha / (m - i + 1)``. Ties keep their order of appearance (the adjusted values of tied p-values are
    equal either way). The paper's pooled secondary family is NLL tail and interaction and EM side, tail and
    interaction (:data:`sur_lab.studies.evidence_location.SECONDARY_FAMILY`); the primary NLL side contrast is not in
    it.

    Args:
        pvalues: raw p-values by hypothesis name (may hold more than the family).
        family: names of the family's hypotheses, in any order; ``None`` = every key of ``pvalues``.

    Returns:
        ``{name: adjusted p}`` for the family's names, in ``family`` order.

    Raises:
        ValueError: naming ``family`` when it is empty, repeats a name or names a hypothesis absent from ``pvalues``;
            naming ``pvalues`` when a family p-value is not in [0, 1] (NaN included).
    """
    names = list(pvalues) if family is None else list(family)
    if not names:
        raise ValueError("family is empty; Holm correction needs at least one hypothesis")
    if len(set(names)) != len(names):
        raise ValueError(f"family={names!r} repeats a hypothesis")
    missing = [n for n in names if n not in pvalues]
    if missing:
        raise ValueError(f"family names {missing} that pvalues lacks (has {sorted(pvalues)})")
    raw = np.array([float(pvalues[n]) for n in names], dtype=np.float64)
    if not np.all((raw >= 0) & (raw <= 1)):
        raise ValueError(f"pvalues must lie in [0, 1] for every family member; got {dict(zip(names, raw.tolist()))}")
    m = raw.size
    order = np.argsort(raw, kind="stable")
    scaled = np.minimum(1.0, (m - np.arange(m)) * raw[order])
    adjusted = np.empty(m)
    adjusted[order] = np.maximum.accumulate(scaled)
    return {n: float(a) for n, a in zip(names, adjusted)}


# ---------------------------------------------------------------------------------------------------------------------
# Factorial contrasts of the evidence-location experiment (Eq. 10-12, appendix 10.2, Tables 15-16)

#: Evidence side z (the exchange slot that holds the evidence bundle) and neutral tail l of the four cells.
SIDES = ("upstream", "downstream")
TAILS = ("short", "long")
#: Cell weights of each contrast, by (side, tail): Eq. 10 (side), Eq. 11 (tail), Eq. 12 (interaction).
CONTRASTS: dict[str, dict[tuple[str, str], float]] = {
    "side": {("downstream", "short"): 0.5, ("upstream", "short"): -0.5,
             ("downstream", "long"): 0.5, ("upstream", "long"): -0.5},
    "tail": {("upstream", "long"): 0.5, ("upstream", "short"): -0.5,
             ("downstream", "long"): 0.5, ("downstream", "short"): -0.5},
    "interaction": {("downstream", "long"): 1.0, ("upstream", "long"): -1.0,
                    ("downstream", "short"): -1.0, ("upstream", "short"): 1.0},
}
_CELLS = tuple((z, tail) for tail in TAILS for z in SIDES)


def method_difference(
    df: pd.DataFrame,
    value_col: str,
    method_a: str,
    method_b: str,
    *,
    method_col: str = "method",
    case_cols: Sequence[str] = ("model", "dataset", "source_id", "side", "tail"),
) -> pd.DataFrame:
    """Per-case paired difference ``value(method_a) - value(method_b)``: the repair advantage G of one cell.

    Appendix 10.2 defines the advantage so that positive means a larger repair benefit: for the gold-answer NLL
    ``G = NLL_Shift - NLL_Replay`` (``method_a="Shift"``, ``method_b="Replay"``), for EM ``G = EM_Replay - EM_Shift``,
    for first-token TV or JSD the reduction ``TV_Shift - TV_method``.

    Args:
        df: long table, one row per (case, method).
        value_col: numeric or bool column.
        method_a, method_b: the two methods (values of ``method_col``).
        method_col: method column.
        case_cols: columns that identify a case (the model is part of a case).

    Returns:
        A new DataFrame with ``case_cols`` and ``value_col`` (float64, a minus b), one row per paired case.

    Raises:
        ValueError: naming ``method_a``/``method_b`` when absent or equal, ``case_cols``/``value_col`` when not
            columns, ``df`` when a case is duplicated or the two methods cover different cases.
    """
    if method_a == method_b:
        raise ValueError(f"method_b={method_b!r} must differ from method_a")
    a, b = _paired_cases(df, {"method_a": method_a, "method_b": method_b}, value_col, method_col, case_cols)
    diff = a.astype(np.float64) - b.astype(np.float64)
    return diff.rename(value_col).reset_index()


def _source_cells(
    df: pd.DataFrame, value_col: str, model_col: str, dataset_col: str, source_col: str, side_col: str, tail_col: str
) -> pd.DataFrame:
    """``(model, dataset, source) x 4 cells`` table of ``value_col``; every unit must have each cell exactly once."""
    _require_columns(df, value_col=value_col, model_col=model_col, dataset_col=dataset_col, source_col=source_col,
                     side_col=side_col, tail_col=tail_col)
    bad_side = sorted(set(map(str, df[side_col].unique())) - set(SIDES))
    bad_tail = sorted(set(map(str, df[tail_col].unique())) - set(TAILS))
    if bad_side or bad_tail:
        raise ValueError(f"df: side values must be {SIDES} and tail values {TAILS}; found {bad_side + bad_tail}")
    try:
        values = df[value_col].astype(np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"value_col={value_col!r} is not numeric or bool: {err}") from err
    if values.isna().any():
        raise ValueError(f"df[{value_col!r}] holds NaN; drop incomplete units before computing contrasts")
    keys = [model_col, dataset_col, source_col]
    frame = df[keys].assign(_cell=list(zip(df[side_col].astype(str), df[tail_col].astype(str))), _v=values.to_numpy())
    if frame.duplicated(keys + ["_cell"]).any():
        dup = frame[frame.duplicated(keys + ["_cell"], keep=False)].iloc[0]
        raise ValueError(f"df: unit {tuple(dup[keys])} has several rows for cell {dup['_cell']}")
    wide = frame.pivot(index=keys, columns="_cell", values="_v").reindex(columns=list(_CELLS))
    if wide.isna().any().any():
        bad = wide.index[wide.isna().any(axis=1)][0]
        raise ValueError(f"df: unit (model, dataset, source)={bad!r} lacks a cell; every unit needs all four cells")
    return wide


def source_contrasts(
    df: pd.DataFrame,
    value_col: str,
    *,
    model_col: str = "model",
    dataset_col: str = "dataset",
    source_col: str = "source_id",
    side_col: str = "side",
    tail_col: str = "tail",
) -> pd.DataFrame:
    """Eq. 10-12 for every (model, dataset, source) unit from its four cells' repair advantages.

    ``side = 1/2 [(G_DS - G_US) + (G_DL - G_UL)]``, ``tail = 1/2 [(G_UL - G_US) + (G_DL - G_DS)]``,
    ``interaction = (G_DL - G_UL) - (G_DS - G_US)``, with ``G_zl`` the unit's value in cell (side z, tail l).

    Args:
        df: one row per (model, dataset, source, cell) with the cell's advantage in ``value_col`` (see
            :func:`method_difference`); ``side_col`` in :data:`SIDES`, ``tail_col`` in :data:`TAILS`.
        value_col, model_col, dataset_col, source_col, side_col, tail_col: column names.

    Returns:
        One row per unit, index ``(model, dataset, source)`` sorted, columns ``side``, ``tail``, ``interaction``.

    Raises:
        ValueError: naming a column argument that is not a column; naming ``df`` for an unknown side/tail value,
            a unit with a missing or repeated cell, or a NaN value.
    """
    wide = _source_cells(df, value_col, model_col, dataset_col, source_col, side_col, tail_col)
    g = wide.to_numpy(np.float64)  # (units, 4) in _CELLS order
    out = {name: g @ np.array([w.get(c, 0.0) for c in _CELLS]) for name, w in CONTRASTS.items()}
    return pd.DataFrame(out, index=wide.index)


def _weighted_mean(per_unit: pd.Series) -> float:
    """Mean within (model, dataset), then over datasets, then over models (equal weights)."""
    names = list(per_unit.index.names)
    by_dataset = per_unit.groupby(level=[names[0], names[1]]).mean()
    return float(by_dataset.groupby(level=names[0]).mean().mean())


def factorial_contrasts(df: pd.DataFrame, value_col: str, **cols: str) -> dict[str, float]:
    """Point estimates of Eq. 10-12 with the paper's weighting (appendix 10.2).

    Paired contrasts are formed within each source (:func:`source_contrasts`), averaged over the sources of each
    (model, dataset), then over datasets with equal weight, then over models with equal weight:
    ``tau = (1/M) sum_m (1/D_m) sum_d (1/n_md) sum_s c_mds``, where ``D_m`` counts the datasets model m has units in.

    Args:
        df: as :func:`source_contrasts`.
        value_col: the per-cell advantage column.
        **cols: column names ``model_col``, ``dataset_col``, ``source_col``, ``side_col``, ``tail_col`` (defaults as
            :func:`source_contrasts`).

    Returns:
        ``{"side": ..., "tail": ..., "interaction": ...}`` in ``value_col``'s units.

    Raises:
        ValueError: as :func:`source_contrasts`.
    """
    units = source_contrasts(df, value_col, **cols)
    return {name: _weighted_mean(units[name]) for name in CONTRASTS}


def factorial_bootstrap(
    df: pd.DataFrame,
    value_col: str,
    *,
    model_col: str = "model",
    dataset_col: str = "dataset",
    source_col: str = "source_id",
    side_col: str = "side",
    tail_col: str = "tail",
    n_boot: int = N_BOOT,
    seed: int = BOOTSTRAP_SEED,
    ci: float = 95.0,
) -> dict[str, BootstrapResult]:
    """Eq. 10-12 with source-bootstrap intervals and p-values (appendix 10.2, Tables 15-16).

    Each replicate draws, within every dataset, as many sources as the dataset has, with replacement
    (:func:`_draw_indices`, datasets in sorted order, sources sorted within a dataset, ``np.random.default_rng(seed)``:
    the draws of :func:`paired_bootstrap`), and carries every cell and every model row of a drawn source together: a
    source is one resampling unit across the four cells and all models. The replicate statistic is
    :func:`factorial_contrasts`'s weighted mean over the drawn sources (a source drawn twice counts twice). A source
    may lack a model (e.g. outside that model's EM stratum); a (model, dataset) with no drawn source in a replicate
    is left out of that replicate's dataset average, and a replicate where every model is undefined is NaN (excluded
    from the interval and the p-value; count them with ``np.isnan(result.replicates)``).

    Args:
        df: as :func:`source_contrasts`.
        value_col, model_col, dataset_col, source_col, side_col, tail_col: column names.
        n_boot: replicates, >= 1 (appendix 10.2: 10,000).
        seed: generator seed (appendix 8.3's 20260928 by default).
        ci: interval coverage in percent, in (0, 100) (percentile interval, linear interpolation).

    Returns:
        ``{contrast: BootstrapResult}`` for ``side``, ``tail``, ``interaction``: ``diff`` the point estimate of
        :func:`factorial_contrasts`, ``low``/``high`` the percentile interval, ``n_sources`` the (dataset, source)
        units, ``replicates`` (n_boot,), and ``p_value`` (:func:`bootstrap_p_value`).

    Raises:
        ValueError: as :func:`source_contrasts`; naming ``n_boot`` or ``ci`` when out of range.
    """
    if int(n_boot) != n_boot or n_boot < 1:
        raise ValueError(f"n_boot={n_boot!r} must be an integer >= 1")
    if not 0 < ci < 100:
        raise ValueError(f"ci={ci!r} must lie in (0, 100)")
    units = source_contrasts(df, value_col, model_col=model_col, dataset_col=dataset_col, source_col=source_col,
                             side_col=side_col, tail_col=tail_col)
    estimates = {name: _weighted_mean(units[name]) for name in CONTRASTS}
    # (dataset, source) x model x contrast, NaN where a model lacks the source.
    cube = units.stack().unstack(level=0)  # index (dataset, source, contrast), columns model
    datasets = sorted(cube.index.get_level_values(0).unique())
    blocks = []
    for d in datasets:
        sub = cube.xs(d, level=0)
        sources = sorted(sub.index.get_level_values(0).unique())
        arr = np.stack([sub.xs(s, level=0).reindex(list(CONTRASTS)).to_numpy(np.float64) for s in sources])
        blocks.append(arr.transpose(0, 2, 1))  # (n_d, models, contrasts)
    rng = np.random.default_rng(seed)
    draws = _draw_indices([b.shape[0] for b in blocks], int(n_boot), rng)
    per_dataset = []
    for arr, idx in zip(blocks, draws):
        present = ~np.isnan(arr)
        sums = np.where(present, arr, 0.0)[idx].sum(axis=1)  # (n_boot, models, contrasts)
        counts = present[idx].sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            per_dataset.append(np.where(counts > 0, sums / np.maximum(counts, 1), np.nan))
    stacked = np.stack(per_dataset)  # (datasets, n_boot, models, contrasts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices are documented NaN replicates
        per_model = np.nanmean(stacked, axis=0)
        replicates = np.nanmean(per_model, axis=1)  # (n_boot, contrasts)
    alpha = (100.0 - ci) / 2.0
    out = {}
    for k, name in enumerate(CONTRASTS):
        reps = replicates[:, k]
        finite = reps[~np.isnan(reps)]
        low, high = np.percentile(finite, [alpha, 100.0 - alpha]) if finite.size else (np.nan, np.nan)
        out[name] = BootstrapResult(diff=estimates[name], low=float(low), high=float(high),
                                    n_sources=sum(b.shape[0] for b in blocks), replicates=reps)
    return out
