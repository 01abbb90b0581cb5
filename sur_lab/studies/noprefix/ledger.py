"""SAFE-KV's decisions: the design ledger's declared comparisons and the power design of the primary one (donor-copy
vs actual forwarding), the operating rule (serve by full prefill when no reuse path reaches the required preservation
with a smaller TTFL), the design ledger and the study's conclusion lines, all on the tables of
:mod:`~sur_lab.studies.noprefix.reporting`.

Source: SAFE-KV (Zhang, 2026), Figures 2-5, Tables 20 and 27.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from sur_lab.analysis.conclusions import paired_outcomes
from sur_lab.analysis.decisions import (
    BEATS,
    COLUMNS,
    DIFF_COLUMNS,
    HOLDS,
    Family,
    Margin,
    PowerBasis,
    PowerDesign,
    best_of,
    bound_claim,
    discordance_from_interval,
    in_units,
    paired_family,
    proportion_interval,
    ratio_verdict,
    sentence,
)
from sur_lab.studies.noprefix.reporting import _pick

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
    the interval of :func:`~sur_lab.studies.noprefix.reporting.summarize` lies above 1
    (:func:`~sur_lab.analysis.decisions.ratio_verdict`, not corrected for the selection). Neither a handful of requests
    nor CPU timing noise can then select a path. The qualifying
    candidate with the smallest median TTFL is served; with none, full prefill.

    Args:
        summary: one workload's rows of :func:`~sur_lab.studies.noprefix.reporting.summarize`.
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


def _fmt(row: pd.Series | None) -> str:
    if row is None:
        return "not run"
    return (f"{row['preservation']:.1%} ({int(row['n_preserved'])} of {int(row['n'])}; 95 % CI {row['ci_low']:.2f} to "
            f"{row['ci_high']:.2f}) at ratio {row['repair_ratio']:.2f}")


#: The ledger's words for a decided verdict (:mod:`sur_lab.analysis.decisions`).
_LEDGER_WORDS = {"beats": "worked", "equivalent": "worked", "loses to": "did not", "not separated": "not separated",
                 "not decided": "not decided", "n/a": "not run", "holds": "worked", "fails": "did not",
                 "not shown": "not shown"}


def _ledger_labels(budgets: Sequence[float]) -> dict[str, str]:
    """Key -> the run label of each route the ledger reads; the adaptive and SUR routes at the largest budget run."""
    b = max(budgets) if budgets else None
    return {"comp": "Prefix composition", "doc": "Doc K2 · oracle", "w4": "w4 K1 · risk", "suf1": "Suffix K1 · risk",
            "suf2": "Suffix K2 · risk", "link": "Linked K2 · oracle", "osuf": "Suffix K1 · oracle",
            "ada": f"Adaptive K2 {b:g}% · risk" if b is not None else "",
            "sur": f"SUR {b:g}%" if b is not None else "",
            "qsuf": "Suffix K2 · query", "hsuf": "Suffix K2 · hybrid"}


#: The :data:`LEDGER` family's comparisons: ledger key -> (route, the route it is compared with), keys of
#: :func:`_ledger_labels`.
_LEDGER_PAIRS = {"w4": ("w4", "suf1"), "link": ("link", "osuf"), "ada": ("ada", "suf2"), "sur": ("sur", "ada"),
                 "query": ("qsuf", "suf2"), "hybrid-query": ("hsuf", "qsuf"), "hybrid-risk": ("hsuf", "suf2")}


def _sources(runs: pd.DataFrame) -> pd.DataFrame:
    """``runs`` with ``_p`` (preserved, float) and ``_src`` (the cluster: dataset/source)."""
    return runs.assign(_p=runs["preserved"].astype(float),
                       _src=runs["dataset"].astype(str) + "/" + runs["source_id"].astype(str))


def _ledger_family(runs: pd.DataFrame | None, labels: Mapping[str, str], *, seed: int,
                   decide: bool) -> pd.DataFrame | None:
    """:data:`LEDGER` decided on the forwarded requests of ``runs`` (:func:`paired_family` rows), ``None`` when no
    pair ran."""
    if runs is None or runs.empty:
        return None
    fwd = _sources(runs[runs["protocol"] == "forward"])
    wanted = [(labels[x], labels[y]) for x, y in _LEDGER_PAIRS.values()]
    outcomes, clusters = paired_outcomes(fwd, wanted, "_p", arm_col="label", case_col="case_id", cluster_col="_src")
    if not outcomes:
        return None
    return paired_family(outcomes, family=LEDGER, cluster=clusters, seed=seed, decide=decide)


def _donor_family(runs: pd.DataFrame, margin: float, *, seed: int, decide: bool) -> pd.DataFrame:
    """:data:`DONOR_PROXY` decided: donor minus forward preservation of suffix K1 (risk), paired over requests, the
    sources clustered, equivalence within ``±margin`` (one :func:`paired_family` row)."""
    sub = _sources(runs[runs["label"] == "Suffix K1 · risk"])
    outcomes, clusters = paired_outcomes(sub, [("donor", "forward")], "_p", arm_col="protocol", case_col="case_id",
                                         cluster_col="_src")
    family = replace(DONOR_PROXY, margin=Margin(margin, LEDGER_MARGIN.source if margin == LEDGER_MARGIN.value
                                                else "the ledger's proxy_margin argument"))
    return paired_family(outcomes, family=family, cluster=clusters, seed=seed, decide=decide)


def decided_table(runs: pd.DataFrame, *, budgets: Sequence[float] = (50,), proxy_margin: float = LEDGER_MARGIN.value,
                  seed: int = 0, decide: bool = True) -> pd.DataFrame:
    """The study's declared comparisons decided, the primary first, in the paired-difference schema of the studies'
    decided tables (:func:`~sur_lab.analysis.decisions.paired_family` rows through
    :func:`~sur_lab.analysis.decisions.in_units`, preservation in percentage points): :data:`DONOR_PROXY` (donor-copy
    minus actual forwarding of suffix K1 (risk), equivalence within ``±proxy_margin``), then :data:`LEDGER` (Holm over
    the ledger's comparisons). The same rows, seed included, that :func:`design_ledger` words; notebook 06 saves them as
    ``06_noprefix_decided`` and the results index reads the primary's verdict from it.

    Args:
        runs: the per-request rows (:func:`~sur_lab.studies.noprefix.study.runs_table`: ``label``, ``protocol``,
            ``case_id``, ``dataset``, ``source_id``, ``preserved``).
        budgets: the adaptive/SUR budgets that were run, in percent (the largest is compared).
        proxy_margin: the donor-copy equivalence margin, a preservation fraction in (0, 1].
        seed: the generator seed (clustered bootstrap). decide: ``False`` at a plumbing-check size ("not decided").

    Returns:
        The rows of the comparisons that ran (none when ``runs`` is empty); columns of
        :data:`~sur_lab.analysis.decisions.COLUMNS` then :data:`~sur_lab.analysis.decisions.DIFF_COLUMNS`.

    Raises:
        ValueError: naming ``proxy_margin`` outside (0, 1].
    """
    if not 0.0 < proxy_margin <= 1.0:
        raise ValueError(f"proxy_margin={proxy_margin!r} must lie in (0, 1]")
    frames = []
    if not runs.empty and "Suffix K1 · risk" in set(runs["label"]):
        frames.append(_donor_family(runs, proxy_margin, seed=seed, decide=decide))
    ledger = _ledger_family(runs, _ledger_labels(budgets), seed=seed, decide=decide)
    if ledger is not None:
        frames.append(ledger)
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=[*COLUMNS, *DIFF_COLUMNS])
    return in_units(pd.concat(frames, ignore_index=True))


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
        summary: :func:`~sur_lab.studies.noprefix.reporting.summarize` pooled over workloads with
            ``by=("label", "protocol")``.
        runs: the per-request rows behind ``summary`` (:func:`~sur_lab.studies.noprefix.study.runs_table`: ``label``,
            ``protocol``, ``case_id``, ``dataset``, ``source_id``, ``preserved``) for the paired rows; without them
            those rows are not judged.
        required_preservation: the preservation a route must be shown to reach, in [0, 1].
        budgets: the adaptive/SUR budgets that were run (the largest is compared).
        drift: :func:`~sur_lab.studies.noprefix.reporting.drift_table`'s row (``spearman_rho``, ``spearman_low``,
            ``spearman_high``), if measured.
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
    labels = _ledger_labels(budgets)
    row = {k: _pick(summary, v) for k, v in labels.items()}
    paired: dict[str, pd.Series] = {}
    res = _ledger_family(runs, labels, seed=seed, decide=decide)
    if res is not None:
        by_pair = {(r["a"], r["b"]): r for _, r in res.iterrows()}
        paired = {k: by_pair[(labels[x], labels[y])] for k, (x, y) in _LEDGER_PAIRS.items()
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
    res = _donor_family(runs, margin, seed=seed, decide=decide).iloc[0]
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
        summary: :func:`~sur_lab.studies.noprefix.reporting.summarize` by ``("workload", "label", "protocol")``.
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


__all__ = [
    "DONOR_PROXY",
    "LEDGER",
    "LEDGER_MARGIN",
    "POWER",
    "PRIMARY_POWER",
    "OperatingDecision",
    "conclusion",
    "decided_table",
    "design_ledger",
    "operating_rule",
]
