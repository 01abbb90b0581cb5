"""SAFE-KV reporting: drift tables, per-group endpoint summaries with bootstrap intervals, the robustness checks (the
EM-correct stratum, a second model family), the largest workload's quality gate with the paired donor − forward
bootstrap, the operating rule, the design ledger and the figures (SAFE-KV Figures 2-5 analogues).

Source: SAFE-KV (Zhang, 2026), Figures 2-5, Tables 20 and 27.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from scipy.stats import pearsonr, rankdata, spearmanr

from sur_lab.analysis.conclusions import paired_outcomes
from sur_lab.analysis.decisions import (
    BEATS,
    HOLDS,
    Family,
    Margin,
    PowerBasis,
    PowerDesign,
    best_of,
    bound_claim,
    discordance_from_interval,
    paired_family,
    proportion_interval,
    ratio_verdict,
    sentence,
)
from sur_lab.analysis.stats import paired_bootstrap
from sur_lab.studies.noprefix.selection import PROTOCOL_LABELS, PROTOCOLS, UNITS

#: The design ledger's paired comparisons (issue 36; :mod:`sur_lab.analysis.decisions`): each route against the one it
#: is meant to match or improve, answer preservation, requests paired, the sources clustered (a source's requests at
#: every workload together), Holm over the ledger. "Worked" needs "beats" or "equivalent" within the margin.
LEDGER_MARGIN = Margin(0.05, "5 points of preservation: the loss the operating rule's required 95 % leaves")
LEDGER = Family("design ledger", "binary",
                "w4 and linked intervals against the suffix, the adaptive suffix against suffix K2, SUR against the "
                "adaptive suffix, the query and hybrid starts against the risk start (and hybrid against query): "
                "preservation, pooled over workloads", margin=LEDGER_MARGIN)
#: Donor-copy is a usable proxy of actual forwarding when donor - forward preservation is equivalent to 0 within
#: :data:`LEDGER_MARGIN` (paired over requests, sources clustered; tested alone).
DONOR_PROXY = Family("donor-copy as a proxy", "binary", "donor-copy minus actual forwarding of suffix K1 (risk), "
                     "preservation", primary=True, margin=LEDGER_MARGIN)
#: The power statement's basis (issue 40; :data:`POWER`): the donor-proxy comparison's discordance rate per request,
#: from SAFE-KV's Table 20 (Noise64, 50 requests): donor-copy minus forwarding +0.20 [0.06, 0.34] in preservation
#: (:func:`~sur_lab.analysis.decisions.discordance_from_interval`).
PRIMARY_POWER = PowerBasis(discordance_from_interval(0.20, 0.06, 0.34, 50),
                           "SAFE-KV's Table 20, donor-copy - forwarding +0.20 [0.06, 0.34] on 50 requests")


def _power_clusters(p: Mapping[str, Any]) -> list[int]:
    """Requests per source of the main design (sources clustered): per dataset, source ``i`` serves every workload
    whose ``n_sources`` exceeds ``i`` (:func:`~sur_lab.studies.noprefix.study.cases`)."""
    per = [sum(k > i for k in p["n_sources"]) for i in range(max(p["n_sources"]))]
    return per * len(p["datasets"])


#: The primary comparison's power design (issue 40): the study's ``mde`` and ``power_line`` (the
#: :class:`~sur_lab.studies.base.Study` base's) at its parameters.
POWER = PowerDesign("donor-copy vs actual forwarding (suffix K1, risk), preservation", DONOR_PROXY,
                    PRIMARY_POWER, lambda p: (len(_power_clusters(p)), _power_clusters(p)), what="requests",
                    clusters="sources")


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


@dataclass(frozen=True)
class OperatingDecision:
    """The operating rule's choice for one workload.

    Attributes:
        serve: ``"repair"`` (a reuse path) or ``"full prefill"``.
        label: the chosen reuse path's label (``"Full prefill"`` when serving by full prefill).
        preservation: its answer preservation (1.0 for full prefill).
        ttfl_ms: its median TTFL, ms.
        full_ttfl_ms: full prefill's median TTFL, ms.
        reason: why, in words, with the bounds it read.
    """

    serve: str
    label: str
    preservation: float
    ttfl_ms: float
    full_ttfl_ms: float
    reason: str = field(default="")


def operating_rule(summary: pd.DataFrame, *, runs: pd.DataFrame | None = None, required_preservation: float = 0.95,
                   protocol: str = "forward", alpha: float = 0.05, decide: bool = True, seed: int = 0,
                   n_boot: int = 2_000) -> OperatingDecision:
    """Serve by full prefill unless a reuse path is *shown* to reach the required preservation *and* to be faster
    (SAFE-KV Fig. 5), by the decision rules of :mod:`sur_lab.analysis.decisions` (issue 36).

    Candidates are the summary rows of ``protocol`` (donor-copy is a diagnostic and never a serving path) other than
    full prefill and other than oracle-selected units (gold evidence labels are unknown when serving), including prefix
    composition without repair. The rule picks one of several candidates, so both of its tests are corrected for
    the m candidates: a candidate qualifies when the lower Clopper–Pearson bound of its preservation (``n_preserved``
    of ``n`` requests, :func:`~sur_lab.analysis.decisions.bound_claim` at level ``alpha / m``, Bonferroni) reaches
    ``required_preservation`` (2 of 2 preserved never does: the bound is at most 16 %) and it is faster than full
    prefill: with ``runs``, its per-request speed-up "beats" 1 in the family of the m candidates
    (:func:`~sur_lab.analysis.decisions.paired_family`, ratios, Holm, a source's requests clustered); without them,
    the interval of :func:`summarize` lies above 1 (:func:`~sur_lab.analysis.decisions.ratio_verdict`, not corrected
    for the selection). Neither a handful of requests nor CPU timing noise can then select a path. The qualifying
    candidate with the smallest median TTFL is served; with none, full prefill.

    Args:
        summary: one workload's rows of :func:`summarize`.
        runs: that workload's per-request rows (``label``, ``protocol``, ``case_id``, ``ttfl_ms``, ``full_ttfl_ms``,
            ``dataset``, ``source_id``), for the speed-up family; ``None``: the summary's intervals.
        required_preservation: in [0, 1].
        protocol: the serving protocol (``"forward"``).
        alpha: the family-wise level of the choice.
        decide: ``False`` at a plumbing-check size: full prefill, "not decided at this size".
        seed, n_boot: the speed-up family's generator seed and resamples.

    Raises:
        ValueError: naming ``required_preservation`` outside [0, 1], ``summary`` when it has no full-prefill row or
            mixes workloads (several full-prefill TTFLs).
    """
    if not 0.0 <= required_preservation <= 1.0:
        raise ValueError(f"required_preservation={required_preservation!r} must lie in [0, 1]")
    full_rows = summary[summary["unit"] == "full"]
    if full_rows.empty:
        raise ValueError("summary has no full-prefill row")
    if full_rows["full_ttfl_ms"].nunique() > 1:
        raise ValueError("summary mixes workloads; pass one workload's rows")
    full_ttfl = float(full_rows["ttfl_ms"].iloc[0])
    req = required_preservation
    if not decide:
        return OperatingDecision("full prefill", "Full prefill", 1.0, full_ttfl, full_ttfl,
                                 "not decided at this size (a plumbing check): full prefill by default")
    # Gold-evidence (oracle) selection is unavailable when serving, like donor-copy: diagnostics only.
    cand = summary[(summary["protocol"] == protocol) & (summary["unit"] != "full") & (summary["selector"] != "oracle")]
    m = max(1, len(cand))
    shown = [bound_claim(int(r["n_preserved"]), int(r["n"]), at_least=req, alpha=alpha / m) == HOLDS
             for _, r in cand.iterrows()]
    ok = cand[shown] if len(cand) else cand
    if ok.empty:
        if cand.empty:
            return OperatingDecision("full prefill", "Full prefill", 1.0, full_ttfl, full_ttfl, "no reuse path ran")
        best = cand.sort_values(["preservation", "n"], ascending=False).iloc[0]
        _, low, _ = proportion_interval(int(best["n_preserved"]), int(best["n"]), alpha=alpha / m)
        return OperatingDecision("full prefill", "Full prefill", 1.0, full_ttfl, full_ttfl,
                                 f"no reuse path is shown to preserve {req:.0%}: the best, {best['label']}, preserves "
                                 f"{int(best['n_preserved'])} of {int(best['n'])} requests (lower bound {low:.0%}, "
                                 f"Bonferroni over {m} candidates)")
    if runs is not None:
        verdicts = _speed_family(cand, runs, protocol=protocol, alpha=alpha, seed=seed, n_boot=n_boot)
        faster = ok[[verdicts.get(lab) == BEATS for lab in ok["label"]]]
    else:
        faster = ok[[ratio_verdict(r["speedup_gmean"], r["speedup_ci_low"], r["speedup_ci_high"]) == BEATS
                     for _, r in ok.iterrows()]]
    if faster.empty:
        best = ok.sort_values(["ttfl_ms", "repair_ratio"]).iloc[0]
        return OperatingDecision(
            "full prefill", "Full prefill", 1.0, full_ttfl, full_ttfl,
            f"no path shown to preserve {req:.0%} is shown faster than full prefill; the fastest, {best['label']}, "
            f"has speed-up {_speedup(best)}")
    best = faster.sort_values(["ttfl_ms", "repair_ratio"]).iloc[0]
    _, low, _ = proportion_interval(int(best["n_preserved"]), int(best["n"]), alpha=alpha / m)
    return OperatingDecision(
        "repair", str(best["label"]), float(best["preservation"]), float(best["ttfl_ms"]), full_ttfl,
        f"{best['label']} preserves {int(best['n_preserved'])} of {int(best['n'])} requests (lower bound {low:.1%}, "
        f"Bonferroni over {m} candidates) at {best['ttfl_ms']:.0f} ms vs {full_ttfl:.0f} ms (speed-up "
        f"{_speedup(best)})",
    )


def _speed_family(cand: pd.DataFrame, runs: pd.DataFrame, *, protocol: str, alpha: float, seed: int,
                  n_boot: int) -> dict[str, str]:
    """label -> verdict of each candidate's per-request speed-up over full prefill (timed requests), decided as one
    family (ratios, Holm, a source's requests clustered)."""
    timed = runs[(runs["protocol"] == protocol) & np.isfinite(runs["ttfl_ms"].astype(float))
                 & np.isfinite(runs["full_ttfl_ms"].astype(float))]
    outcomes, clusters = {}, {}
    for label in cand["label"]:
        t = timed[timed["label"] == label]
        if len(t):
            outcomes[(label, "Full prefill")] = (t["ttfl_ms"].to_numpy(np.float64),
                                                 t["full_ttfl_ms"].to_numpy(np.float64))
            clusters[(label, "Full prefill")] = (t["dataset"].astype(str) + "/" + t["source_id"].astype(str)).to_numpy()
    if not outcomes:
        return {}
    res = paired_family(outcomes, kind="ratio", alpha=alpha, cluster=clusters, seed=seed, n_boot=n_boot,
                        family="serving candidates")
    return dict(zip(res["a"], res["verdict"]))


def _speedup(row: pd.Series) -> str:
    """``"1.35x (95 % CI 1.10x to 1.60x)"``, or ``"... (no interval)"`` when every request has the same ratio."""
    if pd.isna(row["speedup_ci_low"]):
        return f"{row['speedup_gmean']:.2f}x (no interval)"
    return f"{row['speedup_gmean']:.2f}x (95 % CI {row['speedup_ci_low']:.2f}x to {row['speedup_ci_high']:.2f}x)"


def _pick(summary: pd.DataFrame, label: str, protocol: str = "forward") -> pd.Series | None:
    rows = summary[(summary["label"] == label) & (summary["protocol"] == protocol)]
    return rows.iloc[0] if len(rows) else None


def _fmt(row: pd.Series | None) -> str:
    if row is None:
        return "not run"
    return (f"{row['preservation']:.1%} ({int(row['n_preserved'])} of {int(row['n'])}; 95 % CI {row['ci_low']:.2f} to "
            f"{row['ci_high']:.2f}) at ratio {row['repair_ratio']:.2f}")


#: The ledger's words for a decided verdict (:mod:`sur_lab.analysis.decisions`).
_LEDGER_WORDS = {"beats": "worked", "equivalent": "worked", "loses to": "did not", "not separated": "not separated",
                 "not decided": "not decided", "n/a": "not run", "holds": "worked", "fails": "did not",
                 "not shown": "not shown"}


def design_ledger(summary: pd.DataFrame, *, runs: pd.DataFrame | None = None, required_preservation: float = 0.95,
                  budgets: Sequence[float] = (50,), drift: Mapping | pd.Series | None = None,
                  decisions: dict[str, OperatingDecision] | None = None, proxy_margin: float = LEDGER_MARGIN.value,
                  seed: int = 0, decide: bool = True) -> pd.DataFrame:
    """The design ledger (SAFE-KV Table 27) filled from measurements (actual forwarding unless stated), each row
    judged by a declared criterion through :mod:`sur_lab.analysis.decisions` (issue 36), never by comparing two
    point estimates.

    A route "worked" when: for an absolute row, the lower Clopper–Pearson bound of its preservation reaches
    ``required_preservation``; for a route against another, the paired difference on the same requests beats 0 or is
    equivalent to 0 within :data:`LEDGER_MARGIN` (the :data:`LEDGER` family, Holm over the ledger's comparisons,
    sources clustered); for donor-copy, donor minus forward is equivalent to 0 within ``proxy_margin``; for the risk
    score, the lower bound of Spearman's rho with measured drift reaches 0.5. It "did not" when the opposite is shown,
    and is "not separated" / "not shown" otherwise.

    Args:
        summary: :func:`summarize` pooled over workloads with ``by=("label", "protocol")``.
        runs: the per-request rows behind ``summary`` (:func:`~sur_lab.studies.noprefix.study.runs_table`: ``label``,
            ``protocol``, ``case_id``, ``dataset``, ``source_id``, ``preserved``) for the paired rows; without them
            those rows are not judged.
        required_preservation: the preservation a route must be shown to reach, in [0, 1].
        budgets: the adaptive/SUR budgets that were run (the largest is compared).
        drift: :func:`drift_table`'s row (``spearman_rho``, ``spearman_low``, ``spearman_high``), if measured.
        decisions: workload -> :func:`operating_rule` decision, if computed.
        proxy_margin: the donor-copy equivalence margin, in (0, 1] (5 points by default).
        seed: the generator seed (clustered bootstrap).
        decide: ``False`` at a plumbing-check size: every verdict "not decided".

    Returns:
        DataFrame with columns ``experiment``, ``key_result``, ``verdict`` (``"worked"``, ``"did not"``,
        ``"not separated"``, ``"not shown"``, ``"not run"`` or ``"not decided"``) and ``criterion``.

    Raises:
        ValueError: naming ``proxy_margin`` outside (0, 1].
    """
    if not 0.0 < proxy_margin <= 1.0:
        raise ValueError(f"proxy_margin={proxy_margin!r} must lie in (0, 1]")
    b = max(budgets) if budgets else None
    req = required_preservation
    labels = {"comp": "Prefix composition", "doc": "Doc K2 · oracle", "w4": "w4 K1 · risk", "suf1": "Suffix K1 · risk",
              "suf2": "Suffix K2 · risk", "link": "Linked K2 · oracle", "osuf": "Suffix K1 · oracle",
              "ada": f"Adaptive K2 {b:g}% · risk" if b is not None else "",
              "sur": f"SUR {b:g}%" if b is not None else "",
              "qsuf": "Suffix K2 · query", "hsuf": "Suffix K2 · hybrid"}
    row = {k: _pick(summary, v) for k, v in labels.items()}
    pairs = {"w4": ("w4", "suf1"), "link": ("link", "osuf"), "ada": ("ada", "suf2"), "sur": ("sur", "ada"),
             "query": ("qsuf", "suf2"), "hybrid-query": ("hsuf", "qsuf"), "hybrid-risk": ("hsuf", "suf2")}
    paired: dict[str, pd.Series] = {}
    if runs is not None and not runs.empty:
        fwd = runs[runs["protocol"] == "forward"].assign(_p=runs["preserved"].astype(float),
                                                         _src=runs["dataset"].astype(str) + "/"
                                                         + runs["source_id"].astype(str))
        wanted = [(labels[x], labels[y]) for x, y in pairs.values()]
        outcomes, clusters = paired_outcomes(fwd, wanted, "_p", arm_col="label", case_col="case_id",
                                             cluster_col="_src")
        if outcomes:
            res = paired_family(outcomes, family=LEDGER, cluster=clusters, seed=seed, decide=decide)
            by_pair = {(r["a"], r["b"]): r for _, r in res.iterrows()}
            paired = {k: by_pair[(labels[x], labels[y])] for k, (x, y) in pairs.items()
                      if (labels[x], labels[y]) in by_pair}

    def absolute(key: str) -> str:
        r = row[key]
        if r is None:
            return "not run"
        return _LEDGER_WORDS[bound_claim(int(r["n_preserved"]), int(r["n"]), at_least=req, decide=decide)]

    def versus(key: str) -> tuple[str, str]:
        r = paired.get(key)
        if r is None:
            return "not run", "no paired requests" if runs is None else "not run"
        return _LEDGER_WORDS[r["verdict"]], sentence(r, what="requests", clusters="sources", family_name=False)

    def both(keys: Sequence[str]) -> str:
        words = [versus(k)[0] for k in keys]
        if "not run" in words or "not decided" in words:
            return "not decided" if "not decided" in words else "not run"
        if all(w == "worked" for w in words):
            return "worked"
        return "did not" if "did not" in words else "not separated"

    margin = f"beats or is equivalent within ±{100 * LEDGER_MARGIN.value:g} points (paired, Holm over the ledger)"
    rows = [
        ("Prefix composition (no repair)", _fmt(row["comp"]), absolute("comp"),
         f"preserves >= {req:.0%} (lower 95 % bound)"),
        ("Document-only repair (oracle: the gold documents)", f"{_fmt(row['doc'])}; oracle suffix {_fmt(row['osuf'])}",
         absolute("doc"), f"preserves >= {req:.0%} (lower 95 % bound)"),
        ("Downstream window w4 vs suffix K1 (risk, same start)", versus("w4")[1], versus("w4")[0],
         f"window {margin} the suffix"),
        ("Linked intervals vs suffix (oracle)", versus("link")[1], versus("link")[0], f"linked {margin} the suffix"),
        (f"Adaptive suffix {b:g}% vs suffix K2 (risk)", versus("ada")[1], versus("ada")[0],
         f"trimmed suffix {margin} suffix K2"),
        (f"SUR {b:g}% vs adaptive suffix {b:g}%", versus("sur")[1], versus("sur")[0],
         f"SUR {margin} the adaptive suffix at the same budget"),
        ("Query-guided vs risk-guided start (suffix K2)", versus("query")[1], versus("query")[0],
         f"query selector {margin} the risk selector"),
        ("Hybrid vs query- and risk-guided start (suffix K2)",
         f"{versus('hybrid-query')[1]}; {versus('hybrid-risk')[1]}", both(("hybrid-query", "hybrid-risk")),
         f"hybrid (mean of risk and query ranks) {margin} each of its two parts"),
        _donor_row(row["suf1"], _pick(summary, labels["suf1"], "donor"), runs, proxy_margin, seed, decide),
    ]
    if drift is not None:
        rho, low, high = (float(drift[k]) for k in ("spearman_rho", "spearman_low", "spearman_high"))
        verdict = ("not decided" if not decide else "not shown" if np.isnan(low) else
                   "worked" if low >= 0.5 else "did not" if high < 0.5 else "not shown")
        interval = "no interval" if np.isnan(low) else f"95 % CI {low:.2f} to {high:.2f}"
        rows.append(("Risk score vs measured document drift", f"Spearman rho = {rho:.2f} ({interval})", verdict,
                     "rho >= 0.5 (lower 95 % bound)"))
    if decisions:
        served = {wl: d.serve if d.serve == "full prefill" else f"repair ({d.label})" for wl, d in decisions.items()}
        verdict = ("not decided" if not decide else
                   "worked" if any(d.serve == "repair" for d in decisions.values()) else "did not")
        rows.append(("Operating rule", "; ".join(f"{wl}: {v}" for wl, v in served.items()), verdict,
                     f"some workload is served by a reuse path shown faster than full prefill and shown to preserve "
                     f">= {req:.0%}"))
    return pd.DataFrame(rows, columns=["experiment", "key_result", "verdict", "criterion"])


def _donor_row(suf1: pd.Series | None, dsuf: pd.Series | None, runs: pd.DataFrame | None, margin: float,
               seed: int, decide: bool) -> tuple:
    """The ledger's donor-copy row: donor minus forward preservation of suffix K1 (risk), paired over requests with
    the sources clustered, equivalent to 0 within ``±margin`` (:data:`DONOR_PROXY`)."""
    name = "Donor-copy vs actual forwarding (suffix K1, risk)"
    criterion = (f"donor − forward preservation equivalent to 0 within ±{100 * margin:g} points (paired over requests, "
                 "sources clustered, 90 % interval inside the margin): the diagnostic is a usable proxy")
    if dsuf is None or suf1 is None:
        return name, f"donor {_fmt(dsuf)}; forward {_fmt(suf1)}", "not run", criterion
    if runs is None:
        return name, f"donor {_fmt(dsuf)}; forward {_fmt(suf1)}; no per-request runs for the paired interval", \
            "not run", criterion
    sub = runs[runs["label"] == "Suffix K1 · risk"]
    sub = sub.assign(_p=sub["preserved"].astype(float), _src=sub["dataset"].astype(str) + "/"
                     + sub["source_id"].astype(str))
    outcomes, clusters = paired_outcomes(sub, [("donor", "forward")], "_p", arm_col="protocol", case_col="case_id",
                                         cluster_col="_src")
    family = replace(DONOR_PROXY, margin=Margin(margin, LEDGER_MARGIN.source if margin == LEDGER_MARGIN.value
                                                else "the ledger's proxy_margin argument"))
    res = paired_family(outcomes, family=family, cluster=clusters, seed=seed, decide=decide).iloc[0]
    verdict = {"equivalent": "worked", "beats": "did not", "loses to": "did not"}.get(
        res["verdict"], _LEDGER_WORDS[res["verdict"]])
    return name, sentence(res, what="requests", clusters="sources"), verdict, criterion


def conclusion(summary: pd.DataFrame, runs: pd.DataFrame, decisions: Mapping[str, OperatingDecision],
               ledger: pd.DataFrame, *, required_preservation: float = 0.95, decide: bool = True,
               seed: int = 0) -> list[str]:
    """The verdict lines of notebook 06's conclusion, per workload and from the design ledger.

    Per workload (actual forwarding): prefix composition's preservation with its exact interval; the non-oracle
    repair with the highest preservation, the selection named (:func:`sur_lab.analysis.decisions.best_of` over every
    served configuration, paired on the workload's requests: a maximum over ~20 configurations is not a winner on its
    own); the configurations *shown* to reach ``required_preservation`` (lower Clopper–Pearson bound); and the
    operating rule's choice with its reason. Then each ledger row with its verdict.

    Args:
        summary: :func:`summarize` by ``("workload", "label", "protocol")``.
        runs: the per-request rows behind it.
        decisions: workload -> :func:`operating_rule`.
        ledger: :func:`design_ledger`.
        required_preservation, decide, seed: as :func:`operating_rule` and :func:`design_ledger`.
    """
    lines = []
    fwd = summary[summary["protocol"] == "forward"]
    for wl in dict.fromkeys(fwd["workload"]):
        w = fwd[fwd["workload"] == wl].set_index("label")
        served = [lab for lab in w.index if lab != "Full prefill" and not lab.endswith("· oracle")]
        parts = []
        if "Prefix composition" in w.index:
            c = w.loc["Prefix composition"]
            parts.append(f"prefix composition preserves {c.preservation:.0%} ({int(c.n_preserved)} of {int(c.n)}; "
                         f"95 % CI {c.ci_low:.0%} to {c.ci_high:.0%})")
        reqs = runs[(runs["workload"] == wl) & (runs["protocol"] == "forward") & runs["label"].isin(served)]
        if len(served) and len(reqs):
            wide = reqs.pivot_table(index="case_id", columns="label", values="preserved", aggfunc="first")
            outcomes = {lab: wide[lab].astype(float).to_numpy() for lab in served if lab in wide.columns}
            parts.append("preservation: " + best_of(outcomes, kind="binary", what="non-oracle configurations",
                                                    decide=decide, seed=seed))
        shown = [lab for lab in served if decide and bound_claim(int(w.loc[lab, "n_preserved"]), int(w.loc[lab, "n"]),
                                                                  at_least=required_preservation) == HOLDS]
        parts.append(f"shown to preserve {required_preservation:.0%} (lower 95 % bound): "
                     + (", ".join(shown) or ("not decided at this size" if not decide else "none")))
        d = decisions[wl]
        parts.append(f"served by {d.label} ({d.reason})")
        lines.append(f"{wl}: " + "; ".join(parts) + ".")
    lines.append("Design ledger (pooled over workloads; each row judged by its declared criterion):")
    lines += [f"  [{r.verdict}] {r.experiment}: {r.key_result}" for r in ledger.itertuples()]
    return lines


# ---------------------------------------------------------------------------------------------------------------------
# Figures (SAFE-KV Figures 2, 3, 4, 5 analogues)

LOCAL_VS_SUFFIX = ("Prefix composition", "Doc K1 · risk", "w2 K1 · risk", "w3 K1 · risk", "w4 K1 · risk",
                   "Suffix K1 · risk")
#: Marker style per protocol: filled for actual forwarding, open for the donor-copy diagnostic.
_PROTOCOL_STYLE = {"forward": ("o", True), "donor": ("s", False)}


def _short(label: str) -> str:
    return label.replace("Prefix composition", "Composition").replace(" · risk", "").replace(" · ", "\n")


def plot_local_vs_suffix(summary: pd.DataFrame, *, labels: Sequence[str] = LOCAL_VS_SUFFIX, title: str = ""):
    """Figure 2 analogue: preservation (95 % CI) of composition, document-only, windows and the suffix from one start.

    Args:
        summary: :func:`summarize` rows with ``workload`` (one panel each), ``label`` and ``protocol`` columns.
        labels: the labels to draw, left to right (local units first, then the suffix).
        title: figure title (a default names the selector and the interval).

    Returns:
        The matplotlib figure: methods on the x axis with their mean repair ratio under the name; filled circles for
        actual forwarding, open squares for donor-copy (diagnostic upper bound), side by side.
    """
    workloads = list(dict.fromkeys(summary["workload"]))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.0 * len(workloads), 3.8), sharey=True, squeeze=False)
    xs = np.arange(len(labels))
    for ax, wl in zip(axes[0], workloads):
        sub = summary[summary["workload"] == wl]
        for j, proto in enumerate(p for p in PROTOCOLS if p in set(sub["protocol"])):
            marker, fill = _PROTOCOL_STYLE[proto]
            pts = sub[sub["protocol"] == proto].set_index("label").reindex(list(labels))
            ax.errorbar(xs + (j - 0.5) * 0.22, pts["preservation"],
                        yerr=[pts["preservation"] - pts["ci_low"], pts["ci_high"] - pts["preservation"]],
                        fmt=marker, color=f"C{j}", mfc=f"C{j}" if fill else "white", capsize=2, lw=1,
                        label=PROTOCOL_LABELS[proto])
        ratio = sub[sub["protocol"] == "forward"].set_index("label").reindex(list(labels))["repair_ratio"]
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{_short(lab)}\n{r:.0%}" if np.isfinite(r) else _short(lab)
                            for lab, r in zip(labels, ratio)], fontsize=7)
        ax.set_title(wl)
        ax.set_ylim(-0.05, 1.05)
    axes[0][0].set_ylabel("answer preservation vs full prefill")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=8, bbox_to_anchor=(0.5, -0.06))
    fig.suptitle(title or "Local repair vs causal suffix repair from the same start (risk K1); under each method: "
                 "mean repair ratio; error bars: 95 % bootstrap CI", fontsize=10)
    fig.tight_layout()
    return fig


def plot_position_sweep(summary: pd.DataFrame, *, title: str = ""):
    """Figure 3 analogue: preservation against the evidence slot, one line per method, one panel per protocol.

    Args:
        summary: :func:`summarize` rows with ``slot``, ``label`` and ``protocol`` columns (and ``ci_low``/``ci_high``).
        title: figure title.

    Returns:
        The matplotlib figure.
    """
    protocols = [p for p in PROTOCOLS if p in set(summary["protocol"])]
    fig, axes = plt.subplots(1, len(protocols), figsize=(4.8 * len(protocols), 3.6), sharey=True, squeeze=False)
    for ax, proto in zip(axes[0], protocols):
        sub = summary[summary["protocol"] == proto]
        groups = list(sub.groupby("label", sort=False))
        for j, (lab, g) in enumerate(groups):
            g = g.sort_values("slot")
            err = [g["preservation"] - g["ci_low"], g["ci_high"] - g["preservation"]]
            # Side-by-side offsets keep coinciding points and intervals readable.
            ax.errorbar(g["slot"] + (j - (len(groups) - 1) / 2) * 0.06, g["preservation"], yerr=err, marker="o",
                        capsize=2, lw=1.2, elinewidth=0.8, label=lab)
        ax.set_title(PROTOCOL_LABELS[proto])
        ax.set_xlabel("slot of the first gold document")
        ax.set_xticks(sorted(sub["slot"].unique()))
        ax.set_ylim(-0.05, 1.05)
    axes[0][0].set_ylabel("answer preservation vs full prefill")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(title or "Evidence position sweep (oracle selector); error bars: 95 % bootstrap CI", fontsize=10)
    fig.tight_layout()
    return fig


_UNIT_NAMES = {"none": "prefix composition", "doc": "document-only", "window": "window w2–w4",
               "suffix": "causal suffix", "adaptive": "adaptive suffix", "linked": "linked intervals", "sur": "SUR", "full": "full prefill"}
_SELECTOR_MARKERS = {"": "o", "risk": "o", "query": "^", "hybrid": "v", "oracle": "D"}


def plot_pareto_ttfl(summary: pd.DataFrame, *,
                     highlight: Sequence[str] = ("Suffix K1 · risk", "Suffix K2 · risk", "Suffix K2 · query"),
                     title: str = ""):
    """Figure 5 analogue: quality–budget operating points (left) and median TTFL against full prefill (right).

    Args:
        summary: :func:`summarize` rows per workload with ``workload``, ``label``, ``unit``, ``selector``, ``protocol``.
        highlight: reuse paths drawn against full prefill in the TTFL panel (actual forwarding).
        title: figure title.

    Returns:
        The matplotlib figure. Left: mean over workloads of each configuration's repair ratio and preservation; colour =
        repair unit, marker = selector (circle risk / none, triangle query, diamond oracle), filled = actual
        forwarding, open = donor-copy (diagnostic upper bound); inverted triangle hybrid. Right: median TTFL per workload, labels = mean ratio.
    """
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [1.15, 1]})
    keys = ["label", "protocol", "unit", "selector"]
    pooled = summary.groupby(keys, sort=False)[["repair_ratio", "preservation"]].mean().reset_index()
    units = [u for u in UNITS if u in set(pooled["unit"])]
    colors = {u: f"C{i}" for i, u in enumerate(units)}
    for _, r in pooled.iterrows():
        marker = _SELECTOR_MARKERS.get(r["selector"], "o")
        fill = r["protocol"] == "forward"
        left.scatter(r["repair_ratio"], r["preservation"], marker=marker, s=46 if fill else 70, zorder=3 if fill else 2,
                     facecolors=colors[r["unit"]] if fill else "none", edgecolors=colors[r["unit"]], linewidths=1.2)
    handles = [plt.Line2D([], [], marker="s", ls="", color=colors[u], label=_UNIT_NAMES[u]) for u in units]
    handles += [plt.Line2D([], [], marker=m, ls="", color="0.4", label=f"selector: {s}")
                for s, m in (("risk", "o"), ("query", "^"), ("hybrid", "v"), ("oracle", "D"))]
    handles += [plt.Line2D([], [], marker="o", ls="", color="0.4", label=PROTOCOL_LABELS["forward"]),
                plt.Line2D([], [], marker="o", ls="", color="0.4", mfc="none", label=PROTOCOL_LABELS["donor"])]
    left.legend(handles=handles, fontsize=6.5, loc="upper left", ncol=2)
    left.set_xlabel("mean repair ratio (fraction of document tokens re-encoded)")
    left.set_ylabel("answer preservation (mean over workloads)")
    left.set_xlim(-0.03, 1.05)
    left.set_ylim(-0.05, 1.35)
    left.set_yticks(np.linspace(0, 1, 6))
    left.set_title("quality–budget operating points", fontsize=10)

    workloads = list(dict.fromkeys(summary["workload"]))
    names = ["Full prefill", *highlight]
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        vals, ratios = [], []
        for wl in workloads:
            r = _pick(summary[summary["workload"] == wl], name)
            vals.append(np.nan if r is None else r["ttfl_ms"])
            ratios.append(np.nan if r is None else r["repair_ratio"])
        xs = np.arange(len(workloads)) + (j - (len(names) - 1) / 2) * width
        right.bar(xs, vals, width, label=name + ("" if name == "Full prefill" else " (actual forwarding)"))
        if name != "Full prefill":
            for x, v, q in zip(xs, vals, ratios):
                if np.isfinite(v):
                    right.annotate(f"{q:.0%}", (x, v), ha="center", va="bottom", fontsize=6.5)
    right.set_xticks(np.arange(len(workloads)))
    right.set_xticklabels(workloads, fontsize=8)
    right.set_ylabel("median time to first logit (ms, CPU)")
    right.set_title("TTFL vs full prefill (labels: mean repair ratio)", fontsize=10)
    right.legend(fontsize=7)
    fig.suptitle(title or "Quality–budget Pareto and time to first logit", fontsize=11)
    fig.tight_layout()
    return fig

def plot_robustness(table: pd.DataFrame, *, title: str = ""):
    """Figure 4 analogue: preservation (95 % CI) of each path over all requests and over the EM-correct stratum, one
    panel per model (the study model and the robustness model).

    Args:
        table: :func:`robustness_table` rows.
        title: figure title.

    Returns:
        The matplotlib figure: paths on the x axis; circles all requests, diamonds the EM-correct stratum (its size
        under the panel title); filled actual forwarding, open donor-copy (diagnostic upper bound). A panel whose
        model has no EM-correct request says so.
    """
    models = list(dict.fromkeys(table["model"]))
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 3.9), sharey=True, squeeze=False)
    for ax, model in zip(axes[0], models):
        sub = table[table["model"] == model]
        labels = list(dict.fromkeys(sub["label"]))
        xs = np.arange(len(labels))
        series = [(p, stratum) for stratum in ("", "_correct") for p in PROTOCOLS if p in set(sub["protocol"])]
        for j, (proto, sfx) in enumerate(series):
            pts = sub[sub["protocol"] == proto].set_index("label").reindex(labels)
            y = pts[f"preservation{sfx}"].astype(float)
            err = [y - pts[f"ci_low{sfx}"].astype(float), pts[f"ci_high{sfx}"].astype(float) - y]
            color = "C0" if sfx == "" else "C1"
            ax.errorbar(xs + (j - (len(series) - 1) / 2) * 0.16, y, yerr=err, fmt="o" if sfx == "" else "D",
                        color=color, mfc=color if proto == "forward" else "white", capsize=2, lw=1,
                        label=f"{'all requests' if sfx == '' else 'EM-correct'} · {PROTOCOL_LABELS[proto]}")
        n_all = int(sub["n"].max()) if len(sub) else 0
        n_ok = int(sub["n_correct"].max()) if len(sub) else 0
        ax.set_title(f"{model}\n{n_all} requests; EM-correct {n_ok}" + ("" if n_ok else " (none)"), fontsize=9)
        ax.set_xticks(xs)
        ax.set_xticklabels([_short(lab) for lab in labels], fontsize=7)
        ax.set_ylim(-0.05, 1.05)
    axes[0][0].set_ylabel("answer preservation vs full prefill")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=7, bbox_to_anchor=(0.5, -0.1))
    fig.suptitle(title or "Robustness checks: all requests vs the EM-correct stratum, per model; error bars: 95 % "
                 "bootstrap CI", fontsize=10)
    fig.tight_layout()
    return fig


__all__ = [
    "DONOR_PROXY",
    "POWER",
    "PRIMARY_POWER",
    "LEDGER",
    "LEDGER_MARGIN",
    "LOCAL_VS_SUFFIX",
    "ROBUSTNESS_LABELS",
    "em_correct",
    "plot_robustness",
    "protocol_gap",
    "quality_gate",
    "robustness_table",
    "stratum_table",
    "OperatingDecision",
    "conclusion",
    "design_ledger",
    "drift_table",
    "operating_rule",
    "plot_local_vs_suffix",
    "plot_pareto_ttfl",
    "plot_position_sweep",
    "summarize",
]
