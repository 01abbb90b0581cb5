"""Executors recompute a support of the Shift cache; every executor leaves its input cache unchanged.

An executor is ``fn(lm, shift_cache, edit, support) -> DynamicCache`` registered by name. This module holds the
reference, ``"sequential"`` (interval-wise maximal-interval replay, appendix 7.1 "Sparse refresh"), plus the dense
reference operators built on the same forwards (Replay, Re-prefill, Dirty). Faster executors (packed) register
themselves from their own modules and are checked against this one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache

from .budget import Support
from .cache_ops import cache_length, clone_cache, shift_cache, slice_rows, to_tensors, write_rows_
from .edits import EditedContext
from .forward import forward_tokens, prefill
from .models import LoadedModel

Executor = Callable[[LoadedModel, DynamicCache, EditedContext, Support], DynamicCache]
EXECUTORS: dict[str, Executor] = {}


def register_executor(name: str) -> Callable[[Executor], Executor]:
    """Decorator registering an executor under ``name``."""

    def wrap(fn: Executor) -> Executor:
        EXECUTORS[name] = fn
        return fn

    return wrap


def get_executor(name: str) -> Executor:
    """Look up an executor by name.

    Raises:
        ValueError: naming ``name`` and listing the registered executors.
    """
    _load_optional_executors()
    try:
        return EXECUTORS[name]
    except KeyError:
        raise ValueError(f"unknown executor name={name!r}; registered: {', '.join(sorted(EXECUTORS))}") from None


def _load_optional_executors() -> None:
    """Import modules that register further executors (packed backends) when they exist."""
    import importlib

    for module in ("sur_lab.packed",):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise


def check_support(edit: EditedContext, support: Support, cache: DynamicCache) -> None:
    """Validate a support against an edit and a Shift cache before any work.

    Raises:
        ValueError: naming ``support`` when its suffix length differs from the edit's, or ``cache`` when its length is
            not ``p + S``.
    """
    if support.suffix_len != edit.suffix_len:
        raise ValueError(f"support.suffix_len={support.suffix_len} but the edit's suffix has {edit.suffix_len} tokens")
    if cache_length(cache) != edit.edited_len:
        raise ValueError(f"cache has {cache_length(cache)} rows; the Shift cache of this edit has {edit.edited_len}")


@register_executor("sequential")
def refresh_sequential(lm: LoadedModel, shift: DynamicCache, edit: EditedContext, support: Support) -> DynamicCache:
    """Interval-wise sparse refresh, the reference executor (appendix 7.1, "Sparse refresh").

    Starting from a clone of the Shift cache, for each maximal interval ``[a, b)`` of the support in order: copy the
    current cache prefix ``[0, a)``, forward the edited tokens ``x⁻[a:b]`` against it, and write the resulting K/V rows
    back into ``[a, b)`` at every layer. Earlier refreshed intervals are visible to later ones; future rows are absent
    from each forward; all unselected rows stay bitwise those of Shift.

    Args:
        lm: the model.
        shift: Shift cache of ``p ⊕ s`` (``p + S`` rows); not modified.
        edit: the edit.
        support: suffix-local positions to refresh.

    Returns:
        A new cache of ``p + S`` rows.

    Raises:
        ValueError: see :func:`check_support`.
    """
    check_support(edit, support, shift)
    out = clone_cache(shift)
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
        ValueError: if ``dirty_cache`` does not hold the edit's N rows.
    """
    if cache_length(dirty_cache) != edit.num_tokens:
        raise ValueError(f"dirty_cache has {cache_length(dirty_cache)} rows; the edit's context has {edit.num_tokens}")
    return shift_cache(dirty_cache, edit.prefix_len, edit.deleted_len, lm.inv_freq)


def replay(lm: LoadedModel, cache: DynamicCache, edit: EditedContext) -> DynamicCache:
    """Replay: the valid prefix rows ``[0, p)`` of ``cache`` (Dirty or Shift) plus a full recompute of the suffix.

    ``cache`` is not modified. Returns a new cache of ``p + S`` rows.
    """
    out = slice_rows(cache, 0, edit.prefix_len)
    if edit.suffix_len:
        forward_tokens(lm, edit.suffix_ids, out, logits="none")
    return out


def reprefill(lm: LoadedModel, edit: EditedContext) -> DynamicCache:
    """Re-prefill: rebuild the complete edited prompt ``p ⊕ s`` from an empty cache."""
    return prefill(lm, edit.edited_ids)[0]


__all__ = [
    "EXECUTORS",
    "Executor",
    "check_support",
    "dirty",
    "get_executor",
    "refresh_sequential",
    "register_executor",
    "replay",
    "reprefill",
    "shift",
]
