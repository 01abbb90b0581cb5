"""Semantic units: text-boundary regions of the retained suffix that SUR refreshes together (appendix 7.3).

Boundaries, outermost first: message containers (chat turns), structured containers inside a message (fenced code
blocks, ``<tag> ... </tag>`` blocks), paragraphs (blank lines), lines, and sentences (pysbd). The resulting character
segments partition the edited text; each token is assigned to the segment holding the midpoint of its character span,
so the units partition the suffix without gaps or overlaps. Units over 128 tokens are split into balanced chunks, a unit
under 8 tokens merges with the shorter adjacent unit in its container (equal lengths: the preceding one), and
oversized merged units are split again.
"""

from __future__ import annotations

import bisect
import re
import threading
from dataclasses import dataclass

import pysbd

from sur_lab.checks import as_count
from sur_lab.edits import EditedContext

MAX_UNIT_TOKENS = 128
MIN_UNIT_TOKENS = 8

_FENCE = re.compile(r"```.*?(?:```|\Z)", re.S)
_TAG_BLOCK = re.compile(r"^[ \t]*<([A-Za-z][\w\-]*)[^>\n]*>.*?</\1>[ \t]*$", re.S | re.M)
_BLANK = re.compile(r"\n[ \t]*\n\s*")


@dataclass(frozen=True)
class Unit:
    """A semantic unit: suffix-local token positions ``[start, end)`` inside container ``container`` of kind ``kind``."""

    start: int
    end: int
    container: int
    kind: str = "text"

    def __len__(self) -> int:
        return self.end - self.start


_LOCAL = threading.local()


def _segmenter():
    """This thread's pysbd segmenter. One per thread: ``Segmenter.segment`` keeps the text it is segmenting on the
    instance (``self.original_text``) and reads it back to locate sentences, so a segmenter shared by two threads can
    locate one thread's sentences in the other's text and silently drop them."""
    segmenter = getattr(_LOCAL, "segmenter", None)
    if segmenter is None:
        segmenter = _LOCAL.segmenter = pysbd.Segmenter(language="en", clean=False, char_span=False)
    return segmenter


def _sentence_starts(line: str) -> list[int]:
    """Character offsets (within ``line``) where sentences start, via pysbd."""
    if len(line.strip()) < 2:
        return [0]
    starts, pos = [0], 0
    for sent in _segmenter().segment(line):
        found = line.find(sent.strip(), pos) if sent.strip() else -1
        if found > 0 and found != starts[-1]:
            starts.append(found)
        if found >= 0:
            pos = found + len(sent.strip())
    return starts


def _region_starts(text: str, lo: int, hi: int, kind: str) -> list[int]:
    """Segment starts inside ``text[lo:hi]``: paragraphs, then lines, then (for prose) sentences."""
    starts = [lo]
    region = text[lo:hi]
    para_starts = [0] + [m.end() for m in _BLANK.finditer(region) if m.end() < len(region)]
    for i, ps in enumerate(para_starts):
        pe = para_starts[i + 1] if i + 1 < len(para_starts) else len(region)
        para = region[ps:pe]
        line_pos = 0
        for line in para.splitlines(keepends=True):
            abs_line = lo + ps + line_pos
            if abs_line != starts[-1]:
                starts.append(abs_line)
            if kind == "text":
                starts.extend(abs_line + s for s in _sentence_starts(line) if s > 0)
            line_pos += len(line)
    return starts


def text_segments(text: str, containers=()) -> list[tuple[int, int, int, str]]:
    """Partition ``text`` into ``(start, end, container_id, kind)`` character segments (appendix 7.3).

    Args:
        text: the edited pre-query text.
        containers: ``(start, end, kind)`` message spans; text outside them forms ``"template"`` containers.

    Returns:
        Segments in order, covering ``[0, len(text))`` exactly once; ``container_id`` numbers message / structured /
        template containers in order of appearance.
    """
    # 1. Outer containers: given message spans, with gaps as template containers.
    outer: list[tuple[int, int, str]] = []
    pos = 0
    for cs, ce, kind in sorted((max(0, c[0]), min(len(text), c[1]), c[2]) for c in containers):
        if cs < pos or ce <= cs:
            continue
        if cs > pos:
            outer.append((pos, cs, "template"))
        outer.append((cs, ce, kind))
        pos = ce
    if pos < len(text):
        outer.append((pos, len(text), "template" if outer else "message"))
    # 2. Structured containers inside messages.
    regions: list[tuple[int, int, str]] = []
    for cs, ce, kind in outer:
        if kind == "template":
            regions.append((cs, ce, "template"))
            continue
        body = text[cs:ce]
        blocks = sorted([(m.start(), m.end(), "code") for m in _FENCE.finditer(body)] +
                        [(m.start(), m.end(), "structured") for m in _TAG_BLOCK.finditer(body)])
        cur = 0
        for bs, be, bkind in blocks:
            if bs < cur:
                continue
            if bs > cur:
                regions.append((cs + cur, cs + bs, "text"))
            regions.append((cs + bs, cs + be, bkind))
            cur = be
        if cur < len(body):
            regions.append((cs + cur, ce, "text"))
    # 3. Paragraph / line / sentence starts inside each region.
    segments: list[tuple[int, int, int, str]] = []
    container_of_region = _container_ids(regions, outer)
    for (rs, re_, kind), cid in zip(regions, container_of_region):
        starts = [rs] if kind == "template" else _region_starts(text, rs, re_, "text" if kind == "text" else "code")
        bounds = sorted(set(starts)) + [re_]
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                segments.append((a, b, cid, kind))
    return segments


def _container_ids(regions, outer) -> list[int]:
    """Text regions share their message's container id; structured and template regions get their own."""
    ids, next_id, message_id = [], 0, {}
    for rs, _, kind in regions:
        if kind == "text":
            msg = next(i for i, (cs, ce, _) in enumerate(outer) if cs <= rs < ce)
            if msg not in message_id:
                message_id[msg] = next_id
                next_id += 1
            ids.append(message_id[msg])
        else:
            ids.append(next_id)
            next_id += 1
    return ids


def split_balanced(unit: Unit, max_len: int = MAX_UNIT_TOKENS) -> list[Unit]:
    """Split a unit longer than ``max_len`` into ``ceil(n / max_len)`` chunks whose sizes differ by at most one."""
    n = len(unit)
    if n <= max_len:
        return [unit]
    k = -(-n // max_len)
    base, extra = divmod(n, k)
    out, pos = [], unit.start
    for i in range(k):
        size = base + (1 if i < extra else 0)
        out.append(Unit(pos, pos + size, unit.container, unit.kind))
        pos += size
    return out


def merge_short(units: list[Unit], min_len: int = MIN_UNIT_TOKENS) -> list[Unit]:
    """Merge each unit shorter than ``min_len`` with the shorter adjacent unit in the same container.

    Equal-length neighbours: the preceding one. Units are visited left to right and a merged unit is re-examined, so
    the result has no short unit that still has a same-container neighbour.
    """
    units = list(units)
    i = 0
    while i < len(units):
        u = units[i]
        if len(u) < min_len:
            left = i - 1 if i > 0 and units[i - 1].container == u.container else None
            right = i + 1 if i + 1 < len(units) and units[i + 1].container == u.container else None
            if left is not None or right is not None:
                if right is None or (left is not None and len(units[left]) <= len(units[right])):
                    j = left
                else:
                    j = right
                lo, hi = min(i, j), max(i, j)
                kind = units[lo].kind if units[lo].kind == units[hi].kind else "text"
                units[lo : hi + 1] = [Unit(units[lo].start, units[hi].end, u.container, kind)]
                i = lo
                continue
        i += 1
    return units


def segment_units(
    edit: EditedContext, *, max_len: int = MAX_UNIT_TOKENS, min_len: int = MIN_UNIT_TOKENS
) -> list[Unit]:
    """Partition the retained suffix of ``edit`` into semantic units (appendix 7.3).

    Args:
        edit: the edit; when it has no text (a token-level edit) the suffix is one container split into balanced
            ``max_len`` chunks.
        max_len: split threshold, tokens (128 in the paper).
        min_len: merge threshold, tokens (8 in the paper).

    Returns:
        Units in suffix order whose ``[start, end)`` ranges partition ``[0, S)``.

    Raises:
        TypeError: naming ``edit`` when it is not an :class:`~sur_lab.edits.EditedContext`, ``max_len`` or
            ``min_len`` when not integers.
        ValueError: naming ``max_len`` when < 1, ``min_len`` when < 0.
    """
    if not isinstance(edit, EditedContext):
        raise TypeError(f"edit must be an EditedContext (token_edit, chat_edit); got {type(edit).__name__}")
    max_len = as_count(max_len, "max_len", minimum=1)
    min_len = as_count(min_len, "min_len", minimum=0)
    S = edit.suffix_len
    if S == 0:
        return []
    if edit.edited_text is None or edit.edited_offsets is None:
        return split_balanced(Unit(0, S, 0, "text"), max_len)
    segments = text_segments(edit.edited_text, edit.containers)
    seg_starts = [s[0] for s in segments]
    p = edit.prefix_len
    raw: list[Unit] = []
    current, cur_start = None, 0
    for i in range(S):
        cs, ce = edit.edited_offsets[p + i]
        mid = (cs + ce) / 2.0 if ce > cs else cs
        seg = max(0, bisect.bisect_right(seg_starts, mid) - 1)
        if seg != current:
            if current is not None:
                raw.append(Unit(cur_start, i, segments[current][2], segments[current][3]))
            current, cur_start = seg, i
    raw.append(Unit(cur_start, S, segments[current][2], segments[current][3]))
    split = [piece for u in raw for piece in split_balanced(u, max_len)]
    merged = merge_short(split, min_len)
    return [piece for u in merged for piece in split_balanced(u, max_len)]
