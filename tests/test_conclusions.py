"""Words of the generated conclusions (:mod:`sur_lab.analysis.conclusions`): verdicts, sentences, paired rivals."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sur_lab.analysis.conclusions import (
    MIN_PAIRED_UNITS,
    against_rivals,
    arm_differences,
    difference_sentence,
    separates,
    verdict,
)


def test_verdict():
    assert verdict(5.0, 1.0, 9.0) == "higher"
    assert verdict(-5.0, -9.0, -1.0) == "lower"
    assert verdict(1.0, -2.0, 4.0) == "not separated"
    assert verdict(0.0, 0.0, 0.0) == "not separated"  # an interval touching 0 does not separate
    assert verdict(2.0, 0.0, 4.0) == "not separated"
    with pytest.raises(ValueError, match="low"):
        verdict(0.0, 1.0, -1.0)
    with pytest.raises(ValueError, match="diff"):
        verdict(float("nan"), 0.0, 1.0)


def test_difference_sentence():
    assert difference_sentence("SUR 5%", "Shift", 12.5, 4.25, 20.75, n=24) == (
        "SUR 5% beats Shift: +12.5 pp (95 % CI +4.2 to +20.8; 24 cases)")
    assert difference_sentence("SUR 5%", "Re-prefill", -29.2, -40.0, -18.0).startswith("SUR 5% loses to Re-prefill: -29.2")
    null = difference_sentence("SUR 2%", "Shift", 4.2, -4.0, 12.0, n=8, what="sources")
    assert null == "SUR 2% vs Shift: not separated, +4.2 pp (95 % CI -4.0 to +12.0; 8 sources), a null result at this size"
    # lower is better (latency, TV): a negative difference wins
    assert difference_sentence("SUR", "Re-prefill", -300.0, -400.0, -200.0, unit="ms", higher_is_better=False,
                               digits=0).startswith("SUR beats Re-prefill: -300 ms")
    with pytest.raises(ValueError, match="digits"):
        difference_sentence("a", "b", 1.0, 0.5, 1.5, digits=-1)
    # Fewer than MIN_PAIRED_UNITS paired units never separate, even with an interval away from 0 (smoke-sized runs:
    # one case gives the degenerate interval [d, d]).
    tiny = difference_sentence("Erratum", "Shift", -100.0, -100.0, -100.0, n=1)
    assert tiny.startswith("Erratum vs Shift: not separated, -100.0 pp") and "fewer than 6 cases cannot separate" in tiny
    assert difference_sentence("a", "b", 10.0, 5.0, 15.0, n=6).startswith("a beats b")


def test_separates_needs_enough_paired_units():
    assert MIN_PAIRED_UNITS == 6  # 2 * 0.5**5 = 0.0625 > 0.05: five same-sign pairs are not enough for a sign test
    assert 2 * 0.5**MIN_PAIRED_UNITS < 0.05 <= 2 * 0.5 ** (MIN_PAIRED_UNITS - 1)
    assert separates(0.1, 0.2) and separates(-0.2, -0.1, n=6) and not separates(-0.1, 0.2, n=100)
    assert not separates(0.1, 0.2, n=5) and not separates(float("nan"), float("nan"))
    assert verdict(1.0, 0.5, 1.5, n=5) == "not separated" and verdict(1.0, 0.5, 1.5, n=6) == "higher"


def _records(n_cases: int = 12) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n_cases):
        for b in (2.0, 5.0):
            rows += [{"case_id": i, "context_len": 1024, "method": "SUR", "budget_pct": b, "em": 1.0},
                     {"case_id": i, "context_len": 1024, "method": "Dense tokens", "budget_pct": b, "em": 0.0},
                     {"case_id": i, "context_len": 1024, "method": "Window", "budget_pct": b,
                      "em": float(rng.integers(0, 2))}]
        rows.append({"case_id": i, "context_len": 1024, "method": "Shift", "budget_pct": np.nan, "em": 0.0})
    return pd.DataFrame(rows)


def test_against_rivals():
    df = _records()
    out = against_rivals(df, "SUR", ["SUR", "Dense tokens", "Window", "Absent"], "em", n_boot=500)
    assert list(out.columns) == ["focus", "rival", "budget_pct", "diff_pp", "ci_low_pp", "ci_high_pp", "n_cases",
                                 "verdict"]
    assert len(out) == 4  # two rivals present x two budgets; SUR itself and absent rivals skipped
    dense = out[out.rival == "Dense tokens"]
    assert (dense.diff_pp == 100.0).all() and (dense.verdict == "higher").all() and (dense.n_cases == 12).all()
    window = out[out.rival == "Window"].iloc[0]
    exact = 100 * (1 - df[(df.method == "Window") & (df.budget_pct == 2.0)].em.mean())
    assert window.diff_pp == pytest.approx(exact, abs=1e-9)
    assert window.ci_low_pp <= window.diff_pp <= window.ci_high_pp
    with pytest.raises(ValueError, match="metric"):
        against_rivals(df, "SUR", ["Window"], "agree")
    with pytest.raises(ValueError, match="focus"):
        against_rivals(df, "Shift", ["Window"], "em")


def test_arm_differences_pairs_budgeted_and_unbudgeted_arms():
    df = _records()
    # An unbudgeted arm (Erratum) right on every odd case, and a Re-prefill right everywhere.
    extra = []
    for i in range(12):
        extra.append({"case_id": i, "context_len": 1024, "method": "Erratum", "budget_pct": np.nan,
                      "em": float(i % 2)})
        extra.append({"case_id": i, "context_len": 1024, "method": "Re-prefill", "budget_pct": np.nan, "em": 1.0})
    df = pd.concat([df, pd.DataFrame(extra)], ignore_index=True)
    out = arm_differences(df, metrics=["em"], compared=["SUR", "Dense tokens", "Erratum", "Absent"], n_boot=500)
    # Erratum vs the two baselines once (budget NaN); at each budget: 3 arm pairs + 2 budgeted arms x 2 baselines.
    assert len(out) == 2 + 2 * (3 + 4)
    fixed = out[out.budget_pct.isna()].set_index("b")
    assert fixed.loc["Shift", "a"] == "Erratum" and fixed.loc["Shift", "diff_pp"] == pytest.approx(50.0)
    assert fixed.loc["Re-prefill", "diff_pp"] == pytest.approx(-50.0)
    at2 = out[out.budget_pct == 2.0].set_index(["a", "b"])
    assert at2.loc[("SUR 2%", "Dense tokens 2%"), "diff_pp"] == pytest.approx(100.0)
    assert bool(at2.loc[("SUR 2%", "Dense tokens 2%"), "separates"])
    assert at2.loc[("SUR 2%", "Erratum"), "diff_pp"] == pytest.approx(50.0)
    assert at2.loc[("Dense tokens 2%", "Erratum"), "kind"] == "arms"
    assert at2.loc[("SUR 2%", "Re-prefill"), "diff_pp"] == pytest.approx(0.0)
    assert not bool(at2.loc[("SUR 2%", "Re-prefill"), "separates"])
    assert (out.n_cases == 12).all()
    with pytest.raises(ValueError, match="metrics"):
        arm_differences(df, metrics=["agree"], compared=["SUR"])
    with pytest.raises(ValueError, match="strata_col"):
        arm_differences(df, metrics=["em"], compared=["SUR"], strata_col="family")
