"""Edit-local window and Edit-local + SUR (issue 26) on hand-made edits: deletion at the start, in the middle, an empty
suffix, a replacement in an EditSession, the B = S endpoint through the dispatcher, and the split's exact counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_tiny_model
from sur_lab.allocators import AllocationRequest, allocate, variant_name
from sur_lab.allocators.edit_local import clip_units, local_allowance
from sur_lab.budget import allowance
from sur_lab.cache_ops import to_tensors
from sur_lab.edits import token_edit
from sur_lab.repair import prepare, repair
from sur_lab.session import EditSession
from sur_lab.units import Unit

#: The query token of the controlled-embedding model; token 1 is orthogonal to it.
QUERY = 40
FILLER = 1


@pytest.fixture(scope="module")
def llama():
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def controlled():
    """A tiny model whose embedding rows are orthonormal basis vectors, so that SUR's token score is exactly known:
    1.25 for the query token (cos 1 + bonus), 0 for every other token below 48."""
    lm = make_tiny_model("llama")
    with torch.no_grad():
        E = lm.model.get_input_embeddings().weight
        E.zero_()
        E[torch.arange(96), torch.arange(96) % 48] = 1.0
    return lm


def _edit(prefix: int, deleted: int, suffix: list[int], query=(QUERY,)):
    ids = [FILLER] * prefix + [7] * deleted + list(suffix)
    return token_edit(ids, prefix, deleted, list(query))


def _units(lengths):
    out, pos = [], 0
    for n in lengths:
        out.append(Unit(pos, pos + n, 0))
        pos += n
    return out


# ---- Edit-local window --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", [0, 17], ids=["deletion-at-start", "deletion-in-the-middle"])
def test_edit_local_window_is_the_b_positions_right_after_the_deletion(llama, prefix):
    g = torch.Generator().manual_seed(prefix)
    ids = torch.randint(0, 96, (prefix + 5 + 60,), generator=g)
    edit = token_edit(ids, prefix, 5, [3, 4])
    sel = allocate("Edit-local window", AllocationRequest(llama, edit, 10))
    assert sel.support.positions.tolist() == [0, 1, 2, 3, 4, 5]  # B = ceil(60 * 10 / 100) = 6
    assert sel.support.intervals == [(0, 6)]
    # Absolute rows of the edited context: the rows right after the prefix, i.e. the first tokens after the span.
    assert sel.support.absolute(edit.prefix_len).tolist() == list(range(prefix, prefix + 6))
    assert edit.edited_ids[prefix : prefix + 6].tolist() == ids[prefix + 5 : prefix + 11].tolist()


def test_empty_suffix_gives_an_empty_support(llama):
    edit = token_edit(list(range(10, 20)), 6, 4, [3])  # deletes the last 4 tokens: S = 0
    assert edit.suffix_len == 0
    for name in ("Edit-local window", "Edit-local + SUR"):
        for request in (AllocationRequest(llama, edit, 50), AllocationRequest(llama, edit, allowance=0)):
            sel = allocate(name, request)
            assert sel.support.size == 0 and sel.support.suffix_len == 0, name


def test_full_budget_is_the_whole_suffix_and_the_dispatcher_replays(llama):
    g = torch.Generator().manual_seed(3)
    edit = token_edit(torch.randint(0, 96, (8 + 3 + 25,), generator=g), 8, 3, [5, 6])
    S = edit.suffix_len
    for request in (AllocationRequest(llama, edit, 100), AllocationRequest(llama, edit, allowance=S)):
        assert allocate("Edit-local window", request).support.positions.tolist() == list(range(S))
    prepared = prepare(llama, edit)
    local = repair(llama, prepared, "Edit-local window", 100)
    replay = repair(llama, prepared, "Replay")
    assert local.allowance == S and local.support.positions.tolist() == list(range(S))
    for (k1, v1), (k2, v2) in zip(to_tensors(local.cache), to_tensors(replay.cache)):
        torch.testing.assert_close(k1, k2, rtol=0, atol=0)  # the same operator (Algorithm 1 step 2) on the same input
        torch.testing.assert_close(v1, v2, rtol=0, atol=0)


def test_edit_local_window_after_a_replacement_starts_after_the_inserted_text(llama):
    session = EditSession(llama, method="Edit-local window", budget_pct=20)
    session.append(torch.arange(10, 50))  # 40 rows
    record = session.replace(12, 15, [70, 71, 72, 73, 74])  # rows [12, 15) -> 5 inserted rows at 12..16
    S = 40 - 15
    B = allowance(S, 20)
    assert (record.suffix_len, record.allowance) == (S, B)
    assert record.selection.support.positions.tolist() == list(range(B))
    # The refreshed rows are the first B rows after the inserted text (rows 17 ..), not the inserted rows themselves.
    assert record.refreshed_rows.tolist() == list(range(17, 17 + B))
    assert session.tokens[12:17].tolist() == [70, 71, 72, 73, 74]


# ---- Edit-local + SUR: hand-made cases on the controlled-embedding model ---------------------------------------------

# Suffix of 40 tokens in four units of 10; the query token sits at position 25 (unit 2), everything else scores 0.
# Unit 2 scores (1.25 + 0 + 0 + 0) / 4 = 0.3125 (top-4 mean), the others 0.
SUFFIX = [FILLER] * 25 + [QUERY] + [FILLER] * 14
UNITS = _units([10, 10, 10, 10])


def _request(lm, **kw):
    return AllocationRequest(lm, _edit(6, 2, SUFFIX), units=list(UNITS), **kw)


@pytest.mark.parametrize(
    "B, share, expected",
    [
        # W = ceil(8 * 0.5) = 4: window [0, 4); SUR's 4 go to unit 2, which does not fit: the forward-envelope window
        # starting at the peak (Eq. 8: 1 + e^{-1/16} + e^{-2/16} + e^{-3/16} beats any window holding earlier tokens).
        (8, 0.5, [0, 1, 2, 3, 25, 26, 27, 28]),
        # Odd B: the window gets the extra position (W = ceil(2.5) = 3), SUR the other 2.
        (5, 0.5, [0, 1, 2, 25, 26]),
        # local_share = 0 is SUR: a width-8 window inside unit 2 = [20, 30), the latest start 22 reaches the peak's
        # forward tail.
        (8, 0.0, [22, 23, 24, 25, 26, 27, 28, 29]),
        # local_share = 1 is the edit-local window.
        (8, 1.0, [0, 1, 2, 3, 4, 5, 6, 7]),
        # W = ceil(12 * 0.25) = 3; SUR's 9 do not hold unit 2 (10 tokens): its best width-9 window is [21, 30).
        (12, 0.25, [0, 1, 2, 21, 22, 23, 24, 25, 26, 27, 28, 29]),
    ],
)
def test_edit_local_plus_sur_hand_cases(controlled, B, share, expected):
    name = variant_name("Edit-local + SUR", local_share=share)
    sel = allocate(name, _request(controlled, allowance=B))
    assert sel.support.positions.tolist() == expected
    d = sel.diagnostics
    W = local_allowance(B, share)
    assert (d["local_allowance"], d["sur_allowance"], d["window"]) == (W, B - W, (0, W))


def test_edit_local_plus_sur_default_share_is_half_and_equals_sur_and_window_at_the_ends(controlled):
    request = _request(controlled, allowance=8)
    assert allocate("Edit-local + SUR", request).support.positions.tolist() == [0, 1, 2, 3, 25, 26, 27, 28]
    assert allocate("Edit-local + SUR[local_share=0]", request).support == allocate("SUR", request).support
    assert allocate("Edit-local + SUR[local_share=1]", request).support == allocate("Edit-local window", request).support


def test_a_unit_cut_by_the_window_keeps_its_remaining_tokens(controlled):
    # Query tokens at 2 (inside the window) and 6 (unit 0's remainder [4, 10)): SUR's part must not re-select 0..3.
    suffix = [FILLER] * 40
    suffix[2] = suffix[6] = QUERY
    request = AllocationRequest(controlled, _edit(3, 1, suffix), units=list(UNITS), allowance=8)
    sel = allocate("Edit-local + SUR", request)
    # W = 4; unit 0 clipped to [4, 10) scores (1.25 + 0 * 3) / 4 and does not fit 4: forward window from the peak at 6.
    assert sel.support.positions.tolist() == [0, 1, 2, 3, 6, 7, 8, 9]
    assert [(u.start, u.end) for u in sel.diagnostics["units"]] == [(4, 10), (10, 20), (20, 30), (30, 40)]
    assert clip_units(UNITS, 10) == UNITS[1:] and clip_units(UNITS, 40) == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    S=st.integers(1, 160),
    share=st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75, 1.0]),
    data=st.data(),
)
def test_edit_local_plus_sur_counts_are_exact(llama, S, share, data):
    B = data.draw(st.integers(0, S))
    seed = data.draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    edit = token_edit(torch.randint(0, 96, (4 + 2 + S,), generator=g), 4, 2, [5, 9, 11])
    sel = allocate(variant_name("Edit-local + SUR", local_share=share), AllocationRequest(llama, edit, allowance=B))
    pos = sel.support.positions
    W = -(-B * round(share * 100) // 100)  # ceil(B * share) in integers (share has two decimals)
    assert len(pos) == B == len(np.unique(pos))
    assert pos[:W].tolist() == list(range(W))
    assert np.all(pos[W:] >= W) and len(pos[W:]) == B - W
    if B:
        assert sel.diagnostics["local_allowance"] == W
