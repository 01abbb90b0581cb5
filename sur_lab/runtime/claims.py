"""The claims table: each claim of the paper and of SAFE-KV, and each question beyond them, against this release.

One :class:`Claim` per row of :data:`CLAIMS`, numbered by where it stands: ``P`` the paper's main text and its
appendix 9.1-9.2 allocation controls (which section 5 summarises), ``A9.3`` / ``A10`` / ``A11`` its appendix findings,
``S`` SAFE-KV's rules (its abstract and design ledger, Table 27), ``B`` the questions beyond both papers. A row names
the paper's own figure, the notebook and table of this suite it is read from, and a ``compute`` function from the
results folder to an :class:`Estimate`: this suite's estimate with its interval and the verdict, "holds", "does not
hold" or "undecided at this size" with the minimal detectable effect. Verdicts come only from the decisions module
(``sur_lab.analysis.decisions``): a decided row that a notebook saved (``paired_family``'s, e.g.
``02_sur_vs_allocators``, ``03_decisions``, ``09_paired_differences``) through :func:`decide`; a contrast judged by
``decisions.judge`` as its study declares (:func:`threshold_claim` for a magnitude, "by over 80 pp"); a proportion
by ``decisions.bound_claim``; a conjunction of such rows by :func:`all_of`. Where a notebook saves its records
but no decided table, the row rebuilds the per-unit table with the study's own function and decides a family declared
here (appendix 11: notebook 05's decodes, per cell by ``execution_paths.cell_table``). A row without a ``compute``
function, whose notebook has not finished in the release, or whose quantity the run cannot produce
(:class:`NotComputed`: a table not written, a paper model or a GPU measurement) renders as "not yet computed" with
the reason, never as a verdict. A claim whose comparison the release's preset does not run (an arm, budget or context
length that only the ``paper`` preset runs: :class:`NotRun`) is "undecided at this size" with no unit, the verdict
``decisions.claim_of_outcome(None)`` gives a comparison that was not made, and its note names the preset that runs
it. Each ``compute`` reads ``results/tables/<table>_<run tag>.csv`` (:func:`read_table`).

:func:`write_claims` writes ``results/claims.md`` (the first page of the results) and ``results/claims.csv``; the
release (:mod:`sur_lab.runtime.release`) calls it after every run. Sources: "Budgeted KV-Cache Repair for Evolving
Contexts" (sections 1, 4, 5 and appendices 8-11) and "SAFE-KV" (abstract, Tables 1, 3, 5, 7, 20, 27).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd

from sur_lab.analysis.decisions import (
    ALPHA,
    EQUIVALENT,
    NOT_DECIDED,
    Family,
    bound_claim,
    claim_of_bound,
    claim_of_outcome,
    claim_rank,
    claim_reading,
    claim_verdict,
    decides,
    judge,
    min_separating_units,
    paired_family,
    proportion_interval,
)
from sur_lab.analysis.decisions import CLAIM_EXPECTATIONS as EXPECTATIONS
from sur_lab.analysis.decisions import CLAIM_VERDICTS as VERDICTS
from sur_lab.paths import atomic_path
from sur_lab.runtime.run_notebooks import notebooks
from sur_lab.studies import execution_paths
from sur_lab.studies.agent_session import PRIMARY as SESSION_PRIMARY
from sur_lab.studies.agent_session import REPREFILL_FAMILY as SESSION_REPREFILL
from sur_lab.studies.agent_traces import AGREEMENT_FAMILY, PREFIX, REGION_FAMILY, SHIFT
from sur_lab.studies.evidence_location import COMPLETE_REPLAY, FIXED_SLOT_LABEL, NLL_SIDE_MARGIN
from sur_lab.analysis.conclusions import paired_outcomes
from sur_lab.analysis.stats import timed_records
from sur_lab.studies.natural_qa import LATENCY, PRIMARY, REFERENCE_FAMILY, RIVALS, aggregate_trials, results_table
from sur_lab.studies.niah import BOUNDARY_CONTROLS, JOINT_ARM, MATCHED
from sur_lab.studies.noprefix import DONOR_PROXY, LEDGER_MARGIN
from sur_lab.studies.presets import lead_endpoint
from sur_lab.studies.stale_facts import EM_FAMILY, STALE_FAMILY

#: The verdict words of a computed row (:data:`VERDICTS`, the decisions module's), and the word of a row that is not
#: computed. What each kind of claim needs from a decisions row to hold: :data:`EXPECTATIONS` (see :func:`decide`).
NOT_COMPUTED = "not yet computed"


@dataclass(frozen=True)
class Estimate:
    """This suite's answer to one claim.

    Attributes:
        estimate: the point estimate, in ``unit``.
        ci_low, ci_high: its interval (the decisions module's; 95 % unless it says otherwise).
        unit: e.g. ``"pp EM"``, ``"nats"``, ``"x"``.
        verdict: one of :data:`VERDICTS`.
        mde: the smallest effect this size could have shown (``unit``), when the verdict is "undecided at this size".
        n: the units the estimate pools (cases, sources, cells).
        note: what the estimate compares, in words.
        p: the p-value the verdict was read from (the comparison's ``p_adj``: Holm-adjusted inside its family), when
            the comparison has one. With it the table shows why an interval that excludes 0 can still read
            "undecided": the interval is unadjusted, the verdict is not.
        family_size: the comparisons ``p`` was adjusted over (1: tested alone).
        n_clusters: the independent units ``n`` is grouped into (sources, traces, episodes) when the comparison
            resampled clusters; the sign test then counts clusters.
    """

    estimate: float | None
    ci_low: float | None
    ci_high: float | None
    unit: str
    verdict: str
    mde: float | None = None
    n: int | None = None
    note: str = ""
    p: float | None = None
    family_size: int | None = None
    n_clusters: int | None = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}; got {self.verdict!r}")


@dataclass(frozen=True)
class Claim:
    """One row of the claims table.

    Attributes:
        id: its number (``P1``, ``A10-2``, ``S3``, ``B1``).
        source: ``"paper"``, ``"SAFE-KV"`` or ``"beyond the papers"``.
        section: where the source states it (``"§4.3, Table 9"``).
        text: the claim, in words.
        paper: the source's own figure for it (its models and hardware, not this suite's).
        notebook: the notebook (stem) whose results it is read from.
        table: the table (file stem under ``results/tables``) it is read from.
        compute: ``compute(results) -> Estimate`` (None: not implemented yet).
    """

    id: str
    source: str
    section: str
    text: str
    paper: str
    notebook: str
    table: str
    compute: Callable[[Path], Estimate] | None = None


def decide(row: Mapping[str, Any], *, expect: str, unit: str, note: str = "") -> Estimate:
    """The verdict of one claim from one comparison row of ``sur_lab.analysis.decisions.paired_family``.

    Every computed row of the table goes through here, so that the table's words are the decisions module's:
    the verdict is :func:`sur_lab.analysis.decisions.claim_verdict` of the row's verdict and ``expect`` (an
    ``"equivalent"`` claim, e.g. "within 0.1 pp of Re-prefill", needs the comparison's declared margin); an
    undecided row carries its ``mde`` when it has one.

    Args:
        row: ``estimate, ci_low, ci_high, n, verdict`` and optionally ``mde``.
        expect: one of :data:`EXPECTATIONS`.
        unit: the estimate's unit.
        note: what is compared.

    Raises:
        ValueError: naming ``expect`` when it is not one of :data:`EXPECTATIONS`, or ``row`` when it lacks a field.
    """
    claim_verdict("", expect)  # refuses an unknown expect before any work
    missing = [k for k in ("estimate", "ci_low", "ci_high", "verdict") if k not in row]
    if missing:
        raise ValueError(f"row lacks {missing}: pass a row of sur_lab.analysis.decisions.paired_family")
    verdict = claim_verdict(row["verdict"], expect)
    n = row.get("n")
    p = _finite(row.get("p_adj", row.get("p")))
    size, clusters = _finite(row.get("family_size")), _finite(row.get("n_clusters"))
    return Estimate(float(row["estimate"]), float(row["ci_low"]), float(row["ci_high"]), unit, verdict,
                    mde=row.get("mde"), n=None if n is None else int(n), note=note, p=p,
                    family_size=None if size is None else int(size),
                    n_clusters=None if clusters is None or n is None or int(clusters) == int(n) else int(clusters))


def paired_claim(family: Mapping[str, Any], *, comparison: str, expect: str, unit: str, kind: str = "binary",
                 margin: float | None = None, note: str = "", **options: Any) -> Estimate:
    """Decide one claim from a family of paired differences: ``sur_lab.analysis.decisions.paired_family`` over
    ``family`` (comparison name -> per-unit paired differences), then :func:`decide` on the row ``comparison``.

    Raises:
        KeyError: naming ``comparison`` when the family has no such row.
    """
    rows = paired_family(family, kind=kind, margin=margin, **options)
    rows = rows.to_dict("records") if hasattr(rows, "to_dict") else list(rows)
    match = [r for r in rows if r.get("comparison") == comparison]
    if not match:
        raise KeyError(f"comparison {comparison!r} is not in the family ({', '.join(map(str, family))})")
    return decide(match[0], expect=expect, unit=unit, note=note)


class NotComputed(Exception):
    """A claim this release cannot answer: the quantity is outside what the run produced (a paper model, a table the
    notebook does not write). Its row reads "not yet computed" with the message as its note; it never carries a
    verdict."""


class NotRun(NotComputed):
    """A claim whose comparison the release's preset does not make: an arm, budget or context length that another
    preset (``paper``) runs. Its row reads "undecided at this size" (``decisions.claim_of_outcome(None)``: a comparison
    not made decides nothing) with no unit (``n`` 0), and the message, naming what is missing and which preset runs it,
    as its note. A :class:`NotComputed` too, so a ``compute`` that tries several comparisons catches both."""


# ---------------------------------------------------------------------------------------------------------------------
# Reading a notebook's tables from the results folder


def _manifest_entry(results: Path, notebook: str) -> dict[str, Any]:
    try:
        entries = json.loads((Path(results) / "manifest.json").read_text(encoding="utf-8")).get("notebooks", {})
    except (OSError, ValueError):
        return {}
    entry = entries.get(notebook)
    return entry if isinstance(entry, dict) else {}


def _is_table_file(stem: str, table: str) -> bool:
    """Whether a file stem is table ``table`` of some run: ``table`` itself, or ``table`` then ``_`` and a run tag
    (:func:`sur_lab.analysis.plotting.run_tag`, whose first part is ``key-value``); ``02_table12_concordance_model-x``
    is another table, not ``02_table12``."""
    if stem == table:
        return True
    if not stem.startswith(table + "_"):
        return False
    return "-" in stem[len(table) + 1:].split("_", 1)[0]


def table_path(results: Path, table: str) -> Path:
    """The CSV file of table ``table`` (a file stem without its run tag, e.g. ``"02_sur_vs_allocators"``) in
    ``results/tables``.

    ``save_table(df, name, tag=tag)`` writes ``tables/{name}_{tag}.csv``; when the manifest lists the notebook's
    outputs, only those files count (a release removes an earlier run's files, a working folder may keep several).

    Raises:
        FileNotFoundError: naming ``table`` when no file of it exists.
        ValueError: naming ``table`` when several runs' files remain (which run the claim reads would be a guess).
    """
    folder = Path(results) / "tables"
    found = sorted(p for p in folder.glob(f"{table}*.csv") if _is_table_file(p.stem, table)) if folder.is_dir() else []
    listed = set(_manifest_entry(results, _notebook_of(table)).get("outputs") or {})
    if listed:
        found = [p for p in found if f"tables/{p.name}" in listed] or found
    if not found:
        raise FileNotFoundError(f"results/tables has no {table} table ({table}_<run tag>.csv)")
    if len(found) > 1:
        raise ValueError(f"{table}: {len(found)} runs' files ({', '.join(p.name for p in found)}); keep one run")
    return found[0]


def _notebook_of(table: str) -> str:
    prefix = table.split("_", 1)[0] + "_"

    return next((p.stem for p in notebooks("*") if p.stem.startswith(prefix)), "")


def read_table(results: Path, table: str, **options: Any):
    """Table ``table`` of ``results`` as a DataFrame (:func:`table_path`; raises as it does); ``options`` go to
    ``pandas.read_csv`` (e.g. ``dtype`` for a column that must stay text)."""
    return pd.read_csv(table_path(results, table), **options)


def _decides(results: Path, notebook: str) -> bool:
    """Whether the notebook's run decides anything (``sur_lab.analysis.decisions.decides`` of the preset the
    manifest records; a folder without a manifest is taken as a deciding run)."""
    return decides(_manifest_entry(results, notebook).get("preset") or None)


def _finite(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def _scaled(row: Mapping[str, Any], scale: float) -> dict[str, Any]:
    """A decisions row with ``estimate``, ``ci_low``, ``ci_high`` and ``mde`` times ``scale`` (100: a fraction in
    pp); a NaN ``mde`` becomes None."""
    out = dict(row)
    for k in ("estimate", "ci_low", "ci_high", "mde"):
        if k in out:
            v = _finite(out[k])
            out[k] = None if v is None else v * scale
    for k in ("estimate", "ci_low", "ci_high"):
        if k in out and out[k] is None:
            out[k] = float("nan")
    if out.get("kind", "binary") == "binary" and out.get("mde") is not None and out["mde"] > scale:
        out["mde"] = None  # k / n above 1: too few units for any difference to separate (no smallest effect)
    return out


def _row(df, table: str, what: str, **equal: Any) -> dict[str, Any]:
    """The one row of ``df`` whose columns equal ``equal``.

    Raises:
        NotComputed: naming ``what`` when the table has no such row (the run did not make that comparison).
        ValueError: naming ``table`` when several rows match, or a column is missing.
    """
    sel = df
    for col, value in equal.items():
        if col not in sel.columns:
            raise ValueError(f"{table} lacks the column {col!r}")
        sel = sel[sel[col] == value]
    if sel.empty:
        raise NotComputed(f"{table} has no row for {what}: this run did not make that comparison")
    if len(sel) > 1:
        raise ValueError(f"{table}: {len(sel)} rows match {equal}")
    return sel.iloc[0].to_dict()


def _scale_unit(row: Mapping[str, Any], endpoint: str) -> tuple[float, str]:
    kind = row.get("kind", "binary")
    return {"binary": (100.0, f"pp {endpoint}"), "ratio": (1.0, "x")}.get(kind, (1.0, endpoint))


def threshold_claim(row: Mapping[str, Any], threshold: float, *, expect: str, unit: str, scale: float = 100.0,
                    decide_: bool = True, note: str = "") -> Estimate:
    """A claim about a difference's magnitude ("by over 80 pp"): ``sur_lab.analysis.decisions.judge`` of the
    decided row's interval and adjusted p against ``threshold`` (in the row's own unit, a fraction for binary
    endpoints) instead of 0, then :func:`decide`. "over 80 pp" holds when the row's p is significant and its whole
    interval lies above 0.80; it does not hold when the whole interval lies below (the interval decides that alone:
    the row's p tests 0, not the threshold); otherwise it is undecided.

    Raises:
        ValueError: naming ``row`` when it lacks ``estimate``, ``ci_low``, ``ci_high``; as :func:`decide`.
    """
    missing = [k for k in ("estimate", "ci_low", "ci_high") if k not in row]
    if missing:
        raise ValueError(f"row lacks {missing}")
    hib = row.get("higher_is_better", True)
    hib = hib if isinstance(hib, bool) else str(hib).strip().lower() != "false"
    # The row's p tests the difference against 0, not against the threshold: it is needed before "holds" (a
    # significant difference whose interval clears the threshold), not before "does not hold" (an interval wholly on
    # the wrong side of the threshold, e.g. [-10, +6] pp against "over 80 pp"), which the interval alone decides.
    low, high = _finite(row["ci_low"]), _finite(row["ci_high"])
    wrong_side = low is not None and high is not None and (high < threshold if hib else low > threshold)
    p_adj = None if wrong_side else _finite(row.get("p_adj"))
    word = judge(row["estimate"], row["ci_low"], row["ci_high"], p_adj=p_adj, null=threshold, higher_is_better=hib,
                 n=row.get("n"), decide=decide_ and row.get("verdict") != NOT_DECIDED)
    return decide(_scaled({**row, "verdict": word}, scale), expect=expect, unit=unit, note=note)


def all_of(parts: Mapping[str, Estimate], *, missing: Sequence[str] = ()) -> Estimate:
    """A claim that is the conjunction of several decided comparisons ("beats each of four allocators"): the part
    whose verdict is weakest ("does not hold", then "undecided at this size", then "holds"; the first in order on a
    tie), so the claim holds only when every part does and fails when one fails. The verdict is that part's
    (:func:`decide`'s), unchanged; the note lists every part with its estimate, its verdict and, in parentheses, how
    it was read (the part's own note, unless it only repeats the part's name).

    Raises:
        NotComputed: when ``parts`` is empty (none of the comparisons ran).
    """
    if not parts:
        raise NotComputed("none of the comparisons ran" + (f" ({', '.join(missing)})" if missing else ""))
    label, weakest = min(parts.items(), key=lambda kv: claim_rank(kv[1].verdict))
    listed = "; ".join(f"{k}: {format_estimate(vars(e))} {e.verdict}" + (f" ({e.note})" if e.note and e.note != k
                                                                           else "") for k, e in parts.items())
    note = f"all of {len(parts)} must hold; shown: {label}. {listed}"
    if missing:
        note += f". Not run here: {', '.join(missing)}"
    return replace(weakest, note=note)


def _not_run(reason: str) -> Callable[[Path], Estimate]:
    """A ``compute`` for a claim whose comparison the release's preset does not run (:class:`NotRun`): its row is
    "undecided at this size" with no unit, and ``reason`` (what is missing, which preset runs it) is its note."""

    def compute(results: Path) -> Estimate:
        raise NotRun(reason)

    compute.__doc__ = f"Not run at this preset: {reason}"
    return compute


def not_run_part(reason: str) -> Estimate:
    """The part of an :func:`all_of` claim that the preset does not run: "undecided at this size" with no unit (a
    comparison not made decides nothing), so the conjunction can fail on its other parts but never hold."""
    return Estimate(None, None, None, "", claim_of_outcome(None), n=0, note=f"not run at this preset: {reason}")


# ---------------------------------------------------------------------------------------------------------------------
# Notebook 02 (Erasing-NIAH): its decided tables, on its lead endpoint


_ENDPOINT_WORDS = {"em": "EM", "agree_reprefill": "agreement with Re-prefill"}


def _niah_lead(results: Path) -> str:
    """Notebook 02's lead endpoint (``"em"`` or ``"agree_reprefill"``), as the notebook chose it: strict EM when
    Re-prefill's EM (``02_budget_table_em``, its ``Reference`` column, %) reaches
    :data:`sur_lab.studies.presets.EM_LEAD_MIN`, else agreement with Re-prefill. Its decided tables are on it."""
    row = _row(read_table(results, "02_budget_table_em"), "02_budget_table_em", "Re-prefill", method="Re-prefill")
    em = _finite(row.get("Reference"))
    return lead_endpoint(float("nan") if em is None else em / 100)


def _niah_rival(results: Path, comparison: str, *, expect: str = "greater", table: str = "02_sur_vs_allocators",
                threshold: float | None = None) -> Estimate:
    lead = _niah_lead(results)
    df = read_table(results, table)
    row = _row(df, table, repr(comparison), comparison=comparison)
    endpoint = _ENDPOINT_WORDS[lead]
    note = (f"{comparison}, on notebook 02's lead endpoint ({endpoint}); {row.get('family')}, "
            f"Holm over {row.get('family_size')}")
    if threshold is None:
        return decide(_scaled(row, 100.0), expect=expect, unit=f"pp {endpoint}", note=note)
    return threshold_claim(row, threshold, expect=expect, unit=f"pp {endpoint}",
                           note=note + f"; the claim needs the interval above {100 * threshold:g} pp")


def p1_sur_vs_dense(results: Path) -> Estimate:
    """P1: SUR minus Dense tokens at 2 %, its interval against the paper's "over 80 pp" (:func:`threshold_claim`)."""
    return _niah_rival(results, "SUR 2% vs Dense tokens 2%", threshold=0.80)


#: The paper's lowest SUR EM at 2 % over its five models (Table 12, Qwen3-8B): P2's "high EM", as a proportion.
P2_EM_FLOOR = 0.896


def _bound(k: int, n: int, *, at_least: float, decide_: bool, unit: str, note: str,
           negate: bool = False) -> Estimate:
    """An "at least" claim about one proportion: ``sur_lab.analysis.decisions.bound_claim`` on its Clopper-Pearson
    bounds, read as the claim's verdict by ``decisions.claim_of_bound`` (``negate=True``: the claim says the
    proportion falls short)."""
    word = bound_claim(k, n, at_least=at_least, decide=decide_)
    est, low, high = proportion_interval(k, n)
    verdict = claim_of_bound(word, negate=negate)
    return Estimate(100 * est, 100 * low, 100 * high, unit, verdict, n=n, note=note)


def p2_sur_em_at_2(results: Path) -> Estimate:
    """P2: SUR's strict EM at 2 % (``02_niah_records``), at least :data:`P2_EM_FLOOR` by its exact lower bound."""
    k, n = _sur_em(results, 2.0)
    return _bound(k, n, at_least=P2_EM_FLOOR, decide_=_decides(results, _NIAH), unit="% EM",
                  note=f"SUR's strict EM at 2 % with its exact 95 % interval; 'high' read as at least "
                       f"{100 * P2_EM_FLOOR:g} % (the paper's lowest model) by the lower bound")


def p3_sur_vs_shift(results: Path) -> Estimate:
    """P3: SUR at 2 % minus Shift."""
    return _niah_rival(results, "SUR 2% vs Shift")


#: P4's second half: no preset's declared family compares budgets above :data:`niah.FAMILY_BUDGETS` (2 and 5 %).
P4_NOT_RUN = ("Dense tokens at 80 % against SUR at 5 %: the default runs budgets of 2 and 5 % only, and notebook 02's "
              "declared families compare allocators at 2 and 5 % (niah.FAMILY_BUDGETS) at every preset, so this half "
              "is decided by no preset yet")


#: P4's "near-perfect" as a proportion: SUR's strict EM at 5 % at least this by its exact lower bound (the paper's
#: 98.96 % on Qwen3-8B; fixed before reading the release). 48 cases all answered give a lower bound of 92.6 %, so the
#: default can show "does not hold" (an upper bound below it) but not "holds": that needs >= 59 cases.
P4_NEAR_PERFECT = 0.95


def _flags(values: pd.Series) -> pd.Series:
    """0/1 ints of a flag column read back from CSV (``True``/``False``, ``1``/``0``, as text or typed)."""
    return values.map(lambda v: str(v).strip().lower() in ("true", "1", "1.0")).astype(int)


def _sur_em(results: Path, budget: float) -> tuple[int, int]:
    """``(k, n)``: SUR's strict EM successes and records at ``budget`` % in ``02_niah_records``.

    Raises:
        NotComputed: when the table holds no SUR record at that budget.
    """
    df = read_table(results, "02_niah_records")
    em = df.loc[(df["method"] == "SUR") & (df["budget_pct"] == float(budget)), "em"]
    if em.empty:
        raise NotComputed(f"02_niah_records has no SUR record at {budget:g} %")
    return int(_flags(em).sum()), len(em)


def p4_sur_near_perfect_at_5(results: Path) -> Estimate:
    """P4, as :func:`all_of` three parts: SUR's strict EM at 5 % is near-perfect (at least :data:`P4_NEAR_PERFECT` by
    its exact bound, ``decisions.bound_claim``), SUR beats Dense tokens at 5 % (``02_sur_vs_allocators``), and Dense
    tokens approaches SUR only at 80 % (:data:`P4_NOT_RUN`: :func:`not_run_part`). The claim can fail on either of
    the first two parts and is at best undecided while the third is not run."""
    k, n = _sur_em(results, 5.0)
    level = _bound(k, n, at_least=P4_NEAR_PERFECT, decide_=_decides(results, _NIAH), unit="% EM",
                   note=f"SUR's strict EM at 5 % with its exact 95 % interval; 'near-perfect' read as at least "
                        f"{100 * P4_NEAR_PERFECT:g} % by the bounds")
    return all_of({"SUR's EM at 5 %": level,
                   "SUR 5% vs Dense tokens 5%": _niah_rival(results, "SUR 5% vs Dense tokens 5%"),
                   "Dense tokens at 80 %": not_run_part(P4_NOT_RUN)})


def p5_sur_vs_random_units(results: Path) -> Estimate:
    """P5: SUR minus random semantic units at 2 %."""
    return _niah_rival(results, "SUR 2% vs Random semantic units 2%")


def p6_sur_vs_window(results: Path) -> Estimate:
    """P6: SUR minus the single max-relevance contiguous window at 2 %."""
    return _niah_rival(results, "SUR 2% vs Max-relevance contiguous 2%")


def p7_sur_vs_bm25(results: Path) -> Estimate:
    """P7: SUR minus same-unit BM25 at 2 %."""
    return _niah_rival(results, "SUR 2% vs BM25 (same units) 2%")


P8_ALLOCATORS = ("ProphetKV-Adapted", "InfoFlow-Motivated", "Cache-Craft-Adapted", "CacheBlend-Adapted")


def p8_sur_vs_derived(results: Path) -> Estimate:
    """P8: SUR minus each of the four derived allocators at 2 % (:func:`all_of`; those the preset runs)."""
    parts, missing = {}, []
    for name in P8_ALLOCATORS:
        try:
            parts[name] = _niah_rival(results, f"SUR 2% vs {name} 2%")
        except NotComputed:
            missing.append(name)
    if not parts:
        raise NotRun(f"notebook 02 compares none of {', '.join(P8_ALLOCATORS)} at this preset (the paper preset runs "
                     "them)")
    return all_of(parts, missing=missing)


def _table14_row(results: Path, family: str, budget: float, length: str = "all") -> dict[str, Any]:
    df = read_table(results, "02_table14")
    row = _row(df, "02_table14", f"Dense tokens at {budget:g} % ({length})", family=family, budget_pct=budget,
               allocator="Dense tokens", length=length)
    # The differences in the table's ``unit`` (pp: decisions.in_units' columns, per endpoint).
    return {"estimate": row["em_delta"], "ci_low": row["em_delta_low"], "ci_high": row["em_delta_high"],
            "p_adj": row["em_p_adj"], "mde": row["em_delta_mde"] if row["em_delta_mde"] <= 100 else None,
            "n": row["n"], "verdict": row["em_verdict"]}


def a93_1_matched_tokens(results: Path) -> Estimate:
    """A9.3-1: region minus token selection at matched tokens on the holdout roster, 2 % (the smaller support),
    every length pooled, on EM (``02_table14``, family ``matched tokens (holdout roster)``)."""
    row = _table14_row(results, MATCHED.name, 2.0)
    return decide(row, expect="greater", unit="pp EM",
                  note="SUR's whole units minus Dense tokens at the same per-case count, 2 %, lengths pooled")


def _ablation(results: Path, methods: Sequence[str], budgets: Sequence[float], expect: str) -> Estimate:
    lead = _niah_lead(results)
    df = read_table(results, "02_ablation")
    df = df[df["metric"] == lead]
    parts, missing = {}, []
    for m in methods:
        for b in budgets:
            label = f"{m} {b:g}% vs SUR {b:g}%"
            try:
                row = _row(df, "02_ablation", label, comparison=label)
            except NotComputed:
                missing.append(label)
                continue
            parts[label] = decide(_scaled(row, 100.0), expect=expect, unit=f"pp {_ENDPOINT_WORDS[lead]}",
                                  note=label)
    return all_of(parts, missing=missing)


def a93_3_design_tie(results: Path) -> Estimate:
    """A9.3-3: the joint arm (mean aggregation with the prefix partial unit, :data:`JOINT_ARM`) against SUR (top-four
    aggregation, forward partial window) at 5 %, expected equivalent (``02_ablation``; the ablation family declares
    no margin, so no tie can be shown: at best undecided). The claim is about that joint configuration, so a single
    factor's row does not decide it.

    Raises:
        NotRun: when the joint arm did not run (the default preset varies one factor at a time); the message lists the
            single-factor rows that did, as context.
    """
    try:
        return _ablation(results, (JOINT_ARM,), (5.0,), "equivalent")
    except NotComputed:
        seen = []
        for factor in ("SUR[aggregation=mean]", "SUR[partial_unit=prefix]"):
            try:
                est = _ablation(results, (factor,), (5.0,), "equivalent")
            except NotComputed:
                continue
            seen.append(f"{factor} 5% vs SUR 5% {format_estimate(vars(est))}")
        seen = f"; as context, each factor alone against SUR at 5 % (no verdict: the claim is about both together, " \
               f"with allowance_base=prompt as the paper's configuration): {'; '.join(seen)}" if seen else ""
        raise NotRun(f"the claim's joint arm ({JOINT_ARM} 5%) did not run (the paper preset runs it){seen}") from None


def a93_4_boundaries(results: Path) -> Estimate:
    """A9.3-4: each boundary control (Fixed blocks, Multiple local windows) minus SUR at each budget, expected below
    SUR (``02_ablation``)."""
    return _ablation(results, BOUNDARY_CONTROLS, (2.0, 5.0), "less")


def b1_sur_idf(results: Path) -> Estimate:
    """B1: SUR-IDF minus SUR at 5 % (``02_beyond_paper_differences``); "holds" reads SUR-IDF beats SUR."""
    return _niah_rival(results, "SUR-IDF 5% vs SUR 5%", table="02_beyond_paper_differences")


# ---------------------------------------------------------------------------------------------------------------------
# Notebook 03 (natural multi-hop QA): ``03_decisions``, on its lead endpoint; latency as decided ratios


def _qa_lead(results: Path) -> str:
    """Notebook 03's lead endpoint (``"EM"`` or ``"agreement"``), as the notebook chose it from Re-prefill's EM
    (``03_table7_quality_latency``, ``em_pct``)."""
    row = _row(read_table(results, "03_table7_quality_latency"), "03_table7_quality_latency", "Re-prefill",
               condition="Re-prefill")
    em = _finite(row.get("em_pct"))
    return lead_endpoint(float("nan") if em is None else em / 100, em="EM", agreement="agreement")


def _qa(results: Path, family: str, comparison: str, *, expect: str, endpoint: str | None = None) -> Estimate:
    df = read_table(results, "03_decisions")
    row = _row(df, "03_decisions", f"{comparison!r} in {family!r}", family=family, comparison=comparison)
    endpoint = endpoint or _qa_lead(results)
    scale, unit = _scale_unit(row, endpoint if endpoint != "agreement" else "agreement with Re-prefill")
    how = "tested alone" if row.get("adjust") == "none" else f"Holm over {row.get('family_size')}"
    note = f"{comparison} ({family}; {how})"
    if row.get("kind") == "ratio":
        note += ": how many times faster SUR is, case-paired on the timed cases, sources clustered"
    return decide(_scaled(row, scale), expect=expect, unit=unit, note=note)


def _qa_reprefill(results: Path, budget: float, expect: str) -> Estimate:
    if _qa_lead(results) != "EM":
        raise NotComputed("notebook 03's lead endpoint is agreement with Re-prefill (Re-prefill's EM is below the EM "
                          "lead threshold on this model), where Re-prefill is not compared with itself")
    return _qa(results, REFERENCE_FAMILY.name, f"SUR {budget:g}% vs Re-prefill", expect=expect)


def p9_sur_matches_reprefill(results: Path) -> Estimate:
    """P9: SUR at 5 % minus Re-prefill, expected equivalent (the family declares no margin: at best undecided)."""
    return _qa_reprefill(results, 5.0, "equivalent")


def p10_sur_vs_shift_qa(results: Path) -> Estimate:
    """P10: notebook 03's primary comparison, SUR at 5 % minus Shift."""
    return _qa(results, PRIMARY.name, "SUR 5% vs Shift", expect="greater")


def p11_sur2_below_reprefill(results: Path) -> Estimate:
    """P11: SUR at 2 % minus Re-prefill, expected below."""
    return _qa_reprefill(results, 2.0, "less")


def _qa_latency(results: Path, reference: str) -> Estimate:
    return _qa(results, LATENCY.name, f"SUR 5% vs {reference}", expect="greater", endpoint="x")


def p12_faster_than_reprefill(results: Path) -> Estimate:
    """P12: Re-prefill's post-edit latency over SUR's at 5 % (ratio; "holds" when the interval lies above 1)."""
    return _qa_latency(results, "Re-prefill")


def p13_faster_than_replay(results: Path) -> Estimate:
    """P13: Replay's post-edit latency over SUR's at 5 % (:class:`NotRun` when notebook 03 ran no Replay: its
    ``default`` references are Shift and Re-prefill, the ``paper`` preset adds Replay)."""
    try:
        return _qa_latency(results, "Replay")
    except NotComputed as err:
        raise NotRun(f"notebook 03 ran no Replay at this preset (the paper preset does): {err}") from None


#: P14's selectors: the attention- and deviation-derived allocators of notebook 03's ``paper`` preset.
P14_SELECTORS = ("CacheBlend-Adapted", "InfoFlow-Motivated", "ProphetKV-Adapted")
#: P14's latency half as a family declared here (notebook 03's latency family compares SUR with the references only):
#: each selector's post-edit latency (Eq. 20) over SUR's at 5 %, case-paired on the timed cases, sources clustered,
#: rebuilt from ``03_natural_qa_records`` with the study's own functions; Holm over the selectors that ran.
P14_LATENCY = Family(
    "post-edit latency against the selectors (P14)", "ratio",
    "each selector's post-edit latency over SUR's at 5 %, case-paired on the timed cases, sources clustered: how many "
    "times faster SUR is", max_size=len(P14_SELECTORS))


def p14_sur_beats_selectors(results: Path) -> Estimate:
    """P14, as :func:`all_of` two halves per selector of :data:`P14_SELECTORS` that ran: SUR at 5 % minus the selector
    on notebook 03's lead endpoint (its declared family of rivals, ``03_decisions``), and the selector's post-edit
    latency over SUR's (:data:`P14_LATENCY`, decided here on the timed records of ``03_natural_qa_records``: the
    placements of a source are one cluster, as notebook 03 clusters them); each must hold, and a selector that did not
    run leaves the claim undecided at best (:func:`not_run_part`).

    Raises:
        NotRun: when none of the selectors ran (notebook 03's ``default``; its ``paper`` preset runs them).
    """
    records = read_table(results, "03_natural_qa_records")
    ran = [s for s in P14_SELECTORS if (records["method"] == s).any()]
    missing = [s for s in P14_SELECTORS if s not in ran]
    if not ran:
        raise NotRun(f"notebook 03 ran none of {', '.join(P14_SELECTORS)} at this preset (the paper preset runs "
                     "them)")
    parts = {f"EM: SUR 5% vs {s} 5%": _qa(results, RIVALS.name, f"SUR 5% vs {s} 5%", expect="greater") for s in ran}
    timed = timed_records(aggregate_trials(results_table(records)))
    timed = timed[timed["latency_ms"].notna()]
    source = timed["dataset"].astype(str) + "/" + timed["source_id"].astype(str)
    timed = timed.assign(_source=source, _case=source + "/" + timed["placement"].astype(str))
    outcomes, clusters = paired_outcomes(timed, [("SUR 5%", f"{s} 5%") for s in ran], "latency_ms",
                                         arm_col="condition", case_col="_case", cluster_col="_source")
    rows = paired_family({k: v for k, v in outcomes.items() if len(v[0])}, family=P14_LATENCY, cluster=clusters,
                         decide=_decides(results, _QA)).to_dict("records")
    for r in rows:
        parts[f"latency: {r['comparison']}"] = decide(
            r, expect="greater", unit="x", note=f"{P14_LATENCY.name}, Holm over {r['family_size']}: how many times "
                                                 "faster SUR is, case-paired on the timed cases, sources clustered")
    for s in missing:  # the claim names all three: one that did not run leaves it undecided at best
        parts[f"{s}"] = not_run_part(f"notebook 03 ran no {s} at this preset")
    return all_of(parts)


# ---------------------------------------------------------------------------------------------------------------------
# Notebook 04 (packed refresh): Table 18's executor comparisons on the release machine's CPU (a CPU analogue of the
# paper's H100 rows), decided from the notebook's repeated timings

#: Table 18's claims as one declared family (P15-P17), on ``04_timings``: each comparison is the ratio of two
#: executors' times (how many times faster the first is), one unit per context length and repeat (the notebook times
#: every executor in each repeat, in a shuffled order), Holm over the four comparisons.
PACKED_FAMILY = Family(
    "packed refresh on the CPU (Table 18 analogue)", "ratio",
    "at R = 16 intervals: packed over interval-wise, one-shot over interval-wise, packed over one-shot; at R = 1: "
    "direct-cache sequential over packed; each the ratio of the two executors' times in the same repeat at each "
    "context length", max_size=4)
#: The comparisons of :data:`PACKED_FAMILY`: (faster executor, slower executor, intervals R); ``"packed"`` stands for
#: the notebook's ``target_executor`` (its default, ``packed-inplace``, the in-place packed executor its targets
#: are about).
PACKED_COMPARISONS = (("packed", "sequential", 16), ("one-shot", "sequential", 16), ("packed", "one-shot", 16),
                      ("direct-sequential", "packed", 1))
#: "Much faster" (P15) read as at least this many times faster, by the whole interval.
P15_MUCH_FASTER = 2.0


def _packed_rows(results: Path) -> dict[tuple[str, str, int], dict[str, Any]]:
    """:data:`PACKED_FAMILY` decided on ``04_timings``: (a, b, R) of :data:`PACKED_COMPARISONS` -> its
    ``paired_family`` row (``estimate``: the geometric-mean ratio b / a, with its percentile bootstrap interval).

    Raises:
        NotComputed: when an executor or R the comparisons need was not timed.
    """
    df = read_table(results, "04_timings")
    packed = str((_manifest_entry(results, _BENCH).get("parameters") or {}).get("target_executor",
                                                                                "packed-inplace"))
    by_r = {r: df[df["num_intervals"] == r].pivot_table(index=["context_len", "rep"], columns="executor", values="ms",
                                                        aggfunc="first") for r in {r for *_, r in PACKED_COMPARISONS}}
    diffs = {}
    for a, b, r in PACKED_COMPARISONS:
        a, b = (packed if a == "packed" else a), (packed if b == "packed" else b)
        at_r = by_r[r]
        lacking = [e for e in (a, b) if e not in at_r.columns]
        if at_r.empty or lacking:
            raise NotComputed(f"04_timings has no {', '.join(lacking) or 'timing'} at R = {r}: this run did not "
                              f"time that cell")
        both = at_r[[a, b]].dropna()
        diffs[(f"{a} (R = {r})", f"{b} (R = {r})")] = (both[a].to_numpy(float), both[b].to_numpy(float))
    rows = paired_family(diffs, family=PACKED_FAMILY, decide=_decides(results, _BENCH)).to_dict("records")
    return dict(zip(PACKED_COMPARISONS, rows))


def _packed_note(results: Path, what: str) -> str:
    return (f"{what}; a CPU analogue of the paper's H100 row: notebook 04's repeated timings on the release machine, "
            f"one unit per context length and repeat, the geometric-mean ratio with its bootstrap interval, Holm over "
            f"the {len(PACKED_COMPARISONS)} comparisons of Table 18's family")


def p15_packed_much_faster(results: Path) -> Estimate:
    """P15: interval-wise execution's time over packed refresh's at R = 16, at least :data:`P15_MUCH_FASTER` times by
    its whole interval (``threshold_claim``)."""
    row = _packed_rows(results)[PACKED_COMPARISONS[0]]
    return threshold_claim(row, P15_MUCH_FASTER, expect="greater", unit="x", scale=1.0,
                           note=_packed_note(results, f"interval-wise over packed at R = 16; 'much faster' read as "
                                                      f"at least {P15_MUCH_FASTER:g}x by the whole interval"))


def p16_one_shot_then_packing(results: Path) -> Estimate:
    """P16: at R = 16, one-shot sparse execution faster than interval-wise, and packed faster than one-shot (both
    must hold)."""
    rows = _packed_rows(results)
    parts = {"one-shot over interval-wise": decide(rows[PACKED_COMPARISONS[1]], expect="greater", unit="x"),
             "packed over one-shot": decide(rows[PACKED_COMPARISONS[2]], expect="greater", unit="x")}
    est = all_of(parts)
    return replace(est, note=_packed_note(results, est.note))


def p17_direct_faster_at_one_interval(results: Path) -> Estimate:
    """P17: at R = 1, packed refresh's time over direct-cache sequential execution's (the claim: above 1)."""
    return decide(_packed_rows(results)[PACKED_COMPARISONS[3]], expect="greater", unit="x",
                  note=_packed_note(results, "packed over direct-cache sequential at R = 1"))


# ---------------------------------------------------------------------------------------------------------------------
# Notebook 08 (evidence location): Table 15's contrasts judged by the study's declared rules, and its findings


def _t15(results: Path, condition: str, hypothesis: str, *, expect: str, margin: float | None = None,
         holm: bool = True) -> Estimate:
    """One contrast of ``08_table15`` (``condition``, ``hypothesis``), judged as ``evidence_location.findings``
    judges it (``sur_lab.analysis.decisions.judge`` on its 95 % source-bootstrap interval, with the Holm p over the
    secondary family, or the raw p of the preregistered primary, and the primary's TOST against ``margin``)."""
    df = read_table(results, "08_table15")
    r = _row(df, "08_table15", f"{condition}, {hypothesis}", condition=condition, hypothesis=hypothesis)
    n = int(_finite(r.get("n_clusters")) or 0)  # sources: the resampled units
    if n == 0:
        raise NotComputed(f"{condition}'s {hypothesis} contrast has no source"
                          + (" (the EM stratum, the sources Re-prefill answers, is empty)" if "EM" in hypothesis
                             else ""))
    p = _finite(r.get("p_adj") if holm else r.get("p"))
    word = judge(r["estimate"], r["ci_low"], r["ci_high"], p_adj=p, n=n, margin=margin,
                 tost=(r.get("tost_low"), r.get("tost_high")) if margin is not None else None,
                 decide=_decides(results, _EVID))
    # The difference in the table's ``unit`` (decisions.in_units' columns: nats for the NLL, pp for EM).
    unit = f"{r['unit']} EM" if r.get("unit") == "pp" else str(r.get("unit") or "")
    how = f"90 % interval against ±{margin:g} {r.get('unit')} (TOST)" if margin is not None else (
        "Holm p over the secondary family" if holm else "tested alone")
    return decide({"estimate": r["delta"], "ci_low": r["delta_low"], "ci_high": r["delta_high"], "n": n,
                   "verdict": word},
                  expect=expect, unit=unit, note=f"{condition}: {hypothesis} contrast over {n} sources; {how}"
                  + ("; the EM stratum (the sources Re-prefill answers) held one source, too few for an interval"
                     if "EM" in hypothesis and n == 1 else ""))


def a10_1_nll_side_null(results: Path) -> Estimate:
    """A10-1: complete replay's NLL side contrast, equivalent to 0 within the study's declared margin
    (``evidence_location.NLL_SIDE_MARGIN``), the preregistered primary tested alone."""
    return _t15(results, COMPLETE_REPLAY, "NLL side", expect="equivalent", margin=NLL_SIDE_MARGIN.value, holm=False)


def a10_2_em_side_positive(results: Path) -> Estimate:
    """A10-2: complete replay's EM side contrast above 0 (Holm over the secondary family)."""
    return _t15(results, COMPLETE_REPLAY, "EM side", expect="greater")


def a10_3_tail_interaction_null(results: Path) -> Estimate:
    """A10-3: complete replay's NLL and EM tail and interaction contrasts, each expected null (no margin is declared
    for them, so none can be shown equivalent: at best undecided; a separation does not hold)."""
    parts, missing = {}, []
    for h in ("NLL tail", "NLL interaction", "EM tail", "EM interaction"):
        try:
            parts[h] = _t15(results, COMPLETE_REPLAY, h, expect="equivalent")
        except NotComputed as err:
            missing.append(str(err))
    return all_of(parts, missing=missing)


def a10_4_fixed_slot_carries(results: Path) -> Estimate:
    """A10-4: the study's decided finding "fixed-slot refresh carries the side effect" (``08_findings``: every
    fidelity endpoint's side contrast separated above 0 and replay minus the fixed slot within the study's
    declared share), read by ``decisions.claim_of_outcome`` of its ``reproduced`` flag. No single
    estimate: the finding is an intersection over the endpoints (its evidence is the note)."""
    df = read_table(results, "08_findings")
    r = _row(df, "08_findings", "the fixed-slot finding", finding="fixed-slot refresh carries the side effect")
    outcome = {"true": True, "false": False}.get(str(r.get("reproduced")).strip().lower())
    verdict = claim_of_outcome(outcome)
    return Estimate(None, None, None, "", verdict, note=f"{r.get('verdict')}: {r.get('evidence')}")


def a10_5_fixed_slot_nll_null(results: Path) -> Estimate:
    """A10-5: the fixed-slot refresh's NLL side contrast, equivalent to 0 within ``NLL_SIDE_MARGIN``."""
    return _t15(results, FIXED_SLOT_LABEL, "NLL side", expect="equivalent", margin=NLL_SIDE_MARGIN.value)


# ---------------------------------------------------------------------------------------------------------------------
# Notebook 09 (stale facts): ``09_paired_differences``


def _stale(results: Path, family: str, comparison: str, metric: str) -> Estimate:
    df = read_table(results, "09_paired_differences")
    row = _row(df, "09_paired_differences", f"{comparison!r} ({metric})", family=family, comparison=comparison,
               metric=metric)
    what = "EM" if metric == "em" else "stale-answer rate (lower is better)"
    return decide(_scaled(row, 100.0), expect="greater", unit="pp EM" if metric == "em" else "pp stale",
                  note=f"{comparison} on {what}; {family}, Holm over {row.get('family_size')}; "
                       f"{claim_reading(row.get('a'), row.get('b'))}")


def _against_sur(arm: str) -> Callable[[Path], Estimate]:
    def compute(results: Path) -> Estimate:
        return _stale(results, EM_FAMILY.name, f"{arm} vs SUR 5%", "em")

    compute.__doc__ = f"{arm} minus SUR at 5 % on EM (``09_paired_differences``); {claim_reading(arm, 'SUR')}."
    return compute


b2_edit_local = _against_sur("Edit-local window 5%")
b3_edit_local_sur = _against_sur("Edit-local + SUR 5%")
b4_erratum = _against_sur("Erratum")


def b5_stale_rate(results: Path) -> Estimate:
    """B5: SUR at 5 % minus Shift on the stale-answer rate (lower is better)."""
    return _stale(results, STALE_FAMILY.name, "SUR 5% vs Shift", "stale")


# ---------------------------------------------------------------------------------------------------------------------
# Notebook 10 (agent traces): its declared comparisons, decided from the saved per-turn runs


def _traces_decided(results: Path) -> tuple[Any, str]:
    """``(table, sync)``: ``10_agent_traces_decided``, notebook 10's declared comparisons as the notebook decided them
    (:func:`sur_lab.studies.agent_traces.primary_table`: the primary first, then the agreement family, per kind and
    per region), and the lead sync path, the primary's ``a`` (``sync 5%`` at the default)."""
    table = read_table(results, "10_agent_traces_decided")
    syncs = [a for a in table["a"] if str(a).startswith("sync ") and a != SHIFT]
    if not syncs:
        raise NotComputed("10_agent_traces_decided has no budgeted sync path")
    return table, str(syncs[0])


def _traces_row(table, family: str, comparison: str, *, expect: str, endpoint: str, note: str) -> Estimate:
    row = _row(table, "10_agent_traces_decided", repr(comparison), family=family, comparison=comparison)
    scale, unit = _scale_unit(row, endpoint)
    return decide(_scaled(row, scale), expect=expect, unit=unit, note=f"{comparison}: {note}")


def b6_sync_answers_alike(results: Path) -> Estimate:
    """B6: the lead sync path minus prefix reuse (which recomputes every row after the first change: re-prefill's
    answers up to rounding) on agreement with re-prefill over the reaching questions, equivalent within the study's
    declared margin (``agent_traces.AGREEMENT_MARGIN``)."""
    table, sync = _traces_decided(results)
    return _traces_row(table, AGREEMENT_FAMILY.name, f"{sync} (reaching questions) vs {PREFIX} (reaching questions)",
                       expect="equivalent", endpoint="agreement with re-prefill",
                       note="traces clustered; equivalent only when the 90 % interval lies within the declared margin")


def b7_sync_faster_early(results: Path) -> Estimate:
    """B7: prefix reuse's TTFT over the lead sync path's on the turns whose first change lands in the first half of
    the prompt (``REGION_FAMILY``, Holm over the regions); "holds" when the speed-up's interval lies above 1. The
    tokens recomputed are not decided (the notebook's region table shows them)."""
    table, sync = _traces_decided(results)
    return _traces_row(table, REGION_FAMILY.name, f"{sync} (first half) vs {PREFIX} (first half)", expect="greater",
                       endpoint="x", note="how many times faster sync is, traces clustered; tokens not decided")


# ---------------------------------------------------------------------------------------------------------------------
# Notebook 07 (agent session): ``07_agent_session_decided``, its declared comparisons as the notebook decided them

#: What B8 claims that notebook 07 declares no comparison for (the row's note names it).
B8_NOT_DECIDED = ("'a fraction of its recomputation' (07_agent_session_summary's cost_ratio, a mean without an "
                  "interval)")


def _session_part(df, table: str, family: str, what: str, *, expect: str, how: str) -> Estimate:
    """One declared comparison of ``07_agent_session_decided`` (the one row of ``family``), through :func:`decide`."""
    row = _row(df, table, what, family=family)
    scale, unit = _scale_unit(row, "agreement with Re-prefill")
    return decide(_scaled(row, scale), expect=expect, unit=unit, note=f"{row.get('comparison')}: {how}")


def b8_debt_narrows(results: Path) -> Estimate:
    """B8, the conjunction (:func:`all_of`) of notebook 07's two declared comparisons on agreement with Re-prefill
    (``07_agent_session_decided``, an episode's questions clustered): "close to re-prefill", per-edit SUR at the lead
    budget minus Re-prefill, equivalent within the study's declared margin (``agent_session.REPREFILL_FAMILY``,
    ``agent_session.AGREEMENT_MARGIN``); and "the debt arm narrows the rest", the staleness-debt arm minus per-edit
    SUR at its budget, notebook 07's primary (``agent_session.PRIMARY``, tested alone), "holds" when the debt arm
    keeps more of Re-prefill's answers. The cost part has no declared comparison (:data:`B8_NOT_DECIDED`): the note
    names it, undecided.

    Raises:
        NotComputed: when either comparison did not run (no debt arm at one of the per-edit budgets, no per-edit SUR
            arm, or a table written before the comparison was declared): the claim needs both parts.
    """
    table = "07_agent_session_decided"
    df = read_table(results, table)
    parts = {
        "close to re-prefill": _session_part(
            df, table, SESSION_REPREFILL.name, "per-edit SUR against Re-prefill", expect="equivalent",
            how="equivalent only when the 90 % interval lies within the declared margin, episodes clustered"),
        "the debt arm narrows the rest": _session_part(
            df, table, SESSION_PRIMARY.name, "the debt arm against SUR at its budget (its primary comparison)",
            expect="greater", how="notebook 07's primary, tested alone, episodes clustered"),
    }
    est = all_of(parts)
    return replace(est, note=f"{est.note}. Not decided: {B8_NOT_DECIDED}")


# ---------------------------------------------------------------------------------------------------------------------
# Notebook 06 (SAFE-KV, non-prefix reuse): preservation bounds and the design ledger's decided words

_NOPREFIX = "06_noprefix_reuse"


def _required_preservation(results: Path) -> float:
    """The preservation a reuse path must be shown to reach: the notebook's ``required_preservation`` parameter as
    the manifest records it, else its default 0.95."""
    params = _manifest_entry(results, _NOPREFIX).get("parameters") or {}
    return float(params.get("required_preservation", 0.95))


def _workload_docs(workload: str) -> int | None:
    """The documents of a ``06_noprefix_endpoints`` workload (``"HotpotQA·16"`` -> 16; ``"Noise64"`` -> 64), None
    when the name carries no count."""
    digits = "".join(ch for ch in str(workload).rsplit("·", 1)[-1] if ch.isdigit())
    return int(digits) if digits else None


def _preservation(results: Path, label: str, *, fails: bool, docs: Callable[[int], bool] | None = None,
                  where: str = "") -> Estimate:
    """``label``'s answer preservation under actual forwarding, pooled over the workloads of
    ``06_noprefix_endpoints`` (those whose document count satisfies ``docs``, described by ``where``, when given),
    against the required preservation by its Clopper-Pearson bounds (``decisions.bound_claim``, as the design ledger
    reads it). ``fails=True``: the claim is that the path does *not* reach it ("loses many answers"), so the bound's
    "fails" is the claim's "holds" and its "holds" the claim's "does not hold"."""
    df = read_table(results, "06_noprefix_endpoints")
    sel = df[(df["label"] == label) & (df["protocol"] == "forward")]
    if docs is not None:
        sel = sel[[(n := _workload_docs(w)) is not None and docs(n) for w in sel["workload"]]]
    if sel.empty:
        raise NotComputed(f"06_noprefix_endpoints has no forwarded {label!r} row" + (f" {where}" if where else ""))
    n = int(sel["n"].sum())
    k = int(round(float((sel["preservation"] * sel["n"]).sum())))
    req = _required_preservation(results)
    note = (f"{label}, actual forwarding, {len(sel)} workload(s) pooled{f' {where}' if where else ''}; exact 95 % "
            f"interval against the required {100 * req:g} %")
    if fails:
        note += f" (the claim {VERDICTS[0]} when the upper bound is below {100 * req:g} %)"
    return _bound(k, n, at_least=req, decide_=_decides(results, _NOPREFIX), unit="% preserved", note=note,
                  negate=fails)


def s1_composition_loses(results: Path) -> Estimate:
    """S1: prefix composition without repair falls short of the required preservation (its upper bound below it)."""
    return _preservation(results, "Prefix composition", fails=True)


def s2_suffix_restores(results: Path) -> Estimate:
    """S2: suffix repair from the risk-selected start (K2) reaches the required preservation (lower bound)."""
    return _preservation(results, "Suffix K2 · risk", fails=False)


def s3_document_only_short(results: Path) -> Estimate:
    """S3: patching the gold evidence documents alone falls short of the required preservation."""
    return _preservation(results, "Doc K2 · oracle", fails=True)


def s7_exact_then_degrades(results: Path) -> Estimate:
    """S7, its three parts, each by :func:`_preservation`'s bounds on ``06_noprefix_endpoints``: composition without
    repair reaches the required preservation on the workloads of at most four documents, falls short of it at sixteen,
    and suffix repair from the risk-selected start (K2) reaches it at sixteen; all three must hold."""
    return all_of({
        "composition, <= 4 documents": _preservation(results, "Prefix composition", fails=False,
                                                      docs=lambda n: n <= 4, where="of at most 4 documents"),
        "composition, 16 documents": _preservation(results, "Prefix composition", fails=True,
                                                   docs=lambda n: n == 16, where="of 16 documents"),
        "suffix K2 · risk, 16 documents": _preservation(results, "Suffix K2 · risk", fails=False,
                                                        docs=lambda n: n == 16, where="of 16 documents")})


def _ledger(results: Path, experiment: str) -> Estimate:
    """A paired row of ``06_noprefix_design_ledger`` whose claim is that the *first* path falls below the second
    (a window, linked intervals, an adaptive suffix against suffix closure): the ledger's "worked" means the first
    beats or is equivalent to the second (the claim does not hold), "did not" that it loses (the claim holds); the
    ledger's words are ``decisions.paired_family`` verdicts (family ``LEDGER``, Holm). Its key result, a sentence,
    is the note; the ledger saves no number."""
    df = read_table(results, "06_noprefix_design_ledger")
    match = df[df["experiment"].astype(str).str.startswith(experiment)]
    if match.empty:
        raise NotComputed(f"06_noprefix_design_ledger has no {experiment!r} row")
    r = match.iloc[0]
    if r["verdict"] == "not run":
        raise NotComputed(f"the design ledger did not run {experiment!r}: {r['key_result']}")
    verdict = claim_of_outcome({"did not": True, "worked": False}.get(str(r["verdict"])))
    return Estimate(None, None, None, "", verdict, note=f"ledger: {r['verdict']} ({r['criterion']}): {r['key_result']}")


def s4_suffix_beats_window(results: Path) -> Estimate:
    """S4: the downstream window w4 below suffix K1 (risk, same start)."""
    return _ledger(results, "Downstream window w4 vs suffix K1")


def s5_linked_below_suffix(results: Path) -> Estimate:
    """S5: linked intervals below suffix closure (oracle)."""
    return _ledger(results, "Linked intervals vs suffix")


def s6_adaptive_drifts(results: Path) -> Estimate:
    """S6: the adaptive suffix below suffix K2 in preservation (more residual drift; its lower cost is not decided)."""
    return _ledger(results, "Adaptive suffix")


#: S8's two halves as one declared family, decided here (notebook 06 saves the position sweep's requests,
#: ``06_noprefix_sweep_runs``, but no decided table of them): requests paired by source, answer preservation under
#: actual forwarding, Holm over the two, the design ledger's margin (:data:`LEDGER_MARGIN`) for "no better than" and
#: "removes the position dependence".
POSITION_FAMILY = Family(
    "evidence position (S8)", "binary",
    "with the evidence document first: patching it alone (Doc K2, oracle) minus prefix composition; suffix repair "
    "(Suffix K1, oracle) with the evidence first minus with it last; preservation, requests paired by source",
    margin=LEDGER_MARGIN, max_size=2)
#: The position sweep's labels of the three paths S8 compares.
S8_DOC, S8_COMPOSITION, S8_SUFFIX = "Doc K2 · oracle", "Prefix composition", "Suffix K1 · oracle"


def _no_better(verdict: str) -> str:
    """The expectation (:data:`EXPECTATIONS`) that reads a claim "A is *no better than* B" from the decided A - B
    comparison's verdict: "equivalent" when it is equivalent within the family's margin, else "less". So the claim
    holds when A loses to B or is equivalent, does not hold when A beats B, and is undecided otherwise (a difference
    that is merely not separated is no evidence of "no better")."""
    return "equivalent" if verdict == EQUIVALENT else "less"


def s8_position_dependence(results: Path) -> Estimate:
    """S8, as :func:`all_of` its two halves, :data:`POSITION_FAMILY` decided on ``06_noprefix_sweep_runs`` (the
    position sweep's requests; actual forwarding):

    - with the evidence document in the first slot, patching it alone is *no better than* composition
      (:func:`_no_better`: it loses, or is equivalent within the margin);
    - suffix repair "removes most of the position dependence", read as: suffix repair's preservation with the evidence
      first and with it last is equivalent within the margin (the slots are the sweep's first and last).

    Raises:
        NotComputed: when the table lacks a path or a slot (a sweep of one slot has no position to compare).
    """
    table = "06_noprefix_sweep_runs"
    df = read_table(results, table)
    df = df[df["protocol"] == "forward"]
    keys = ["dataset", "source_id"]
    missing = [c for c in ("slot", "label", "preserved", *keys) if c not in df.columns]
    if missing:
        raise ValueError(f"{table} lacks the columns {missing}")
    if df["slot"].nunique() < 2:
        raise NotComputed(f"{table} has fewer than two evidence slots")
    first, last = int(df["slot"].min()), int(df["slot"].max())

    # one arm per (path, slot); a source's request is the paired unit (paired_outcomes, as the studies pair)
    arms = df.assign(_arm=df["label"] + " @ " + df["slot"].astype(int).astype(str),
                     _unit=df["dataset"].astype(str) + "/" + df["source_id"].astype(str),
                     _kept=_flags(df["preserved"]))
    compared = {(S8_DOC, S8_COMPOSITION): (f"{S8_DOC} @ {first}", f"{S8_COMPOSITION} @ {first}"),
                (f"{S8_SUFFIX} first", f"{S8_SUFFIX} last"): (f"{S8_SUFFIX} @ {first}", f"{S8_SUFFIX} @ {last}")}
    outcomes, _ = paired_outcomes(arms, list(compared.values()), "_kept", arm_col="_arm", case_col="_unit")
    lacking = [" and ".join(pair) for pair in compared.values() if pair not in outcomes]
    if lacking:
        raise NotComputed(f"{table} has no forwarded requests of {lacking[0]}")
    diffs = {name: outcomes[pair] for name, pair in compared.items()}
    rows = paired_family(diffs, family=POSITION_FAMILY, decide=_decides(results, _NOPREFIX)).to_dict("records")
    doc, suffix = rows
    margin = f"the margin ±{100 * LEDGER_MARGIN.value:g} points ({LEDGER_MARGIN.source})"
    how = f"{POSITION_FAMILY.name}, Holm over 2; slots {first} (first) and {last} (last); requests paired by source"
    parts = {
        "patching the evidence document alone, evidence first: no better than composition": decide(
            _scaled(doc, 100.0), expect=_no_better(doc["verdict"]), unit="pp preservation"),
        "suffix repair: first and last slot alike": decide(
            _scaled(suffix, 100.0), expect="equivalent", unit="pp preservation"),
    }
    est = all_of(parts)
    return replace(est, note=f"{est.note}. Read as: {S8_DOC} minus {S8_COMPOSITION} with the evidence in slot {first}, "
                             f"holding when it loses or is equivalent within {margin}; {S8_SUFFIX} with the evidence "
                             f"in slot {first} minus slot {last}, equivalent only when its 90 % interval lies within "
                             f"the margin; {how}")


#: The smallest composition S10 is about: SAFE-KV's Table 20 measures the donor-copy gap on Noise64.
S10_MIN_DOCS = 64


def s10_donor_overstates(results: Path) -> Estimate:
    """S10: donor-copy minus actual forwarding of suffix K1 (risk) in answer preservation, above 0: the primary row of
    ``06_noprefix_decided`` (:func:`sur_lab.studies.noprefix.decided_table`, family ``DONOR_PROXY``: paired over
    requests, sources clustered), judged as a claim that donor-copy is higher (``expect="greater"``): the mapping is
    :func:`~sur_lab.analysis.decisions.claim_verdict`'s.

    Raises:
        NotRun: when the run has no workload of :data:`S10_MIN_DOCS` documents or more (``06_noprefix_endpoints``): the
            claim is about a long composition, and the primary pooled over short ones is only context, in the note.
    """
    df = read_table(results, "06_noprefix_decided")
    row = _row(df, "06_noprefix_decided", "donor-copy vs actual forwarding", family=DONOR_PROXY.name)
    discordant = _finite(row.get("n_discordant"))
    pairs = "" if discordant is None else f"; {int(discordant)} of {int(row['n'])} request pairs discordant"
    docs = sorted({d for w in read_table(results, "06_noprefix_endpoints")["workload"]
                   if (d := _workload_docs(w)) is not None})
    note = (f"donor-copy minus actual forwarding (suffix K1, risk); requests paired, sources clustered{pairs}; pooled "
            f"over the workloads of {', '.join(map(str, docs))} documents")
    est = decide(_scaled(row, 100.0), expect="greater", unit="pp preservation", note=note)
    if not docs or max(docs) < S10_MIN_DOCS:
        raise NotRun(f"the claim is about a long composition (Noise64, SAFE-KV's Table 20), and this run's largest "
                     f"workload has {max(docs) if docs else 0} documents (the paper preset runs Noise64); as context, "
                     f"notebook 06's primary: {format_estimate(vars(est))} ({note})")
    return est


def s9_full_prefill_everywhere(results: Path) -> Estimate:
    """S9: the operating rule (``06_noprefix_operating_rule``) serves every workload by full prefill. A workload
    served by a repair path (shown faster and shown to preserve enough) refutes it; the rule falls back to full prefill
    also when a path is merely not shown, so an all-full-prefill table is undecided, not a confirmation."""
    df = read_table(results, "06_noprefix_operating_rule")
    if df.empty:
        raise NotComputed("06_noprefix_operating_rule has no workload")
    repaired = df[df["serve"] == "repair"]
    reasons = "; ".join(f"{r.workload}: {r.serve} ({r.reason})" for r in df.itertuples())
    if not _decides(results, _NOPREFIX):
        return Estimate(None, None, None, "", claim_of_outcome(None), n=len(df),
                        note=f"not decided at this size. {reasons}")
    verdict = claim_of_outcome(False if len(repaired) else None)
    return Estimate(None, None, None, "", verdict, n=len(df), note=reasons)


# ---------------------------------------------------------------------------------------------------------------------
# Notebook 05 (execution paths, appendix 11): the per-cell table rebuilt from the saved decodes

#: The precision of the paper's Table 17 (appendix 11: Replay and Re-prefill "can disagree numerically under BF16"):
#: A11's claims are decided on the run's bfloat16 cells. The default preset also runs float32; A11-1's note counts
#: those cells, which decide nothing.
A11_DTYPE = "bfloat16"
#: "Differ in every cell" as a proportion of cells: at least this share by its exact (Clopper-Pearson) lower bound. A
#: sample cannot show "every", only a high share: 0.75 is the largest multiple of 5 % that the default preset's 16
#: cells per dtype can show (all 16 differing: lower bound 79.4 %); the paper's 160 cells per model, all differing,
#: show 97.7 %. It does not hold when the upper bound falls below. A cell differs when none of its nine
#: Replay-Re-prefill pairs has byte-equal float32 first logits (``cross_exact_logits == 0``: Table 17's 100 %).
A11_EVERY_CELL = 0.75
#: "Far smaller" as a gap of over half the pairs: per cell, exact-logit minus argmax (or sequence) cross-path
#: disagreement (``1 - A_cross``), its mean's interval above 0.5 (50 pp; :func:`threshold_claim`). The paper's gaps
#: are 89-99 pp (exact logits 100 %; argmax 0.62-8.75 %, sequence 2.29-10.69 %).
A11_FAR_SMALLER = 0.5
#: A11-2's comparisons, declared here (notebook 05 saves the decodes, not a decided table): cells are the paired units
#: (not clustered by source: the default preset has four sources, too few clusters for any test to separate).
A11_GAP = Family("exact-logit disagreement against argmax and sequence disagreement (A11-2)", "continuous",
                 "per cell, cross-path exact-logit disagreement minus argmax and minus sequence disagreement, each "
                 "1 - A_cross over the nine Replay-Re-prefill pairs", max_size=2)
#: A11-3's comparison: per cell, the median cross-path |dNLL| minus the median within-Re-prefill |dNLL| (nats).
A11_NLL = Family("cross-path against within-Re-prefill |dNLL| (A11-3)", "continuous",
                 "per cell, the median of the nine cross-path |dNLL| minus the median of the three within-Re-prefill "
                 "|dNLL| (execution_paths.nll_differences)", max_size=1)


def _token_ids(value: Any) -> list:
    """Generated ids as notebook 05 saves them (``str`` of the list, ``"[1, 2]"``); a list passes unchanged.

    Raises:
        ValueError: naming ``token_ids`` when the text is not a JSON list.
    """
    if isinstance(value, (list, tuple)):
        return list(value)
    try:
        ids = json.loads(str(value))
    except ValueError:
        ids = None
    if not isinstance(ids, list):
        raise ValueError(f"05_execution_paths: token_ids {value!r} is not a list of token ids")
    return ids


def _paths_cells(results: Path) -> tuple[pd.DataFrame, bool]:
    """``(cells, decide)``: :func:`sur_lab.studies.execution_paths.cell_table` of notebook 05's saved decodes
    (``05_execution_paths``: one row per model, dtype, device, case, condition and repeat), one row per cell and
    dtype; and whether the run decides (neither the release's preset nor the notebook's ``paths_preset`` is a
    plumbing check, ``decisions.decides``).

    Raises:
        NotComputed: when the table holds no decode.
        FileNotFoundError, ValueError: as :func:`read_table`; as ``cell_table`` (a missing column, a cell short of
            repeats); naming ``token_ids`` when a saved sequence is not a list.
    """
    records = read_table(results, "05_execution_paths", dtype={"logits_sha256": str, "case_id": str})
    if records.empty:
        raise NotComputed("05_execution_paths has no decode")
    if "token_ids" in records.columns:
        records["token_ids"] = records["token_ids"].map(_token_ids)
    cells = execution_paths.cell_table(records)
    params = _manifest_entry(results, _NUM).get("parameters") or {}
    return cells, _decides(results, _NUM) and decides(params.get("paths_preset") or None)


def _per_group(cells: pd.DataFrame, decide_: bool, claim: Callable[[pd.DataFrame, bool, str], Estimate]) -> Estimate:
    """``claim(group, decide, label)`` on the :data:`A11_DTYPE` cells of each (model, device) of the run; with several
    (a run over models or devices) each must hold (:func:`all_of`).

    Raises:
        NotComputed: when the run has no :data:`A11_DTYPE` cell.
    """
    scoped = cells[cells["dtype"] == A11_DTYPE]
    if scoped.empty:
        ran = ", ".join(sorted(map(str, cells["dtype"].unique())))
        raise NotComputed(f"05_execution_paths has no {A11_DTYPE} cell (the paper's precision; this run: {ran})")
    parts = {f"{model}, {A11_DTYPE} on {device}": claim(g, decide_, f"{model}, {A11_DTYPE} on {device}")
             for (model, device), g in scoped.groupby(["model", "device"], sort=True)}
    return next(iter(parts.values())) if len(parts) == 1 else all_of(parts)


def _differ(g: pd.DataFrame) -> tuple[int, int]:
    """``(k, n)``: cells of ``g`` whose nine Replay-Re-prefill first-logit pairs all differ in their bytes, of all."""
    return int((g["cross_exact_logits"] == 0).sum()), len(g)


def _every_cell(g: pd.DataFrame, decide_: bool, label: str) -> Estimate:
    k, n = _differ(g)
    return _bound(k, n, at_least=A11_EVERY_CELL, decide_=decide_, unit="% of cells",
                  note=f"{label}: {k} of {n} cells with no byte-equal Replay-Re-prefill first-logit pair (of nine), "
                       f"exact 95 % interval; 'every cell' read as at least {100 * A11_EVERY_CELL:g} % by the lower "
                       f"bound")


def a11_1_exact_logits_differ(results: Path) -> Estimate:
    """A11-1: the share of bfloat16 cells whose cross-path exact first-logit vectors differ (all nine pairs), at least
    :data:`A11_EVERY_CELL` by its Clopper-Pearson lower bound (``decisions.bound_claim``), rebuilt per cell from
    ``05_execution_paths``; the note counts the other dtypes' cells (not decided)."""
    cells, decide_ = _paths_cells(results)
    est = _per_group(cells, decide_, _every_cell)
    others = [f"{dtype}: {'{} of {}'.format(*_differ(g))} cells differ (not decided)"
              for dtype, g in cells[cells["dtype"] != A11_DTYPE].groupby("dtype", sort=True)]
    return replace(est, note="; ".join([est.note, *others]))


def _far_smaller(g: pd.DataFrame, decide_: bool, label: str) -> Estimate:
    exact = 1.0 - g["cross_exact_logits"].to_numpy(dtype=float)
    family = {("exact logits", out): (exact, 1.0 - g[f"cross_{out}"].to_numpy(dtype=float))
              for out in ("argmax", "sequence")}
    rows = paired_family(family, family=A11_GAP, decide=decide_).to_dict("records")
    return all_of({f"{label}, {r['b']}": threshold_claim(
        r, A11_FAR_SMALLER, expect="greater", unit="pp cross-path disagreement",
        note=f"{label}: exact-logit minus {r['b']} cross-path disagreement over {r['n']} cells (paired), Holm over "
             f"{r['family_size']}; 'far smaller' needs the interval above {100 * A11_FAR_SMALLER:g} pp") for r in rows})


def a11_2_argmax_far_below_logits(results: Path) -> Estimate:
    """A11-2: per bfloat16 cell, exact-logit minus argmax and minus sequence cross-path disagreement (:data:`A11_GAP`,
    bootstrap interval and sign-flip test over cells), each above :data:`A11_FAR_SMALLER` (:func:`threshold_claim`);
    both must hold (:func:`all_of`)."""
    cells, decide_ = _paths_cells(results)
    return _per_group(cells, decide_, _far_smaller)


def _nll_excess(g: pd.DataFrame, decide_: bool, label: str) -> Estimate:
    pair = ("cross-path |dNLL|", "within-Re-prefill |dNLL|")
    row = paired_family({pair: (g["nll_cross"].to_numpy(dtype=float), g["nll_within"].to_numpy(dtype=float))},
                        family=A11_NLL, decide=decide_).iloc[0].to_dict()
    return decide(row, expect="greater", unit="nats",
                  note=f"{label}: median cross-path minus median within-Re-prefill |dNLL| over {len(g)} cells "
                       f"(paired; bootstrap interval, sign-flip test)")


def a11_3_nll_cross_exceeds_within(results: Path) -> Estimate:
    """A11-3: per bfloat16 cell, the cross-path minus the within-Re-prefill median |dNLL| (:data:`A11_NLL`), above 0
    (``decisions.paired_family``)."""
    cells, decide_ = _paths_cells(results)
    return _per_group(cells, decide_, _nll_excess)


def _p(id, section, text, paper, notebook, table, compute=None):
    return Claim(id, "paper", section, text, paper, notebook, table, compute)


def _s(id, section, text, paper, table, compute=None):
    return Claim(id, "SAFE-KV", section, text, paper, "06_noprefix_reuse", table, compute)


def _b(id, section, text, paper, notebook, table, compute=None):
    return Claim(id, "beyond the papers", section, text, paper, notebook, table, compute)


_NIAH, _QA, _BENCH, _NUM, _EVID = ("02_allocation_geometry", "03_natural_qa_latency", "04_packed_refresh_benchmark",
                                   "05_kernel_numerical_validation", "08_evidence_location")

#: Every row of the claims table, in order. Appending a row here is all a new claim needs; its ``compute`` function
#: (listed in ``_COMPUTED`` below, by id) reads ``results/`` and returns :func:`decide`'s :class:`Estimate`.
CLAIMS: tuple[Claim, ...] = (
    # ---- the paper: main text (sections 1, 4, 5) and the allocation controls of appendix 9.1-9.2
    _p("P1", "§1, §5, Table 12",
       "With identical token scores and budgets, SUR's region allocation beats individual token selection (Dense "
       "tokens) by over 80 pp EM at a 2 % budget.",
       "Qwen3-8B 89.6 vs 7.3 %; Llama-3.3-70B 90.6 vs 7.3 % (96 cases each)", _NIAH, "02_table12"),
    _p("P2", "§1, §4.2, Figure 3, Tables 2-6",
       "SUR reaches high EM with only 2 % of the suffix recomputed on controlled deletions (Erasing-NIAH).",
       "89.6-100 % EM at 2 % across five models", _NIAH, "02_budget_table_em"),
    _p("P3", "§4.2, Table 6",
       "Even where Shift starts high, SUR at 2 % recovers substantially over Shift: scale alone does not remove the "
       "need for repair.",
       "Qwen3-235B-A22B: Shift 68.75 %, SUR 2 % 97.92 %", _NIAH, "02_budget_table_em"),
    _p("P4", "§5, Table 2",
       "SUR is near-perfect at 5 %, while same-score token selection approaches that level only at 80 %.",
       "Qwen3-8B: SUR 98.96 % at 5 %; Dense tokens 14.58 % at 5 %, 97.92 % at 80 %", _NIAH, "02_budget_table_em"),
    _p("P5", "§5, §9.1, Table 12",
       "Grouping alone is insufficient: random semantic units (SUR's partition without query ranking) recover far "
       "less than SUR.",
       "Random units 2.1 % vs SUR 89.6 % at 2 % (Qwen3-8B); SUR ahead on all five systems", _NIAH, "02_table12"),
    _p("P6", "§9.1, Table 12",
       "SUR beats the single max-relevance contiguous window at 2 %.",
       "89.6 vs 75.0 % (Qwen3-8B), 90.6 vs 65.6 % (Llama-3.3-70B); ahead on all five systems", _NIAH, "02_table12"),
    _p("P7", "§9.2, Table 12",
       "SUR beats same-unit BM25 at 2 % (on four of five models).",
       "89.6 vs 82.3 % (Qwen3-8B); Qwen3-235B favours BM25, 98.96 vs 97.92 %", _NIAH, "02_table12"),
    _p("P8", "§9.2, Table 13",
       "At 2 %, SUR beats the ProphetKV-, InfoFlow-, Cache-Craft- and CacheBlend-derived allocators (on four of five "
       "models).",
       "Qwen3-8B: SUR 89.6 %, ProphetKV 77.1, InfoFlow 82.3, Cache-Craft 77.1, CacheBlend 0.0 %; Llama favours "
       "InfoFlow (92.7 %)", _NIAH, "02_sur_vs_allocators"),
    _p("P9", "§1, §4.3, Table 9",
       "On natural multi-hop QA, SUR at 5 % is within 0.1 pp of Re-prefill's EM (the paired interval spans zero).",
       "+0.08 pp [-0.53, +0.63] (Qwen3-30B-A3B); -0.08 pp [-0.48, +0.40] (Llama-3.3-70B); 1,200 cases", _QA,
       "03_table9_paired_differences"),
    _p("P10", "§4.3, Table 9",
       "At 5 %, SUR improves on Shift, with positive paired intervals.",
       "+1.75 pp [1.12, 2.24] (Qwen3-30B-A3B); +2.25 pp [1.56, 3.21] (Llama-3.3-70B)", _QA,
       "03_table9_paired_differences"),
    _p("P11", "§4.3, Table 9",
       "The 2 % budget trades quality for speed: SUR at 2 % falls below Re-prefill.",
       "-0.75 pp [-1.14, -0.02] (Qwen3-30B-A3B); -0.33 [-1.15, +0.88] (Llama-3.3-70B)", _QA,
       "03_table9_paired_differences"),
    _p("P12", "§4.3, Tables 7-8, Figure 4",
       "At 5 %, SUR's post-edit latency (selection, repair, answer) is lower than Re-prefill's.",
       "1.16-1.43x faster (2.039 vs 2.360 s; 0.535 vs 0.766 s)", _QA, "03_table7_quality_latency"),
    _p("P13", "§4.3, Tables 7-8",
       "At 5 %, SUR's post-edit latency is lower than full-suffix Replay's.",
       "2.039 vs 2.164 s (Qwen3-30B-A3B); 0.535 vs 0.635 s (Llama-3.3-70B)", _QA, "03_table7_quality_latency"),
    _p("P14", "§4.3, Tables 7-8",
       "At 5 %, SUR has both higher EM and lower latency than the attention- and deviation-derived selectors "
       "(CacheBlend-, InfoFlow-, ProphetKV-Adapted).",
       "Qwen3-30B: SUR 43.42 % at 2.04 s vs 41.17-42.58 % at 6.31-6.85 s", _QA, "03_table7_quality_latency"),
    _p("P15", "§1, §4.4, Table 18",
       "Packed refresh runs a fragmented support (R = 16 intervals) much faster than interval-wise execution.",
       "up to 16.1x (Qwen3-8B, H100, B = 64; this suite measures a CPU analogue)", _BENCH, "04_table18"),
    _p("P16", "§4.4, Table 18",
       "Most of that gain comes from sharing one traversal: one-shot sparse execution captures much of it, and "
       "packing adds a further speed-up.",
       "packed over one-shot 1.21x at 8K, R = 16 (H100; this suite measures a CPU analogue)", _BENCH,
       "04_table18"),
    _p("P17", "§4.4, Table 18",
       "With a single interval, direct-cache sequential execution is slightly faster than packing.",
       "8K, R = 1: 32.571 vs 34.860 ms (H100; this suite measures a CPU analogue)", _BENCH, "04_table18"),
    # ---- appendix 9.3: matched tokens and design variants
    _p("A9.3-1", "App. 9.3, Table 14",
       "Under a matched-token protocol on a frozen holdout, region-level selection beats token-level selection, "
       "mostly at the smaller support.",
       "+9.85 pp at 144.6 tokens, +1.84 pp at 359.2 tokens (Qwen3-8B, 599 cases)", _NIAH, "02_table14"),
    _p("A9.3-2", "App. 9.3",
       "The matched-token benefit concentrates in short contexts (1K-2K); both selectors approach saturation from 4K.",
       "described, no table", _NIAH, "02_table14"),
    _p("A9.3-3", "App. 9.3",
       "Top-four aggregation with a forward partial window ties mean aggregation with a prefix partial unit in EM "
       "from 5 % up, while selecting fewer tokens in fewer intervals.",
       "about 244 vs 519 tokens, 7.3 vs 20.1 intervals (24 cases, Qwen3-8B)", _NIAH, "02_ablation"),
    _p("A9.3-4", "§5, App. 9.3",
       "Open in the paper: whether linguistic boundaries improve on generic grouping (SUR against Fixed blocks and "
       "Multiple local windows at the same budget).",
       "not tested (no matched controls)", _NIAH, "02_ablation"),
    # ---- appendix 10: the matched evidence-location experiment
    _p("A10-1", "App. 10.2, Table 15",
       "Preregistered primary: the evidence-side contrast on gold-answer NLL (Eq. 10) is null.",
       "-0.039 nats [-0.099, 0.021]", _EVID, "08_table15"),
    _p("A10-2", "App. 10.2, Table 15",
       "The evidence-side contrast on EM is positive after Holm correction: repair helps more when the evidence is "
       "downstream of the edit.",
       "+5.99 pp [2.87, 9.26], Holm p 0.002", _EVID, "08_table15"),
    _p("A10-3", "App. 10.2, Table 15",
       "The neutral-tail (Eq. 11) and interaction (Eq. 12) contrasts are null on NLL and EM.",
       "NLL tail -0.031 [-0.066, 0.004]; EM tail +0.49 [-1.6, 2.6]; EM interaction -1.2 [-4.8, 2.2]", _EVID,
       "08_table15"),
    _p("A10-4", "App. 10.3, Table 16",
       "A fixed-slot refresh of the downstream slot shows an evidence-side effect similar to complete replay's on the "
       "fidelity endpoints.",
       "first-token TV .0696 vs .0709; argmax agreement 8.37 vs 8.17 pp", _EVID, "08_table16"),
    _p("A10-5", "App. 10.3",
       "The fixed-slot refresh's NLL side contrast is null as well.",
       "-0.031 nats [-0.093, 0.032]", _EVID, "08_table16"),
    # ---- appendix 11: numerical execution-path controls
    _p("A11-1", "App. 11, Table 17",
       "Replay and Re-prefill disagree numerically: their exact first-logit vectors differ in every cell.",
       "100 % exact-logit disagreement (BF16, three models, 160 cells each)", _NUM, "05_table17"),
    _p("A11-2", "App. 11, Table 17",
       "Their argmax and sequence disagreement is far smaller than the exact-logit one.",
       "argmax 0.62-8.75 %, sequence 2.29-10.69 %", _NUM, "05_table17"),
    _p("A11-3", "App. 11, Table 17",
       "Cross-path gold-answer NLL differences exceed the within-Re-prefill ones.",
       "|dNLL| excess 0.028-0.204", _NUM, "05_table17_nll"),
    # ---- SAFE-KV (non-prefix reuse of composed document caches)
    _s("S1", "abstract, Table 1",
       "Composing independently cached documents without repair (prefix-conditioned composition) loses many of full "
       "prefill's answers.",
       "preserves 47.2 % (HotpotQA-500) and 37.8 % (2Wiki-500) of full-prefill answers (Qwen2.5-7B)",
       "06_noprefix_pareto_ttfl"),
    _s("S2", "abstract, Table 1",
       "Suffix repair from a risk-selected start document (Risk K2) restores nearly all full-prefill answers.",
       "99.8 / 98.4 % (donor copy), 100.0 / 98.4 % (actual forwarding)", "06_noprefix_pareto_ttfl"),
    _s("S3", "Table 27 (document-only repair)",
       "Repair causally closed units, not evidence documents: patching the gold evidence document alone preserves "
       "far less.",
       "oracle evidence-document patching 54.4 % on Noise16", "06_noprefix_design_ledger"),
    _s("S4", "Figure 2, Table 3, Table 27",
       "Suffix closure beats a fixed downstream window at a similar recomputed share.",
       "window w4 79.0 % at a 72.9 % patch ratio; suffix K1 97.0 % at 79.3 % (2Wiki-100)",
       "06_noprefix_local_vs_suffix"),
    _s("S5", "Table 27 (linked intervals)",
       "Linked reasoning intervals fall below suffix closure.",
       "oracle linked intervals 80.0 % vs oracle suffix closure 93.6 % (Noise16)", "06_noprefix_design_ledger"),
    _s("S6", "Table 27 (adaptive suffix)",
       "An adaptive suffix trades budget for fidelity: cheaper, with more residual drift.",
       "86.8 % at 57.9 % patch ratio vs Risk K2 88.8 % at 69.9 % (Noise16)", "06_noprefix_design_ledger"),
    _s("S7", "abstract, Figure 5",
       "Reuse without repair is exact up to four documents and degrades at sixteen, where suffix repair recovers it.",
       "exact at <= 4 documents; suffix repair 98-100 % at 16", "06_noprefix_endpoints"),
    _s("S8", "Figure 3, Table 5",
       "With the evidence document first, patching that document alone is no better than composition; suffix repair "
       "removes most of the position dependence.",
       "50 examples per position (donor copy)", "06_noprefix_position_sweep"),
    _s("S9", "abstract, Figure 5, Table 7",
       "Operating rule: faithful repair re-encodes most of the context, so a single-request server answers every "
       "workload by full prefill.",
       "Risk K1 slower on four workloads; the Noise64 crossover preserves 44 % (one L40S)",
       "06_noprefix_operating_rule"),
    _s("S10", "Table 20",
       "The donor-copy protocol overstates actual forwarding on a long composition.",
       "+0.20 [0.06, 0.34] in answer preservation (Noise64, 50 examples)", "06_noprefix_quality_gate"),
    # ---- beyond the papers
    _b("B1", "issue 13; notebooks 02 and 09",
       "SUR-IDF (the identical-token bonus weighted by context IDF) against SUR at the same budget.",
       "not in the papers", _NIAH, "02_beyond_paper_differences"),
    _b("B2", "issue 26 ('Contiguity, Not Importance'); notebooks 02 and 09",
       "The edit-local window (the B positions right after the edit) against SUR at the same budget.",
       "not in the papers", "09_stale_facts", "09_paired_differences"),
    _b("B3", "issue 26; notebooks 02 and 09",
       "Edit-local + SUR (part of the allowance right after the edit, the rest by SUR) against SUR.",
       "not in the papers", "09_stale_facts", "09_paired_differences"),
    _b("B4", "issue 26; notebook 09",
       "Erratum (the Dirty cache plus an appended correction note, no recomputation) against SUR.",
       "not in the papers", "09_stale_facts", "09_paired_differences"),
    _b("B5", "issue 26; notebook 09",
       "Where an edit supersedes a value (stale facts), SUR lowers the stale-answer rate against Shift.",
       "not in the papers", "09_stale_facts", "09_summary"),
    _b("B6", "issue 27; notebook 10",
       "On agent traces (whole prompts resent every turn), a budgeted sync answers like re-prefill.",
       "not in the papers", "10_agent_traces", "10_agent_traces_decided"),
    _b("B7", "issue 27; notebook 10",
       "A budgeted sync recomputes fewer tokens, and answers sooner, than prefix reuse when a change lands early in "
       "the prompt.",
       "not in the papers", "10_agent_traces", "10_agent_traces_decided"),
    _b("B8", "notebook 07",
       "In one live session of successive deletions, per-edit SUR keeps answers close to re-prefill at a fraction of "
       "its recomputation; a staleness-debt arm narrows the rest.",
       "not in the papers", "07_agent_session", "07_agent_session_summary"),
)


#: How each row is computed: id -> (``compute``, the table it reads, when it differs from the row's). A row not
#: listed has no ``compute`` ("computation not implemented yet").
_COMPUTED: dict[str, tuple[Callable[[Path], Estimate], str | None]] = {
    "P1": (p1_sur_vs_dense, "02_sur_vs_allocators"),
    "P2": (p2_sur_em_at_2, "02_niah_records"),
    "P3": (p3_sur_vs_shift, "02_sur_vs_allocators"),
    "P4": (p4_sur_near_perfect_at_5, "02_sur_vs_allocators"),
    "P5": (p5_sur_vs_random_units, "02_sur_vs_allocators"),
    "P6": (p6_sur_vs_window, "02_sur_vs_allocators"),
    "P7": (p7_sur_vs_bm25, "02_sur_vs_allocators"),
    "P8": (p8_sur_vs_derived, "02_sur_vs_allocators"),
    "P9": (p9_sur_matches_reprefill, "03_decisions"),
    "P10": (p10_sur_vs_shift_qa, "03_decisions"),
    "P11": (p11_sur2_below_reprefill, "03_decisions"),
    "P12": (p12_faster_than_reprefill, "03_decisions"),
    "P13": (p13_faster_than_replay, "03_decisions"),
    "P14": (p14_sur_beats_selectors, "03_natural_qa_records"),
    "A9.3-1": (a93_1_matched_tokens, None),
    "A9.3-2": (_not_run("the default preset runs 1K and 2K contexts only; the claim contrasts them with 4K and "
                        "longer (the paper preset runs them), and 'concentrates' is no declared comparison"), None),
    "A9.3-3": (a93_3_design_tie, None),
    "A9.3-4": (a93_4_boundaries, None),
    "A10-1": (a10_1_nll_side_null, None),
    "A10-2": (a10_2_em_side_positive, None),
    "A10-3": (a10_3_tail_interaction_null, None),
    "A10-4": (a10_4_fixed_slot_carries, "08_findings"),
    "A10-5": (a10_5_fixed_slot_nll_null, "08_table15"),
    "B1": (b1_sur_idf, None),
    "B2": (b2_edit_local, None),
    "B3": (b3_edit_local_sur, None),
    "B4": (b4_erratum, None),
    "B5": (b5_stale_rate, "09_paired_differences"),
    "S1": (s1_composition_loses, "06_noprefix_endpoints"),
    "S2": (s2_suffix_restores, "06_noprefix_endpoints"),
    "S3": (s3_document_only_short, None),
    "S4": (s4_suffix_beats_window, "06_noprefix_design_ledger"),
    "S5": (s5_linked_below_suffix, None),
    "S6": (s6_adaptive_drifts, None),
    "S7": (s7_exact_then_degrades, "06_noprefix_endpoints"),
    "S8": (s8_position_dependence, "06_noprefix_sweep_runs"),
    "S9": (s9_full_prefill_everywhere, None),
    "S10": (s10_donor_overstates, "06_noprefix_decided"),
    "B6": (b6_sync_answers_alike, "10_agent_traces_decided"),
    "B7": (b7_sync_faster_early, "10_agent_traces_decided"),
    "B8": (b8_debt_narrows, "07_agent_session_decided"),
    "P15": (p15_packed_much_faster, "04_timings"),
    "P16": (p16_one_shot_then_packing, "04_timings"),
    "P17": (p17_direct_faster_at_one_interval, "04_timings"),
    "A11-1": (a11_1_exact_logits_differ, "05_execution_paths"),
    "A11-2": (a11_2_argmax_far_below_logits, "05_execution_paths"),
    "A11-3": (a11_3_nll_cross_exceeds_within, "05_execution_paths"),
}


def _with_compute(claim: Claim) -> Claim:
    if claim.id not in _COMPUTED:
        return claim
    compute, table = _COMPUTED[claim.id]
    return replace(claim, compute=compute, table=table or claim.table)


CLAIMS = tuple(_with_compute(c) for c in CLAIMS)


def _finished(results: Path) -> dict[str, bool]:
    try:
        entries = json.loads((Path(results) / "manifest.json").read_text(encoding="utf-8")).get("notebooks", {})
    except (OSError, ValueError):
        return {}
    return {stem: entry.get("status") == "finished" for stem, entry in entries.items()}


def claim_row(claim: Claim, results: Path, finished: Mapping[str, bool] | None = None) -> dict[str, Any]:
    """One claim's row: its fields, then ``estimate, ci_low, ci_high, unit, verdict, mde, n, note``.

    The verdict is :data:`NOT_COMPUTED` (with the reason in ``note``) when the claim has no ``compute`` function, when
    its notebook has not finished in the release, or when ``compute`` cannot run yet (the decisions module missing, a
    table absent: ``cannot compute yet``), or when the claim is about a quantity the run cannot produce
    (:class:`NotComputed`, whose reason is the note). A comparison the preset does not run (:class:`NotRun`) is
    "undecided at this size" with ``n`` 0 and the reason as the note.
    """
    finished = _finished(results) if finished is None else finished
    base = {"id": claim.id, "source": claim.source, "section": claim.section, "claim": claim.text,
            "paper": claim.paper, "notebook": claim.notebook, "table": claim.table}
    empty = dict(estimate=None, ci_low=None, ci_high=None, unit="", verdict=NOT_COMPUTED, mde=None, n=None, p=None,
                 family_size=None, n_clusters=None)
    if claim.compute is None:
        return {**base, **empty, "note": "computation not implemented yet"}
    if not finished.get(claim.notebook):
        return {**base, **empty, "note": f"{claim.notebook} has not finished in this release"}
    try:
        est = claim.compute(Path(results))
    except NotRun as err:
        return {**base, **empty, "verdict": claim_of_outcome(None), "n": 0, "note": f"not run at this preset: {err}"}
    except NotComputed as err:
        return {**base, **empty, "note": str(err)}
    except (ImportError, FileNotFoundError, KeyError, ValueError) as err:
        return {**base, **empty, "note": f"cannot compute yet: {type(err).__name__}: {err}"}
    return {**base, "estimate": est.estimate, "ci_low": est.ci_low, "ci_high": est.ci_high, "unit": est.unit,
            "verdict": est.verdict, "mde": est.mde, "n": est.n, "p": est.p, "family_size": est.family_size,
            "n_clusters": est.n_clusters, "note": est.note}


def claim_rows(results: Path, claims: Sequence[Claim] = CLAIMS) -> list[dict[str, Any]]:
    """:func:`claim_row` of every claim, in order.

    Raises:
        ValueError: naming ``claims`` when two rows share an id.
    """
    ids = [c.id for c in claims]
    if len(set(ids)) != len(ids):
        raise ValueError(f"claims repeat the ids {sorted({i for i in ids if ids.count(i) > 1})}")
    finished = _finished(results)
    return [claim_row(c, results, finished) for c in claims]


def _num(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:+.3g}" if abs(x) < 1000 else f"{x:+,.0f}"


def format_estimate(row: Mapping[str, Any]) -> str:
    """``"+12.5 pp EM [+4.2, +20.8] (n 96)"``; with the verdict's test when the row has one,
    ``"-20.8 pp EM [-35.3, -5.91] (n 48; Holm p 0.1 over 8)"`` or ``"(n 20 in 2 clusters; p 0.5)"``: the interval
    is unadjusted, so the p-value says why one that excludes 0 can still be undecided. ``"–"`` for a row not
    computed."""
    if row["estimate"] is None:
        words = row.get("verdict") not in (None, NOT_COMPUTED) and row.get("n") != 0 and row.get("note")
        return "– (decided in words: see how it was read)" if words else "–"
    parts = []
    if row.get("n") is not None:
        clusters = row.get("n_clusters")
        parts.append(f"n {row['n']}" + (f" in {clusters} clusters" if clusters is not None else ""))
    if row.get("p") is not None:
        size = row.get("family_size")
        parts.append(f"Holm p {row['p']:.2g} over {size}" if size is not None and size > 1 else f"p {row['p']:.2g}")
    n = f" ({'; '.join(parts)})" if parts else ""
    return f"{_num(row['estimate'])} {row['unit']} [{_num(row['ci_low'])}, {_num(row['ci_high'])}]{n}".replace(
        "  ", " ")


def too_few_units(row: Mapping[str, Any]) -> int | None:
    """The fewest units (clusters, when the comparison clusters) whose exact sign or sign-flip test could reach
    significance at the first Holm step of the row's family (``decisions.min_separating_units``), when the row has
    fewer: then no difference of any size separates at this size. ``None`` when the row has enough units, or no test
    (no ``p``) or no unit count."""
    units = row.get("n_clusters") if row.get("n_clusters") is not None else row.get("n")
    if row.get("p") is None or not units:
        return None
    needed = min_separating_units(ALPHA / max(int(row.get("family_size") or 1), 1))
    return needed if int(units) < needed else None


def format_verdict(row: Mapping[str, Any]) -> str:
    """The verdict; when undecided, why: the smallest separable difference (the comparison's ``mde``: the difference
    whose units, all one way, would just reach significance at this size; not an 80 %-power effect), or that no
    difference can separate with this few units (:func:`too_few_units`), or that the preset ran no unit of it."""
    if row["verdict"] == "undecided at this size" and row.get("n") == 0 and row.get("estimate") is None:
        return "undecided at this size (0 units: this preset does not run it)"
    if row["verdict"] == "undecided at this size" and (needed := too_few_units(row)) is not None:
        what = "clusters" if row.get("n_clusters") is not None else "units"
        size = row.get("family_size") or 1
        holm = f" under Holm over {size}" if size > 1 else ""
        return f"undecided at this size (no difference can separate: it needs at least {needed} {what}{holm})"
    if row["verdict"] == "undecided at this size" and row.get("mde") is not None:
        return f"undecided at this size (smallest separable: {abs(row['mde']):.3g} {row['unit']})"
    return row["verdict"]


def claims_markdown(rows: Sequence[Mapping[str, Any]], *, link: Callable[[str], str] | None = None,
                    level: int = 1) -> str:
    """The claims table as Markdown, one section per source. ``link(notebook)`` is the link target of a notebook
    (default ``<notebook>.ipynb``, beside ``claims.md`` in ``results/``); ``level`` is the title's heading level (the
    sections are one below)."""
    link = link or (lambda stem: f"{stem}.ipynb")
    counts = {v: sum(r["verdict"] == v for r in rows) for v in (*VERDICTS, NOT_COMPUTED)}
    lines = ["#" * level + " Claims", "",
             "The paper's claims (*Budgeted KV-Cache Repair for Evolving Contexts*: main text and appendices 9-11), "
             "SAFE-KV's rules, and the questions beyond both, against this release of the suite (every notebook at "
             "its `default` preset on the embedded study model, `sur-lab release`). The *paper* column is the "
             "source's own figure on its models and hardware; *this suite* is the estimate with its interval from "
             "this release's records, and the verdict comes from the decisions module. The interval is the "
             "comparison's own 95 % interval, not adjusted for multiplicity; the p-value beside it is the one the "
             "verdict reads (Holm-adjusted over the comparisons of its declared family, and counting clusters "
             "rather than cases where the units cluster), which is why an interval that excludes 0 can still be "
             "undecided. \"Smallest separable\" beside an undecided verdict is the difference this size could "
             "separate if every discordant unit went one way (the notebooks' power lines and results/README.md give "
             "the minimal detectable effect at 80 % power, which is larger). Under each table, how each computed "
             "verdict was read: the comparison, its family and the threshold or margin the claim needs. Generated by "
             "`sur_lab.runtime.claims`; nothing here is typed by hand.", "",
             "Verdicts: " + ", ".join(f"{n} {v}" for v, n in counts.items()) + ".", ""]
    titles = {"paper": "The paper", "SAFE-KV": "SAFE-KV", "beyond the papers": "Beyond the papers"}
    for source, title in titles.items():
        chosen = [r for r in rows if r["source"] == source]
        if not chosen:
            continue
        lines += ["#" * (level + 1) + f" {title}", "", "| # | claim | paper | this suite | verdict | from |",
                  "|---|---|---|---|---|---|"]
        for r in chosen:
            where = f"[`{r['notebook'][:2]}`]({link(r['notebook'])}) `{r['table']}`"
            verdict = format_verdict(r)
            if r["verdict"] == NOT_COMPUTED and r.get("note"):
                verdict += f" ({r['note']})"
            cells = [r["id"], f"{r['claim']} <small>({r['section']})</small>", r["paper"], format_estimate(r),
                     verdict, where]
            lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
        lines.append("")
        read = [f"- **{r['id']}**: {r['note']}" for r in chosen if r["verdict"] != NOT_COMPUTED and r.get("note")]
        if read:
            lines += ["How each verdict was read:", "", *read, ""]
    return "\n".join(lines)


CSV_COLUMNS = ("id", "source", "section", "claim", "paper", "notebook", "table", "estimate", "ci_low", "ci_high",
               "unit", "verdict", "mde", "n", "p", "family_size", "n_clusters", "note")


def claims_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    """The claims table as CSV text (:data:`CSV_COLUMNS`; empty cells for missing numbers)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: "" if r.get(k) is None else r.get(k) for k in CSV_COLUMNS})
    return buf.getvalue()


def write_claims(results: Path, claims: Sequence[Claim] = CLAIMS) -> list[Path]:
    """Write ``results/claims.md`` and ``results/claims.csv`` atomically; returns their paths."""
    results = Path(results)
    rows = claim_rows(results, claims)
    paths = [results / "claims.md", results / "claims.csv"]
    for path, text in zip(paths, (claims_markdown(rows), claims_csv(rows))):
        with atomic_path(path) as tmp:
            tmp.write_text(text, encoding="utf-8")
    return paths


__all__ = ["CLAIMS", "Claim", "Estimate", "NOT_COMPUTED", "NotComputed", "VERDICTS", "all_of", "claim_row",
           "claim_rows", "claims_csv", "claims_markdown", "decide", "format_estimate", "paired_claim", "read_table",
           "table_path", "threshold_claim", "write_claims"]
