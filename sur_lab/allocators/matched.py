"""The matched-token protocol (appendix 9.3, Table 14; issue 28): token-level allocators get exactly the region
allocator's count on each case.

Table 14 compares region-level against token-level selection "at matched selected-token counts". Here the region
allocator (SUR, or any variant name) runs first on a case's request; every token-level allocator then runs on the same
request with the exact allowance ``n = |support|`` of that selection (:meth:`AllocationRequest.with_allowance`), so the
comparison differs only in which positions are chosen. With the paper's suffix budget SUR fills B exactly and n = B;
the protocol matters when the region allocator's count comes from another convention (e.g. ``allowance_base="prompt"``)
or when the study fixes support sizes (``AllocationRequest(..., allowance=n)``).
"""

from __future__ import annotations

from collections.abc import Sequence

from sur_lab.allocators.base import AllocationRequest, Selection, allocate, get_allocator

#: Allocators that choose individual positions by a per-token score (top-B with earlier-position ties; Dense tokens
#: and the Table 1 rows that do so). SpecCache-Adapted (spans) and the region allocators are not among them.
TOKEN_LEVEL_ALLOCATORS = (
    "Dense tokens",
    "ProphetKV-Adapted",
    "InfoFlow-Motivated",
    "Cache-Craft-Adapted",
    "CacheBlend-Adapted",
    "A3-Adapted",
    "LegoLink-Adapted",
    "CacheTune-Adapted",
    "Clean-state oracle",
)


def matched_token_selections(
    request: AllocationRequest,
    region: str = "SUR",
    token_level: Sequence[str] = ("Dense tokens",),
) -> dict[str, Selection]:
    """Run ``region`` on ``request``, then each of ``token_level`` with exactly the region's selected count.

    Args:
        request: the case's request (its ``budget_pct``/``allowance`` decide the region allocator's count).
        region: a region allocator or variant name (``"SUR"``, ``"SUR-IDF"``, ``"SUR[aggregation=mean]"``).
        token_level: allocator or variant names given the region's count (e.g. :data:`TOKEN_LEVEL_ALLOCATORS`; the
            attention-derived ones need ``request.shift_cache``).

    Returns:
        ``{name: Selection}`` in the order region, then ``token_level``; every token-level support has exactly
        ``selections[region].support.size`` positions.

    Raises:
        ValueError: for an unknown name (every name is checked before any allocator runs), or ``region`` listed in
            ``token_level``.
    """
    for name in (region, *token_level):
        get_allocator(name)
    if region in token_level:
        raise ValueError(f"region={region!r} is also in token_level")
    out = {region: allocate(region, request)}
    matched = request.with_allowance(out[region].support.size)
    for name in token_level:
        out[name] = allocate(name, matched)
    if request.units is None and matched.units is not None:
        request.units = matched.units
    return out
