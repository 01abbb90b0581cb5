"""The Erratum reference operator: keep the Dirty cache, deleted text included, and prefill a short correction note
after the context and before the query (issue 26).

Source: "Models Take Notes at Prefill" (arXiv 2606.17107) reports that editing a field's own KV rows leaves the
decision stale, while appending an erratum after the context fixes it at a small cost and keeps the prefix cache
aligned. Erratum is a reference operator beside Dirty, Shift, Replay and Re-prefill
(:mod:`sur_lab.executors.sequential`): it refreshes no row; its cost is the note's tokens.

The note is text built from :class:`ErratumTemplates` (documented, parameterised, one default):

- a *deletion* (``inserted_len = 0``): the note says that the passage is withdrawn, naming it by its first words, as
  many as it takes to tell it from the text that stays (:attr:`ErratumTemplates.distinct`);
- a *replacement* (``inserted_len = m > 0``; the :func:`sur_lab.edits.splice_replacement` layout, whose prefix ends
  with the m inserted tokens): the note gives the new text, and so the new value.

The cache Erratum extends is the cache of the context *before* the edit. For a deletion that is the Dirty cache
``p ⊕ e ⊕ s`` (N rows), and the result has ``N + L`` rows (L note tokens). For a replacement an agent that appends
an erratum never inserts the new text into its context: the cache before the edit holds
:func:`pre_edit_ids` ``= ids[:p - m] ⊕ e ⊕ s`` (``N - m`` rows) and the result ``N - m + L`` rows. With
``inserted_len=0`` on a replacement edit the operator extends the layout's own Dirty cache (new text, then old text),
which already contains the new value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from sur_lab.cache_ops import cache_length, clone_cache
from sur_lab.checks import as_count, as_token_ids, check_batch_one, check_vocab
from sur_lab.edits import EditedContext, tokenize_segments
from sur_lab.forward import forward_tokens
from sur_lab.models import LoadedModel


@dataclass(frozen=True)
class ErratumTemplates:
    """Templates of the correction note (Python ``str.format`` fields).

    Attributes:
        deletion: note for a deletion; field ``{excerpt}``: the deleted text's first ``excerpt_words`` words
            (whitespace collapsed, with ``"..."`` appended when cut).
        update: note for a replacement; fields ``{inserted}`` (the inserted text, stripped) and ``{excerpt}`` (the
            replaced text's first words, as above). The default gives the new text alone, so the note never restates
            the old value.
        excerpt_words: words of the deleted text quoted in ``{excerpt}`` (>= 1). Keep it short enough that the
            excerpt does not reach the old value.
        distinct: a deletion's excerpt grows word by word past ``excerpt_words`` until it no longer occurs in the
            edited text (whitespace collapsed), so the note says *which* passage is withdrawn: of two needles that
            share their first words, the note quotes the withdrawn one up to its value (issue 40). A replacement's
            excerpt keeps ``excerpt_words``.

    Both templates start with a blank line: the note continues the user message after the documents, before
    ``"\\n\\nQuestion: ..."`` (:func:`sur_lab.edits.render_chat`).

    Raises:
        ValueError: naming ``excerpt_words`` when it is not an integer >= 1, ``distinct`` when not a bool, or
            ``deletion``/``update`` when a template is empty or uses a field other than the ones above.
    """

    deletion: str = '\n\nCorrection: the passage above that begins "{excerpt}" is withdrawn. Disregard it.'
    update: str = "\n\nCorrection, this supersedes the notes above: {inserted}"
    excerpt_words: int = 6
    distinct: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.excerpt_words, bool) or not isinstance(self.excerpt_words, int) or self.excerpt_words < 1:
            raise ValueError(f"excerpt_words must be an integer >= 1; got {self.excerpt_words!r}")
        if not isinstance(self.distinct, bool):
            raise ValueError(f"distinct must be a bool; got {self.distinct!r}")
        for name in ("deletion", "update"):
            template = getattr(self, name)
            if not isinstance(template, str) or not template.strip():
                raise ValueError(f"{name} must be a non-empty template string")
            try:
                template.format(excerpt="x", inserted="y")
            except (KeyError, IndexError) as err:
                raise ValueError(f"{name}={template!r} uses a field other than {{excerpt}} and {{inserted}}: {err}") \
                    from None


#: The default note templates.
DEFAULT_ERRATUM = ErratumTemplates()
#: Note templates by name: the Erratum reference operator takes ``options["erratum_template"]`` (default
#: ``"default"``) and its records carry the name (``note_template``). ``"restate"`` also quotes the replaced text's
#: first words (a note that names what it supersedes); ``"terse"`` is a bare correction.
ERRATUM_TEMPLATES: dict[str, ErratumTemplates] = {
    "default": DEFAULT_ERRATUM,
    "restate": ErratumTemplates(
        update='\n\nCorrection, this supersedes the passage that begins "{excerpt}": {inserted}'),
    "terse": ErratumTemplates(deletion='\n\nIgnore the passage "{excerpt}".', update="\n\nUpdate: {inserted}"),
}


def erratum_templates(name: str) -> ErratumTemplates:
    """The note templates registered as ``name`` in :data:`ERRATUM_TEMPLATES`.

    Raises:
        ValueError: naming ``erratum_template`` and listing the registered names.
    """
    if name not in ERRATUM_TEMPLATES:
        raise ValueError(f"erratum_template={name!r} is not one of {', '.join(ERRATUM_TEMPLATES)}")
    return ERRATUM_TEMPLATES[name]


def _excerpt(text: str, words: int, distinct_from: str | None = None) -> str:
    """The first ``words`` words of ``text`` (``"..."`` appended when cut); with ``distinct_from``, as many more words
    as it takes for the excerpt not to occur in it (whitespace collapsed; the whole text at most)."""
    parts = text.split()
    if distinct_from is not None:
        other = " ".join(distinct_from.split())
        while words < len(parts) and " ".join(parts[:words]) in other:
            words += 1
    head = " ".join(parts[:words])
    return head + "..." if len(parts) > words else head


def _check_inserted(edit: EditedContext, inserted_len) -> int:
    """m: ``inserted_len``, or the edit's own ``inserted_len`` when ``None``; checked against ``prefix_len``."""
    m = edit.inserted_len if inserted_len is None else as_count(inserted_len, "inserted_len")
    if m > edit.prefix_len:
        raise ValueError(f"inserted_len={m} exceeds the edit's prefix_len={edit.prefix_len} (the inserted tokens end "
                         "the prefix)")
    return m


def erratum_note(
    edit: EditedContext, *, inserted_len: int | None = None, templates: ErratumTemplates = DEFAULT_ERRATUM
) -> str:
    """The correction note of ``edit``: ``templates.deletion`` for a deletion, ``templates.update`` for a replacement.

    Args:
        edit: a text edit (:func:`sur_lab.edits.segment_edit`, :func:`sur_lab.edits.replacement_edit`,
            :func:`sur_lab.edits.chat_edit`): ``original_text``, ``original_offsets`` and ``deleted_char_span`` set.
        inserted_len: m, tokens at the end of the prefix that the edit inserted (0: a deletion; ``None``: the edit's
            own ``inserted_len``). The inserted text is ``original_text`` from the first inserted token's start to the
            deleted span's start.
        templates: the note templates.

    Returns:
        The note text (starts with a blank line with the default templates).

    Raises:
        ValueError: naming ``edit`` when it carries no text (a token-level edit), ``inserted_len`` when it is negative,
            not an integer or larger than ``prefix_len``.
    """
    if edit.original_text is None or edit.deleted_char_span is None or edit.original_offsets is None:
        raise ValueError("edit has no text (a token-level edit); build the note text yourself and pass its ids")
    m = _check_inserted(edit, inserted_len)
    start, end = edit.deleted_char_span
    if m == 0:
        kept = edit.original_text[:start] + edit.original_text[end:]
        excerpt = _excerpt(edit.original_text[start:end], templates.excerpt_words,
                           kept if templates.distinct else None)
        return templates.deletion.format(excerpt=excerpt, inserted="")
    excerpt = _excerpt(edit.original_text[start:end], templates.excerpt_words)
    ins_start = edit.original_offsets[edit.prefix_len - m][0]
    inserted = edit.original_text[ins_start:start].strip()
    return templates.update.format(excerpt=excerpt, inserted=inserted)


def erratum_note_ids(tokenizer, note: str) -> torch.Tensor:
    """``[L]`` int64: the note tokenized as its own segment, no special tokens (:func:`~sur_lab.edits.tokenize_segments`)

    Raises:
        ValueError: naming ``note`` when it is empty or produces no token; naming ``tokenizer`` as
            :func:`~sur_lab.edits.tokenize_segments`.
    """
    if not isinstance(note, str) or not note:
        raise ValueError("note must be a non-empty str")
    ids = tokenize_segments(tokenizer, [note])[0][0]
    if not ids:
        raise ValueError(f"note={note[:40]!r} produces no token")
    return torch.tensor(ids, dtype=torch.long)


def pre_edit_ids(edit: EditedContext, inserted_len: int | None = None) -> torch.Tensor:
    """``[N - m]`` int64: the context before the edit, ``original_ids`` without the m inserted tokens
    ``[p - m, p)`` (a deletion, m = 0: ``original_ids`` itself, a copy). ``inserted_len=None`` (default) takes the
    edit's own ``inserted_len``.

    Raises:
        ValueError: naming ``inserted_len`` when it is negative, not an integer or larger than ``prefix_len``.
    """
    m = _check_inserted(edit, inserted_len)
    p = edit.prefix_len
    return torch.cat((edit.original_ids[: p - m], edit.original_ids[p:]))


def erratum(
    lm: LoadedModel, dirty_cache: DynamicCache, edit: EditedContext, note_ids, *, inserted_len: int | None = None
) -> DynamicCache:
    """Erratum: the cache of the context before the edit, kept whole (deleted rows included), extended by a prefill
    of the correction note at positions ``n .. n + L - 1`` (issue 26; arXiv 2606.17107).

    No row of ``dirty_cache`` is recomputed or moved (no re-rotation); the note's rows attend to every cached row,
    the deleted span included. The cost is the L note tokens.

    Args:
        lm: the model.
        dirty_cache: prefill of :func:`pre_edit_ids` ``(edit, inserted_len)``: ``n = N - inserted_len`` rows,
            ``[1, H_kv, n, d_h]`` per layer (for a deletion, the Dirty cache of :func:`sur_lab.executors.dirty`);
            not modified.
        edit: the edit (its query follows the note).
        note_ids: ``[L]`` integer ids of the note, L >= 1 (:func:`erratum_note_ids` of :func:`erratum_note`).
        inserted_len: m, tokens at the end of the prefix that the edit inserted (0 for a deletion; ``None``: the
            edit's own ``inserted_len``).

    Returns:
        A new cache of ``N - inserted_len + L`` rows; process ``edit.query_ids`` after it.

    Raises:
        ValueError: naming ``dirty_cache`` when it holds a batch of several sequences or not ``N - inserted_len``
            rows; naming ``note_ids`` when empty, not 1-D or outside the vocabulary; naming ``inserted_len`` as
            :func:`pre_edit_ids` — all before any forward.
        TypeError: naming ``note_ids`` when the ids are not integers.
    """
    m = _check_inserted(edit, inserted_len)
    check_batch_one(dirty_cache, "dirty_cache")
    n = edit.num_tokens - m
    if cache_length(dirty_cache) != n:
        raise ValueError(
            f"dirty_cache has {cache_length(dirty_cache)} rows; the context before the edit has N - inserted_len = "
            f"{edit.num_tokens} - {m} = {n}"
        )
    note = as_token_ids(note_ids, "note_ids")
    check_vocab(note, lm.spec.vocab_size, "note_ids")
    out = clone_cache(dirty_cache)
    forward_tokens(lm, note, out, logits="none")
    return out
