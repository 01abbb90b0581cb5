"""The claims table: each claim of the paper and of SAFE-KV, and each question beyond them, against this release.

One :class:`Claim` per row of :data:`CLAIMS`, numbered by where it stands: ``P`` the paper's main text and its
appendix 9.1-9.2 allocation controls (which section 5 summarises), ``A9.3`` / ``A10`` / ``A11`` its appendix findings,
``S`` SAFE-KV's rules (its abstract and design ledger, Table 27), ``B`` the questions beyond both papers. A row names
the paper's own figure, the notebook and table of this suite it is read from, and a ``compute`` function from the
results folder to an :class:`Estimate`: this suite's estimate with its interval and the verdict, "holds", "does not
hold" or "undecided at this size" with the minimal detectable effect. Verdicts come only from :func:`decide`, the one
place that calls the decisions module (``sur_lab.analysis.decisions``); a row without a ``compute`` function, or
whose notebook has not finished in the release, renders as "not yet computed", never as a verdict.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sur_lab.analysis.decisions import CLAIM_EXPECTATIONS as EXPECTATIONS
from sur_lab.analysis.decisions import CLAIM_VERDICTS as VERDICTS
from sur_lab.analysis.decisions import claim_verdict, paired_family
from sur_lab.paths import atomic_path

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
    """

    estimate: float | None
    ci_low: float | None
    ci_high: float | None
    unit: str
    verdict: str
    mde: float | None = None
    n: int | None = None
    note: str = ""

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
    return Estimate(float(row["estimate"]), float(row["ci_low"]), float(row["ci_high"]), unit, verdict,
                    mde=row.get("mde"), n=None if n is None else int(n), note=note)


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


def _p(id, section, text, paper, notebook, table, compute=None):
    return Claim(id, "paper", section, text, paper, notebook, table, compute)


def _s(id, section, text, paper, table, compute=None):
    return Claim(id, "SAFE-KV", section, text, paper, "06_noprefix_reuse", table, compute)


def _b(id, section, text, paper, notebook, table, compute=None):
    return Claim(id, "beyond the papers", section, text, paper, notebook, table, compute)


_NIAH, _QA, _BENCH, _NUM, _EVID = ("02_allocation_geometry", "03_natural_qa_latency", "04_packed_refresh_benchmark",
                                   "05_kernel_numerical_validation", "08_evidence_location")

#: Every row of the claims table, in order. Appending a row here is all a new claim needs; its ``compute`` function
#: reads ``results/`` and returns :func:`decide`'s :class:`Estimate`.
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
       "packed over one-shot 1.21x at 8K, R = 16", _BENCH, "04_table18"),
    _p("P17", "§4.4, Table 18",
       "With a single interval, direct-cache sequential execution is slightly faster than packing.",
       "8K, R = 1: 32.571 vs 34.860 ms", _BENCH, "04_table18"),
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
       "not in the papers", "10_agent_traces", "10_agent_traces_summary"),
    _b("B7", "issue 27; notebook 10",
       "A budgeted sync recomputes fewer tokens, and answers sooner, than prefix reuse when a change lands early in "
       "the prompt.",
       "not in the papers", "10_agent_traces", "10_agent_traces_regions"),
    _b("B8", "notebook 07",
       "In one live session of successive deletions, per-edit SUR keeps answers close to re-prefill at a fraction of "
       "its recomputation; a staleness-debt arm narrows the rest.",
       "not in the papers", "07_agent_session", "07_agent_session_summary"),
)


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
    table absent).
    """
    finished = _finished(results) if finished is None else finished
    base = {"id": claim.id, "source": claim.source, "section": claim.section, "claim": claim.text,
            "paper": claim.paper, "notebook": claim.notebook, "table": claim.table}
    empty = dict(estimate=None, ci_low=None, ci_high=None, unit="", verdict=NOT_COMPUTED, mde=None, n=None)
    if claim.compute is None:
        return {**base, **empty, "note": "computation not implemented yet"}
    if not finished.get(claim.notebook):
        return {**base, **empty, "note": f"{claim.notebook} has not finished in this release"}
    try:
        est = claim.compute(Path(results))
    except (ImportError, FileNotFoundError, KeyError, ValueError) as err:
        return {**base, **empty, "note": f"cannot compute yet: {type(err).__name__}: {err}"}
    return {**base, "estimate": est.estimate, "ci_low": est.ci_low, "ci_high": est.ci_high, "unit": est.unit,
            "verdict": est.verdict, "mde": est.mde, "n": est.n, "note": est.note}


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
    """``"+12.5 pp EM [+4.2, +20.8] (n 96)"``; ``"–"`` for a row not computed."""
    if row["estimate"] is None:
        return "–"
    n = f" (n {row['n']})" if row.get("n") is not None else ""
    return f"{_num(row['estimate'])} {row['unit']} [{_num(row['ci_low'])}, {_num(row['ci_high'])}]{n}".replace(
        "  ", " ")


def format_verdict(row: Mapping[str, Any]) -> str:
    """The verdict, with the minimal detectable effect when undecided, or "not yet computed"."""
    if row["verdict"] == "undecided at this size" and row.get("mde") is not None:
        return f"undecided at this size (smallest detectable: {abs(row['mde']):.3g} {row['unit']})"
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
             "this release's records, and the verdict comes from the decisions module. Generated by "
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
    return "\n".join(lines)


CSV_COLUMNS = ("id", "source", "section", "claim", "paper", "notebook", "table", "estimate", "ci_low", "ci_high",
               "unit", "verdict", "mde", "n", "note")


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


__all__ = ["CLAIMS", "Claim", "Estimate", "NOT_COMPUTED", "VERDICTS", "claim_row", "claim_rows", "claims_csv",
           "claims_markdown", "decide", "format_estimate", "paired_claim", "write_claims"]
