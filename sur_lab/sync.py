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

Text is compared as text first (:func:`align_text`): agent runtimes resend the whole prompt as a string, and
tokenizing that string whole gives other ids than the cached ones wherever earlier appends met (a BPE merge across the
seam), so a token diff alone would see edits in unchanged text. The unchanged text before the first changed character
and after the last one keeps its cached rows; only the text between the last stable boundary before the change and
the first one after it is tokenized again. A stable boundary is a message boundary (where an appended segment
starts), a special token, or a whitespace boundary where tokenizing across it gives the same ids as tokenizing each
side (a round trip; the end of the cached text is checked so too). An unchanged text is then the cached ids, and the
cached text plus a suffix that starts at a stable boundary is the cached ids plus the suffix's own, as
:meth:`~sur_lab.session.EditSession.append` would give. Whatever still differs from the cached ids is an edit of the
token diff, repaired and counted in the debt.

Source: section 3 (evolving contexts), Algorithm 1 (one repair over the union of the stale suffix), Eq. 2 (Shift),
Eq. 3 (allowance), appendix 14 (stale causal predecessors).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import numpy as np
import torch

from sur_lab.budget import Selection, Support
from sur_lab.edits import common_prefix_len, offset_pieces

#: Paths :meth:`EditSession.sync` can take.
SYNC_PATHS = ("unchanged", "tail", "repair", "prefix-reuse", "re-prefill")
#: Characters each side of a whitespace boundary that :func:`align_text` tokenizes to check it by round trip.
ROUND_TRIP_CHARS = 64
#: Whitespace boundaries :func:`align_text` tries on each side of a change before it settles for a structural one.
ROUND_TRIP_TRIES = 32


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


def special_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special tokens (``all_special_ids`` and added tokens marked special): tokenization
    always splits around them."""
    out = set(getattr(tokenizer, "all_special_ids", ()) or ())
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            out.add(int(i))
    return frozenset(out)


def splits_at(tokenizer, text: str, c: int, window: int = ROUND_TRIP_CHARS) -> bool:
    """Whether tokenizing across character ``c`` of ``text`` gives the ids of tokenizing each side on its own (a
    round trip over ``window`` characters each side): a boundary where re-tokenizing from ``c`` changes nothing."""
    if c <= 0 or c >= len(text):
        return True
    lo, hi = max(0, c - window), min(len(text), c + window)

    def enc(x: str) -> list[int]:
        return list(tokenizer(x, add_special_tokens=False)["input_ids"])

    return enc(text[lo:hi]) == enc(text[lo:c]) + enc(text[c:hi])


def align_text(tokenizer, old_ids, old_pieces, old_segment, new_text: str) -> tuple[torch.Tensor, tuple[str, ...]] | None:
    """Token ids of ``new_text`` that keep the cached rows of its unchanged text (module docstring).

    The longest common prefix and suffix of the cached text and ``new_text`` are found as text. The rows before the
    last stable boundary at or before the first changed character, and from the first stable boundary at or after the
    last one, keep their cached ids; the text between is tokenized on its own (without special tokens added). Stable
    boundaries: where a segment (an append, a message) starts, either side of a special token, or a whitespace
    boundary that :func:`splits_at` accepts (at most :data:`ROUND_TRIP_TRIES` tried per side); the end of the cached
    text is one after a special token or where :func:`splits_at` accepts it (``"...\\n"`` followed by ``"\\n..."``
    merges into one token: the last row is tokenized again with the suffix).

    Args:
        tokenizer: a fast tokenizer (offsets).
        old_ids: ``[n]`` int64 cached ids.
        old_pieces: ``n`` strings, each row's share of the cached text.
        old_segment: int64 ``[n]`` container label of each row (a change of label is a message boundary).
        new_text: the whole new prompt.

    Returns:
        ``(ids [m] int64, pieces)``: the cached ids for ``new_text == "".join(old_pieces)``, the cached ids plus the
        suffix's own for an appended suffix that starts at a stable boundary; ``None`` when the result would not decode to ``new_text`` (a tokenizer
        that adds a prefix space to a piece, or cached pieces that are not the text of their ids): tokenize
        ``new_text`` whole then.
    """
    old_ids = torch.as_tensor(old_ids, dtype=torch.long).reshape(-1).cpu()
    old_text = "".join(old_pieces)
    n = len(old_pieces)
    if new_text == old_text:
        return old_ids.clone(), tuple(old_pieces)
    lengths = np.fromiter((len(x) for x in old_pieces), dtype=np.int64, count=n)
    starts = np.concatenate(([0], np.cumsum(lengths)))  # starts[r]: character where row r starts; starts[n] = len
    ids = old_ids.tolist()
    segment = np.asarray(old_segment, dtype=np.int64)
    special = special_ids(tokenizer)
    grow = len(new_text) - len(old_text)
    cp = common_prefix_len(old_text, new_text)
    cs = min(common_prefix_len(old_text[::-1], new_text[::-1]), min(len(old_text), len(new_text)) - cp)

    def structural(r: int, keep_after: bool) -> bool:
        if r == 0 or r == n and not keep_after:
            return True
        if r == n:  # the end of the cached text: stable after a special token, or where the round trip says so
            return ids[r - 1] in special or splits_at(tokenizer, new_text, len(old_text))
        if segment[r] != segment[r - 1]:  # where an append started: its seam is in the cache already
            return True
        if keep_after:  # rows before r are kept: a special token before r, or one at r wholly in the common prefix
            return ids[r - 1] in special or (ids[r] in special and starts[r + 1] <= cp)
        return ids[r] in special or (ids[r - 1] in special and starts[r - 1] >= len(old_text) - cs)

    def whitespace(c: int) -> bool:
        return (c > 0 and new_text[c - 1].isspace()) or (c < len(new_text) and new_text[c].isspace())

    # r0: the last stable boundary at or before the first change (rows [0, r0) kept).
    r0, tries = int(np.searchsorted(starts, cp, side="right")) - 1, 0
    while not structural(r0, True):
        c = int(starts[r0])
        if tries < ROUND_TRIP_TRIES and whitespace(c):
            tries += 1
            if splits_at(tokenizer, new_text, c):
                break
        r0 -= 1
    # r1: the first stable boundary at or after the last change (rows [r1, n) kept).
    r1, tries = max(r0, int(np.searchsorted(starts, len(old_text) - cs, side="left"))), 0
    while not structural(r1, False):
        c = int(starts[r1]) + grow
        if tries < ROUND_TRIP_TRIES and whitespace(c):
            tries += 1
            if splits_at(tokenizer, new_text, c):
                break
        r1 += 1
    c0, c1 = int(starts[r0]), int(starts[r1]) + grow
    middle = new_text[c0:c1]
    mid_ids: list[int] = []
    mid_pieces: tuple[str, ...] = ()
    if middle:
        enc = tokenizer(middle, add_special_tokens=False, return_offsets_mapping=True)
        mid_ids = list(enc["input_ids"])
        mid_pieces = offset_pieces(middle, enc["offset_mapping"])
    new_ids = torch.tensor(ids[:r0] + mid_ids + ids[r1:], dtype=torch.long)
    back = tokenizer.decode(new_ids.tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if back != new_text:
        return None
    return new_ids, tuple(old_pieces[:r0]) + mid_pieces + tuple(old_pieces[r1:])


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
        allowance: B of them refreshed by the allocation: the allocator's allowance over the S kept rows
            (:func:`~sur_lab.allocators.allowance_for`: Eq. 3's ⌈S · b / 100⌉, or the whole-prompt base a variant
            binds); S for Replay, 0 for Shift and the paths without a repair.
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
