"""Repair an edited cache by name: the reference operators and budgeted repair with any allocator (Algorithm 1).

``prepare`` computes, once per edit, what every method shares: the Dirty cache (original prefill) and the Shift cache
(with its time). ``repair`` then runs one method at one budget and returns the repaired pre-query cache with a timing
breakdown (Eq. 20: select, shift, refresh). The prepared caches are never modified, unless ``repair(...,
inplace=True)`` is asked to consume them (a cache the caller gives up: no output clone).

``repair`` is the one Algorithm 1 dispatcher: the sweep's case runner (:func:`sur_lab.sweeps.run_case`) and every
edit and sync of an :class:`~sur_lab.session.EditSession` (through its :class:`~sur_lab.live_cache.LiveCache`) call
it. Its rules: a reference operator by name (:data:`REFERENCE_OPERATORS`); otherwise an allocator at budget b, whose
allowance B = B(S, b) (Eq. 3, or the base a variant binds: :func:`~sur_lab.allocators.allowance_for`) picks the path
(:func:`algorithm1_path`): B = S > 0 is Replay from the valid prefix (step 2, no Shift), B = 0 is Shift, anything
else is the allocator's support refreshed by the executor. ``recover`` follows the same path rule.

Adding a reference operator (as ``Erratum``, whose cache is the Dirty cache plus a prefilled correction note) takes one
function in this module decorated with :func:`reference_operator`: it receives the model, the prepared edit, whether
it may consume the prepared caches, and the options, and returns a :class:`RepairResult`. Its cache may have any
length: the sweep groups caches by their actual length, and the one place that knows which lengths an edit allows is
:func:`sur_lab.answer.check_cache_rows` (extend it there for a cache of another length).

``recover`` is the post-edit critical path from a Dirty cache in one call (appendix 13.1 "recovery", 13.3): Shift,
selection and refresh, serially or with the preparation overlap of appendix 13.3 (``overlap=True``): unit
construction and allocation run on a reusable worker thread while Shift runs on the calling thread. Both orders give
bitwise the same support, Shift cache, output cache and query logits (tested).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from sur_lab.allocators import ALLOCATORS, AllocationRequest, allocate, allowance_for
from sur_lab.budget import Selection, Support, check_budget, fractions_expected, warn_if_fraction
from sur_lab.cache_ops import cache_length, clone_cache
from sur_lab.checks import as_count, as_token_ids, check_vocab
from sur_lab.edits import EditedContext
from sur_lab.executors import (
    dirty,
    dirty_rows,
    erratum,
    erratum_note,
    erratum_note_ids,
    erratum_templates,
    get_executor,
    replay,
    reprefill,
    shift,
    shift_inplace,
    valid_prefix,
)
from sur_lab.forward import one_context_warning
from sur_lab.models import LoadedModel
from sur_lab.units import Unit, segment_units

#: Allocators whose signals do not read the Shift cache, so their unit construction and allocation can overlap Shift
#: (``overlap=True``; appendix 13.3). The adapted prior-work signals that read it are not among them.
OVERLAP_METHODS = ("SUR", "Dense tokens", "Max-relevance contiguous", "BM25 (same units)", "Random semantic units")

_WORKER: ThreadPoolExecutor | None = None
_WORKER_LOCK = threading.Lock()


def preparation_worker() -> ThreadPoolExecutor:
    """The reusable one-thread worker of the preparation overlap (appendix 13.3), created on first use.

    Its creation is not part of any timing (as in the paper); call this once before timing to exclude it.
    """
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sur_lab-preparation")
        return _WORKER


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


@dataclass
class PreparedEdit:
    """Per-edit state shared by all methods: Dirty and Shift caches (read-only) and semantic units.

    Attributes:
        edit: the edit.
        dirty_cache: the cache before the edit (:func:`sur_lab.executors.dirty`): prefill of ``p ⊕ e ⊕ s`` (N rows)
            for a deletion; for a replacement (``edit.inserted_len = m > 0``) prefill of the context before it,
            old value in place (N - m rows, :func:`sur_lab.executors.pre_edit_ids`). ``None`` when the caller holds
            no Dirty cache (a composed cache): Dirty and Erratum are then unavailable and Replay reads the valid
            prefix from the Shift cache.
        shift_cache: Shift of it (``p + S`` rows; for a replacement the new text's rows prefilled after the prefix
            and the suffix re-rotated, :func:`sur_lab.executors.shift`), or any stale cache of the edited context
            with its rows at their edited positions.
        dirty_ms: prefill time, ms (excluded from post-edit latency).
        shift_ms: Shift time, ms (the position-correction term of Eq. 20; for a replacement it includes the
            m-token prefill of the new text, which every method but Dirty, Erratum and Re-prefill needs).
        units: SUR's semantic units of the suffix (computed on first use).
        share_prefix: exact prefix sharing (issue 37; off by default): Replay's path (the valid prefix ``[0, p)``
            copied from the Dirty cache, the suffix forwarded on it, Algorithm 1 step 2) runs once per prepared edit
            and serves Replay and every allocator at B = S (clones of one cache, bitwise what each would compute),
            and Re-prefill becomes that cache instead of a rebuild from empty: rows ``[0, p)`` of the edited prompt
            are a function of the prefix alone, so in exact arithmetic both are the same cache (tested within
            float64 rounding). Re-prefill shares only where the valid prefix comes from a Dirty prefill
            (:func:`shares_prefix`); a study whose question is the difference between the paths (appendix 11,
            :mod:`sur_lab.studies.execution_paths`) builds them independently.
        matched_counts: the matched-token counts n already computed on this edit (the Table 14 protocol), by
            ``(region, budget_pct, count, seed)``: ``(options, n)``, so that every arm of a case reads one n.
    """

    edit: EditedContext
    dirty_cache: DynamicCache | None
    shift_cache: DynamicCache
    dirty_ms: float
    shift_ms: float
    units: list[Unit] | None = None
    share_prefix: bool = False
    # (cache, ms) of the shared Replay path once computed (share_prefix); never handed out, only cloned.
    _replayed: tuple[DynamicCache, float] | None = field(default=None, repr=False, compare=False)
    matched_counts: dict[tuple, tuple[Any, int]] = field(default_factory=dict, repr=False, compare=False)

    def get_units(self) -> list[Unit]:
        if self.units is None:
            self.units = segment_units(self.edit)
        return self.units


@one_context_warning
def prepare(lm: LoadedModel, edit: EditedContext, *, overlap: bool = False) -> PreparedEdit:
    """Prefill the context before the edit (Dirty) and Shift it; both are timed separately.

    A deletion's Dirty cache is a prefill of ``original_ids`` (N rows). A replacement's (``edit.inserted_len = m >
    0``) is a prefill of the context the agent held before it, ``original_ids`` without the new text (N - m rows: the
    old value in place); its Shift drops the old span, prefills the new text's rows at their positions after the
    prefix and re-rotates the suffix by ``m - d``, so the suffix saw only the old value, exactly as in the cache of
    :meth:`sur_lab.session.EditSession.replace` (tested). At B = S every allocator gives Replay, which equals
    Re-prefill of the edited prompt.

    Warns when the context exceeds the model's ``max_position_embeddings`` (see :func:`sur_lab.forward.prefill`).

    Args:
        lm: the model.
        edit: the edit.
        overlap: also build the suffix's semantic units (``prepared.units``) on the reusable worker thread
            (:func:`preparation_worker`) while the prefill and Shift run (appendix 13.3). Off by default (units are
            then built on first use). The units are the same either way.

    Raises:
        ValueError: naming ``original_ids``, ``query_ids`` or ``question_ids`` when an id lies outside the model's
            vocabulary ``[0, vocab_size)``, before any forward.
    """
    vocab = lm.spec.vocab_size
    check_vocab(edit.original_ids, vocab, "original_ids")
    check_vocab(edit.query_ids, vocab, "query_ids")
    if edit.question_ids is not None:
        check_vocab(edit.question_ids, vocab, "question_ids")
    pending = preparation_worker().submit(segment_units, edit) if overlap else None
    t0 = time.perf_counter()
    dirty_cache = dirty(lm, edit)
    dirty_ms = _ms(t0)
    t0 = time.perf_counter()
    shift_cache = shift(lm, dirty_cache, edit)
    shift_ms = _ms(t0)
    units = pending.result() if pending is not None else None
    return PreparedEdit(edit, dirty_cache, shift_cache, dirty_ms, shift_ms, units)


@dataclass(frozen=True)
class RepairResult:
    """A repaired pre-query cache and how it was obtained.

    Attributes:
        cache: the repaired cache (Dirty: N rows, N - m for a replacement; Erratum: Dirty's rows plus the note's;
            every other method: ``p + S`` rows). Owned by the caller.
        method: method name (an allocator name or one of :data:`REFERENCE_METHODS`).
        budget_pct: b in percent (NaN for reference methods).
        selection: the allocator's selection (``None`` for reference methods and for B = 0 / B = S endpoints).
        timings_ms: ``select``, ``shift``, ``refresh`` (ms); Re-prefill's rebuild is its ``refresh``.
        allowance: B, positions refreshed (S for Replay and Re-prefill, 0 for Shift and Dirty).
        shift_cache: the Shift cache this repair started from, set by :func:`recover` only when it is not the output
            (``inplace=False``); ``None`` otherwise.
        note_tokens: L, tokens of an appended correction note (Erratum; 0 for every other method).
        note_template: the note's template name (:data:`sur_lab.executors.ERRATUM_TEMPLATES`; ``""`` without note).
        refreshed: ``[k]`` int64 sorted absolute rows of ``cache`` that :func:`repair` recomputed: all ``p + S``
            for Re-prefill, the suffix ``[p, p + S)`` for Replay (and an allocator at B = S), ``p +`` the support
            and the forced positions for an allocator, ``p +`` the forced positions for Shift, none for Dirty and
            Erratum (the note's rows are new, not recomputed). ``None`` on a result built outside :func:`repair`.
    """

    cache: DynamicCache
    method: str
    budget_pct: float
    selection: Selection | None
    timings_ms: dict[str, float] = field(default_factory=dict)
    allowance: int = 0
    shift_cache: DynamicCache | None = field(default=None, repr=False, compare=False)
    note_tokens: int = 0
    note_template: str = ""
    refreshed: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def support(self) -> Support | None:
        return self.selection.support if self.selection is not None else None


def algorithm1_path(suffix_len: int, allowance_: int) -> str:
    """Algorithm 1's path for an allocator at allowance B on a suffix of S positions: ``"replay"`` when B = S > 0
    (step 2: Replay from the valid prefix, no Shift), ``"shift"`` when B = 0 (the Shift cache is the result), else
    ``"refresh"`` (the allocator's support recomputed by the executor).

    Raises:
        ValueError: naming ``allowance_`` when it is outside [0, S].
    """
    if not 0 <= allowance_ <= suffix_len:
        raise ValueError(f"allowance_={allowance_} must lie in [0, S={suffix_len}]")
    if allowance_ == suffix_len and suffix_len > 0:
        return "replay"
    return "shift" if allowance_ == 0 else "refresh"


#: A reference operator: ``fn(lm, prepared, *, inplace, options) -> RepairResult``.
ReferenceOperator = Callable[..., "RepairResult"]
#: Reference operators by name (appendix 7.1), in table order; :func:`reference_operator` registers one.
REFERENCE_OPERATORS: dict[str, ReferenceOperator] = {}


def reference_operator(name: str) -> Callable[[ReferenceOperator], ReferenceOperator]:
    """Decorator registering a reference operator (a method with no budget) under ``name`` for :func:`repair`.

    The operator is called as ``fn(lm, prepared, *, inplace, options)`` and returns a :class:`RepairResult` whose
    ``budget_pct`` is NaN; ``inplace`` says it may consume (return or write into) the prepared caches, in which case
    it sets the consumed attribute of ``prepared`` to ``None``. Register operators in this module, so that
    :data:`REFERENCE_METHODS` lists them.

    Raises:
        ValueError: when ``name`` is already registered.
    """

    def wrap(fn: ReferenceOperator) -> ReferenceOperator:
        if name in REFERENCE_OPERATORS:
            raise ValueError(f"reference operator {name!r} is already registered")
        REFERENCE_OPERATORS[name] = fn
        return fn

    return wrap


def _result(method: str, cache: DynamicCache, timings: tuple[float, float, float], allowance_: int,
            selection: Selection | None = None, budget_pct: float = float("nan")) -> "RepairResult":
    select, shift_ms, refresh = timings
    return RepairResult(cache, method, budget_pct, selection, {"select": select, "shift": shift_ms, "refresh": refresh},
                        allowance_)


@reference_operator("Dirty")
def _dirty_op(lm: LoadedModel, prepared: PreparedEdit, *, inplace: bool, options: dict) -> "RepairResult":
    """Dirty: the untreated cache of the context before the edit (N rows, deleted span included; a replacement's
    N - m rows hold the old value and not the new one)."""
    return _result("Dirty", _take(prepared, "dirty_cache", inplace), (0.0, 0.0, 0.0), 0)


@reference_operator("Shift")
def _shift_op(lm: LoadedModel, prepared: PreparedEdit, *, inplace: bool, options: dict) -> "RepairResult":
    """Shift: the span's rows dropped, suffix keys re-rotated (Eq. 2); no recompute (its time is the Shift's)."""
    return _result("Shift", _take(prepared, "shift_cache", inplace), (0.0, prepared.shift_ms, 0.0), 0)


@reference_operator("Replay")
def _replay_op(lm: LoadedModel, prepared: PreparedEdit, *, inplace: bool, options: dict) -> "RepairResult":
    """Replay: the valid prefix plus a full recompute of the suffix (appendix 7.1); nothing is consumed."""
    cache, ms = _replay_path(lm, prepared)
    return _result("Replay", cache, (0.0, 0.0, ms), prepared.edit.suffix_len)


@reference_operator("Re-prefill")
def _reprefill_op(lm: LoadedModel, prepared: PreparedEdit, *, inplace: bool, options: dict) -> "RepairResult":
    """Re-prefill: the edited prompt rebuilt from an empty cache (its rebuild is its refresh). With
    ``prepared.share_prefix`` (and a Dirty prefill to take the prefix from, :func:`shares_prefix`) it is the shared
    Replay path's cache instead, and its refresh time is NaN: no rebuild ran."""
    if shares_prefix(prepared):
        cache, _ = _replay_path(lm, prepared)
        return _result("Re-prefill", cache, (0.0, 0.0, float("nan")), prepared.edit.suffix_len)
    t0 = time.perf_counter()
    cache = reprefill(lm, prepared.edit)
    return _result("Re-prefill", cache, (0.0, 0.0, _ms(t0)), prepared.edit.suffix_len)


def erratum_note_for(lm: LoadedModel, edit: EditedContext, options: dict) -> tuple[str, torch.Tensor]:
    """The Erratum note of ``edit`` under ``options``: ``(template name, [L] int64 note ids)``.

    ``options["erratum_note_ids"]`` (token ids) gives the note directly (name ``"ids"``); otherwise the note is
    :func:`sur_lab.executors.erratum_note` with the templates named by ``options["erratum_template"]`` (default
    ``"default"``), tokenized on its own. The one place the note is made (the operator and
    :class:`sur_lab.session.EditSession` call it).

    Raises:
        ValueError: naming ``erratum_template`` when unknown, ``edit`` when it has no text (and no note ids are
            given), ``erratum_note_ids`` when empty.
    """
    if options.get("erratum_note_ids") is not None:
        return "ids", as_token_ids(options["erratum_note_ids"], "erratum_note_ids")
    name = options.get("erratum_template", "default")
    templates = erratum_templates(name)
    return name, erratum_note_ids(lm.tokenizer, erratum_note(edit, templates=templates))


@reference_operator("Erratum")
def _erratum_op(lm: LoadedModel, prepared: PreparedEdit, *, inplace: bool, options: dict) -> "RepairResult":
    """Erratum (issue 26; "Models Take Notes at Prefill", arXiv 2606.17107): the Dirty cache kept whole, deleted or
    replaced text included, extended by a prefill of a correction note (:func:`sur_lab.executors.erratum`).

    The note is :func:`sur_lab.executors.erratum_note` of the edit with the templates named by
    ``options["erratum_template"]`` (default ``"default"``; :data:`sur_lab.executors.ERRATUM_TEMPLATES`): the
    passage is withdrawn (a deletion) or the new text supersedes it (a replacement). ``options["erratum_note_ids"]``
    (a sequence of token ids) gives the note's tokens directly instead (a token-level edit; template ``"ids"``).
    Its cost, the note's L token-forwards, is its ``refresh`` time; ``allowance`` is 0 (no suffix row is
    recomputed); the result carries ``note_tokens`` = L and ``note_template``. Needs a text edit and the Dirty cache; consumes nothing.

    Raises:
        ValueError: naming ``prepared.dirty_cache`` when there is none, ``edit`` for a token-level edit, or
            ``erratum_template`` when unknown — before any forward.
    """
    edit = prepared.edit
    name, note_ids = erratum_note_for(lm, edit, options)
    source = _owned(prepared, "dirty_cache")
    t0 = time.perf_counter()
    cache = erratum(lm, source, edit, note_ids)
    out = _result("Erratum", cache, (0.0, 0.0, _ms(t0)), 0)
    return RepairResult(out.cache, out.method, out.budget_pct, None, out.timings_ms, 0,
                        note_tokens=int(note_ids.numel()), note_template=name)


#: The paper's reference methods (appendix 7.1), in table order: the registered reference operators that every edit
#: supports. Operators registered beyond them (``"Erratum"``: a text edit or explicit note ids, and a Dirty cache)
#: are in :data:`REFERENCE_OPERATORS` only, dispatched alike.
REFERENCE_METHODS = ("Dirty", "Shift", "Replay", "Re-prefill")
assert set(REFERENCE_METHODS) <= set(REFERENCE_OPERATORS)


def shares_prefix(prepared: PreparedEdit) -> bool:
    """Whether Re-prefill of ``prepared`` is its shared Replay path (:attr:`PreparedEdit.share_prefix`): sharing is
    asked for and the valid prefix comes from a Dirty prefill (a deletion's first p rows, or a replacement's first
    ``p - m`` rows with the new text's rows prefilled on them by Shift), whose rows ``[0, p)`` are those of a prefill
    of the edited prompt in exact arithmetic. A cache composed without a Dirty prefill (non-prefix reuse) never
    shares: its prefix rows need not be a prefill's."""
    return bool(prepared.share_prefix) and prepared.dirty_cache is not None


def _replay_path(lm: LoadedModel, prepared: PreparedEdit) -> tuple[DynamicCache, float]:
    """Replay from the valid prefix (Algorithm 1 step 2): ``(a new cache of p + S rows, its time in ms)``.

    With ``prepared.share_prefix`` the suffix forward runs once per prepared edit; every call returns a clone of that
    one cache (bitwise what a fresh Replay computes: the same operations on the same inputs) and its measured time.
    """
    if not prepared.share_prefix:
        t0 = time.perf_counter()
        cache = replay(lm, _prefix_source(prepared), prepared.edit)
        return cache, _ms(t0)
    if prepared._replayed is None:
        t0 = time.perf_counter()
        cache = replay(lm, _prefix_source(prepared), prepared.edit)
        prepared._replayed = (cache, _ms(t0))
    cache, ms = prepared._replayed
    return clone_cache(cache), ms


def _prefix_source(prepared: PreparedEdit) -> DynamicCache:
    """The cache Replay reads the valid prefix rows ``[0, p)`` from: the Dirty cache (Algorithm 1 step 2 needs no
    Shift), else the Shift cache (its prefix rows are the Dirty cache's, bitwise). A replacement's Dirty cache lacks
    the new text's rows, so its Replay reads them from the Shift cache (where they were prefilled)."""
    if prepared.dirty_cache is not None and not prepared.edit.inserted_len:
        return prepared.dirty_cache
    return _owned(prepared, "shift_cache")


@one_context_warning
def repair(
    lm: LoadedModel,
    prepared: PreparedEdit,
    method: str = "SUR",
    budget_pct: float | None = 5.0,
    *,
    executor: str = "sequential",
    seed: int = 0,
    options: dict | None = None,
    inplace: bool = False,
    allowance: int | None = None,
    forced=None,
) -> RepairResult:
    """Repair ``prepared.edit`` with ``method`` at budget ``budget_pct``: the one Algorithm 1 dispatcher.

    Args:
        lm: the model.
        prepared: output of :func:`prepare` (its caches are not modified unless ``inplace``), or a
            :class:`PreparedEdit` built by the caller (``dirty_cache=None`` when there is none).
        method: a reference operator (:data:`REFERENCE_METHODS`: ``"Dirty"``, ``"Shift"``, ``"Replay"``,
            ``"Re-prefill"``, ``"Erratum"``) or a registered allocator name (``"SUR"``).
        budget_pct: b in [0, 100] (ignored by reference methods); ``None`` when ``allowance`` is given alone. B is
            the allocator's (:func:`sur_lab.allocators.allowance_for`: Eq. 3's ``B(S, b)``, on the whole-prompt base
            for a variant binding ``allowance_base=prompt``). B = 0 returns Shift; B = S returns Replay
            (:func:`algorithm1_path`).
        executor: registered executor name for sparse refresh (``"sequential"`` reference); checked for every
            method, the reference ones included.
        seed: case-fixed seed passed to randomized allocators, an integer >= 0 (TypeError / ValueError naming ``seed``
            otherwise, before any work).
        options: allocator-specific options, also passed to reference operators. ``"dirty_cache"`` defaults to
            ``prepared.dirty_cache`` when there is one (Cache-Craft-Adapted reads the deleted span's keys from it
            instead of re-running the span).
        inplace: the caller gives up the prepared cache the method starts from, which is consumed: the refresh
            writes into ``prepared.shift_cache`` itself through the executor's in-place form
            (``get_executor(executor, inplace=True)``), with no output clone; Dirty, Shift and B = 0 return the
            prepared cache itself instead of a clone. The consumed attribute of ``prepared`` is set to ``None``
            (a later repair that needs it raises). Results are bitwise those of ``inplace=False``. Replay and
            Re-prefill consume nothing.
        allowance: an exact per-case B in [0, S] (suffix positions; e.g. the matched-token protocol or a fixed slot,
            ``AllocationRequest(..., allowance=B)``), used as given instead of ``B(S, b)``; ``budget_pct`` is then
            only the nominal budget the result carries (NaN when ``None``). Ignored by reference methods.
        forced: suffix-local positions (int64, in ``[0, S)``, any order) recomputed whatever the method chooses: rows
            the Shift cache holds no state for (the rows an :class:`~sur_lab.session.EditSession` sync inserts inside
            the suffix). B is then a share of the ``S - len(forced)`` other positions
            (:func:`~sur_lab.allocators.allowance_for` with ``selectable``) and picks the path on them: B = S -
            len(forced) is Replay of the whole suffix, B = 0 refreshes the forced rows alone, anything else refreshes
            the allocator's B positions and the forced ones in one executor call (the result's ``selection`` is the
            allocator's). Shift refreshes them too; Replay and Re-prefill recompute them anyway (their allowance is
            ``S - len(forced)``); Dirty and Erratum refuse them.

    Returns:
        RepairResult with a timing breakdown in ms.

    Raises:
        ValueError: for a budget outside [0, 100], neither a budget nor an allowance, an allowance outside [0, S], an
            unknown method or executor, an executor without an in-place form (``inplace=True``), a prepared cache
            already consumed by an in-place repair, Dirty without a Dirty cache, or ``forced`` positions outside
            ``[0, S)`` or given to Dirty / Erratum — before any model call.
        TypeError: naming ``allowance`` when it is not an integer.

    Warns:
        BudgetFractionWarning: (a ``UserWarning``, once per call) when 0 < ``budget_pct`` < 1: b is a percentage,
            so 0.05 is 0.05 %, not 5 % (:func:`sur_lab.budget.warn_if_fraction`; silence it with
            :func:`sur_lab.budget.fractions_expected` when a sub-1 % budget is meant).
    """
    edit = prepared.edit
    # Looked up first so that every method, the reference ones included, refuses an unknown executor name.
    run = get_executor(executor)
    as_count(seed, "seed", minimum=0)  # numpy generators take non-negative integer seeds; 1.5 is not truncated
    options = dict(options or {})
    S = edit.suffix_len
    forced = _check_forced(forced, S)
    if method in REFERENCE_OPERATORS:
        if len(forced) and method not in ("Shift", "Replay", "Re-prefill"):
            raise ValueError(f"forced={forced.tolist()[:8]} rows must be recomputed, but method={method!r} "
                             "recomputes no row; forced rows need Shift, Replay, Re-prefill or an allocator")
        result = REFERENCE_OPERATORS[method](lm, prepared, inplace=inplace, options=options)
        # Replay and Re-prefill recompute every suffix row (the forced ones included), Shift only the forced ones.
        result = replace(result, refreshed=_refreshed(edit, method, np.arange(S) if method == "Replay" else forced))
        if not len(forced):
            return result
        if method != "Shift":
            return replace(result, allowance=S - len(forced))
        t0 = time.perf_counter()
        cache = run(lm, result.cache, edit, Support(forced, S))
        return replace(result, cache=cache, timings_ms={**result.timings_ms, "refresh": _ms(t0)})

    if method not in ALLOCATORS:
        raise ValueError(
            f"unknown method={method!r}; allowed: {', '.join(REFERENCE_OPERATORS)} or an allocator "
            f"({', '.join(sorted(ALLOCATORS))})"
        )
    run = get_executor(executor, inplace=inplace)
    # Algorithm 1 starts from the Dirty cache: allocators that read it (Cache-Craft-Adapted takes the deleted span's
    # keys from it) must not re-run the span. A replacement's Dirty cache has the span elsewhere (N - m rows): the
    # allocator then rebuilds the span from the Shift cache's prefix.
    if prepared.dirty_cache is not None and not edit.inserted_len:
        options.setdefault("dirty_cache", prepared.dirty_cache)
    # Units are built inside the timed allocator call: selection time includes unit construction (appendix 13.1).
    request, B = _request(lm, edit, method, budget_pct, allowance, prepared.shift_cache, seed, options,
                          S - len(forced))
    budget_pct = _nominal(request)
    path = algorithm1_path(S - len(forced), B)
    if path == "replay":
        cache, ms = _replay_path(lm, prepared)
        return replace(_result(method, cache, (0.0, 0.0, ms), B, Selection(Support.full(S)), budget_pct),
                       refreshed=_refreshed(edit, method, np.arange(S)))
    _owned(prepared, "shift_cache")
    if path == "shift":
        sel = Selection(Support(np.zeros(0, dtype=np.int64), S))
        if not len(forced):
            return replace(_result(method, _take(prepared, "shift_cache", inplace), (0.0, prepared.shift_ms, 0.0), 0,
                                   sel, budget_pct), refreshed=_refreshed(edit, method, forced))
        positions, selection = forced, sel
    else:
        selection = allocate(method, request)
        if prepared.units is None and request.units is not None:
            prepared.units = request.units
        positions = np.union1d(selection.support.positions, forced).astype(np.int64)
    t0 = time.perf_counter()
    cache = run(lm, prepared.shift_cache, edit, Support(positions, S) if len(forced) else selection.support)
    timings = (selection.select_ms, prepared.shift_ms, _ms(t0))
    if inplace:
        prepared.shift_cache = None  # consumed: it is now the output
    return replace(_result(method, cache, timings, B, selection, budget_pct),
                   refreshed=_refreshed(edit, method, positions))


def _refreshed(edit: EditedContext, method: str, positions: np.ndarray) -> np.ndarray:
    """:attr:`RepairResult.refreshed`: int64 absolute rows ``p + positions`` (suffix-local ``positions``, sorted), or
    every row ``[0, p + S)`` for Re-prefill (the prefix rebuilt too); none for Dirty and Erratum."""
    if method == "Re-prefill":
        return np.arange(edit.prefix_len + edit.suffix_len, dtype=np.int64)
    if method in ("Dirty", "Erratum"):
        return np.zeros(0, dtype=np.int64)
    return edit.prefix_len + np.asarray(positions, dtype=np.int64)


def _check_forced(forced, suffix_len: int) -> np.ndarray:
    """``forced`` as sorted unique int64 suffix positions (empty for ``None``).

    Raises:
        TypeError: naming ``forced`` when the positions are not integers.
        ValueError: naming ``forced`` when a position lies outside ``[0, S)``.
    """
    if forced is None:
        return np.zeros(0, dtype=np.int64)
    raw = np.asarray(forced)
    if raw.size and raw.dtype.kind not in "iu":
        raise TypeError(f"forced must be integer suffix positions; got dtype {raw.dtype}")
    out = np.unique(raw.astype(np.int64).reshape(-1))
    if len(out) and (out[0] < 0 or out[-1] >= suffix_len):
        raise ValueError(f"forced positions must lie in the suffix [0, S={suffix_len}); got {out[0]}..{out[-1]}")
    return out


def _request(lm: LoadedModel, edit: EditedContext, method: str, budget_pct: float | None, allowance: int | None,
             shift_cache: DynamicCache | None, seed: int, options: dict,
             selectable: int | None = None) -> tuple[AllocationRequest, int]:
    """The allocation request of a repair and the B its method selects (:func:`sur_lab.allocators.allowance_for`),
    checked before any work; warns once about a sub-1 % budget. With ``selectable`` below S (forced rows), B is a
    share of those positions and the request asks the allocator for exactly B."""
    if budget_pct is None and allowance is None:
        raise ValueError("budget_pct is None and no allowance is given; give b in [0, 100] or an exact allowance in "
                         f"[0, S={edit.suffix_len}]")
    if budget_pct is not None:
        budget_pct = check_budget(budget_pct)
        warn_if_fraction(budget_pct)
    with fractions_expected():  # warned above, once per call
        request = AllocationRequest(lm, edit, budget_pct, shift_cache=shift_cache, units=None, seed=seed,
                                    options=options, allowance=allowance)
    if selectable is None or selectable == edit.suffix_len:
        return request, allowance_for(method, request)
    B = allowance_for(method, request, selectable=selectable)
    return request.with_allowance(B), B


def _nominal(request: AllocationRequest) -> float:
    """The budget a result carries: the request's b, NaN when only an exact allowance was given."""
    return float("nan") if request.budget_pct is None else request.budget_pct


def _owned(prepared: PreparedEdit, name: str) -> DynamicCache:
    cache = getattr(prepared, name)
    if cache is None:
        raise ValueError(f"prepared.{name} is None: consumed by an earlier repair(..., inplace=True) or never built "
                         "(a PreparedEdit without a Dirty cache); call prepare() again")
    return cache


def _take(prepared: PreparedEdit, name: str, inplace: bool) -> DynamicCache:
    """The prepared cache itself (consumed: the attribute is cleared) when ``inplace``, else a clone."""
    cache = _owned(prepared, name)
    if not inplace:
        return clone_cache(cache)
    setattr(prepared, name, None)
    return cache


@one_context_warning
def recover(
    lm: LoadedModel,
    edit: EditedContext,
    dirty_cache: DynamicCache,
    method: str = "SUR",
    budget_pct: float | None = 5.0,
    *,
    executor: str = "packed",
    overlap: bool = False,
    inplace: bool = False,
    seed: int = 0,
    options: dict | None = None,
    allowance: int | None = None,
) -> RepairResult:
    """Post-edit recovery from the Dirty cache in one call: Shift, selection and refresh (appendix 13.1, 13.3).

    Serial (``overlap=False``): Shift, then the allocator (relevance scoring, unit construction, allocation), then
    the executor. Overlapped (``overlap=True``, appendix 13.3 "Preparation overlap"): unit construction and the
    allocation (with its relevance scoring) run on the reusable worker thread (:func:`preparation_worker`) while
    Shift runs on the calling thread; the refresh starts when both are done. Both give bitwise the same support,
    Shift cache, output cache and query logits: the same functions run on the same inputs, only their order in time
    differs (the allocators of :data:`OVERLAP_METHODS` do not read the Shift cache).

    Args:
        lm: the model.
        edit: the edit.
        dirty_cache: the cache before the edit (:func:`sur_lab.executors.dirty`: prefill of ``p ⊕ e ⊕ s``, N rows;
            N - m rows for a replacement); not modified unless ``inplace``.
        method: a registered allocator name; with ``overlap=True`` one of :data:`OVERLAP_METHODS`.
        budget_pct: b in [0, 100] (``None`` with an exact ``allowance``). B is the allocator's, as in :func:`repair`;
            B = 0 returns Shift; B = S returns Replay from the valid prefix.
        executor: registered executor name (default ``"packed"``).
        overlap: run unit construction and allocation concurrently with Shift (off by default).
        inplace: consume ``dirty_cache``: Shift in place (:func:`sur_lab.executors.shift_inplace`, one compaction
            copy per layer) and refresh in place (the executor's in-place form): no cache is allocated. The result's
            cache is ``dirty_cache`` itself (except for a replacement, whose Shift builds a new cache). Bitwise
            equal to ``inplace=False``.
        seed: case-fixed seed for randomized allocators, an integer >= 0 (checked before any work).
        options: allocator-specific options.
        allowance: an exact B in [0, S], as in :func:`repair`.

    Returns:
        RepairResult with ``timings_ms`` ``select`` (allocator wall time, ms; on the worker when overlapped),
        ``shift``, ``refresh`` and ``recovery`` (the wall time of the whole call, its critical path, ms), and
        ``shift_cache`` (the Shift cache; ``None`` when ``inplace``, where it became the output).

    Raises:
        ValueError: naming ``budget_pct`` (outside [0, 100]), ``allowance`` (outside [0, S]), ``method`` (not an
            allocator, or not in :data:`OVERLAP_METHODS` with ``overlap=True``), ``executor`` (unknown, or without an
            in-place form when ``inplace``), or ``dirty_cache`` (not the edit's N rows) — before any work.

    Warns:
        BudgetFractionWarning: as :func:`repair`, when 0 < ``budget_pct`` < 1.
    """
    as_count(seed, "seed", minimum=0)
    if method not in ALLOCATORS:
        raise ValueError(f"unknown method={method!r}; recover takes an allocator ({', '.join(sorted(ALLOCATORS))})")
    if overlap and method not in OVERLAP_METHODS:
        raise ValueError(
            f"overlap=True needs an allocator that does not read the Shift cache ({', '.join(OVERLAP_METHODS)}); "
            f"got method={method!r}"
        )
    run = get_executor(executor, inplace=inplace)
    if cache_length(dirty_cache) != dirty_rows(edit):
        raise ValueError(f"dirty_cache has {cache_length(dirty_cache)} rows; the context before the edit has "
                         f"{dirty_rows(edit)}")
    S = edit.suffix_len
    request, B = _request(lm, edit, method, budget_pct, allowance, None, seed, dict(options or {}))
    budget_pct = _nominal(request)
    path = algorithm1_path(S, B)
    # A replacement's Shift inserts the new text's rows: it builds a new cache (no in-place form).
    do_shift = shift_inplace if inplace and not edit.inserted_len else shift
    worker = preparation_worker() if overlap else None  # created outside the timed region
    t_start = time.perf_counter()
    if path == "replay":  # Algorithm 1, step 2: Replay from the valid prefix, no Shift
        source = valid_prefix(lm, dirty_cache, edit) if edit.inserted_len else dirty_cache
        cache = replay(lm, source, edit)
        ms = _ms(t_start)
        timings = {"select": 0.0, "shift": 0.0, "refresh": ms, "recovery": ms}
        return RepairResult(cache, method, budget_pct, Selection(Support.full(S)), timings, S)

    def select() -> Selection:
        if path == "shift":
            return Selection(Support(np.zeros(0, dtype=np.int64), S))
        return allocate(method, request)  # unit construction, relevance scoring and allocation (timed together)

    if overlap:
        pending = worker.submit(select)
        t0 = time.perf_counter()
        shift_cache = do_shift(lm, dirty_cache, edit)
        shift_ms = _ms(t0)
        selection = pending.result()
    else:
        t0 = time.perf_counter()
        shift_cache = do_shift(lm, dirty_cache, edit)
        shift_ms = _ms(t0)
        request.shift_cache = shift_cache
        selection = select()
    t0 = time.perf_counter()
    cache = run(lm, shift_cache, edit, selection.support) if path == "refresh" else shift_cache
    refresh_ms = _ms(t0)
    timings = {"select": selection.select_ms, "shift": shift_ms, "refresh": refresh_ms, "recovery": _ms(t_start)}
    return RepairResult(cache, method, budget_pct, selection, timings, B, None if inplace else shift_cache)
