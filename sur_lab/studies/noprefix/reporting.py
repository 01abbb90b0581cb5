"""SAFE-KV reporting tables: drift tables, per-group endpoint summaries with bootstrap intervals (median and p95
time to first logit), the robustness checks (the EM-correct stratum, a second model family) and the largest workload's
quality gate with the paired donor − forward bootstrap. The operating rule and the design ledger are in
:mod:`~sur_lab.studies.noprefix.ledger`, the figures in :mod:`~sur_lab.studies.noprefix.figures`.

Source: SAFE-KV (Zhang, 2026), Figures 2-5, Tables 20 and 27.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from scipy.stats import pearsonr, rankdata, spearmanr

from sur_lab.analysis.decisions import paired_family, proportion_interval
from sur_lab.analysis.stats import paired_bootstrap
from sur_lab.studies.noprefix.selection import PROTOCOLS

# ---------------------------------------------------------------------------------------------------------------------
# Drift


def drift_table(runs: pd.DataFrame, by: str = "workload") -> pd.DataFrame:
    """Measured drift of the composed cache and its rank agreement with the risk score, per ``by`` group.

    Uses one row per request of :func:`~sur_lab.studies.noprefix.study.measure_drift` (``unit`` ``"full"``); documents
    after the first are pooled (the first document's drift is exactly 0 and its risk 0).

    Returns:
        DataFrame with ``by``, ``requests``, ``docs``, ``mean_drift`` (relative K/V deviation), ``spearman_rho``
        (risk vs drift, pooled) with its 95 % interval ``spearman_low``/``spearman_high`` (Fisher's z interval of
        the Pearson correlation of the ranks, ``scipy.stats.pearsonr(...).confidence_interval()``; NaN below four
        documents or for a perfect rank correlation) and ``within_request_rho`` (mean per-request Spearman over requests with >= 4 documents).

    Raises:
        ValueError: naming ``runs`` when it has no ``drift``/``risk`` columns.
    """
    if "drift" not in runs.columns or "risk" not in runs.columns:
        raise ValueError("runs has no drift/risk columns; pass sur_lab.studies.noprefix.measure_drift's rows")
    full = runs[runs["unit"] == "full"]
    rows = []
    for key, g in full.groupby(by, sort=False):
        drift = np.concatenate([np.asarray(d)[1:] for d in g["drift"]])
        risk = np.concatenate([np.asarray(r)[1:] for r in g["risk"]])
        within = [spearmanr(np.asarray(r)[1:], np.asarray(d)[1:])[0]
                  for r, d in zip(g["risk"], g["drift"]) if len(d) >= 4]
        low = high = np.nan
        if len(drift) > 3 and np.ptp(risk) > 0 and np.ptp(drift) > 0:
            interval = pearsonr(rankdata(risk), rankdata(drift)).confidence_interval(confidence_level=0.95)
            if interval.high > interval.low:  # a perfect rank correlation has no interval, never a zero-width one
                low, high = float(interval.low), float(interval.high)
        rows.append({by: key, "requests": len(g), "docs": len(drift), "mean_drift": float(drift.mean()),
                     "spearman_rho": float(spearmanr(risk, drift)[0]) if len(drift) > 2 else np.nan,
                     "spearman_low": low, "spearman_high": high,
                     "within_request_rho": float(np.nanmean(within)) if within else np.nan})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------------------------------
# Endpoints


def summarize(df: pd.DataFrame, by: Sequence[str] = ("dataset", "num_docs", "label", "protocol"), *,
              confidence: float = 0.95, seed: int = 0, n_boot: int = 2_000) -> pd.DataFrame:
    """Per-group endpoints of :func:`~sur_lab.studies.noprefix.study.runs_table` rows.

    Columns: ``by`` plus ``method``, ``selector``, ``unit``, ``n`` (requests), ``n_preserved`` and ``preservation``
    (mean) with its Clopper–Pearson interval ``ci_low``/``ci_high`` (:func:`sur_lab.analysis.decisions
    .proportion_interval`: never zero-width, 2 of 2 preserved is 16 % to 100 %), ``token_exact`` (mean), ``gold_em``
    (mean, NaN without a scorer), ``changed_wrong`` (count), ``repair_ratio`` (mean), ``timed`` (requests whose time
    to first logit was measured per request: only they enter the timing columns), ``ttfl_ms`` and ``full_ttfl_ms``
    (medians, ms), ``ttfl_p95_ms`` and ``full_ttfl_p95_ms`` (95th percentiles, ms, linear interpolation between order
    statistics as :func:`numpy.percentile`; SAFE-KV Figure 5 reports p95 beside the median), ``speedup``
    (``full_ttfl_ms / ttfl_ms`` of the medians) and the per-request speed-up's geometric mean ``speedup_gmean`` with
    its percentile bootstrap interval ``speedup_ci_low``/``speedup_ci_high`` (each request's full-prefill TTFL over
    its reuse TTFL, log scale; a source's requests resampled together when ``source_id`` is a column; NaN when every
    request has the same ratio, :func:`sur_lab.analysis.decisions.paired_family`). Timing columns are NaN for a group
    without timed requests.

    Raises:
        ValueError: naming ``by`` when a column is missing.
    """
    missing = [c for c in by if c not in df.columns]
    if missing:
        raise ValueError(f"by={tuple(by)!r}: {missing} are not columns of df")
    rows = []
    for key, g in df.groupby(list(by), sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        k = int(g["preserved"].astype(bool).sum())
        _, low, high = proportion_interval(k, len(g), alpha=1 - confidence)
        em = g["em"].dropna()
        cw = g["changed_wrong"].dropna()
        row = dict(zip(by, key))
        row.update({
            "method": g["method"].iloc[0], "selector": g["selector"].iloc[0], "unit": g["unit"].iloc[0],
            "n": len(g), "n_preserved": k, "preservation": float(g["preserved"].mean()), "ci_low": low,
            "ci_high": high, "token_exact": float(g["token_exact"].mean()),
            "gold_em": float(em.astype(float).mean()) if len(em) else np.nan,
            "changed_wrong": int(cw.astype(bool).sum()), "repair_ratio": float(g["repair_ratio"].mean()),
        })
        # Timings only from the requests timed per request (a batched pass yields none: their TTFL is NaN).
        t = g[np.isfinite(g["ttfl_ms"].astype(float)) & np.isfinite(g["full_ttfl_ms"].astype(float))]
        row.update({"timed": len(t), "ttfl_ms": float(t["ttfl_ms"].median()) if len(t) else np.nan,
                    "ttfl_p95_ms": _p95(t["ttfl_ms"]),
                    "full_ttfl_ms": float(t["full_ttfl_ms"].median()) if len(t) else np.nan,
                    "full_ttfl_p95_ms": _p95(t["full_ttfl_ms"])})
        row["speedup"] = row["full_ttfl_ms"] / row["ttfl_ms"] if row["ttfl_ms"] > 0 else np.nan
        row.update({"speedup_gmean": np.nan, "speedup_ci_low": np.nan, "speedup_ci_high": np.nan})
        if len(t):
            cluster = (t["dataset"].astype(str) + "/" + t["source_id"].astype(str)).to_numpy() \
                if {"dataset", "source_id"} <= set(t.columns) else None
            res = paired_family({("reuse", "full prefill"): (t["ttfl_ms"].to_numpy(np.float64),
                                                             t["full_ttfl_ms"].to_numpy(np.float64))},
                                kind="ratio", alpha=1 - confidence, cluster=cluster, n_boot=n_boot, seed=seed).iloc[0]
            row.update({"speedup_gmean": res["estimate"], "speedup_ci_low": res["ci_low"],
                        "speedup_ci_high": res["ci_high"]})
        rows.append(row)
    return pd.DataFrame(rows)


def _p95(values: pd.Series) -> float:
    """95th percentile (ms) of timed values, NaN when there are none."""
    v = values.to_numpy(np.float64)
    return float(np.percentile(v, 95)) if len(v) else np.nan


# ---------------------------------------------------------------------------------------------------------------------
# Robustness checks (SAFE-KV Figure 4) and the Noise64 quality gate (Table 20)

#: Paths of the robustness figure and table (SAFE-KV Figure 4): composition, the risk suffixes and the query and hybrid
#: starts, each under both protocols.
ROBUSTNESS_LABELS = ("Prefix composition", "Suffix K1 · risk", "Suffix K2 · risk", "Suffix K2 · query",
                     "Suffix K2 · hybrid")
#: The stratum columns :func:`stratum_table` puts beside the all-cases ones (suffix ``_correct``).
_STRATUM_COLS = ("n", "n_preserved", "preservation", "ci_low", "ci_high", "token_exact", "changed_wrong")


def em_correct(runs: pd.DataFrame) -> pd.DataFrame:
    """The EM-correct stratum: rows of the requests that full prefill answers correctly (SAFE-KV Figure 4, left).

    Args:
        runs: :func:`~sur_lab.studies.noprefix.study.runs_table` rows (``full_em``: Re-prefill's gold EM per request).

    Returns:
        The rows whose ``full_em`` is true (a copy; requests without a gold score are left out).

    Raises:
        ValueError: naming ``runs`` when it has no ``full_em`` column.
    """
    if "full_em" not in runs.columns:
        raise ValueError("runs has no full_em column; pass sur_lab.studies.noprefix.runs_table's rows")
    ok = runs["full_em"].map(lambda e: e is not None and not pd.isna(e) and bool(e))
    return runs[ok.astype(bool)].copy()


def stratum_table(runs: pd.DataFrame, by: Sequence[str] = ("workload", "label", "protocol"), *,
                  confidence: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """All requests and the EM-correct stratum (:func:`em_correct`) side by side, per ``by`` group.

    Returns:
        ``by``, ``method``, ``unit``, ``selector`` and the all-cases ``n``, ``preservation``, ``ci_low``, ``ci_high``,
        ``token_exact``, ``changed_wrong`` (:func:`summarize`), then the same columns over the EM-correct requests
        with the suffix ``_correct`` (``n_correct`` 0 and NaN preservation where a group has no such request).

    Raises:
        ValueError: as :func:`summarize` and :func:`em_correct`.
    """
    by = list(by)
    keep = [*by, "method", "unit", "selector", *_STRATUM_COLS]
    table = summarize(runs, by=by, confidence=confidence, seed=seed)[keep]
    correct = em_correct(runs)
    if len(correct):
        strat = summarize(correct, by=by, confidence=confidence, seed=seed)[[*by, *_STRATUM_COLS]]
    else:
        strat = pd.DataFrame(columns=[*by, *_STRATUM_COLS])
    strat = strat.rename(columns={c: f"{c}_correct" for c in _STRATUM_COLS})
    out = table.merge(strat, on=by, how="left")
    out["n_correct"] = out["n_correct"].fillna(0).astype(int)
    return out


def robustness_table(runs_by_model: Mapping[str, pd.DataFrame], *, labels: Sequence[str] = ROBUSTNESS_LABELS,
                     confidence: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """SAFE-KV Figure 4's robustness checks as one table: per model (the study model and a second family), each path
    of ``labels`` under each protocol, pooled over workloads, over all requests and the EM-correct stratum.

    Args:
        runs_by_model: model name -> its :func:`~sur_lab.studies.noprefix.study.runs_table` rows.
        labels: the paths to report (those a model's runs lack are left out).

    Returns:
        ``model`` then :func:`stratum_table` columns with ``by=("label", "protocol")``, rows in ``labels`` order.

    Raises:
        ValueError: naming ``runs_by_model`` when empty, or as :func:`stratum_table`.
    """
    if not runs_by_model:
        raise ValueError("runs_by_model is empty; pass at least the study model's runs")
    parts = []
    for model, runs in runs_by_model.items():
        sub = runs[runs["label"].isin(list(labels))]
        if sub.empty:
            continue
        t = stratum_table(sub, by=("label", "protocol"), confidence=confidence, seed=seed)
        t.insert(0, "model", model)
        order = {lab: i for i, lab in enumerate(labels)}
        prot = {p: i for i, p in enumerate(PROTOCOLS)}
        t = t.sort_values(["label", "protocol"], key=lambda c: c.map(order if c.name == "label" else prot))
        parts.append(t)
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def protocol_gap(runs: pd.DataFrame, label: str = "Suffix K1 · risk", *, n_boot: int = 10_000, seed: int = 0,
                 ci: float = 95.0):
    """Donor-copy minus actual forwarding in answer preservation for one path: a paired bootstrap over sources.

    Each replicate draws sources (``source_id``) with replacement within each dataset and keeps *all* rows of a drawn
    source together, its donor and its forward rows at every workload, so the interval is the paired one SAFE-KV
    Table 20 reports (``+0.20 [0.06, 0.34]``); :func:`sur_lab.analysis.stats.paired_bootstrap` with the protocol as
    the method.

    Args:
        runs: :func:`~sur_lab.studies.noprefix.study.runs_table` rows (``dataset``, ``source_id``, ``protocol``,
            ``preserved``).
        label: the path compared.
        n_boot, seed, ci: replicates (>= 1), generator seed, coverage in percent.

    Returns:
        :class:`sur_lab.analysis.stats.BootstrapResult` (``diff``: donor − forward, a fraction; ``low``/``high``).

    Raises:
        ValueError: naming ``label`` when the runs lack its donor or forward rows, ``runs`` when a source lacks one
            protocol's rows; or as :func:`~sur_lab.analysis.stats.paired_bootstrap`.
    """
    sub = runs[runs["label"] == label]
    missing = [p for p in ("donor", "forward") if p not in set(sub["protocol"])]
    if missing:
        raise ValueError(f"label={label!r}: runs hold no {' or '.join(missing)} rows for it")
    return paired_bootstrap(sub, metric_col="preserved", method_a="donor", method_b="forward",
                            method_col="protocol", source_col="source_id", strata_col="dataset", n_boot=n_boot,
                            seed=seed, ci=ci)


def quality_gate(runs: pd.DataFrame, *, num_docs: int, label: str = "Suffix K1 · risk", confidence: float = 0.95,
                 seed: int = 0) -> pd.DataFrame:
    """SAFE-KV Table 20: the quality gate of the largest workload (Noise64 in the ``paper`` preset).

    For each workload with ``num_docs`` documents: full prefill, the actual-forwarding path of ``label`` and its
    donor-copy path (diagnostic), in that order, with answer preservation (95 % bootstrap CI), token exactness, gold EM,
    changed-wrong, the mean repair ratio and the median and p95 TTFL (timed requests), and the paired donor − forward
    difference in preservation with its interval (:func:`protocol_gap`, sources resampled within the workload).

    Returns:
        Columns ``workload``, ``path``, ``protocol``, ``n``, ``preservation``, ``ci_low``, ``ci_high``,
        ``token_exact``, ``gold_em``, ``changed_wrong``, ``repair_ratio``, ``timed``, ``ttfl_ms``, ``ttfl_p95_ms``,
        ``donor_minus_forward``, ``gap_ci_low``, ``gap_ci_high`` (the workload's paired difference, on each row).

    Raises:
        ValueError: naming ``num_docs`` when no workload has that many documents, or as :func:`protocol_gap`.
    """
    sub = runs[runs["num_docs"] == num_docs]
    if sub.empty:
        raise ValueError(f"num_docs={num_docs!r}: the runs have no such workload (have {sorted(set(runs['num_docs']))})")
    cols = ["workload", "path", "protocol", "n", "preservation", "ci_low", "ci_high", "token_exact", "gold_em",
            "changed_wrong", "repair_ratio", "timed", "ttfl_ms", "ttfl_p95_ms"]
    parts = []
    for wl, g in sub.groupby("workload", sort=False):
        gap = protocol_gap(g, label, seed=seed, ci=100 * confidence)
        full = g[(g["unit"] == "full") & (g["protocol"] == "forward")]
        path = g[g["label"] == label]
        summ = summarize(pd.concat([full, path]), by=("workload", "label", "protocol"), confidence=confidence,
                         seed=seed)
        names = {"full": "Full prefill"}
        summ["path"] = [names.get(u) or (f"Donor-copy {lab} (diagnostic)" if p == "donor" else
                                         f"Actual-forwarding {lab}")
                        for u, lab, p in zip(summ["unit"], summ["label"], summ["protocol"])]
        order = summ["unit"].eq("full").map({True: 0, False: 1}) * 10 + summ["protocol"].map(
            {p: i for i, p in enumerate(PROTOCOLS)})
        summ = summ.iloc[np.argsort(order.to_numpy(), kind="stable")]
        summ = summ[cols].assign(donor_minus_forward=gap.diff, gap_ci_low=gap.low, gap_ci_high=gap.high)
        parts.append(summ)
    return pd.concat(parts, ignore_index=True)


def _pick(summary: pd.DataFrame, label: str, protocol: str = "forward") -> pd.Series | None:
    rows = summary[(summary["label"] == label) & (summary["protocol"] == protocol)]
    return rows.iloc[0] if len(rows) else None


__all__ = [
    "ROBUSTNESS_LABELS",
    "drift_table",
    "em_correct",
    "protocol_gap",
    "quality_gate",
    "robustness_table",
    "stratum_table",
    "summarize",
]
