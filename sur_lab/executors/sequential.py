"""The reference executor, ``"sequential"`` (interval-wise maximal-interval replay, appendix 7.1 "Sparse refresh"),
and the dense reference operators built on the same forwards: Dirty, Shift (Eq. 2), Replay and Re-prefill.

Faster executors (packed, :mod:`sur_lab.executors.packed`) are checked against this one.
"""

from __future__ import annotations

from transformers import DynamicCache

from sur_lab.budget import Support
from sur_lab.cache_ops import (
    cache_length,
    clone_cache,
    shift_cache,
    shift_cache_,
    slice_rows,
    to_tensors,
    write_rows_,
)
from sur_lab.edits import EditedContext
from sur_lab.executors.registry import check_batch_one, check_support, register_executor
from sur_lab.forward import forward_tokens, prefill
from sur_lab.models import LoadedModel


@register_executor("sequential")
def refresh_sequential(
    lm: LoadedModel, shift: DynamicCache, edit: EditedContext, support: Support, *, inplace: bool = False
) -> DynamicCache:
    """Interval-wise sparse refresh, the reference executor (appendix 7.1, "Sparse refresh").

    Starting from a clone of the Shift cache, for each maximal interval ``[a, b)`` of the support in order: copy the
    current cache prefix ``[0, a)``, forward the edited tokens ``x⁻[a:b]`` against it, and write the resulting K/V rows
    back into ``[a, b)`` at every layer. Earlier refreshed intervals are visible to later ones; future rows are absent
    from each forward; all unselected rows stay bitwise those of Shift.

    Args:
        lm: the model.
        shift: Shift cache of ``p ⊕ s`` (``p + S`` rows); not modified unless ``inplace``.
        edit: the edit.
        support: suffix-local positions to refresh.
        inplace: refresh ``shift`` itself (no output clone; the input is consumed and returned). Registered as
            ``"sequential-inplace"``. Bitwise equal to the cloning path.

    Returns:
        A new cache of ``p + S`` rows (``shift`` itself when ``inplace``).

    Raises:
        ValueError: see :func:`check_support`.
    """
    check_support(edit, support, shift)
    out = shift if inplace else clone_cache(shift)
    ids = edit.edited_ids
    p = edit.prefix_len
    for a, b in support.intervals:
        start, end = p + a, p + b
        work = slice_rows(out, 0, start)
        forward_tokens(lm, ids[start:end], work, logits="none")
        write_rows_(out, start, [(k[:, :, start:end], v[:, :, start:end]) for k, v in to_tensors(work)])
    return out


def dirty(lm: LoadedModel, edit: EditedContext) -> DynamicCache:
    """Dirty: prefill of the original pre-query tokens ``p ⊕ e ⊕ s`` (the untreated cache, N rows)."""
    return prefill(lm, edit.original_ids)[0]


def shift(lm: LoadedModel, dirty_cache: DynamicCache, edit: EditedContext) -> DynamicCache:
    """Shift: drop the span's K/V and re-rotate the suffix keys by ``-d`` (Eq. 2); ``dirty_cache`` is not modified.

    Raises:
        ValueError: if ``dirty_cache`` does not hold the edit's N rows, or holds a batch of several sequences.
    """
    check_batch_one(dirty_cache, "dirty_cache")
    if cache_length(dirty_cache) != edit.num_tokens:
        raise ValueError(f"dirty_cache has {cache_length(dirty_cache)} rows; the edit's context has {edit.num_tokens}")
    return shift_cache(dirty_cache, edit.prefix_len, edit.deleted_len, lm.inv_freq)


@register_executor("sequential-inplace")
def refresh_sequential_inplace(lm: LoadedModel, shift: DynamicCache, edit: EditedContext, support: Support):
    """Registered executor ``"sequential-inplace"``: :func:`refresh_sequential` with ``inplace=True`` (consumes
    ``shift``)."""
    return refresh_sequential(lm, shift, edit, support, inplace=True)


def shift_inplace(lm: LoadedModel, dirty_cache: DynamicCache, edit: EditedContext) -> DynamicCache:
    """In-place Shift of a Dirty cache the caller gives up (:func:`sur_lab.cache_ops.shift_cache_`): bitwise equal
    to :func:`shift`, with one compaction copy per layer instead of a new cache. ``dirty_cache`` is consumed and
    returned, now holding ``p + S`` rows.

    Raises:
        ValueError: if ``dirty_cache`` does not hold the edit's N rows (before anything is modified).
    """
    if cache_length(dirty_cache) != edit.num_tokens:
        raise ValueError(f"dirty_cache has {cache_length(dirty_cache)} rows; the edit's context has {edit.num_tokens}")
    return shift_cache_(dirty_cache, edit.prefix_len, edit.deleted_len, lm.inv_freq)


def replay(lm: LoadedModel, cache: DynamicCache, edit: EditedContext) -> DynamicCache:
    """Replay: the valid prefix rows ``[0, p)`` of ``cache`` (Dirty or Shift) plus a full recompute of the suffix.

    ``cache`` is not modified. Returns a new cache of ``p + S`` rows.

    Raises:
        ValueError: naming ``cache`` when it holds a batch of several sequences; if it has fewer than p rows.
    """
    check_batch_one(cache, "cache")
    out = slice_rows(cache, 0, edit.prefix_len)
    if edit.suffix_len:
        forward_tokens(lm, edit.suffix_ids, out, logits="none")
    return out


def reprefill(lm: LoadedModel, edit: EditedContext) -> DynamicCache:
    """Re-prefill: rebuild the complete edited prompt ``p ⊕ s`` from an empty cache."""
    return prefill(lm, edit.edited_ids)[0]
