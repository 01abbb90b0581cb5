"""Repair an edited cache by name: the reference operators and budgeted repair with any allocator (Algorithm 1).

``prepare`` computes, once per edit, what every method shares: the Dirty cache (original prefill) and the Shift cache
(with its time). ``repair`` then runs one method at one budget and returns the repaired pre-query cache with a timing
breakdown (Eq. 20: select, shift, refresh). The prepared caches are never modified.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from transformers import DynamicCache

from sur_lab.allocators import ALLOCATORS, AllocationRequest, Selection, allocate
from sur_lab.budget import Support, allowance, check_budget
from sur_lab.cache_ops import clone_cache
from sur_lab.checks import check_vocab
from sur_lab.edits import EditedContext
from sur_lab.executors import dirty, get_executor, replay, reprefill, shift
from sur_lab.models import LoadedModel
from sur_lab.units import Unit, segment_units

#: Methods that are not allocators (appendix 7.1).
REFERENCE_METHODS = ("Dirty", "Shift", "Replay", "Re-prefill")


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


@dataclass
class PreparedEdit:
    """Per-edit state shared by all methods: Dirty and Shift caches (read-only) and semantic units.

    Attributes:
        edit: the edit.
        dirty_cache: prefill of ``p ⊕ e ⊕ s`` (N rows).
        shift_cache: Shift of it (``p + S`` rows).
        dirty_ms: prefill time, ms (excluded from post-edit latency).
        shift_ms: Shift time, ms (the position-correction term of Eq. 20).
        units: SUR's semantic units of the suffix (computed on first use).
    """

    edit: EditedContext
    dirty_cache: DynamicCache
    shift_cache: DynamicCache
    dirty_ms: float
    shift_ms: float
    units: list[Unit] | None = None

    def get_units(self) -> list[Unit]:
        if self.units is None:
            self.units = segment_units(self.edit)
        return self.units


def prepare(lm: LoadedModel, edit: EditedContext) -> PreparedEdit:
    """Prefill the original context (Dirty) and Shift it; both are timed separately.

    Warns when the context exceeds the model's ``max_position_embeddings`` (see :func:`sur_lab.forward.prefill`).

    Raises:
        ValueError: naming ``original_ids``, ``query_ids`` or ``question_ids`` when an id lies outside the model's
            vocabulary ``[0, vocab_size)``, before any forward.
    """
    vocab = lm.spec.vocab_size
    check_vocab(edit.original_ids, vocab, "original_ids")
    check_vocab(edit.query_ids, vocab, "query_ids")
    if edit.question_ids is not None:
        check_vocab(edit.question_ids, vocab, "question_ids")
    t0 = time.perf_counter()
    dirty_cache = dirty(lm, edit)
    dirty_ms = _ms(t0)
    t0 = time.perf_counter()
    shift_cache = shift(lm, dirty_cache, edit)
    return PreparedEdit(edit, dirty_cache, shift_cache, dirty_ms, _ms(t0))


@dataclass(frozen=True)
class RepairResult:
    """A repaired pre-query cache and how it was obtained.

    Attributes:
        cache: the repaired cache (Dirty: N rows; every other method: ``p + S`` rows). Owned by the caller.
        method: method name (an allocator name or one of :data:`REFERENCE_METHODS`).
        budget_pct: b in percent (NaN for reference methods).
        selection: the allocator's selection (``None`` for reference methods and for B = 0 / B = S endpoints).
        timings_ms: ``select``, ``shift``, ``refresh`` (ms); Re-prefill's rebuild is its ``refresh``.
        allowance: B, positions refreshed (S for Replay and Re-prefill, 0 for Shift and Dirty).
    """

    cache: DynamicCache
    method: str
    budget_pct: float
    selection: Selection | None
    timings_ms: dict[str, float] = field(default_factory=dict)
    allowance: int = 0

    @property
    def support(self) -> Support | None:
        return self.selection.support if self.selection is not None else None


def repair(
    lm: LoadedModel,
    prepared: PreparedEdit,
    method: str = "SUR",
    budget_pct: float = 5.0,
    *,
    executor: str = "sequential",
    seed: int = 0,
    options: dict | None = None,
) -> RepairResult:
    """Repair ``prepared.edit`` with ``method`` at budget ``budget_pct`` (Algorithm 1).

    Args:
        lm: the model.
        prepared: output of :func:`prepare` (its caches are not modified).
        method: ``"Dirty"``, ``"Shift"``, ``"Replay"``, ``"Re-prefill"`` or a registered allocator name (``"SUR"``).
        budget_pct: b in [0, 100] (ignored by reference methods). B = 0 returns Shift; B = S returns Replay.
        executor: registered executor name for sparse refresh (``"sequential"`` reference); checked for every
            method, the reference ones included.
        seed: case-fixed seed passed to randomized allocators.
        options: allocator-specific options. ``"dirty_cache"`` defaults to ``prepared.dirty_cache`` (Cache-Craft-Adapted
            reads the deleted span's keys from it instead of re-running the span).

    Returns:
        RepairResult with a timing breakdown in ms.

    Raises:
        ValueError: for a budget outside [0, 100], an unknown method or executor — before any model call.
    """
    edit = prepared.edit
    # Looked up first so that every method, the reference ones included, refuses an unknown executor name.
    run = get_executor(executor)
    if method in REFERENCE_METHODS:
        nan = float("nan")
        t0 = time.perf_counter()
        if method == "Dirty":
            return RepairResult(clone_cache(prepared.dirty_cache), method, nan, None, {"select": 0.0, "shift": 0.0, "refresh": 0.0}, 0)
        if method == "Shift":
            return RepairResult(
                clone_cache(prepared.shift_cache), method, nan, None,
                {"select": 0.0, "shift": prepared.shift_ms, "refresh": 0.0}, 0,
            )
        if method == "Replay":
            cache = replay(lm, prepared.dirty_cache, edit)
            return RepairResult(cache, method, nan, None, {"select": 0.0, "shift": 0.0, "refresh": _ms(t0)}, edit.suffix_len)
        cache = reprefill(lm, edit)
        return RepairResult(cache, method, nan, None, {"select": 0.0, "shift": 0.0, "refresh": _ms(t0)}, edit.suffix_len)

    budget_pct = check_budget(budget_pct)
    if method not in ALLOCATORS:
        raise ValueError(
            f"unknown method={method!r}; allowed: {', '.join(REFERENCE_METHODS)} or an allocator "
            f"({', '.join(sorted(ALLOCATORS))})"
        )
    S = edit.suffix_len
    B = allowance(S, budget_pct)
    if B == S and S > 0:
        # Algorithm 1, step 2: a full budget is Replay from the valid prefix (no Shift needed).
        t0 = time.perf_counter()
        cache = replay(lm, prepared.dirty_cache, edit)
        sel = Selection(Support.full(S))
        return RepairResult(cache, method, budget_pct, sel, {"select": 0.0, "shift": 0.0, "refresh": _ms(t0)}, S)
    if B == 0:
        sel = Selection(Support(np.zeros(0, dtype=np.int64), S))
        return RepairResult(
            clone_cache(prepared.shift_cache), method, budget_pct, sel,
            {"select": 0.0, "shift": prepared.shift_ms, "refresh": 0.0}, 0,
        )
    # Units are built inside the timed allocator call: selection time includes unit construction (appendix 13.1).
    options = dict(options or {})
    # Algorithm 1 starts from the Dirty cache: allocators that read it (Cache-Craft-Adapted takes the deleted span's
    # keys from it) must not re-run the span.
    options.setdefault("dirty_cache", prepared.dirty_cache)
    request = AllocationRequest(
        lm, edit, budget_pct, shift_cache=prepared.shift_cache, units=None, seed=seed, options=options
    )
    selection = allocate(method, request)
    if prepared.units is None and request.units is not None:
        prepared.units = request.units
    t0 = time.perf_counter()
    cache = run(lm, prepared.shift_cache, edit, selection.support)
    timings = {"select": selection.select_ms, "shift": prepared.shift_ms, "refresh": _ms(t0)}
    return RepairResult(cache, method, budget_pct, selection, timings, B)
