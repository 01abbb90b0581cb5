"""The executor registry: an executor is ``fn(lm, shift_cache, edit, support) -> DynamicCache`` registered by name.

Every executor registered under a plain name leaves its input cache unchanged (it returns a new cache). In-place
forms, for a Shift cache the caller gives up, are registered beside them under ``"<name>-inplace"``
(:data:`INPLACE_SUFFIX`): they write the refreshed rows into the input cache, return that same object and make no
output clone; the input is consumed. ``get_executor(name, inplace=True)`` returns the in-place form of ``name`` and
:func:`executor_consumes_input` tells which names consume their input (benchmarks hand those a fresh copy per call).
The reference, ``"sequential"``, lives in :mod:`sur_lab.executors.sequential`; packed backends register themselves
from :mod:`sur_lab.executors.packed`, imported on first lookup.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from transformers import DynamicCache

from sur_lab.budget import Support
from sur_lab.cache_ops import cache_length
from sur_lab.checks import check_batch_one
from sur_lab.edits import EditedContext
from sur_lab.forward import one_context_warning
from sur_lab.models import LoadedModel

Executor = Callable[[LoadedModel, DynamicCache, EditedContext, Support], DynamicCache]
EXECUTORS: dict[str, Executor] = {}
#: Name suffix of the in-place form of an executor (``"packed"`` -> ``"packed-inplace"``).
INPLACE_SUFFIX = "-inplace"


def register_executor(name: str) -> Callable[[Executor], Executor]:
    """Decorator registering an executor under ``name`` (returns ``fn`` unchanged).

    The registered callable warns at most once per call when its forwards pass the model's context length
    (:func:`sur_lab.forward.one_context_warning`; an executor may run one forward per interval).
    """

    def wrap(fn: Executor) -> Executor:
        EXECUTORS[name] = one_context_warning(fn)
        return fn

    return wrap


def get_executor(name: str, *, inplace: bool = False) -> Executor:
    """Look up an executor by name; ``inplace=True`` returns its in-place form (``name + "-inplace"``).

    Raises:
        ValueError: naming ``name`` and listing the registered executors, or (``inplace=True``) naming ``name`` when
            it has no in-place form and listing those that have one.
    """
    _load_optional_executors()
    if not isinstance(name, str):
        raise ValueError(f"executor name must be a string; got {type(name).__name__} {name!r}; registered: "
                         f"{', '.join(sorted(EXECUTORS))}")
    if inplace and not name.endswith(INPLACE_SUFFIX):
        if name + INPLACE_SUFFIX not in EXECUTORS:
            forms = sorted(n[: -len(INPLACE_SUFFIX)] for n in EXECUTORS if n.endswith(INPLACE_SUFFIX))
            raise ValueError(f"executor name={name!r} has no in-place form; in-place executors: {', '.join(forms)}")
        name = name + INPLACE_SUFFIX
    try:
        return EXECUTORS[name]
    except KeyError:
        raise ValueError(f"unknown executor name={name!r}; registered: {', '.join(sorted(EXECUTORS))}") from None


def executor_consumes_input(name: str) -> bool:
    """Whether executor ``name`` writes into (consumes) its input cache: the ``"-inplace"`` forms.

    Raises:
        ValueError: for an unknown name (see :func:`get_executor`).
    """
    get_executor(name)
    return name.endswith(INPLACE_SUFFIX)


def _load_optional_executors() -> None:
    """Import modules that register further executors (packed backends) when they exist."""
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

