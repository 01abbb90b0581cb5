"""The reference executor, ``"sequential"`` (interval-wise maximal-interval replay, appendix 7.1 "Sparse refresh"),
and the dense reference operators built on the same forwards: Dirty, Shift (Eq. 2), Replay and Re-prefill.

Faster executors (packed, :mod:`sur_lab.executors.packed`) are checked against this one.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from sur_lab.budget import Support
from sur_lab.cache_ops import (
    cache_length,
    clone_cache,
    from_tensors,
    rerotate_keys,
    shift_cache,
    shift_cache_,
    slice_rows,
    to_tensors,
    write_rows_,
)
from sur_lab.edits import EditedContext
from sur_lab.executors.erratum import pre_edit_ids
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
    """Dirty: prefill of the context *before* the edit, the untreated cache.

    For a deletion that is the original pre-query tokens ``p ⊕ e ⊕ s`` (N rows). For a replacement
    (``edit.inserted_len = m > 0``, the :func:`sur_lab.edits.splice_replacement` layout) it is
    :func:`sur_lab.executors.erratum.pre_edit_ids`: ``original_ids`` without the m inserted tokens (N - m rows: the old
    value in place, the new one absent), which is the cache an agent held when it made the edit
    (:class:`sur_lab.session.EditSession`).
    """
    if edit.inserted_len:
        return prefill(lm, pre_edit_ids(edit))[0]
    return prefill(lm, edit.original_ids)[0]


def dirty_rows(edit: EditedContext) -> int:
    """Rows of the edit's Dirty cache (:func:`dirty`): ``N - inserted_len``."""
    return edit.num_tokens - edit.inserted_len


def insert_rows(lm: LoadedModel, layers, start: int, inserted) -> list:
    """K/V rows of ``inserted`` prefilled at positions ``start .. start + m - 1`` against rows ``[0, start)`` of
    ``layers`` (the unchanged prefix of a replacement): the new text's rows, as a prefill of ``prefix ⊕ inserted``
    computes them. The one place a replacement's inserted rows are computed (:func:`shift` of a replacement and
    :meth:`sur_lab.session.EditSession.replace` both call it).

    Args:
        lm: the model.
        layers: per layer ``(K, V)``, ``[1, H_kv, >= start, d_h]``; only rows ``[0, start)`` are read; not modified.
        start: the first inserted position (the prefix length before the insertion), >= 0.
        inserted: ``[m]`` int64 ids, m >= 1.

    Returns:
        Per layer ``(K, V)`` of shape ``[1, H_kv, m, d_h]`` (keys rotated to their positions).
    """
    work = from_tensors([(k[:, :, :start], v[:, :, :start]) for k, v in layers])
    forward_tokens(lm, inserted, work, logits="none")
    return [(k[:, :, start:], v[:, :, start:]) for k, v in to_tensors(work)]


def _check_dirty(dirty_cache: DynamicCache, edit: EditedContext) -> None:
    check_batch_one(dirty_cache, "dirty_cache")
    n = dirty_rows(edit)
    if cache_length(dirty_cache) != n:
        what = "the edit's context has" if not edit.inserted_len else "the context before the replacement has N - m ="
        raise ValueError(f"dirty_cache has {cache_length(dirty_cache)} rows; {what} {n}")


def shift(lm: LoadedModel, dirty_cache: DynamicCache, edit: EditedContext) -> DynamicCache:
    """Shift: drop the span's K/V and re-rotate the suffix keys by ``-d`` (Eq. 2); ``dirty_cache`` is not modified.

    For a replacement (``edit.inserted_len = m > 0``) ``dirty_cache`` is the cache before the edit (:func:`dirty`,
    ``N - m`` rows: prefix ``[0, p - m)``, old span, suffix): the old span's rows are dropped, the new text's m rows
    are prefilled at positions ``p - m .. p - 1`` against the prefix (:func:`insert_rows`), and the suffix keys are
    re-rotated by ``m - d``. No suffix row is recomputed: the suffix saw only the old value, as in an agent's cache
    (:meth:`sur_lab.session.EditSession.replace` builds the same cache). Its cost includes the m-token prefill.

    Returns:
        A new cache of ``p + S`` rows.

    Raises:
        ValueError: if ``dirty_cache`` does not hold :func:`dirty_rows` rows, or holds a batch of several sequences.
    """
    _check_dirty(dirty_cache, edit)
    m = edit.inserted_len
    if not m:
        return shift_cache(dirty_cache, edit.prefix_len, edit.deleted_len, lm.inv_freq)
    a, d = edit.prefix_len - m, edit.deleted_len
    kv = to_tensors(dirty_cache)
    new_rows = insert_rows(lm, kv, a, edit.original_ids[a : edit.prefix_len])
    layers = []
    for (k, v), (ki, vi) in zip(kv, new_rows):
        suffix_k = rerotate_keys(k[:, :, a + d :], m - d, lm.inv_freq)
        layers.append((torch.cat((k[:, :, :a], ki, suffix_k), dim=2), torch.cat((v[:, :, :a], vi, v[:, :, a + d :]),
                                                                                 dim=2)))
    return from_tensors(layers)


def valid_prefix(lm: LoadedModel, dirty_cache: DynamicCache, edit: EditedContext) -> DynamicCache:
    """The edited context's valid prefix ``[0, p)`` from the Dirty cache, as a new cache: its first p rows (a
    deletion), or its first ``p - m`` rows plus the m inserted rows (:func:`insert_rows`; a replacement). Replay from
    the Dirty cache (Algorithm 1 step 2) continues it with the suffix.

    Raises:
        ValueError: as :func:`shift`.
    """
    _check_dirty(dirty_cache, edit)
    m = edit.inserted_len
    if not m:
        return slice_rows(dirty_cache, 0, edit.prefix_len)
    a = edit.prefix_len - m
    kv = to_tensors(dirty_cache)
    new_rows = insert_rows(lm, kv, a, edit.original_ids[a : edit.prefix_len])
    return from_tensors([(torch.cat((k[:, :, :a], ki), dim=2), torch.cat((v[:, :, :a], vi), dim=2))
                         for (k, v), (ki, vi) in zip(kv, new_rows)])


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
        ValueError: if ``dirty_cache`` does not hold the edit's N rows, or naming ``edit`` for a replacement
            (``inserted_len > 0``: its Shift inserts rows; use :func:`shift`), before anything is modified.
    """
    if edit.inserted_len:
        raise ValueError(f"edit is a replacement (inserted_len={edit.inserted_len}); an in-place Shift only deletes "
                         "rows: use shift()")
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
