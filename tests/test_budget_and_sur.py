"""Budgets (Eq. 3), supports, semantic units and the SUR allocator (Eq. 1/7, top-4 mean, Eq. 8, Algorithm 1)."""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_tiny_model
from sur_lab.allocators import AllocationRequest, allocate, allocate_units, best_window, forward_envelope, token_relevance, unit_scores
from sur_lab.budget import BudgetFractionWarning, Support, allowance, coalesce, fractions_expected
from sur_lab.edits import token_edit
from sur_lab.units import Unit, merge_short, segment_units, split_balanced


# ---- Eq. 3 -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "S,b,B", [(0, 5, 0), (100, 0, 0), (100, 2, 2), (100, 7, 7), (101, 2, 3), (49, 2, 1), (10, 100, 10), (3, 0.1, 1),
              (1000, 0.5, 5), (999, 12.5, 125)],
)
def test_allowance_hand_cases(S, b, B):
    assert allowance(S, b) == B


def _allowance_by_search(S: int, b: Fraction) -> int:
    """Brute-force oracle for Eq. 3: the smallest count B in [0, S] whose share B / S reaches b percent (S if none).

    Searches counts one by one with exact fractions, so it shares neither ``ceil`` nor the float product with the
    code under test."""
    for B in range(S + 1):
        if 100 * B >= b * S:
            return B
    return S


@settings(max_examples=300)
@given(st.integers(0, 2_000), st.integers(0, 10_000))
def test_allowance_matches_a_brute_force_search(S, b_hundredths):
    b = Fraction(b_hundredths, 100)
    # The budget reaches allowance() as the float (or int) a user types; its decimal value is b exactly.
    typed = b_hundredths // 100 if b_hundredths % 100 == 0 else float(f"{b_hundredths / 100:.2f}")
    assert allowance(S, typed) == _allowance_by_search(S, b)


@pytest.mark.parametrize("b", [-0.1, 100.01, float("nan"), float("inf"), "five", "5", True, np.bool_(False), None])
def test_allowance_rejects_budget_outside_range(b):
    with pytest.raises(ValueError, match="budget_pct"):
        allowance(10, b)


def test_support_validation_and_intervals():
    s = Support(np.array([0, 1, 2, 5, 7, 8]), 10)
    assert s.intervals == [(0, 3), (5, 6), (7, 9)] and s.num_intervals == 3 and s.size == 6
    assert list(s.absolute(4)) == [4, 5, 6, 9, 11, 12]
    assert coalesce(np.array([], dtype=np.int64)) == []
    with pytest.raises(ValueError, match="sorted and unique"):
        Support(np.array([3, 1]), 10)
    with pytest.raises(ValueError, match="sorted and unique"):
        Support(np.array([1, 1]), 10)
    with pytest.raises(ValueError, match="suffix"):
        Support(np.array([10]), 10)


# ---- Eq. 1 / Eq. 7 -----------------------------------------------------------------------------------------------
def test_token_relevance_hand_case():
    E = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0], [-1.0, 0.0]])
    suffix = torch.tensor([0, 1, 2, 3])
    query = torch.tensor([1, 2])
    r = token_relevance(E, suffix, query)
    s2 = 1 / math.sqrt(2)
    # token 0: max(cos(e0,e1)=0, cos(e0,e2)=1/sqrt2); token 1 is in the query: 1 + 0.25; token 2 likewise;
    # token 3: max(0, -1/sqrt2) = 0.
    np.testing.assert_allclose(r, [s2, 1.25, 1.25, 0.0], atol=1e-6)


def test_token_relevance_blocks_do_not_change_scores():
    g = torch.Generator().manual_seed(0)
    E = torch.randn(50, 8, generator=g)
    suffix = torch.randint(0, 50, (300,), generator=g)
    query = torch.randint(0, 50, (7,), generator=g)
    # Different block sizes are matmuls of different row counts, which may round differently (float32 scoring): the
    # scores agree to a few float32 ulps of their magnitude (cosines <= 1, plus the 0.25 bonus), never bitwise.
    eps32 = float(np.finfo(np.float32).eps)
    np.testing.assert_allclose(
        token_relevance(E, suffix, query, block=1024), token_relevance(E, suffix, query, block=7), rtol=0,
        atol=8 * eps32 * 1.25,
    )


def test_unit_scores_top4_mean():
    scores = np.array([0.1, 0.9, 0.2, 0.8, 0.3, 0.7, 0.5, 0.4, 0.6])
    units = [Unit(0, 6, 0), Unit(6, 9, 0)]
    np.testing.assert_allclose(unit_scores(scores, units), [(0.9 + 0.8 + 0.7 + 0.3) / 4, (0.5 + 0.4 + 0.6) / 3])


# ---- Eq. 8 -------------------------------------------------------------------------------------------------------
def test_forward_envelope_hand_case():
    r = np.array([0.0, 1.0, 0.0, 0.0])
    a = math.exp(-1 / 16)
    expected = [max(math.exp(-1), 0), 1.0, max(math.exp(-1), a), max(math.exp(-1), a * a)]
    np.testing.assert_allclose(forward_envelope(r), expected)


def test_best_window_prefers_forward_context_and_earliest_tie():
    # A peak at index 2: windows of width 2 starting at 2 cover the peak and its decayed tail.
    assert best_window(np.array([0.0, 0.0, 1.0, 0.0, 0.0]), 2) == 2
    # Equal scores everywhere: every window sums the same; the earliest wins.
    assert best_window(np.zeros(6), 3) == 0
    with pytest.raises(ValueError, match="width"):
        best_window(np.zeros(3), 4)


def test_allocate_units_ranking_ties_and_window():
    scores = np.array([1, 1, 1, 1, 5, 0, 0, 0, 1, 1, 1, 1], dtype=float)
    units = [Unit(0, 4, 0), Unit(4, 8, 0), Unit(8, 12, 0)]
    u = unit_scores(scores, units)  # 1, 1.25, 1
    pos, admitted, partial = allocate_units(units, scores, u, 6)
    # Unit 1 (highest) whole, then unit 0 beats unit 2 on the tie (earlier), windowed to width 2 at its start.
    assert admitted == [1] and partial == 0
    assert list(pos) == [0, 1, 4, 5, 6, 7]


# ---- units -------------------------------------------------------------------------------------------------------
def test_split_balanced_and_merge_short():
    pieces = split_balanced(Unit(0, 300, 0), 128)
    assert [len(p) for p in pieces] == [100, 100, 100]
    assert [len(p) for p in split_balanced(Unit(0, 257, 0), 128)] == [86, 86, 85]
    units = [Unit(0, 10, 0), Unit(10, 13, 0), Unit(13, 20, 0), Unit(20, 22, 1), Unit(22, 40, 2)]
    merged = merge_short(units, 8)
    # 3-token unit: neighbours 10 and 7 tokens -> the shorter (following, 7) ; the 2-token unit is alone in its container.
    assert [(u.start, u.end) for u in merged] == [(0, 10), (10, 20), (20, 22), (22, 40)]
    tie = merge_short([Unit(0, 9, 0), Unit(9, 12, 0), Unit(12, 21, 0)], 8)
    assert [(u.start, u.end) for u in tie] == [(0, 12), (12, 21)]  # equal neighbours: the preceding one


# ---- allocator properties on a tiny model ---------------------------------------------------------------------------
_LM = {}


def _tiny():
    if "lm" not in _LM:
        _LM["lm"] = make_tiny_model("llama", dtype=torch.float32)
    return _LM["lm"]


@settings(max_examples=60, deadline=None)
@given(
    S=st.integers(0, 400), b=st.floats(0, 100, allow_nan=False), q=st.lists(st.integers(0, 95), min_size=1, max_size=6),
    seed=st.integers(0, 1000),
)
def test_sur_support_is_exact_sorted_unique_and_deterministic(S, b, q, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (5 + 3 + S,), generator=g)
    edit = token_edit(ids, 5, 3, q)
    units = segment_units(edit)
    assert sum(len(u) for u in units) == S
    assert all(units[i].end == units[i + 1].start for i in range(len(units) - 1))
    assert (units[0].start == 0 and units[-1].end == S) if S else units == []
    with fractions_expected():  # budgets below 1 % are drawn on purpose
        sel = allocate("SUR", AllocationRequest(_tiny(), edit, b))
        again = allocate("SUR", AllocationRequest(_tiny(), edit, b))
    pos = sel.support.positions
    assert len(pos) == allowance(S, b) and len(np.unique(pos)) == len(pos)
    assert np.all(np.diff(pos) > 0) and (len(pos) == 0 or (pos[0] >= 0 and pos[-1] < S))
    assert np.array_equal(again.support.positions, pos)


FRACTION_MESSAGE = (r"budget_pct is a percentage of the suffix; 0\.05 means 0\.05 %, not 5 % \(pass budget_pct=5 "
                    r"for that; wrap the call in sur_lab\.budget\.fractions_expected\(\) when 0\.05 % is meant\)")


def _fraction_warnings(record):
    return [w for w in record if issubclass(w.category, BudgetFractionWarning)]


def test_a_budget_below_one_percent_warns_once_at_the_callers_line():
    from sur_lab import EditSession, prepare, repair

    lm = _tiny()
    edit = token_edit(torch.arange(3, 63) % 96, 5, 3, [7, 8])  # S = 52: 0.05 % is B = 1, 5 % is B = 3
    with pytest.warns(UserWarning, match=FRACTION_MESSAGE) as record:
        request = AllocationRequest(lm, edit, 0.05)
    assert request.allowance == 1 == allowance(52, 0.05) and allowance(52, 5) == 3
    [w] = _fraction_warnings(record)
    assert w.filename == __file__  # the user's line, not the library's
    prepared = prepare(lm, edit)
    with pytest.warns(BudgetFractionWarning) as record:
        result = repair(lm, prepared, "SUR", budget_pct=0.05)
    assert result.allowance == 1
    assert [w.filename for w in _fraction_warnings(record)] == [__file__]  # once, though AllocationRequest checks too
    with pytest.warns(BudgetFractionWarning, match="0.5 means 0.5 %, not 50 %") as record:
        EditSession(lm, budget_pct=0.5)
    assert [w.filename for w in _fraction_warnings(record)] == [__file__]
    # Percent budgets, 0, and sub-1 % budgets inside fractions_expected() do not warn.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for b in (0, 1, 5, 100):
            AllocationRequest(lm, edit, b)
        assert repair(lm, prepare(lm, edit), "SUR", budget_pct=1).allowance == 1
        with fractions_expected():
            assert AllocationRequest(lm, edit, 0.05).allowance == 1
            EditSession(lm, budget_pct=0.5)
        EditSession(lm, budget_pct=5)


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_units_partition_real_text(smol_tokenizer, data_dir, data):
    from sur_lab.edits import chat_edit, format_passages

    corpus = _corpus(data_dir)
    idx = data.draw(st.lists(st.integers(0, len(corpus) - 1), min_size=2, max_size=5, unique=True))
    docs, spans = format_passages([corpus[i] for i in idx])
    victim = data.draw(st.integers(0, len(idx) - 1))
    edit = chat_edit(smol_tokenizer, docs, "Who was born first?", spans[victim])
    units = segment_units(edit)
    covered = np.zeros(edit.suffix_len, dtype=int)
    for u in units:
        covered[u.start : u.end] += 1
        assert len(u) <= 128
    assert np.all(covered == 1)


_CORPUS = {}


def _corpus(data_dir):
    if "c" not in _CORPUS:
        from sur_lab.data.qa import load_corpus

        _CORPUS["c"] = load_corpus(limit=300)
    return _CORPUS["c"]


def test_support_equality_compares_positions():
    assert Support(np.array([1, 2]), 5) == Support(np.array([1, 2]), 5)
    assert Support(np.array([1, 2]), 5) != Support(np.array([1, 3]), 5)
    assert Support(np.array([1, 2]), 5) != Support(np.array([1, 2]), 6)
    assert len({Support(np.array([1, 2]), 5), Support(np.array([1, 2]), 5)}) == 1
