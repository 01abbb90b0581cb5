"""Edit-local allocators: the contiguous window right after the edit, alone or sharing the allowance with SUR (beyond
the paper; issue 26).

"Contiguity, Not Importance" (arXiv 2609.17983) reports that recomputing a contiguous window starting right after an
edit recovers most of the post-edit answer margin, and that the advantage fades when the answer-bearing text lies far
downstream. Its baseline is not SUR's "Max-relevance contiguous" (a query-relevant window anywhere in the suffix).

Where the window starts. An :class:`~sur_lab.edits.EditedContext` is ``p ⊕ e ⊕ s``: suffix position 0 is the first
retained token after the deleted span. For a replacement built by :meth:`sur_lab.session.EditSession.replace`, the
inserted tokens are prefilled fresh and belong to the prefix p, so suffix position 0 is the first token after the
inserted text. Either way the edit-local window is suffix positions ``[0, B)``.

- ``"Edit-local window"``: ``[0, B)``. B = S is the whole suffix (Replay through the dispatcher's B = S rule).
- ``"Edit-local + SUR"``: ``W = ⌈B · local_share⌉`` positions ``[0, W)`` (option ``local_share``, default 0.5), and the
  other ``B − W`` chosen by SUR over the rest of the suffix ``[W, S)``: SUR's semantic units clipped to ``[W, S)``
  (a unit cut by the window keeps its remaining tokens), scored, ranked and allocated as SUR does (SUR's
  ``aggregation``, ``partial_unit`` and ``bonus`` options apply). The two parts are disjoint, so the total is exactly
  B. ``local_share=0`` is SUR; ``local_share=1`` is the edit-local window.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from sur_lab.allocators.base import (
    AllocationRequest,
    AllocatorOption,
    Selection,
    empty_selection,
    read_options,
    register_allocator,
)
from sur_lab.allocators.sur import SUR_OPTIONS, allocate_regions, scores_with_bonus
from sur_lab.budget import Support
from sur_lab.units import Unit

#: Default share of the allowance given to the edit-local window by ``"Edit-local + SUR"`` (issue 26: "half").
LOCAL_SHARE = 0.5


def _share(value) -> float:
    """Parse the ``local_share`` option: a number in [0, 1] (text from a variant name is read as a decimal)."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"option local_share={value!r}; allowed: a number in [0, 1]")
    try:
        share = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"option local_share={value!r}; allowed: a number in [0, 1]") from None
    if not 0.0 <= share <= 1.0:  # NaN fails both comparisons
        raise ValueError(f"option local_share={value!r}; allowed: a number in [0, 1]")
    return share


LOCAL_SHARE_OPTION = AllocatorOption(
    "local_share", LOCAL_SHARE, parse=_share,
    doc="share of the allowance given to the edit-local window; the rest goes to SUR (issue 26)",
)


def local_allowance(budget: int, share: float) -> int:
    """``W = ⌈B · share⌉``, the edit-local part of ``budget`` (exact: ``share`` is read as its decimal value, as Eq. 3
    reads b), so that an odd B gives the window the extra position."""
    return min(budget, math.ceil(budget * Fraction(str(float(share)))))


def clip_units(units: list[Unit], start: int) -> list[Unit]:
    """The units restricted to positions ``>= start``: units ending at or before ``start`` are dropped, a unit that
    straddles it keeps its tokens from ``start`` on."""
    return [Unit(max(u.start, start), u.end, u.container, u.kind) for u in units if u.end > start]


@register_allocator("Edit-local window")
def edit_local_window(request: AllocationRequest) -> Selection:
    """The B suffix positions right after the edit, ``[0, B)`` (module docstring; issue 26, after arXiv 2609.17983).

    Diagnostics: ``window`` = ``(0, B)``.
    """
    S, B = request.suffix_len, request.allowance
    return Selection(Support(np.arange(B, dtype=np.int64), S), diagnostics={"window": (0, B)})


@register_allocator("Edit-local + SUR", options=(LOCAL_SHARE_OPTION, *SUR_OPTIONS))
def edit_local_plus_sur(request: AllocationRequest) -> Selection:
    """``⌈B · local_share⌉`` positions right after the edit, the rest by SUR over the remaining suffix (module
    docstring; issue 26).

    Diagnostics: ``window`` = ``(0, W)``, ``local_allowance`` W, ``sur_allowance`` B − W, and SUR's (``token_scores``,
    ``units`` clipped to ``[W, S)``, ``unit_scores``, ``admitted``, ``partial``, ``tied_units``, ``tie_decimals``) when
    B − W > 0.

    Raises:
        ValueError: naming an option whose value is not allowed.
    """
    options = read_options(request, "Edit-local + SUR")
    S, B = request.suffix_len, request.allowance
    if B == 0:
        return empty_selection(S, window=(0, 0), local_allowance=0, sur_allowance=0)
    W = local_allowance(B, options["local_share"])
    diagnostics: dict = {"window": (0, W), "local_allowance": W, "sur_allowance": B - W}
    positions = np.arange(W, dtype=np.int64)
    if B > W:
        scores, weights = scores_with_bonus(request, options["bonus"])
        rest, sur_diag = allocate_regions(
            clip_units(request.get_units(), W), scores, B - W,
            aggregation=options["aggregation"], partial_unit=options["partial_unit"],
        )
        positions = np.concatenate((positions, rest))
        diagnostics.update(token_scores=scores, **sur_diag)
        if weights is not None and options["bonus"] == "idf":
            diagnostics["bonus_weights"] = weights
    return Selection(Support(positions, S), diagnostics=diagnostics)
