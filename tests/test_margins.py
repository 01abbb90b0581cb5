"""Answer-margin endpoints (issue 26) on hand-made logits: the gold token's margin over its strongest competitor, the
per-case recovery between Shift and Re-prefill (undefined when they tie, never clipped) and the table of medians of
defined ratios with their count."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from sur_lab.analysis.endpoints import add_margin_recovery, gold_margin, margin_recovery, margin_recovery_table


def test_gold_margin_on_hand_made_logits():
    z = [0.5, 3.0, 2.25, -1.0]
    assert gold_margin(z, 1) == 0.75  # the gold token leads the runner-up by 0.75
    assert gold_margin(z, 2) == -0.75  # another token leads by 0.75
    assert gold_margin(z, 3) == -4.0
    assert gold_margin([2.0, 2.0, 0.0], 0) == 0.0  # a tie with a competitor
    # Any container, dtype and leading size-1 dims; float64 arithmetic.
    assert gold_margin(torch.tensor([[0.5, 3.0, 2.25, -1.0]], dtype=torch.bfloat16), 1) == 0.75
    assert gold_margin(np.array([1e9 + 1.0, 1e9]), np.int64(0)) == 1.0


@pytest.mark.parametrize(
    "logits,gold,match",
    [([1.0], 0, "two entries"), ([1.0, float("inf")], 0, "non-finite"), ([1.0, float("nan")], 0, "non-finite"),
     ([1.0, 2.0], 2, "gold_token=2"), ([1.0, 2.0], -1, "gold_token=-1"), ([1.0, 2.0], True, "gold_token"),
     ([1.0, 2.0], 1.0, "gold_token"), ([[1.0, 2.0], [3.0, 4.0]], 0, "logits")],
)
def test_gold_margin_refuses_bad_inputs(logits, gold, match):
    with pytest.raises(ValueError, match=match):
        gold_margin(logits, gold)


def test_margin_recovery_is_a_ratio_between_shift_and_reprefill():
    assert margin_recovery(1.0, 1.0, 3.0) == 0.0  # Shift itself
    assert margin_recovery(3.0, 1.0, 3.0) == 1.0  # Re-prefill itself
    assert margin_recovery(2.5, 1.0, 3.0) == 0.75
    # Never clipped: below Shift is negative, beyond Re-prefill above 1; a negative denominator is kept.
    assert margin_recovery(-1.0, 1.0, 3.0) == -1.0
    assert margin_recovery(5.0, 1.0, 3.0) == 2.0
    assert margin_recovery(-2.0, 0.0, -4.0) == 0.5


def test_margin_recovery_is_undefined_when_shift_ties_reprefill():
    assert math.isnan(margin_recovery(2.0, 1.5, 1.5))
    assert math.isnan(margin_recovery(1.5, 1.5, 1.5))
    assert math.isnan(margin_recovery(float("nan"), 1.0, 2.0))
    with pytest.raises(ValueError, match="m_shift"):
        margin_recovery(1.0, float("inf"), 2.0)
    with pytest.raises(ValueError, match="m_method"):
        margin_recovery("x", 1.0, 2.0)
    with pytest.raises(ValueError, match="m_reprefill"):
        margin_recovery(1.0, 1.0, True)


def _records():
    # Case a: Shift 1, Re-prefill 3. Case b: Shift = Re-prefill = 2 (undefined). Case c: Shift 0, Re-prefill 4.
    rows = [("a", "Shift", np.nan, 1.0), ("a", "Re-prefill", np.nan, 3.0), ("a", "SUR", 5.0, 2.0),
            ("a", "Erratum", np.nan, 4.0),
            ("b", "Shift", np.nan, 2.0), ("b", "Re-prefill", np.nan, 2.0), ("b", "SUR", 5.0, 7.0),
            ("b", "Erratum", np.nan, 2.0),
            ("c", "Shift", np.nan, 0.0), ("c", "Re-prefill", np.nan, 4.0), ("c", "SUR", 5.0, 1.0),
            ("c", "Erratum", np.nan, -4.0)]
    return pd.DataFrame(rows, columns=["case_id", "method", "budget_pct", "gold_margin"])


def test_add_margin_recovery_pairs_each_record_with_its_case():
    records = _records()
    out = add_margin_recovery(records)
    assert "margin_recovery" not in records.columns
    got = dict(zip(zip(out["case_id"], out["method"]), out["margin_recovery"]))
    assert got[("a", "SUR")] == 0.5 and got[("c", "SUR")] == 0.25
    assert got[("a", "Erratum")] == 1.5 and got[("c", "Erratum")] == -1.0
    assert got[("a", "Shift")] == 0.0 and got[("a", "Re-prefill")] == 1.0
    assert all(math.isnan(got[("b", m)]) for m in ("Shift", "Re-prefill", "SUR", "Erratum"))
    with pytest.raises(ValueError, match="exactly one 'Re-prefill'"):
        add_margin_recovery(records[records["method"] != "Re-prefill"])
    with pytest.raises(ValueError, match="lack"):
        add_margin_recovery(records.drop(columns="gold_margin"))


def test_table_reports_medians_of_defined_ratios_with_their_count():
    table = margin_recovery_table(add_margin_recovery(_records()))
    sur = table.loc[("SUR", 5.0)]
    assert sur["median"] == 0.375 and sur["n_defined"] == 2 and sur["n_cases"] == 3
    erratum = table.loc[("Erratum", np.nan)] if ("Erratum", np.nan) in table.index else \
        table.xs("Erratum", level="method").iloc[0]
    assert erratum["median"] == 0.25 and erratum["n_defined"] == 2 and erratum["n_cases"] == 3
    only_undefined = pd.DataFrame({"method": ["X"], "budget_pct": [2.0], "margin_recovery": [np.nan]})
    row = margin_recovery_table(only_undefined).iloc[0]
    assert math.isnan(row["median"]) and row["n_defined"] == 0 and row["n_cases"] == 1
    with pytest.raises(ValueError, match="lack"):
        margin_recovery_table(only_undefined, by=("method", "family"))
