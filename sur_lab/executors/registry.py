"""The executor registry: an executor is ``fn(lm, shift_cache, edit, support) -> DynamicCache`` registered by name.

Every executor leaves its input cache unchanged. The reference, ``"sequential"``, lives in
:mod:`sur_lab.executors.sequential`; packed backends register themselves from :mod:`sur_lab.executors.packed`, imported
on first lookup.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import DynamicCache

from sur_lab.budget import Support
from sur_lab.cache_ops import cache_length
from sur_lab.checks import check_batch_one
from sur_lab.edits import EditedContext
from sur_lab.models import LoadedModel

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

    for module in ("sur_lab.executors.packed",):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise


def check_support(edit: EditedContext, support: Support, cache: DynamicCache) -> None:
    """Validate a support against an edit and a Shift cache before any work.

    Raises:
        ValueError: naming ``support`` when its suffix length differs from the edit's, or ``cache`` when its length is
            not ``p + S`` or it holds a batch of more than one sequence.
    """
    check_batch_one(cache, "cache")
    if support.suffix_len != edit.suffix_len:
        raise ValueError(f"support.suffix_len={support.suffix_len} but the edit's suffix has {edit.suffix_len} tokens")
    if cache_length(cache) != edit.edited_len:
        raise ValueError(f"cache has {cache_length(cache)} rows; the Shift cache of this edit has {edit.edited_len}")

