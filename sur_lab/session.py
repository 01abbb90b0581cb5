"""Edit sessions: one live KV cache kept usable across many appends, deletions and replacements (evolving contexts).

An agent's context keeps changing: turns are appended, obsolete tool outputs are deleted or replaced. An
:class:`EditSession` is the conversation: the current context's token ids, each row's text and message container,
the pending query and the history of edits; it holds one :class:`~sur_lab.live_cache.LiveCache`, the owner of the
cache state (the live transformers ``DynamicCache``'s tensors and, per row, the position its keys were computed at,
its *recorded angle*, and its *staleness*: how many context tokens before it were deleted or inserted since its state
was computed, directly or through the stale rows it read: see **Staleness debt** below). Each edit is the paper's
repair (Algorithm 1) on an :class:`~sur_lab.edits.EditedContext` that the session builds for that edit (tokens, text,
containers, query): the live cache drops the span and Shifts the suffix (Eq. 2, its one Shift), then hands it to the
one dispatcher, :func:`sur_lab.repair.repair` (any allocator at budget b, B = ``allowance_for`` of it, with any
executor, or a reference method: Shift, Replay, Re-prefill, Erratum).

**Staleness debt** below). Each edit is the paper's repair (Algorithm 1) on an
:class:`~sur_lab.edits.EditedContext` built for that edit: drop the span, Shift the suffix (Eq. 2), then refresh a
support chosen by any allocator at budget b (Eq. 3) with any executor, or a reference method (Shift, Replay,
Re-prefill).

**Staleness debt** (appendix 14, stale causal predecessors). A row is *stale* when its K/V differ from a clean prefill
of the current tokens because of a deleted, replaced or inserted span: the edit happened before the row after its
state was computed, or the row was computed (or recomputed) while a row before it was stale. A recomputed row is
therefore fresh only if every row before it was fresh when it was recomputed. Each row keeps its *staleness*, the
tokens deleted or inserted before it since its state was computed, directly or through the stale predecessors it read
(recomputing a row sets it to the largest staleness among the rows before it; 0 when they were all fresh). Under these
rules the stale rows are always a suffix of the context, ``[n - debt, n)``, and every row before it equals a clean
prefill up to rounding (tested over random edit programs on float64 models). :attr:`EditSession.debt` counts the stale
rows; paying it (``debt_pct``) refreshes the *earliest* stale rows, the only ones whose refresh makes them fresh.

Re-rotation always starts from each row's *anchor*, the key as the model computed it at its recorded position, and
rotates it once by ``current_pos - recorded_pos`` (float32 arithmetic or better, one cast). A row moved by forty
edits therefore carries one rotation's rounding, not forty: keys re-rotated and stored again after every edit drift (on
SmolLM2 in bfloat16, 40 Shifts of 2 positions leave about 8x the layer-0 key error of one Shift of 80;
``scripts/session_drift.py``). Anchors cost one extra copy of the keys.

:meth:`EditSession.sync` takes a whole new prompt instead (token ids, text, segments, or chat messages rendered one
message per segment), diffs it against the cached ids (:mod:`sur_lab.sync`; text is compared as text first, so a
resent unchanged prompt is a no-op and a resent prompt plus a suffix an append) and applies all its deletions,
insertions and replacements with one repair; :class:`~sur_lab.sync.SyncPolicy` falls back to prefix reuse where a
repair saves little. :func:`sur_lab.check_model` (``EditSession(..., check=True)``) checks a model before it is trusted.

**Weights.** The live cache is valid for the weights it was computed with. Every call that reads or extends it first
compares the model's :func:`~sur_lab.fingerprint.weights_digest` with the one its rows were computed under (an RL
loop's ``p.data.copy_(new)`` included); after a change the context is prefilled again (one warning), and a
:meth:`EditSession.sync` takes the ``"re-prefill"`` path for the new prompt.

:func:`repair_cache` applies one deletion repair to a user's own ``DynamicCache`` built from known ids, with no
sur_lab types in its signature. The session's :attr:`EditSession.cache` works with ``model.generate`` (transformers
5.x takes it as ``cache=``; ``past_key_values=`` is the deprecated alias).

Source: section 3 (evolving contexts, Eq. 2, Eq. 3), Algorithm 1, appendix 7.1 (Shift, sparse refresh), appendix 14
(stale causal predecessors).
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
import time
import warnings
from collections.abc import Mapping
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from sur_lab.allocators import ALLOCATORS
from sur_lab.answer import Answer, greedy_answer
from sur_lab.budget import Selection, Support, check_budget, warn_if_fraction
from sur_lab.cache_ops import check_model_kv, held_kv
from sur_lab.checks import as_count, user_stacklevel
from sur_lab.edits import EditedContext, chat_segments, offset_pieces, splice_replacement, tokenize_segments
from sur_lab.executors import get_executor
from sur_lab.fingerprint import weights_digest
from sur_lab.forward import one_context_warning
from sur_lab.live_cache import LiveCache
from sur_lab.models import LoadedModel, as_loaded_model
from sur_lab.repair import erratum_note_for
from sur_lab.sync import SyncPlan, SyncPolicy, SyncRecord, align_text, choose_path, diff_tokens

#: Reference methods a session accepts (Dirty keeps the deleted rows, which a session cannot hold).
SESSION_REFERENCE_METHODS = ("Shift", "Replay", "Re-prefill", "Erratum")
#: Relevance fallback when no query is pending: the last this-many tokens of the edited context (tokens).
FALLBACK_QUERY_TOKENS = 32


#: The model check ``EditSession(check=True)`` runs: ``fn(lm) -> report``, raising
#: :class:`~sur_lab.model_check.ModelCheckError` for a model that fails. :mod:`sur_lab.model_check` (a higher module:
#: it runs sessions) registers :func:`~sur_lab.model_check.check_model_once` here when it is imported, which importing
#: ``sur_lab`` always does, so this module never imports it (no import cycle, ``tests/test_layout.py``).
_MODEL_CHECK: Callable[[LoadedModel], Any] | None = None


def register_model_check(fn: Callable[[LoadedModel], Any]) -> None:
    """Register the gate ``EditSession(check=True)`` runs (done by :mod:`sur_lab.model_check`; one gate at a time, a
    second registration replaces the first)."""
    global _MODEL_CHECK
    _MODEL_CHECK = fn


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def _is_id(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _check_ids_kind(content, name: str) -> None:
    """Refuse, before any tensor is built, a ``content`` that is neither text nor token ids: ``None``, another
    object, or a list holding something other than numbers (text, a message, ``None``, a boolean).

    Raises:
        TypeError: naming ``name`` (and the first offending item).
    """
    if isinstance(content, (str, torch.Tensor, np.ndarray)):
        return
    if isinstance(content, (list, tuple)):
        rows = content if content and all(isinstance(x, (list, tuple)) for x in content) else [content]
        for row in rows:  # [L] or [[L]] (batch size one; a larger batch is refused by the shape check)
            for i, x in enumerate(row):
                if not _is_id(x):
                    raise TypeError(f"{name} must be text or integer token ids, one kind; {name}[{i}] is "
                                    f"{type(x).__name__} {x!r:.40}")
        return
    raise TypeError(f"{name} must be text or integer token ids ([L] list, tensor or array); got "
                    f"{type(content).__name__} {content!r:.40}")


def _prompt_kind(new) -> str:
    """What :meth:`EditSession.sync` was given: ``"text"``, ``"ids"``, ``"segments"`` (a list of str) or
    ``"messages"`` (a list of dicts), checked before any tensor is built.

    Raises:
        TypeError: naming ``new`` for ``None``, another object, or a list that mixes kinds (ids and text, messages and
            text), with the first item of another kind.
    """
    if new is None:
        raise TypeError("new is None; pass the whole new prompt: token ids, text, a list of text segments or a list of "
                        "chat messages")
    if isinstance(new, str):
        return "text"
    if isinstance(new, (torch.Tensor, np.ndarray)):
        return "ids"
    if not isinstance(new, (list, tuple)):
        raise TypeError(f"new must be token ids, text, a list of text segments or a list of chat messages; got "
                        f"{type(new).__name__} {new!r:.40}")
    if not new:
        return "ids"  # refused as empty by the ids check
    kinds = {"ids": _is_id, "segments": lambda x: isinstance(x, str), "messages": lambda x: isinstance(x, Mapping)}
    if all(isinstance(x, (list, tuple)) for x in new):  # [[L]]: ids of batch size one
        _check_ids_kind(new, "new")
        return "ids"
    for kind, test in kinds.items():
        if test(new[0]):
            bad = next((i for i, x in enumerate(new) if not test(x)), None)
            if bad is None:
                return kind
            raise TypeError(f"new mixes kinds: new[0] is {type(new[0]).__name__} ({kind}) but new[{bad}] is "
                            f"{type(new[bad]).__name__} {new[bad]!r:.40}; pass one kind: token ids, text segments or "
                            "chat messages")
    raise TypeError(f"new must be token ids, text, a list of text segments or a list of chat messages; new[0] is "
                    f"{type(new[0]).__name__} {new[0]!r:.40}")


@dataclass(frozen=True)
class EditRecord:
    """What one edit did (a :class:`~sur_lab.repair.RepairResult`-style record without the cache).

    Attributes:
        kind: ``"append"``, ``"delete"`` or ``"replace"``.
        start / end: the edited row span ``[start, end)`` of the context before the edit (``append``: the new rows).
        inserted: tokens inserted (``append`` / ``replace``), 0 for ``delete``.
        method: repair method (allocator name or a reference method); ``""`` for ``append``.
        budget_pct: b in percent (NaN for reference methods and ``append``).
        suffix_len: S, rows after the edit that were Shifted (tokens).
        allowance: B, suffix positions refreshed by the repair (S for Replay and Re-prefill, 0 for Shift).
        selection: the allocator's selection (``None`` for reference methods and the B = 0 / B = S endpoints).
        refreshed_rows: int64 absolute rows of the new context recomputed by the repair and the debt pass (inserted
            rows excluded).
        forwarded_tokens: tokens run through the model by the edit: inserted + refreshed (Re-prefill: every row).
        timings_ms: ``prefill`` (inserted tokens), ``shift``, ``select``, ``refresh``, ``debt`` (ms).
        debt_before: stale rows right after the Shift, before any refresh (rows).
        debt_after: stale rows after the edit (rows).
        debt_refreshed: stale rows refreshed by the debt pass (rows).
        num_tokens: context length after the edit (tokens).
    """

    kind: str
    start: int
    end: int
    inserted: int
    method: str
    budget_pct: float
    suffix_len: int
    allowance: int
    selection: Selection | None
    refreshed_rows: np.ndarray = field(repr=False)
    forwarded_tokens: int
    timings_ms: dict[str, float]
    debt_before: int
    debt_after: int
    debt_refreshed: int
    num_tokens: int

    @property
    def support(self) -> Support | None:
        """The suffix-local support of the repair (``None`` for reference methods and ``append``)."""
        return self.selection.support if self.selection is not None else None

    @property
    def refresh_ms(self) -> float:
        """Post-edit repair time, ms: select + shift + refresh + debt (Eq. 20 without the answer term)."""
        return float(sum(self.timings_ms.get(k, 0.0) for k in ("select", "shift", "refresh", "debt")))


@dataclass(frozen=True)
class _Query:
    ids: torch.Tensor
    question: str | None
    question_ids: torch.Tensor | None


@dataclass(frozen=True)
class _Policy:
    method: str
    budget_pct: float
    executor: str
    debt_pct: float
    seed: int
    options: dict


@dataclass(frozen=True)
class _State:
    """An immutable snapshot of the session; edits build a new one and commit it only when they succeed.

    The conversation: ``ids`` ``[n]`` int64 tokens, ``segment`` the append/insert call each row came from (its message
    container), ``pieces`` each row's text (``None`` without a tokenizer); and ``live``, the
    :class:`~sur_lab.live_cache.LiveCache` of those rows (tensors, anchors, recorded angles, staleness).
    """

    ids: torch.Tensor
    live: LiveCache
    segment: np.ndarray
    pieces: tuple[str, ...] | None

    @property
    def n(self) -> int:
        return int(self.ids.numel())

    def cache(self) -> DynamicCache:
        return self.live.cache()


class EditSession:
    """A live KV cache of an evolving context, repaired after every edit (section 3, Algorithm 1 per edit).

    Rows are kept in context order with contiguous positions ``0 .. n-1``. Keys in :attr:`cache` are always rotated
    for their current position, so the cache can be passed to ``model.generate`` at any time. Every edit validates
    its arguments before any work and builds a new state that replaces the old one only when the edit succeeds: after
    any raised error the session is unchanged. No tensor the session holds is ever written in place.

    Args:
        lm: the model, a :class:`~sur_lab.models.LoadedModel` or a transformers causal LM module in eval mode (any
            dtype; float64 tiny models give exact comparisons).
        method: default repair method: an allocator name (``"SUR"``) or ``"Shift"``, ``"Replay"``, ``"Re-prefill"``.
        budget_pct: default budget b in [0, 100], percent of each edit's suffix (Eq. 3).
        executor: default executor name (``"sequential"`` reference, packed backends).
        debt_pct: default staleness-debt budget in [0, 100], percent of the stale rows left after an edit's repair
            that are refreshed too, earliest first (the rows whose refresh retires debt, see the module docstring;
            0: only the edit's own allowance is spent; 100: the cache equals a clean prefill).
        seed: case seed for randomized allocators.
        options: allocator options (passed through).
        sync_policy: when :meth:`sync` falls back to prefix reuse (:class:`~sur_lab.sync.SyncPolicy`; its defaults
            when None).
        check: run :func:`sur_lab.check_model` on ``lm`` first, once per model object (the result is cached), and
            raise :class:`~sur_lab.model_check.ModelCheckError` naming the failing check.

    Raises:
        TypeError: naming ``lm`` when it is neither a LoadedModel nor a module.
        ValueError: naming ``method``, ``budget_pct``, ``executor``, ``debt_pct`` or ``sync_policy`` when invalid,
            ``lm`` when the module is in training mode.
        ModelCheckError: with ``check=True``, when the model fails :func:`sur_lab.check_model`.

    Warns:
        BudgetFractionWarning: (a ``UserWarning``) when a default or per-edit ``budget_pct`` is in (0, 1), usually
            a fraction meant as a percentage (:func:`sur_lab.budget.warn_if_fraction`).
    """

    def __init__(
        self,
        lm: LoadedModel | torch.nn.Module,
        *,
        method: str = "SUR",
        budget_pct: float = 5.0,
        executor: str = "sequential",
        debt_pct: float = 0.0,
        seed: int = 0,
        options: dict | None = None,
        sync_policy: SyncPolicy | None = None,
        check: bool = False,
    ) -> None:
        lm = as_loaded_model(lm, name="lm")
        self.lm = lm
        self._defaults = _Policy(method, budget_pct, executor, debt_pct, seed, dict(options or {}))
        self._defaults = self._policy()
        warn_if_fraction(self._defaults.budget_pct)
        if sync_policy is not None and not isinstance(sync_policy, SyncPolicy):
            raise ValueError(f"sync_policy must be a sur_lab.SyncPolicy; got {type(sync_policy).__name__}")
        self._sync_policy = sync_policy if sync_policy is not None else SyncPolicy()
        if check:
            if _MODEL_CHECK is None:  # only when sur_lab.model_check was never imported (importing sur_lab does it)
                raise RuntimeError("EditSession(check=True): no model check registered; import sur_lab.model_check")
            _MODEL_CHECK(lm)
        self._state = _State(ids=torch.zeros(0, dtype=torch.long), live=LiveCache.empty(),
                             segment=np.zeros(0, dtype=np.int64), pieces=() if lm.tokenizer is not None else None)
        self._next_segment = 0
        self._query: _Query | None = None
        self.history: list[EditRecord | SyncRecord] = []
        self._weights = weights_digest(lm.model)  # the weights the live rows were computed with

    # ------------------------------------------------------------------------------------------------------------
    # Construction from an existing cache

    @classmethod
    def from_cache(cls, lm: LoadedModel | torch.nn.Module, cache, input_ids, **defaults: Any) -> EditSession:
        """A session over an existing cache of ``input_ids`` (one segment; rows computed at positions ``0 .. n-1``).

        The cache is checked against the model before any work and is not modified. A ``DynamicCache`` is not copied
        (the session shares its tensors and never writes into them); a ``StaticCache`` gives its filled rows only,
        copied (:func:`sur_lab.cache_ops.held_kv`). The rows are taken as a clean prefill of ``input_ids`` (debt 0).

        Args:
            lm: the model the cache was built with (a LoadedModel or the transformers module).
            cache: ``DynamicCache`` (or ``StaticCache``) holding ``n`` rows per layer, ``[1, H_kv, n, d_h]``, in the
                model's dtype and on its device.
            input_ids: ``[n]`` (or ``[1, n]``) token ids the cache was built from.
            **defaults: session defaults (``method``, ``budget_pct``, ``executor``, ``debt_pct``, ``seed``,
                ``options``).

        Raises:
            TypeError: naming ``cache`` for ``None``, a legacy tuple cache or another cache type (named); naming
                ``lm`` as the constructor.
            ValueError: naming ``cache`` when its layers hold different row counts, or its layer count, batch size,
                KV heads, head dim, dtype or device differ from the model's; naming ``input_ids`` when it is empty,
                not integer ids, or not of the cache's length.
        """
        session = cls(lm, **defaults)
        spec = session.lm.spec
        kv = held_kv(cache, "cache")
        rows = check_model_kv(
            kv, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            dtype=session.lm.dtype, device=session.lm.device, name="cache",
        )
        ids = session._as_ids(input_ids, "input_ids")
        n = int(ids.numel())
        if rows != n:
            raise ValueError(f"input_ids has {n} tokens; the cache holds {rows} rows")
        session._state = _State(ids=ids, live=LiveCache.clean(kv), segment=np.zeros(n, dtype=np.int64),
                                pieces=session._decode_pieces(ids))
        session._next_segment = 1
        return session

    def fork(self, **defaults: Any) -> EditSession:
        """A new session starting from this one's state (tensors shared, never written) with other defaults.

        The pending query is carried over; the history starts empty. Forking costs no tensor copy, so several repair
        policies can follow the same edits from one prefill.

        Raises:
            ValueError: as the constructor, for invalid ``defaults``.
        """
        merged = {**{f: getattr(self._defaults, f) for f in _Policy.__dataclass_fields__},
                  "sync_policy": self._sync_policy, **defaults}
        self._follow_weights()
        other = EditSession(self.lm, **merged)
        other._state, other._next_segment, other._query = self._state, self._next_segment, self._query
        other._weights = self._weights
        return other

    # ------------------------------------------------------------------------------------------------------------
    # Read-only views

    def __len__(self) -> int:
        return self._state.n

    @property
    def tokens(self) -> torch.Tensor:
        """``[n]`` int64 token ids of the current context (a copy)."""
        return self._state.ids.clone()

    @property
    def text(self) -> str | None:
        """The current context's text (``None`` without a tokenizer); appended text is kept verbatim."""
        return "".join(self._state.pieces) if self._state.pieces is not None else None

    @property
    def cache(self) -> DynamicCache:
        """The live cache: a new ``DynamicCache`` object over the session's tensors (no copy), ``n`` rows per layer.

        Appending to it (``model.generate``, :func:`~sur_lab.forward.forward_tokens`) concatenates into new tensors
        and leaves the session unchanged; writing into its tensors in place would not. After an update of the model's
        weights the context is prefilled again first (module docstring).
        """
        self._follow_weights()
        return self._state.cache()

    @property
    def pending_query(self) -> torch.Tensor | None:
        """``[Q]`` int64 ids of the pending query (processed by :meth:`answer` and used for SUR's relevance)."""
        return None if self._query is None else self._query.ids.clone()

    @property
    def recorded_positions(self) -> np.ndarray:
        """int64 ``[n]``: the position each row's keys were computed at (its anchor's angle)."""
        return self._state.live.angle_pos.copy()

    @property
    def staleness(self) -> np.ndarray:
        """int64 ``[n]``: tokens deleted or inserted before each row since its K/V were computed, directly or through
        the stale rows it read when it was computed (0: fresh; module docstring)."""
        return self._state.live.stale.copy()

    @property
    def debt(self) -> int:
        """Staleness debt (rows): rows whose K/V differ from a clean prefill of the current tokens because of a
        deleted, replaced or inserted span, including rows recomputed over stale predecessors (appendix 14). They are
        always the last ``debt`` rows; ``debt == 0`` means the cache equals a clean prefill up to rounding."""
        return self._state.live.debt

    # ------------------------------------------------------------------------------------------------------------
    # Validation helpers

    def _policy(self, method=None, budget_pct=None, executor=None, debt_pct=None, seed=None, options=None) -> _Policy:
        d = self._defaults
        method = d.method if method is None else method
        if method == "Dirty":
            raise ValueError("method='Dirty' keeps the deleted rows, which an edit session cannot hold; use "
                             f"{', '.join(SESSION_REFERENCE_METHODS)} or an allocator")
        if method not in SESSION_REFERENCE_METHODS and method not in ALLOCATORS:
            raise ValueError(
                f"unknown method={method!r}; allowed: {', '.join(SESSION_REFERENCE_METHODS)} or an allocator "
                f"({', '.join(sorted(ALLOCATORS))})"
            )
        budget = check_budget(d.budget_pct if budget_pct is None else budget_pct)
        if budget_pct is not None:  # the session default warned in __init__
            warn_if_fraction(budget)
        executor = d.executor if executor is None else executor
        get_executor(executor)
        debt = d.debt_pct if debt_pct is None else debt_pct
        try:
            debt = check_budget(debt)
        except ValueError:
            raise ValueError(
                f"debt_pct must be a number in [0, 100] (percent of the stale rows); got {debt!r}"
            ) from None
        seed = as_count(d.seed if seed is None else seed, "seed", minimum=0)  # 1.5 is refused, not truncated
        return _Policy(method, budget, executor, debt, seed,
                       dict(d.options if options is None else options))

    def _follow_weights(self) -> None:
        """Prefill the context again when the model's weights changed since its rows were computed (an in-place
        update: :func:`~sur_lab.fingerprint.weights_digest`); the new rows are fresh (debt 0)."""
        now = weights_digest(self.lm.model)
        if now == self._weights:
            return
        old = self._state
        if old.n:
            warnings.warn(
                f"EditSession: the model's weights changed since the cache was computed (an in-place update); the "
                f"context's {old.n} rows are prefilled again", RuntimeWarning, stacklevel=user_stacklevel(),
            )
            self._state = dataclasses.replace(old, live=LiveCache.prefilled(self.lm, old.ids))
        self._weights = now

    def _as_ids(self, content, name: str) -> torch.Tensor:
        _check_ids_kind(content, name)
        if isinstance(content, str):
            if self.lm.tokenizer is None:
                raise ValueError(f"{name} is text but the model has no tokenizer; pass token ids")
            ids = torch.tensor(self.lm.tokenizer(content, add_special_tokens=False)["input_ids"], dtype=torch.long)
        else:
            ids = torch.as_tensor(content)
            if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() > 2 or (
                ids.dim() == 2 and ids.shape[0] != 1
            ):
                raise ValueError(
                    f"{name} must be integer token ids [L] or [1, L]; got {ids.dtype} {tuple(ids.shape)}"
                )
            ids = ids.reshape(-1).to(torch.long).cpu()
        if ids.numel() == 0:
            raise ValueError(f"{name} is empty; need at least one token")
        vocab = self.lm.spec.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"{name} has ids outside [0, {vocab}) (the vocabulary)")
        return ids

    def _check_span(self, start, end) -> tuple[int, int]:
        try:
            a, b = operator.index(start), operator.index(end)
        except TypeError:
            raise ValueError(f"span (start={start!r}, end={end!r}) must be integers") from None
        if isinstance(start, bool) or isinstance(end, bool):
            raise ValueError(f"span (start={start!r}, end={end!r}) must be integers, not booleans")  # noqa: TRY004
        n = self._state.n
        if a >= b:
            raise ValueError(f"span [start={a}, end={b}) is empty; need start < end")
        if self._query is not None and a >= 0 and b > n and a < n + int(self._query.ids.numel()):
            raise ValueError(
                f"span [start={a}, end={b}) reaches into the pending query, which starts at row {n}; only the cached "
                f"context [0, {n}) can be edited"
            )
        if a < 0 or b > n:
            raise ValueError(f"span [start={a}, end={b}) is out of range; need 0 <= start < end <= {n}")
        return a, b

    # ------------------------------------------------------------------------------------------------------------
    # Text pieces

    def _text_pieces(self, text: str, ids: torch.Tensor) -> tuple[str, ...]:
        """Each token's share of ``text`` (:func:`sur_lab.edits.offset_pieces`)."""
        enc = self.lm.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return offset_pieces(text, enc["offset_mapping"])

    def _decode_pieces(self, ids: torch.Tensor) -> tuple[str, ...] | None:
        if self.lm.tokenizer is None:
            return None
        return tuple(self.lm.tokenizer.decode([int(t)], skip_special_tokens=False) for t in ids)

    def _pieces(self, content, ids: torch.Tensor) -> tuple[str, ...] | None:
        if self.lm.tokenizer is None:
            return None
        return self._text_pieces(content, ids) if isinstance(content, str) else self._decode_pieces(ids)

    # ------------------------------------------------------------------------------------------------------------
    # Queries and answers

    def set_query(self, content, *, question=None) -> None:
        """Set the pending query: the tokens :meth:`answer` processes after the context (not cached).

        The pending query (or ``question``, when given) is also the relevance query SUR scores the suffix against
        (Eq. 7). Without one, relevance is scored against the last :data:`FALLBACK_QUERY_TOKENS` context tokens.

        Args:
            content: query text (tokenized without special tokens; chat-template markers in it are kept) or ids.
            question: the question alone (text or ids), for relevance scoring (defaults to the whole query).

        Raises:
            TypeError: naming ``content`` or ``question`` when neither text nor integer ids.
            ValueError: naming ``content`` or ``question`` when empty or out of the vocabulary.
        """
        ids = self._as_ids(content, "content")
        question_ids = None
        if question is not None:
            if isinstance(question, str) and not question.strip():
                raise ValueError("question is empty (empty query)")
            question_ids = self._as_ids(question, "question")
        self._query = _Query(ids, question if isinstance(question, str) else None, question_ids)

    def clear_query(self) -> None:
        """Forget the pending query."""
        self._query = None

    def answer(self, query=None, *, max_new_tokens: int = 64, draft: Sequence[int] = ()) -> Answer:
        """Greedy answer after the current context (:func:`~sur_lab.answer.greedy_answer`); the session is unchanged.

        Args:
            query: query text or ids; ``None`` uses the pending query.
            max_new_tokens: decoding limit (tokens, >= 1).
            draft: token ids to verify in one forward (e.g. Re-prefill's answer), see ``greedy_answer``.

        Raises:
            ValueError: naming ``query`` when there is neither a query nor a pending one, or it is empty; naming
                ``max_new_tokens`` when < 1.
        """
        ids = self._query_ids(query)
        if draft:
            return greedy_answer(self.lm, self.cache, ids, max_new_tokens=max_new_tokens, draft=draft, copy=True)
        # A fresh cache object over the session's tensors: decoding concatenates into new tensors, no clone needed.
        return greedy_answer(self.lm, self.cache, ids, max_new_tokens=max_new_tokens, copy=False)

    def _query_ids(self, query) -> torch.Tensor:
        """``[Q]`` ids of ``query`` (text or ids), or of the pending query when ``None``."""
        if query is None:
            if self._query is None:
                raise ValueError("query is None and no query is pending (set_query)")
            return self._query.ids
        return self._as_ids(query, "query")

    def forward_query(self, query=None) -> tuple[Answer, DynamicCache]:
        """One request's query forward after the current context: the first answer token and the cache holding the
        query's rows; the session is unchanged (the cache's tensors are new).

        For studies that time the first token per request and decode the rest of several answers together
        (:meth:`sur_lab.answer.AnswerBatch.queried` takes the returned caches and first-token logits).

        Args:
            query: the query as text (tokenized without special tokens, so it must carry the chat template's user turn
                and generation prompt itself, as :meth:`answer`'s does) or ``[Q]`` / ``[1, Q]`` integer ids; ``None``
                uses the pending query.

        Returns:
            ``(first, cache)``: ``first`` is :func:`~sur_lab.answer.greedy_answer` with ``max_new_tokens=1`` (its
            ``timings_ms["query"]`` is the query forward, ms; ``first_token_logits`` ``[V]`` float32 on the CPU);
            ``cache`` holds the session's ``n = len(session)`` rows followed by the query's ``Q`` rows. Pass the same ids
            as ``query_ids`` to :meth:`~sur_lab.answer.AnswerBatch.queried`.

        Raises:
            ValueError: as :meth:`answer`.
        """
        ids = self._query_ids(query)
        cache = self.cache  # a fresh object over the session's tensors (weights followed): new tensors on forward
        return greedy_answer(self.lm, cache, ids, max_new_tokens=1, copy=False), cache

    # ------------------------------------------------------------------------------------------------------------
    # Edits

    @one_context_warning
    def append(self, content) -> EditRecord:
        """Prefill new tokens (a user or tool turn) at positions ``n .. n + L - 1``; they form one new container.

        Args:
            content: text (tokenized without special tokens; template markers in it are kept) or ``[L]`` ids.

        Returns:
            EditRecord with ``kind="append"`` and ``timings_ms["prefill"]``.

        Raises:
            TypeError: naming ``content`` when it is neither text nor integer ids (``None``, a list holding text).
            ValueError: naming ``content`` when empty, not integer ids, or text without a tokenizer.
        """
        ids = self._as_ids(content, "content")
        pieces = self._pieces(content, ids)
        self._follow_weights()
        old = self._state
        n, m = old.n, int(ids.numel())
        new, prefill_ms = self._extended(old, ids, pieces, np.full(m, self._next_segment, dtype=np.int64))
        record = EditRecord(
            "append", n, n + m, m, "", float("nan"), 0, 0, None, np.zeros(0, dtype=np.int64), m,
            {"prefill": prefill_ms, "shift": 0.0, "select": 0.0, "refresh": 0.0, "debt": 0.0},
            self.debt, new.live.debt, 0, new.n,
        )
        self._commit(new, record)
        self._next_segment += 1
        return record

    def _extended(self, old: _State, ids: torch.Tensor, pieces, segment: np.ndarray) -> tuple[_State, float]:
        """``old`` with ``ids`` prefilled after it at positions ``n .. n + m - 1``; returns the state and its ms."""
        live, prefill_ms = old.live.extended(self.lm, ids)
        return self._joined(old, ids, live, pieces, segment), prefill_ms

    @staticmethod
    def _joined(old: _State, ids: torch.Tensor, live: LiveCache, pieces, segment: np.ndarray) -> _State:
        """``old``'s conversation followed by ``ids`` (their ``pieces`` and container labels), over ``live``."""
        return _State(ids=torch.cat((old.ids, ids)), live=live,
                      segment=np.concatenate((old.segment, np.asarray(segment, dtype=np.int64))),
                      pieces=None if old.pieces is None else old.pieces + tuple(pieces))

    @one_context_warning
    def delete(
        self, start: int, end: int, *, method: str | None = None, budget_pct: float | None = None,
        executor: str | None = None, debt_pct: float | None = None, seed: int | None = None,
        options: dict | None = None,
    ) -> EditRecord:
        """Delete rows ``[start, end)``, Shift the suffix and repair it (Algorithm 1 on this edit).

        ``method="Erratum"`` (issue 26; the reference operator of :func:`sur_lab.repair.repair`) instead keeps every
        row and prefills a correction note after the context (``options["erratum_template"]`` or
        ``options["erratum_note_ids"]``; a session without text needs the latter): the session's tokens become the
        context before the edit followed by the note, and the record's ``forwarded_tokens`` is the note's length.

        The suffix keys are re-rotated from their anchors (one rotation, float32 or better, one cast); the repair
        refreshes the support that ``method`` chooses at ``budget_pct`` with ``executor``; then, with ``debt_pct`` >
        0, the stalest remaining stale rows are refreshed too. Arguments left ``None`` take the session defaults.

        Returns:
            EditRecord (allowance, support, refreshed rows, timings in ms, debt).

        Raises:
            ValueError: before any work, naming the span (empty, out of range, reaching into the pending query),
                ``method``, ``budget_pct``, ``executor`` or ``debt_pct``.
        """
        policy = self._policy(method, budget_pct, executor, debt_pct, seed, options)
        a, b = self._check_span(start, end)
        self._follow_weights()
        return self._edit(a, b, None, None, policy)

    @one_context_warning
    def replace(
        self, start: int, end: int, content, *, method: str | None = None, budget_pct: float | None = None,
        executor: str | None = None, debt_pct: float | None = None, seed: int | None = None,
        options: dict | None = None,
    ) -> EditRecord:
        """Replace rows ``[start, end)`` by ``content``: delete, prefill the new tokens at their positions, repair.

        The inserted tokens are computed against the (unchanged) prefix; the suffix after them is re-rotated to its
        new positions and repaired under the same budget rules as :meth:`delete` (its allowance is a share of the
        suffix, Eq. 3). The inserted rows join the container of the row they replace.

        ``method="Erratum"`` (as in :meth:`delete`) keeps every row and appends a correction note giving the new text
        instead (issue 26): the session then holds the context before the edit followed by the note.

        Raises:
            TypeError: naming ``content`` when it is neither text nor integer ids.
            ValueError: as :meth:`delete`, and naming ``content`` when empty.
        """
        policy = self._policy(method, budget_pct, executor, debt_pct, seed, options)
        a, b = self._check_span(start, end)
        ids = self._as_ids(content, "content")
        self._follow_weights()
        return self._edit(a, b, ids, self._pieces(content, ids), policy)

    # ------------------------------------------------------------------------------------------------------------
    # Whole-prompt sync (issue 27)

    @one_context_warning
    def sync(
        self, new, *, method: str | None = None, budget_pct: float | None = None, executor: str | None = None,
        debt_pct: float | None = None, seed: int | None = None, options: dict | None = None,
        policy: SyncPolicy | None = None, add_generation_prompt: bool = False, template_kwargs: dict | None = None,
    ) -> SyncRecord:
        """Make the cached context equal to a whole new prompt, with one budgeted repair (agent loops).

        The new prompt's ids are diffed against the current ones (:func:`sur_lab.sync.diff_tokens`: common prefix,
        then difflib's matching blocks); the deletions, insertions and replacements are applied together so that
        every row index stays valid, then **one** repair runs for the whole sync (Algorithm 1 over the union of the
        stale suffix):

        1. rows deleted from the prompt are dropped; every kept row after the first change is moved to its new
           position and its key re-rotated once from its recorded angle (Eq. 2, the live cache's one Shift,
           :meth:`sur_lab.live_cache.LiveCache.shifted`);
        2. inserted text is prefilled at its positions: a run at the first change against the unchanged prefix,
           runs inside the stale region as forced rows of the refresh (they read the rows refreshed before them),
           and an append at the end after the repair;
        3. one allocation chooses B of the S kept rows after the first change under ``method`` and ``budget_pct``:
           the allocator's allowance (:func:`~sur_lab.allocators.allowance_for`: ⌈S · b / 100⌉, Eq. 3, or the
           whole-prompt base a variant binds; Replay: all of them; Shift: none), refreshed in one executor call with
           the inserted rows (the ``forced`` rows of :func:`sur_lab.repair.repair`, the one dispatcher); then the debt
           pass (``debt_pct``) as for every edit.

        The allocator scores the suffix from the first stale row, inserted rows included; a multi-change sync whose
        allocation lands on inserted rows (recomputed anyway) refreshes fewer than B kept rows; the record tells.
        :class:`~sur_lab.sync.SyncPolicy` (``policy``, default the session's) falls back to prefix reuse (recompute
        every row from the first change) when the first change is near the end or most of what follows it is new.
        A pure append computes only the new tokens; an unchanged prompt computes nothing but the debt pass
        (``debt_pct``). ``Re-prefill`` prefills the new prompt whole, and so does every sync after the model's weights
        changed (module docstring).

        Text is compared as text before any token diff (:func:`sur_lab.sync.align_text`): the session's own
        :attr:`text` resent unchanged is a no-op, and :attr:`text` plus a suffix is an append of the suffix's tokens,
        whatever the whole text would tokenize to; only the text between the stable boundaries around a change is
        tokenized again, and any token that then differs from the cached ones is repaired and counted in the debt.

        Args:
            new: the whole new prompt: ``[m]`` token ids (tensor or list of ints); text (tokenized as one segment,
                without special tokens); a list of text segments (each tokenized on its own,
                :func:`sur_lab.edits.tokenize_segments`, one container each); or a list of chat messages
                (``{"role", "content"}`` dicts) rendered with the tokenizer's chat template segment by segment
                (:func:`sur_lab.edits.chat_segments`: message boundaries are token boundaries, located by rendering
                the conversation prefix; a template that renders an earlier message differently once another follows
                is refused).
            method, budget_pct, executor, debt_pct, seed, options: as :meth:`delete` (session defaults when None).
            policy: when to fall back to prefix reuse (default: the session's ``sync_policy``).
            add_generation_prompt: chat messages only: end the prompt with the template's generation prompt.
            template_kwargs: chat messages only: passed to ``apply_chat_template`` (see :func:`chat_segments`).

        Returns:
            :class:`~sur_lab.sync.SyncRecord` (path, rows reused / deleted / inserted / re-rotated / recomputed,
            allowance, debt, timings in ms); it is also appended to :attr:`history`.

        Raises:
            TypeError: before any tensor is built, naming ``new`` (``None``, another object, a list that mixes ids,
                text and messages), ``template_kwargs`` (not a dict) or ``add_generation_prompt`` (not a bool).
            ValueError: before any work, naming ``new`` (empty, ids outside the vocabulary, text or messages
                without a tokenizer, a malformed message, a chat template that is not prefix-stable), ``policy`` (not
                a SyncPolicy), ``method``, ``budget_pct``, ``executor`` or ``debt_pct``. After any error the session
                is unchanged.
        """
        t_start = time.perf_counter()
        pol = self._policy(method, budget_pct, executor, debt_pct, seed, options)
        if pol.method == "Erratum":
            raise ValueError("method='Erratum' appends a note for one edit (delete / replace); sync takes Shift, "
                             "Replay, Re-prefill or an allocator")
        sync_policy = self._sync_policy if policy is None else policy
        if not isinstance(sync_policy, SyncPolicy):
            raise ValueError(f"policy must be a sur_lab.SyncPolicy; got {type(sync_policy).__name__}")
        if not isinstance(add_generation_prompt, (bool, np.bool_)):
            raise TypeError(f"add_generation_prompt must be True or False; got {add_generation_prompt!r}")
        if template_kwargs is not None and not isinstance(template_kwargs, Mapping):
            raise TypeError("template_kwargs must be a dict of apply_chat_template keyword arguments (or None); got "
                            f"{type(template_kwargs).__name__} {template_kwargs!r:.60}")
        timings = {"diff": 0.0, "prefill": 0.0, "shift": 0.0, "select": 0.0, "refresh": 0.0, "debt": 0.0}
        ids, pieces, labels = self._sync_input(new, bool(add_generation_prompt), template_kwargs)
        old = self._state
        t0 = time.perf_counter()
        plan = diff_tokens(old.ids, ids)
        timings["diff"] = _ms(t0)
        path = choose_path(plan, sync_policy, pol.method)
        weights = weights_digest(self.lm.model)
        if weights != self._weights and old.n:  # rows computed under other weights: every row is recomputed
            path = "re-prefill"
        pieces = self._sync_pieces(old, plan, ids, pieces)
        labels, next_segment = self._sync_labels(old, plan, labels)
        f, m = plan.first_change, plan.new_len
        selection, B, refreshed, rerotated = None, 0, np.zeros(0, dtype=np.int64), 0
        recomputed = np.zeros(m, dtype=bool)
        if path == "unchanged":
            state = old
        elif path == "re-prefill":
            t0 = time.perf_counter()
            state = _State(ids, LiveCache.prefilled(self.lm, ids), labels, pieces)
            timings["refresh"] = _ms(t0)
            recomputed[:], B = True, plan.stale_rows
        elif path in ("tail", "prefix-reuse"):
            state = _State(old.ids[:f], old.live.prefix(f), old.segment[:f],
                           None if old.pieces is None else old.pieces[:f])
            if f < m:
                state, timings["prefill"] = self._extended(state, ids[f:], pieces[f:] if pieces else (), labels[f:])
            state = dataclasses.replace(state, segment=labels)
            recomputed[f:] = True
        else:
            state, selection, B, refreshed, rerotated = self._sync_repair(old, plan, ids, pieces, labels, pol, timings)
            recomputed[plan.source < 0] = True
            recomputed[refreshed] = True
        debt_before = state.live.debt
        state, debt_rows = self._pay_debt(state, pol, timings)  # an unchanged prompt pays debt_pct too
        forwarded = int(recomputed.sum()) + len(debt_rows)
        recomputed[debt_rows] = True
        timings["total"] = _ms(t_start)
        nan = float("nan")
        record = SyncRecord(
            path=path, method=pol.method,
            budget_pct=nan if pol.method in SESSION_REFERENCE_METHODS else pol.budget_pct,
            previous_tokens=plan.old_len, num_tokens=m, first_change=f, deleted=plan.deleted, inserted=plan.inserted,
            reused=int((plan.kept & ~recomputed).sum()), rerotated=int(rerotated), recomputed=forwarded,
            stale_rows=plan.stale_rows, allowance=int(B), selection=selection,
            refreshed_rows=np.union1d(refreshed, debt_rows).astype(np.int64), debt_before=debt_before,
            debt_after=state.live.debt, debt_refreshed=len(debt_rows), timings_ms=timings,
        )
        self._commit(state, record)
        self._next_segment = next_segment
        self._weights = weights
        return record

    def _sync_input(self, new, add_generation_prompt: bool, template_kwargs):
        """``new`` as ``(ids [m], pieces or None, container labels or None)``; None: derived from the diff."""
        tok = self.lm.tokenizer
        kind = _prompt_kind(new)
        if kind == "text":
            old = self._state
            if tok is not None and old.pieces is not None and old.n:
                # Text first: the unchanged text keeps its cached rows (sur_lab.sync.align_text).
                aligned = align_text(tok, old.ids, old.pieces, old.segment, new)
                if aligned is not None:
                    return self._as_ids(aligned[0], "new"), aligned[1], None
            ids = self._as_ids(new, "new")
            return ids, self._pieces(new, ids), None
        if kind == "ids":
            return self._as_ids(new, "new"), None, None
        if tok is None:
            what = "chat messages" if kind == "messages" else "text segments"
            raise ValueError(f"new is a list of {what} but the model has no tokenizer; pass token ids")
        if kind == "messages":
            try:
                segments = chat_segments(tok, new, add_generation_prompt=add_generation_prompt,
                                         template_kwargs=template_kwargs)
            except ValueError as err:
                raise ValueError(f"new: {err}") from None
        else:
            segments = list(new)
        seg_ids, offsets = tokenize_segments(tok, segments)
        flat = [t for x in seg_ids for t in x]
        ids = self._as_ids(torch.tensor(flat, dtype=torch.long), "new")
        pieces = offset_pieces("".join(segments), offsets)
        labels = np.concatenate([np.full(len(x), k, dtype=np.int64) for k, x in enumerate(seg_ids)])
        return ids, pieces, labels

    def _sync_pieces(self, old: _State, plan: SyncPlan, ids: torch.Tensor, pieces) -> tuple | None:
        if old.pieces is None or pieces is not None:
            return pieces
        decode = self.lm.tokenizer.decode
        return tuple(old.pieces[src] if src >= 0 else decode([int(ids[j])], skip_special_tokens=False)
                     for j, src in enumerate(plan.source.tolist()))

    def _sync_labels(self, old: _State, plan: SyncPlan, labels) -> tuple[np.ndarray, int]:
        """Container label of each new row and the next free label: given segments get fresh labels; otherwise kept
        rows keep theirs and inserted rows join the row before them (a new container after the last kept row)."""
        base = self._next_segment
        if labels is not None:
            return labels + base, base + (int(labels.max()) + 1 if len(labels) else 0)
        out = np.empty(plan.new_len, dtype=np.int64)
        t = plan.tail_start
        for j, src in enumerate(plan.source.tolist()):
            if src >= 0:
                out[j] = old.segment[src]
            elif j >= t:
                out[j] = base
            else:
                out[j] = out[j - 1] if j else base
        return out, base + 1

    def _sync_repair(self, old: _State, plan: SyncPlan, ids: torch.Tensor, pieces, labels, policy: _Policy,
                     timings: dict):
        """The repair path of :meth:`sync`; returns ``(state, selection, B, refreshed kept rows, rows re-rotated)``.

        The kept rows after the first change are moved by the live cache's one Shift (:meth:`LiveCache.shifted`):
        the inserted run at the first change is prefilled against the unchanged prefix, inserted rows inside the
        stale region are holes, forced rows of the one repair (:meth:`LiveCache.repaired`, B a share of the S kept
        rows on the method's allowance base); an append at the end follows the repair (it reads the repaired rows).
        """
        src, f, t, m = plan.source, plan.first_change, plan.tail_start, plan.new_len
        kept_rows = np.flatnonzero(src[:t] >= 0)
        e0 = int(kept_rows[kept_rows >= f][0])  # first stale row: the inserted run [f, e0) precedes it
        region = src[e0:t]
        forced = np.flatnonzero(region < 0).astype(np.int64)  # inserted rows inside the stale region

        # 1-2. Drop, insert, move and re-rotate: each kept row once from its anchor to its new position.
        live, moved, rerotated = old.live.shifted(self.lm, f, ids[f:e0] if e0 > f else None, region)
        timings["prefill"] += moved["prefill"]
        timings["shift"] = moved["shift"]
        shifted = _State(ids[:t], live, labels[:t], None if pieces is None else tuple(pieces[:t]))

        # 3. One allocation over the S kept rows after the first change, one refresh with the inserted rows.
        removed = old.ids[torch.from_numpy(plan.deleted_rows())]
        if removed.numel() == 0:  # pure insertions: a placeholder keeps the EditedContext an edit (d >= 1)
            removed = ids[e0 : e0 + 1]
        original_ids = torch.cat((ids[:e0], removed, ids[e0:t]))
        edit = self._edited_context(original_ids, e0, int(removed.numel()), shifted)
        live, result, rows = live.repaired(self.lm, edit, policy.method, policy.budget_pct, executor=policy.executor,
                                           seed=policy.seed, options=policy.options, forced=forced)
        timings["select"] = result.timings_ms["select"]
        timings["refresh"] = result.timings_ms["refresh"]
        state = dataclasses.replace(shifted, live=live)
        refreshed = np.setdiff1d(rows, e0 + forced).astype(np.int64)

        # 4. The append at the end, after the repair (it reads the repaired rows).
        if t < m:
            state, ms = self._extended(state, ids[t:], pieces[t:] if pieces else (), labels[t:])
            timings["prefill"] += ms
        return state, result.selection, result.allowance, refreshed, rerotated

    # ------------------------------------------------------------------------------------------------------------
    # The edit itself

    def _edit(self, a: int, b: int, ins: torch.Tensor | None, ins_pieces, policy: _Policy) -> EditRecord:
        if policy.method == "Erratum":
            return self._erratum(a, b, ins, ins_pieces, policy)
        lm, old = self.lm, self._state
        n, d = old.n, b - a
        m = 0 if ins is None else int(ins.numel())
        p = a + m  # the repair's prefix: kept rows before the span plus the inserted rows
        S = n - b
        timings = {"prefill": 0.0, "shift": 0.0, "select": 0.0, "refresh": 0.0, "debt": 0.0}

        # 1-2. The live cache's Shift: the inserted rows prefilled against the unchanged prefix rows [0, a) at
        # positions a .. a + m - 1 (as a replacement's Shift in a sweep, sur_lab.executors.shift), rows [a, b)
        # dropped, each suffix row re-rotated once from its anchor to its new position p + j.
        live, moved, _ = old.live.shifted(lm, a, ins, np.arange(b, n, dtype=np.int64))
        timings.update(moved)
        new_ids = torch.cat([old.ids[:a]] + ([ins] if m else []) + [old.ids[b:]])
        seg_ins = old.segment[a] if a < n else self._next_segment
        pieces = None
        if old.pieces is not None:
            pieces = old.pieces[:a] + (tuple(ins_pieces) if m else ()) + old.pieces[b:]
        shifted = _State(
            ids=new_ids, live=live,
            segment=np.concatenate((old.segment[:a], np.full(m, seg_ins, dtype=np.int64), old.segment[b:])),
            pieces=pieces,
        )
        debt_before = live.debt

        # 3. Repair through the one Algorithm 1 dispatcher, on the EditedContext of this edit.
        if shifted.n == 0:
            # The whole context was deleted: nothing is left to repair (an EditedContext must keep one token).
            state, selection, B, refreshed = shifted, None, 0, np.zeros(0, dtype=np.int64)
        else:
            original_ids = splice_replacement(old.ids, a, b, ins if m else old.ids[:0])[0]
            edit = self._edited_context(original_ids, p, d, shifted, m)
            live, result, refreshed = live.repaired(lm, edit, policy.method, policy.budget_pct,
                                                    executor=policy.executor, seed=policy.seed,
                                                    options=policy.options)
            timings["select"] = result.timings_ms["select"]
            timings["refresh"] = result.timings_ms["refresh"]
            state, selection, B = dataclasses.replace(shifted, live=live), result.selection, result.allowance

        # 4. Staleness debt: refresh the stalest remaining stale rows with the same executor.
        state, debt_rows = self._pay_debt(state, policy, timings)
        rows = np.union1d(refreshed, debt_rows).astype(np.int64)
        nan = float("nan")
        record = EditRecord(
            "delete" if ins is None else "replace", a, b, m, policy.method,
            nan if policy.method in SESSION_REFERENCE_METHODS else policy.budget_pct, S, B, selection, rows,
            m + len(rows) if policy.method != "Re-prefill" else state.n + len(debt_rows), timings,
            debt_before, state.live.debt, len(debt_rows), state.n,
        )
        self._commit(state, record)
        return record

    def _erratum(self, a: int, b: int, ins: torch.Tensor | None, ins_pieces, policy: _Policy) -> EditRecord:
        """The Erratum policy (issue 26): no row is dropped, moved or recomputed; a correction note is prefilled after
        the context through the one dispatcher (:func:`sur_lab.repair.repair`, ``"Erratum"``). The session then holds
        the context before the edit followed by the note (its tokens are *not* the edited tokens)."""
        old = self._state
        n, d = old.n, b - a
        m = 0 if ins is None else int(ins.numel())
        original_ids, p, _ = splice_replacement(old.ids, a, b, ins if m else old.ids[:0])
        text: dict = {}
        if old.pieces is not None:
            pieces = old.pieces[:a] + (tuple(ins_pieces) if m else ()) + old.pieces[a:]
            ends = np.cumsum([len(x) for x in pieces])
            offsets = tuple(zip((ends - [len(x) for x in pieces]).tolist(), ends.tolist()))
            kept = pieces[:p] + pieces[p + d:]
            kept_ends = np.cumsum([len(x) for x in kept]) if kept else np.zeros(0, dtype=np.int64)
            text = {"original_text": "".join(pieces), "original_offsets": offsets,
                    "deleted_char_span": (offsets[p][0], offsets[p + d - 1][1]), "edited_text": "".join(kept),
                    "edited_offsets": tuple(zip((kept_ends - [len(x) for x in kept]).tolist(), kept_ends.tolist()))}
        elif policy.options.get("erratum_note_ids") is None:
            raise ValueError("method='Erratum' needs a session with text (its note quotes the edit) or "
                             "options={'erratum_note_ids': [...]}")
        edit = EditedContext(original_ids=original_ids, prefix_len=p, deleted_len=d, inserted_len=m,
                             **self._query_fields(old.ids, original_ids), **text)
        _, note_ids = erratum_note_for(self.lm, edit, dict(policy.options))
        live, result = old.live.noted(self.lm, edit, executor=policy.executor, options=policy.options)
        note_pieces = self._decode_pieces(note_ids) or ()
        state = self._joined(old, note_ids, live, note_pieces,
                             np.full(int(note_ids.numel()), self._next_segment, dtype=np.int64))
        self._next_segment += 1
        timings = {"prefill": result.timings_ms["refresh"], "shift": 0.0, "select": 0.0, "refresh": 0.0, "debt": 0.0}
        record = EditRecord("delete" if ins is None else "replace", a, b, m, "Erratum", float("nan"), n - b, 0, None,
                            np.zeros(0, dtype=np.int64), int(note_ids.numel()), timings, self.debt,
                            state.live.debt, 0, state.n)
        self._commit(state, record)
        return record

    def _query_fields(self, edited_ids: torch.Tensor, fallback: torch.Tensor) -> dict:
        if self._query is not None:
            q = self._query
            return {"query_ids": q.ids, "question": q.question, "question_ids": q.question_ids}
        tail = edited_ids[-FALLBACK_QUERY_TOKENS:] if edited_ids.numel() else fallback[-1:]
        return {"query_ids": tail, "question": None, "question_ids": None}

    def _edited_context(self, original_ids: torch.Tensor, p: int, d: int, shifted: _State, m: int = 0
                        ) -> EditedContext:
        """The edit as an EditedContext: original ``p ⊕ e ⊕ s`` (p includes the m inserted tokens,
        ``inserted_len``), edited ``p ⊕ s``."""
        text = {}
        if shifted.pieces is not None:
            lengths = np.fromiter((len(x) for x in shifted.pieces), dtype=np.int64, count=shifted.n)
            ends = np.cumsum(lengths)
            starts = ends - lengths
            containers = []
            seg = shifted.segment
            breaks = np.flatnonzero(np.diff(seg)) + 1 if shifted.n else np.zeros(0, dtype=np.int64)
            for r0, r1 in zip(np.concatenate(([0], breaks)), np.concatenate((breaks, [shifted.n]))):
                if r1 > r0 and ends[r1 - 1] > starts[r0]:
                    containers.append((int(starts[r0]), int(ends[r1 - 1]), "message"))
            text = {
                "edited_text": "".join(shifted.pieces),
                "edited_offsets": tuple(zip(starts.tolist(), ends.tolist())),
                "containers": tuple(containers),
            }
        return EditedContext(
            original_ids=original_ids, prefix_len=p, deleted_len=d, inserted_len=m,
            **self._query_fields(shifted.ids, original_ids), **text,
        )

    def _pay_debt(self, state: _State, policy: _Policy, timings: dict) -> tuple[_State, np.ndarray]:
        """The debt pass of ``policy.debt_pct`` (:meth:`LiveCache.paid`): ``(state, rows refreshed)``."""
        live, rows, ms = state.live.paid(self.lm, state.ids, self._query_fields(state.ids, state.ids),
                                         policy.executor, policy.debt_pct)
        if len(rows):
            timings["debt"] = ms
        return dataclasses.replace(state, live=live), rows

    def _commit(self, state: _State, record: EditRecord) -> None:
        self._state = state
        self.history.append(record)


@one_context_warning
def repair_cache(
    model: torch.nn.Module | LoadedModel,
    cache: DynamicCache,
    input_ids,
    span: tuple[int, int],
    *,
    budget_pct: float = 5.0,
    method: str = "SUR",
    executor: str = "sequential",
    query_ids=None,
    tokenizer: Any = None,
    seed: int = 0,
) -> DynamicCache:
    """Repair a user's own ``DynamicCache`` after deleting ``input_ids[span[0]:span[1]]`` (Algorithm 1, one edit).

    For a cache built by an ordinary prefill (``model(input_ids, cache=...)``, keys rotated for positions
    ``0 .. n-1``): the span's rows are dropped, the suffix is Shifted (Eq. 2) and a support of
    ``B = ⌈S · budget_pct / 100⌉`` suffix positions (Eq. 3) is recomputed.

    Args:
        model: a transformers causal LM of a supported family (``sur_lab.models.check_supported``), in eval mode, or
            the :class:`~sur_lab.models.LoadedModel` wrapping one; not modified.
        cache: ``DynamicCache`` of ``n`` rows, ``[1, H_kv, n, d_h]`` per layer, in the model's dtype and on its
            device; a ``StaticCache`` gives its filled rows (never its padding); not modified.
        input_ids: ``[n]`` or ``[1, n]`` int64 ids the cache was built from.
        span: ``(start, end)`` rows to delete, ``0 <= start < end <= n``.
        budget_pct: b in [0, 100], percent of the suffix.
        method: an allocator name (``"SUR"``) or ``"Shift"``, ``"Replay"``, ``"Re-prefill"``.
        executor: executor name (``"sequential"``, packed backends).
        query_ids: the next query's ids (SUR's relevance query, Eq. 7); ``None`` scores relevance against the last
            :data:`FALLBACK_QUERY_TOKENS` tokens of the edited context.
        tokenizer: optional; lets SUR build semantic units from text (otherwise fixed-size chunks). Defaults to the
            LoadedModel's tokenizer when ``model`` is one.
        seed: seed for randomized allocators.

    Returns:
        A new ``DynamicCache`` of ``n - (end - start)`` rows for ``input_ids`` without the span; pass it to
        ``model.generate(input_ids=edited_ids ⊕ query, cache=...)``.

    Raises:
        TypeError: naming ``model`` (neither a module nor a LoadedModel) or ``cache`` (``None``, a legacy tuple
            cache, another cache type), before any model call.
        ValueError: naming ``model`` (training mode), ``input_ids``, ``cache`` (layer count, row counts, batch size,
            KV heads, head dim, dtype or device unlike the model's), ``span``, ``budget_pct``, ``method``,
            ``executor`` or ``query_ids`` — before any model call.
        UnsupportedModelError: for a model family or configuration repair does not cover.
    """
    lm = as_loaded_model(model, tokenizer, name="model")
    session = EditSession.from_cache(
        lm, cache, input_ids, method=method, budget_pct=budget_pct, executor=executor, seed=seed
    )
    if query_ids is not None:
        session.set_query(query_ids if isinstance(query_ids, str) else torch.as_tensor(query_ids))
    try:
        start, end = span
    except (TypeError, ValueError):
        raise ValueError(f"span must be a (start, end) pair; got {span!r}") from None
    session.delete(start, end)
    return session.cache
