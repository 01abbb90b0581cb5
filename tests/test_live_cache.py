"""The session's live cache (sur_lab.live_cache.LiveCache): one Shift, one dispatcher with forced rows, and B from the
allocator's own allowance (issue 39, item 5). Exact on float64 tiny models."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from conftest import make_tiny_model

from sur_lab import EditSession, SyncPolicy
from sur_lab.edits import token_edit
from sur_lab.allocators import AllocationRequest, allowance_for
from sur_lab.budget import Support, allowance, prompt_allowance
from sur_lab.cache_ops import caches_equal, max_abs_diff, to_tensors
from sur_lab.edits import EditedContext, splice_replacement
from sur_lab.executors import dirty, get_executor, shift
from sur_lab.live_cache import LiveCache
from sur_lab.repair import PreparedEdit, prepare, repair

#: A sync policy that always repairs (no prefix-reuse fallback), so that the repair path is what a test sees.
ALWAYS_REPAIR = SyncPolicy(min_stale_rows=0, max_new_share=1.0)


@functools.cache
def tiny():
    return make_tiny_model("llama")


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("a, b, m", [(6, 11, 0), (0, 4, 0), (12, 13, 3), (20, 26, 2), (5, 40, 0)])
def test_the_live_caches_shift_is_the_dispatchers_shift(a, b, m):
    """One Shift: on a clean prefill, the live cache's move (each row re-rotated once from its anchor) gives the cache
    :func:`sur_lab.executors.shift` gives the sweeps, for a deletion and for a replacement, within float64 rounding:
    both rotate through one helper, but their angle tensors differ in shape (``[L, R/2]`` against ``[R/2]``), and a
    vectorised cos/sin may round a tail element differently, so a few units of 2^-53 of the largest entry."""
    lm, ids = tiny(), _ids(40)
    query = _ids(4, 1)
    ins = _ids(m, 2) if m else None
    live, timings, moved = LiveCache.prefilled(lm, ids).shifted(lm, a, ins, np.arange(b, 40, dtype=np.int64))
    original, p, d = splice_replacement(ids, a, b, ins if m else ids[:0])
    edit = EditedContext(original_ids=original, prefix_len=p, deleted_len=d, inserted_len=m, query_ids=query)
    got, ref = live.cache(), shift(lm, dirty(lm, edit), edit)
    assert [k.shape for k, _ in to_tensors(got)] == [k.shape for k, _ in to_tensors(ref)]
    scale = max(t.abs().max().item() for kv in to_tensors(ref) for t in kv)
    dk, dv = max_abs_diff(got, ref)
    assert dk <= 8 * 2**-53 * scale and dv <= 8 * 2**-53 * scale
    assert moved == (40 - b if m != b - a else 0) and set(timings) == {"prefill", "shift"}
    assert live.angle_pos.tolist() == list(range(a + m)) + list(range(b, 40))
    assert live.stale.tolist() == [0] * (a + m) + [d + m] * (40 - b)
    # The anchors are the keys at their recorded angles: untouched rows keep theirs, moved rows keep their old key.
    old = LiveCache.prefilled(lm, ids)
    assert all(torch.equal(x[:, :, p:], y[:, :, b:]) for x, y in zip(live.anchors, old.keys))


@pytest.mark.parametrize("method", ["SUR", "SUR[allowance_base=prompt]"])
def test_a_session_honours_the_allocators_allowance(method):
    """B is the allocator's (allowance_for): a variant that binds the whole-prompt allowance base (appendix 9.3) gets
    its own B in a delete and in a sync, where B is a share of the kept rows after the first change and the inserted
    rows inside them are refreshed on top (forced rows)."""
    lm, b = tiny(), 10.0
    whole_prompt = "allowance_base=prompt" in method
    session = EditSession(lm, method=method, budget_pct=b, sync_policy=ALWAYS_REPAIR)
    session.append(_ids(60))
    record = session.delete(10, 15)  # p = 10, S = 45, N- = 55
    expected = prompt_allowance(45, 55, b) if whole_prompt else allowance(45, b)
    assert (record.allowance, record.support.size) == (expected, expected)
    assert prompt_allowance(45, 55, b) != allowance(45, b)  # the two bases differ here: the test can fail

    tokens = session.tokens.tolist()
    new = tokens[:4] + tokens[7:30] + [5, 6, 7] + tokens[30:]  # a deletion at 4, an insertion inside the suffix
    sync = session.sync(new)
    assert sync.path == "repair" and sync.stale_rows == len(tokens) - 7
    S_kept, prompt_len = sync.stale_rows, sync.num_tokens
    expected = prompt_allowance(S_kept, prompt_len, b) if whole_prompt else allowance(S_kept, b)
    assert prompt_allowance(S_kept, prompt_len, b) != allowance(S_kept, b)
    assert sync.allowance == expected and sync.selection.support.size == expected
    # The allocation spans the kept and the inserted rows; the inserted rows are recomputed whatever it picks.
    assert sync.selection.support.suffix_len == S_kept + 3
    assert sync.recomputed == 3 + len(sync.refreshed_rows)


def test_repair_refreshes_forced_rows_with_the_allocators_support_in_one_call():
    lm = tiny()
    edit = token_edit(_ids(40), 6, 5, _ids(4, 1))
    prepared = prepare(lm, edit)
    S, forced = edit.suffix_len, np.array([3, 17, 8])
    result = repair(lm, prepared, "SUR", 20.0, forced=forced)
    B = allowance(S - 3, 20.0)
    assert result.allowance == B and result.support.size == B
    union = Support(np.union1d(result.support.positions, forced), S)
    assert caches_equal(result.cache, get_executor("sequential")(lm, prepared.shift_cache, edit, union))
    # B = S - |forced|: Replay of the whole suffix; B = 0: the forced rows alone; Shift refreshes them too.
    full = repair(lm, prepared, "SUR", 100.0, forced=forced)
    assert full.allowance == S - 3 and caches_equal(full.cache, repair(lm, prepared, "Replay").cache)
    assert repair(lm, prepared, "Replay", forced=forced).allowance == S - 3
    only = get_executor("sequential")(lm, prepared.shift_cache, edit, Support(np.sort(forced), S))
    assert caches_equal(repair(lm, prepared, "SUR", 0.0, forced=forced).cache, only)
    shifted = repair(lm, prepared, "Shift", forced=forced)
    assert shifted.allowance == 0 and caches_equal(shifted.cache, only)
    assert caches_equal(repair(lm, prepared, "Shift").cache, prepared.shift_cache)  # the prepared cache unchanged


def test_repair_refuses_bad_forced_rows_before_any_work():
    lm = tiny()
    edit = token_edit(_ids(40), 6, 5, _ids(4, 1))
    prepared = PreparedEdit(edit, None, prepare(lm, edit).shift_cache, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"forced positions must lie in the suffix \[0, S=29\)"):
        repair(lm, prepared, "SUR", 10.0, forced=[29])
    with pytest.raises(TypeError, match="forced must be integer"):
        repair(lm, prepared, "SUR", 10.0, forced=[1.5])
    with pytest.raises(ValueError, match="method='Dirty' recomputes no row"):
        repair(lm, prepare(lm, edit), "Dirty", forced=[1])


def test_allowance_for_a_share_of_the_selectable_positions():
    lm = tiny()
    edit = token_edit(_ids(40), 6, 5, _ids(4, 1))  # p = 6, S = 29, N- = 35
    request = AllocationRequest(lm, edit, 10.0)
    assert allowance_for("SUR", request, selectable=20) == allowance(20, 10.0) == 2
    assert allowance_for("SUR[allowance_base=prompt]", request, selectable=20) == min(20, math.ceil(35 * 0.1)) == 4
    assert allowance_for("SUR", request, selectable=29) == allowance_for("SUR", request) == 3
    exact = AllocationRequest(lm, edit, 10.0, allowance=7)
    assert allowance_for("SUR[allowance_base=prompt]", exact, selectable=20) == 7  # an exact B is used as given
    for bad in (-1, 30, 2.0, True):
        with pytest.raises(ValueError, match=r"selectable must be an integer in \[0, S=29\]"):
            allowance_for("SUR", request, selectable=bad)


def test_repair_result_carries_the_rows_it_recomputed():
    """``RepairResult.refreshed``: absolute rows, all of them for Re-prefill, the suffix for Replay and B = S, the
    support and the forced rows for an allocator, the forced rows for Shift, none for Dirty; the live cache's repair
    returns exactly these rows."""
    lm = tiny()
    edit = token_edit(_ids(40), 6, 5, _ids(4, 1))  # p = 6, S = 29
    p, S, forced = edit.prefix_len, edit.suffix_len, np.array([17, 3, 8])
    prepared = prepare(lm, edit)
    suffix = list(range(p, p + S))

    def rows(method, budget=None, **kw):
        out = repair(lm, prepared, method, budget, **kw).refreshed
        assert out.dtype == np.int64
        return out.tolist()

    assert rows("Re-prefill") == list(range(p + S)) and rows("Replay") == suffix == rows("Replay", forced=forced)
    assert rows("Shift") == [] == rows("Dirty") == rows("SUR", 0.0)
    assert rows("Shift", forced=forced) == [p + 3, p + 8, p + 17] == rows("SUR", 0.0, forced=forced)
    assert rows("SUR", 100.0) == suffix == rows("SUR", 100.0, forced=forced)
    sur = repair(lm, prepared, "SUR", 20.0, forced=forced)
    assert sur.refreshed.tolist() == (p + np.union1d(sur.support.positions, forced)).tolist()
    assert len(sur.refreshed) > allowance(S - 3, 20.0)  # the forced rows are not all in the support: the test bites

    live = LiveCache.prefilled(lm, edit.original_ids).shifted(lm, p, None, np.arange(p + 5, 40, dtype=np.int64))[0]
    for method, budget in (("SUR", 20.0), ("Shift", None), ("Replay", None), ("Re-prefill", None)):
        _, result, got = live.repaired(lm, edit, method, budget, executor="sequential", seed=0, options={},
                                       forced=forced)
        assert got.tolist() == result.refreshed.tolist() == rows(method, budget, forced=forced), method
