"""The matched-token protocol on a holdout roster (appendix 9.3, Table 14; issues 28 and 40).

The region arm (:class:`MatchedRegion`: SUR's whole units up to its stopping point by default) and each token-level
allocator at that exact per-case count (:class:`MatchedTokens`) run on the frozen holdout roster (seed
:data:`~sur_lab.studies.niah.design.HOLDOUT_SEED`) by :func:`matched_sweep` into :func:`matched_folder`; the report is
:func:`table14` (the :data:`~sur_lab.studies.niah.design.MATCHED` and
:data:`~sur_lab.studies.niah.design.MATCHED_BY_LENGTH` families) with :func:`table14_lines`, and the count
distribution :func:`matched_counts`, :func:`count_summary` and :func:`plot_matched_counts`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from sur_lab.allocators import (
    COUNT_RULES,
    AllocationRequest,
    check_region,
    get_allocator,
    region_count,
    resolve_method,
)
from sur_lab.analysis.decisions import kind_of
from sur_lab.budget import base_allowance, check_budget
from sur_lab.repair import repair
from sur_lab.studies.niah.cases import niah_scorer, parse_niah_answer
from sur_lab.studies.niah.design import MATCHED, MATCHED_BY_LENGTH
from sur_lab.studies.niah.report import _decided
from sur_lab.studies.niah.study import FOLDER, STUDY
from sur_lab.sweeps import EVAL_BATCH, records_frame, run_sweep, sweep_folder

__all__ = ["region_label", "matched_label", "MatchedRegion", "MatchedTokens", "matched_methods", "matched_folder",
    "matched_sweep", "length_label", "matched_counts", "count_summary", "plot_matched_counts", "table14",
    "table14_lines"]

def region_label(region: str = "SUR", count: str = "whole_units") -> str:
    """The record method of the region arm under count rule ``count`` (:data:`sur_lab.allocators.COUNT_RULES`):
    ``"SUR (whole units)"`` for ``"whole_units"``, the region's own name for ``"selected"``.

    Raises:
        ValueError: naming ``count`` when it is not a count rule.
    """
    if count not in COUNT_RULES:
        raise ValueError(f"count={count!r} must be one of {COUNT_RULES}")
    return region if count == "selected" else f"{region} (whole units)"


def matched_label(allocator: str, region: str = "SUR", count: str = "whole_units") -> str:
    """The record method of ``allocator`` at the region arm's count: ``"Dense tokens (matched to SUR (whole
    units))"`` (``count="selected"``: ``"Dense tokens (matched to SUR)"``).

    Raises:
        ValueError: as :func:`region_label`.
    """
    return f"{allocator} (matched to {region_label(region, count)})"


@dataclass(frozen=True)
class MatchedRegion:
    """A sweep method: the region arm of the matched-token protocol, SUR at the case's matched count n.

    n is :func:`sur_lab.allocators.region_count` ``(region, request, count)`` on the case's request at b. With
    ``count="whole_units"`` (the default, issue 40) n is SUR's natural stopping point: whole units in its ranked
    order until B = B(S, b) is reached (our reading of the paper's "SUR V1", whose count is not fixed by the budget),
    and SUR at the exact allowance n selects exactly those units (:func:`sur_lab.allocators.sur.whole_unit_count`);
    n differs between cases and from B. With ``"selected"`` n is the region's own count (B for SUR at the suffix
    budget: the Table 12 comparison again).

    Attributes:
        region: SUR or a SUR variant name (any region allocator with ``count="selected"``).
        budget_pct: b, % of the suffix, from which B and n follow (the record's budget).
        count: the count rule (:data:`sur_lab.allocators.COUNT_RULES`).
        protocol: ``"forward"`` (the rows are recomputed).

    Raises:
        ValueError: (at construction) naming ``region`` when unknown (or, for ``"whole_units"``, not SUR or a SUR
            variant), ``count`` when not a rule, or ``budget_pct`` outside [0, 100].
    """

    region: str
    budget_pct: float
    count: str = "whole_units"
    protocol: str = "forward"

    def __post_init__(self) -> None:
        check_region(self.region, self.count)
        object.__setattr__(self, "budget_pct", float(check_budget(self.budget_pct)))

    @property
    def name(self) -> str:
        """The record's method: :func:`region_label` ``(region, count)``."""
        return region_label(self.region, self.count)

    def repair(self, lm, prepared, *, executor: str, seed: int, options: Mapping[str, Any] | None):
        """The region's repair at exactly n positions on this case (a new cache; ``prepared`` is kept)."""
        n = _matched_count(lm, prepared, self.region, self.budget_pct, self.count, seed, options)
        return repair(lm, prepared, self.region, self.budget_pct, executor=executor, seed=seed, options=options,
                      allowance=n)


@dataclass(frozen=True)
class MatchedTokens:
    """A sweep method: the token-level ``allocator`` given exactly the region arm's count n on each case.

    The matched-token protocol of appendix 9.3 (Table 14; :func:`sur_lab.allocators.matched_token_selections`): on a
    case's request at budget b, n is :func:`sur_lab.allocators.region_count` ``(region, request, count)``, the count
    :class:`MatchedRegion` refreshes, and it becomes the exact allowance of the token-level allocator's repair
    (:func:`sur_lab.repair.repair` with ``allowance=n``), so the two supports differ only in which positions they
    hold. The record's ``allowance`` is n and its ``select_ms`` the token-level allocator's own selection (the count's
    computation is protocol bookkeeping, untimed).

    Attributes:
        allocator: a token-level allocator (:data:`sur_lab.allocators.TOKEN_LEVEL_ALLOCATORS`) or variant name.
        region: the region allocator or variant name whose count is matched (``"SUR"``).
        budget_pct: b, % of the suffix, at which the region's count is taken (the record's budget).
        count: the count rule (:data:`sur_lab.allocators.COUNT_RULES`; ``"whole_units"``: SUR's whole-unit stopping
            point, ``"selected"``: the region's own count).
        protocol: ``"forward"`` (the rows are recomputed).

    Raises:
        ValueError: (at construction) naming ``allocator`` or ``region`` when unknown or equal (``region`` also when
            ``count="whole_units"`` and it is not SUR or a SUR variant), ``count`` when not a rule, or
            ``budget_pct`` outside [0, 100].
    """

    allocator: str
    region: str
    budget_pct: float
    count: str = "whole_units"
    protocol: str = "forward"

    def __post_init__(self) -> None:
        get_allocator(self.allocator)
        check_region(self.region, self.count)
        if self.allocator == self.region:
            raise ValueError(f"allocator={self.allocator!r} must differ from region")
        object.__setattr__(self, "budget_pct", float(check_budget(self.budget_pct)))

    @property
    def name(self) -> str:
        """The record's method: :func:`matched_label` ``(allocator, region, count)``."""
        return matched_label(self.allocator, self.region, self.count)

    def repair(self, lm, prepared, *, executor: str, seed: int, options: Mapping[str, Any] | None):
        """The token-level repair at the region arm's count on this case (a new cache; ``prepared`` is kept)."""
        n = _matched_count(lm, prepared, self.region, self.budget_pct, self.count, seed, options)
        return repair(lm, prepared, self.allocator, self.budget_pct, executor=executor, seed=seed, options=options,
                      allowance=n)


def _matched_count(lm, prepared, region: str, budget_pct: float, count: str, seed: int,
                   options: Mapping[str, Any] | None) -> int:
    """n of :func:`sur_lab.allocators.region_count` on the case's request at ``budget_pct`` (units kept on
    ``prepared``), computed once per prepared edit: kept in ``prepared.matched_counts`` and read back for the same
    region, budget, count, seed and ``options`` object (every arm of a case)."""
    key = (region, float(budget_pct), count, int(seed))
    kept = prepared.matched_counts.get(key)
    if kept is not None and kept[0] is options:
        return kept[1]
    opts = dict(options or {})
    if prepared.dirty_cache is not None:
        opts.setdefault("dirty_cache", prepared.dirty_cache)
    request = AllocationRequest(lm, prepared.edit, budget_pct, shift_cache=prepared.shift_cache,
                                units=prepared.units, seed=seed, options=opts)
    n = region_count(region, request, count)
    if prepared.units is None and request.units is not None:
        prepared.units = request.units
    prepared.matched_counts[key] = (options, n)
    return n


def matched_methods(p: Mapping[str, Any]) -> list:
    """The matched-token sweep's methods for parameters ``p``: Shift and Re-prefill (when among ``p["references"]``),
    then per matched budget of ``p["matched_budgets"]`` the region arm (:class:`MatchedRegion` of
    ``p["matched_region"]`` under ``p["matched_count"]``) and one :class:`MatchedTokens` per token-level allocator of
    ``p["matched_allocators"]``."""
    refs = [r for r in p["references"] if r in ("Shift", "Re-prefill")]
    region, count = p["matched_region"], p["matched_count"]
    budgets = p["matched_budgets"]
    return [*refs, *(MatchedRegion(region, b, count) for b in budgets),
            *(MatchedTokens(a, region, b, count) for a in p["matched_allocators"] for b in budgets)]


def matched_folder(lm, p: Mapping[str, Any], *, eval_batch: int | None = None, executor: str = "sequential",
                   outputs: Path | None = None) -> Path:
    """The matched-token sweep's folder (``02_niah_matched_...``: sizes, matched budgets, the count rule, the holdout
    seed, the evaluation batch, the executor when not sequential, the model's fingerprint)."""
    extra = {} if executor == "sequential" else {"ex": executor}
    return sweep_folder(f"{FOLDER}_matched", lm, outputs=outputs, ctx=p["context_lens"], n=p["matched_cases"],
                        b=p["matched_budgets"], count=p["matched_count"], tok=p["max_new_tokens"],
                        seed=p["holdout_seed"], eb=EVAL_BATCH if eval_batch is None else eval_batch, **extra)


def matched_sweep(lm, *, preset: str = "default", out: Path | str | None = None, workers: int = 1,
                  threads: int | None = None, address: str | None = None, executor: str = "sequential",
                  eval_batch: int | None = None, progress: bool = True,
                  **overrides: Any) -> tuple[pd.DataFrame, Path]:
    """Run (or resume) the matched-token study (Table 14 analogue) on the frozen holdout roster.

    The roster is ``STUDY.cases`` at the preset's sizes, ``p["matched_cases"]`` of them (alternating over
    ``context_lens``), with seed ``p["holdout_seed"]`` (:data:`~sur_lab.studies.niah.design.HOLDOUT_SEED`, never used
    for design); the methods are :func:`matched_methods`: the region arm at each matched budget
    (:class:`MatchedRegion`: SUR's whole units up to its stopping point by default), and each token-level allocator at
    that exact count on the same case (:class:`MatchedTokens`). Records come from :func:`sur_lab.sweeps.run_sweep`,
    strictly scored like ``STUDY.sweep``'s.

    Args:
        lm, out, workers, threads, address, executor, eval_batch, progress: as ``STUDY.sweep``.
        preset, overrides: the parameters (``STUDY.params``; e.g. ``matched_allocators=["Dense tokens"]``,
            ``matched_budgets=[2, 5]``, ``matched_count="whole_units"``, ``holdout_seed=...``).

    Returns:
        ``(records, folder)``; ``records`` is empty (and nothing runs) when ``matched_allocators`` is empty.

    Raises:
        ValueError: naming a bad parameter (an unknown allocator or count rule, a budget outside [0, 100]), before
            any model call.
    """
    p = STUDY.params(preset, **overrides)
    eval_batch = EVAL_BATCH if eval_batch is None else eval_batch
    the_methods = matched_methods(p)  # MatchedRegion / MatchedTokens check names, counts and budgets here
    where = Path(out) if out is not None else matched_folder(lm, p, eval_batch=eval_batch, executor=executor)
    if not p["matched_allocators"]:
        return records_frame([]), where
    seed = int(p["holdout_seed"])
    the_cases = STUDY.cases(lm.tokenizer, {**p, "num_cases": p["matched_cases"]}, seed)
    records = run_sweep(lm, the_cases, the_methods, p["matched_budgets"], where, max_new_tokens=p["max_new_tokens"],
                        executor=executor, eval_batch=eval_batch, scorer=niah_scorer, parser=parse_niah_answer,
                        seed=seed, workers=workers, threads=threads, address=address, progress=progress)
    return records, where


def length_label(context_len: float) -> str:
    """A context length's row label: ``"1K"`` for 1024 tokens, ``"32K"`` for 32768, the number otherwise
    (``"256"``)."""
    c = int(context_len)
    return f"{c // 1024}K" if c % 1024 == 0 else str(c)


def _region_allowance(records: pd.DataFrame, region: str) -> np.ndarray:
    """B per record: Eq. 3's ``B(S, b)`` of the record's suffix at its budget, on the whole-prompt base when
    ``region`` binds ``allowance_base=prompt`` (the B from which the region's count starts); int64."""
    base = resolve_method(region)[1].get("allowance_base", "suffix")
    return np.array([base_allowance(int(s), int(p) + int(s), float(b), base)
                     for s, p, b in zip(records["suffix_len"], records["prefix_len"], records["budget_pct"])],
                    dtype=np.int64)


def matched_counts(records: pd.DataFrame, *, region: str = "SUR", count: str = "whole_units") -> pd.DataFrame:
    """The matched count of every case and budget: the region arm's n beside the suffix allowance B it started from.

    Args:
        records: :func:`matched_sweep` records (``case_id``, ``context_len``, ``method``, ``budget_pct``,
            ``allowance``, ``prefix_len``, ``suffix_len``).
        region, count: the region arm (:func:`region_label`).

    Returns:
        One row per (case, budget), sorted by length, budget and case: ``case_id``, ``context_len``, ``length``
        (:func:`length_label`), ``budget_pct``, ``suffix_len``, ``allowance_b`` (B, positions), ``matched_count``
        (n, positions), ``extra`` (n - B) and ``ratio`` (n / B; NaN when B = 0).

    Raises:
        ValueError: naming ``records`` when it holds no region-arm row.
    """
    label = region_label(region, count)
    reg = records[records["method"] == label]
    if reg.empty:
        raise ValueError(f"records hold no {label!r} row (the region arm of the matched-token sweep)")
    b = _region_allowance(reg, region)
    n = reg["allowance"].to_numpy(np.int64)
    out = pd.DataFrame({"case_id": reg["case_id"].to_numpy(), "context_len": reg["context_len"].astype(int).to_numpy(),
                        "length": [length_label(c) for c in reg["context_len"]],
                        "budget_pct": reg["budget_pct"].astype(float).to_numpy(),
                        "suffix_len": reg["suffix_len"].astype(int).to_numpy(), "allowance_b": b,
                        "matched_count": n, "extra": n - b,
                        "ratio": np.where(b > 0, n / np.maximum(b, 1), np.nan)})
    return out.sort_values(["context_len", "budget_pct", "case_id"], ignore_index=True)


def count_summary(counts: pd.DataFrame) -> pd.DataFrame:
    """The count distribution of :func:`matched_counts`, per length and budget, then every length pooled
    (``length`` ``"all"``): ``cases``, ``mean_b``, ``min_count``, ``median_count``, ``mean_count``, ``max_count``,
    ``distinct_counts`` and ``share_at_b`` (% of cases whose n equals B).

    Raises:
        ValueError: if ``counts`` is empty.
    """
    if counts.empty:
        raise ValueError("counts is empty: no region-arm row")
    rows = []
    for (ctx, budget), g in [*counts.groupby(["context_len", "budget_pct"], sort=True),
                             *(((None, b), g) for b, g in counts.groupby("budget_pct", sort=True))]:
        n = g["matched_count"]
        rows.append({"length": "all" if ctx is None else length_label(ctx), "budget_pct": float(budget),
                     "cases": len(g), "mean_b": float(g["allowance_b"].mean()), "min_count": int(n.min()),
                     "median_count": float(n.median()), "mean_count": float(n.mean()), "max_count": int(n.max()),
                     "distinct_counts": int(n.nunique()),
                     "share_at_b": 100.0 * float((n == g["allowance_b"]).mean())})
    return pd.DataFrame(rows)


def plot_matched_counts(counts: pd.DataFrame):
    """The count distribution: per matched budget a panel of every case's matched count n against its suffix
    allowance B (one colour per context length), with the line n = B (the degenerate protocol's counts).

    Returns:
        The matplotlib figure.

    Raises:
        ValueError: if ``counts`` is empty.
    """
    if counts.empty:
        raise ValueError("counts is empty: no region-arm row")
    budgets = sorted(counts["budget_pct"].unique())
    lengths = list(dict.fromkeys(counts.sort_values("context_len")["length"]))
    palette = dict(zip(lengths, sns.color_palette("crest", len(lengths))))
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.4 * len(budgets) + 1.2, 4.0), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        sub = counts[counts["budget_pct"] == budget]
        for length in lengths:
            at = sub[sub["length"] == length]
            ax.scatter(at["allowance_b"], at["matched_count"], s=18, alpha=0.8, color=palette[length], label=length)
        hi = float(max(sub["allowance_b"].max(), sub["matched_count"].max(), 1))
        ax.plot([0, hi], [0, hi], color="0.3", lw=0.9, ls="--", label="n = B")
        ax.set_xlabel("suffix allowance B (positions)")
        ax.set_ylabel("matched count n (positions)")
        ax.set_title(f"b = {budget:g} %")
    axes[0][-1].legend(title="context", fontsize=8)
    fig.tight_layout()
    return fig


def table14(records: pd.DataFrame, *, region: str = "SUR", count: str = "whole_units",
            metrics: Sequence[str] = ("em", "agree_reprefill"), n_boot: int = 10_000, seed: int = 20260928,
            decide: bool = True) -> pd.DataFrame:
    """Our Table 14: region against token-level selection at matched per-case counts, case-paired, every length
    pooled and per context length.

    For each matched budget and each token-level allocator of ``records`` (methods named :func:`matched_label`
    ``(allocator, region, count)``): the mean matched count n and the mean suffix allowance B it started from, then
    for each metric the region arm's and the token-level allocator's mean (×100) and the region minus token difference
    in pp. The pooled rows (``length`` ``"all"``) are the :data:`MATCHED` family and the per-length rows (``"1K"``,
    ``"2K"``, ...) the :data:`MATCHED_BY_LENGTH` family, each decided per metric by
    :func:`sur_lab.analysis.decisions.paired_family` (exact sign test, Newcombe interval, Holm over the family's
    rows).

    Args:
        records: :func:`matched_sweep` records (``case_id``, ``context_len``, ``method``, ``budget_pct``,
            ``allowance``, ``prefix_len``, ``suffix_len`` and the metrics).
        region, count: the region arm (:func:`region_label`).
        metrics: 0/1 record fields (``"em"``, ``"agree_reprefill"``).
        n_boot, seed, decide: as :func:`~sur_lab.studies.niah.report.paired_differences`.

    Returns:
        One row per (length, budget, allocator), pooled rows first: ``length``, ``context_len`` (NaN when pooled),
        ``family``, ``budget_pct``, ``allocator``, ``mean_tokens`` (mean n), ``mean_b`` (mean B), ``n`` (cases),
        ``unit`` ("pp"), and per metric ``{metric}_region``, ``{metric}_token``, ``{metric}_delta``,
        ``{metric}_delta_low``, ``{metric}_delta_high``, ``{metric}_p_adj``, ``{metric}_delta_mde`` (the smallest
        difference the family's size could separate; the columns of
        :func:`sur_lab.analysis.decisions.in_units` in ``unit``) and ``{metric}_verdict``.

    Raises:
        ValueError: naming ``records`` when it holds no matched method or no region-arm row at a matched budget, or
            when a token-level record's count differs from the region arm's on its case (the protocol was broken);
            naming ``metrics`` when one is not a record field; naming ``count`` when it is not a count rule.
    """
    missing = [m for m in metrics if m not in records.columns]
    if missing:
        raise ValueError(f"metrics {missing} are not record fields")
    numeric = [m for m in metrics if kind_of(records[m]) != "binary"]
    if numeric:
        raise ValueError(f"metrics {numeric} are not 0/1 record fields (Table 14 compares proportions, in pp)")
    label = region_label(region, count)
    suffix = f" (matched to {label})"
    token_methods = [m for m in dict.fromkeys(records["method"]) if str(m).endswith(suffix)]
    if not token_methods:
        raise ValueError(f"records hold no method matched to {label!r} (names ending in {suffix!r})")
    budgets = sorted(records.loc[records["method"].isin(token_methods), "budget_pct"].unique())
    for budget in budgets:
        at_b = records[records["budget_pct"] == budget]
        counts = at_b[at_b["method"] == label].set_index("case_id")["allowance"]
        if counts.empty:
            raise ValueError(f"records hold no {label!r} row at {budget:g} %")
        for method in token_methods:
            mine = at_b[at_b["method"] == method].set_index("case_id")["allowance"]
            if not mine.index.isin(counts.index).all() or (mine != counts.reindex(mine.index)).any():
                raise ValueError(f"records: {method!r} at {budget:g} % does not select {label!r}'s count on every "
                                 "case")
    # The per-length family pairs arms within one length: its arm labels carry the length ("... @1K 2%").
    tagged = records.assign(method=[f"{m} @{length_label(c)}" for m, c in zip(records["method"],
                                                                             records["context_len"])])
    lengths = [None, *sorted(records["context_len"].dropna().unique())]
    tables = []
    for family, frame, ctxs in ((MATCHED, records, lengths[:1]), (MATCHED_BY_LENGTH, tagged, lengths[1:])):
        rows, pairs = [], []
        for ctx in ctxs:
            sub = records if ctx is None else records[records["context_len"] == ctx]
            tag = "" if ctx is None else f" @{length_label(ctx)}"
            for budget in budgets:
                at_b = sub[sub["budget_pct"] == budget]
                reg = at_b[at_b["method"] == label]
                for method in token_methods:
                    tok = at_b[at_b["method"] == method]
                    if tok.empty:
                        continue
                    reg_t = reg[reg["case_id"].isin(tok["case_id"])]
                    row = {"length": "all" if ctx is None else length_label(ctx),
                           "context_len": float("nan") if ctx is None else float(ctx), "family": family.name,
                           "budget_pct": float(budget), "allocator": method.removesuffix(suffix),
                           "mean_tokens": float(tok["allowance"].mean()),
                           "mean_b": float(_region_allowance(reg_t, region).mean()), "n": int(len(tok)),
                           "unit": "pp"}
                    for metric in metrics:
                        row.update({f"{metric}_region": 100 * float(reg_t[metric].astype(float).mean()),
                                    f"{metric}_token": 100 * float(tok[metric].astype(float).mean())})
                    rows.append(row)
                    pairs.append((f"{label}{tag} {budget:g}%", f"{method}{tag} {budget:g}%"))
        table = pd.DataFrame(rows)
        for metric in metrics:
            res = _decided(frame, pairs, metric, family, decide=decide, n_boot=n_boot, seed=seed)
            for col in ("delta", "delta_low", "delta_high", "p_adj", "delta_mde", "verdict"):
                table[f"{metric}_{col}"] = res[col].to_numpy()
        tables.append(table)
    return pd.concat(tables, ignore_index=True)


def table14_lines(table: pd.DataFrame, *, region: str = "SUR", count: str = "whole_units") -> list[str]:
    """Table 14 in words, per family (:data:`MATCHED`, :data:`MATCHED_BY_LENGTH`): a heading naming its size, then per
    row the length, budget, mean matched count and B, and per endpoint the region minus token difference with its
    interval, adjusted p, the smallest separable difference and the verdict.

    Args:
        table: :func:`table14`.
        region, count: the region arm (:func:`region_label`).
    """
    arm = region_label(region, count)
    lines = []
    for family in (MATCHED, MATCHED_BY_LENGTH):
        rows = table[table["family"] == family.name]
        lines.append(f"This run ({family.name}, Holm over {len(rows)} comparisons per endpoint):")
        for row in rows.itertuples():
            parts = []
            for m, name in (("em", "EM"), ("agree_reprefill", "agreement")):
                get = lambda col: getattr(row, f"{m}_{col}")  # noqa: E731
                mde = (f"{get('delta_mde'):.0f} {row.unit}" if get("delta_mde") <= 100 else "none at this size")
                parts.append(f"{name} {get('delta'):+.1f} {row.unit} (95 % CI {get('delta_low'):+.1f} to "
                             f"{get('delta_high'):+.1f}, p_adj {get('p_adj'):.2g}, smallest separable {mde}): "
                             f"{get('verdict')}")
            lines.append(f"  {row.length}, {row.budget_pct:g} % (mean n {row.mean_tokens:.1f} matched tokens, mean B "
                         f"{row.mean_b:.1f}), {arm} minus {row.allocator} over {row.n} case(s): " + "; ".join(parts))
    return lines
