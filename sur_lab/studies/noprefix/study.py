"""The non-prefix reuse study's sweep: composed RAG requests as sweep cases, repair units as methods, one record schema.

Each RAG request is a :class:`ComposedCase`: its :meth:`ComposedCase.prepare` composes the cached documents (the
stale cache with exact positions, in place of a Shift cache; :mod:`~sur_lab.studies.noprefix.composition`) and keeps
the full-prefill cache for the donor protocol. The sweep's methods are the reference operators — ``"Shift"`` is prefix
composition with no repair, ``"Replay"`` the full prefill after the shared prefix (the TTFL reference), ``"Re-prefill"``
the prompt rebuilt from scratch (the answer reference) — and one :class:`RepairMethod` per (repair unit, protocol),
so every record goes through :func:`sur_lab.sweeps.run_case` and the one store like every other study's. Records say
``protocol`` (``"forward"``: executor; ``"donor"``: rows copied from full prefill, a diagnostic upper bound).

Endpoints in :class:`~sur_lab.sweeps.Record` terms (:func:`runs_table` adds the study's names for the reporting
functions): answer preservation is ``agree_reprefill`` with the whole-answer parser (:func:`preservation_text`:
normalised whole text, as :func:`~sur_lab.studies.noprefix.protocol.answers_agree`), token exactness is
``sequence_agree``, first-token TV is ``tv_reprefill``, the repair ratio is ``allowance / suffix_len``, and time to
first logit is ``shift_ms`` (composition) + ``select_ms`` + ``refresh_ms`` + ``query_ms``, on the timed cases only
(the first ``timed_sources`` sources per dataset, answered one record at a time).

What does not go through :func:`run_case`: the per-document drift of the composed cache against full prefill
(:func:`measure_drift`, notebook section 1). It is a measurement of the case's caches, not of a method's answer, so it
has no place in a per-method record; it composes each request again (the document caches are reused).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from transformers import DynamicCache

from sur_lab.allocators import Selection
from sur_lab.analysis.scoring import agreement, extract_answer, normalize_answer, score_example
from sur_lab.cache_ops import clone_cache
from sur_lab.data.qa import load_qa, select_sources
from sur_lab.executors import get_executor
from sur_lab.fingerprint import digest, model_fingerprint
from sur_lab.models import LoadedModel
from sur_lab.repair import PreparedEdit, RepairResult
from sur_lab.studies.base import Report, Study
from sur_lab.studies.noprefix.composition import ComposedPrompt, build_caches, composition_edit, prefix_cache
from sur_lab.studies.noprefix.protocol import (
    build_request,
    default_specs,
    document_drift,
    donor_copy,
    sweep_specs,
    workload_name,
)
from sur_lab.studies.noprefix.ledger import (
    DONOR_PROXY,
    LEDGER,
    POWER,
    conclusion,
    decided_table,
    design_ledger,
    operating_rule,
)
from sur_lab.studies.noprefix.reporting import summarize
from sur_lab.studies.noprefix.selection import PROTOCOLS, RepairSpec, plan_repair, risk_scores, selector_scores
from sur_lab.sweeps import Case

#: The study's name in the registry (``sur-lab sweep noprefix``), its notebook, and its sweep folders' prefix.
NAME = "noprefix"
NOTEBOOK = "06_noprefix_reuse"
FOLDER = "06_noprefix"
#: Study sizes of notebook 06 by preset (issue 13; :func:`sur_lab.studies.presets.resolve_preset`). ``n_sources`` pairs
#: with ``num_docs`` (sources per dataset for each prompt size, nested); ``timed_sources`` is how many of the first
#: sources per dataset are answered one record at a time and timed (time to first logit); the others are answered in
#: batches for quality only. The 64-document workload is SAFE-KV's Noise64 (Table 20: 50 examples), run by the
#: ``paper`` preset only: at ``default`` size it held one source per dataset (2 requests, a quarter of the notebook's
#: minutes), which decides nothing (certifying 95 % preservation needs >= 59 all-preserved requests), so the
#: ``default`` keeps the 4- and 16-document workloads and its quality gate (Table 20's analogue) is the 16-document
#: one (issue 41's 3-hour budget; issue 40: a size the suite cannot hold belongs to ``paper``).
#: ``robustness_sources`` caps the sources per dataset of the robustness model's run (:func:`robustness_overrides`).
PRESETS = {
    "smoke": {"datasets": ["hotpotqa"], "num_docs": [4], "n_sources": [2], "timed_sources": 2, "sweep_sources": 1,
              "max_doc_tokens": 40, "max_new_tokens": 6, "robustness_sources": 1},
    "default": {"datasets": ["hotpotqa", "2wikimultihopqa"], "num_docs": [4, 16], "n_sources": [6, 2],
                "timed_sources": 6, "sweep_sources": 2, "max_doc_tokens": 48, "max_new_tokens": 8,
                "robustness_sources": 6},
    "paper": {"datasets": ["hotpotqa", "2wikimultihopqa"], "num_docs": [4, 16, 64], "n_sources": [100, 100, 50],
              "timed_sources": 100, "sweep_sources": 20, "max_doc_tokens": 128, "max_new_tokens": 32,
              "robustness_sources": 100},
}
#: The robustness model's run keeps the workloads up to this many documents (SAFE-KV's second-family diagnostic is
#: Noise16-sized; SmolLM2-135M's 8,192-position context cannot hold the ``paper`` preset's Noise64 prompts).
ROBUSTNESS_MAX_DOCS = 16
#: Parameters that are not preset sizes, at the notebook's defaults (the literals of its ``parameters`` cell).
FIXED = {"sweep_docs": 4, "budgets": [50], "protocols": ["forward", "donor"]}
#: The reference operators' names in the study's tables.
REFERENCE_LABELS = {"Shift": "Prefix composition", "Replay": "Full prefill"}
#: Designs: ``"main"`` (every repair unit over the ``num_docs`` workloads) and ``"positions"`` (the evidence position
#: sweep: gold documents moved through the slots of ``sweep_docs``-document prompts, :func:`sweep_specs`).
DESIGNS = ("main", "positions")

# Shared prefix caches and prefix-conditioned document caches, reused across requests in this process (offline caches
# in RAG serving); bounded, least recently used dropped first. Keys hold the model fingerprint and the ids.
_PREFIXES: OrderedDict = OrderedDict()
_DOCUMENTS: OrderedDict = OrderedDict()
_MAX_PREFIXES = 4
_MAX_DOCUMENTS = 256


def _bounded(store: OrderedDict, limit: int) -> None:
    while len(store) > limit:
        store.popitem(last=False)


@dataclass
class ComposedPrepared(PreparedEdit):
    """A composed request prepared once for every method: the composed cache as the stale cache (``shift_cache``; its
    composition time is ``shift_ms``), no Dirty cache, the full-prefill cache for the donor protocol, and the selectors'
    document scores (computed on first use, with their time).

    Attributes:
        prompt: the composed prompt.
        full_cache: full prefill of the documents after the shared prefix (``p + S`` rows).
        scores: selector name -> ``(document scores [n], scoring ms)``.
    """

    prompt: ComposedPrompt | None = None
    full_cache: DynamicCache | None = None
    scores: dict = field(default_factory=dict)

    def selector(self, name: str, lm: LoadedModel) -> tuple[np.ndarray, float]:
        """Document scores of selector ``name`` (:func:`~sur_lab.studies.noprefix.selection.selector_scores`), computed
        once per request, and the time it took, ms."""
        if name not in self.scores:
            t0 = time.perf_counter()
            values = selector_scores(name, lm, self.prompt)
            self.scores[name] = (values, (time.perf_counter() - t0) * 1e3)
        return self.scores[name]


@dataclass(frozen=True)
class ComposedCase(Case):
    """One composed RAG request as a sweep case (build it with :func:`composed_case`).

    Attributes:
        prompt: the composed prompt (its :func:`composition_edit` is the case's ``edit``).
    """

    prompt: ComposedPrompt | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prompt is None:
            raise ValueError(f"case {self.case_id!r}: prompt is required (use composed_case)")

    def fingerprint(self) -> str:
        """The edit, gold and meta hash, and the documents' segmentation (each is cached on its own)."""
        return digest({"case": super().fingerprint(), "doc_lens": self.prompt.doc_lens.tolist()})[:16]

    def prepare(self, lm: LoadedModel) -> ComposedPrepared:
        """Compose the request from its document caches (encoded once per prefix and document, reused across
        requests), and build the full prefill for the donor protocol (:func:`build_caches`)."""
        fp = tuple(model_fingerprint(lm).values())
        pkey = (fp, tuple(self.prompt.prefix_ids.tolist()))
        if pkey not in _PREFIXES:
            _PREFIXES[pkey] = prefix_cache(lm, self.prompt)
        _PREFIXES.move_to_end(pkey)
        _bounded(_PREFIXES, _MAX_PREFIXES)
        caches = build_caches(lm, self.prompt, _PREFIXES[pkey], _DOCUMENTS)
        _bounded(_DOCUMENTS, _MAX_DOCUMENTS)
        return ComposedPrepared(self.edit, None, caches.composed, caches.timings_ms["documents"],
                                caches.timings_ms["compose"], prompt=self.prompt, full_cache=caches.full)


def composed_case(case_id: str, prompt: ComposedPrompt, gold: Sequence[str] = (),
                  meta: Mapping[str, Any] | None = None) -> ComposedCase:
    """A :class:`ComposedCase` for ``prompt``: its edit is :func:`composition_edit` ``(prompt)``."""
    return ComposedCase(case_id, composition_edit(prompt), tuple(gold), dict(meta or {}), prompt=prompt)


@dataclass(frozen=True)
class RepairMethod:
    """A repair unit with a protocol, as a sweep method (:class:`sur_lab.sweeps.Method`).

    Attributes:
        spec: the repair unit (:class:`~sur_lab.studies.noprefix.selection.RepairSpec`; not ``"none"``/``"full"``,
            which are the reference operators Shift and Replay).
        protocol: ``"forward"`` (the executor recomputes the support) or ``"donor"`` (rows copied from full prefill).

    Raises:
        ValueError: naming ``protocol`` or ``spec`` when invalid.
    """

    spec: RepairSpec
    protocol: str = "forward"

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol={self.protocol!r}; allowed: {', '.join(PROTOCOLS)}")
        if self.spec.unit in ("none", "full"):
            raise ValueError(f"spec.unit={self.spec.unit!r} is a reference operator (Shift / Replay), not a method")

    @property
    def name(self) -> str:
        return self.spec.label

    @property
    def budget_pct(self) -> float:
        return float(self.spec.budget_pct) if self.spec.budget_pct is not None else math.nan

    def repair(self, lm: LoadedModel, prepared: ComposedPrepared, *, executor: str, seed: int,
               options: Mapping[str, Any] | None) -> RepairResult:
        """Plan the unit on the request (selector scores shared by the request's methods) and apply it with the
        protocol; the composed and full caches are not modified."""
        prompt = prepared.prompt
        scores, score_ms = ({}, {})
        if self.spec.uses_selector:
            values, ms = prepared.selector(self.spec.selector, lm)
            scores, score_ms = {self.spec.selector: values}, {self.spec.selector: ms}
        plan = plan_repair(self.spec, prompt, scores=scores, select_ms=score_ms, lm=lm, edit=prepared.edit,
                           composed=prepared.shift_cache, units=prepared.units)
        t0 = time.perf_counter()
        if plan.support.size == 0:
            cache = clone_cache(prepared.shift_cache)
        elif self.protocol == "forward":
            cache = get_executor(executor)(lm, prepared.shift_cache, prepared.edit, plan.support)
        else:
            cache = donor_copy(prepared.shift_cache, prepared.full_cache, prompt.prefix_len, plan.support)
        refresh_ms = (time.perf_counter() - t0) * 1e3 if plan.support.size else 0.0
        diagnostics = {"start_doc": plan.start_doc, "candidates": list(plan.candidates)}
        selection = Selection(plan.support, plan.select_ms, 0, diagnostics)
        return RepairResult(cache, self.name, self.budget_pct, selection,
                            {"select": plan.select_ms, "shift": prepared.shift_ms, "refresh": refresh_ms},
                            plan.support.size)


def preservation_text(text: str) -> str:
    """The whole answer, whitespace-collapsed and normalised (:func:`sur_lab.analysis.scoring.normalize_answer`): the
    parser under which ``agree_reprefill`` is answer preservation (a lead-in line alone never counts as preserved)."""
    return normalize_answer(" ".join(text.split()))


class ExampleScorer:
    """A picklable ``scorer(case, answer_text) -> bool``: the example's dataset rule on the extracted answer."""

    def __init__(self, examples: Mapping[str, Any]) -> None:
        self.examples = dict(examples)

    def __call__(self, case, text: str) -> bool:
        return score_example(extract_answer(text), self.examples[case.case_id])


# ---------------------------------------------------------------------------------------------------------------------
# The study (issue 39: declarations on the Study base; params, folder, sweep, mde and conclusion are the base's)


def robustness_overrides(p: Mapping[str, Any]) -> dict[str, Any]:
    """Overrides of :meth:`NoprefixStudy.sweep` for the robustness model (SAFE-KV Figure 4, right): the main design's
    workloads with at most :data:`ROBUSTNESS_MAX_DOCS` documents, at most ``p["robustness_sources"]`` sources per
    dataset each, and no timed request (the check is about answers; its records are answered in batches).

    Args:
        p: the study's parameters (:meth:`NoprefixStudy.params`).

    Returns:
        ``num_docs``, ``n_sources`` and ``timed_sources`` to pass with the study's other overrides.

    Raises:
        ValueError: naming ``p`` when no workload has at most :data:`ROBUSTNESS_MAX_DOCS` documents, or
            ``robustness_sources`` when it is below 1.
    """
    cap = int(p["robustness_sources"])
    if cap < 1:
        raise ValueError(f"robustness_sources={cap!r} must be >= 1")
    kept = [(n, k) for n, k in zip(p["num_docs"], p["n_sources"]) if n <= ROBUSTNESS_MAX_DOCS]
    if not kept:
        raise ValueError(f"p: no workload has at most {ROBUSTNESS_MAX_DOCS} documents (num_docs={p['num_docs']})")
    return {"num_docs": [n for n, _ in kept], "n_sources": [min(k, cap) for _, k in kept], "timed_sources": 0}


def _check_design(design: str) -> None:
    if design not in DESIGNS:
        raise ValueError(f"design={design!r}; allowed: {', '.join(DESIGNS)}")


def _requests(tokenizer, p: Mapping[str, Any], seed: int, design: str) -> list[tuple[str, Any, Any, int]]:
    """``(case_id, RagRequest, example, source rank)`` of the design, in the notebook's order (nested source
    selections; the rank is the source's place in its dataset's seeded selection)."""
    out = []
    for ds in p["datasets"]:
        pool = load_qa(ds, split="dev")
        # Padding for the 16-document prompts: other questions' paragraphs from the same development file.
        filler = [q for ex in pool for q in (*ex.supporting, *ex.distractors)]
        if design == "main":
            for i, ex in enumerate(select_sources(pool, max(p["n_sources"]), seed)):
                for n, k in zip(p["num_docs"], p["n_sources"]):
                    if i < k:  # nested: the 16-document sources are the first of the 4-document ones
                        req = build_request(tokenizer, ex, n, seed=seed, filler=filler,
                                            max_doc_tokens=p["max_doc_tokens"])
                        out.append((f"{ds}/{ex.id}/n{n}", req, ex, i))
        else:
            two_gold = [ex for ex in pool if len(ex.supporting) == 2]
            for i, ex in enumerate(select_sources(two_gold, min(p["sweep_sources"], len(two_gold)), seed)):
                for slot in range(p["sweep_docs"] - 1):
                    req = build_request(tokenizer, ex, p["sweep_docs"], seed=seed, filler=filler,
                                        max_doc_tokens=p["max_doc_tokens"], slot=slot)
                    out.append((f"{ds}/{ex.id}/n{p['sweep_docs']}/slot{slot}", req, ex, i))
    return out


def _case(row: tuple) -> ComposedCase:
    cid, req, ex, rank = row
    meta = {**req.meta, "workload": workload_name(req.meta["dataset"], req.meta["num_docs"]), "source_rank": rank}
    return composed_case(cid, req.prompt, tuple(ex.answers), meta)


class ComposedCases(list):
    """A design's :class:`ComposedCase` list, with ``examples`` (case id -> its QA example) for the scorer."""

    def __init__(self, cases: Sequence[ComposedCase] = (), examples: Mapping[str, Any] | None = None) -> None:
        super().__init__(cases)
        self.examples = dict(examples or {})


class NoprefixStudy(Study):
    """Non-prefix reuse (notebook 06), one instance per design: ``"main"`` (every repair unit and protocol over the
    workloads; :data:`STUDY`, registered as ``noprefix``) or ``"positions"`` (the evidence position sweep,
    :data:`POSITIONS`). Requests of the first ``timed_sources`` sources per dataset (main design) are answered one
    record at a time and timed (time to first logit); the rest, and the position sweep, are answered in batches for
    quality only (keep ``workers=1`` for TTFL). :func:`runs_table` turns the records into the study's tables' columns.

    Raises:
        ValueError: naming ``design`` when not one of :data:`DESIGNS`.
    """

    name, notebook = NAME, NOTEBOOK
    presets, fixed = PRESETS, FIXED
    parser = staticmethod(preservation_text)
    power, families = POWER, (DONOR_PROXY, LEDGER)

    def __init__(self, design: str = "main") -> None:
        _check_design(design)
        self.design = design
        self.folder_prefix = f"{FOLDER}_{design}"
        sizes = ({"n": "num_docs", "src": "n_sources", "timed": "timed_sources"} if design == "main"
                 else {"docs": "sweep_docs", "src": "sweep_sources"})
        self.folder_keys = {"data": "datasets", **sizes, "cap": "max_doc_tokens", "b": "budgets",
                            "tok": "max_new_tokens", "seed": "seed", "eb": "eval_batch"}

    def cases(self, tokenizer, p: Mapping[str, Any], seed: int = 0) -> ComposedCases:
        """One :class:`ComposedCase` per RAG request of the design (meta: dataset, source, number of documents,
        evidence slot, workload, and ``source_rank``, the source's place in the seeded selection).

        Raises:
            ValueError: as the request builders.
        """
        rows = _requests(tokenizer, p, seed, self.design)
        return ComposedCases([_case(row) for row in rows], {cid: ex for cid, _, ex, _ in rows})

    def methods(self, p: Mapping[str, Any]) -> list:
        """Re-prefill (the answer reference), Replay (full prefill after the shared prefix: the TTFL reference), Shift
        (prefix composition), then one :class:`RepairMethod` per repair unit and protocol."""
        specs = default_specs(p["budgets"]) if self.design == "main" else sweep_specs()
        units = [s for s in specs if s.unit not in ("none", "full")]
        return ["Re-prefill", "Replay", "Shift"] + [RepairMethod(s, proto) for s in units for proto in p["protocols"]]

    def budgets(self, p: Mapping[str, Any]) -> list:
        """None: every :class:`RepairMethod` carries its own budget."""
        return []

    def sweep_cases(self, cases: ComposedCases, p: Mapping[str, Any]) -> list:
        """:meth:`cases` are sweep cases already."""
        return list(cases)

    def timed(self, cases: ComposedCases, p: Mapping[str, Any]) -> list[str]:
        """The main design's requests of the first ``timed_sources`` sources per dataset."""
        return [c.case_id for c in cases if self.design == "main" and c.meta["source_rank"] < p["timed_sources"]]

    def scorer_for(self, cases: ComposedCases) -> ExampleScorer:
        """Each request's dataset rule on the extracted answer (:class:`ExampleScorer`)."""
        return ExampleScorer(cases.examples)

    def report(self, records: pd.DataFrame, p: Mapping[str, Any], *, decide: bool = True,
               required_preservation: float = 0.95, seed: int = 0, drift=None) -> Report:
        """The runs (:func:`runs_table`), the summary by workload, the operating rule per workload, the design
        ledger (with the pooled ``drift`` row of :func:`drift_table` when measured), the declared comparisons decided
        (``"decided"``: :func:`~sur_lab.studies.noprefix.ledger.decided_table`, the primary first) and the conclusion
        lines."""
        runs = runs_table(records)
        summary = summarize(runs, by=("workload", "label", "protocol"))
        decisions = {wl: operating_rule(summary[summary["workload"] == wl], runs=runs[runs["workload"] == wl],
                                        required_preservation=required_preservation, decide=decide, seed=seed)
                     for wl in dict.fromkeys(summary["workload"])}
        ledger = design_ledger(summarize(runs, by=("label", "protocol")), runs=runs,
                               required_preservation=required_preservation, budgets=p["budgets"], drift=drift,
                               decisions=decisions, seed=seed, decide=decide)
        lines = conclusion(summary, runs, decisions, ledger, required_preservation=required_preservation,
                           decide=decide, seed=seed)
        decided = decided_table(runs, budgets=p["budgets"], seed=seed, decide=decide)
        return Report(tables={"runs": runs, "summary": summary, "ledger": ledger, "decided": decided},
                      conclusion=lines)


STUDY = NoprefixStudy("main")
POSITIONS = NoprefixStudy("positions")


def spec_of(method: str, budget_pct: float, budgets: Sequence[float] = ()) -> RepairSpec | None:
    """The repair unit a record's ``method`` names (``None`` for Re-prefill): Shift is prefix composition
    (``"none"``), Replay full prefill (``"full"``), every other method a :func:`default_specs` /
    :func:`sweep_specs` label."""
    if method == "Shift":
        return RepairSpec("none")
    if method == "Replay":
        return RepairSpec("full")
    known = {s.label: s for s in [*default_specs([*budgets] or [50]), *sweep_specs()]}
    if not math.isnan(budget_pct):
        known.update({s.label: s for s in default_specs([budget_pct])})
    return known.get(method)


def runs_table(records: pd.DataFrame) -> pd.DataFrame:
    """The study's long table from sweep records, with the columns the reporting functions read.

    One row per (request, repair unit, protocol): Re-prefill's rows are dropped (it is the answer reference); prefix
    composition (Shift, no support) is repeated under every protocol of the sweep. Adds ``label``, ``unit``,
    ``selector``, ``k``, ``width``, ``preserved`` (= ``agree_reprefill``: whole answers equal after normalisation),
    ``token_exact`` (= ``sequence_agree``), ``tv_full`` (= ``tv_reprefill``), ``extracted_agree`` (extracted answers
    agree), ``full_em`` (Re-prefill's EM), ``changed_wrong`` (not preserved and gold-wrong), ``repair_ratio``
    (``allowance / suffix_len``), ``ttfl_ms`` (composition + select + refresh + query forward, ms; NaN for untimed
    records) and ``full_ttfl_ms`` (the request's full prefill TTFL).

    Raises:
        ValueError: naming ``records`` when a method is not one of the study's.
    """
    df = records.copy()
    ref = df[df["method"] == "Re-prefill"].set_index("case_id")
    df = df[df["method"] != "Re-prefill"].copy()
    budgets = sorted({float(b) for b in df["budget_pct"].dropna()})
    specs = [spec_of(m, b, budgets) for m, b in zip(df["method"], df["budget_pct"])]
    unknown = sorted({m for m, s in zip(df["method"], specs) if s is None})
    if unknown:
        raise ValueError(f"records hold methods that are not the noprefix study's: {unknown}")
    df["label"] = [s.label for s in specs]
    df["method"] = [s.method for s in specs]
    df["unit"] = [s.unit for s in specs]
    df["selector"] = [s.selector if s.uses_selector else "" for s in specs]
    df["k"] = [s.k for s in specs]
    df["width"] = [float(s.width) if s.unit == "window" else math.nan for s in specs]
    df["preserved"] = df["agree_reprefill"].astype(bool)
    df["token_exact"] = df["sequence_agree"].astype(bool)
    df["tv_full"] = df["tv_reprefill"]
    ref_answer = df["case_id"].map(ref["answer"])
    df["extracted_agree"] = [bool(agreement(extract_answer(a), extract_answer(r))) for a, r in
                             zip(df["answer"], ref_answer)]
    df["full_em"] = df["case_id"].map(ref["em"])
    df["changed_wrong"] = [(not p) and (e is False or e == 0) if e is not None and not pd.isna(e) else None
                           for p, e in zip(df["preserved"], df["em"])]
    df["repair_ratio"] = df["allowance"] / df["suffix_len"].where(df["suffix_len"] > 0)
    df["ttfl_ms"] = df["shift_ms"] + df["select_ms"] + df["refresh_ms"] + df["query_ms"]
    full = df[df["unit"] == "full"].set_index("case_id")["ttfl_ms"]
    df["full_ttfl_ms"] = df["case_id"].map(full)
    protocols = [p for p in PROTOCOLS if p in set(df["protocol"])]
    comp = df[df["unit"] == "none"]
    extra = [comp.assign(protocol=p) for p in protocols if p != "forward"]
    df = pd.concat([df, *extra], ignore_index=True) if extra else df.reset_index(drop=True)
    if "budget_pct" in df and df["budget_pct"].isna().all():
        df = df.drop(columns=["budget_pct"])
    if df["width"].isna().all():
        df = df.drop(columns=["width"])
    return df


def measure_drift(lm: LoadedModel, cases_: Sequence[ComposedCase]) -> pd.DataFrame:
    """Per request: the measured drift of each document's composed rows against full prefill
    (:func:`~sur_lab.studies.noprefix.protocol.document_drift`) and the forward-free risk score
    (:func:`~sur_lab.studies.noprefix.selection.risk_scores`), for :func:`drift_table`.

    Returns:
        One row per request: the case's meta, ``unit`` (``"full"``), ``drift`` and ``risk`` (lists over documents).
    """
    rows = []
    for case in cases_:
        prepared = case.prepare(lm)
        rows.append({**case.meta, "case_id": case.case_id, "unit": "full",
                     "drift": document_drift(case.prompt, prepared.shift_cache, prepared.full_cache).tolist(),
                     "risk": risk_scores(case.prompt).tolist()})
    return pd.DataFrame(rows)


__all__ = [
    "DESIGNS", "FIXED", "FOLDER", "NAME", "NOTEBOOK", "PRESETS", "REFERENCE_LABELS", "ROBUSTNESS_MAX_DOCS",
    "POSITIONS", "STUDY", "ComposedCase", "ComposedCases", "ComposedPrepared", "ExampleScorer", "NoprefixStudy",
    "RepairMethod", "composed_case", "measure_drift", "preservation_text", "robustness_overrides", "runs_table",
    "spec_of",
]
