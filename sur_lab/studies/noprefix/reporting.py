"""SAFE-KV reporting: drift tables, per-group endpoint summaries with bootstrap intervals, the robustness checks (the
EM-correct stratum, a second model family), the largest workload's quality gate with the paired donor − forward
bootstrap, the operating rule, the design ledger and the figures (SAFE-KV Figures 2-5 analogues).

Source: SAFE-KV (Zhang, 2026), Figures 2-5, Tables 20 and 27.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from sur_lab.analysis.stats import bootstrap_ci
from sur_lab.studies.noprefix.selection import PROTOCOL_LABELS, PROTOCOLS, UNITS

# ---------------------------------------------------------------------------------------------------------------------
# Drift


def drift_table(runs: pd.DataFrame, by: str = "workload") -> pd.DataFrame:
    """Measured drift of the composed cache and its rank agreement with the risk score, per ``by`` group.

    Uses one row per request of :func:`~sur_lab.studies.noprefix.study.measure_drift` (``unit`` ``"full"``); documents
    after the first are pooled (the first document's drift is exactly 0 and its risk 0).

    Returns:
        DataFrame with ``by``, ``requests``, ``docs``, ``mean_drift`` (relative K/V deviation), ``spearman_rho``
        (risk vs drift, pooled) and ``within_request_rho`` (mean per-request Spearman over requests with >= 4
        documents).

    Raises:
        ValueError: naming ``runs`` when it has no ``drift``/``risk`` columns.
    """
    from scipy.stats import spearmanr

    if "drift" not in runs.columns or "risk" not in runs.columns:
        raise ValueError("runs has no drift/risk columns; pass sur_lab.studies.noprefix.measure_drift's rows")
    full = runs[runs["unit"] == "full"]
    rows = []
    for key, g in full.groupby(by, sort=False):
        drift = np.concatenate([np.asarray(d)[1:] for d in g["drift"]])
        risk = np.concatenate([np.asarray(r)[1:] for r in g["risk"]])
        within = [spearmanr(np.asarray(r)[1:], np.asarray(d)[1:])[0]
                  for r, d in zip(g["risk"], g["drift"]) if len(d) >= 4]
        rows.append({by: key, "requests": len(g), "docs": len(drift), "mean_drift": float(drift.mean()),
                     "spearman_rho": float(spearmanr(risk, drift)[0]) if len(drift) > 2 else np.nan,
                     "within_request_rho": float(np.nanmean(within)) if within else np.nan})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------------------------------
# Endpoints


def summarize(df: pd.DataFrame, by: Sequence[str] = ("dataset", "num_docs", "label", "protocol"), *,
              confidence: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """Per-group endpoints of :func:`~sur_lab.studies.noprefix.study.runs_table` rows.

    Columns: ``by`` plus ``method``, ``selector``, ``unit``, ``n`` (requests), ``preservation`` (mean) with
    ``ci_low``/``ci_high`` (:func:`bootstrap_ci`), ``token_exact`` (mean), ``gold_em`` (mean, NaN without a
    scorer), ``changed_wrong`` (count), ``repair_ratio`` (mean), ``timed`` (requests whose time to first logit was
    measured per request: only they enter the timing columns), ``ttfl_ms`` and ``full_ttfl_ms`` (medians, ms),
    ``ttfl_p95_ms`` and ``full_ttfl_p95_ms`` (95th percentiles, ms, linear interpolation between order statistics as
    :func:`numpy.percentile`; SAFE-KV Figure 5 reports p95 beside the median),
    ``speedup`` (``full_ttfl_ms / ttfl_ms`` of the medians) and the per-request speed-up's geometric mean
    ``speedup_gmean`` with its bootstrap interval ``speedup_ci_low``/``speedup_ci_high`` (paired: each request's
    full-prefill TTFL over its reuse TTFL). Timing columns are NaN for a group without timed requests.

    Raises:
        ValueError: naming ``by`` when a column is missing.
    """
    missing = [c for c in by if c not in df.columns]
    if missing:
        raise ValueError(f"by={tuple(by)!r}: {missing} are not columns of df")
    rows = []
    for key, g in df.groupby(list(by), sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        low, high = bootstrap_ci(g["preserved"].astype(float), confidence=confidence, seed=seed)
        em = g["em"].dropna()
        cw = g["changed_wrong"].dropna()
        row = dict(zip(by, key))
        row.update({
            "method": g["method"].iloc[0], "selector": g["selector"].iloc[0], "unit": g["unit"].iloc[0],
            "n": len(g), "preservation": float(g["preserved"].mean()), "ci_low": low, "ci_high": high,
            "token_exact": float(g["token_exact"].mean()),
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
        if len(t):
            log_ratio = np.log(t["full_ttfl_ms"].to_numpy(np.float64) / t["ttfl_ms"].to_numpy(np.float64))
            lo, hi = bootstrap_ci(log_ratio, confidence=confidence, seed=seed)
            row.update({"speedup_gmean": float(np.exp(log_ratio.mean())), "speedup_ci_low": float(np.exp(lo)),
                        "speedup_ci_high": float(np.exp(hi))})
        else:
            row.update({"speedup_gmean": np.nan, "speedup_ci_low": np.nan, "speedup_ci_high": np.nan})
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
_STRATUM_COLS = ("n", "preservation", "ci_low", "ci_high", "token_exact", "changed_wrong")


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
    from sur_lab.analysis.stats import paired_bootstrap

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
        reason: why, in words.
    """

    serve: str
    label: str
    preservation: float
    ttfl_ms: float
    full_ttfl_ms: float
    reason: str = field(default="")


def operating_rule(summary: pd.DataFrame, *, required_preservation: float = 0.95, use_lower_bound: bool = False,
                   significant: bool = True, protocol: str = "forward") -> OperatingDecision:
    """Serve by full prefill unless a reuse path reaches the required preservation *and* is faster (SAFE-KV Fig. 5).

    Candidates are the summary rows of ``protocol`` (donor-copy is a diagnostic and never a serving path) other than
    full prefill and other than oracle-selected units (gold evidence labels are unknown when serving), including prefix
    composition without repair. A candidate qualifies when its preservation (or its lower confidence bound with
    ``use_lower_bound``) reaches ``required_preservation`` and it is faster than full prefill: with ``significant``,
    the 95 % bootstrap interval of its per-request speed-up (``speedup_ci_low``, geometric mean of
    ``full_ttfl / ttfl``) lies above 1, so CPU timing noise alone cannot select it; otherwise its median TTFL is below
    full prefill's. The qualifying candidate with the smallest median TTFL is served; with none, full prefill.

    Args:
        summary: one workload's rows of :func:`summarize`.
        required_preservation: in [0, 1].
        use_lower_bound: judge preservation by ``ci_low`` instead of the point estimate.
        significant: judge "faster" by the speed-up interval instead of the medians.
        protocol: the serving protocol (``"forward"``).

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
    # Gold-evidence (oracle) selection is unavailable when serving, like donor-copy: diagnostics only.
    cand = summary[(summary["protocol"] == protocol) & (summary["unit"] != "full") & (summary["selector"] != "oracle")]
    measure = cand["ci_low"] if use_lower_bound else cand["preservation"]
    ok = cand[measure >= required_preservation]
    if ok.empty:
        return OperatingDecision("full prefill", "Full prefill", 1.0, full_ttfl, full_ttfl,
                                 f"no reuse path reaches {required_preservation:.0%} preservation")
    faster = ok[ok["speedup_ci_low"] > 1.0] if significant else ok[ok["ttfl_ms"] < full_ttfl]
    if faster.empty:
        best = ok.sort_values(["ttfl_ms", "repair_ratio"]).iloc[0]
        how = (f"speed-up {best['speedup_gmean']:.2f}x [{best['speedup_ci_low']:.2f}, {best['speedup_ci_high']:.2f}]"
               if significant else f"{best['ttfl_ms']:.0f} ms vs {full_ttfl:.0f} ms")
        return OperatingDecision(
            "full prefill", "Full prefill", 1.0, full_ttfl, full_ttfl,
            f"no path at {required_preservation:.0%} is faster than full prefill; the fastest, {best['label']}, has "
            f"{how}",
        )
    best = faster.sort_values(["ttfl_ms", "repair_ratio"]).iloc[0]
    return OperatingDecision(
        "repair", str(best["label"]), float(best["preservation"]), float(best["ttfl_ms"]), full_ttfl,
        f"{best['label']} preserves {best['preservation']:.0%} at {best['ttfl_ms']:.0f} ms vs {full_ttfl:.0f} ms "
        f"(speed-up {best['speedup_gmean']:.2f}x [{best['speedup_ci_low']:.2f}, {best['speedup_ci_high']:.2f}])",
    )


def _pick(summary: pd.DataFrame, label: str, protocol: str = "forward") -> pd.Series | None:
    rows = summary[(summary["label"] == label) & (summary["protocol"] == protocol)]
    return rows.iloc[0] if len(rows) else None


def _fmt(row: pd.Series | None) -> str:
    if row is None:
        return "not run"
    return f"{row['preservation']:.1%} [{row['ci_low']:.2f}, {row['ci_high']:.2f}] at ratio {row['repair_ratio']:.2f}"


def design_ledger(summary: pd.DataFrame, *, required_preservation: float = 0.95, budgets: Sequence[float] = (50,),
                  drift_spearman: float | None = None,
                  decisions: dict[str, OperatingDecision] | None = None, runs: pd.DataFrame | None = None,
                  proxy_margin: float = 0.05, seed: int = 0) -> pd.DataFrame:
    """The design ledger (SAFE-KV Table 27) filled from measurements (actual forwarding unless stated).

    Each row states a route, what was measured, whether it worked by a stated criterion, and the criterion.

    Args:
        summary: :func:`summarize` pooled over workloads with ``by=("label", "protocol")``.
        required_preservation: the preservation a route must reach to count as having worked, in [0, 1].
        budgets: the adaptive/SUR budgets that were run (the largest is compared).
        drift_spearman: Spearman correlation of the risk score with measured document drift, if measured.
        decisions: workload -> :func:`operating_rule` decision, if computed.
        runs: the per-request rows behind ``summary`` (:func:`~sur_lab.studies.noprefix.study.runs_table`), for the
            donor-copy row's paired bootstrap (:func:`protocol_gap`); without them that row is not judged.
        proxy_margin: donor-copy counts as a usable proxy of actual forwarding when the 95 % paired interval of
            donor − forward preservation lies within ``±proxy_margin`` (an equivalence criterion), in [0, 1].
        seed: the bootstrap's seed.

    Returns:
        DataFrame with columns ``experiment``, ``key_result``, ``worked`` (bool, or None when not run) and
        ``criterion``.
    """
    if not 0.0 <= proxy_margin <= 1.0:
        raise ValueError(f"proxy_margin={proxy_margin!r} must lie in [0, 1]")
    b = max(budgets) if budgets else None
    req = required_preservation
    comp = _pick(summary, "Prefix composition")
    doc = _pick(summary, "Doc K2 · oracle")
    w4 = _pick(summary, "w4 K1 · risk")
    suf1 = _pick(summary, "Suffix K1 · risk")
    suf2 = _pick(summary, "Suffix K2 · risk")
    link = _pick(summary, "Linked K2 · oracle")
    osuf = _pick(summary, "Suffix K1 · oracle")
    ada = _pick(summary, f"Adaptive K2 {b:g}% · risk") if b is not None else None
    sur = _pick(summary, f"SUR {b:g}%") if b is not None else None
    qsuf = _pick(summary, "Suffix K2 · query")
    hsuf = _pick(summary, "Suffix K2 · hybrid")
    dsuf = _pick(summary, "Suffix K1 · risk", "donor")

    def val(r):
        return None if r is None else float(r["preservation"])

    def ge(x, y):
        return None if x is None or y is None else bool(val(x) >= val(y))

    rows = [
        ("Prefix composition (no repair)", _fmt(comp), None if comp is None else val(comp) >= req,
         f"preserves >= {req:.0%}"),
        ("Document-only repair (oracle: the gold documents)", f"{_fmt(doc)}; oracle suffix {_fmt(osuf)}",
         None if doc is None else val(doc) >= req, f"preserves >= {req:.0%}"),
        ("Downstream window w4 vs suffix K1 (risk, same start)", f"w4 {_fmt(w4)}; suffix {_fmt(suf1)}", ge(w4, suf1),
         "window preserves at least as much as the suffix"),
        ("Linked intervals vs suffix (oracle)", f"linked K2 {_fmt(link)}; suffix K1 {_fmt(osuf)}", ge(link, osuf),
         "linked preserves at least as much as the suffix"),
        (f"Adaptive suffix {b:g}% vs suffix K2 (risk)", f"adaptive {_fmt(ada)}; suffix K2 {_fmt(suf2)}", ge(ada, suf2),
         "trimmed suffix preserves at least as much"),
        (f"SUR {b:g}% vs adaptive suffix {b:g}%", f"SUR {_fmt(sur)}; adaptive {_fmt(ada)}", ge(sur, ada),
         "SUR preserves at least as much at the same budget"),
        ("Query-guided vs risk-guided start (suffix K2)", f"query {_fmt(qsuf)}; risk {_fmt(suf2)}", ge(qsuf, suf2),
         "query selector preserves at least as much"),
        ("Hybrid vs query- and risk-guided start (suffix K2)",
         f"hybrid {_fmt(hsuf)}; query {_fmt(qsuf)}; risk {_fmt(suf2)}",
         None if hsuf is None or qsuf is None or suf2 is None else bool(val(hsuf) >= max(val(qsuf), val(suf2))),
         "hybrid (mean of risk and query ranks) preserves at least as much as the better of its two parts"),
        _donor_row(dsuf, suf1, runs, proxy_margin, seed),
    ]
    if drift_spearman is not None:
        rows.append(("Risk score vs measured document drift", f"Spearman rho = {drift_spearman:.2f}",
                     bool(drift_spearman >= 0.5), "rho >= 0.5"))
    if decisions:
        served = {wl: d.serve if d.serve == "full prefill" else f"repair ({d.label})" for wl, d in decisions.items()}
        rows.append(("Operating rule", "; ".join(f"{wl}: {v}" for wl, v in served.items()),
                     any(d.serve == "repair" for d in decisions.values()),
                     f"some workload is served by a reuse path faster than full prefill at >= {req:.0%}"))
    return pd.DataFrame(rows, columns=["experiment", "key_result", "worked", "criterion"])


def _donor_row(dsuf: pd.Series | None, suf1: pd.Series | None, runs: pd.DataFrame | None, margin: float,
               seed: int) -> tuple:
    """The ledger's donor-copy row: the paired donor − forward bootstrap (:func:`protocol_gap`) against
    ``±margin``."""
    name = "Donor-copy vs actual forwarding (suffix K1, risk)"
    criterion = (f"95 % paired bootstrap interval of donor − forward preservation (sources resampled with both "
                 f"protocols' rows) within ±{100 * margin:g} points: the diagnostic is a usable proxy")
    if dsuf is None or suf1 is None:
        return name, f"donor {_fmt(dsuf)}; forward {_fmt(suf1)}", None, criterion
    if runs is None:
        return name, f"donor {_fmt(dsuf)}; forward {_fmt(suf1)}; no per-request runs for the paired interval", None, \
            criterion
    gap = protocol_gap(runs, "Suffix K1 · risk", seed=seed)
    key = (f"donor − forward {gap.diff:+.2f} [{gap.low:+.2f}, {gap.high:+.2f}] over {gap.n_sources} sources "
           f"(donor {dsuf['preservation']:.1%}, forward {suf1['preservation']:.1%})")
    return name, key, bool(-margin <= gap.low and gap.high <= margin), criterion


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
    import matplotlib.pyplot as plt

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
    import matplotlib.pyplot as plt

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
    import matplotlib.pyplot as plt

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
    import matplotlib.pyplot as plt

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
    "LOCAL_VS_SUFFIX",
    "ROBUSTNESS_LABELS",
    "em_correct",
    "plot_robustness",
    "protocol_gap",
    "quality_gate",
    "robustness_table",
    "stratum_table",
    "OperatingDecision",
    "design_ledger",
    "drift_table",
    "operating_rule",
    "plot_local_vs_suffix",
    "plot_pareto_ttfl",
    "plot_position_sweep",
    "summarize",
]
