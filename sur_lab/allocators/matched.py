"""The matched-token protocol (appendix 9.3, Table 14; issue 28): token-level allocators get exactly the region
allocator's count on each case.

Table 14 compares region-level against token-level selection "at matched selected-token counts". Here the region
allocator (SUR, or any variant name) runs first on a case's request; every token-level allocator then runs on the same
request with the exact allowance ``n = |support|`` of that selection (:meth:`AllocationRequest.with_allowance`), so the
comparison differs only in which positions are chosen. How n is set is the count rule (:data:`COUNT_RULES`,
:func:`region_count`): ``"selected"``, the region allocator's own count (with the paper's suffix budget SUR fills B
exactly and n = B, so the comparison is Table 12's at the same B; another n only for a region variant with another
budget convention, e.g. ``allowance_base="prompt"``), or ``"whole_units"``, SUR's natural stopping point (whole units
in its ranked order until B is reached, :func:`sur_lab.allocators.sur.whole_unit_count`): n differs between cases and
from B, and SUR given n as an exact allowance selects exactly those whole units (issue 40).
"""

from __future__ import annotations

from collections.abc import Sequence

from sur_lab.allocators.base import (
    AllocationRequest,
    Selection,
    allocate,
    allowance_for,
    get_allocator,
    read_options,
    resolve_method,
)
from sur_lab.allocators.sur import aggregate_units, scores_with_bonus, whole_unit_count

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


#: How the matched count n of a case is set: the region allocator's own selected count, or SUR's whole-unit stopping
#: point (:func:`region_count`).
COUNT_RULES = ("selected", "whole_units")


def check_region(region: str, count: str) -> None:
    """Refuse, before any work, what :func:`region_count` cannot count: an unknown ``region``, a ``count`` outside
    :data:`COUNT_RULES`, or a ``region`` that is not SUR or a SUR variant under ``"whole_units"``.

    Raises:
        ValueError: naming ``region`` or ``count``.
    """
    get_allocator(region)
    if count not in COUNT_RULES:
        raise ValueError(f"count={count!r} must be one of {COUNT_RULES}")
    if count == "whole_units" and resolve_method(region)[0] != "SUR":
        raise ValueError(f"region={region!r}: count='whole_units' ranks SUR's units; give SUR or a SUR variant")


def region_count(region: str, request: AllocationRequest, count: str = "whole_units") -> int:
    """The matched count n of ``request`` for region allocator ``region`` under rule ``count``.

    ``"selected"``: the count ``allocate(region, request)`` selects (:func:`sur_lab.allocators.allowance_for`: B of
    Eq. 3, on the whole-prompt base when the name binds ``allowance_base=prompt``). ``"whole_units"``: SUR's natural
    stopping point at that B (:func:`sur_lab.allocators.sur.whole_unit_count`) under the region's own options (its
    aggregation and bonus rank the units; the partial-unit rule plays no part), so ``B <= n <= S``; SUR at the exact
    allowance n then selects the same whole units.

    Args:
        region: a region allocator or variant name; ``"whole_units"`` needs SUR or a SUR variant (``"SUR"``,
            ``"SUR-IDF"``, ``"SUR[aggregation=mean,...]"``).
        request: the case's request (its ``budget_pct`` or ``allowance`` sets B). Units computed here are kept on it.
        count: one of :data:`COUNT_RULES`.

    Returns:
        n, an integer in ``[0, S]``.

    Raises:
        ValueError: naming ``count`` when it is not one of :data:`COUNT_RULES`, or ``region`` when it is unknown or,
            for ``"whole_units"``, not SUR or a SUR variant (before any scoring).
    """
    check_region(region, count)
    if count == "selected":
        return allowance_for(region, request)
    bound = resolve_method(region)[1]
    call = request.with_options(bound) if bound else request
    if call.allowance == 0:
        return 0
    options = read_options(call, "SUR")
    scores, _ = scores_with_bonus(call, options["bonus"])
    units = call.get_units()
    if request.units is None:
        request.units = units
    return whole_unit_count(units, aggregate_units(scores, units, options["aggregation"]), call.allowance)


def matched_token_selections(
    request: AllocationRequest,
    region: str = "SUR",
    token_level: Sequence[str] = ("Dense tokens",),
    count: str = "selected",
) -> dict[str, Selection]:
    """Run ``region`` at the matched count n (:func:`region_count`), then each of ``token_level`` with exactly n.

    Args:
        request: the case's request (its ``budget_pct``/``allowance`` decide B, from which n follows).
        region: a region allocator or variant name (``"SUR"``, ``"SUR-IDF"``, ``"SUR[aggregation=mean]"``).
        token_level: allocator or variant names given the region's count (e.g. :data:`TOKEN_LEVEL_ALLOCATORS`; the
            attention-derived ones need ``request.shift_cache``).
        count: the count rule (:data:`COUNT_RULES`): ``"selected"`` runs ``region`` on ``request`` as it is;
            ``"whole_units"`` runs it at the exact allowance n (its whole units, no partial window).

    Returns:
        ``{name: Selection}`` in the order region, then ``token_level``; every token-level support has exactly
        ``selections[region].support.size`` positions.

    Raises:
        ValueError: for an unknown name (every name is checked before any allocator runs), ``region`` listed in
            ``token_level``, or a bad ``count`` (as :func:`region_count`).
    """
    for name in (region, *token_level):
        get_allocator(name)
    if region in token_level:
        raise ValueError(f"region={region!r} is also in token_level")
    if count not in COUNT_RULES:
        raise ValueError(f"count={count!r} must be one of {COUNT_RULES}")
    if count == "selected":
        out = {region: allocate(region, request)}
    else:
        out = {region: allocate(region, request.with_allowance(region_count(region, request, count)))}
    matched = request.with_allowance(out[region].support.size)
    for name in token_level:
        out[name] = allocate(name, matched)
    if request.units is None and matched.units is not None:
        request.units = matched.units
    return out
