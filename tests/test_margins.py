"""Answer-margin endpoints (issues 26 and 40) on hand-made logits and frames: the gold token's margin over its strongest
competitor, the per-case recovery between Shift and Re-prefill (undefined when they tie, never clipped), the pooled
recovery as a ratio of sums (undefined below the declared gap) and the table of both."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from sur_lab.analysis.endpoints import (MARGIN_RECOVERY_MIN_GAP, add_margin_recovery, gold_margin, margin_recovery,
                                       margin_recovery_table, pooled_margin_recovery)


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


def test_pooled_recovery_is_a_ratio_of_sums():
    # Re-prefill gains 2, 0 and 4 over Shift (sum 6); SUR's margins 2, 7, 1 gain 1, 5 and 1 (sum 7): 7 / 6. The tied
    # case b counts in the numerator (its per-case ratio is undefined).
    shift, reprefill = [1.0, 2.0, 0.0], [3.0, 2.0, 4.0]
    assert pooled_margin_recovery([2.0, 7.0, 1.0], shift, reprefill) == (7 / 6, "")
    assert pooled_margin_recovery(shift, shift, reprefill) == (0.0, "")
    assert pooled_margin_recovery(reprefill, shift, reprefill) == (1.0, "")
    assert pooled_margin_recovery([4.0, 2.0, -4.0], shift, reprefill) == (-1 / 6, "")  # never clipped
    # A case with a NaN margin is left out of both sums: (2 - 1) / (3 - 1).
    assert pooled_margin_recovery([2.0, np.nan, 1.0], shift, [3.0, 2.0, np.nan]) == (0.5, "")


def test_pooled_recovery_is_undefined_below_the_declared_gap():
    assert MARGIN_RECOVERY_MIN_GAP == 0.2
    # Re-prefill's mean gain 0.15 logits per case (0.1 and 0.2) is below 0.2: NaN with the reason.
    ratio, note = pooled_margin_recovery([1.0, 1.0], [0.0, 0.0], [0.1, 0.2])
    assert math.isnan(ratio) and note == ("undefined: Re-prefill's mean margin gain over Shift is 0.15 logits over 2 "
                                          "cases, below the 0.2 threshold")
    assert pooled_margin_recovery([1.0, 1.0], [0.0, 0.0], [0.1, 0.2], min_gap=0.1) == (2 / (0.1 + 0.2), "")
    ratio, note = pooled_margin_recovery([1.0], [2.0], [1.0], min_gap=0.0)  # Shift above Re-prefill: negative gap
    assert math.isnan(ratio) and "-1 logits over 1 case," in note
    ratio, note = pooled_margin_recovery([np.nan], [1.0], [2.0])
    assert math.isnan(ratio) and note.startswith("undefined: no case has")
    with pytest.raises(ValueError, match="m_shift"):
        pooled_margin_recovery([1.0], [np.inf], [2.0])
    with pytest.raises(ValueError, match="m_method"):
        pooled_margin_recovery([[1.0]], [1.0], [2.0])
    with pytest.raises(ValueError, match="one margin per case"):
        pooled_margin_recovery([1.0, 2.0], [1.0], [2.0])
    with pytest.raises(ValueError, match="min_gap"):
        pooled_margin_recovery([1.0], [0.0], [2.0], min_gap=-0.1)


def test_table_reports_the_ratio_of_sums_and_the_median_of_defined_ratios():
    table = margin_recovery_table(add_margin_recovery(_records()))
    assert list(table.columns) == ["ratio", "median", "n_defined", "n_pooled", "n_cases", "note"]
    sur = table.loc[("SUR", 5.0)]
    assert sur["ratio"] == 7 / 6 and sur["note"] == ""
    assert sur["median"] == 0.375 and sur["n_defined"] == 2 and sur["n_pooled"] == 3 and sur["n_cases"] == 3
    erratum = table.xs("Erratum", level="method").iloc[0]
    assert erratum["ratio"] == -1 / 6 and erratum["median"] == 0.25 and erratum["n_defined"] == 2
    assert table.xs("Shift", level="method").iloc[0]["ratio"] == 0.0
    assert table.xs("Re-prefill", level="method").iloc[0]["ratio"] == 1.0
    # Only case b (Shift ties Re-prefill): both forms undefined, the ratio with its reason.
    only_b = add_margin_recovery(_records()).query("case_id == 'b'")
    row = margin_recovery_table(only_b).loc[("SUR", 5.0)]
    assert math.isnan(row["ratio"]) and math.isnan(row["median"]) and row["n_defined"] == 0
    assert row["note"].startswith("undefined: Re-prefill's mean margin gain over Shift is 0 logits over 1 case")
    with pytest.raises(ValueError, match="lack"):
        margin_recovery_table(only_b, by=("method", "family"))
    with pytest.raises(ValueError, match="exactly one 'Shift'"):
        margin_recovery_table(only_b[only_b["method"] != "Shift"])


def test_old_margin_on_hand_made_logits():
    from sur_lab.analysis.endpoints import old_margin

    z = [0.5, 3.0, -1.25, 2.0]
    assert old_margin(z, 1, 3) == 1.0 and old_margin(z, 3, 1) == -1.0 and old_margin(z, 2, 2) == 0.0
    assert old_margin(torch.tensor([[0.5, 3.0, -1.25, 2.0]], dtype=torch.float32), 2, 0) == -1.75
    for logits, old, gold, match in (([1.0, 2.0], 2, 0, "old_token=2"), ([1.0, 2.0], 0, -1, "gold_token=-1"),
                                     ([1.0, 2.0], True, 0, "old_token"), ([1.0, 2.0], 0, 1.0, "gold_token"),
                                     ([1.0, math.inf], 0, 1, "non-finite"), ([[1.0, 2.0], [3.0, 4.0]], 0, 1, "logits")):
        with pytest.raises(ValueError, match=match):
            old_margin(logits, old, gold)


def test_old_margin_record_field_on_a_float64_tiny_model(tiny_lm):
    """Each record's ``old_margin`` is its own first-token logit of ``meta["old_token"]`` minus that of
    ``meta["gold_token"]``: checked against a plain transformers forward of the whole prompt (Dirty: the original
    context; Re-prefill: the edited one), to float32 rounding of the stored logits; NaN without an old token."""
    from conftest import hf_prefill

    from sur_lab.edits import token_edit
    from sur_lab.sweeps import Case, run_case

    gen = torch.Generator().manual_seed(5)
    original, query = torch.randint(0, 96, (30,), generator=gen), torch.randint(0, 96, (4,), generator=gen)
    edit = token_edit(original, 9, 5, query)
    old, gold = 17, 42
    records = run_case(tiny_lm, Case("m0", edit, meta={"gold_token": gold, "old_token": old}),
                       ["Dirty", "Shift", "Re-prefill"], [], max_new_tokens=1)
    by = {r.method: r for r in records}
    for method, ids in (("Dirty", edit.original_ids), ("Re-prefill", edit.edited_ids)):
        _, logits = hf_prefill(tiny_lm, torch.cat((ids, query)))
        z = logits[-1].to(torch.float32).double()  # the record reads float32 first-token logits
        expected = (z[old] - z[gold]).item()
        tol = 4 * torch.finfo(torch.float32).eps * max(1.0, z.abs().max().item())
        assert abs(by[method].old_margin - expected) <= tol, method
    assert math.isfinite(by["Shift"].old_margin)
    assert by["Dirty"].old_margin != by["Re-prefill"].old_margin  # the edit moved the pull
    plain = run_case(tiny_lm, Case("m1", edit, meta={"gold_token": gold}), ["Shift"], [], max_new_tokens=1)
    assert math.isnan(plain[0].old_margin)


def test_table_pools_only_cases_with_all_three_margins():
    """``n_pooled`` counts the cases the pooled ratio used (one NaN mask, :func:`pooled_margin_recovery`'s)."""
    records = _records()
    records.loc[(records["case_id"] == "a") & (records["method"] == "SUR"), "gold_margin"] = np.nan
    sur = margin_recovery_table(add_margin_recovery(records)).loc[("SUR", 5.0)]
    assert sur["n_pooled"] == 2 and sur["n_cases"] == 3 and sur["n_defined"] == 1
    assert sur["ratio"] == pooled_margin_recovery([7.0, 1.0], [2.0, 0.0], [2.0, 4.0])[0] == 6 / 4


def test_gold_and_old_margin_share_one_input_check():
    """Both margins refuse the same bad logits and token ids with the same words (one validator)."""
    from sur_lab.analysis.endpoints import old_margin

    for logits, token in (([1.0, math.inf], 0), ([1.0, math.nan], 1), ([1.0, 2.0], 2), ([1.0, 2.0], -1),
                          ([1.0, 2.0], True), ([1.0, 2.0], 1.0), ([[1.0, 2.0], [3.0, 4.0]], 0)):
        with pytest.raises(ValueError) as gold:
            gold_margin(logits, token)
        with pytest.raises(ValueError) as old:
            old_margin(logits, 0, token)
        assert str(old.value) == str(gold.value), (logits, token)
    assert old_margin([1.5], 0, 0) == 0.0  # one entry is enough for the old value's pull
    with pytest.raises(ValueError, match="two entries"):
        gold_margin([1.5], 0)
