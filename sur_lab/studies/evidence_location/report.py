"""Evidence-location report (appendix 10.2-10.3): Table 15 (the factorial effects of each repair condition's
advantage over Shift), Table 16 (the evidence-side effects on clean-reference fidelity), the paired replay minus
fixed-slot gaps, the four cells' means and figure, and the paper's three findings judged by declared rules.

Pure: records (or long tables) in, tables out. The pooled estimand of several models' runs
(:func:`sur_lab.studies.evidence_location.pooled.pooled_report`) reads them as one run's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from sur_lab.analysis.conclusions import arm_labels
from sur_lab.analysis.decisions import (
    ALPHA,
    BEATS,
    DIFF_COLUMNS,
    EQUIVALENT,
    LOSES,
    NA,
    NOT_DECIDED,
    NOT_SEPARATED,
    SEPARATED,
    Margin,
    bootstrap_p,
    in_units,
    judge,
    min_separating_units,
    p_floor,
)
from sur_lab.analysis.stats import BOOTSTRAP_SEED, CONTRASTS, factorial_bootstrap, holm, method_difference
from sur_lab.studies.evidence_location.cases import CELLS

__all__ = ["SECONDARY_FAMILY", "NLL_SIDE_MARGIN", "FIXED_SLOT_SHARE", "FIXED_SLOT_LABEL", "COMPLETE_REPLAY",
           "UNIT_KEYS", "CELL_KEYS", "em_stratum", "contrast_table", "table15", "FIDELITY_ENDPOINTS", "results_table",
           "advantage", "factorial_table", "table16", "slot_gap_table", "cell_means", "plot_cells",
           "min_separable_sources", "margin_sizing", "nll_side_decision", "findings"]

#: The pooled secondary family corrected by Holm (appendix 10.2); the primary hypothesis is the NLL side contrast.
SECONDARY_FAMILY = ("NLL tail", "NLL interaction", "EM side", "EM tail", "EM interaction")
#: The primary's equivalence margin (issue 36): "the NLL side contrast is null" is claimed only when its 90 % source
#: bootstrap interval lies inside ±0.1 nats (TOST at 5 %).
NLL_SIDE_MARGIN = Margin(0.1, "±0.1 nats holds the paper's own Table 15 interval for this contrast, -0.099 to 0.021 "
                              "(half-width 0.06 nats); issue 36")
#: The fixed slot "carries" complete replay's side effect on an endpoint when the paired side contrast of replay's
#: advantage minus the fixed slot's lies inside ± this share of replay's estimate (TOST on the paired difference,
#: issue 36). The paper's Table 16 fixed-slot estimates are within 4 % of replay's on every fidelity endpoint.
FIXED_SLOT_SHARE = 0.25
#: The record ``method`` of the fixed-slot refresh (:class:`~sur_lab.studies.evidence_location.study.FixedSlotRefresh`).
FIXED_SLOT_LABEL = "Fixed slot"
#: The complete suffix replay, the method Table 15's advantages are about.
COMPLETE_REPLAY = "Replay"

#: Columns that identify one source-model unit and one cell in a results table.
UNIT_KEYS = ("model", "dataset", "source_id")
CELL_KEYS = (*UNIT_KEYS, "side", "tail")


def em_stratum(table: pd.DataFrame, *, reference: str = "Re-prefill", correct_col: str = "em",
               method_col: str = "method") -> pd.DataFrame:
    """The EM secondary's stratum (appendix 10.2): rows of the source-model units whose clean reference answers
    correctly in all four cells. Not conditioned on Shift failing.

    Args:
        table: long table, one row per (model, dataset, source_id, side, tail, method).
        reference: the clean reference method.
        correct_col: bool EM column.
        method_col: method column.

    Returns:
        The rows of ``table`` whose unit qualifies (all methods), a new DataFrame.

    Raises:
        ValueError: naming ``reference`` when absent, or ``table`` when a column is missing.
    """
    missing = [c for c in (*CELL_KEYS, correct_col, method_col) if c not in table.columns]
    if missing:
        raise ValueError(f"table lacks columns {missing}")
    ref = table[table[method_col] == reference]
    if ref.empty:
        raise ValueError(f"reference={reference!r} has no rows in table[{method_col!r}]")
    per_unit = ref.groupby(list(UNIT_KEYS))[correct_col].agg(["all", "size"])
    keep = per_unit[(per_unit["all"].astype(bool)) & (per_unit["size"] == len(CELLS))].index
    idx = pd.MultiIndex.from_frame(table[list(UNIT_KEYS)])
    return table[idx.isin(keep)].copy()


def contrast_table(advantages: dict[str, pd.DataFrame], *, value_col: str = "g", kinds: dict[str, str] | None = None,
                   units: dict[str, str] | None = None, n_boot: int = 10_000, seed: int | None = None) -> pd.DataFrame:
    """Eq. 10-12 with source-bootstrap intervals for several endpoints (:func:`sur_lab.analysis.stats.
    factorial_bootstrap`), in the one paired-difference schema (:func:`sur_lab.analysis.decisions.in_units`).

    Args:
        advantages: ``{label: frame}``, each frame one row per (model, dataset, source_id, side, tail) with the cell's
            repair advantage in ``value_col`` (:func:`sur_lab.analysis.stats.method_difference`; e.g. ``"NLL"`` =
            NLL_Shift - NLL_Replay, ``"EM"`` = EM_Replay - EM_Shift on :func:`em_stratum`).
        value_col: the advantage column.
        kinds: ``"binary"`` (0/1 endpoints: the decision columns are fractions, ``delta`` in pp) or ``"continuous"``
            per label; default ``"continuous"``.
        units: the printed unit of each continuous label (``"nats"``; default ``""``).
        n_boot: replicates. seed: generator seed (default appendix 8.3's).

    Returns:
        One row per (label, contrast): ``endpoint``, ``contrast``, ``kind``, ``estimate``, ``ci_low``, ``ci_high``
        (95 %), ``tost_low``, ``tost_high`` (90 %: the equivalence test's interval), ``p`` (two-sided bootstrap p,
        never below :func:`sur_lab.analysis.decisions.p_floor` of the sources: no exact test on n sources goes
        lower), ``n`` (the (model, dataset, source) units, e.g. 825 for the paper's three models on 275 sources),
        ``n_clusters`` (the resampled (dataset, source) units: a source carries its cells of every model),
        ``undefined_replicates``, ``mde`` (NaN: a bootstrap contrast states no detectable size), then
        :data:`sur_lab.analysis.decisions.DIFF_COLUMNS` (``delta``, ``delta_low``, ``delta_high``, ``delta_mde``,
        ``unit``: the difference in its printed unit). A degenerate bootstrap (every replicate equal) has no interval
        (NaN: never a zero-width one). A frame without rows (e.g. an empty EM stratum) gives NaN rows with ``n`` and
        ``n_clusters`` 0.

    Raises:
        ValueError: naming ``kinds`` when a kind is neither ``"binary"`` nor ``"continuous"``.
    """
    kinds, units = kinds or {}, units or {}
    bad = sorted({k for k in kinds.values()} - {"binary", "continuous"})
    if bad:
        raise ValueError(f"kinds holds {bad}; each is 'binary' or 'continuous'")
    rows = []
    nan = float("nan")
    for label, frame in advantages.items():
        kind = kinds.get(label, "continuous")
        head = {"endpoint": label, "kind": kind}
        if len(frame) == 0:
            rows.extend({**head, "contrast": c, "estimate": nan, "ci_low": nan, "ci_high": nan, "tost_low": nan,
                         "tost_high": nan, "p": nan, "n": 0, "n_clusters": 0, "undefined_replicates": 0,
                         "mde": nan, "_unit": units.get(label, "")} for c in CONTRASTS)
            continue
        res = factorial_bootstrap(frame, value_col, n_boot=n_boot, seed=BOOTSTRAP_SEED if seed is None else seed)
        n_units = len(frame[list(UNIT_KEYS)].drop_duplicates())
        for contrast, r in res.items():
            finite = r.replicates[~np.isnan(r.replicates)]
            degenerate = finite.size == 0 or np.ptp(finite) == 0
            t_low, t_high = (np.percentile(finite, [100 * ALPHA, 100 * (1 - ALPHA)]) if not degenerate
                             else (nan, nan))
            rows.append({**head, "contrast": contrast, "estimate": r.diff, "ci_low": nan if degenerate else r.low,
                         "ci_high": nan if degenerate else r.high, "tost_low": t_low, "tost_high": t_high,
                         "p": bootstrap_p(finite, r.n_sources) if finite.size else nan, "n": n_units,
                         "n_clusters": r.n_sources, "undefined_replicates": int(np.isnan(r.replicates).sum()),
                         "mde": nan, "_unit": units.get(label, "")})
    cols = ["endpoint", "contrast", "kind", "estimate", "ci_low", "ci_high", "tost_low", "tost_high", "p", "n",
            "n_clusters", "undefined_replicates", "mde"]
    df = pd.DataFrame(rows, columns=[*cols, "_unit"])
    parts = [in_units(g.drop(columns="_unit"), unit=u) for u, g in df.groupby("_unit", sort=False)]
    if not parts:
        return pd.DataFrame(columns=[*cols, *DIFF_COLUMNS])
    return pd.concat(parts).sort_index()


def table15(nll: pd.DataFrame, em: pd.DataFrame, *, value_col: str = "g", n_boot: int = 10_000,
            seed: int | None = None) -> pd.DataFrame:
    """Table 15: NLL (nats) and EM (a binary endpoint: ``delta`` in percentage points) factorial effects with 95 %
    intervals and Holm p over the pooled secondary family :data:`SECONDARY_FAMILY`; the preregistered primary (NLL
    side) has no Holm p (NaN).
    An undefined member (an empty EM stratum) enters the correction with p = 1, so the family keeps its five
    hypotheses, and its own Holm p is NaN.

    Args:
        nll: per-cell ``NLL_Shift - NLL_Replay`` advantages of every complete source (see :func:`contrast_table`).
        em: per-cell ``EM_Replay - EM_Shift`` (0/1 differences) on the :func:`em_stratum` units.
        value_col, n_boot, seed: as :func:`contrast_table`.

    Returns:
        :func:`contrast_table`'s rows with ``hypothesis`` (e.g. ``"EM side"``) and ``p_adj`` (the Holm p).
    """
    out = contrast_table({"NLL": nll, "EM": em}, value_col=value_col, kinds={"EM": "binary"},
                         units={"NLL": "nats"}, n_boot=n_boot, seed=seed)
    out["hypothesis"] = out["endpoint"] + " " + out["contrast"]
    raw = {h: (1.0 if np.isnan(p) else float(p)) for h, p in zip(out["hypothesis"], out["p"])}
    adjusted = holm(raw, family=SECONDARY_FAMILY)
    out["p_adj"] = [adjusted.get(h, np.nan) if not np.isnan(p) else np.nan for h, p in zip(out["hypothesis"], out["p"])]
    return out



#: Table 16's endpoints: label -> (record column, sign, kind, unit). The advantage of a method over Shift is
#: ``sign * (value(method) - value(Shift))``: reductions of TV, JSD and the gold NLL (continuous, in ``unit``),
#: agreement gains (binary: fractions in ``estimate``, percentage points in ``delta``).
FIDELITY_ENDPOINTS = {
    "First-token TV": ("tv_reprefill", -1.0, "continuous", ""),
    "First-token JSD": ("jsd_reprefill", -1.0, "continuous", ""),
    "Argmax agreement": ("argmax_agree", 1.0, "binary", "pp"),
    "Sequence agreement": ("sequence_agree", 1.0, "binary", "pp"),
    "Gold NLL": ("gold_nll", -1.0, "continuous", "nats"),
}


def _fidelity_contrasts(frames: dict[str, pd.DataFrame], n_boot: int, seed: int) -> pd.DataFrame:
    kinds = {label: FIDELITY_ENDPOINTS[label][2] for label in frames}
    units = {label: FIDELITY_ENDPOINTS[label][3] for label in frames}
    return contrast_table(frames, kinds=kinds, units=units, n_boot=n_boot, seed=seed)


def results_table(records: pd.DataFrame | Sequence[dict]) -> pd.DataFrame:
    """Sweep records as the long table of the report: one row per (model, dataset, source_id, side, tail, method[,
    budget]), with ``condition`` (``"SUR 5%"`` for a budgeted method, the plain name otherwise) and ``em`` as bool.

    Raises:
        ValueError: naming ``records`` when a required column is missing.
    """
    df = pd.DataFrame(records).copy()
    need = [*CELL_KEYS, "method", "budget_pct", "em", "gold_nll", *(c for c, *_ in FIDELITY_ENDPOINTS.values())]
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise ValueError(f"records lack columns {missing}")
    df["condition"] = arm_labels(df)
    df["em"] = df["em"].astype(bool)
    return df


def advantage(table: pd.DataFrame, condition: str, column: str, *, sign: float = 1.0,
              reference: str = "Shift") -> pd.DataFrame:
    """Per-cell repair advantage of ``condition`` over ``reference`` (appendix 10.2's G):
    ``sign * (column(condition) - column(reference))``, one row per (model, dataset, source_id, side, tail), in
    column ``g`` (float64). E.g. NLL: ``sign=-1`` (``NLL_Shift - NLL_Replay``, nats); EM: ``sign=1`` (0/1
    differences; :func:`table15` reports them in pp).

    Raises:
        ValueError: as :func:`sur_lab.analysis.stats.method_difference`.
    """
    diff = method_difference(table, column, condition, reference, method_col="condition", case_cols=CELL_KEYS)
    return diff.assign(g=sign * diff[column].astype(np.float64))[[*CELL_KEYS, "g"]]


def factorial_table(table: pd.DataFrame, conditions: Sequence[str] = (COMPLETE_REPLAY, FIXED_SLOT_LABEL), *,
                    n_boot: int = 10_000, seed: int = 20260928) -> pd.DataFrame:
    """:func:`table15` for each repair condition: NLL (nats) and EM (pp) factorial effects (Eq. 10-12) of its
    advantage over Shift, with source-bootstrap 95 % intervals and Holm p (within each condition).

    NLL: ``G = NLL_Shift - NLL_condition`` (the gold answer's mean NLL, nats per token) on every source. EM:
    ``G = EM_condition - EM_Shift`` on the :func:`em_stratum` sources (the clean reference answers correctly in all
    four cells; NaN rows with ``n`` 0 when the stratum is empty).

    Args:
        table: :func:`results_table`.
        conditions: repair conditions (values of ``table["condition"]``).
        n_boot: bootstrap replicates; seed: generator seed (appendix 8.3's by default).

    Returns:
        :func:`table15`'s rows with ``condition`` first.

    Raises:
        ValueError: naming a condition absent from ``table``.
    """
    stratum = em_stratum(table, reference="Re-prefill", method_col="condition")
    out = []
    for cond in conditions:
        _check_condition(table, cond)
        nll = advantage(table, cond, "gold_nll", sign=-1.0)
        em = advantage(stratum, cond, "em") if len(stratum) else nll.iloc[:0]
        out.append(table15(nll, em, n_boot=n_boot, seed=seed).assign(condition=cond))
    df = pd.concat(out, ignore_index=True)
    return df[["condition", *[c for c in df.columns if c != "condition"]]]


def _check_condition(table: pd.DataFrame, cond: str) -> None:
    if cond not in set(table["condition"]):
        raise ValueError(f"condition {cond!r} has no records (conditions: {sorted(set(table['condition']))})")


def table16(table: pd.DataFrame, conditions: Sequence[str] = (COMPLETE_REPLAY, FIXED_SLOT_LABEL), *,
            n_boot: int = 10_000, seed: int = 20260928) -> pd.DataFrame:
    """Table 16: evidence-side effects (Eq. 10) on clean-reference fidelity, complete replay beside the fixed-slot
    refresh (appendix 10.3), and the gold-NLL side contrast of each (:func:`contrast_table`).

    Each endpoint of :data:`FIDELITY_ENDPOINTS` is a per-cell advantage over Shift (TV and JSD reductions, argmax and
    sequence agreement gains, the gold NLL reduction in nats); a positive side effect means a larger repair
    benefit with downstream evidence. Every source counts (no stratum).

    Returns:
        One row per (endpoint, condition): the side contrast in :func:`contrast_table`'s schema (``kind``,
        ``estimate``, ``ci_low``, ``ci_high`` (95 % source bootstrap), ``tost_low``, ``tost_high``, ``p``, ``n``,
        ``n_clusters``, ``mde``, then ``delta``, ``delta_low``, ``delta_high``, ``delta_mde``, ``unit``); the tail
        and interaction estimates in ``unit`` as ``tail`` and ``interaction``.

    Raises:
        ValueError: naming a condition absent from ``table``.
    """
    out = []
    for cond in conditions:
        _check_condition(table, cond)
        frames = {label: advantage(table, cond, column, sign=sign)
                  for label, (column, sign, *_) in FIDELITY_ENDPOINTS.items()}
        long = _fidelity_contrasts(frames, n_boot, seed)
        wide = long[long["contrast"] == "side"].drop(columns=["contrast"]).set_index("endpoint")
        for other in ("tail", "interaction"):
            wide[other] = long[long["contrast"] == other].set_index("endpoint")["delta"]
        out.append(wide.reset_index().assign(condition=cond))
    df = pd.concat(out, ignore_index=True)
    order = {label: i for i, label in enumerate(FIDELITY_ENDPOINTS)}
    df = df.sort_values(["endpoint", "condition"], key=lambda c: c.map(order) if c.name == "endpoint" else
                        c.map({k: i for i, k in enumerate(conditions)}), kind="stable").reset_index(drop=True)
    return df[["endpoint", "condition", "kind", "estimate", "ci_low", "ci_high", "tost_low", "tost_high", "p", "n",
               "n_clusters", "mde", *DIFF_COLUMNS, "tail", "interaction"]]


def slot_gap_table(table: pd.DataFrame, *, n_boot: int = 10_000, seed: int = 20260928) -> pd.DataFrame:
    """The paired difference behind "the fixed slot carries the side effect" (issue 36): per Table 16 fidelity
    endpoint but the gold NLL, the side contrast (Eq. 10) of complete replay's advantage minus the fixed slot's, per
    cell and source (``sign * (value(Replay) - value(Fixed slot))``), with its source bootstrap
    (:func:`contrast_table`). Positive: replay's side effect is larger.

    Returns:
        One row per endpoint: ``endpoint``, ``kind``, ``estimate``, ``ci_low``, ``ci_high``, ``tost_low``,
        ``tost_high``, ``p``, ``n``, ``n_clusters``, ``mde``, ``delta``, ``delta_low``, ``delta_high``,
        ``delta_mde``, ``unit`` (:func:`contrast_table`'s schema).

    Raises:
        ValueError: naming a condition (Replay, the fixed slot) absent from ``table``.
    """
    for cond in (COMPLETE_REPLAY, FIXED_SLOT_LABEL):
        _check_condition(table, cond)
    frames = {}
    for label, (column, sign, *_) in FIDELITY_ENDPOINTS.items():
        if label == "Gold NLL":
            continue
        rep, fix = (advantage(table, c, column, sign=sign) for c in (COMPLETE_REPLAY, FIXED_SLOT_LABEL))
        merged = rep.merge(fix, on=list(CELL_KEYS), suffixes=("_r", "_f"))
        frames[label] = merged.assign(g=merged["g_r"] - merged["g_f"])[[*CELL_KEYS, "g"]]
    long = _fidelity_contrasts(frames, n_boot, seed)
    side = long[long["contrast"] == "side"]
    return side[["endpoint", "kind", "estimate", "ci_low", "ci_high", "tost_low", "tost_high", "p", "n", "n_clusters",
                 "mde", *DIFF_COLUMNS]].reset_index(drop=True)


def cell_means(table: pd.DataFrame, conditions: Sequence[str] | None = None) -> pd.DataFrame:
    """Mean per cell and condition, over sources (the figure of the four cells): ``em`` (%), ``gold_nll`` (nats),
    ``tv_reprefill``, ``jsd_reprefill``, ``argmax_agree`` and ``sequence_agree`` (%), and ``sources``."""
    df = table if conditions is None else table[table["condition"].isin(conditions)]
    pct = {"em", "argmax_agree", "sequence_agree"}
    cols = ["em", "gold_nll", "tv_reprefill", "jsd_reprefill", "argmax_agree", "sequence_agree"]
    g = df.assign(**{c: df[c].astype(float) * (100.0 if c in pct else 1.0) for c in cols})
    out = g.groupby(["condition", "side", "tail"], sort=False)[cols].mean()
    return out.assign(sources=g.groupby(["condition", "side", "tail"], sort=False).size()).reset_index()


def plot_cells(means: pd.DataFrame, endpoints: Sequence[str] = ("gold_nll", "em", "sequence_agree"), *,
               title: str = ""):
    """The four cells: one panel per endpoint, the cells on the x axis (upstream/downstream within each tail), one
    line per condition. Returns the figure."""

    labels = {"gold_nll": "gold NLL (nats/token)", "em": "EM (%)", "sequence_agree": "sequence agreement (%)",
              "argmax_agree": "argmax agreement (%)", "tv_reprefill": "first-token TV", "jsd_reprefill": "JSD"}
    order = [f"{z}/{t}" for z, t in CELLS]
    fig, axes = plt.subplots(1, len(endpoints), figsize=(4.2 * len(endpoints), 3.6), squeeze=False)
    m = means.assign(cell=means["side"] + "/" + means["tail"])
    for ax, ep in zip(axes[0], endpoints):
        for cond, g in m.groupby("condition", sort=False):
            g = g.set_index("cell").reindex(order)
            ax.plot(range(len(order)), g[ep], marker="o", label=cond)
        ax.set_xticks(range(len(order)), [c.replace("/", "\n") for c in order], fontsize=8)
        ax.set_title(labels.get(ep, ep), fontsize=10)
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig



def min_separable_sources(family_size: int = len(SECONDARY_FAMILY), alpha: float = 0.05) -> int:
    """The fewest sources whose bootstrap p can separate a member of a Holm family: the smallest n with
    ``family_size * p_floor(n) < alpha`` (:func:`sur_lab.analysis.decisions.p_floor`, ``2 ** (1 - n)``: every
    source on one side). E.g. 8 for the secondary family of five at 5 %: an EM stratum of fewer sources decides
    nothing, whatever its estimate.

    Raises:
        ValueError: naming ``family_size`` when < 1 or ``alpha`` outside (0, 1).
    """
    if isinstance(family_size, bool) or int(family_size) != family_size or family_size < 1:
        raise ValueError(f"family_size={family_size!r} must be an integer >= 1")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha!r} must lie in (0, 1)")
    return min_separating_units(alpha / family_size)


def margin_sizing(estimate: float, tost_low: float, tost_high: float, n_sources: int,
                  margin: float | None = None) -> str:
    """Why the NLL side contrast's equivalence test did not decide, in words with the numbers: the 90 % interval's
    half-width against the room the margin leaves around the estimate, and about how many sources would close the
    gap if the estimate and the spread per source held (the half-width shrinks as 1/sqrt(sources)).

    Args:
        estimate: the contrast's estimate, nats.
        tost_low, tost_high: its ``1 - 2 alpha`` interval, nats.
        n_sources: the bootstrap's sources (>= 1).
        margin: the equivalence margin, nats (default :data:`NLL_SIDE_MARGIN`).

    Raises:
        ValueError: naming ``n_sources`` when < 1, ``tost_high`` when below ``tost_low``, or ``margin`` when not > 0.
    """
    m = NLL_SIDE_MARGIN.value if margin is None else float(margin)
    if not m > 0:
        raise ValueError(f"margin={margin!r} must be > 0")
    if isinstance(n_sources, bool) or int(n_sources) != n_sources or n_sources < 1:
        raise ValueError(f"n_sources={n_sources!r} must be an integer >= 1")
    if not tost_high >= tost_low:
        raise ValueError(f"tost_high={tost_high!r} must be >= tost_low={tost_low!r}")
    half = (tost_high - tost_low) / 2
    room = m - abs(estimate)
    head = f"the 90 % interval is too wide for the margin: half-width {half:.3g} nats"
    if room <= 0:
        return f"{head}, and the estimate itself lies outside ±{m:g} nats"
    need = math.ceil(n_sources * (half / room) ** 2)
    return (f"{head} where ±{m:g} leaves {room:.3g} around the estimate; about {need} sources would fit it if the "
            "estimate and the spread per source held")


def nll_side_decision(t15: pd.DataFrame, *, alpha: float = 0.05, decide: bool = True) -> tuple[pd.Series | None, str]:
    """The preregistered primary decided (issue 36): complete replay's NLL side contrast (Table 15's ``Replay``,
    ``NLL side`` row), tested alone, "equivalent" when its 90 % interval lies inside ±:data:`NLL_SIDE_MARGIN`
    (:func:`sur_lab.analysis.decisions.judge`). The one rule :func:`findings` words and the study's decided table
    (:func:`sur_lab.studies.evidence_location.study.decided_table`) records.

    Args:
        t15: :func:`factorial_table`. alpha: the level. decide: ``False`` at a plumbing-check size.

    Returns:
        ``(row, verdict)``: the Table 15 row (``None`` when it is missing or has no source) and one of
        :data:`sur_lab.analysis.decisions.VERDICTS` ("n/a" without a row, "not decided" without ``decide``).
    """
    sel = t15[(t15["condition"] == COMPLETE_REPLAY) & (t15["hypothesis"] == "NLL side")]
    r = sel.iloc[0] if len(sel) else None
    if r is None or not r.n_clusters:
        return None, (NA if decide else NOT_DECIDED)
    return r, judge(r.estimate, r.ci_low, r.ci_high, p_adj=r.p, alpha=alpha, tost=(r.tost_low, r.tost_high),
                    margin=NLL_SIDE_MARGIN.value, n=int(r.n), decide=decide)


def findings(t15: pd.DataFrame, t16: pd.DataFrame, gaps: pd.DataFrame | None = None, *, alpha: float = 0.05,
             decide: bool = True) -> pd.DataFrame:
    """The paper's three findings (appendix 10.2-10.3), each judged on this run's tables by a rule declared here
    (issue 36; :func:`sur_lab.analysis.decisions.judge`):

    - ``NLL side contrast null`` (the preregistered primary, tested alone): reproduced when complete replay's NLL
      side contrast is *equivalent* to 0 within :data:`NLL_SIDE_MARGIN` (its 90 % interval inside ±0.1 nats); not
      reproduced when it separates from 0; otherwise not separated, its interval wider than the margin (undecided);
    - ``EM side contrast positive``: reproduced when replay's EM side contrast "beats" 0 (interval above 0 and Holm
      p < ``alpha`` over :data:`SECONDARY_FAMILY`); not reproduced when it separates below 0; undecided otherwise;
    - ``fixed-slot refresh carries the side effect``: on every Table 16 fidelity endpoint but the NLL, the fixed
      slot's side contrast beats 0 (Holm over the endpoints) and the paired difference replay minus fixed slot
      (:func:`slot_gap_table`) is equivalent to 0 within :data:`FIXED_SLOT_SHARE` of replay's estimate (every
      endpoint must hold: an intersection, tested at ``alpha`` each); not reproduced when some endpoint's difference
      separates (Holm over the endpoints) or its side contrast separates below 0.

    Args:
        t15: :func:`factorial_table`; t16: :func:`table16`; gaps: :func:`slot_gap_table` (``None``: the fixed-slot
            finding is undecided).
        alpha: the level.
        decide: ``False`` at a plumbing-check size: every finding "not decided at this size".

    Returns:
        One row per finding: ``finding``, ``rule``, ``verdict`` (the decision's words), ``evidence`` (the numbers it
        read), ``reproduced`` (True / False; None when undecided: not separated, an empty EM stratum, or a smoke run).
    """
    def pick(df, cond, **kw):
        if df is None:
            return None
        sel = df if cond is None else df[df["condition"] == cond]
        for k, v in kw.items():
            sel = sel[sel[k] == v]
        return sel.iloc[0] if len(sel) else None

    def ci(r):
        unit = f" {r.unit}" if r.unit else ""
        interval = "no interval" if pd.isna(r.delta_low) else f"95 % CI {r.delta_low:+.4g} to {r.delta_high:+.4g}"
        return f"{r.delta:+.4g}{unit} ({interval})"

    def sources(n):
        return f"{int(n)} source{'' if int(n) == 1 else 's'}"

    def over(r):
        units = int(r.n or r.n_clusters)
        return sources(r.n_clusters) + (f" ({units} source-model units)" if units != r.n_clusters else "")

    out = []
    r, v = nll_side_decision(t15, alpha=alpha, decide=decide)
    m = NLL_SIDE_MARGIN.value
    if r is None:
        evidence = "n/a"
    else:
        tost = ("no 90 % interval" if pd.isna(r.tost_low) else
                f"90 % CI {r.tost_low:+.4g} to {r.tost_high:+.4g} against ±{m:g} nats")
        evidence = f"{ci(r)}, {tost}, p {r.p:.3g}, over {over(r)}"
        if v == NOT_SEPARATED and not pd.isna(r.tost_low):
            evidence += "; " + margin_sizing(r.estimate, r.tost_low, r.tost_high, int(r.n_clusters))
    words = {EQUIVALENT: f"equivalent within ±{m:g} nats", BEATS: "separated from 0 (above)",
             LOSES: "separated from 0 (below)", NA: "n/a", NOT_DECIDED: "not decided at this size"}
    out.append({"finding": "NLL side contrast null",
                "rule": f"replay's NLL side 90 % interval inside ±{m:g} nats (TOST, tested alone; margin: "
                        f"{NLL_SIDE_MARGIN.source})",
                "verdict": words.get(v, "not separated, interval wider than the margin"), "evidence": evidence,
                "reproduced": {EQUIVALENT: True, BEATS: False, LOSES: False}.get(v)})

    r = pick(t15, COMPLETE_REPLAY, hypothesis="EM side")
    if r is None or not r.n_clusters:
        v, evidence = (NA if decide else NOT_DECIDED), "empty EM stratum"
    else:
        v = judge(r.estimate, r.ci_low, r.ci_high, p_adj=r.p_adj, alpha=alpha, n=int(r.n), decide=decide)
        evidence = f"{ci(r)}, Holm p {r.p_adj:.3g} over {len(SECONDARY_FAMILY)}, {over(r)}"
        need = min_separable_sources(len(SECONDARY_FAMILY), alpha)
        if decide and v not in SEPARATED and r.n_clusters < need:
            evidence += (f"; a stratum of {sources(r.n_clusters)} cannot separate (its smallest Holm p is "
                         f"{min(1.0, len(SECONDARY_FAMILY) * p_floor(int(r.n_clusters))):.3g}): it needs >= {need}")
    out.append({"finding": "EM side contrast positive",
                "rule": f"replay's EM side interval above 0 and Holm p < {alpha:g} over the secondary family",
                "verdict": {BEATS: "positive", LOSES: "negative", NA: "n/a (empty EM stratum)",
                            NOT_DECIDED: "not decided at this size"}.get(v, "not separated at this size"),
                "evidence": evidence, "reproduced": {BEATS: True, LOSES: False}.get(v)})

    labels = [label for label in FIDELITY_ENDPOINTS if label != "Gold NLL"]
    fixed = {label: pick(t16, FIXED_SLOT_LABEL, endpoint=label) for label in labels}
    rep = {label: pick(t16, COMPLETE_REPLAY, endpoint=label) for label in labels}
    gap = {label: pick(gaps, None, endpoint=label) for label in labels}
    parts, calls = [], []
    complete = all(x is not None and x.n_clusters for x in (*fixed.values(), *rep.values(), *gap.values()))
    if complete:
        adjusted = holm({label: float(fixed[label].p) for label in labels})
        gap_adjusted = holm({label: float(gap[label].p) for label in labels})
        for label in labels:
            f, g, rp = fixed[label], gap[label], rep[label]
            side = judge(f.estimate, f.ci_low, f.ci_high, p_adj=adjusted[label], alpha=alpha, n=int(f.n),
                         decide=decide)
            margin = FIXED_SLOT_SHARE * abs(float(rp.estimate))
            same = judge(g.estimate, g.ci_low, g.ci_high, p_adj=gap_adjusted[label], alpha=alpha,
                         tost=(g.tost_low, g.tost_high),
                         margin=margin if margin > 0 else None, n=int(g.n), decide=decide)
            calls.append((side, same))
            shown = margin * (100.0 if g.kind == "binary" else 1.0)  # the margin in the printed unit
            against = (f"against ±{shown:.3g}{f' {g.unit}' if g.unit else ''}" if margin > 0
                       else "no margin (replay's estimate is 0)")
            parts.append(f"{label}: fixed slot {ci(f)} (Holm p {adjusted[label]:.3g}), replay {rp.delta:+.4g}, "
                         f"replay minus fixed slot {ci(g)} {against}")
    if not decide:
        v, ok = "not decided at this size", None
    elif not complete:
        v, ok = "n/a (a condition or the paired difference is missing)", None
    elif all(side == BEATS and same == EQUIVALENT for side, same in calls):
        v, ok = f"carried (within {FIXED_SLOT_SHARE:.0%} of replay on every endpoint)", True
    elif any(same in SEPARATED or side == LOSES for side, same in calls):
        v, ok = "not carried (replay and the fixed slot separate on some endpoint)", False
    else:
        v, ok = "not separated at this size", None
    out.append({"finding": "fixed-slot refresh carries the side effect",
                "rule": f"on each fidelity endpoint the fixed slot's side contrast beats 0 (Holm over {len(labels)}) "
                        f"and replay minus fixed slot is equivalent to 0 within {FIXED_SLOT_SHARE:.0%} of replay's "
                        "estimate (paired, TOST)",
                "verdict": v, "evidence": "; ".join(parts) or "n/a", "reproduced": ok})
    return pd.DataFrame(out).astype({"reproduced": object})  # True / False / None as Python values
