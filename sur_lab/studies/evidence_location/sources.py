"""Evidence-location sources (appendix 10.1): candidate geometries, token segments, and one source's exact
construction and content checks, by tokenization alone.

A source (a natural-QA question) is built at the first feasible geometry of a candidate list (:func:`build_source`):
its chat head, lead filler, evidence and control bundles (each exactly W tokens), deleted filler, neutral tail and
tail extension, every region checked before execution (:func:`check_source`). A source that no geometry can build is
an :class:`Exclusion` with its reason (:data:`REASONS`). The package docstring
(:mod:`sur_lab.studies.evidence_location`) has the design.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from sur_lab.analysis.endpoints import canonical_answer_ids
from sur_lab.analysis.scoring import normalize_answer
from sur_lab.analysis.stats import SIDES, TAILS
from sur_lab.data.qa import Passage, QAExample, load_corpus
from sur_lab.data.text import source_rng
from sur_lab.edits import DEFAULT_INSTRUCTION, render_chat

__all__ = ["PAD_WORDS", "MIN_FILL_TOKENS", "MAX_FILL_SKIPS", "MIN_CONTROL_DOCS", "MAX_CONTROL_DOCS", "Geometry",
           "scaled_geometries", "GEOMETRIES", "Segment", "Infeasible", "REASONS", "special_token_ids",
           "protected_strings", "neutral_padding", "LocationSource", "check_source", "Exclusion", "build_source"]

#: The one neutral padding family: this word cycle, joined by spaces and closed by a blank line
#: (:func:`neutral_padding`).
PAD_WORDS = ("the", "day", "went", "on", "as", "before", "and", "then", "time", "passed", "over", "quiet", "fields")
#: Filler: stop adding whole chunks when fewer tokens than this remain (the rest is padding).
MIN_FILL_TOKENS = 24
#: Filler: stop adding whole chunks after this many consecutive candidates that do not fit or are inadmissible.
MAX_FILL_SKIPS = 64
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
