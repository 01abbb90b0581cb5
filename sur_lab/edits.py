"""Contexts and edits: prefix p, deleted span e, retained suffix s and query q (section 3.1).

A context is the token sequence of a chat-rendered prompt up to the query. An edit deletes tokens ``[p, p + d)``: the
original pre-query sequence is ``x = p ⊕ e ⊕ s`` (N = p + d + S tokens) and the edited one is ``x⁻ = p ⊕ s``. The query
``q`` is processed after whichever cache a repair produced.

Edits are built from token *segments*, as an agent's cache holds them: the prompt head, each document, the deleted
span, the retained suffix and the query are tokenized each on its own and their ids concatenated
(:func:`segment_edit`). Re-prefill prefills exactly these edited ids. A BPE merge never has to fall on a boundary:
Qwen's tokenizer merges ``".\n\n"`` across the end of a document and the start of ``"\n\nQuestion:"`` when the
whole prompt is tokenized at once, but the segments keep the cut. The character-span API (:func:`build_edit`,
:func:`chat_edit`) cuts the text at the span's ends (and at passage boundaries) and tokenizes the pieces; a boundary
that falls inside a token of the whole-text tokenization is kept exactly, and the tokens around it are those of the
segment tokenization (never snapped outwards or refused).
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sur_lab.checks import as_count, as_token_ids

#: Instruction placed before the documents in :func:`chat_edit` prompts.
DEFAULT_INSTRUCTION = "Answer the question using the documents below. Reply with a short answer only."


@dataclass(frozen=True)
class EditedContext:
    """One deletion edit of a cached context, with the query that follows it.

    Attributes:
        original_ids: ``[N]`` int64, the Dirty pre-query tokens ``p ⊕ e ⊕ s``.
        query_ids: ``[Q]`` int64, tokens processed after the repaired cache (question plus chat-template tail).
        prefix_len: p, tokens before the deleted span (an integer; floats are refused, not truncated).
        deleted_len: d >= 1, deleted tokens. A whole-context deletion (p = 0, d = N) is refused at construction with
            a ``ValueError`` naming ``deleted_len``: nothing would remain to cache, so no method (Shift, Replay,
            Re-prefill, SUR) has a cache to return; every edit keeps p + S >= 1 tokens.
        question: the query text used for relevance scoring (SUR, Eq. 7), or ``None`` for token-level edits.
        question_ids: ``[|q|]`` int64, ``question`` tokenized without special tokens (Eq. 7, appendix 7.3).
        original_text / edited_text: pre-query text before and after the deletion (``None`` for token-level edits).
        edited_offsets: ``(start, end)`` character span in ``edited_text`` of each edited token (``N - d`` entries).
        original_offsets: ``(start, end)`` character span in ``original_text`` of each original token (N entries).
        containers: ``(start, end, kind)`` character spans in ``edited_text`` of message and structured containers;
            semantic units never cross their boundaries (appendix 7.3).
        deleted_char_span: ``(start, end)`` of the deleted text in ``original_text``.
        inserted_len: m, tokens at the end of the prefix that the edit inserted (0: a deletion; m > 0: a replacement
            in the :func:`splice_replacement` layout, ``p ⊕ e ⊕ s`` with the m new tokens ending ``p``). The context
            *before* the edit is then ``original_ids`` without them (N - m tokens): what the Dirty cache of a
            replacement holds (:func:`sur_lab.executors.dirty`). Integer in ``[0, prefix_len]``.
    """

    original_ids: torch.Tensor
    query_ids: torch.Tensor
    prefix_len: int
    deleted_len: int
    question: str | None = None
    question_ids: torch.Tensor | None = None
    original_text: str | None = None
    edited_text: str | None = None
    edited_offsets: tuple[tuple[int, int], ...] | None = field(default=None, repr=False)
    containers: tuple[tuple[int, int, str], ...] = ()
    deleted_char_span: tuple[int, int] | None = None
    original_offsets: tuple[tuple[int, int], ...] | None = field(default=None, repr=False)
    inserted_len: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "original_ids", as_token_ids(self.original_ids, "original_ids", allow_empty=True))
        object.__setattr__(self, "query_ids", as_token_ids(self.query_ids, "query_ids", allow_empty=True))
        if self.query_ids.numel() == 0:
            raise ValueError("query_ids must be a non-empty 1-D tensor (empty query)")
        object.__setattr__(self, "prefix_len", as_count(self.prefix_len, "prefix_len"))
        object.__setattr__(self, "deleted_len", as_count(self.deleted_len, "deleted_len"))
        n = int(self.original_ids.numel())
        if self.deleted_len < 1:
            raise ValueError(f"deleted_len must be >= 1 (empty span); got {self.deleted_len}")
        if self.prefix_len + self.deleted_len > n:
            raise ValueError(
                f"span [prefix_len={self.prefix_len}, {self.prefix_len + self.deleted_len}) must lie in [0, {n}]"
            )
        if self.deleted_len == n:
            # Whole-context deletion (p = 0, d = N): nothing is left to cache, so no method has a cache to repair.
            # Refused here, at edit time, so that every method behaves alike.
            raise ValueError(
                f"deleted_len={self.deleted_len} with prefix_len=0 deletes the whole context of {n} tokens; "
                "an edit must keep at least one token (p + S >= 1): start a new prompt instead"
            )
        object.__setattr__(self, "inserted_len", as_count(self.inserted_len, "inserted_len"))
        if self.inserted_len > self.prefix_len:
            raise ValueError(f"inserted_len={self.inserted_len} must lie in [0, prefix_len={self.prefix_len}] (the "
                             "inserted tokens end the prefix)")
        if self.question_ids is not None:
            object.__setattr__(self, "question_ids", as_token_ids(self.question_ids, "question_ids", allow_empty=True))
            if self.question_ids.numel() == 0:
                raise ValueError("question must contain at least one token (empty query)")

    @property
    def num_tokens(self) -> int:
        """N, tokens of the original pre-query sequence."""
        return int(self.original_ids.numel())

    @property
    def suffix_len(self) -> int:
        """S, retained suffix tokens."""
        return self.num_tokens - self.prefix_len - self.deleted_len

    @property
    def edited_len(self) -> int:
        """p + S, tokens of the edited pre-query sequence."""
        return self.num_tokens - self.deleted_len

    @property
    def edited_ids(self) -> torch.Tensor:
        """``[p + S]`` int64, the edited pre-query tokens ``p ⊕ s``."""
        return torch.cat((self.original_ids[: self.prefix_len], self.original_ids[self.prefix_len + self.deleted_len :]))

    @property
    def suffix_ids(self) -> torch.Tensor:
        """``[S]`` int64, the retained suffix tokens."""
        return self.original_ids[self.prefix_len + self.deleted_len :]

    @property
    def relevance_ids(self) -> torch.Tensor:
        """Query tokens for relevance scoring: ``question_ids`` when known, else ``query_ids``."""
        return self.question_ids if self.question_ids is not None else self.query_ids

    @property
    def suffix_slice(self) -> slice:
        """Absolute positions of the suffix in the edited context: ``slice(p, p + S)``."""
        return slice(self.prefix_len, self.edited_len)


def token_edit(
    original_ids,
    prefix_len: int,
    deleted_len: int,
    query_ids,
    *,
    question_ids=None,
) -> EditedContext:
    """Build a token-level edit (no text; for tiny random models and synthetic studies).

    Args:
        original_ids: ``[N]`` integer token ids ``p ⊕ e ⊕ s`` (a ``[1, N]`` tensor is batch size one).
        prefix_len: p >= 0, an integer.
        deleted_len: d >= 1, an integer; ``p + d <= N`` and the edit keeps at least one token (``p + S >= 1``).
        query_ids: ``[Q]`` non-empty integer ids.
        question_ids: optional relevance query ``[|q|]`` (defaults to ``query_ids``).

    Raises:
        TypeError: naming ``original_ids``/``query_ids``/``question_ids`` when the ids are not integers (floats are
            not truncated), or ``prefix_len``/``deleted_len`` when they are not integers (``3.7``, ``True``).
        ValueError: naming ``original_ids``/``query_ids`` for a batch of several sequences (``[2, N]`` is not
            flattened) or a negative id; ``deleted_len`` (empty span, or the whole context: p = 0, d = N);
            ``prefix_len`` (out of range); ``query_ids`` (empty).
    """
    return EditedContext(
        original_ids=original_ids,
        query_ids=query_ids,
        prefix_len=prefix_len,
        deleted_len=deleted_len,
        question_ids=question_ids,
    )


def _check_tokenizer_segment(tokenizer, seg: str, ids: list[int]) -> None:
    back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if back != seg:
        raise ValueError(
            f"tokenizer does not reproduce a segment's text on its own ({seg[:40]!r} decodes to {back[:40]!r}); "
            "segment edits need a tokenizer that adds no prefix space or special tokens (byte-level BPE)"
        )


def tokenize_segments(tokenizer, segments: Sequence[str]) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Tokenize each text segment on its own (no special tokens added) and locate every token in the joined text.

    Args:
        tokenizer: a fast tokenizer (offsets required) whose ``decode`` of a segment's ids gives the segment back
            (byte-level BPE tokenizers such as SmolLM2's, Qwen2.5's and Qwen3's do).
        segments: texts in order; empty segments contribute no tokens. Chat-template special tokens written as text
            (``"<|im_start|>"``) are recognised inside a segment.

    Returns:
        ``(ids, offsets)``: ``ids[k]`` the token ids of segment k, ``offsets`` the ``(start, end)`` character span in
        ``"".join(segments)`` of every token, in order.

    Raises:
        ValueError: naming ``tokenizer`` when decoding a segment's ids does not give the segment back.
    """
    ids: list[list[int]] = []
    offsets: list[tuple[int, int]] = []
    pos = 0
    for seg in segments:
        if not seg:
            ids.append([])
            continue
        enc = tokenizer(seg, add_special_tokens=False, return_offsets_mapping=True)
        seg_ids = list(enc["input_ids"])
        _check_tokenizer_segment(tokenizer, seg, seg_ids)
        ids.append(seg_ids)
        offsets.extend((pos + int(a), pos + int(b)) for a, b in enc["offset_mapping"])
        pos += len(seg)
    return ids, offsets


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings (a binary search over slice comparisons: C speed on long
    prompts)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def offset_pieces(text: str, offsets: Sequence[tuple[int, int]]) -> tuple[str, ...]:
    """Each token's share of ``text``: from its start offset to the next token's (the first from 0, the last to the
    end), so the pieces join to ``text`` exactly, whatever spaces a tokenizer leaves out of its offsets.

    Args:
        text: the tokenized text.
        offsets: ``(start, end)`` character offsets of its tokens in order (a fast tokenizer's ``offset_mapping``,
            or :func:`tokenize_segments`' offsets).
    """
    starts, prev = [], 0
    for i, (a, _) in enumerate(offsets):
        prev = 0 if i == 0 else max(prev, int(a))
        starts.append(prev)
    bounds = starts[1:] + [len(text)]
    return tuple(text[a:b] for a, b in zip(starts, bounds))


def passage_cuts(documents: str) -> tuple[int, ...]:
    """Character positions just after each blank-line run in ``documents`` (where a new passage begins).

    Documents are appended to an agent's context one passage at a time, so :func:`chat_edit` tokenizes each passage
    (with the blank line that follows it) as its own segment, as SAFE-KV's document store does
    (:func:`sur_lab.studies.noprefix.composition.compose_prompt`).
    """
    return tuple(m.end() for m in re.finditer(r"\n{2,}", documents) if m.end() < len(documents))


def _check_span(span, name: str = "span") -> tuple[int, int]:
    if isinstance(span, (str, bytes)) or not hasattr(span, "__len__") or len(span) != 2:
        raise ValueError(f"{name}={span!r} must be a (start, end) pair of character offsets")
    bounds = []
    for v in span:
        # operator.index accepts Python and NumPy integers and refuses floats (no silent truncation).
        if isinstance(v, bool) or not hasattr(type(v), "__index__"):
            raise ValueError(f"{name}={span!r} must hold integer character offsets; got {type(v).__name__}")
        bounds.append(operator.index(v))
    start, end = bounds
    if start >= end:
        raise ValueError(f"{name}=({start}, {end}) is empty; need start < end")
    return start, end


def segment_edit(
    tokenizer,
    prefix: Sequence[str] | str,
    deleted: Sequence[str] | str,
    suffix: Sequence[str] | str,
    query_text: str,
    *,
    question: str | None = None,
    containers: tuple[tuple[int, int, str], ...] = (),
) -> EditedContext:
    """Build an edit from text segments, each tokenized on its own (the token-segment path of section 3.1).

    The original ids are ``tok(prefix) ⊕ tok(deleted) ⊕ tok(suffix)``, the query ids ``tok(query_text)``, where each
    segment of ``prefix`` / ``deleted`` / ``suffix`` (a string or a sequence of strings, e.g. one per passage) is
    tokenized separately (:func:`tokenize_segments`). The edited ids ``tok(prefix) ⊕ tok(suffix)`` are exactly what
    Re-prefill prefills; no BPE merge across a boundary is required or performed.

    Args:
        tokenizer: a fast byte-level tokenizer (offsets required).
        prefix: text before the deleted span (may be empty: p = 0).
        deleted: the deleted text; must produce at least one token.
        suffix: retained text after the deleted span (may be empty: S = 0).
        query_text: text processed after the repaired cache (question and template tail); non-empty.
        question: relevance query for SUR (Eq. 7; defaults to ``query_text``), tokenized without special tokens.
        containers: ``(start, end, kind)`` character spans in the original pre-query text (prefix + deleted + suffix)
            of messages / structured containers; mapped to the edited text.

    Returns:
        EditedContext with texts, per-token character offsets (original and edited) and mapped containers.

    Raises:
        ValueError: naming ``deleted`` when it is empty, ``query_text`` / ``question`` when empty, ``containers``
            when one is not an ``(start, end, kind)`` triple of integers ``0 <= start <= end <= len(text)`` and a
            string, or ``tokenizer`` (see :func:`tokenize_segments`); all before tokenizing.
    """
    parts = [[x] if isinstance(x, str) else list(x) for x in (prefix, deleted, suffix)]
    for name, part in zip(("prefix", "deleted", "suffix"), parts):
        if not all(isinstance(t, str) for t in part):
            raise ValueError(f"{name} must be a str or a sequence of str")
    if not isinstance(query_text, str) or not query_text:
        raise ValueError("query_text must be non-empty (empty query)")
    if question is not None and (not isinstance(question, str) or not question.strip()):
        raise ValueError("question must be non-empty (empty query)")
    texts = ["".join(p) for p in parts]
    if not texts[1]:
        raise ValueError("deleted is empty; an edit deletes at least one character (empty span)")
    _check_containers(containers, sum(map(len, texts)))
    seg_ids, offsets = tokenize_segments(tokenizer, parts[0] + parts[1] + parts[2])
    n0, n1 = len(parts[0]), len(parts[1])
    p = sum(len(x) for x in seg_ids[:n0])
    d = sum(len(x) for x in seg_ids[n0 : n0 + n1])
    ids = [t for x in seg_ids for t in x]
    if d < 1:
        raise ValueError(f"deleted={texts[1][:40]!r} produces no token (empty span)")
    query_ids = tokenize_segments(tokenizer, [query_text])[0][0]
    if not query_ids:
        raise ValueError("query_text produces no token (empty query)")
    text = "".join(texts)
    start, end = len(texts[0]), len(texts[0]) + len(texts[1])
    width = end - start

    def to_edited(c: int) -> int:
        return c if c <= start else max(start, c - width)

    mapped = tuple(
        (to_edited(cs), to_edited(ce), kind) for cs, ce, kind in containers if to_edited(ce) > to_edited(cs)
    )
    edited_offsets = tuple(offsets[:p]) + tuple((a - width, b - width) for a, b in offsets[p + d :])
    q_text = question if question is not None else query_text
    question_ids = tokenizer(q_text, add_special_tokens=False)["input_ids"]
    return EditedContext(
        original_ids=torch.tensor(ids, dtype=torch.long),
        query_ids=torch.tensor(query_ids, dtype=torch.long),
        prefix_len=p,
        deleted_len=d,
        question=q_text,
        question_ids=torch.tensor(question_ids, dtype=torch.long),
        original_text=text,
        edited_text=texts[0] + texts[2],
        edited_offsets=edited_offsets,
        original_offsets=tuple(offsets),
        containers=mapped,
        deleted_char_span=(start, end),
    )


def splice_replacement(ids, start: int, end: int, inserted) -> tuple[torch.Tensor, int, int]:
    """The replacement layout: rows ``[start, end)`` of ``ids`` replaced by ``inserted``, as one deletion edit.

    A replacement is a deletion whose prefix ends with the inserted tokens: the original ids are
    ``ids[:start] ⊕ inserted ⊕ ids[start:]``, the prefix ``p = start + m`` (m inserted tokens, computed against the
    unchanged ``ids[:start]``), the deleted span the old rows ``[start, end)`` (``d = end - start``) and the suffix
    ``ids[end:]``. The edited ids ``p ⊕ s`` are ``ids[:start] ⊕ inserted ⊕ ids[end:]``. This is the one layout of a
    replacement: :meth:`sur_lab.session.EditSession.replace` builds its :class:`EditedContext` with it and
    :func:`replacement_edit` builds the same one from text segments.

    Args:
        ids: ``[n]`` int64 token ids of the context before the edit.
        start, end: the replaced rows, ``0 <= start < end <= n`` (integers).
        inserted: ``[m]`` int64 ids of the new content (m >= 0; an empty tensor is a plain deletion).

    Returns:
        ``(original_ids [n + m] int64, prefix_len, deleted_len)``.

    Raises:
        ValueError: naming ``start``/``end`` when the span is empty or out of ``[0, n]``; naming ``ids``/``inserted``
            as :func:`sur_lab.checks.as_token_ids`.
    """
    ids = as_token_ids(ids, "ids", allow_empty=True)
    inserted = as_token_ids(inserted, "inserted", allow_empty=True)
    a, b = as_count(start, "start"), as_count(end, "end")
    if not 0 <= a < b <= ids.numel():
        raise ValueError(f"span [start={a}, end={b}) must satisfy 0 <= start < end <= {ids.numel()}")
    m = int(inserted.numel())
    return torch.cat((ids[:a], inserted, ids[a:])), a + m, b - a


def replacement_edit(
    tokenizer,
    before: Sequence[str] | str,
    old: str,
    new: str,
    after: Sequence[str] | str,
    query_text: str,
    *,
    question: str | None = None,
    containers: tuple[tuple[int, int, str], ...] = (),
) -> EditedContext:
    """The edit that replaces the text ``old`` by ``new`` between ``before`` and ``after`` (:func:`splice_replacement`
    layout, from text segments).

    Each segment is tokenized on its own (:func:`segment_edit` with ``prefix = before ⊕ [new]``, ``deleted = old``,
    ``suffix = after``), so the original ids are ``tok(before) ⊕ tok(new) ⊕ tok(old) ⊕ tok(after)``, the prefix
    ends with the inserted text and the deleted span is the old text: exactly what
    :meth:`sur_lab.session.EditSession.replace` builds after a session holding ``tok(before) ⊕ tok(old) ⊕ tok(after)``
    replaces the old rows by ``tok(new)`` (tested). ``original_text`` is ``before + new + old + after`` and
    ``edited_text`` is ``before + new + after``; ``containers`` are character spans in ``original_text``.

    Args:
        tokenizer: a fast byte-level tokenizer (offsets required).
        before: text before the replaced span (a str or a sequence of segments, e.g. the prompt head and passages).
        old: the replaced (deleted) text; non-empty.
        new: the inserted text; non-empty.
        after: text after the replaced span (may be empty: S = 0).
        query_text: text processed after the cache (question and template tail); non-empty.
        question: relevance query for SUR (defaults to ``query_text``).
        containers: ``(start, end, kind)`` spans of ``original_text`` (mapped to the edited text).

    Returns:
        EditedContext whose ``prefix_len`` counts the inserted tokens, whose ``inserted_len`` is their number m and
        whose ``deleted_len`` counts the old ones.

    Raises:
        ValueError: naming ``new`` when it is empty or not a str; otherwise as :func:`segment_edit`.
    """
    if not isinstance(new, str) or not new:
        raise ValueError("new must be a non-empty str (a replacement inserts text; use segment_edit to delete)")
    head = [before] if isinstance(before, str) else list(before)
    edit = segment_edit(tokenizer, [*head, new], old, after, query_text, question=question, containers=containers)
    m = len(tokenize_segments(tokenizer, [new])[0][0])
    return dataclasses.replace(edit, inserted_len=m)


def _check_containers(containers, length: int) -> None:
    """Refuse container spans that are not ``(start, end, kind)`` with ``0 <= start <= end <= length`` (a reversed or
    out-of-range span would be dropped or clipped silently, changing the semantic units)."""
    for c in containers:
        ok = isinstance(c, (tuple, list)) and len(c) == 3 and isinstance(c[2], str) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in c[:2])
        if not ok or not 0 <= c[0] <= c[1] <= length:
            raise ValueError(f"containers must hold (start, end, kind) character spans with 0 <= start <= end <= "
                             f"{length} and a str kind; got {c!r}")


def _split(text: str, cuts: Sequence[int], lo: int, hi: int) -> list[str]:
    """``text[lo:hi]`` split at the cuts strictly inside it."""
    inner = sorted({c for c in cuts if lo < c < hi})
    bounds = [lo, *inner, hi]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def build_edit(
    tokenizer,
    text: str,
    query_text: str,
    span: tuple[int, int],
    *,
    question: str | None = None,
    containers: tuple[tuple[int, int, str], ...] = (),
    cuts: Sequence[int] = (),
) -> EditedContext:
    """Build an edit that deletes characters ``span = (start, end)`` of the pre-query ``text``.

    Character-span API over :func:`segment_edit`: ``text`` is cut at ``start``, ``end`` and every position in
    ``cuts``; each piece and ``query_text`` is tokenized on its own. Boundaries are kept exactly where they are given:
    when one falls inside a token of the whole-text tokenization (a BPE merge across it, or a cut mid-word), the
    tokens on either side are those of the segment tokenization, so the edited ids can differ from tokenizing the
    edited text in one call. They equal the segment tokenization of the edited text cut at the same places.

    Args:
        tokenizer: a fast byte-level tokenizer (offsets required).
        text: the rendered prompt up to the query (may contain chat-template special tokens as text).
        query_text: the rendered text after ``text`` (question and template tail); non-empty.
        span: half-open ``(start, end)`` integer character span in ``text`` to delete, ``0 <= start < end <= len(text)``.
        question: relevance query for SUR (defaults to ``query_text``), tokenized without special tokens.
        containers: ``(start, end, kind)`` character spans in ``text`` of messages / structured containers.
        cuts: extra character positions in ``text`` where a new segment begins (e.g. prompt head, passages).

    Returns:
        EditedContext with token spans, edited text, offsets and containers mapped to the edited text.

    Raises:
        ValueError: naming ``span`` when it is not a pair of integers, empty, out of range or reaches into the query;
            naming ``query_text``/``question`` when empty; naming ``cuts`` when a cut is outside ``[0, len(text)]``;
            naming ``tokenizer`` (see :func:`tokenize_segments`).
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str; got {type(text).__name__}")
    if not isinstance(query_text, str) or not query_text or (question is not None and not str(question).strip()):
        raise ValueError("query_text and question must be non-empty (empty query)")
    start, end = _check_span(span)
    if start < 0 or end > len(text) + len(query_text):
        raise ValueError(f"span=({start}, {end}) is out of range; need 0 <= start < end <= {len(text)}")
    if end > len(text):
        raise ValueError(f"span=({start}, {end}) reaches into the query, which starts at character {len(text)}")
    bad = [c for c in cuts if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= len(text)]
    if bad:
        raise ValueError(f"cuts must be integer character positions in [0, {len(text)}]; got {bad[:3]}")
    return segment_edit(
        tokenizer,
        _split(text, cuts, 0, start),
        _split(text, cuts, start, end),
        _split(text, cuts, end, len(text)),
        query_text,
        question=question,
        containers=containers,
    )


def render_chat(tokenizer, documents: str, question: str, *, instruction: str = DEFAULT_INSTRUCTION, system=None):
    """Render the chat prompt used throughout sur_lab and locate its parts.

    The user message is ``"{instruction}\\n\\n{documents}\\n\\nQuestion: {question}"``; the query (what follows the
    cached context) is ``"\\n\\nQuestion: {question}"`` plus the template's end of turn and generation prompt. The
    model's native chat template is used with ``add_generation_prompt=True`` (no reasoning mode).

    Returns:
        ``(pre_query_text, query_text, documents_start, containers)`` where ``documents_start`` is the character offset
        of ``documents`` in ``pre_query_text`` and ``containers`` are the message-content spans in it.

    Raises:
        ValueError: naming ``documents`` when it is not a str or is empty, ``question`` when empty, or when the
            template drops the documents.
    """
    _check_documents(documents)
    if not isinstance(question, str):
        raise ValueError(f"question must be a str; got {type(question).__name__}")
    if not documents.strip():
        raise ValueError("documents must be non-empty")
    if not question.strip():
        raise ValueError("question must be non-empty (empty query)")
    user = f"{instruction}\n\n{documents}" if instruction else documents
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": f"{user}\n\nQuestion: {question}"}
    ]
    # enable_thinking=False keeps reasoning templates (Qwen3) out of thinking mode; other templates ignore it.
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    user_start = rendered.rfind(user)
    if user_start < 0:
        raise ValueError("the chat template altered the documents; cannot locate them in the rendered prompt")
    doc_start = user_start + (len(user) - len(documents))
    cut = user_start + len(user)
    containers: list[tuple[int, int, str]] = []
    if system and (s := rendered.find(system)) >= 0:
        containers.append((s, s + len(system), "message"))
    elif not system:
        # Templates that insert a default system message (SmolLM2 does) still get it as its own container.
        head = rendered[:user_start]
        if "system" in head:
            containers.append((0, user_start, "message"))
    containers.append((user_start, cut, "message"))
    return rendered[:cut], rendered[cut:], doc_start, tuple(containers)


def _check_documents(documents) -> None:
    if not isinstance(documents, str):
        raise ValueError(
            f"documents must be a str (got {type(documents).__name__}); join a list of passages with "
            "format_passages(passages), which also returns each passage's deletable span"
        )


def chat_cuts(text: str, doc_start: int, documents: str) -> tuple[int, ...]:
    """Segment boundaries of a :func:`render_chat` prompt: the prompt head ends at ``doc_start``, then one segment per
    passage (:func:`passage_cuts`)."""
    return (doc_start, *(doc_start + c for c in passage_cuts(documents)))


def chat_prompt_ids(
    tokenizer, documents: str, question: str, *, instruction: str = DEFAULT_INSTRUCTION, system: str | None = None
) -> torch.Tensor:
    """``[p + S + Q]`` int64: a chat prompt tokenized by segments exactly as :func:`chat_edit` tokenizes it.

    The head (template and instruction), each passage and the query are tokenized on their own. Deleting a passage's
    span with :func:`chat_edit` leaves, token for token, this tokenization of the documents without the passage.

    Raises:
        ValueError: as :func:`render_chat`; naming ``documents`` when it is not a str.
    """
    _check_documents(documents)
    text, query_text, doc_start, _ = render_chat(tokenizer, documents, question, instruction=instruction, system=system)
    ids, _ = tokenize_segments(tokenizer, _split(text, chat_cuts(text, doc_start, documents), 0, len(text)) + [query_text])
    return torch.tensor([t for x in ids for t in x], dtype=torch.long)


def _check_chat_tokenizer(tokenizer) -> None:
    """Refuse a tokenizer that cannot render a chat (``None``, a model, a template-less tokenizer), naming it.

    Raises:
        TypeError: naming ``tokenizer`` when it has no ``apply_chat_template`` (``None`` included).
        ValueError: naming ``tokenizer`` when it has no chat template.
    """
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise TypeError(f"tokenizer must be a transformers tokenizer with a chat template (apply_chat_template); got "
                        f"{type(tokenizer).__name__}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat template; pass token ids or text segments instead")


#: A private-use character appended to a message's content to find where the template ends it (it occurs in no text).
_END_MARK = "\ue000"


def _render(tokenizer, messages, add_generation_prompt: bool, template_kwargs: dict) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )


def chat_segments(
    tokenizer, messages: Sequence[dict], *, add_generation_prompt: bool = False, template_kwargs: dict | None = None
) -> list[str]:
    """The chat template's rendering of ``messages``, cut into one text segment per message (agent prompts).

    Each boundary is located by rendering the conversation prefix, never by searching for a message's text: segment
    k ends where the rendering of ``messages[:k + 1]`` stops agreeing with the rendering of all messages (where it
    ends, for a template whose prefixes are prefixes of the whole), so each message with its template markers is a
    segment of its own and :func:`tokenize_segments` keeps message boundaries as token boundaries: a message that did
    not change tokenizes the same in every prompt that holds it, whatever the messages around it. A template that
    closes a message differently when another follows (Qwen2.5 groups consecutive tool results in one turn) cuts
    after the message's content, where the two renderings part. A template that renders an earlier message's content
    differently once another follows (some drop the reasoning of earlier turns) is not prefix-stable: the message
    cannot be located and it is refused. With ``add_generation_prompt`` the template's generation prompt is one more,
    last segment.

    Args:
        tokenizer: a tokenizer with a chat template (``apply_chat_template``).
        messages: ``{"role": ..., "content": ...}`` dicts, at least one.
        add_generation_prompt: append the assistant header (the prompt for the model's next turn).
        template_kwargs: passed to ``apply_chat_template`` (default ``{"enable_thinking": False}``, as
            :func:`render_chat`: reasoning templates out of thinking mode; other templates ignore it).

    Returns:
        Text segments whose concatenation is the whole rendering (empty segments are dropped).

    Raises:
        TypeError: naming ``tokenizer`` when it cannot render a chat (``None``); naming ``template_kwargs`` when it is
            not a dict.
        ValueError: naming ``messages`` when it is empty or holds something other than dicts with ``role`` and a
            string ``content``; naming ``tokenizer`` when it has no chat template, or when its template is not
            prefix-stable (an earlier message rendered differently once another follows).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': str} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and a str 'content'; got {m!r:.80}")
    _check_chat_tokenizer(tokenizer)
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise TypeError(f"template_kwargs must be a dict (or None); got {type(template_kwargs).__name__}")
    kwargs = {"enable_thinking": False} if template_kwargs is None else dict(template_kwargs)
    full = _render(tokenizer, messages, add_generation_prompt, kwargs)
    body = _render(tokenizer, messages, False, kwargs) if add_generation_prompt else full
    cuts, pos = [], 0
    for k in range(1, len(messages)):
        head = _render(tokenizer, messages[:k], False, kwargs)
        cut = common_prefix_len(head, body)
        if cut < len(head):
            # The renderings part before the prefix's end: fine while message k-1's content lies before the parting
            # (a closing marker that depends on what follows), not when the content itself is rendered otherwise.
            last = dict(messages[k - 1], content=messages[k - 1]["content"] + _END_MARK)
            content_end = _render(tokenizer, [*messages[: k - 1], last], False, kwargs).find(_END_MARK)
            if content_end < 0 or cut < content_end or cut < pos:
                raise ValueError(
                    f"tokenizer's chat template is not prefix-stable: it renders messages[{k - 1}] (role "
                    f"{messages[k - 1]['role']!r}) differently once another message follows (e.g. it drops the "
                    "reasoning of earlier turns), so the message cannot be located by rendering the conversation "
                    "prefix; pass the prompt as text or token ids instead"
                )
        cuts.append(cut)
        pos = cut
    if add_generation_prompt and full.startswith(body):
        cuts.append(len(body))
    bounds = [0, *cuts, len(full)]
    return [full[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def chat_edit(
    tokenizer,
    documents: str,
    question: str,
    span: tuple[int, int],
    *,
    instruction: str = DEFAULT_INSTRUCTION,
    system: str | None = None,
) -> EditedContext:
    """Build an edit of a chat prompt that deletes ``documents[span[0]:span[1]]``.

    Token segments (:func:`segment_edit`): the prompt head, each passage of ``documents`` (split after every blank-line
    run, :func:`passage_cuts`), the two ends of ``span`` and the query are tokenization boundaries, so the edit never
    depends on a BPE merge across them (module docstring). Deleting a passage span from :func:`format_passages` leaves
    exactly :func:`chat_prompt_ids` of the documents without that passage.

    Args:
        tokenizer: the model's fast tokenizer with a chat template.
        documents: context text as one str (e.g. passages joined by :func:`format_passages`); a list is refused.
        question: the next query; also the relevance query for SUR.
        span: half-open ``(start, end)`` integer character span *relative to* ``documents``.
        instruction: text before the documents in the user message.
        system: optional system message (the template's default is used otherwise).

    Raises:
        TypeError: naming ``tokenizer`` when it cannot render a chat (``None``, an object without
            ``apply_chat_template``).
        ValueError: naming ``documents`` when it is not a str or is empty; ``span`` when it is not a pair of integers,
            empty or outside ``[0, len(documents)]``; ``tokenizer`` when it has no chat template; otherwise as
            :func:`build_edit` and :func:`render_chat`.
    """
    _check_documents(documents)
    if not isinstance(question, str):
        raise ValueError(f"question must be a str; got {type(question).__name__}")
    start, end = _check_span(span)
    if not 0 <= start < end <= len(documents):
        raise ValueError(
            f"span=({start}, {end}) is out of range; need 0 <= start < end <= len(documents) = {len(documents)} "
            "(the query follows the documents and cannot be deleted)"
        )
    _check_chat_tokenizer(tokenizer)
    text, query_text, doc_start, containers = render_chat(
        tokenizer, documents, question, instruction=instruction, system=system
    )
    return build_edit(
        tokenizer,
        text,
        query_text,
        (doc_start + start, doc_start + end),
        question=question,
        containers=containers,
        cuts=chat_cuts(text, doc_start, documents),
    )


def format_passages(passages) -> tuple[str, list[tuple[int, int]]]:
    """Join passages as ``"Title: {title}\\n{text}"`` blocks separated by blank lines.

    Args:
        passages: objects with ``title`` and ``text`` attributes, or ``(title, text)`` pairs.

    Returns:
        ``(documents, spans)`` where ``spans[i]`` is the character span of passage i *including* its trailing blank
        line separator (the last passage's span ends at the end of the text), so deleting ``spans[i]`` leaves exactly
        the documents formatted without passage i.

    Raises:
        TypeError: naming ``passages`` when it is a string, or an item is neither a passage nor a ``(title, text)``
            pair of strings.
    """
    if isinstance(passages, (str, bytes)):
        raise TypeError("passages must be a sequence of passages (title/text objects or (title, text) pairs), not a "
                        "string")
    blocks = []
    for p in passages:
        title, text = (p.title, p.text) if hasattr(p, "title") and hasattr(p, "text") else (
            p if isinstance(p, (tuple, list)) and len(p) == 2 else (None, None))
        if not isinstance(title, str) or not isinstance(text, str):
            raise TypeError(f"passages must hold title/text objects or (title, text) pairs of strings; got {p!r}")
        blocks.append(f"Title: {title}\n{text.strip()}")
    spans, pos = [], 0
    for i, block in enumerate(blocks):
        sep = 2 if i < len(blocks) - 1 else 0
        spans.append((pos, pos + len(block) + sep))
        pos += len(block) + sep
    documents = "\n\n".join(blocks)
    if len(blocks) > 1:
        # The last passage owns the separator before it, so its deletion also removes that blank line.
        last0 = spans[-1][0]
        spans[-1] = (last0 - 2, len(documents))
    return documents, spans
