"""The live KV cache of an edit session: its rows, their anchors, recorded angles and staleness, and every change to
them (append, the one Shift, the repair through the one Algorithm 1 dispatcher, the debt pass).

A :class:`LiveCache` is an immutable snapshot: every operation returns a new one and never writes into a tensor it
holds, so a caller commits the result only when the whole edit succeeded (:class:`~sur_lab.session.EditSession` keeps
the conversation, its tokens, text and history, and one ``LiveCache``). Rows are in context order with positions
``0 .. n-1``; per layer, ``keys`` / ``values`` / ``anchors`` are ``[1, H_kv, n, d_h]``.

- **Anchors and one rotation.** A row's *anchor* is its key as the model computed it at its *recorded angle*
  (``angle_pos``). Moving rows (:meth:`LiveCache.shifted`) re-rotates each moved row once, from its anchor straight to
  its new position (:func:`sur_lab.cache_ops.rerotate_rows`, Eq. 2), so a row moved by forty edits carries one
  rotation's rounding, not forty (``scripts/session_drift.py``).
- **One dispatcher.** :meth:`LiveCache.repaired` hands the Shifted rows to :func:`sur_lab.repair.repair` (reference
  operators, or B from :func:`sur_lab.allocators.allowance_for`: B = S Replay, B = 0 Shift, else allocate + execute),
  with rows the Shift holds no state for as its ``forced`` rows.
- **Staleness debt** (appendix 14, stale causal predecessors). ``stale[j]`` counts the tokens deleted or inserted
  before row j since its state was computed, directly or through the stale rows it read; a recomputed row inherits the
  largest staleness among the rows before it (:func:`recomputed_staleness`). The stale rows are always a suffix of the
  context; :meth:`LiveCache.paid` refreshes the earliest of them, the only ones whose refresh makes them fresh.

Source: section 3 (evolving contexts, Eq. 2, Eq. 3), Algorithm 1, appendix 7.1 (Shift), appendix 14.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

from sur_lab.budget import Support, allowance, fractions_expected
from sur_lab.cache_ops import KV, from_tensors, rerotate_rows, to_tensors
from sur_lab.edits import EditedContext
from sur_lab.executors import get_executor, insert_rows
from sur_lab.forward import check_context_length, forward_tokens, prefill
from sur_lab.models import LoadedModel
from sur_lab.repair import REFERENCE_OPERATORS, PreparedEdit, RepairResult, repair


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def _before_max(stale: np.ndarray, upto: int) -> int:
    """Staleness a row computed at position ``upto`` inherits: the largest of the rows before it (0 when fresh)."""
    return int(stale[:upto].max()) if upto > 0 else 0


def recomputed_staleness(stale: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Staleness after recomputing ``rows`` in causal order (any executor: all compute the sequential recurrence).

    A recomputed row reads every row before it, so it inherits the largest staleness among them, where the rows
    recomputed before it already carry their new value; by induction that is the largest staleness among the earlier
    rows that were *not* recomputed. Rows not in ``rows`` keep theirs. Appendix 14 (stale causal predecessors).

    Args:
        stale: int64 ``[n]`` staleness before the refresh (tokens).
        rows: int64 absolute rows recomputed (any order; duplicates allowed).

    Returns:
        int64 ``[n]``, a new array.
    """
    stale = np.asarray(stale, dtype=np.int64)
    out = stale.copy()
    if len(rows) == 0 or len(stale) == 0:
        return out
    recomputed = np.zeros(len(stale), dtype=bool)
    recomputed[np.asarray(rows, dtype=np.int64)] = True
    kept = np.where(recomputed, 0, stale)
    before = np.concatenate(([0], np.maximum.accumulate(kept)[:-1]))  # max over kept rows strictly before j
    out[recomputed] = before[recomputed]
    return out


@dataclass(frozen=True)
class LiveCache:
    """The live cache's state, immutable (module docstring).

    Attributes:
        keys / values: per layer ``[1, H_kv, n, d_h]``, keys rotated for their current positions ``0 .. n-1``;
            ``None`` before the first rows.
        anchors: per layer ``[1, H_kv, n, d_h]``, each row's key at its recorded angle (``None`` with ``keys``).
        angle_pos: int64 ``[n]``, the position each anchor was computed at (tokens).
        stale: int64 ``[n]``, tokens deleted or inserted before each row since its state was computed (0: fresh).
    """

    keys: tuple[torch.Tensor, ...] | None
    values: tuple[torch.Tensor, ...] | None
    anchors: tuple[torch.Tensor, ...] | None
    angle_pos: np.ndarray
    stale: np.ndarray

    @classmethod
    def empty(cls) -> LiveCache:
        """No rows."""
        zeros = np.zeros(0, dtype=np.int64)
        return cls(None, None, None, zeros, zeros)

    @classmethod
    def clean(cls, kv: list[KV]) -> LiveCache:
        """Rows a prefill computed at positions ``0 .. n-1`` (fresh: anchors are the keys, staleness 0); ``kv`` per
        layer ``(K, V)`` ``[1, H_kv, n, d_h]``, shared, never written."""
        keys = tuple(k for k, _ in kv)
        n = int(keys[0].shape[2]) if keys else 0
        return cls(keys, tuple(v for _, v in kv), keys, np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64))

    @classmethod
    def prefilled(cls, lm: LoadedModel, ids: torch.Tensor) -> LiveCache:
        """A clean prefill of ``ids`` (``[n]`` int64, n >= 1)."""
        return cls.clean(to_tensors(prefill(lm, ids)[0]))

    @property
    def n(self) -> int:
        """Rows (tokens)."""
        return int(len(self.angle_pos))

    @property
    def debt(self) -> int:
        """Stale rows (appendix 14): always the last ``debt`` rows."""
        return int((self.stale > 0).sum())

    def cache(self) -> DynamicCache:
        """A new ``DynamicCache`` object over the live tensors (no copy; empty before the first rows)."""
        return from_tensors(list(zip(self.keys, self.values))) if self.keys is not None else DynamicCache()

    def prefix(self, rows: int) -> LiveCache:
        """Rows ``[0, rows)`` (views)."""
        if self.keys is None:
            return self
        cut = lambda ts: tuple(t[:, :, :rows] for t in ts)  # noqa: E731
        return LiveCache(cut(self.keys), cut(self.values), cut(self.anchors), self.angle_pos[:rows],
                         self.stale[:rows])

    def extended(self, lm: LoadedModel, ids: torch.Tensor) -> tuple[LiveCache, float]:
        """``ids`` (``[m]`` int64) prefilled after the rows at positions ``n .. n + m - 1``: ``(new state, ms)``."""
        t0 = time.perf_counter()
        work = self.cache()
        forward_tokens(lm, ids, work, logits="none")
        return self.appended(work, int(ids.numel())), _ms(t0)

    def appended(self, cache: DynamicCache, m: int) -> LiveCache:
        """This state followed by ``m`` rows that ``cache`` holds after its own ``n`` rows (computed at positions
        ``n .. n + m - 1`` over these rows: stale predecessors make them stale too, appendix 14)."""
        n = self.n
        kv = to_tensors(cache)
        keys = tuple(k for k, _ in kv)
        anchors = keys if self.anchors is None else tuple(
            torch.cat((a, k[:, :, n:]), dim=2) for a, k in zip(self.anchors, keys))
        return LiveCache(keys, tuple(v for _, v in kv), anchors,
                         np.concatenate((self.angle_pos, np.arange(n, n + m, dtype=np.int64))),
                         np.concatenate((self.stale, np.full(m, _before_max(self.stale, n), dtype=np.int64))))

    def shifted(self, lm: LoadedModel, keep: int, inserted: torch.Tensor | None, source: np.ndarray
                ) -> tuple[LiveCache, dict[str, float], int]:
        """The Shift of a live cache (Eq. 2, appendix 7.1), for one edit or a whole sync: rows ``[0, keep)`` stay;
        ``inserted`` is prefilled after them at positions ``keep .. keep + m - 1`` (against rows ``[0, keep)`` only,
        :func:`sur_lab.executors.insert_rows`); then one row per entry of ``source``: old row ``source[j]`` moved to
        position ``keep + m + j`` with its key re-rotated once from its anchor (:func:`sur_lab.cache_ops.rerotate_rows`;
        an unmoved row is kept bitwise), or, for ``-1``, a hole of zeros that a refresh must compute (a forced row of
        :meth:`repaired`). Old rows neither before ``keep`` nor in ``source`` are dropped; nothing is recomputed.

        Staleness: a moved row adds the old rows dropped before it and the new rows inserted before it; inserted rows
        take the largest staleness before them; holes 1 (their refresh sets theirs).

        Args:
            lm: the model (RoPE inverse frequencies, the prefill of ``inserted``).
            keep: rows kept in place, ``0 <= keep <= n``.
            inserted: ``[m]`` int64 ids, or ``None``.
            source: int64 ``[L]``, old rows after ``keep`` in their new order (each at most once) or -1.

        Returns:
            ``(state of keep + m + L rows, {"prefill": ms, "shift": ms}, rows whose keys moved)``.

        Warns:
            UserWarning: when the new length exceeds the model's context
                (:func:`sur_lab.forward.check_context_length`).
        """
        m = 0 if inserted is None else int(inserted.numel())
        source = np.asarray(source, dtype=np.int64)
        L = len(source)
        start = keep + m
        check_context_length(lm, start + L)  # the moved rows are re-rotated up to position start + L - 1
        timings = {"prefill": 0.0, "shift": 0.0}
        lead: list = []
        if m:
            t0 = time.perf_counter()
            lead = insert_rows(lm, list(zip(self.keys, self.values)), keep, inserted)
            timings["prefill"] = _ms(t0)
        t0 = time.perf_counter()
        moved = source >= 0
        gather = np.where(moved, source, 0)
        index = torch.from_numpy(gather).to(self.keys[0].device)
        new_pos = np.arange(start, start + L, dtype=np.int64)
        deltas = np.where(moved, new_pos - self.angle_pos[gather], 0)
        hole = torch.from_numpy(~moved).to(index.device)[None, None, :, None]
        deltas_t = torch.from_numpy(np.ascontiguousarray(deltas))
        keys, values, anchors = [], [], []
        for layer, (k, v, anc) in enumerate(zip(self.keys, self.values, self.anchors)):
            a_src = anc.index_select(2, index).masked_fill(hole, 0)
            lead_k, lead_v = lead[layer] if m else (k[:, :, :0], v[:, :, :0])
            keys.append(torch.cat((k[:, :, :keep], lead_k, rerotate_rows(a_src, deltas_t, lm.inv_freq)), dim=2))
            values.append(torch.cat((v[:, :, :keep], lead_v, v.index_select(2, index).masked_fill(hole, 0)), dim=2))
            anchors.append(torch.cat((anc[:, :, :keep], lead_k, a_src), dim=2))
        timings["shift"] = _ms(t0)
        old_kept = np.zeros(self.n, dtype=bool)
        old_kept[:keep] = True
        old_kept[source[moved]] = True
        deleted_before = np.concatenate(([0], np.cumsum(~old_kept)))[gather]
        inserted_before = m + np.concatenate(([0], np.cumsum(~moved)))[:L]
        state = LiveCache(
            tuple(keys), tuple(values), tuple(anchors),
            np.concatenate((self.angle_pos[:keep], np.arange(keep, start, dtype=np.int64),
                            np.where(moved, self.angle_pos[gather], new_pos))),
            np.concatenate((self.stale[:keep], np.full(m, _before_max(self.stale, keep), dtype=np.int64),
                            np.where(moved, self.stale[gather] + deleted_before + inserted_before, 1))),
        )
        return state, timings, int((deltas[moved] != 0).sum())

    def with_rows(self, cache: DynamicCache, rows: np.ndarray) -> LiveCache:
        """``cache`` (``n`` rows) as the live tensors, where ``rows`` (int64 absolute) were recomputed at their
        current positions (their anchors and angles follow; :func:`recomputed_staleness`)."""
        kv = to_tensors(cache)
        keys = tuple(k for k, _ in kv)
        if len(rows) == self.n:
            anchors = keys
        else:
            mask = torch.zeros(self.n, dtype=torch.bool)
            mask[torch.from_numpy(np.asarray(rows, dtype=np.int64))] = True
            mask = mask.to(keys[0].device)[None, None, :, None]
            anchors = tuple(torch.where(mask, k, a) for k, a in zip(keys, self.anchors))
        angle_pos = self.angle_pos.copy()
        angle_pos[rows] = rows
        return LiveCache(keys, tuple(v for _, v in kv), anchors, angle_pos, recomputed_staleness(self.stale, rows))

    def repaired(self, lm: LoadedModel, edit: EditedContext, method: str, budget_pct: float, *, executor: str,
                 seed: int, options: dict, forced: np.ndarray | None = None
                 ) -> tuple[LiveCache, RepairResult, np.ndarray]:
        """Repair these Shifted rows (``edit``'s edited context: prefix ``p``, suffix ``S``) through the one Algorithm 1
        dispatcher, :func:`sur_lab.repair.repair`: a reference operator, or B from
        :func:`sur_lab.allocators.allowance_for` (B = S Replay, B = 0 Shift, else allocate + execute).

        The Shift cache handed over is this state's own (no Dirty cache: Replay reads the valid prefix from it); a
        reference operator may take it without a clone, it writes into no tensor.

        Args:
            lm: the model.
            edit: the edit; its edited ids are these rows' tokens.
            method, budget_pct, executor, seed, options: as :func:`sur_lab.repair.repair` (budget in percent).
            forced: suffix-local rows recomputed whatever the method chooses (holes of :meth:`shifted`).

        Returns:
            ``(state, result, rows)``: ``rows`` int64 absolute rows recomputed (Re-prefill: all ``n``; forced rows
            included); ``result.allowance`` is B, ``result.selection`` the allocator's (``None`` for reference ones).
        """
        forced = np.zeros(0, dtype=np.int64) if forced is None else np.asarray(forced, dtype=np.int64)
        prepared = PreparedEdit(edit, None, self.cache(), 0.0, 0.0)
        with fractions_expected():  # the caller warned when the budget was given
            result = repair(lm, prepared, method, budget_pct, executor=executor, seed=seed, options=dict(options),
                            inplace=method in REFERENCE_OPERATORS, forced=forced)
        rows = result.refreshed  # Re-prefill: every row, stale rows before the edit included
        if not len(rows):  # Shift, or B = 0 with nothing forced: the Shifted rows are the result
            return self, result, rows
        return self.with_rows(result.cache, rows), result, rows

    def noted(self, lm: LoadedModel, edit: EditedContext, *, executor: str, options: dict
              ) -> tuple[LiveCache, RepairResult]:
        """The Erratum reference operator through the one dispatcher (:func:`sur_lab.repair.repair`, issue 26): these
        rows are ``edit``'s context before the edit (its Dirty cache, none dropped, moved or recomputed), followed by
        the correction note's rows, prefilled. Returns ``(state of n + L rows, result)``; ``result.note_tokens`` is L.
        """
        result = repair(lm, PreparedEdit(edit, self.cache(), None, 0.0, 0.0), "Erratum", executor=executor,
                        options=dict(options))
        return self.appended(result.cache, result.note_tokens), result

    def paid(self, lm: LoadedModel, ids: torch.Tensor, query: dict, executor: str, debt_pct: float
             ) -> tuple[LiveCache, np.ndarray, float]:
        """Refresh ``⌈D · debt_pct / 100⌉`` of the D stale rows, earliest first (the staleness debt pass).

        The stale rows are the suffix ``[n - D, n)``; a row refreshed after a stale row it reads stays stale
        (appendix 14), so the earliest stale rows are the ones whose refresh pays the debt: D falls by exactly the
        rows refreshed.

        Args:
            lm: the model.
            ids: ``[n]`` int64, these rows' tokens.
            query: the ``query_ids`` / ``question`` / ``question_ids`` fields of an :class:`EditedContext`.
            executor: a registered executor name.
            debt_pct: percent of the stale rows, in [0, 100].

        Returns:
            ``(state, int64 rows refreshed, ms)``.
        """
        stale_rows = np.flatnonzero(self.stale > 0)
        k = allowance(len(stale_rows), debt_pct)
        if k == 0:
            return self, np.zeros(0, dtype=np.int64), 0.0
        chosen = stale_rows[:k].astype(np.int64)
        j0 = int(chosen[0])
        # A refresh-only edit: executors read the edited ids, the prefix length and the suffix; the one "deleted"
        # placeholder token (a copy of row j0) only makes the context an EditedContext.
        edit = EditedContext(original_ids=torch.cat((ids[:j0], ids[j0 : j0 + 1], ids[j0:])), prefix_len=j0,
                             deleted_len=1, **query)
        t0 = time.perf_counter()
        cache = get_executor(executor)(lm, self.cache(), edit, Support(chosen - j0, self.n - j0))
        ms = _ms(t0)
        return self.with_rows(cache, chosen), chosen, ms
