"""SUR's tie rule (appendix 7.3: units ranked by score, earlier position breaking ties; scores compared after rounding
to TIE_DECIMALS places), the tied-unit count in the diagnostics, and the SUR-IDF variant. Hand-made cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import make_tiny_model

from sur_lab.allocators import ALLOCATORS, AllocationRequest, allocate
from sur_lab.allocators.sur import (
    TIE_DECIMALS,
    allocate_units,
    context_idf_weights,
    count_tied_units,
    rank_units,
    token_relevance,
)
from sur_lab.edits import token_edit
from sur_lab.units import Unit


def _units(lengths):
    out, pos = [], 0
    for n in lengths:
        out.append(Unit(pos, pos + n, 0))
        pos += n
    return out


def test_fp32_rounding_differences_are_ties_and_the_earlier_unit_wins():
    # The case: the needle's unit scores 1.25000039 and a later filler unit 1.25000060 (fp32 cosine rounding).
    units = _units([5, 5, 5, 5])
    scores = np.array([0.9, 1.25000039, 1.0, 1.25000060])
    assert rank_units(scores, units).tolist() == [1, 3, 2, 0]
    assert count_tied_units(scores) == 2
    # Unrounded comparison would have put the later unit first: the rule, not the rounding noise, decides.
    assert np.lexsort((np.arange(4), -scores)).tolist()[0] == 3


def test_scores_that_differ_on_the_tie_grid_are_not_ties():
    units = _units([3, 3, 3])
    step = 10.0 ** -TIE_DECIMALS
    scores = np.array([1.0, 1.0 + 2 * step, 0.5])
    assert rank_units(scores, units).tolist() == [1, 0, 2]
    assert count_tied_units(scores) == 0


def test_tied_groups_are_counted_and_ordered_by_position():
    units = _units([2, 2, 2, 2, 2, 2])
    scores = np.array([0.5, 1.25, 0.5, 1.25, 0.7, 1.2500001])
    assert rank_units(scores, units).tolist() == [1, 3, 5, 4, 0, 2]
    assert count_tied_units(scores) == 5  # three at 1.25 and two at 0.5


def test_admission_follows_the_tie_rule():
    units = _units([4, 4, 4])
    token_scores = np.zeros(12, dtype=np.float32)
    unit_score = np.array([1.25000050, 1.25000001, 1.2500004])  # all equal after rounding
    positions, admitted, partial = allocate_units(units, token_scores, unit_score, 6)
    assert admitted == [0] and partial == 1
    assert positions.tolist() == [0, 1, 2, 3, 4, 5]  # earliest window of the flat second unit


def test_context_idf_weights_by_hand():
    # edited context p ⊕ s = [7, 7, 7, 8 | 7, 9] (p = 4), deleted [5]; N = 6
    edit = token_edit([7, 7, 7, 8, 5, 7, 9], 4, 1, [9, 7])
    w = context_idf_weights(edit)
    assert w.tolist() == pytest.approx([math.log(7 / 4) / math.log(7), math.log(7 / 1) / math.log(7)], rel=1e-15)
    assert edit.suffix_ids.tolist() == [7, 9]


def test_idf_bonus_weights_the_identical_token_bonus():
    emb = torch.eye(4)  # orthonormal: cos = 1 for the same token, 0 otherwise
    suffix, query = torch.tensor([0, 1, 2]), torch.tensor([0, 2])
    plain = token_relevance(emb, suffix, query)
    weighted = token_relevance(emb, suffix, query, bonus_weights=np.array([0.2, 1.0, 0.6]))
    assert plain.tolist() == [1.25, 0.0, 1.25]
    assert weighted.tolist() == pytest.approx([1.05, 0.0, 1.15], abs=1e-7)
    with pytest.raises(ValueError, match="bonus_weights"):
        token_relevance(emb, suffix, query, bonus_weights=np.ones(2))


@pytest.mark.parametrize("name", ["SUR", "SUR-IDF"])
def test_allocators_report_tied_units(name):
    lm = make_tiny_model("llama")
    ids = torch.arange(3, 3 + 60) % 50
    edit = token_edit(ids, 5, 3, [10, 11, 12])
    sel = allocate(name, AllocationRequest(lm, edit, 10.0))
    d = sel.diagnostics
    assert d["tied_units"] == count_tied_units(d["unit_scores"])
    assert d["tie_decimals"] == TIE_DECIMALS
    assert len(sel.support.positions) == math.ceil(edit.suffix_len * 10 / 100)
    if name == "SUR-IDF":
        assert d["bonus_weights"].tolist() == context_idf_weights(edit).tolist()


def test_variant_is_registered_beside_sur():
    assert "SUR" in ALLOCATORS and "SUR-IDF" in ALLOCATORS
    assert ALLOCATORS["SUR"] is not ALLOCATORS["SUR-IDF"]
