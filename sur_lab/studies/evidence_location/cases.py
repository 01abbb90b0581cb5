"""Evidence-location cells and the panel (appendix 10.1): each feasible source's four cells as checked edits, the
panel of a candidate pool with its counted exclusions, and the cells as sweep cases.

A cell (:class:`LocationCase`) is one source at one evidence side and one neutral tail (:data:`CELLS`), its edit built
by :func:`sur_lab.edits.segment_edit` from the source's segments and checked against the plan (:func:`build_cell`);
the four cells of a source are checked against each other (:func:`check_cells`). :func:`build_panel` builds every
candidate of the natural-QA pool, by tokenization alone, before any model runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pandas as pd
import torch
from transformers import AutoTokenizer

from sur_lab.analysis.stats import TAILS
from sur_lab.budget import budget_for_allowance
from sur_lab.data.qa import DATASETS, Passage, QAExample, load_qa, select_sources
from sur_lab.data.text import PanelConfig, is_eligible
from sur_lab.edits import DEFAULT_INSTRUCTION, EditedContext, render_chat, segment_edit
from sur_lab.models import embedded_model, embedded_tokenizer
from sur_lab.studies.evidence_location.sources import (
    REASONS,
    Exclusion,
    Geometry,
    LocationSource,
    _build_source,
    _Builder,
    _default_corpus,
    _geometries,
)
from sur_lab.sweeps import Case

__all__ = ["CELLS", "FIXED_SLOT_METHOD", "LocationCase", "build_cell", "build_cells", "check_cells", "Panel",
           "build_panel", "panel_tokenizers", "sweep_cases", "sweep_cases_of"]

#: The four cells (evidence side, neutral tail) in the paper's order.
CELLS = (("upstream", "short"), ("downstream", "short"), ("upstream", "long"), ("downstream", "long"))
#: The fixed-slot refresh (appendix 10.3) is the edit-local window ``[0, B)`` at the exact allowance B = W: the
#: downstream exchange slot starts at suffix position 0, right after the deletion, so the window covers exactly the slot
#: whichever bundle it holds (:attr:`LocationCase.fixed_slot_allowance`, :attr:`LocationCase.fixed_slot_budget_pct`).
FIXED_SLOT_METHOD = "Edit-local window"


@dataclass(frozen=True)
class LocationCase:
    """One cell of one source: an :class:`~sur_lab.edits.EditedContext` and what the runner and tables need.

    Attributes:
        case_id: ``"{dataset}/{source_id}/{side}-{tail}"``.
        source: the source (example, geometry, segments).
        side: evidence side, ``"upstream"`` or ``"downstream"``.
        tail: ``"short"`` or ``"long"``.
        edit: the edit: ``original_ids`` = head, lead, upstream slot, deleted filler, downstream slot, tail
            [, extension]; ``prefix_len`` = p, ``deleted_len`` = d, ``suffix_len`` = S; ``query_ids`` the query.
    """

    case_id: str
    source: LocationSource
    side: str
    tail: str
    edit: EditedContext = field(repr=False, compare=False)

    @property
    def example(self) -> QAExample:
        return self.source.example

    @property
    def cell(self) -> str:
        """``"side/tail"``, e.g. ``"downstream/long"``."""
        return f"{self.side}/{self.tail}"

    @property
    def gold(self) -> tuple[str, ...]:
        """Gold answers for EM (the answer and its aliases; an IIRC bag of spans)."""
        return tuple(self.example.answers)

    @property
    def answer_ids(self) -> tuple[int, ...]:
        """The canonical answer's token ids for the gold NLL (:func:`sur_lab.analysis.endpoints.gold_nll`)."""
        return self.source.answer_ids

    @property
    def fixed_slot(self) -> tuple[int, int]:
        """The downstream exchange slot, suffix-local and half-open: ``(0, W)`` (the fixed-slot support)."""
        return (0, self.source.geometry.slot_width)

    @property
    def upstream_slot(self) -> tuple[int, int]:
        """The upstream exchange slot in absolute positions (original and edited context): ``(p - W, p)``."""
        g = self.source.geometry
        return (g.edit_index - g.slot_width, g.edit_index)

    @property
    def evidence_span(self) -> tuple[int, int]:
        """Absolute positions of the support passages (without filler) in the edited context ``p ⊕ s``."""
        start = self.upstream_slot[0] if self.side == "upstream" else self.source.geometry.edit_index
        return (start, start + self.source.evidence_tokens)

    @property
    def fixed_slot_allowance(self) -> int:
        """B = W: run :data:`FIXED_SLOT_METHOD` (``"Edit-local window"``, suffix positions ``[0, B)``) with this exact
        allowance (``AllocationRequest(..., allowance=W)``) to refresh exactly the downstream slot."""
        return self.source.geometry.slot_width

    @property
    def fixed_slot_budget_pct(self) -> float:
        """The budget b whose Eq. 3 allowance is exactly W at this case's S (:func:`sur_lab.budget.
        budget_for_allowance`: 50 % of S_short, W / S_long), for dispatchers that take a budget; the same interval and
        token count in both side conditions."""
        return budget_for_allowance(self.edit.suffix_len, self.source.geometry.slot_width)

    @property
    def meta(self) -> dict[str, Any]:
        """Flat scalars copied into every sweep record (the runner records p, d, S and the gold answers itself)."""
        g = self.source.geometry
        up, down = ("evidence", "control") if self.side == "upstream" else ("control", "evidence")
        ev0, ev1 = self.evidence_span
        return {
            "dataset": self.example.dataset,
            "source_id": self.example.id,
            "cell": self.cell,
            "side": self.side,
            "tail": self.tail,
            "geometry": g.label,
            "geometry_index": self.source.candidate,
            "slot_width": g.slot_width,
            "edit_index": g.edit_index,
            "upstream_slot_role": up,
            "downstream_slot_role": down,
            "fixed_slot_start": 0,
            "fixed_slot_end": g.slot_width,
            "fixed_slot_allowance": g.slot_width,
            "fixed_slot_budget_pct": self.fixed_slot_budget_pct,
            "evidence_start": ev0,
            "evidence_end": ev1,
            "evidence_tokens": self.source.evidence_tokens,
            "n_support": len(self.example.supporting),
            "control_docs": len(self.source.control_titles),
            "control_tokens": self.source.control_tokens,
            "answer_type": self.example.answer_type,
            "canonical_answer": self.example.answer,
            "answer_len": len(self.answer_ids),
            "query_len": int(self.edit.query_ids.numel()),
        }


def build_cell(tokenizer, source: LocationSource, side: str, tail: str) -> LocationCase:
    """The edit of one cell, built by :func:`sur_lab.edits.segment_edit` from the source's segments and checked.

    The check is exact: the edit's ids are the planned segment ids, ``p``, ``d`` and ``S`` are the geometry's, the
    slots hold the planned contents, and the rendered chat prompt is the segments' text.

    Raises:
        ValueError: naming ``side``/``tail`` when unknown.
        RuntimeError: if the edit differs from the plan (a construction bug).
    """
    prefix, deleted, suffix = source.regions(side, tail)
    g = source.geometry
    documents = "".join(s.text for s in [*prefix[1:], *deleted, *suffix])
    pre, query, doc_start, containers = render_chat(
        tokenizer, documents[:-2], source.example.question, instruction=source.instruction
    )
    if pre[:doc_start] != source.head.text or query != "\n\n" + source.query_text:
        raise RuntimeError(f"{source.source_key}: the chat template renders another head or query for this cell")
    # The user message now also holds the blank line that closes the documents.
    containers = tuple((a, b + 2 if b == len(pre) else b, kind) for a, b, kind in containers)
    edit = segment_edit(
        tokenizer,
        [s.text for s in prefix],
        [s.text for s in deleted],
        [s.text for s in suffix],
        source.query_text,
        question=source.example.question,
        containers=containers,
    )
    planned = [i for s in (*prefix, *deleted, *suffix) for i in s.ids]
    if edit.original_ids.tolist() != planned:
        raise RuntimeError(f"{source.source_key} {side}/{tail}: segment_edit's ids differ from the planned segments")
    if (edit.prefix_len, edit.deleted_len, edit.suffix_len) != (g.edit_index, g.deletion, g.suffix_len(tail)):
        raise RuntimeError(f"{source.source_key} {side}/{tail}: p, d, S = {edit.prefix_len}, {edit.deleted_len}, "
                           f"{edit.suffix_len}; planned {g.edit_index}, {g.deletion}, {g.suffix_len(tail)}")
    case_id = f"{source.source_key}/{side}-{tail}"
    return LocationCase(case_id, source, side, tail, edit)


def build_cells(tokenizer, source: LocationSource) -> list[LocationCase]:
    """The four cells of a source in :data:`CELLS` order, with the cross-cell invariants checked
    (:func:`check_cells`)."""
    cells = [build_cell(tokenizer, source, side, tail) for side, tail in CELLS]
    check_cells(cells)
    return cells


def check_cells(cells: Sequence[LocationCase]) -> None:
    """The exchange invariants of one source's four cells (appendix 10.1).

    Every cell has the same edit index, deletion width, slot width, query ids, answer ids and gold answers; within a
    tail condition the two cells have the same suffix length and the same token multiset, and the upstream slot of
    one is the downstream slot of the other.

    Raises:
        ValueError: naming ``cells`` when they are not the four cells of one source.
        RuntimeError: naming the invariant that fails.
    """
    if sorted((c.side, c.tail) for c in cells) != sorted(CELLS) or len({c.source.source_key for c in cells}) != 1:
        raise ValueError("cells must be the four cells (CELLS) of one source")
    first = cells[0]
    w = first.source.geometry.slot_width
    for c in cells:
        same = {
            "edit index": (c.edit.prefix_len, first.edit.prefix_len),
            "deletion width": (c.edit.deleted_len, first.edit.deleted_len),
            "slot width": (c.source.geometry.slot_width, w),
            "query": (c.edit.query_ids.tolist(), first.edit.query_ids.tolist()),
            "answer target": ((c.answer_ids, c.gold), (first.answer_ids, first.gold)),
        }
        for name, (a, b) in same.items():
            if a != b:
                raise RuntimeError(f"{c.case_id}: {name} differs from {first.case_id}")
    by = {(c.side, c.tail): c for c in cells}
    for tail in TAILS:
        up, down = by["upstream", tail].edit, by["downstream", tail].edit
        if up.suffix_len != down.suffix_len:
            raise RuntimeError(f"{tail} tail: suffix lengths differ")
        if Counter(up.original_ids.tolist()) != Counter(down.original_ids.tolist()):
            raise RuntimeError(f"{tail} tail: the token multisets differ")
        p = up.prefix_len
        if not (torch.equal(up.original_ids[p - w : p], down.suffix_ids[:w])
                and torch.equal(down.original_ids[p - w : p], up.suffix_ids[:w])):
            raise RuntimeError(f"{tail} tail: the slots are not exchanged")


@dataclass
class Panel:
    """The evidence-location panel: cases of every feasible source and the counted exclusions.

    Attributes:
        cases: four :class:`LocationCase` per feasible source, source-major, cells in :data:`CELLS` order.
        sources: the feasible sources in draw order (dataset by dataset).
        exclusions: the candidates no geometry could build.
        candidates: candidates examined per dataset (a preset with ``sources_per_dataset`` stops early).
    """

    cases: list[LocationCase]
    sources: list[LocationSource]
    exclusions: list[Exclusion]
    candidates: dict[str, int]

    def summary(self) -> pd.DataFrame:
        """One row per dataset: ``examined``, ``feasible``, ``excluded`` and the feasible sources per geometry."""
        labels = sorted({(s.candidate, s.geometry.label) for s in self.sources})
        rows = []
        for d, n in self.candidates.items():
            feasible = [s for s in self.sources if s.example.dataset == d]
            row = {"dataset": d, "examined": n, "feasible": len(feasible),
                   "excluded": sum(e.dataset == d for e in self.exclusions)}
            counts = Counter(s.geometry.label for s in feasible)
            row.update({f"geometry {label}": counts.get(label, 0) for _, label in labels})
            rows.append(row)
        return pd.DataFrame(rows)

    def exclusion_counts(self) -> pd.DataFrame:
        """Exclusions per dataset and reason (columns ``dataset``, ``reason``, ``sources``)."""
        counts = Counter((e.dataset, e.reason) for e in self.exclusions)
        return pd.DataFrame([{"dataset": d, "reason": r, "sources": k} for (d, r), k in sorted(counts.items())],
                            columns=["dataset", "reason", "sources"])


def build_panel(
    tokenizer,
    datasets: Sequence[str] = ("2wikimultihopqa", "hotpotqa", "iirc", "musique"),
    *,
    geometries: Sequence[Geometry] | str = "quarter",
    candidates_per_dataset: int | None = 100,
    sources_per_dataset: int | None = None,
    seed: int = 0,
    split: str = "dev",
    corpus: Sequence[Passage] | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
    also: Sequence = (),
) -> Panel:
    """Build the panel from the natural-QA candidate pool, by tokenization alone (appendix 10.1).

    Candidates: each dataset's eligible natural-QA sources (:func:`sur_lab.data.text.is_eligible`), in
    the order :func:`sur_lab.data.qa.select_sources` draws them with ``seed`` (so the first 100 are natural
    QA's 100 sources of that dataset), cut at ``candidates_per_dataset``. Each is built with
    :func:`~sur_lab.studies.evidence_location.sources.build_source`; the infeasible ones are excluded and counted;
    with ``sources_per_dataset`` the scan stops once that many are feasible (candidates after that are not
    examined).

    Args:
        tokenizer: the model's fast tokenizer with a chat template.
        datasets: dataset keys, in output order.
        geometries: a name of :data:`~sur_lab.studies.evidence_location.sources.GEOMETRIES` or a candidate list.
        candidates_per_dataset: size of the candidate pool per dataset (``None``: every eligible source).
        sources_per_dataset: stop after this many feasible sources per dataset (``None``: build every candidate).
        seed: source selection and per-source draws.
        split: ``"dev"`` (default); ``"test"`` reads held-out files (never tune on them).
        corpus: filler paragraphs (default: the shipped 2WikiMultiHopQA corpus).
        instruction: text before the documents.
        also: other models' tokenizers that must build a candidate too (their own geometry, checks and cells) for it
            to be feasible: the **common panel** of a pooled run (appendix 10.1), identical whichever of these
            models runs it, so every model's run holds the same sources even when ``sources_per_dataset`` stops the
            scan early. The cases are ``tokenizer``'s. An exclusion by one of them says so in its ``detail``.

    Returns:
        The :class:`Panel`.

    Raises:
        ValueError: naming ``datasets`` (unknown or repeated keys), ``candidates_per_dataset`` or
            ``sources_per_dataset`` (not an integer >= 1), ``geometries``; or when a dataset yields fewer feasible
            sources than ``sources_per_dataset`` (naming it, with the exclusion counts).
    """
    unknown = [d for d in datasets if d not in DATASETS]
    if not datasets or unknown or len(set(datasets)) != len(datasets):
        raise ValueError(f"datasets={list(datasets)!r} must be distinct keys of {DATASETS}")
    for name, value in (("candidates_per_dataset", candidates_per_dataset),
                        ("sources_per_dataset", sources_per_dataset)):
        if value is not None and (isinstance(value, bool) or int(value) != value or value < 1):
            raise ValueError(f"{name}={value!r} must be an integer >= 1 or None")
    candidates = _geometries(geometries)
    builder = _Builder(tokenizer, corpus if corpus is not None else _default_corpus())
    others = [_Builder(t, builder.corpus) for t in also]
    config = PanelConfig(seed=seed)
    sources: list[LocationSource] = []
    cases: list[LocationCase] = []
    exclusions: list[Exclusion] = []
    examined: dict[str, int] = {}
    for d in datasets:
        pool = [ex for ex in load_qa(d, split=split) if is_eligible(ex, config)]
        n = len(pool) if candidates_per_dataset is None else min(int(candidates_per_dataset), len(pool))
        examined[d] = 0
        feasible = 0
        for ex in select_sources(pool, n, seed):
            if sources_per_dataset is not None and feasible >= sources_per_dataset:
                break
            examined[d] += 1
            built = _build_source(builder, ex, candidates, seed, instruction)
            if isinstance(built, Exclusion):
                exclusions.append(built)
                continue
            try:
                cells = build_cells(tokenizer, built)
            except ValueError as err:  # segment_edit refusing a segment is a tokenization failure of this source
                exclusions.append(Exclusion(d, ex.id, REASONS[6], str(err), (REASONS[6],)))
                continue
            refused = _refused_by_others(others, ex, candidates, seed, instruction)
            if refused is not None:
                exclusions.append(refused)
                continue
            sources.append(built)
            cases.extend(cells)
            feasible += 1
        if sources_per_dataset is not None and feasible < sources_per_dataset:
            counts = Counter(e.reason for e in exclusions if e.dataset == d)
            raise ValueError(f"sources_per_dataset={sources_per_dataset}: {d} has only {feasible} feasible sources "
                             f"among {examined[d]} candidates (exclusions: {dict(counts)})")
    return Panel(cases, sources, exclusions, examined)


def _refused_by_others(others: Sequence[_Builder], example: QAExample, candidates: tuple[Geometry, ...], seed: int,
                       instruction: str) -> Exclusion | None:
    """The exclusion of ``example`` by the first panel tokenizer of ``others`` that cannot build it, else ``None``."""
    for k, other in enumerate(others, start=1):
        label = f"panel tokenizer {k} ({getattr(other.tok, 'name_or_path', '') or type(other.tok).__name__})"
        built = _build_source(other, example, candidates, seed, instruction)
        if isinstance(built, Exclusion):
            return Exclusion(example.dataset, example.id, built.reason, f"{label}: {built.detail}", built.reasons)
        try:
            build_cells(other.tok, built)
        except ValueError as err:
            return Exclusion(example.dataset, example.id, REASONS[6], f"{label}: {err}", (REASONS[6],))
    return None


def panel_tokenizers(names: Sequence[str], tokenizer=None) -> list:
    """The tokenizers of ``names`` (``params["panel_models"]``), without those equal to ``tokenizer`` (the run's own):
    an embedded model's from its package (:func:`sur_lab.models.embedded_tokenizer`), else ``AutoTokenizer`` on the
    hub id or local path. No weights are loaded.

    Raises:
        ValueError: naming ``names`` when it is not a list of non-empty strings.
    """
    if isinstance(names, str) or not all(isinstance(n, str) and n.strip() for n in names):
        raise ValueError(f"names={names!r} must be a list of model names (embedded names, hub ids or local paths)")
    out = []
    for name in names:
        if embedded_model(name) is not None:
            tok = embedded_tokenizer(name)
        else:
            tok = AutoTokenizer.from_pretrained(name)
        if tokenizer is not None and type(tok) is type(tokenizer) and tok.get_vocab() == tokenizer.get_vocab():
            continue  # the run's own tokenizer: its panel checks it already
        out.append(tok)
    return out


def sweep_cases(cases: Sequence[LocationCase]) -> list:
    """The cases as :class:`sur_lab.sweeps.Case` objects (``meta`` = :attr:`LocationCase.meta`,
    ``gold`` = the example's answers). The fixed-slot refresh's allowance is per case (``meta["fixed_slot_allowance"]``,
    ``meta["fixed_slot_budget_pct"]``)."""
    return [Case(c.case_id, c.edit, gold=c.gold, meta=c.meta) for c in cases]


def sweep_cases_of(location_cases: Sequence[LocationCase]) -> list:
    """:func:`sweep_cases` with each case's canonical answer as its answer target (``gold_nll``, ``gold_margin``)."""
    return [replace(sc, answer_ids=c.answer_ids) for sc, c in zip(sweep_cases(location_cases), location_cases)]
