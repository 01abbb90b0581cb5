"""The matched controls of the allocation study: the paper's four (section 4.1, appendix 7.4, Table 12) and two it
lacked (appendix 9.3: "without matched fixed-block and multiple-local-window controls, these results do not establish
a unique advantage for linguistic boundaries"; issue 28).

All spend no extra forward tokens and share SUR's inputs:

- ``"Dense tokens"``: the top-B individual positions by SUR's token score r_i (Eq. 7).
- ``"Max-relevance contiguous"``: the width-B suffix window with the largest summed r_i, earliest tie.
- ``"BM25 (same units)"``: lexical BM25 scores of SUR's exact units, broadcast to tokens and passed through SUR's unit
  allocator (:func:`sur_lab.allocators.sur.allocate_units`).
- ``"Random semantic units"``: SUR's units in a case-fixed random order, with a random exact-width window in the last
  admitted unit.

- ``"Fixed blocks"`` (beyond the paper): the suffix cut into equal token blocks instead of semantic units, scored,
  ranked and allocated exactly like SUR's units (:func:`fixed_blocks`).
- ``"Multiple local windows"`` (beyond the paper): k contiguous windows placed around the highest-scoring tokens, with
  no text boundaries (:func:`local_windows`); by default k is the number of intervals SUR's support has on the same
  request, so only the placement rule differs.

Dense tokens, the single window and SUR compare support organization under one token score and allowance; random
units test query direction; BM25 tests another relevance rule with the same units and allocator; fixed blocks and
multiple local windows test whether linguistic boundaries matter beyond regions of the same granularity or the same
number of intervals. Every control takes the request's allowance, so with an exact ``allowance`` they are compared at
matched token counts. Dense tokens, the single window and the two new controls read SUR's ``bonus`` option.
"""

from __future__ import annotations

import re

import numpy as np

from sur_lab.allocators.base import (
    AllocationRequest,
    AllocatorOption,
    Selection,
    read_options,
    register_allocator,
    top_b,
)
from sur_lab.allocators.sur import (
    AGGREGATION_OPTION,
    BONUS_OPTION,
    PARTIAL_UNIT_OPTION,
    allocate_units,
    scores_with_bonus,
    sur_selection,
)
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


@register_allocator("Dense tokens", options=(BONUS_OPTION,))
def dense_tokens(request: AllocationRequest) -> Selection:
    """Top-B suffix positions by SUR's token score r_i (Eq. 7), earlier position first among ties (appendix 7.4).

    Option ``bonus`` as SUR's. Diagnostics: ``token_scores`` float32 ``[S]``.
    """
    S, B = request.suffix_len, request.allowance
    if B == 0:
        return _empty(S)
    scores, _ = scores_with_bonus(request, read_options(request, "Dense tokens")["bonus"])
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


@register_allocator("Max-relevance contiguous", options=(BONUS_OPTION,))
def max_relevance_contiguous(request: AllocationRequest) -> Selection:
    """The single width-B suffix window maximizing the summed SUR token score, earliest tie (appendix 7.4).

    Option ``bonus`` as SUR's. Diagnostics: ``token_scores`` float32 ``[S]``, ``window_start`` (suffix-local).
    """
    S, B = request.suffix_len, request.allowance
    if B == 0:
        return _empty(S)
    scores, _ = scores_with_bonus(request, read_options(request, "Max-relevance contiguous")["bonus"])
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
    # import cost: bm25s (~0.2 s) is loaded only when a BM25 control runs, not by `import sur_lab`
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


# ---------------------------------------------------------------------------------------------------------------------
# Controls beyond the paper (appendix 9.3's missing controls; issue 28)


def _block_len(value) -> int | str:
    """Parse the ``block_len`` option: ``"units"`` or a positive integer (tokens)."""
    if value == "units":
        return "units"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"option block_len={value!r}; allowed: 'units' or an integer >= 1 (tokens)")
    return int(value)


def _window_count(value) -> int | str:
    """Parse the ``windows`` option: ``"sur"`` or a positive integer."""
    if value == "sur":
        return "sur"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"option windows={value!r}; allowed: 'sur' or an integer >= 1")
    return int(value)


BLOCK_LEN_OPTION = AllocatorOption(
    "block_len", "units", parse=_block_len,
    doc="tokens per block, or 'units': as many equal blocks as SUR has units on the case (its mean unit length)",
)
WINDOWS_OPTION = AllocatorOption(
    "windows", "sur", parse=_window_count,
    doc="number of windows k, or 'sur': as many as SUR's support has intervals on the same request",
)


def fixed_blocks(suffix_len: int, num_blocks: int) -> list[Unit]:
    """Cut ``[0, S)`` into ``num_blocks`` contiguous blocks whose lengths differ by at most one (longer first).

    Returns:
        Units (``container`` = block index, ``kind="block"``) partitioning the suffix; ``[]`` when S = 0.

    Raises:
        ValueError: if ``num_blocks`` is not in ``[1, S]`` (for S >= 1).
    """
    if suffix_len == 0:
        return []
    if not 1 <= num_blocks <= suffix_len:
        raise ValueError(f"num_blocks={num_blocks} must be in [1, {suffix_len}]")
    base, extra = divmod(suffix_len, num_blocks)
    out, pos = [], 0
    for i in range(num_blocks):
        size = base + (1 if i < extra else 0)
        out.append(Unit(pos, pos + size, i, "block"))
        pos += size
    return out


def block_count(request: AllocationRequest, block_len: int | str) -> int:
    """Blocks for the request's suffix: ``ceil(S / block_len)``, or SUR's unit count for ``"units"`` (>= 1 when
    S >= 1)."""
    S = request.suffix_len
    if block_len == "units":
        return len(request.get_units())
    return -(-S // int(block_len))


@register_allocator("Fixed blocks", options=(BLOCK_LEN_OPTION, AGGREGATION_OPTION, PARTIAL_UNIT_OPTION, BONUS_OPTION))
def fixed_blocks_control(request: AllocationRequest) -> Selection:
    """SUR with its semantic units replaced by equal token blocks (a matched control beyond the paper; appendix 9.3).

    The suffix is cut into :func:`fixed_blocks` (by default as many as SUR has units on this case, so the mean region
    length matches; ``block_len=L`` gives ``ceil(S / L)`` blocks of at most L tokens); blocks are scored, ranked, admitted
    and windowed exactly like units (:func:`sur_lab.allocators.sur.sur_selection`, with SUR's ``aggregation``,
    ``partial_unit`` and ``bonus`` options). Block boundaries ignore text, message and container boundaries.

    Diagnostics: as SUR's (``units`` holds the blocks), plus ``block_len`` (the option) and ``num_blocks``.
    """
    options = read_options(request, "Fixed blocks")
    S = request.suffix_len
    if request.allowance == 0:
        return _empty(S)
    blocks = fixed_blocks(S, block_count(request, options["block_len"]))
    sur_options = {k: options[k] for k in ("aggregation", "partial_unit", "bonus")}
    selection = sur_selection(request, sur_options, regions=blocks)
    selection.diagnostics.update(block_len=options["block_len"], num_blocks=len(blocks))
    return selection


def local_windows(scores: np.ndarray, budget: int, num_windows: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Place ``num_windows`` contiguous windows of ``budget`` positions in total around the highest-scoring tokens.

    The widths are ``budget`` split into ``k = min(num_windows, budget)`` parts differing by at most one (larger
    first). Each window in turn: its anchor is the highest-scoring position not yet chosen (earlier first among
    ties); the window lies inside the maximal run of unchosen positions holding the anchor, centred on it (the anchor
    at offset ``(w - 1) // 2``, so an even width reaches one token further forward) and shifted inward at the run's
    ends. When the run is shorter than the width, the whole run is taken and the shortfall is added to the next
    window's width (or to a further window after the last), so exactly ``budget`` positions are chosen.

    Args:
        scores: ``[S]`` token scores.
        budget: positions to choose, ``0 <= budget <= S``.
        num_windows: k >= 1.

    Returns:
        ``(positions sorted int64 [budget], windows)`` with ``windows`` the placed ``(start, end)`` in placement order.

    Raises:
        ValueError: if ``budget`` is outside ``[0, S]`` or ``num_windows`` < 1.
    """
    S = len(scores)
    if not 0 <= budget <= S:
        raise ValueError(f"budget={budget} must be in [0, {S}]")
    if num_windows < 1:
        raise ValueError(f"num_windows={num_windows} must be >= 1")
    if budget == 0:
        return np.zeros(0, dtype=np.int64), []
    k = min(num_windows, budget)
    base, extra = divmod(budget, k)
    widths = [base + (1 if i < extra else 0) for i in range(k)]
    order = np.lexsort((np.arange(S), -np.asarray(scores, dtype=np.float64)))  # best first, earlier among ties
    chosen = np.zeros(S, dtype=bool)
    windows: list[tuple[int, int]] = []
    spent, carry, j, cursor = 0, 0, 0, 0
    while spent < budget:
        width = (widths[j] if j < k else 0) + carry
        j += 1
        while chosen[order[cursor]]:
            cursor += 1
        anchor = int(order[cursor])
        lo, hi = anchor, anchor + 1
        while lo > 0 and not chosen[lo - 1]:
            lo -= 1
        while hi < S and not chosen[hi]:
            hi += 1
        w = min(width, hi - lo)
        start = min(max(anchor - (w - 1) // 2, lo), hi - w)
        chosen[start : start + w] = True
        windows.append((start, start + w))
        spent += w
        carry = width - w
    return np.flatnonzero(chosen).astype(np.int64), windows


@register_allocator("Multiple local windows", options=(WINDOWS_OPTION, BONUS_OPTION))
def multiple_local_windows(request: AllocationRequest) -> Selection:
    """k windows around the top-scoring tokens by SUR's token score (a matched control beyond the paper; appendix
    9.3), :func:`local_windows`.

    ``windows="sur"`` (default) sets k to the number of intervals of SUR's support on the same request (same
    allowance and ``bonus``, SUR's other options at their defaults), so the control differs from SUR only in where
    its contiguous regions are placed: around top tokens instead of along text boundaries.

    Diagnostics: ``token_scores`` float32 ``[S]``, ``windows`` (placed ``(start, end)``), ``num_windows`` (k).
    """
    options = read_options(request, "Multiple local windows")
    S, B = request.suffix_len, request.allowance
    if B == 0:
        return _empty(S)
    scores, _ = scores_with_bonus(request, options["bonus"])
    k = options["windows"]
    if k == "sur":
        sur_opts = {"aggregation": "top4", "partial_unit": "forward", "bonus": options["bonus"]}
        k = sur_selection(request, sur_opts).support.num_intervals
    positions, windows = local_windows(scores, B, int(k))
    return Selection(Support(positions, S), diagnostics={"token_scores": scores, "windows": windows, "num_windows": k})
