"""Semantic-Unit Refresh (SUR): frozen-embedding relevance, semantic units, whole-unit admission and a forward-envelope
window for the remainder (section 3.2, appendix 7.3, Algorithm 1 steps 4–9).

Ties. Appendix 7.3 ranks units by score "with earlier position breaking ties". Eq. 1's identical-token bonus makes
ties common: every suffix token that also occurs in the query scores ``cos + 0.25 = 1.25``, stopwords included, so many
units reach the top-4 mean of 1.25 and differ only by fp32 cosine rounding (~1e-7), which depends on the BLAS and the
CPU. Unit scores are therefore compared after rounding to :data:`TIE_DECIMALS` decimal places (a 1e-5 grid, a hundred
times the fp32 rounding of an O(1) score), and the earlier unit wins among equal rounded scores. The number of tied
units is reported in the diagnostics (``tied_units``).

Variants are options of the one allocator (read from ``AllocationRequest.options`` or bound by a variant name such as
``"SUR[aggregation=mean]"``); the defaults are the paper's SUR:

- ``aggregation``: ``"top4"`` (a unit's score is the mean of its four highest token scores; section 3.2, appendix 7.3)
  or ``"mean"`` (the mean of all its token scores; the "mean aggregation" variant of appendix 9.3);
- ``partial_unit``: ``"forward"`` (the unit that does not fit gets the width-w window with the largest forward-envelope
  sum, Eq. 8) or ``"prefix"`` (its first w tokens; the "prefix partial unit" of appendix 9.3);
- ``bonus``: the identical-token bonus of Eq. 1 / Eq. 7: ``"paper"`` (0.25·1[s_i ∈ q]), ``"idf"`` (0.25·w_i·1[s_i ∈ q]
  with the context IDF weight w_i of :func:`context_idf_weights`; not in the paper, issue 13) or ``"off"`` (no bonus:
  the max cosine alone);
- the allowance base (appendix 9.3's "whole-prompt allowance") is the request's ``allowance_base``
  (:class:`~sur_lab.allocators.base.AllocationRequest`), bindable in a variant name (``"SUR[allowance_base=prompt]"``):
  it sets B, which the dispatcher and the exact-allowance check must know, so it is not a ranking option.

``"SUR-IDF"`` is registered as the variant ``SUR[bonus=idf]``.
"""

from __future__ import annotations

import numpy as np
import torch

from sur_lab.allocators.base import (
    AllocationRequest,
    AllocatorOption,
    Selection,
    empty_selection,
    read_options,
    register_allocator,
    register_variant,
)
from sur_lab.budget import Support
from sur_lab.units import Unit

#: Identical-token bonus of Eq. 1 / Eq. 7.
IDENTICAL_TOKEN_BONUS = 0.25
#: Forward-envelope decay per token of Eq. 8 (e^{-1/16}).
ENVELOPE_DECAY = float(np.exp(-1.0 / 16.0))
#: Suffix tokens scored per block (appendix 7.3).
RELEVANCE_BLOCK = 1024
#: Token scores averaged into a unit score (the four highest).
UNIT_TOP_K = 4
#: Unit scores are compared after rounding to this many decimal places; equal rounded scores are ties, broken by the
#: earlier position (appendix 7.3). fp32 cosine rounding of an O(1) score is ~1e-7, far below the 1e-5 grid.
TIE_DECIMALS = 5

#: Unit-score aggregations: the paper's top-four mean (appendix 7.3) and the mean of all token scores (appendix 9.3).
AGGREGATIONS = ("top4", "mean")
#: Partial-unit rules: the forward-envelope window (Eq. 8) and the unit's first tokens (appendix 9.3).
PARTIAL_UNITS = ("forward", "prefix")
#: Identical-token bonus rules: Eq. 1's, IDF-weighted (SUR-IDF, not in the paper), none.
BONUSES = ("paper", "idf", "off")

AGGREGATION_OPTION = AllocatorOption(
    "aggregation", "top4", AGGREGATIONS,
    doc="unit score: mean of the 4 highest token scores (appendix 7.3) or of all (mean aggregation, appendix 9.3)",
)
PARTIAL_UNIT_OPTION = AllocatorOption(
    "partial_unit", "forward", PARTIAL_UNITS,
    doc="unit that does not fit: best forward-envelope window (Eq. 8) or its first w tokens (prefix, appendix 9.3)",
)
BONUS_OPTION = AllocatorOption(
    "bonus", "paper", BONUSES,
    doc="identical-token bonus: 0.25 (Eq. 1), 0.25 x context IDF weight (SUR-IDF, issue 13) or none",
)
#: The options of SUR (and of the controls that score and allocate like it).
SUR_OPTIONS = (AGGREGATION_OPTION, PARTIAL_UNIT_OPTION, BONUS_OPTION)


@torch.inference_mode()
def token_relevance(
    embedding: torch.Tensor,
    suffix_ids: torch.Tensor,
    query_ids: torch.Tensor,
    *,
    block: int = RELEVANCE_BLOCK,
    bonus_weights: np.ndarray | None = None,
) -> np.ndarray:
    """SUR token scores r_i = max_j cos(E(s_i), E(q_j)) + 0.25·w_i·1[s_i ∈ q] (Eq. 1, Eq. 7; w_i = 1 in the paper).

    Args:
        embedding: ``[V, H]`` the model's frozen input-embedding table (any float dtype; scored in FP32).
        suffix_ids: ``[S]`` int64 retained suffix tokens.
        query_ids: ``[Q]`` int64 query tokens (tokenized without special tokens), Q >= 1.
        block: suffix tokens per block (1,024 in the paper), bounds memory at ``block × Q`` floats.
        bonus_weights: optional ``[S]`` weights w_i in [0, 1] of the identical-token bonus (``"SUR-IDF"``);
            ``None`` is the paper's w_i = 1.

    Returns:
        float32 array ``[S]``.

    Raises:
        ValueError: if ``query_ids`` is empty.
    """
    if query_ids.numel() == 0:
        raise ValueError("query_ids is empty (empty query)")
    if bonus_weights is not None and len(bonus_weights) != suffix_ids.numel():
        raise ValueError(f"bonus_weights has {len(bonus_weights)} entries; the suffix has {suffix_ids.numel()}")
    weights = torch.ones(suffix_ids.numel()) if bonus_weights is None else torch.as_tensor(bonus_weights).float()
    q = torch.nn.functional.normalize(embedding[query_ids].float(), dim=-1)  # (Q, H)
    q_set = torch.unique(query_ids)
    out = torch.empty(suffix_ids.numel(), dtype=torch.float32)
    for lo in range(0, suffix_ids.numel(), block):
        ids = suffix_ids[lo : lo + block]
        s = torch.nn.functional.normalize(embedding[ids].float(), dim=-1)  # (b, H)
        cos = (s @ q.T).amax(dim=1)
        bonus = IDENTICAL_TOKEN_BONUS * weights[lo : lo + block] * torch.isin(ids, q_set).float().cpu()
        out[lo : lo + block] = cos.cpu() + bonus
    return out.numpy()


def unit_scores(token_scores: np.ndarray, units: list[Unit], k: int | None = UNIT_TOP_K) -> np.ndarray:
    """Mean of each unit's ``k`` highest token scores (all of them when the unit is shorter, or when ``k`` is
    ``None``); float64 ``[U]``. Units must be non-empty."""
    out = np.empty(len(units), dtype=np.float64)
    for i, u in enumerate(units):
        vals = np.asarray(token_scores[u.start : u.end], dtype=np.float64)
        top = np.sort(vals)[-k:] if k is not None and len(vals) > k else vals
        out[i] = top.mean()
    return out


def aggregate_units(token_scores: np.ndarray, units: list[Unit], aggregation: str = "top4") -> np.ndarray:
    """Unit scores by ``aggregation``: ``"top4"`` (appendix 7.3) or ``"mean"`` (appendix 9.3); float64 ``[U]``.

    Raises:
        ValueError: naming ``aggregation`` when it is not one of :data:`AGGREGATIONS`.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}; got {aggregation!r}")
    return unit_scores(token_scores, units, UNIT_TOP_K if aggregation == "top4" else None)


def forward_envelope(scores: np.ndarray) -> np.ndarray:
    """Forward-decaying relevance envelope of Eq. 8 over one unit's token scores.

    ``u_t = max(exp(r_t - r_max), e^{-1/16} u_{t-1})`` with ``u_0 = 0`` and ``r_max`` the unit's largest score.
    Returns float64 ``[n]``.
    """
    r = np.asarray(scores, dtype=np.float64)
    peaks = np.exp(r - r.max())
    env = np.empty_like(peaks)
    prev = 0.0
    for t, value in enumerate(peaks):
        prev = max(value, ENVELOPE_DECAY * prev)
        env[t] = prev
    return env


def best_window(scores: np.ndarray, width: int) -> int:
    """Start offset of the width-``width`` window with the largest envelope sum (Eq. 8), earliest maximizer.

    Each window is summed on its own (not by prefix-sum differences) so equal windows compare exactly equal.

    Raises:
        ValueError: if ``width`` is not in ``[1, len(scores)]``.
    """
    n = len(scores)
    if not 1 <= width <= n:
        raise ValueError(f"width={width} must be in [1, {n}]")
    env = forward_envelope(scores)
    sums = np.lib.stride_tricks.sliding_window_view(env, width).sum(axis=1)
    return int(np.argmax(sums))


def rounded_scores(scores: np.ndarray, decimals: int = TIE_DECIMALS) -> np.ndarray:
    """Unit scores as compared by the ranking: float64, rounded half-to-even to ``decimals`` places."""
    return np.round(np.asarray(scores, dtype=np.float64), decimals)


def rank_units(scores: np.ndarray, units: list[Unit], decimals: int = TIE_DECIMALS) -> np.ndarray:
    """Unit indices by decreasing score rounded to ``decimals`` places, earlier position first among ties (appendix
    7.3); int64 ``[U]``."""
    starts = np.array([u.start for u in units], dtype=np.int64)
    return np.lexsort((starts, -rounded_scores(scores, decimals)))


def count_tied_units(scores: np.ndarray, decimals: int = TIE_DECIMALS) -> int:
    """Number of units whose rounded score equals at least one other unit's (0 when every score is distinct)."""
    _, counts = np.unique(rounded_scores(scores, decimals), return_counts=True)
    return int(counts[counts > 1].sum())


def allocate_units(
    units: list[Unit],
    token_scores: np.ndarray,
    unit_score: np.ndarray,
    budget: int,
    *,
    partial_unit: str = "forward",
) -> tuple[np.ndarray, list[int], int | None]:
    """Admit whole units in ranked order, then an exact-width window of the next unit (Algorithm 1, 6–8).

    Args:
        units: disjoint non-empty units (partitioning the suffix, or the part of it being allocated).
        token_scores: ``[S]`` per-token scores (used by the window rule).
        unit_score: ``[U]`` unit scores used for ranking.
        budget: B, positions to select (0 <= B <= the units' total length).
        partial_unit: the window in the unit that does not fit: ``"forward"``, the best forward-envelope window
            (:func:`best_window`, Eq. 8), or ``"prefix"``, its first tokens (appendix 9.3).

    Returns:
        ``(positions, admitted_unit_indices, partial_unit_index_or_None)`` with ``positions`` sorted int64 ``[B]``.

    Raises:
        ValueError: naming ``partial_unit`` when it is not one of :data:`PARTIAL_UNITS`.
    """
    if partial_unit not in PARTIAL_UNITS:
        raise ValueError(f"partial_unit must be one of {PARTIAL_UNITS}; got {partial_unit!r}")
    chosen: list[np.ndarray] = []
    admitted: list[int] = []
    partial = None
    remaining = budget
    for idx in rank_units(unit_score, units):
        if remaining == 0:
            break
        u = units[idx]
        if len(u) <= remaining:
            chosen.append(np.arange(u.start, u.end))
            admitted.append(int(idx))
            remaining -= len(u)
        else:
            off = best_window(token_scores[u.start : u.end], remaining) if partial_unit == "forward" else 0
            chosen.append(np.arange(u.start + off, u.start + off + remaining))
            partial = int(idx)
            remaining = 0
    positions = np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, dtype=np.int64)
    return positions.astype(np.int64), admitted, partial


def whole_unit_count(units: list[Unit], unit_score: np.ndarray, budget: int) -> int:
    """SUR's natural stopping point at allowance ``budget``: the total length of the units admitted *whole* in SUR's
    ranked order (:func:`rank_units`, the tie rule included) until that total first reaches ``budget``; the unit that
    crosses ``budget`` is admitted whole instead of windowed (our reading of the "SUR V1" of appendix 9.3 / Table 14,
    whose count is not fixed by the budget: it ends on a unit boundary).

    Given this count n as an exact allowance, :func:`allocate_units` admits exactly the same units and no partial
    window (each fits, and the allowance is used up after the last), so SUR at allowance n *is* the whole-unit
    selection, and the matched-token protocol can hand n to token-level allocators (issue 40).

    Args:
        units: disjoint non-empty units (SUR's, partitioning the suffix).
        unit_score: ``[U]`` unit scores used for ranking (:func:`aggregate_units`).
        budget: B, an integer in ``[0, total units length]``.

    Returns:
        n, an integer with ``budget <= n <= total units length`` (0 when ``budget`` is 0; ``n - budget`` is less than
        the crossing unit's length).

    Raises:
        ValueError: naming ``budget`` when it is negative or exceeds the units' total length, or ``unit_score`` when
            its length differs from ``units``'.
    """
    total = sum(len(u) for u in units)
    if isinstance(budget, bool) or int(budget) != budget or not 0 <= budget <= total:
        raise ValueError(f"budget={budget!r} must be an integer in [0, {total}] (the units' total length)")
    if len(unit_score) != len(units):
        raise ValueError(f"unit_score has {len(unit_score)} entries for {len(units)} units")
    count = 0
    for idx in rank_units(unit_score, units):
        if count >= budget:
            break
        count += len(units[idx])
    return int(count)


def sur_token_scores(request: AllocationRequest, bonus_weights: np.ndarray | None = None) -> np.ndarray:
    """SUR's token scores for the request's suffix (Eq. 7), float32 ``[S]``; ``bonus_weights`` as in
    :func:`token_relevance` (``None``: the paper's bonus)."""
    edit = request.edit
    embedding = request.lm.model.get_input_embeddings().weight
    return token_relevance(
        embedding,
        edit.suffix_ids.to(embedding.device),
        edit.relevance_ids.to(embedding.device),
        bonus_weights=bonus_weights,
    )


def context_idf_weights(edit) -> np.ndarray:
    """Identical-token bonus weights of ``"SUR-IDF"``: w_i = log((N + 1) / c(s_i)) / log(N + 1), float64 ``[S]``.

    ``c(t)`` counts token t in the edited pre-query context ``p ⊕ s`` (N = p + S tokens), so a token that occurs once
    gets w close to 1 and a token that makes up the whole context gets w = log((N+1)/N)/log(N+1), close to 0.
    """
    ids = edit.edited_ids.cpu().numpy()
    n = len(ids)
    values, counts = np.unique(ids, return_counts=True)
    suffix = edit.suffix_ids.cpu().numpy()
    c = counts[np.searchsorted(values, suffix)].astype(np.float64)
    return np.log((n + 1) / c) / np.log(n + 1)


def bonus_weights(edit, bonus: str = "paper") -> np.ndarray | None:
    """Weights w_i of the identical-token bonus ``0.25·w_i·1[s_i ∈ q]`` for rule ``bonus``.

    Returns:
        ``None`` for ``"paper"`` (w_i = 1, Eq. 1), :func:`context_idf_weights` for ``"idf"``, float64 zeros ``[S]``
        for ``"off"`` (no bonus: r_i is the max cosine alone).

    Raises:
        ValueError: naming ``bonus`` when it is not one of :data:`BONUSES`.
    """
    if bonus not in BONUSES:
        raise ValueError(f"bonus must be one of {BONUSES}; got {bonus!r}")
    if bonus == "paper":
        return None
    if bonus == "idf":
        return context_idf_weights(edit)
    return np.zeros(edit.suffix_len, dtype=np.float64)


def scores_with_bonus(request: AllocationRequest, bonus: str = "paper") -> tuple[np.ndarray, np.ndarray | None]:
    """SUR's token scores under bonus rule ``bonus`` and the bonus weights used: ``(float32 [S], float64 [S] | None)``.

    Raises:
        ValueError: naming ``bonus`` when it is not one of :data:`BONUSES`.
    """
    weights = bonus_weights(request.edit, bonus)
    return sur_token_scores(request, weights), weights


def allocate_regions(
    regions: list[Unit],
    token_scores: np.ndarray,
    budget: int,
    *,
    aggregation: str = "top4",
    partial_unit: str = "forward",
) -> tuple[np.ndarray, dict]:
    """SUR's region allocation over ``regions``: aggregate, rank (tie rule), admit whole, window the next one.

    Args:
        regions: disjoint non-empty regions (SUR's units, fixed blocks, or units clipped to part of the suffix).
        token_scores: ``[S]`` token scores.
        budget: positions to select, ``0 <= budget <=`` the regions' total length.
        aggregation: :func:`aggregate_units` rule.
        partial_unit: :func:`allocate_units` rule.

    Returns:
        ``(positions sorted int64 [budget], diagnostics)`` with ``units``, ``unit_scores``, ``admitted``, ``partial``,
        ``tied_units`` and ``tie_decimals``.
    """
    u_scores = aggregate_units(token_scores, regions, aggregation)
    positions, admitted, partial = allocate_units(regions, token_scores, u_scores, budget, partial_unit=partial_unit)
    return positions, {
        "units": regions,
        "unit_scores": u_scores,
        "admitted": admitted,
        "partial": partial,
        "tied_units": count_tied_units(u_scores),
        "tie_decimals": TIE_DECIMALS,
    }


def sur_selection(request: AllocationRequest, options: dict, regions: list[Unit] | None = None) -> Selection:
    """SUR's selection with resolved ``options`` (``aggregation``, ``partial_unit``, ``bonus``) over ``regions``
    (default: the request's semantic units); the shared body of :func:`sur` and the region controls.

    Diagnostics: ``token_scores`` ``[S]``, ``units``, ``unit_scores`` ``[U]``, ``admitted`` (region indices admitted
    whole, in rank order), ``partial`` (the windowed region or ``None``), ``tied_units``, ``tie_decimals``,
    ``options`` (the resolved options and the request's ``allowance_base``), and ``bonus_weights`` ``[S]`` with the
    IDF bonus.
    """
    S, B = request.suffix_len, request.allowance
    if B == 0:
        return empty_selection(S, tied_units=0)
    scores, weights = scores_with_bonus(request, options["bonus"])
    regions = request.get_units() if regions is None else regions
    positions, diag = allocate_regions(
        regions, scores, B, aggregation=options["aggregation"], partial_unit=options["partial_unit"]
    )
    extra = {"bonus_weights": weights} if options["bonus"] == "idf" else {}
    return Selection(
        Support(positions, S),
        diagnostics={
            "token_scores": scores, **diag, "options": {**options, "allowance_base": request.allowance_base}, **extra,
        },
    )


@register_allocator("SUR", options=SUR_OPTIONS)
def sur(request: AllocationRequest) -> Selection:
    """Semantic-Unit Refresh (section 3.2, appendix 7.3, Algorithm 1 steps 4–9), with the appendix 9.3 variants as
    options (module docstring); the defaults are the paper's SUR.

    Units are ranked by their score rounded to :data:`TIE_DECIMALS` places, earlier position first among ties.
    Diagnostics: as :func:`sur_selection`.

    Raises:
        ValueError: naming an option of ``request.options`` whose value is not allowed.
    """
    return sur_selection(request, read_options(request, "SUR"))


#: ``"SUR-IDF"``: SUR with the IDF-weighted identical-token bonus (a variant, not the paper's SUR; issue 13). Eq. 1's
#: bonus 0.25·1[s_i ∈ q] becomes 0.25·w_i·1[s_i ∈ q] with w_i from :func:`context_idf_weights` (the edited context's
#: own token counts), so query stopwords repeated across the context no longer lift every unit to the saturated score
#: 1.25. Units, ranking (with the same tie rule), admission and the window are SUR's. Diagnostics: as SUR's, with
#: ``bonus_weights``.
sur_idf = register_variant("SUR-IDF", "SUR", bonus="idf")
