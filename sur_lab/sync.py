"""Prompt sync: turn a whole new prompt into edits of the cached one, and decide how to repair them (issue 27).

Agent runtimes rebuild the whole prompt every turn (compacted tool outputs, trimmed observations, a rewritten plan, a
new turn) instead of naming rows to edit. :func:`diff_tokens` compares the cached token ids with the new ones: the
common prefix first (one vectorised comparison), then difflib's ``SequenceMatcher`` (``autojunk=False``, so frequent
tokens are matched like any other) on the rest, whose matching blocks are the rows kept. Every other old row is
deleted and every other new row is inserted. The result, a :class:`SyncPlan`, maps each row of the new prompt to the
old row it keeps (or to none), so the repair can drop, move (re-rotate once from the recorded angle) and insert rows
in one pass with every row index valid. :class:`SyncPolicy` says when a repair is not worth it and prefix reuse
(recompute everything from the first change, what serving engines do today) is taken instead.
:meth:`sur_lab.session.EditSession.sync` runs the plan and returns a :class:`SyncRecord`.

Source: section 3 (evolving contexts), Algorithm 1 (one repair over the union of the stale suffix), Eq. 2 (Shift),
Eq. 3 (allowance), appendix 14 (stale causal predecessors).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import numpy as np
import torch

from sur_lab.allocators import Selection
from sur_lab.budget import Support

#: Paths :meth:`EditSession.sync` can take.
SYNC_PATHS = ("unchanged", "tail", "repair", "prefix-reuse", "re-prefill")


@dataclass(frozen=True)
class SyncPolicy:
    """When :meth:`EditSession.sync` repairs and when it falls back to prefix reuse (recompute from the first change).

    A repair pays Shift, selection and a refresh of B of the S stale rows; prefix reuse recomputes the S stale rows
    plus the inserted ones, exactly. Prefix reuse is taken when either threshold says the repair saves little:

    Attributes:
        min_stale_rows: prefix reuse when fewer than this many kept rows follow the first change (S, tokens): the
            first change is near the end, so recomputing the rest costs little and is exact. >= 0; 0 never falls
            back on this ground.
        max_new_share: prefix reuse when more than this share of the rows after the first change is new text
            (inserted rows over inserted + kept rows, in [0, 1]; 1 never falls back on this ground): those rows are
            prefilled either way, and the few kept rows are cheap to recompute.

    The defaults come from ``scripts/bench_sync.py`` on the agent-trace study's default traces (issue 27; Qwen study
    model, sync at 5 %): its offline grid over both thresholds picks the fastest policy whose next-token agreement
    with re-prefill stays within 5 points of prefix reuse's. ``max_new_share`` decided it (turns whose rows after the
    first change were mostly new text lost agreement under repair); ``min_stale_rows`` made no difference from 0 to
    64 rows on those traces and keeps its earlier value. ``SyncPolicy(0, 1.0)`` always repairs.

    Raises:
        ValueError: naming the field when out of range (at construction).
    """

    min_stale_rows: int = 32
    max_new_share: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.min_stale_rows, bool) or not isinstance(self.min_stale_rows, (int, np.integer)) or (
            self.min_stale_rows < 0
        ):
            raise ValueError(f"min_stale_rows must be an integer >= 0 (tokens); got {self.min_stale_rows!r}")
        share = self.max_new_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= float(share) <= 1.0:
            raise ValueError(f"max_new_share must be a number in [0, 1]; got {share!r}")


@dataclass(frozen=True)
class SyncPlan:
    """The token diff of a sync: which old row each new row keeps.

    Attributes:
        old_len / new_len: rows before and after (tokens).
        source: int64 ``[new_len]``: the old row that new row j keeps, or -1 when j is inserted. Kept rows keep their
            order (``source`` increases over the kept rows).
        first_change: f, the length of the common prefix: rows ``[0, f)`` are unchanged (``min(old_len, new_len)``
            for a pure append or truncation, ``new_len`` for an unchanged prompt).
    """

    old_len: int
    new_len: int
    source: np.ndarray = field(repr=False)
    first_change: int

    @property
    def kept(self) -> np.ndarray:
        """bool ``[new_len]``: rows kept from the old prompt."""
        return self.source >= 0

    @property
    def unchanged(self) -> bool:
        return self.old_len == self.new_len and self.first_change == self.new_len

    @property
    def inserted(self) -> int:
        """New rows (tokens inserted)."""
        return int((self.source < 0).sum())

    @property
    def deleted(self) -> int:
        """Old rows dropped (tokens deleted)."""
        return self.old_len - int(self.kept.sum())

    @property
    def tail_start(self) -> int:
        """t: one past the last kept row; rows ``[t, new_len)`` are all inserted (an append at the end)."""
        kept = np.flatnonzero(self.kept)
        return int(kept[-1]) + 1 if len(kept) else 0

    @property
    def stale_rows(self) -> int:
        """S: kept rows at or after the first change, the rows a repair would carry over stale (tokens)."""
        return int(self.kept[self.first_change :].sum())

    @property
    def new_share(self) -> float:
        """Inserted rows among the rows after the first change (0 when nothing follows it)."""
        after = self.new_len - self.first_change
        return float((self.source[self.first_change :] < 0).sum()) / after if after else 0.0

    @property
    def moved(self) -> np.ndarray:
        """int64 new rows kept at another index than their old one (their keys need re-rotation)."""
        rows = np.flatnonzero(self.kept)
        return rows[self.source[rows] != rows].astype(np.int64)

    def deleted_rows(self) -> np.ndarray:
        """int64 old rows dropped, in order."""
        keep = np.zeros(self.old_len, dtype=bool)
        keep[self.source[self.kept]] = True
        return np.flatnonzero(~keep).astype(np.int64)


def diff_tokens(old_ids, new_ids) -> SyncPlan:
    """The token diff of ``old_ids`` against ``new_ids``: common prefix, then difflib's matching blocks.

    Args:
        old_ids: ``[n]`` int64 ids of the cached prompt (may be empty).
        new_ids: ``[m]`` int64 ids of the new prompt (may be empty).

    Returns:
        :class:`SyncPlan`. A pure append keeps every old row in place; an unchanged prompt keeps every row.

    Source: issue 27 (difflib ``SequenceMatcher`` on ids; ``autojunk=False`` so that no frequent token, such as a
    template marker, is excluded from matching).
    """
    old = np.asarray(torch.as_tensor(old_ids).reshape(-1).cpu(), dtype=np.int64)
    new = np.asarray(torch.as_tensor(new_ids).reshape(-1).cpu(), dtype=np.int64)
    n, m = len(old), len(new)
    common = min(n, m)
    neq = np.flatnonzero(old[:common] != new[:common])
    f = int(neq[0]) if len(neq) else common
    source = np.full(m, -1, dtype=np.int64)
    source[:f] = np.arange(f)
    if f < n and f < m:
        matcher = difflib.SequenceMatcher(None, old[f:].tolist(), new[f:].tolist(), autojunk=False)
        for i, j, size in matcher.get_matching_blocks():
            source[f + j : f + j + size] = np.arange(f + i, f + i + size)
    return SyncPlan(old_len=n, new_len=m, source=source, first_change=f)


def choose_path(plan: SyncPlan, policy: SyncPolicy, method: str) -> str:
    """The path :meth:`EditSession.sync` takes for ``plan`` (one of :data:`SYNC_PATHS`).

    ``"unchanged"`` when nothing changed; ``"re-prefill"`` for the Re-prefill method (the whole prompt, every
    time); ``"tail"`` when no kept row follows the first change (a pure append, a truncation, or a rewrite of the
    end: rows from the first change are dropped and only the new rows computed); ``"prefix-reuse"`` when
    :class:`SyncPolicy` says a repair saves little; ``"repair"`` otherwise.
    """
    if plan.unchanged:
        return "unchanged"
    if method == "Re-prefill":
        return "re-prefill"
    if plan.stale_rows == 0:
        return "tail"
    if plan.stale_rows < policy.min_stale_rows or plan.new_share > policy.max_new_share:
        return "prefix-reuse"
    return "repair"


@dataclass(frozen=True)
class SyncRecord:
    """What one :meth:`EditSession.sync` did.

    Attributes:
        path: one of :data:`SYNC_PATHS`.
        method: repair method (allocator name or reference method); budget_pct: b in percent (NaN for reference
            methods).
        previous_tokens / num_tokens: context length before and after (tokens).
        first_change: f, the first row that differs (tokens of common prefix).
        deleted: old tokens dropped; inserted: new tokens (the diff, whatever the path).
        reused: rows of the new cache carried over from the old one without being recomputed.
        rerotated: reused rows moved to another position, their keys re-rotated once from their recorded angle.
        recomputed: rows run through the model: inserted rows, refreshed rows and the debt pass (prefix reuse: every
            row from the first change; Re-prefill: every row).
        stale_rows: S, kept rows after the first change (stale before the repair).
        allowance: B = ⌈S · b / 100⌉ of them refreshed by the allocation (Eq. 3 over the union of the stale suffix;
            S for Replay, 0 for Shift and the paths without a repair).
        selection: the allocator's selection over the suffix from the first stale row (``None`` without one).
        refreshed_rows: int64 absolute rows of the new context recomputed by the repair and the debt pass (inserted
            rows excluded).
        debt_before / debt_after / debt_refreshed: stale rows after the plan is applied, after the sync, and
            refreshed by the debt pass (rows; see :attr:`EditSession.debt`).
        timings_ms: ``diff``, ``prefill`` (inserted rows), ``shift``, ``select``, ``refresh``, ``debt`` and ``total``
            (the whole call), ms.
    """

    path: str
    method: str
    budget_pct: float
    previous_tokens: int
    num_tokens: int
    first_change: int
    deleted: int
    inserted: int
    reused: int
    rerotated: int
    recomputed: int
    stale_rows: int
    allowance: int
    selection: Selection | None
    refreshed_rows: np.ndarray = field(repr=False)
    debt_before: int
    debt_after: int
    debt_refreshed: int
    timings_ms: dict[str, float]

    @property
    def kind(self) -> str:
        """``"sync"`` (history entries of an :class:`EditSession` tell edits and syncs apart by ``kind``)."""
        return "sync"

    @property
    def support(self) -> Support | None:
        """The suffix-local support of the repair (``None`` without an allocation)."""
        return self.selection.support if self.selection is not None else None

    @property
    def forwarded_tokens(self) -> int:
        """Tokens run through the model (the same as ``recomputed``; :class:`EditRecord`'s name)."""
        return self.recomputed
