"""Notebook 10's tables and conclusion: per turn (:func:`per_turn_table`), per region of the first change or per
question kind against prefix reuse (:func:`comparison_table`, :func:`region_table`, :func:`kind_table`), per path over
whole traces (:func:`summary_table`), the declared comparisons decided (:func:`primary_table`) and the conclusion lines
(:func:`conclusion`).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from sur_lab.analysis.decisions import (
    BEATS,
    FAILS,
    HOLDS,
    LOSES,
    bound_claim,
    bound_sentence,
    family_lines,
    in_units,
    paired_family,
    proportion_interval,
)
from sur_lab.studies.agent_traces.cases import QUESTION_KINDS, REACHING
from sur_lab.studies.agent_traces.design import (
    AGREEMENT_FAMILY,
    KIND_FAMILY,
    MAX_AGREEMENT_LOSS,
    PREFIX,
    PRIMARY,
    REFERENCE,
    REGION_FAMILY,
    REGIONS,
    SHIFT,
)

__all__ = ["per_turn_table", "comparison_table", "region_table", "kind_table", "summary_table", "primary_table",
           "conclusion"]


def per_turn_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (path, turn) over traces: median TTFT, mean tokens recomputed, EM and agreement (%), mean cumulative cost
    (tokens recomputed and TTFT) and its ratio to re-prefill's."""
    out = runs.groupby(["path", "turn"], sort=False).agg(
        n=("em", "size"), ttft_ms=("ttft_ms", "median"), recomputed=("recomputed", "mean"), em_pct=("em", "mean"),
        agree_pct=("agree", "mean"), cum_recomputed=("cum_recomputed", "mean"), cum_ttft_ms=("cum_ttft_ms", "mean"),
        cost_ratio=("cost_ratio", "mean"),
    ).reset_index()
    out[["em_pct", "agree_pct"]] *= 100
    return out


def _groups(runs: pd.DataFrame, by: str) -> list[tuple[str, pd.DataFrame]]:
    """The later turns of ``runs`` split by ``by``: per region (:data:`REGIONS`) or per question kind
    (:data:`QUESTION_KINDS`, then ``"reaching"``: every kind but ``new``), then ``"all"``; empty groups left out."""
    later = runs[runs["turn"] > 0]
    names = REGIONS if by == "region" else QUESTION_KINDS
    groups = [(g, later[later[by] == g]) for g in names]
    if by == "kind":
        groups.append(("reaching", later[later["kind"].isin(REACHING)]))
    groups.append(("all", later))
    return [(g, part) for g, part in groups if not part.empty]


def comparison_table(runs: pd.DataFrame, by: str = "region", *, against: str = PREFIX, clustered: bool = True,
                     seed: int = 0, n_boot: int = 2_000) -> pd.DataFrame:
    """Per (group of later turns, path), each path paired with ``against`` on the same turns: median TTFT, the paired
    speed-up ``against``'s TTFT / this path's (geometric mean, > 1: this path is faster) with its 95 % percentile
    bootstrap interval (NaN with one cluster or identical ratios), median tokens recomputed, agreement with re-prefill
    and EM (%), the paired difference of agreement against ``against`` (``agree_delta``, ``agree_delta_low``,
    ``agree_delta_high``, in percentage points: :func:`sur_lab.analysis.decisions.in_units`; Newcombe's interval,
    hulled with the cluster bootstrap's), and the turns on which this path loses re-prefill's answer that ``against`` kept
    (``losses``) with the exact 95 % upper bound of that rate (``loss_upper_pct``). Descriptive: the verdicts are
    :func:`conclusion`'s.

    Args:
        runs: the per-turn rows (:func:`run_traces`; ``kind`` needed when ``by="kind"``).
        by: ``"region"`` (where the first change lands) or ``"kind"`` (the question kind, plus ``"reaching"``).
        against: the path every other is paired with.
        clustered: ``True``: a trace's turns resampled together (:func:`sur_lab.analysis.decisions.paired_family`'s
            ``cluster``); ``False``: turns as independent units (for comparison only: they are not).
        seed, n_boot: the bootstrap's.

    Raises:
        ValueError: naming ``by`` when not ``"region"`` or ``"kind"``, ``against`` when it is not a path of ``runs``.
    """
    if by not in ("region", "kind"):
        raise ValueError(f"by={by!r} must be 'region' or 'kind'")
    if against not in set(runs["path"]):
        raise ValueError(f"against={against!r} is not a path of runs; paths: {sorted(set(runs['path']))}")
    rows = []
    nan = float("nan")
    for group, part in _groups(runs, by):
        wide = part.pivot_table(index=["trace", "turn"], columns="path", values=["ttft_ms", "agree"], aggfunc="first")
        traces = wide.index.get_level_values("trace").to_numpy() if clustered else None
        for path in dict.fromkeys(part["path"]):
            mine = part[part["path"] == path]
            a_agree = wide["agree"][path].astype(float).to_numpy()
            b_agree = wide["agree"][against].astype(float).to_numpy()
            losses = int(np.sum((b_agree == 1) & (a_agree == 0)))
            row = {by: group, "path": path, "turns": len(mine), "ttft_ms": mine["ttft_ms"].median(),
                   "speedup": 1.0, "speedup_lo": nan, "speedup_hi": nan, "recomputed": mine["recomputed"].median(),
                   "agree_pct": 100 * mine["agree"].mean(), "agree_delta": 0.0, "agree_delta_low": nan,
                   "agree_delta_high": nan, "losses": losses,
                   "loss_upper_pct": 100 * proportion_interval(losses, len(a_agree))[2],
                   "em_pct": 100 * mine["em"].mean()}
            if path != against:
                ratio = paired_family({(path, against): (wide["ttft_ms"][path].to_numpy(float),
                                                         wide["ttft_ms"][against].to_numpy(float))},
                                      kind="ratio", cluster=traces, n_boot=n_boot, seed=seed).iloc[0]
                agree = in_units(paired_family({(path, against): (a_agree, b_agree)}, kind="binary",
                                               cluster=traces, n_boot=n_boot, seed=seed)).iloc[0]
                row.update(speedup=ratio["estimate"], speedup_lo=ratio["ci_low"], speedup_hi=ratio["ci_high"],
                           agree_delta=agree["delta"], agree_delta_low=agree["delta_low"],
                           agree_delta_high=agree["delta_high"])
            rows.append(row)
    return pd.DataFrame(rows)


def region_table(runs: pd.DataFrame, *, against: str = PREFIX, clustered: bool = True, seed: int = 0,
                 n_boot: int = 2_000) -> pd.DataFrame:
    """:func:`comparison_table` by region of the first change (:data:`REGIONS`, then ``"all"``).

    Raises:
        ValueError: naming ``against`` when it is not a path of ``runs``.
    """
    return comparison_table(runs, "region", against=against, clustered=clustered, seed=seed, n_boot=n_boot)


def kind_table(runs: pd.DataFrame, *, against: str = PREFIX, clustered: bool = True, seed: int = 0,
               n_boot: int = 2_000) -> pd.DataFrame:
    """:func:`comparison_table` by question kind (:data:`QUESTION_KINDS`, then ``"reaching"``, then ``"all"``), with
    ``known_pct``: the share of the group's turns whose gold is an answer rather than "unknown".

    Raises:
        ValueError: naming ``against`` when it is not a path of ``runs``.
    """
    out = comparison_table(runs, "kind", against=against, clustered=clustered, seed=seed, n_boot=n_boot)
    known = {g: 100 * part.drop_duplicates(["trace", "turn"])["known"].mean() for g, part in _groups(runs, "kind")}
    out.insert(3, "known_pct", out["kind"].map(known))
    return out


def summary_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per path over every turn after the first: median TTFT, agreement and EM (%), and over whole traces the total
    tokens recomputed and TTFT and their ratio to re-prefill's (means over traces)."""
    later = runs[runs["turn"] > 0]
    quality = later.groupby("path", sort=False).agg(turns=("em", "size"), ttft_ms=("ttft_ms", "median"),
                                                    agree_pct=("agree", "mean"), em_pct=("em", "mean"))
    quality[["agree_pct", "em_pct"]] *= 100
    last = runs[runs["turn"] == runs.groupby("trace")["turn"].transform("max")]
    total = last.groupby("path", sort=False).agg(total_recomputed=("cum_recomputed", "mean"),
                                                 total_ttft_ms=("cum_ttft_ms", "mean"), cost_ratio=("cost_ratio", "mean"))
    ref_ms = total.loc[REFERENCE, "total_ttft_ms"] if REFERENCE in total.index else float("nan")
    total["time_ratio"] = total["total_ttft_ms"] / ref_ms
    return quality.join(total).reset_index()


def _later_wide(runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The later turns as one row per (trace, turn) with a column per (endpoint, path), and the turns' region and
    kind aligned with it."""
    later = runs[runs["turn"] > 0]
    wide = later.pivot_table(index=["trace", "turn"], columns="path", values=["ttft_ms", "agree"], aggfunc="first")
    meta = later.drop_duplicates(["trace", "turn"]).set_index(["trace", "turn"])[["region", "kind"]].reindex(
        wide.index)
    return wide, meta


def primary_table(runs: pd.DataFrame, *, sync: str = "sync 5%", clustered: bool = True, decide: bool = True,
                  n_boot: int = 10_000, seed: int = 0) -> pd.DataFrame:
    """The declared comparisons, decided (:func:`sur_lab.analysis.decisions.paired_family` rows with each difference in
    its printed unit, :func:`~sur_lab.analysis.decisions.in_units`: the paired-difference schema that notebook 10
    saves as ``10_agent_traces_decided`` and the results index reads the primary's verdict from; in this order):
    :data:`PRIMARY` (prefix reuse's TTFT over ``sync``'s on every later turn, tested alone), :data:`AGREEMENT_FAMILY`
    (``sync`` − prefix reuse, agreement with re-prefill on the later turns of a :data:`REACHING` kind, equivalence
    within :data:`AGREEMENT_MARGIN`), :data:`KIND_FAMILY` (the same per question kind, Holm) and
    :data:`REGION_FAMILY` (the TTFT ratio per region of the first change, Holm).

    Args:
        runs: the per-turn rows (:func:`run_traces`).
        sync: the lead sync path.
        clustered: ``True`` (the declared analysis): a trace's turns are one cluster, resampled together by the
            bootstrap and flipped together by the sign tests; ``False``: turns as independent units (for comparison
            only).
        decide: ``False`` at a plumbing-check size (``decisions.decides(preset)``).
        n_boot, seed: as :func:`~sur_lab.analysis.decisions.paired_family`.

    Raises:
        ValueError: naming ``sync`` when it is not a path of ``runs``.
    """
    if sync not in set(runs["path"]):
        raise ValueError(f"sync={sync!r} is not a path of runs; paths: {sorted(set(runs['path']))}")
    wide, meta = _later_wide(runs)
    traces = wide.index.get_level_values("trace").to_numpy()
    kw = dict(decide=decide, n_boot=n_boot, seed=seed)

    def agree(mask):
        return (wide["agree"][sync].astype(float).to_numpy()[mask],
                wide["agree"][PREFIX].astype(float).to_numpy()[mask])

    def times(mask):
        return wide["ttft_ms"][sync].to_numpy(float)[mask], wide["ttft_ms"][PREFIX].to_numpy(float)[mask]

    def family(fam, masks, data, label):
        keys = {g: (f"{sync}{label(g)}", f"{PREFIX}{label(g)}") for g in masks}
        cluster = {keys[g]: traces[m] for g, m in masks.items()} if clustered else None
        return paired_family({keys[g]: data(m) for g, m in masks.items()}, family=fam, cluster=cluster, **kw)

    reaching = meta["kind"].isin(REACHING).to_numpy()
    kinds = {k: (meta["kind"] == k).to_numpy() for k in QUESTION_KINDS if (meta["kind"] == k).any()}
    regions = {r: (meta["region"] == r).to_numpy() for r in REGIONS if (meta["region"] == r).any()}
    tables = [family(PRIMARY, {"all": np.ones(len(wide), dtype=bool)}, times, lambda g: "")]
    if reaching.any():
        tables.append(family(AGREEMENT_FAMILY, {"reaching": reaching}, agree, lambda g: " (reaching questions)"))
    if kinds:
        tables.append(family(KIND_FAMILY, kinds, agree, lambda g: f" ({g})"))
    if regions:
        tables.append(family(REGION_FAMILY, regions, times, lambda g: f" ({g})"))
    return in_units(pd.concat(tables, ignore_index=True))


def conclusion(regions: pd.DataFrame, summary: pd.DataFrame, runs: pd.DataFrame, *, sync: str = "sync 5%",
               kinds: pd.DataFrame | None = None, max_agreement_loss: float = MAX_AGREEMENT_LOSS, decide: bool = True,
               n_boot: int = 10_000, seed: int = 0, decided: pd.DataFrame | None = None) -> list[str]:
    """The conclusion's sentences from this run's tables, with every verdict from :mod:`sur_lab.analysis.decisions`:
    per region of the first change the path with the lowest median TTFT (a point estimate, the selection named) and
    ``sync``'s numbers against prefix reuse; per question kind ``sync``'s, Shift's and prefix reuse's agreement with
    re-prefill and EM; the declared comparisons (:func:`primary_table`: the primary, whether ``sync`` is faster than
    prefix reuse over every later turn; whether it keeps re-prefill's answers on the reaching questions as prefix
    reuse does, within the margin, and the same per kind; the speed-up by region); per region whether ``sync`` is
    shown to lose at most ``max_agreement_loss`` of agreement (:func:`~sur_lab.analysis.decisions.bound_claim` on its
    loss turns); and where ``sync`` should not be used (prefix reuse shown faster, or a loss above the tolerance shown)
    or where this size shows neither.

    Args:
        regions: :func:`region_table`; summary: :func:`summary_table`; runs: the per-turn rows behind them.
        sync: the lead sync path.
        kinds: :func:`kind_table` (default: computed from ``runs``).
        max_agreement_loss: the agreement loss tolerated by the per-region bounds, a fraction in [0, 1].
        decide: ``False`` at a plumbing-check size (``decisions.decides(preset)``).
        n_boot, seed: as :func:`sur_lab.analysis.decisions.paired_family`.
        decided: :func:`primary_table` of ``runs`` at the same ``sync``, ``decide``, ``n_boot`` and ``seed``, when
            already computed (default: computed here).

    Raises:
        ValueError: naming ``sync`` when it is not a path of the tables, ``max_agreement_loss`` outside [0, 1].
    """
    if sync not in set(regions["path"]):
        raise ValueError(f"sync={sync!r} is not a path of the tables; paths: {sorted(set(regions['path']))}")
    if not 0 <= max_agreement_loss <= 1:
        raise ValueError(f"max_agreement_loss={max_agreement_loss!r} must lie in [0, 1]")

    def interval(lo: float, hi: float, fmt: str, sep: str, unit: str = "") -> str:
        return ("no interval" if math.isnan(lo) or math.isnan(hi) else
                f"95 % CI {lo:{fmt}}{unit}{sep}{hi:{fmt}}{unit}")

    lines = []
    present = [r for r in (*REGIONS, "all") if r in set(regions["region"])]
    for region in present:
        t = regions[regions["region"] == region].set_index("path")
        fastest = t["ttft_ms"].idxmin()
        s = t.loc[sync]
        lines.append(
            f"{region} ({int(s.turns)} turn{'s' if int(s.turns) != 1 else ''}): lowest median TTFT of the {len(t)} "
            f"paths {fastest} ({t.loc[fastest, 'ttft_ms']:.0f} ms; point estimates); {sync} {s.ttft_ms:.0f} ms, "
            f"{s.speedup:.2f}x prefix reuse's speed (paired geometric mean, "
            f"{interval(s.speedup_lo, s.speedup_hi, '.2f', ' to ', 'x')}), re-prefill "
            f"{t.loc[REFERENCE, 'ttft_ms']:.0f} ms; agreement with re-prefill {s.agree_pct:.0f} % vs prefix reuse {t.loc[PREFIX, 'agree_pct']:.0f} % "
            f"({s.agree_delta:+.0f} pp, {interval(s.agree_delta_low, s.agree_delta_high, '+.0f', ' to ')}); "
            f"tokens recomputed {s.recomputed:.0f} vs {t.loc[PREFIX, 'recomputed']:.0f} (medians).")
    if "kind" in runs.columns:
        kt = kinds if kinds is not None else kind_table(runs, seed=seed, n_boot=min(n_boot, 2_000))
        for kind in [k for k in (*QUESTION_KINDS, "reaching") if k in set(kt["kind"])]:
            t = kt[kt["kind"] == kind].set_index("path")
            shift = f", {SHIFT} {t.loc[SHIFT, 'agree_pct']:.0f} %" if SHIFT in t.index else ""
            lines.append(
                f"{kind} questions ({int(t.loc[sync, 'turns'])} turns, gold known on {t.loc[sync, 'known_pct']:.0f} "
                f"%): agreement with re-prefill {sync} {t.loc[sync, 'agree_pct']:.0f} %{shift}, prefix reuse "
                f"{t.loc[PREFIX, 'agree_pct']:.0f} %; EM re-prefill {t.loc[REFERENCE, 'em_pct']:.0f} %, {sync} "
                f"{t.loc[sync, 'em_pct']:.0f} %.")
    if decided is None:
        decided = primary_table(runs, sync=sync, decide=decide, n_boot=n_boot, seed=seed)
    lines += family_lines(decided, what="turns", clusters="traces")
    wide, meta = _later_wide(runs)
    fam = decided[decided["family"] == REGION_FAMILY.name]
    by_region = [r for r in REGIONS if (meta["region"] == r).any()]
    avoid, unshown, ok = [], [], []
    limit = f"{100 * max_agreement_loss:g} points"
    for region, (_, r) in zip(by_region, fam.iterrows()):
        mask = (meta["region"] == region).to_numpy()
        a_agree = wide["agree"][sync].astype(float).to_numpy()[mask]
        b_agree = wide["agree"][PREFIX].astype(float).to_numpy()[mask]
        losses = int(np.sum((b_agree == 1) & (a_agree == 0)))
        loss = bound_claim(losses, len(a_agree), at_most=max_agreement_loss, decide=decide)
        lines.append(f"  {region}: " + bound_sentence(f"{sync} loses re-prefill's answer that prefix reuse kept on",
                                                      losses, len(a_agree), at_most=max_agreement_loss,
                                                      decide=decide, units="turns"))
        if r["verdict"] == LOSES:
            avoid.append(f"{region}: prefix reuse is shown faster ({r['estimate']:.2f}x)")
        if loss == FAILS:
            avoid.append(f"{region}: a loss of agreement above {limit} is shown")
        if r["verdict"] == BEATS and loss == HOLDS:
            ok.append(region)
        elif r["verdict"] != LOSES and loss != FAILS:
            unshown.append(region)
    if not decide:
        lines.append("Where to use the sync path: not decided at this size (a plumbing check).")
        return lines + _whole_trace_lines(summary)
    if avoid:
        lines.append(f"Where {sync} should not be used: " + "; ".join(avoid) + ".")
    if ok:
        lines.append(f"{sync} is shown faster than prefix reuse and shown to lose at most {limit} of agreement in: "
                     + ", ".join(ok) + ".")
    if unshown:
        lines.append(f"Not shown at this size (faster, or within {limit} of agreement) in: " + ", ".join(unshown)
                     + ".")
    return lines + _whole_trace_lines(summary)


def _whole_trace_lines(summary: pd.DataFrame) -> list[str]:
    """Whole-trace cost and quality per path against re-prefill (descriptive)."""
    sm = summary.set_index("path")
    return [f"over whole traces {path}: {r.cost_ratio:.0%} of re-prefill's tokens recomputed, {r.time_ratio:.0%} of "
            f"its summed TTFT; agreement {r.agree_pct:.0f} %, EM {r.em_pct:.0f} % (re-prefill EM "
            f"{sm.loc[REFERENCE, 'em_pct']:.0f} %)." for path, r in sm.iterrows() if path != REFERENCE]
