"""Matched evidence-location experiment: cases that exchange evidence across a fixed deletion (appendix 10.1).

Each *source* (a natural-QA question) yields four cases with one fixed edit geometry: slot width W, edit index p
(tokens before the deleted span, chat head included), deletion width d, and a retained suffix of S_short or S_long
tokens. The context, token for token::

    head | lead filler (p - W - |head|) | upstream slot (W) ‖ deleted filler (d) ‖ downstream slot (W) | tail | [ext]
    └──────────────────── prefix, p tokens ──────────────┘                     └──── suffix, S tokens ────────────┘

- the **evidence bundle** (every annotated supporting passage of the source, untruncated, in dataset order) and the
  **control bundle** (one to four of the source's own non-supporting documents, as many as it has supporting ones,
  that fit) are each extended to exactly W tokens by whole natural-text chunks (2WikiMultiHopQA corpus paragraphs)
  and then the neutral padding family (:func:`neutral_padding`);
- the two bundles fill the **exchange slots** immediately before and after the deletion: evidence *upstream* (in the
  valid prefix, control downstream) or *downstream* (in the stale suffix, control upstream);
- the suffix continues with a **neutral tail** of ``S_short - W`` filler tokens; the *long* cells append a tail
  extension of ``S_long - S_short`` filler tokens (whole chunks, then padding), crossing the exchange.

So within a tail condition the exchange holds the edit index, deletion width, slot width, suffix length, token
multiset, query and answer target fixed; the tail contrast changes filler, stale-state volume and evidence-to-query
distance together (appendix 10.1). Cells are named ``upstream/short``, ``downstream/short``, ``upstream/long``,
``downstream/long`` (:data:`CELLS`).

**Geometry** is chosen per source from a fixed candidate list by tokenization alone, before any model runs: the first
candidate whose slot holds the evidence bundle and at least one control document, and whose construction passes every
check. The paper's list is :data:`GEOMETRIES` ``["paper"]`` (d = 256); ``"half"`` and ``"quarter"`` scale every
width (d included) for small models and CPU runs.

**Checks before execution** (:func:`check_source`): every segment round-trips through the tokenizer on its own and the
edit's ids are exactly the planned segment ids (boundary tokenization: sur_lab edits are token segments,
:mod:`sur_lab.edits`); widths are exact; no inserted non-evidence content (control documents, filler chunks,
padding, deleted span, tail) contains a normalised answer alias or a support title as whole words; no inserted
content holds a special-token id. A source that cannot be built is **excluded and counted** with its reason
(:class:`Exclusion`); no decision reads a model output.

Choices the paper leaves open, fixed here (all before any model output): filler chunks are drawn per source from a
generator seeded by ``(seed, crc32("dataset/id"))`` (:func:`sur_lab.data.text.source_rng`) and taken
first-fit in that order while one of the next :data:`MAX_FILL_SKIPS` candidates fits and at least
:data:`MIN_FILL_TOKENS` tokens remain, then padded; answer aliases are checked for span and number answers (a yes/no
gold says nothing about a passage), as natural QA does; the query is the chat template's ``Question: ...`` turn
tail, and the blank line before it closes the last document segment. ``docs/studies/evidence_location.md`` has the
design, geometry and exclusion rules.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from sur_lab.analysis.decisions import Family, Margin, PowerBasis, PowerDesign, sd_from_interval
from sur_lab.analysis.endpoints import canonical_answer_ids
from sur_lab.analysis.scoring import normalize_answer
from sur_lab.analysis.stats import SIDES, TAILS
from sur_lab.budget import budget_for_allowance
from sur_lab.edits import DEFAULT_INSTRUCTION, EditedContext, render_chat, segment_edit
from sur_lab.data.qa import DATASETS, Passage, QAExample, load_corpus, load_qa, select_sources
from sur_lab.data.text import PanelConfig, is_eligible, source_rng
from sur_lab.studies.base import Report, Study

#: The four cells (evidence side, neutral tail) in the paper's order.
CELLS = (("upstream", "short"), ("downstream", "short"), ("upstream", "long"), ("downstream", "long"))
#: The pooled secondary family corrected by Holm (appendix 10.2); the primary hypothesis is the NLL side contrast.
SECONDARY_FAMILY = ("NLL tail", "NLL interaction", "EM side", "EM tail", "EM interaction")
#: The primary's equivalence margin (issue 36): "the NLL side contrast is null" is claimed only when its 90 % source
#: bootstrap interval lies inside ±0.1 nats (TOST at 5 %).
NLL_SIDE_MARGIN = Margin(0.1, "±0.1 nats holds the paper's own Table 15 interval for this contrast, -0.099 to 0.021 "
                              "(half-width 0.06 nats); issue 36")
#: The declared families of notebook 08's findings (issue 36; :mod:`sur_lab.analysis.decisions`): the preregistered
#: primary tested alone with its margin, the secondary family with Holm (:func:`table15`), and the fixed slot's
#: side effects on the Table 16 fidelity endpoints with Holm.
PRIMARY_FAMILY = Family("primary: NLL side (preregistered)", "continuous",
                        "complete replay's gold-NLL side contrast (Eq. 10), sources resampled; a null result needs "
                        "equivalence within the margin", primary=True, margin=NLL_SIDE_MARGIN)
#: The power statement's basis (issue 40; :data:`POWER`): the SD of one source's NLL side contrast, from the paper's
#: Table 15 interval (-0.039 nats, -0.099 to 0.021, over 275 sources with three models averaged per source;
#: :func:`~sur_lab.analysis.decisions.sd_from_interval`). One model's per-source contrast varies more, so the stated
#: MDE of a one-model run errs small.
PRIMARY_POWER = PowerBasis(sd_from_interval(-0.099, 0.021, 275),
                           "the paper's Table 15 NLL side interval, -0.099 to 0.021 nats over 275 sources",
                           unit="nats")
#: Sources a preset without ``sources_per_dataset`` yields, per candidate: the paper's 275 feasible of 400 (appendix
#: 10.1), for the power statement only (the run counts its own).
PAPER_FEASIBLE_SHARE = 275 / 400
SECONDARY = Family("secondary (Holm)", "continuous",
                   "complete replay's NLL tail and interaction and EM side, tail and interaction (appendix 10.2)")
FIXED_SLOT_FAMILY = Family("the fixed slot's side effects", "continuous",
                           "the fixed-slot refresh's side contrast on each Table 16 fidelity endpoint but the gold NLL")
#: The fixed slot "carries" complete replay's side effect on an endpoint when the paired side contrast of replay's
#: advantage minus the fixed slot's lies inside ± this share of replay's estimate (TOST on the paired difference,
#: issue 36). The paper's Table 16 fixed-slot estimates are within 4 % of replay's on every fidelity endpoint.
FIXED_SLOT_SHARE = 0.25
#: The one neutral padding family: this word cycle, joined by spaces and closed by a blank line
#: (:func:`neutral_padding`).
PAD_WORDS = ("the", "day", "went", "on", "as", "before", "and", "then", "time", "passed", "over", "quiet", "fields")
#: Filler: stop adding whole chunks when fewer tokens than this remain (the rest is padding).
MIN_FILL_TOKENS = 24
#: Filler: stop adding whole chunks after this many consecutive candidates that do not fit or are inadmissible.
MAX_FILL_SKIPS = 64
#: The fixed-slot refresh (appendix 10.3) is the edit-local window ``[0, B)`` at the exact allowance B = W: the
#: downstream exchange slot starts at suffix position 0, right after the deletion, so the window covers exactly the slot
#: whichever bundle it holds (:attr:`LocationCase.fixed_slot_allowance`, :attr:`LocationCase.fixed_slot_budget_pct`).
FIXED_SLOT_METHOD = "Edit-local window"
#: Control bundle size bounds (appendix 10.1: one to four native non-support documents).
MIN_CONTROL_DOCS, MAX_CONTROL_DOCS = 1, 4


@dataclass(frozen=True)
class Geometry:
    """One candidate edit geometry (appendix 10.1), in tokens.

    Attributes:
        slot_width: W, tokens of each exchange slot.
        edit_index: p, tokens before the deleted span (chat head, lead filler and the upstream slot).
        short_suffix: S_short, retained suffix tokens of the short-tail cells (downstream slot and tail).
        long_suffix: S_long, retained suffix tokens of the long-tail cells.
        deletion: d, deleted tokens.

    Raises:
        ValueError: (at construction) unless ``1 <= W``, ``W < p``, ``W < S_short < S_long`` and ``d >= 1``.
    """

    slot_width: int
    edit_index: int
    short_suffix: int
    long_suffix: int
    deletion: int

    def __post_init__(self) -> None:
        w, p, s, long_, d = self.slot_width, self.edit_index, self.short_suffix, self.long_suffix, self.deletion
        if not (1 <= w < p and w < s < long_ and d >= 1):
            raise ValueError(f"geometry {self} needs 1 <= slot_width < edit_index, slot_width < short_suffix < "
                             "long_suffix and deletion >= 1")

    @property
    def label(self) -> str:
        """``"W/p/S_short/S_long/d"``, e.g. ``"512/2048/1024/4096/256"``."""
        return f"{self.slot_width}/{self.edit_index}/{self.short_suffix}/{self.long_suffix}/{self.deletion}"

    def suffix_len(self, tail: str) -> int:
        """S for ``tail`` in :data:`sur_lab.analysis.stats.TAILS`."""
        if tail not in TAILS:
            raise ValueError(f"tail={tail!r} is not one of {TAILS}")
        return self.short_suffix if tail == "short" else self.long_suffix


_PAPER = ((512, 2048, 1024, 4096), (768, 3072, 1536, 4096), (1024, 4096, 2048, 4096))


def scaled_geometries(divisor: int) -> tuple[Geometry, ...]:
    """The paper's candidate list (:data:`GEOMETRIES` ``["paper"]``) with every width, d = 256 included, divided by
    ``divisor`` (2 or 4 give integers)."""
    if divisor not in (1, 2, 4):
        raise ValueError(f"divisor={divisor!r} must be 1, 2 or 4 (integer widths)")
    return tuple(Geometry(*(x // divisor for x in g), deletion=256 // divisor) for g in _PAPER)


#: Candidate lists by name, each tried in order. ``paper``: appendix 10.1 (N up to 8.4K tokens). ``half`` and
#: ``quarter``: every width / 2 or / 4, for the Qwen2.5-0.5B and SmolLM2 presets on a CPU (N up to 4.2K / 1.6K).
#: ``smoke``: one small geometry (W = 128, p = 256, S = 160 / 256, d = 32; N up to about 550 tokens), for the smoke
#: runs of notebooks 05 and 08: a plumbing check at a third of the quarter list's length, not the paper's ratios.
GEOMETRIES: dict[str, tuple[Geometry, ...]] = {
    "paper": scaled_geometries(1),
    "half": scaled_geometries(2),
    "quarter": scaled_geometries(4),
    "smoke": (Geometry(slot_width=128, edit_index=256, short_suffix=160, long_suffix=256, deletion=32),),
}

#: Study sizes (``sur_lab.studies.presets.resolve_preset``). ``candidates_per_dataset``: the fixed candidate pool drawn
#: per dataset from the natural-QA eligible sources (``None`` = all of them, in draw order); ``sources_per_dataset``:
#: stop after this many feasible sources per dataset (``None`` = every feasible candidate). Methods: the references,
#: the fixed-slot refresh (:data:`FIXED_SLOT_METHOD` at the exact allowance W) and the allocators at ``budgets`` (%).
#: ``smoke`` runs SmolLM2 on 2 sources at the one small ``smoke`` geometry, ``default`` the Qwen study model on 24 sources (issue 25's floor; quarter
#: geometry; the suite fans notebook 08 out over two Ray workers, its ``suite_parameters``; its quiet 2-core time is
#: not measured yet, and issue 25's note estimates it above the 30-minute share), ``paper`` the 400-candidate pool of natural QA with the
#: paper's geometry (275 feasible in the paper).
PRESETS = {
    "smoke": {"datasets": ["hotpotqa", "2wikimultihopqa"], "candidates_per_dataset": 100, "sources_per_dataset": 1,
              "geometry": "smoke", "references": ["Shift", "Replay", "Re-prefill"], "fixed_slot": True,
              "allocators": ["SUR"], "budgets": [5], "max_new_tokens": 4, "n_boot": 200},
    "default": {"datasets": ["2wikimultihopqa", "hotpotqa", "iirc", "musique"], "candidates_per_dataset": None,
                "sources_per_dataset": 6, "geometry": "quarter", "references": ["Shift", "Replay", "Re-prefill"],
                "fixed_slot": True, "allocators": ["SUR"], "budgets": [2, 5], "max_new_tokens": 16,
                "n_boot": 10_000},
    "paper": {"datasets": ["2wikimultihopqa", "hotpotqa", "iirc", "musique"], "candidates_per_dataset": 100,
              "sources_per_dataset": None, "geometry": "paper", "references": ["Shift", "Replay", "Re-prefill"],
              "fixed_slot": True,
              "allocators": ["SUR", "BM25 (same units)", "CacheBlend-Adapted", "InfoFlow-Motivated",
                             "ProphetKV-Adapted"],
              "budgets": [2, 5], "max_new_tokens": 64, "n_boot": 10_000},
}

# Answer types whose gold strings are protected (natural_qa's rule): yes/no and "none" answers are not checked.
_PROTECTED_TYPES = frozenset({"span", "spans", "number"})


# ---------------------------------------------------------------------------------------------------------------------
# Segments and regions


@dataclass(frozen=True)
class Segment:
    """One token segment: a text tokenized on its own.

    Attributes:
        text: the segment's text (documents end with their blank-line separator).
        ids: its token ids.
        kind: ``"head"``, ``"evidence"``, ``"control"``, ``"chunk"`` (a corpus paragraph) or ``"pad"`` (neutral
            padding).
        title: the document title for evidence, control and chunk segments (``""`` otherwise).
    """

    text: str
    ids: tuple[int, ...] = field(repr=False)
    kind: str
    title: str = ""

    def __len__(self) -> int:
        return len(self.ids)


def _width(segments: Iterable[Segment]) -> int:
    return sum(len(s) for s in segments)


class Infeasible(Exception):
    """A source's exact construction is impossible at a geometry (carries the exclusion reason)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


#: Exclusion reasons, in the order the construction meets them.
REASONS = (
    "no admissible native control document",
    "special token in the evidence",
    "head wider than the edit index",
    "evidence wider than the slot",
    "protected answer string in inserted content",
    "special token in inserted content",
    "boundary tokenization",
)


def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special tokens: ``all_special_ids`` and every added token marked special."""
    ids = set(int(i) for i in tokenizer.all_special_ids)
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids |= {int(i) for i, tok in decoder.items() if getattr(tok, "special", False)}
    return frozenset(ids)


def _needles(example: QAExample) -> tuple[str, ...]:
    if example.answer_type not in _PROTECTED_TYPES:
        return ()
    return tuple(sorted({n for n in (normalize_answer(a) for a in example.answers) if n}))


def _support_titles(example: QAExample) -> tuple[str, ...]:
    return tuple(sorted({n for n in (normalize_answer(p.title) for p in example.supporting) if n}))


def protected_strings(example: QAExample) -> tuple[str, ...]:
    """Normalised strings no inserted non-evidence content may contain as whole words: the answer and its aliases
    (span and number answers) and the support titles (:func:`sur_lab.analysis.scoring.normalize_answer`)."""
    return tuple(sorted(set(_needles(example)) | set(_support_titles(example))))


def _contains(text: str, needles: Sequence[str]) -> str | None:
    padded = f" {normalize_answer(text)} "
    return next((n for n in needles if f" {n} " in padded), None)


def neutral_padding(tokenizer, k: int) -> str:
    """The neutral padding of exactly ``k`` tokens: ``k - 1`` words of :data:`PAD_WORDS` (cycled, space-separated)
    and a closing blank line; ``""`` for k = 0.

    Raises:
        ValueError: naming ``k`` when negative; naming ``tokenizer`` when the text does not tokenize to exactly k
            tokens (a padding word that is not one token).
    """
    if int(k) != k or k < 0:
        raise ValueError(f"k={k!r} must be an integer >= 0")
    if k == 0:
        return ""
    text = " ".join(PAD_WORDS[i % len(PAD_WORDS)] for i in range(k - 1)) + "\n\n"
    n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    if n != k:
        raise ValueError(f"tokenizer splits the neutral padding of {k} tokens into {n}; PAD_WORDS must be single "
                         "tokens for it")
    return text


def _block(title: str, text: str) -> str:
    """A document block as :func:`sur_lab.edits.format_passages` writes it, with its blank-line separator."""
    return f"Title: {title}\n{text.strip()}\n\n"


class _Builder:
    """Tokenizes segments (with a cache for corpus chunks) and checks them; one per tokenizer and panel."""

    def __init__(self, tokenizer, corpus: Sequence[Passage]) -> None:
        self.tok = tokenizer
        self.corpus = corpus
        self.special = special_token_ids(tokenizer)
        self._chunks: dict[int, Segment] = {}

    def segment(self, text: str, kind: str, title: str = "") -> Segment:
        ids = tuple(int(i) for i in self.tok(text, add_special_tokens=False)["input_ids"])
        back = self.tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if back != text:
            raise Infeasible("boundary tokenization", f"{kind} segment {text[:40]!r} does not round-trip")
        return Segment(text, ids, kind, title)

    def chunk(self, index: int) -> Segment | None:
        if index not in self._chunks:
            p = self.corpus[index]
            try:
                self._chunks[index] = self.segment(_block(p.title, p.text), "chunk", p.title)
            except Infeasible:
                self._chunks[index] = None  # type: ignore[assignment]
        return self._chunks[index]

    def has_special(self, seg: Segment) -> bool:
        return any(i in self.special for i in seg.ids)

    def pad(self, k: int) -> list[Segment]:
        return [self.segment(neutral_padding(self.tok, k), "pad")] if k else []


# ---------------------------------------------------------------------------------------------------------------------
# Sources


@dataclass(frozen=True)
class LocationSource:
    """One feasible source: its geometry and every region's segments, shared by its four cells.

    Attributes:
        example: the QA example.
        geometry: the chosen :class:`Geometry`.
        candidate: index of ``geometry`` in the candidate list (0 = narrowest).
        head: the chat head (template, system message, instruction) up to the documents.
        lead: filler between the head and the upstream slot (``p - W - |head|`` tokens).
        evidence: the evidence slot content: support passages, filler chunks, padding (W tokens).
        control: the control slot content: control documents, filler chunks, padding (W tokens).
        deleted: the deleted filler (d tokens).
        tail: the neutral tail after the downstream slot (``S_short - W`` tokens).
        extension: the long cells' tail extension (``S_long - S_short`` tokens).
        query_text: text processed after the cache: ``"Question: {q}"`` and the template's turn tail.
        answer_ids: the canonical answer's token ids (:func:`sur_lab.analysis.endpoints.canonical_answer_ids`).
        instruction: text before the documents in the user message.
    """

    example: QAExample
    geometry: Geometry
    candidate: int
    head: Segment
    lead: tuple[Segment, ...]
    evidence: tuple[Segment, ...]
    control: tuple[Segment, ...]
    deleted: tuple[Segment, ...]
    tail: tuple[Segment, ...]
    extension: tuple[Segment, ...]
    query_text: str
    answer_ids: tuple[int, ...]
    instruction: str = DEFAULT_INSTRUCTION

    @property
    def source_key(self) -> str:
        return f"{self.example.dataset}/{self.example.id}"

    @property
    def evidence_tokens(self) -> int:
        """Tokens of the support passages alone (without their filler and padding)."""
        return _width(s for s in self.evidence if s.kind == "evidence")

    @property
    def control_tokens(self) -> int:
        return _width(s for s in self.control if s.kind == "control")

    @property
    def control_titles(self) -> tuple[str, ...]:
        return tuple(s.title for s in self.control if s.kind == "control")

    def slots(self, side: str) -> tuple[tuple[Segment, ...], tuple[Segment, ...]]:
        """``(upstream slot, downstream slot)`` contents when the evidence is on ``side``."""
        if side not in SIDES:
            raise ValueError(f"side={side!r} is not one of {SIDES}")
        return (self.evidence, self.control) if side == "upstream" else (self.control, self.evidence)

    def regions(self, side: str, tail: str) -> tuple[list[Segment], list[Segment], list[Segment]]:
        """``(prefix, deleted, suffix)`` segments of one cell."""
        if tail not in TAILS:
            raise ValueError(f"tail={tail!r} is not one of {TAILS}")
        up, down = self.slots(side)
        suffix = [*down, *self.tail, *(self.extension if tail == "long" else ())]
        return [self.head, *self.lead, *up], list(self.deleted), suffix


def _choose_controls(builder: _Builder, example: QAExample, rng: np.random.Generator, width: int) -> list[Segment]:
    """Up to ``min(4, max(1, #supporting))`` admissible native non-supporting documents that fit in ``width``."""
    protected = protected_strings(example)
    support_titles = {p.title for p in example.supporting}
    texts = {p.text.strip() for p in example.supporting}
    native = [p for p in example.distractors
              if p.text.strip() and p.title not in support_titles and p.text.strip() not in texts
              and _contains(f"{p.title} {p.text}", protected) is None]
    target = min(MAX_CONTROL_DOCS, max(MIN_CONTROL_DOCS, len(example.supporting)))
    chosen: list[Segment] = []
    seen: set[str] = set()
    used = 0
    for i in rng.permutation(len(native)):
        p = native[int(i)]
        if len(chosen) == target:
            break
        if p.text.strip() in seen:
            continue
        seg = builder.segment(_block(p.title, p.text), "control", p.title)
        if builder.has_special(seg) or used + len(seg) > width:
            continue
        chosen.append(seg)
        seen.add(p.text.strip())
        used += len(seg)
    return chosen


def _fill(builder: _Builder, width: int, order: np.ndarray, state: dict, protected: Sequence[str],
          used_titles: set[str]) -> list[Segment]:
    """Whole corpus chunks (first-fit along ``order`` from ``state["next"]``), then padding: exactly ``width``."""
    out: list[Segment] = []
    remaining = width
    skips = 0
    while remaining >= MIN_FILL_TOKENS and skips < MAX_FILL_SKIPS and state["next"] < len(order):
        index = int(order[state["next"]])
        state["next"] += 1
        seg = builder.chunk(index)
        p = builder.corpus[index]
        if (seg is None or len(seg) > remaining or p.title in used_titles or not p.text.strip()
                or builder.has_special(seg) or _contains(f"{p.title} {p.text}", protected) is not None):
            skips += 1
            continue
        skips = 0
        out.append(seg)
        used_titles.add(p.title)
        remaining -= len(seg)
    return out + builder.pad(remaining)


def _head_and_query(tokenizer, question: str, instruction: str) -> tuple[str, str]:
    """The chat head before the documents and the query text after them (the blank line moves to the documents)."""
    pre, query, doc_start, _ = render_chat(tokenizer, "DOCUMENTS", question, instruction=instruction)
    if not query.startswith("\n\n"):
        raise ValueError("render_chat's query no longer starts with a blank line; the segment layout needs it")
    return pre[:doc_start], query[2:]


def _build_at(builder: _Builder, example: QAExample, geometry: Geometry, candidate: int, seed: int,
              instruction: str) -> LocationSource:
    """Build one source at one geometry or raise :class:`Infeasible`."""
    tok = builder.tok
    rng = source_rng(example, seed)
    w = geometry.slot_width
    controls = _choose_controls(builder, example, rng, w)
    if len(controls) < MIN_CONTROL_DOCS:
        raise Infeasible(REASONS[0], f"{len(example.distractors)} native distractors, none admissible within W={w}")
    evidence_docs = [builder.segment(_block(p.title, p.text), "evidence", p.title) for p in example.supporting]
    if any(builder.has_special(s) for s in evidence_docs):
        raise Infeasible(REASONS[1])
    head_text, query_text = _head_and_query(tok, example.question, instruction)
    head = builder.segment(head_text, "head")
    lead_width = geometry.edit_index - w - len(head)
    if lead_width < 0:
        raise Infeasible(REASONS[2], f"head {len(head)} + W {w} > p {geometry.edit_index}")
    if _width(evidence_docs) > w:
        raise Infeasible(REASONS[3], f"{_width(evidence_docs)} > W={w}")
    protected = protected_strings(example)
    used = {p.title for p in example.supporting} | {s.title for s in controls}
    order = rng.permutation(len(builder.corpus))
    state = {"next": 0}
    evidence = (*evidence_docs, *_fill(builder, w - _width(evidence_docs), order, state, protected, used))
    control = (*controls, *_fill(builder, w - _width(controls), order, state, protected, used))
    lead = tuple(_fill(builder, lead_width, order, state, protected, used))
    deleted = tuple(_fill(builder, geometry.deletion, order, state, protected, used))
    tail = tuple(_fill(builder, geometry.short_suffix - w, order, state, protected, used))
    extension = tuple(_fill(builder, geometry.long_suffix - geometry.short_suffix, order, state, protected, used))
    answer = canonical_answer_ids(tok, example.answer, query_text)
    source = LocationSource(example, geometry, candidate, head, lead, evidence, control, deleted, tail, extension,
                            query_text, tuple(answer), instruction)
    check_source(source, builder)
    return source


def check_source(source: LocationSource, builder: _Builder | None = None) -> None:
    """Content checks of one source before execution (appendix 10.1).

    Every region has its planned width; no segment other than the evidence passages (control documents, chunks,
    padding, deleted span, tail) contains a protected string (:func:`protected_strings`) as whole words; no segment
    other than the chat head holds a special-token id.

    Raises:
        Infeasible: with the failing check's reason (:data:`REASONS`).
        RuntimeError: if a region's width differs from the geometry (a construction bug, never a source property).
    """
    g = source.geometry
    widths = {
        "head + lead + slot": (len(source.head) + _width(source.lead) + g.slot_width, g.edit_index),
        "evidence slot": (_width(source.evidence), g.slot_width),
        "control slot": (_width(source.control), g.slot_width),
        "deleted": (_width(source.deleted), g.deletion),
        "tail": (g.slot_width + _width(source.tail), g.short_suffix),
        "extension": (g.slot_width + _width(source.tail) + _width(source.extension), g.long_suffix),
    }
    for name, (got, want) in widths.items():
        if got != want:
            raise RuntimeError(f"{source.source_key}: {name} is {got} tokens, planned {want}")
    protected = protected_strings(source.example)
    regions = (source.lead, source.evidence, source.control, source.deleted, source.tail, source.extension)
    special = builder.special if builder is not None else None
    for seg in (s for region in regions for s in region):
        if seg.kind != "evidence":
            hit = _contains(seg.text, protected)
            if hit is not None:
                raise Infeasible(REASONS[4], f"{seg.kind} segment {seg.title or seg.text[:30]!r} contains {hit!r}")
        if special is not None and any(i in special for i in seg.ids):
            raise Infeasible(REASONS[5], f"{seg.kind} segment {seg.title or seg.text[:30]!r}")


@dataclass(frozen=True)
class Exclusion:
    """A candidate source that no geometry could build.

    Attributes:
        dataset, source_id: the source.
        reason: the reason at the widest candidate geometry (one of :data:`REASONS`).
        detail: what failed there.
        reasons: the reason at each candidate geometry, narrowest first.
    """

    dataset: str
    source_id: str
    reason: str
    detail: str
    reasons: tuple[str, ...]


def build_source(
    tokenizer,
    example: QAExample,
    geometries: Sequence[Geometry] | str = "quarter",
    *,
    seed: int = 0,
    corpus: Sequence[Passage] | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
) -> LocationSource | Exclusion:
    """Build one source at the first feasible geometry of the candidate list, by tokenization alone.

    Args:
        tokenizer: the model's fast tokenizer with a chat template.
        example: a natural-QA source (:func:`sur_lab.data.text.is_eligible`).
        geometries: a name of :data:`GEOMETRIES` or a sequence of :class:`Geometry`, tried in order.
        seed: seeds each source's control and filler draws (with the source's id).
        corpus: filler paragraphs (default: :func:`sur_lab.data.qa.load_corpus`).
        instruction: text before the documents.

    Returns:
        The :class:`LocationSource`, or an :class:`Exclusion` when no candidate is feasible.

    Raises:
        ValueError: naming ``geometries`` when unknown or empty.
    """
    builder = _Builder(tokenizer, corpus if corpus is not None else _default_corpus())
    return _build_source(builder, example, _geometries(geometries), seed, instruction)


def _build_source(builder: _Builder, example: QAExample, candidates: tuple[Geometry, ...], seed: int,
                  instruction: str) -> LocationSource | Exclusion:
    failures: list[Infeasible] = []
    for i, g in enumerate(candidates):
        try:
            return _build_at(builder, example, g, i, seed, instruction)
        except Infeasible as err:
            failures.append(err)
    last = failures[-1]
    return Exclusion(example.dataset, example.id, last.reason, last.detail, tuple(f.reason for f in failures))


def _geometries(geometries: Sequence[Geometry] | str) -> tuple[Geometry, ...]:
    if isinstance(geometries, str):
        if geometries not in GEOMETRIES:
            raise ValueError(f"geometries={geometries!r} is not one of {sorted(GEOMETRIES)}")
        return GEOMETRIES[geometries]
    out = tuple(geometries)
    if not out or not all(isinstance(g, Geometry) for g in out):
        raise ValueError("geometries must be a name of GEOMETRIES or a non-empty sequence of Geometry")
    return out


@functools.lru_cache(maxsize=1)
def _default_corpus() -> tuple[Passage, ...]:
    return tuple(load_corpus())


# ---------------------------------------------------------------------------------------------------------------------
# Cases


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
    QA's 100 sources of that dataset), cut at ``candidates_per_dataset``. Each is built with :func:`build_source`;
    the infeasible ones are excluded and counted; with ``sources_per_dataset`` the scan stops once that many are
    feasible (candidates after that are not examined).

    Args:
        tokenizer: the model's fast tokenizer with a chat template.
        datasets: dataset keys, in output order.
        geometries: a name of :data:`GEOMETRIES` or a candidate list.
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
    from sur_lab.models import embedded_model, embedded_tokenizer

    if isinstance(names, str) or not all(isinstance(n, str) and n.strip() for n in names):
        raise ValueError(f"names={names!r} must be a list of model names (embedded names, hub ids or local paths)")
    out = []
    for name in names:
        if embedded_model(name) is not None:
            tok = embedded_tokenizer(name)
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(name)
        if tokenizer is not None and type(tok) is type(tokenizer) and tok.get_vocab() == tokenizer.get_vocab():
            continue  # the run's own tokenizer: its panel checks it already
        out.append(tok)
    return out


def sweep_cases(cases: Sequence[LocationCase]) -> list:
    """The cases as :class:`sur_lab.sweeps.Case` objects (``meta`` = :attr:`LocationCase.meta`,
    ``gold`` = the example's answers). The fixed-slot refresh's allowance is per case (``meta["fixed_slot_allowance"]``,
    ``meta["fixed_slot_budget_pct"]``)."""
    from sur_lab.sweeps import Case

    return [Case(c.case_id, c.edit, gold=c.gold, meta=c.meta) for c in cases]


# ---------------------------------------------------------------------------------------------------------------------
# Tables 15-16 (pure: long tables in, tables out)

#: Columns that identify one source-model unit and one cell in a results table.
UNIT_KEYS = ("model", "dataset", "source_id")
CELL_KEYS = (*UNIT_KEYS, "side", "tail")


def em_stratum(table: pd.DataFrame, *, reference: str = "Re-prefill", correct_col: str = "em",
               method_col: str = "method") -> pd.DataFrame:
    """The EM secondary's stratum (appendix 10.2): rows of the source-model units whose clean reference answers
    correctly in all four cells. Not conditioned on Shift failing.

    Args:
        table: long table, one row per (model, dataset, source_id, side, tail, method).
        reference: the clean reference method.
        correct_col: bool EM column.
        method_col: method column.

    Returns:
        The rows of ``table`` whose unit qualifies (all methods), a new DataFrame.

    Raises:
        ValueError: naming ``reference`` when absent, or ``table`` when a column is missing.
    """
    missing = [c for c in (*CELL_KEYS, correct_col, method_col) if c not in table.columns]
    if missing:
        raise ValueError(f"table lacks columns {missing}")
    ref = table[table[method_col] == reference]
    if ref.empty:
        raise ValueError(f"reference={reference!r} has no rows in table[{method_col!r}]")
    per_unit = ref.groupby(list(UNIT_KEYS))[correct_col].agg(["all", "size"])
    keep = per_unit[(per_unit["all"].astype(bool)) & (per_unit["size"] == len(CELLS))].index
    idx = pd.MultiIndex.from_frame(table[list(UNIT_KEYS)])
    return table[idx.isin(keep)].copy()


def contrast_table(advantages: dict[str, pd.DataFrame], *, value_col: str = "g", scale: dict[str, float] | None = None,
                   n_boot: int = 10_000, seed: int | None = None) -> pd.DataFrame:
    """Eq. 10-12 with source-bootstrap intervals for several endpoints (:func:`sur_lab.analysis.stats.
    factorial_bootstrap`).

    Args:
        advantages: ``{label: frame}``, each frame one row per (model, dataset, source_id, side, tail) with the cell's
            repair advantage in ``value_col`` (:func:`sur_lab.analysis.stats.method_difference`; e.g. ``"NLL"`` =
            NLL_Shift - NLL_Replay, ``"EM"`` = EM_Replay - EM_Shift on :func:`em_stratum`).
        value_col: the advantage column.
        scale: multiplier per label for presentation (100 for EM in percentage points); default 1.
        n_boot: replicates. seed: generator seed (default appendix 8.3's).

    Returns:
        One row per (label, contrast): ``endpoint``, ``contrast``, ``estimate``, ``low``, ``high`` (95 %),
        ``tost_low``, ``tost_high`` (90 %: the equivalence test's interval), ``p`` (two-sided bootstrap p, never
        below :func:`sur_lab.analysis.decisions.p_floor` of the sources: no exact test on n sources goes lower),
        ``n_sources`` (the resampled (dataset, source) units: a source carries its cells of every model), ``n_units``
        (the (model, dataset, source) units, e.g. 825 for the paper's three models on 275 sources),
        ``undefined_replicates``. A degenerate bootstrap (every replicate equal) has no interval (NaN: never a
        zero-width one). A frame without rows (e.g. an empty EM stratum) gives NaN rows with ``n_sources`` 0.
    """
    from sur_lab.analysis.decisions import ALPHA, bootstrap_p
    from sur_lab.analysis.stats import BOOTSTRAP_SEED, CONTRASTS, factorial_bootstrap

    rows = []
    nan = float("nan")
    for label, frame in advantages.items():
        k = (scale or {}).get(label, 1.0)
        if len(frame) == 0:
            rows.extend({"endpoint": label, "contrast": c, "estimate": nan, "low": nan, "high": nan, "tost_low": nan,
                         "tost_high": nan, "p": nan, "n_sources": 0, "n_units": 0, "undefined_replicates": 0}
                        for c in CONTRASTS)
            continue
        res = factorial_bootstrap(frame, value_col, n_boot=n_boot, seed=BOOTSTRAP_SEED if seed is None else seed)
        n_units = len(frame[list(UNIT_KEYS)].drop_duplicates())
        for contrast, r in res.items():
            finite = r.replicates[~np.isnan(r.replicates)]
            degenerate = finite.size == 0 or np.ptp(finite) == 0
            t_low, t_high = (np.percentile(finite, [100 * ALPHA, 100 * (1 - ALPHA)]) if not degenerate
                             else (nan, nan))
            rows.append({"endpoint": label, "contrast": contrast, "estimate": k * r.diff,
                         "low": nan if degenerate else k * r.low, "high": nan if degenerate else k * r.high,
                         "tost_low": k * t_low, "tost_high": k * t_high,
                         "p": bootstrap_p(finite, r.n_sources) if finite.size else nan, "n_sources": r.n_sources,
                         "n_units": n_units, "undefined_replicates": int(np.isnan(r.replicates).sum())})
    return pd.DataFrame(rows)


def table15(nll: pd.DataFrame, em: pd.DataFrame, *, value_col: str = "g", n_boot: int = 10_000,
            seed: int | None = None) -> pd.DataFrame:
    """Table 15: NLL (nats) and EM (percentage points) factorial effects with 95 % intervals and Holm p over the
    pooled secondary family :data:`SECONDARY_FAMILY`; the preregistered primary (NLL side) has no Holm p (NaN).
    An undefined member (an empty EM stratum) enters the correction with p = 1, so the family keeps its five
    hypotheses, and its own Holm p is NaN.

    Args:
        nll: per-cell ``NLL_Shift - NLL_Replay`` advantages of every complete source (see :func:`contrast_table`).
        em: per-cell ``EM_Replay - EM_Shift`` (0/1 differences) on the :func:`em_stratum` units.
        value_col, n_boot, seed: as :func:`contrast_table`.

    Returns:
        :func:`contrast_table`'s rows with ``hypothesis`` (e.g. ``"EM side"``) and ``holm_p``.
    """
    from sur_lab.analysis.stats import holm

    out = contrast_table({"NLL": nll, "EM": em}, value_col=value_col, scale={"EM": 100.0}, n_boot=n_boot, seed=seed)
    out["hypothesis"] = out["endpoint"] + " " + out["contrast"]
    raw = {h: (1.0 if np.isnan(p) else float(p)) for h, p in zip(out["hypothesis"], out["p"])}
    adjusted = holm(raw, family=SECONDARY_FAMILY)
    out["holm_p"] = [adjusted.get(h, np.nan) if not np.isnan(p) else np.nan for h, p in zip(out["hypothesis"], out["p"])]
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The study (``sur-lab sweep evidence-location``, notebook 08): declarations on the Study base (issue 39)

NAME = "evidence-location"
NOTEBOOK = "08_evidence_location"
FOLDER = "08_evidence_location"
#: Parameters that are not preset sizes, at the notebook's defaults (the literals of its ``parameters`` cell).
FIXED = {"boot_seed": 20260928, "panel_models": []}
#: The record ``method`` of the fixed-slot refresh (:class:`FixedSlotRefresh`).
FIXED_SLOT_LABEL = "Fixed slot"
#: The complete suffix replay, the method Table 15's advantages are about.
COMPLETE_REPLAY = "Replay"


@dataclass(frozen=True)
class FixedSlotRefresh:
    """The fixed-slot refresh as a sweep method (:class:`sur_lab.sweeps.Method`): :data:`FIXED_SLOT_METHOD` at the
    exact allowance B = W, i.e. suffix positions ``[0, W)``, the downstream exchange slot (appendix 10.3).

    W is read from the case's edit: the candidate geometry whose edit index p, deletion d and one of whose suffix
    lengths match the edit (the candidates of a list have distinct p, so exactly one does). The same interval and
    token count are refreshed whichever bundle the slot holds. Records carry ``budget_pct`` NaN and
    ``allowance`` = W.

    Attributes:
        geometries: the candidate list the cases were built from.
        name: the record's ``method``; budget_pct: NaN (an exact allowance); protocol: ``"forward"``.
    """

    geometries: tuple[Geometry, ...]
    name: str = FIXED_SLOT_LABEL
    budget_pct: float = float("nan")
    protocol: str = "forward"

    def slot_width(self, edit: EditedContext) -> int:
        """W of the geometry ``edit`` was built at.

        Raises:
            ValueError: naming ``edit`` when no candidate geometry (or more than one slot width) matches its p, d, S.
        """
        widths = {g.slot_width for g in self.geometries
                  if g.edit_index == edit.prefix_len and g.deletion == edit.deleted_len
                  and edit.suffix_len in (g.short_suffix, g.long_suffix)}
        if len(widths) != 1:
            raise ValueError(f"edit (p={edit.prefix_len}, d={edit.deleted_len}, S={edit.suffix_len}) matches "
                             f"{len(widths)} slot widths of the candidate geometries; it is not an evidence-location "
                             "cell of this list")
        return widths.pop()

    def repair(self, lm, prepared, *, executor: str, seed: int, options=None):
        """The edit-local window ``[0, W)`` through the one Algorithm 1 dispatcher (a new cache)."""
        from sur_lab.repair import repair

        return repair(lm, prepared, FIXED_SLOT_METHOD, None, executor=executor, seed=seed,
                      options=dict(options) if options else None, allowance=self.slot_width(prepared.edit))


def _power_sources(p: Mapping[str, Any]) -> int:
    """The sources of the power statement: ``sources_per_dataset`` per dataset, or the paper's feasible share
    (:data:`PAPER_FEASIBLE_SHARE`) of the candidates when every feasible source runs."""
    if p["sources_per_dataset"] is not None:
        return len(p["datasets"]) * int(p["sources_per_dataset"])
    return int(len(p["datasets"]) * (p["candidates_per_dataset"] or 0) * PAPER_FEASIBLE_SHARE)


def sweep_cases_of(location_cases: Sequence[LocationCase]) -> list:
    """:func:`sweep_cases` with each case's canonical answer as its answer target (``gold_nll``, ``gold_margin``)."""
    from dataclasses import replace

    return [replace(sc, answer_ids=c.answer_ids) for sc, c in zip(sweep_cases(location_cases), location_cases)]


#: The primary comparison's power design (issue 40): the study's ``mde`` and ``power_line`` (the
#: :class:`~sur_lab.studies.base.Study` base's) at its parameters.
POWER = PowerDesign("complete replay's NLL side contrast vs 0", PRIMARY_FAMILY, PRIMARY_POWER,
                    lambda p: _power_sources(p), what="sources")


class EvidenceLocationStudy(Study):
    """The preregistered evidence-location experiment (notebook 08): every cell x methods x budgets, answers scored by
    the dataset rules (:func:`sur_lab.sweeps.make_scorer`), every record with the endpoints of issue 25. No case is
    timed (the study measures quality and fidelity; answers come from batched passes). Its cases are a
    :class:`Panel` (four cells per feasible source, by tokenization alone); the sweep writes :data:`PANEL_FILE` beside
    the records."""

    name, notebook, folder_prefix = NAME, NOTEBOOK, FOLDER
    presets, fixed = PRESETS, FIXED
    folder_keys = {"data": lambda p: list(p["datasets"]), "cand": "candidates_per_dataset", "n": "sources_per_dataset",
                   "geom": "geometry", "fs": "fixed_slot", "b": "budgets", "tok": "max_new_tokens", "seed": "seed",
                   "eb": "eval_batch"}
    power, families = POWER, (PRIMARY_FAMILY, SECONDARY, FIXED_SLOT_FAMILY)

    def folder_tag(self, p: Mapping[str, Any], **run: Any) -> dict[str, Any]:
        """The base's entries, then ``pm`` (the sorted ``panel_models``) when the panel is a common one."""
        tag = super().folder_tag(p, **run)
        if p.get("panel_models"):
            tag["pm"] = sorted(p["panel_models"])
        return tag

    def cases(self, tokenizer, p: Mapping[str, Any], seed: int = 0) -> Panel:
        """The study's :class:`Panel` (:func:`build_panel`; by tokenization alone, before any model runs). With
        ``panel_models`` (a parameter) every listed model's tokenizer must build a source too: the common panel that
        several models' runs share (:func:`combine` pools them).

        Raises:
            ValueError: as :func:`build_panel`.
        """
        return build_panel(tokenizer, p["datasets"], geometries=p["geometry"],
                           candidates_per_dataset=p["candidates_per_dataset"],
                           sources_per_dataset=p["sources_per_dataset"], seed=seed,
                           also=panel_tokenizers(p["panel_models"], tokenizer))

    def sweep_cases(self, panel: Panel, p: Mapping[str, Any]) -> list:
        """Four :class:`sur_lab.sweeps.Case` per feasible source, with their answer targets (:func:`sweep_cases_of`)."""
        return sweep_cases_of(panel.cases)

    def scorer_for(self, panel: Panel):
        """The dataset rules of each cell's example (:func:`sur_lab.sweeps.make_scorer`)."""
        from sur_lab.sweeps import make_scorer

        return make_scorer(panel.cases)

    def methods(self, p: Mapping[str, Any]) -> list:
        """The sweep's methods for parameters ``p``: the references, the fixed-slot refresh (when ``p["fixed_slot"]``)
        and the allocators (each at ``p["budgets"]``).

        Raises:
            ValueError: naming ``geometry`` when unknown.
        """
        out: list = list(p["references"])
        if p["fixed_slot"]:
            out.append(FixedSlotRefresh(_geometries(p["geometry"])))
        return out + [a for a in p["allocators"] if a not in out]

    def finish(self, lm, records, panel: Panel, p: Mapping[str, Any], where, *, seed: int = 0, **run: Any):
        """Write :data:`PANEL_FILE` beside the records (:func:`write_panel_file`)."""
        write_panel_file(where, panel, p, seed=seed)
        return records

    def report(self, records: pd.DataFrame, p: Mapping[str, Any], *, decide: bool = True) -> Report:
        """Table 15 (:func:`factorial_table`), Table 16 (:func:`table16`), the replay minus fixed-slot gaps
        (:func:`slot_gap_table`, with the fixed slot) and the findings (:func:`findings`) as conclusion lines.
        ``decide``: ``False`` at a plumbing-check size."""
        table = results_table(records)
        conditions = [COMPLETE_REPLAY] + ([FIXED_SLOT_LABEL] if p["fixed_slot"] else [])
        t15 = factorial_table(table, conditions, n_boot=p["n_boot"], seed=p["boot_seed"])
        t16 = table16(table, conditions, n_boot=p["n_boot"], seed=p["boot_seed"])
        gaps = slot_gap_table(table, n_boot=p["n_boot"], seed=p["boot_seed"]) if p["fixed_slot"] else None
        verdicts = findings(t15, t16, gaps, decide=decide)
        word = {True: "reproduced", False: "not reproduced", None: "undecided"}
        lines = [f"- {r.finding}: {word[r.reproduced]}, {r.verdict} ({r.rule}): {r.evidence}"
                 for r in verdicts.itertuples()]
        return Report(tables={"results": table, "table15": t15, "table16": t16, "gaps": gaps, "findings": verdicts},
                      conclusion=lines)


STUDY = EvidenceLocationStudy()


# ---------------------------------------------------------------------------------------------------------------------
# Across models: finished per-model runs pooled on the common feasible panel (appendix 10.1)

#: The file :meth:`STUDY.sweep` writes into its folder beside ``records.parquet`` (:func:`write_panel_file`): the run's
#: parameters and seed, and the outcome of every candidate it examined, so that :func:`combine` can form the common
#: panel of several models' runs.
PANEL_FILE = "panel.json"
#: Parameters that change no record (the analysis's own): pooled runs may differ in them.
ANALYSIS_PARAMS = ("n_boot", "boot_seed")
#: A candidate's outcome for one model's run in :func:`common_panel`: built at some candidate geometry.
FEASIBLE = "feasible"
#: ... excluded with its reason (:class:`Exclusion`).
EXCLUDED = "excluded"
#: ... never examined (the run stopped at its ``sources_per_dataset``-th feasible source before it).
NOT_EXAMINED = "not examined"


def panel_record(built: Panel, p: Mapping[str, Any], *, seed: int) -> dict[str, Any]:
    """What :data:`PANEL_FILE` holds for one run: ``{"study", "params", "seed", "candidates"}``.

    ``params`` are the run's parameters (:meth:`STUDY.params`) minus :data:`ANALYSIS_PARAMS` (``panel_models``
    sorted: the panel does not depend on their order); ``candidates`` maps each
    dataset of ``p["datasets"]`` to ``{"feasible": [source ids], "excluded": [source ids]}``, in draw order: every
    candidate the run examined, with its outcome (decided by tokenization alone, :func:`build_panel`).

    Raises:
        ValueError: naming ``built`` when it holds a dataset outside ``p["datasets"]``.
    """
    datasets = list(p["datasets"])
    extra = sorted({s.example.dataset for s in built.sources} - set(datasets))
    if extra:
        raise ValueError(f"built holds sources of {extra}, not in the parameters' datasets {datasets}")
    return {
        "study": NAME,
        "params": {k: (sorted(v) if k == "panel_models" else v) for k, v in p.items() if k not in ANALYSIS_PARAMS},
        "seed": int(seed),
        "candidates": {d: {FEASIBLE: [s.example.id for s in built.sources if s.example.dataset == d],
                           EXCLUDED: [e.source_id for e in built.exclusions if e.dataset == d]} for d in datasets},
    }


def write_panel_file(folder, built: Panel, p: Mapping[str, Any], *, seed: int) -> None:
    """Write :func:`panel_record` as ``folder/panel.json`` (atomically; the sweep calls it after its records)."""
    import json
    from pathlib import Path

    from sur_lab.paths import atomic_path

    path = Path(folder) / PANEL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(panel_record(built, p, seed=seed), indent=1, default=str), encoding="utf-8")


def read_panel_file(folder) -> dict[str, Any]:
    """``folder/panel.json`` (:func:`write_panel_file`).

    Raises:
        FileNotFoundError: naming the file when it is missing (a folder swept before the file existed: rerun the
            notebook or ``sur-lab sweep evidence-location`` with the same parameters, which resumes every record and
            writes it).
        ValueError: naming the file when it is not an evidence-location panel record.
    """
    import json
    from pathlib import Path

    path = Path(folder) / PANEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: rerun the sweep of {path.parent} with its parameters (it "
                                "resumes every record and writes the panel file)")
    record = json.loads(path.read_text(encoding="utf-8"))
    if (not isinstance(record, dict) or record.get("study") != NAME
            or not {"params", "seed", "candidates"} <= set(record)):
        raise ValueError(f"{path} is not an {NAME} panel file")
    return record


def common_panel(panels: Mapping[str, Mapping[str, Any]]) -> pd.DataFrame:
    """Every candidate any run examined, with each run's outcome, and the **common feasible panel**: the sources
    every run's tokenizer could build (appendix 10.1's common panel; by tokenization alone).

    A candidate one run did not examine (a run with ``sources_per_dataset`` stops at its own n-th feasible source)
    is not in the common panel: with early stopping the panel is the common feasible sources among the candidates
    every run examined; without it (the ``paper`` preset) every run examines the same pool.

    Args:
        panels: model label -> its :func:`panel_record` (at least one).

    Returns:
        One row per examined candidate, datasets in the first record's order and candidates in order of first
        appearance: ``dataset``, ``source_id``, one column per model with :data:`FEASIBLE`, :data:`EXCLUDED` or
        :data:`NOT_EXAMINED`, and ``common`` (bool: feasible for every model).

    Raises:
        ValueError: naming ``panels`` when empty or when a record lacks ``candidates``.
    """
    if not panels:
        raise ValueError("panels is empty: give one panel record per model")
    order: dict[tuple[str, str], None] = {}
    status: dict[str, dict[tuple[str, str], str]] = {}
    for model, record in panels.items():
        candidates = record.get("candidates") if isinstance(record, Mapping) else None
        if not isinstance(candidates, Mapping):
            raise ValueError(f"panels[{model!r}] has no 'candidates' (not a panel_record)")
        status[model] = {}
        for d, outcome in candidates.items():
            for kind in (FEASIBLE, EXCLUDED):
                for sid in outcome.get(kind, ()):
                    order.setdefault((str(d), str(sid)), None)
                    status[model][str(d), str(sid)] = kind
    first = [str(d) for d in next(iter(panels.values()))["candidates"]]
    rank = {d: i for i, d in enumerate(first)}
    keys = sorted(order, key=lambda k: rank.get(k[0], len(rank)))  # stable: draw order within a dataset
    rows = []
    for d, sid in keys:
        row = {"dataset": d, "source_id": sid}
        row.update({m: status[m].get((d, sid), NOT_EXAMINED) for m in panels})
        row["common"] = all(row[m] == FEASIBLE for m in panels)
        rows.append(row)
    return pd.DataFrame(rows, columns=["dataset", "source_id", *panels, "common"])


@dataclass(frozen=True)
class PooledRuns:
    """Several models' finished runs on their common feasible panel (:func:`combine`).

    Attributes:
        records: every run's records on the common panel, in folder order (``model`` tells the runs apart); the
            report functions (:func:`results_table`, :func:`factorial_table`, :func:`table16`, :func:`findings`)
            read it as they read one run's, and their source bootstrap carries a source's cells of every model
            together (:func:`sur_lab.analysis.stats.factorial_bootstrap`).
        panel: :func:`common_panel` of the runs.
        folders: the sweep folders, in order.
        models: the model of each folder.
        params: the runs' common parameters (:func:`panel_record`'s ``params``) and ``seed``.
    """

    records: pd.DataFrame = field(repr=False)
    panel: pd.DataFrame = field(repr=False)
    folders: tuple
    models: tuple[str, ...]
    params: dict = field(repr=False)

    def summary(self) -> pd.DataFrame:
        """One row per dataset: the feasible sources of each model's run (``feasible: MODEL``), the ``common`` panel,
        the ``units`` it gives (sources x models), the sources ``dropped`` (feasible for some run but not all), and
        the common sources ``built at another geometry`` by some model (each tokenizer picks its own, appendix
        10.1)."""
        geometry = self.records.groupby(["dataset", "source_id"])["geometry"].nunique()
        rows = []
        for d, g in self.panel.groupby("dataset", sort=False):
            row = {"dataset": d}
            row.update({f"feasible: {m}": int((g[m] == FEASIBLE).sum()) for m in self.models})
            common = g[g["common"]]
            row["common"] = len(common)
            row["units"] = len(common) * len(self.models)
            row["dropped"] = int(((g[list(self.models)] == FEASIBLE).any(axis=1) & ~g["common"]).sum())
            row["built at another geometry"] = int(sum(geometry.get((d, s), 1) > 1 for s in common["source_id"]))
            rows.append(row)
        return pd.DataFrame(rows)


def combine(folders: Sequence) -> PooledRuns:
    """Pool finished per-model runs of this study on their common feasible panel (appendix 10.1: three models on 275
    common sources, 825 source-model units).

    Each folder is one model's finished sweep (notebook 08 or ``sur-lab sweep evidence-location``): its
    ``records.parquet`` and :data:`PANEL_FILE`. The runs must differ only in the model: the same study parameters
    (:func:`panel_record`; :data:`ANALYSIS_PARAMS` aside) and seed, and the same value of every record fingerprint
    field outside :data:`~sur_lab.sweeps.record.MODEL_FIELDS` (executor, decoding limit and rule, evaluation batch, options, versions). The
    pooled records keep the sources every run's tokenizer could build (:func:`common_panel`); a source one model
    could not build is dropped for every model, so the models' cells stay paired by source.

    Args:
        folders: two or more sweep folders, one per model.

    Returns:
        :class:`PooledRuns`.

    Raises:
        ValueError: naming ``folders`` when fewer than two are given or one repeats; when a folder holds several
            models, or two hold the same model (name or weights); when a parameter, the seed or a fingerprint field
            differs (naming it and both folders); when a folder's records and panel file disagree on its sources, or
            the method grids differ; when the common panel is empty.
        FileNotFoundError: for a folder without ``records.parquet`` (its sweep has not finished) or without
            :data:`PANEL_FILE`.
    """
    from pathlib import Path

    from sur_lab.sweeps.record import CONFIG_FIELDS, MODEL_FIELDS
    from sur_lab.sweeps.store import read_records

    if isinstance(folders, (str, Path)) or not isinstance(folders, Sequence):
        raise ValueError(f"folders={folders!r} must be a list of sweep folders, one per model")
    paths = [Path(f) for f in folders]
    if len(paths) < 2:
        raise ValueError(f"folders holds {len(paths)} folder(s): the pooled estimand needs the runs of >= 2 models")
    if len({p.resolve() for p in paths}) != len(paths):
        raise ValueError(f"folders repeat a folder: {[str(p) for p in paths]}")
    frames = [read_records(p) for p in paths]
    records = [read_panel_file(p) for p in paths]
    shared = [f for f in CONFIG_FIELDS if f not in MODEL_FIELDS]
    models: list[str] = []
    seen: dict[str, Path] = {}
    for path, df, rec in zip(paths, frames, records):
        weights = sorted(set(df["model_weights"]))
        if len(weights) != 1 or df["model"].nunique() != 1:
            raise ValueError(f"folders: {path} holds {len(weights)} models ({sorted(set(df['model']))}); one per "
                             "folder")
        name = str(df["model"].iloc[0])
        for key in (weights[0], name):
            if key in seen:
                raise ValueError(f"folders: {path} and {seen[key]} hold the same model ({name})")
            seen[key] = path
        models.append(name)
        for label, a, b in (("parameter", rec["params"], records[0]["params"]),
                            ("parameter", {"seed": rec["seed"]}, {"seed": records[0]["seed"]})):
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    raise ValueError(f"folders: {label} {k!r} differs between {paths[0]} ({b.get(k)!r}) and {path} "
                                     f"({a.get(k)!r}); pooled runs differ only in the model")
        for f in shared:
            values = sorted(set(map(str, df[f])))
            if len(values) != 1:
                raise ValueError(f"folders: {path} holds several values of {f!r} ({values})")
            ref = str(frames[0][f].iloc[0])
            if values[0] != ref:
                raise ValueError(f"folders: {f!r} differs between {paths[0]} ({ref!r}) and {path} ({values[0]!r}); "
                                 f"only the model ({', '.join(MODEL_FIELDS)}) may differ")
        ran = set(zip(df["dataset"].astype(str), df["source_id"].astype(str)))
        listed = {(d, str(s)) for d, c in rec["candidates"].items() for s in c.get(FEASIBLE, ())}
        if ran != listed:
            raise ValueError(f"folders: {path}'s records cover {len(ran)} sources and its {PANEL_FILE} lists "
                             f"{len(listed)} feasible ones ({len(ran ^ listed)} differ): an unfinished sweep or a "
                             "panel file of another call")
        grid = {(m, "ref" if pd.isna(b) else float(b)) for m, b in zip(df["method"], df["budget_pct"])}
        first = {(m, "ref" if pd.isna(b) else float(b)) for m, b in zip(frames[0]["method"], frames[0]["budget_pct"])}
        if grid != first:
            raise ValueError(f"folders: {paths[0]} and {path} hold different (method, budget) grids: "
                             f"{sorted(map(str, grid ^ first))[:6]}")
    panel = common_panel(dict(zip(models, records)))
    common = set(zip(panel.loc[panel["common"], "dataset"], panel.loc[panel["common"], "source_id"]))
    if not common:
        raise ValueError(f"folders: the runs of {models} have no feasible source in common")
    pooled = []
    for df in frames:
        keys = zip(df["dataset"].astype(str), df["source_id"].astype(str))
        pooled.append(df[[k in common for k in keys]])
    return PooledRuns(pd.concat(pooled, ignore_index=True), panel, tuple(paths), tuple(models),
                      {**records[0]["params"], "seed": records[0]["seed"]})


# ---------------------------------------------------------------------------------------------------------------------
# Report: Table 15, Table 16, the four cells, the findings (records in, tables out)

#: Table 16's endpoints: label -> (record column, sign, scale). The advantage of a method over Shift is
#: ``sign * (value(method) - value(Shift))``, reported times ``scale``: reductions of TV, JSD and the gold NLL,
#: agreement gains in percentage points.
FIDELITY_ENDPOINTS = {
    "First-token TV": ("tv_reprefill", -1.0, 1.0),
    "First-token JSD": ("jsd_reprefill", -1.0, 1.0),
    "Argmax agreement (pp)": ("argmax_agree", 1.0, 100.0),
    "Sequence agreement (pp)": ("sequence_agree", 1.0, 100.0),
    "Gold NLL": ("gold_nll", -1.0, 1.0),
}


def results_table(records: pd.DataFrame | Sequence[dict]) -> pd.DataFrame:
    """Sweep records as the long table of the report: one row per (model, dataset, source_id, side, tail, method[,
    budget]), with ``condition`` (``"SUR 5%"`` for a budgeted method, the plain name otherwise) and ``em`` as bool.

    Raises:
        ValueError: naming ``records`` when a required column is missing.
    """
    from sur_lab.analysis.conclusions import arm_labels

    df = pd.DataFrame(records).copy()
    need = [*CELL_KEYS, "method", "budget_pct", "em", "gold_nll", *(c for c, _, _ in FIDELITY_ENDPOINTS.values())]
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise ValueError(f"records lack columns {missing}")
    df["condition"] = arm_labels(df)
    df["em"] = df["em"].astype(bool)
    return df


def advantage(table: pd.DataFrame, condition: str, column: str, *, sign: float = 1.0,
              reference: str = "Shift") -> pd.DataFrame:
    """Per-cell repair advantage of ``condition`` over ``reference`` (appendix 10.2's G):
    ``sign * (column(condition) - column(reference))``, one row per (model, dataset, source_id, side, tail), in
    column ``g`` (float64). E.g. NLL: ``sign=-1`` (``NLL_Shift - NLL_Replay``, nats); EM: ``sign=1`` (0/1
    differences; :func:`table15` reports them in pp).

    Raises:
        ValueError: as :func:`sur_lab.analysis.stats.method_difference`.
    """
    from sur_lab.analysis.stats import method_difference

    diff = method_difference(table, column, condition, reference, method_col="condition", case_cols=CELL_KEYS)
    return diff.assign(g=sign * diff[column].astype(np.float64))[[*CELL_KEYS, "g"]]


def factorial_table(table: pd.DataFrame, conditions: Sequence[str] = (COMPLETE_REPLAY, FIXED_SLOT_LABEL), *,
                    n_boot: int = 10_000, seed: int = 20260928) -> pd.DataFrame:
    """:func:`table15` for each repair condition: NLL (nats) and EM (pp) factorial effects (Eq. 10-12) of its
    advantage over Shift, with source-bootstrap 95 % intervals and Holm p (within each condition).

    NLL: ``G = NLL_Shift - NLL_condition`` (the gold answer's mean NLL, nats per token) on every source. EM:
    ``G = EM_condition - EM_Shift`` on the :func:`em_stratum` sources (the clean reference answers correctly in all
    four cells; NaN rows with ``n_sources`` 0 when the stratum is empty).

    Args:
        table: :func:`results_table`.
        conditions: repair conditions (values of ``table["condition"]``).
        n_boot: bootstrap replicates; seed: generator seed (appendix 8.3's by default).

    Returns:
        :func:`table15`'s rows with ``condition`` first.

    Raises:
        ValueError: naming a condition absent from ``table``.
    """
    stratum = em_stratum(table, reference="Re-prefill", method_col="condition")
    out = []
    for cond in conditions:
        _check_condition(table, cond)
        nll = advantage(table, cond, "gold_nll", sign=-1.0)
        em = advantage(stratum, cond, "em") if len(stratum) else nll.iloc[:0]
        out.append(table15(nll, em, n_boot=n_boot, seed=seed).assign(condition=cond))
    df = pd.concat(out, ignore_index=True)
    return df[["condition", *[c for c in df.columns if c != "condition"]]]


def _check_condition(table: pd.DataFrame, cond: str) -> None:
    if cond not in set(table["condition"]):
        raise ValueError(f"condition {cond!r} has no records (conditions: {sorted(set(table['condition']))})")


def table16(table: pd.DataFrame, conditions: Sequence[str] = (COMPLETE_REPLAY, FIXED_SLOT_LABEL), *,
            n_boot: int = 10_000, seed: int = 20260928) -> pd.DataFrame:
    """Table 16: evidence-side effects (Eq. 10) on clean-reference fidelity, complete replay beside the fixed-slot
    refresh (appendix 10.3), and the gold-NLL side contrast of each (:func:`contrast_table`).

    Each endpoint of :data:`FIDELITY_ENDPOINTS` is a per-cell advantage over Shift (TV and JSD reductions, argmax and
    sequence agreement gains in pp, the gold NLL reduction in nats); a positive side effect means a larger repair
    benefit with downstream evidence. Every source counts (no stratum).

    Returns:
        One row per (endpoint, condition): the side contrast's ``estimate``, ``low``, ``high`` (95 % source
        bootstrap), ``p``, ``n_sources``; the tail and interaction estimates as ``tail`` and ``interaction``.

    Raises:
        ValueError: naming a condition absent from ``table``.
    """
    out = []
    for cond in conditions:
        _check_condition(table, cond)
        frames = {label: advantage(table, cond, column, sign=sign)
                  for label, (column, sign, _) in FIDELITY_ENDPOINTS.items()}
        scale = {label: k for label, (_, _, k) in FIDELITY_ENDPOINTS.items()}
        long = contrast_table(frames, scale=scale, n_boot=n_boot, seed=seed)
        wide = long[long["contrast"] == "side"].drop(columns=["contrast"]).set_index("endpoint")
        for other in ("tail", "interaction"):
            wide[other] = long[long["contrast"] == other].set_index("endpoint")["estimate"]
        out.append(wide.reset_index().assign(condition=cond))
    df = pd.concat(out, ignore_index=True)
    order = {label: i for i, label in enumerate(FIDELITY_ENDPOINTS)}
    df = df.sort_values(["endpoint", "condition"], key=lambda c: c.map(order) if c.name == "endpoint" else
                        c.map({k: i for i, k in enumerate(conditions)}), kind="stable").reset_index(drop=True)
    return df[["endpoint", "condition", "estimate", "low", "high", "tost_low", "tost_high", "p", "n_sources", "tail",
               "interaction"]]


def slot_gap_table(table: pd.DataFrame, *, n_boot: int = 10_000, seed: int = 20260928) -> pd.DataFrame:
    """The paired difference behind "the fixed slot carries the side effect" (issue 36): per Table 16 fidelity
    endpoint but the gold NLL, the side contrast (Eq. 10) of complete replay's advantage minus the fixed slot's, per
    cell and source (``sign * (value(Replay) - value(Fixed slot))``), with its source bootstrap
    (:func:`contrast_table`). Positive: replay's side effect is larger.

    Returns:
        One row per endpoint: ``endpoint``, ``estimate``, ``low``, ``high``, ``tost_low``, ``tost_high``, ``p``,
        ``n_sources``.

    Raises:
        ValueError: naming a condition (Replay, the fixed slot) absent from ``table``.
    """
    for cond in (COMPLETE_REPLAY, FIXED_SLOT_LABEL):
        _check_condition(table, cond)
    frames = {}
    for label, (column, sign, _) in FIDELITY_ENDPOINTS.items():
        if label == "Gold NLL":
            continue
        rep, fix = (advantage(table, c, column, sign=sign) for c in (COMPLETE_REPLAY, FIXED_SLOT_LABEL))
        merged = rep.merge(fix, on=list(CELL_KEYS), suffixes=("_r", "_f"))
        frames[label] = merged.assign(g=merged["g_r"] - merged["g_f"])[[*CELL_KEYS, "g"]]
    scale = {label: k for label, (_, _, k) in FIDELITY_ENDPOINTS.items()}
    long = contrast_table(frames, scale=scale, n_boot=n_boot, seed=seed)
    side = long[long["contrast"] == "side"]
    return side[["endpoint", "estimate", "low", "high", "tost_low", "tost_high", "p", "n_sources"]] \
        .reset_index(drop=True)


def cell_means(table: pd.DataFrame, conditions: Sequence[str] | None = None) -> pd.DataFrame:
    """Mean per cell and condition, over sources (the figure of the four cells): ``em`` (%), ``gold_nll`` (nats),
    ``tv_reprefill``, ``jsd_reprefill``, ``argmax_agree`` and ``sequence_agree`` (%), and ``sources``."""
    df = table if conditions is None else table[table["condition"].isin(conditions)]
    pct = {"em", "argmax_agree", "sequence_agree"}
    cols = ["em", "gold_nll", "tv_reprefill", "jsd_reprefill", "argmax_agree", "sequence_agree"]
    g = df.assign(**{c: df[c].astype(float) * (100.0 if c in pct else 1.0) for c in cols})
    out = g.groupby(["condition", "side", "tail"], sort=False)[cols].mean()
    return out.assign(sources=g.groupby(["condition", "side", "tail"], sort=False).size()).reset_index()


def plot_cells(means: pd.DataFrame, endpoints: Sequence[str] = ("gold_nll", "em", "sequence_agree"), *,
               title: str = ""):
    """The four cells: one panel per endpoint, the cells on the x axis (upstream/downstream within each tail), one
    line per condition. Returns the figure."""
    import matplotlib.pyplot as plt

    labels = {"gold_nll": "gold NLL (nats/token)", "em": "EM (%)", "sequence_agree": "sequence agreement (%)",
              "argmax_agree": "argmax agreement (%)", "tv_reprefill": "first-token TV", "jsd_reprefill": "JSD"}
    order = [f"{z}/{t}" for z, t in CELLS]
    fig, axes = plt.subplots(1, len(endpoints), figsize=(4.2 * len(endpoints), 3.6), squeeze=False)
    m = means.assign(cell=means["side"] + "/" + means["tail"])
    for ax, ep in zip(axes[0], endpoints):
        for cond, g in m.groupby("condition", sort=False):
            g = g.set_index("cell").reindex(order)
            ax.plot(range(len(order)), g[ep], marker="o", label=cond)
        ax.set_xticks(range(len(order)), [c.replace("/", "\n") for c in order], fontsize=8)
        ax.set_title(labels.get(ep, ep), fontsize=10)
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def pooled_report(pooled: PooledRuns, *, n_boot: int = 10_000, seed: int = 20260928,
                  decide: bool = True) -> dict[str, pd.DataFrame]:
    """Tables 15-16 and the findings of the pooled estimand (appendix 10.2): every model's cells on the common panel,
    averaged within source, dataset and model with equal weights, intervals from the source bootstrap that carries a
    source's cells of every model together.

    Args:
        pooled: :func:`combine`'s result.
        n_boot: bootstrap replicates; seed: generator seed.
        decide: ``False`` at a plumbing-check size (:func:`sur_lab.analysis.decisions.decides`).

    Returns:
        ``{"panel": pooled.summary(), "table15": factorial_table, "table16": table16, "findings": findings}``; the
        fixed-slot rows and finding only when the runs ran the fixed slot.
    """
    table = results_table(pooled.records)
    conditions = [COMPLETE_REPLAY] + ([FIXED_SLOT_LABEL] if FIXED_SLOT_LABEL in set(table["condition"]) else [])
    t15 = factorial_table(table, conditions, n_boot=n_boot, seed=seed)
    t16 = table16(table, conditions, n_boot=n_boot, seed=seed)
    gaps = slot_gap_table(table, n_boot=n_boot, seed=seed) if FIXED_SLOT_LABEL in conditions else None
    return {"panel": pooled.summary(), "table15": t15, "table16": t16,
            "findings": findings(t15, t16, gaps, decide=decide)}


def min_separable_sources(family_size: int = len(SECONDARY_FAMILY), alpha: float = 0.05) -> int:
    """The fewest sources whose bootstrap p can separate a member of a Holm family: the smallest n with
    ``family_size * p_floor(n) < alpha`` (:func:`sur_lab.analysis.decisions.p_floor`, ``2 ** (1 - n)``: every
    source on one side). E.g. 8 for the secondary family of five at 5 %: an EM stratum of fewer sources decides
    nothing, whatever its estimate.

    Raises:
        ValueError: naming ``family_size`` when < 1 or ``alpha`` outside (0, 1).
    """
    if isinstance(family_size, bool) or int(family_size) != family_size or family_size < 1:
        raise ValueError(f"family_size={family_size!r} must be an integer >= 1")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha!r} must lie in (0, 1)")
    from sur_lab.analysis.decisions import min_separating_units

    return min_separating_units(alpha / family_size)


def margin_sizing(estimate: float, tost_low: float, tost_high: float, n_sources: int,
                  margin: float | None = None) -> str:
    """Why the NLL side contrast's equivalence test did not decide, in words with the numbers: the 90 % interval's
    half-width against the room the margin leaves around the estimate, and about how many sources would close the
    gap if the estimate and the spread per source held (the half-width shrinks as 1/sqrt(sources)).

    Args:
        estimate: the contrast's estimate, nats.
        tost_low, tost_high: its ``1 - 2 alpha`` interval, nats.
        n_sources: the bootstrap's sources (>= 1).
        margin: the equivalence margin, nats (default :data:`NLL_SIDE_MARGIN`).

    Raises:
        ValueError: naming ``n_sources`` when < 1, ``tost_high`` when below ``tost_low``, or ``margin`` when not > 0.
    """
    m = NLL_SIDE_MARGIN.value if margin is None else float(margin)
    if not m > 0:
        raise ValueError(f"margin={margin!r} must be > 0")
    if isinstance(n_sources, bool) or int(n_sources) != n_sources or n_sources < 1:
        raise ValueError(f"n_sources={n_sources!r} must be an integer >= 1")
    if not tost_high >= tost_low:
        raise ValueError(f"tost_high={tost_high!r} must be >= tost_low={tost_low!r}")
    half = (tost_high - tost_low) / 2
    room = m - abs(estimate)
    head = f"the 90 % interval is too wide for the margin: half-width {half:.3g} nats"
    if room <= 0:
        return f"{head}, and the estimate itself lies outside ±{m:g} nats"
    need = math.ceil(n_sources * (half / room) ** 2)
    return (f"{head} where ±{m:g} leaves {room:.3g} around the estimate; about {need} sources would fit it if the "
            "estimate and the spread per source held")


def findings(t15: pd.DataFrame, t16: pd.DataFrame, gaps: pd.DataFrame | None = None, *, alpha: float = 0.05,
             decide: bool = True) -> pd.DataFrame:
    """The paper's three findings (appendix 10.2-10.3), each judged on this run's tables by a rule declared here
    (issue 36; :func:`sur_lab.analysis.decisions.judge`):

    - ``NLL side contrast null`` (the preregistered primary, tested alone): reproduced when complete replay's NLL
      side contrast is *equivalent* to 0 within :data:`NLL_SIDE_MARGIN` (its 90 % interval inside ±0.1 nats); not
      reproduced when it separates from 0; otherwise not separated, its interval wider than the margin (undecided);
    - ``EM side contrast positive``: reproduced when replay's EM side contrast "beats" 0 (interval above 0 and Holm
      p < ``alpha`` over :data:`SECONDARY_FAMILY`); not reproduced when it separates below 0; undecided otherwise;
    - ``fixed-slot refresh carries the side effect``: on every Table 16 fidelity endpoint but the NLL, the fixed
      slot's side contrast beats 0 (Holm over the endpoints) and the paired difference replay minus fixed slot
      (:func:`slot_gap_table`) is equivalent to 0 within :data:`FIXED_SLOT_SHARE` of replay's estimate (every
      endpoint must hold: an intersection, tested at ``alpha`` each); not reproduced when some endpoint's difference
      separates (Holm over the endpoints) or its side contrast separates below 0.

    Args:
        t15: :func:`factorial_table`; t16: :func:`table16`; gaps: :func:`slot_gap_table` (``None``: the fixed-slot
            finding is undecided).
        alpha: the level.
        decide: ``False`` at a plumbing-check size: every finding "not decided at this size".

    Returns:
        One row per finding: ``finding``, ``rule``, ``verdict`` (the decision's words), ``evidence`` (the numbers it
        read), ``reproduced`` (True / False; None when undecided: not separated, an empty EM stratum, or a smoke run).
    """
    from sur_lab.analysis.decisions import (BEATS, EQUIVALENT, LOSES, NA, NOT_DECIDED, NOT_SEPARATED, SEPARATED,
                                            judge, p_floor)
    from sur_lab.analysis.stats import holm

    def pick(df, cond, **kw):
        if df is None:
            return None
        sel = df if cond is None else df[df["condition"] == cond]
        for k, v in kw.items():
            sel = sel[sel[k] == v]
        return sel.iloc[0] if len(sel) else None

    def ci(r, unit=""):
        interval = "no interval" if pd.isna(r.low) else f"95 % CI {r.low:+.4g} to {r.high:+.4g}"
        return f"{r.estimate:+.4g}{unit} ({interval})"

    def sources(n):
        return f"{int(n)} source{'' if int(n) == 1 else 's'}"

    def over(r):
        units = int(getattr(r, "n_units", r.n_sources) or r.n_sources)
        return sources(r.n_sources) + (f" ({units} source-model units)" if units != r.n_sources else "")

    out = []
    r = pick(t15, COMPLETE_REPLAY, hypothesis="NLL side")
    m = NLL_SIDE_MARGIN.value
    if r is None or not r.n_sources:
        v, evidence = (NA if decide else NOT_DECIDED), "n/a"
    else:
        v = judge(r.estimate, r.low, r.high, p_adj=r.p, alpha=alpha, tost=(r.tost_low, r.tost_high), margin=m,
                  n=int(r.n_sources), decide=decide)
        tost = ("no 90 % interval" if pd.isna(r.tost_low) else
                f"90 % CI {r.tost_low:+.4g} to {r.tost_high:+.4g} against ±{m:g} nats")
        evidence = f"{ci(r, ' nats')}, {tost}, p {r.p:.3g}, over {over(r)}"
        if v == NOT_SEPARATED and not pd.isna(r.tost_low):
            evidence += "; " + margin_sizing(r.estimate, r.tost_low, r.tost_high, int(r.n_sources))
    words = {EQUIVALENT: f"equivalent within ±{m:g} nats", BEATS: "separated from 0 (above)",
             LOSES: "separated from 0 (below)", NA: "n/a", NOT_DECIDED: "not decided at this size"}
    out.append({"finding": "NLL side contrast null",
                "rule": f"replay's NLL side 90 % interval inside ±{m:g} nats (TOST, tested alone; margin: "
                        f"{NLL_SIDE_MARGIN.source})",
                "verdict": words.get(v, "not separated, interval wider than the margin"), "evidence": evidence,
                "reproduced": {EQUIVALENT: True, BEATS: False, LOSES: False}.get(v)})

    r = pick(t15, COMPLETE_REPLAY, hypothesis="EM side")
    if r is None or not r.n_sources:
        v, evidence = (NA if decide else NOT_DECIDED), "empty EM stratum"
    else:
        v = judge(r.estimate, r.low, r.high, p_adj=r.holm_p, alpha=alpha, n=int(r.n_sources), decide=decide)
        evidence = f"{ci(r, ' pp')}, Holm p {r.holm_p:.3g} over {len(SECONDARY_FAMILY)}, {over(r)}"
        need = min_separable_sources(len(SECONDARY_FAMILY), alpha)
        if decide and v not in SEPARATED and r.n_sources < need:
            evidence += (f"; a stratum of {sources(r.n_sources)} cannot separate (its smallest Holm p is "
                         f"{min(1.0, len(SECONDARY_FAMILY) * p_floor(int(r.n_sources))):.3g}): it needs >= {need}")
    out.append({"finding": "EM side contrast positive",
                "rule": f"replay's EM side interval above 0 and Holm p < {alpha:g} over the secondary family",
                "verdict": {BEATS: "positive", LOSES: "negative", NA: "n/a (empty EM stratum)",
                            NOT_DECIDED: "not decided at this size"}.get(v, "not separated at this size"),
                "evidence": evidence, "reproduced": {BEATS: True, LOSES: False}.get(v)})

    labels = [label for label in FIDELITY_ENDPOINTS if label != "Gold NLL"]
    fixed = {label: pick(t16, FIXED_SLOT_LABEL, endpoint=label) for label in labels}
    rep = {label: pick(t16, COMPLETE_REPLAY, endpoint=label) for label in labels}
    gap = {label: pick(gaps, None, endpoint=label) for label in labels}
    parts, calls = [], []
    complete = all(x is not None and x.n_sources for x in (*fixed.values(), *rep.values(), *gap.values()))
    if complete:
        adjusted = holm({label: float(fixed[label].p) for label in labels})
        gap_adjusted = holm({label: float(gap[label].p) for label in labels})
        for label in labels:
            f, g, rp = fixed[label], gap[label], rep[label]
            side = judge(f.estimate, f.low, f.high, p_adj=adjusted[label], alpha=alpha, n=int(f.n_sources),
                         decide=decide)
            margin = FIXED_SLOT_SHARE * abs(float(rp.estimate))
            same = judge(g.estimate, g.low, g.high, p_adj=gap_adjusted[label], alpha=alpha,
                         tost=(g.tost_low, g.tost_high),
                         margin=margin if margin > 0 else None, n=int(g.n_sources), decide=decide)
            calls.append((side, same))
            against = f"against ±{margin:.3g}" if margin > 0 else "no margin (replay's estimate is 0)"
            parts.append(f"{label}: fixed slot {ci(f)} (Holm p {adjusted[label]:.3g}), replay {rp.estimate:+.4g}, "
                         f"replay minus fixed slot {ci(g)} {against}")
    if not decide:
        v, ok = "not decided at this size", None
    elif not complete:
        v, ok = "n/a (a condition or the paired difference is missing)", None
    elif all(side == BEATS and same == EQUIVALENT for side, same in calls):
        v, ok = f"carried (within {FIXED_SLOT_SHARE:.0%} of replay on every endpoint)", True
    elif any(same in SEPARATED or side == LOSES for side, same in calls):
        v, ok = "not carried (replay and the fixed slot separate on some endpoint)", False
    else:
        v, ok = "not separated at this size", None
    out.append({"finding": "fixed-slot refresh carries the side effect",
                "rule": f"on each fidelity endpoint the fixed slot's side contrast beats 0 (Holm over {len(labels)}) "
                        f"and replay minus fixed slot is equivalent to 0 within {FIXED_SLOT_SHARE:.0%} of replay's "
                        "estimate (paired, TOST)",
                "verdict": v, "evidence": "; ".join(parts) or "n/a", "reproduced": ok})
    return pd.DataFrame(out).astype({"reproduced": object})  # True / False / None as Python values
