"""The four matched controls of the allocation study (section 4.1, appendix 7.4, Table 12).

All four spend no extra forward tokens and share SUR's inputs:

- ``"Dense tokens"``: the top-B individual positions by SUR's token score r_i (Eq. 7).
- ``"Max-relevance contiguous"``: the width-B suffix window with the largest summed r_i, earliest tie.
- ``"BM25 (same units)"``: lexical BM25 scores of SUR's exact units, broadcast to tokens and passed through SUR's unit
  allocator (:func:`sur_lab.allocators.sur.allocate_units`).
- ``"Random semantic units"``: SUR's units in a case-fixed random order, with a random exact-width window in the last
  admitted unit.

Dense tokens, the single window and SUR compare support organization under one token score and allowance; random
units test query direction; BM25 tests another relevance rule with the same units and allocator.
"""

from __future__ import annotations

import re

import numpy as np

from sur_lab.allocators.base import (
    AllocationRequest,
    Selection,
    register_allocator,
    top_b,
)
from sur_lab.allocators.sur import allocate_units, sur_token_scores
from sur_lab.budget import Support
from sur_lab.edits import EditedContext
from sur_lab.units import Unit

#: BM25 term-frequency saturation (appendix 7.4).
BM25_K1 = 1.2
#: BM25 length normalization b_BM25 (appendix 7.4).
BM25_B = 0.75

_TERM = re.compile(r"[a-z0-9]+")


def _empty(S: int) -> Selection:
    return Selection(Support(np.zeros(0, dtype=np.int64), S))


@register_allocator("Dense tokens")
def dense_tokens(request: AllocationRequest) -> Selection:
    """Top-B suffix positions by SUR's token score r_i (Eq. 7), earlier position first among ties (appendix 7.4).

    Diagnostics: ``token_scores`` float32 ``[S]``.
    """
    S, B = request.suffix_len, request.allowance
    if B == 0:
        return _empty(S)
    scores = sur_token_scores(request)
    return Selection(Support(top_b(scores, B), S), diagnostics={"token_scores": scores})


def max_sum_window(scores: np.ndarray, width: int) -> int:
    """Start of the width-``width`` window of ``scores`` ``[S]`` with the largest sum, earliest maximizer.

    Each window is summed on its own in float64 (not by prefix-sum differences) so equal windows compare exactly equal.

    Raises:
        ValueError: if ``width`` is not in ``[1, S]``.
    """
    n = len(scores)
    if not 1 <= width <= n:
        raise ValueError(f"width={width} must be in [1, {n}]")
    sums = np.lib.stride_tricks.sliding_window_view(np.asarray(scores, dtype=np.float64), width).sum(axis=1)
    return int(np.argmax(sums))


@register_allocator("Max-relevance contiguous")
def max_relevance_contiguous(request: AllocationRequest) -> Selection:
    """The single width-B suffix window maximizing the summed SUR token score, earliest tie (appendix 7.4).

    Diagnostics: ``token_scores`` float32 ``[S]``, ``window_start`` (suffix-local).
    """
    S, B = request.suffix_len, request.allowance
    if B == 0:
        return _empty(S)
    scores = sur_token_scores(request)
    start = max_sum_window(scores, B)
    return Selection(
        Support(np.arange(start, start + B, dtype=np.int64), S),
        diagnostics={"token_scores": scores, "window_start": start},
    )


def bm25_terms(text: str) -> list[str]:
    """Lowercase ASCII-alphanumeric terms of ``text``, in order, repeats kept (appendix 7.4)."""
    return _TERM.findall(text.lower())


def bm25_scores(
    query_terms: list[str], documents: list[list[str]], *, k1: float = BM25_K1, b: float = BM25_B
) -> np.ndarray:
    """BM25 score of each document for a query whose repeated terms each contribute (appendix 7.4).

    ``score(D) = sum over query terms t, with multiplicity, of idf(t) * tf(t, D) / (tf(t, D) + k1 (1 - b + b |D| /
    avgdl))`` with the Lucene idf ``ln(1 + (n - df(t) + 0.5) / (df(t) + 0.5))`` over the n documents. The paper fixes
    k1, b, the terms and the multiplicity rule but not the idf variant; Lucene's is non-negative, and its tf factor
    omits Robertson's constant ``(k1 + 1)``, which leaves every ranking unchanged. Computed with ``bm25s``
    (``method="lucene"``, float64): its ``get_scores`` sums one contribution per query-term occurrence, which is the
    multiplicity rule, and drops terms absent from every document (they would contribute 0).

    Args:
        query_terms: query terms (see :func:`bm25_terms`).
        documents: each document's terms.
        k1: term-frequency saturation (1.2).
        b: length normalization (0.75).

    Returns:
        float64 ``[n]`` (zeros when the query has no term present in any document, or every document is empty).

    Raises:
        ValueError: if ``documents`` is empty.
    """
    if not documents:
        raise ValueError("documents must contain at least one document")
    vocab = {t for doc in documents for t in doc}
    present = [t for t in query_terms if t in vocab]
    if not present:
        return np.zeros(len(documents), dtype=np.float64)
    import bm25s

    index = bm25s.BM25(k1=k1, b=b, method="lucene", dtype="float64")
    index.index(documents, show_progress=False)
    return np.asarray(index.get_scores(present), dtype=np.float64)


def unit_terms(edit: EditedContext, units: list[Unit]) -> tuple[list[str], list[list[str]]]:
    """BM25 terms of the relevance query and of each unit's text.

    A unit's text is the edited text from its first token's start to its last token's end (token offsets). Token-level
    edits (no text) fall back to token-id terms (``"t{id}"``) for both query and units.
    """
    p = edit.prefix_len
    if edit.edited_text is None or edit.edited_offsets is None or edit.question is None:
        query = [f"t{int(t)}" for t in edit.relevance_ids]
        ids = edit.suffix_ids
        return query, [[f"t{int(t)}" for t in ids[u.start : u.end]] for u in units]
    text, offsets = edit.edited_text, edit.edited_offsets
    docs = [bm25_terms(text[offsets[p + u.start][0] : offsets[p + u.end - 1][1]]) for u in units]
    return bm25_terms(edit.question), docs


@register_allocator("BM25 (same units)")
def bm25_same_units(request: AllocationRequest) -> Selection:
    """BM25 over SUR's units, unit score broadcast to its tokens, then SUR's unit allocator (appendix 7.4).

    With a constant token score inside a unit, the forward envelope (Eq. 8) is flat and the partial unit's window is
    its first ``w`` tokens (earliest maximizer).

    Diagnostics: ``units``, ``unit_scores`` float64 ``[U]``, ``admitted``, ``partial``.
    """
    S, B = request.suffix_len, request.allowance
    if B == 0:
        return _empty(S)
    units = request.get_units()
    query, docs = unit_terms(request.edit, units)
    u_scores = bm25_scores(query, docs)
    token_scores = np.repeat(u_scores, [len(u) for u in units])
    positions, admitted, partial = allocate_units(units, token_scores, u_scores, B)
    return Selection(
        Support(positions, S),
        diagnostics={"units": units, "unit_scores": u_scores, "admitted": admitted, "partial": partial},
    )


@register_allocator("Random semantic units")
def random_semantic_units(request: AllocationRequest) -> Selection:
    """SUR's units in a random order from the case-fixed ``request.seed``; whole units are admitted until the next one
    exceeds the remaining allowance w, which gets a uniformly random width-w window (appendix 7.4).

    The permutation depends only on the seed and the number of units, so one case's supports at increasing budgets
    share their admitted units.

    Diagnostics: ``units``, ``order`` (the permutation), ``admitted``, ``partial``, ``window_start``.
    """
    S, B = request.suffix_len, request.allowance
    if B == 0:
        return _empty(S)
    units = request.get_units()
    rng = np.random.default_rng(request.seed)
    order = rng.permutation(len(units))
    chosen, admitted, partial, window = [], [], None, None
    remaining = B
    for idx in order:
        u = units[int(idx)]
        if len(u) <= remaining:
            chosen.append(np.arange(u.start, u.end))
            admitted.append(int(idx))
            remaining -= len(u)
        else:
            window = u.start + int(rng.integers(0, len(u) - remaining + 1))
            chosen.append(np.arange(window, window + remaining))
            partial = int(idx)
            remaining = 0
        if remaining == 0:
            break
    positions = np.sort(np.concatenate(chosen)).astype(np.int64)
    return Selection(
        Support(positions, S),
        diagnostics={"units": units, "order": order, "admitted": admitted, "partial": partial, "window_start": window},
    )
