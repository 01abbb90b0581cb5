"""Inputs of the generated conclusions (:mod:`sur_lab.analysis.conclusions`): arm labels and the aligned paired
outcomes of declared comparisons (the words are :mod:`sur_lab.analysis.decisions`', tested in test_decisions.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sur_lab.analysis.conclusions import arm_labels, paired_outcomes


def _records(n_cases: int = 6) -> pd.DataFrame:
    rows = []
    for i in range(n_cases):
        for b in (2.0, 5.0):
            rows += [{"case_id": f"c{i}", "source": f"s{i // 2}", "method": "SUR", "budget_pct": b, "em": 1.0},
                     {"case_id": f"c{i}", "source": f"s{i // 2}", "method": "Dense tokens", "budget_pct": b,
                      "em": float(i % 2)}]
        rows.append({"case_id": f"c{i}", "source": f"s{i // 2}", "method": "Erratum", "budget_pct": np.nan,
                     "em": np.nan if i == 0 else 0.0})
    return pd.DataFrame(rows)


def test_arm_labels():
    df = _records(1)
    assert arm_labels(df).tolist() == ["SUR 2%", "Dense tokens 2%", "SUR 5%", "Dense tokens 5%", "Erratum"]


def test_paired_outcomes_align_cases_and_clusters():
    df = _records().assign(arm=lambda d: arm_labels(d))
    pairs = [("SUR 5%", "Dense tokens 5%"), ("Erratum", "SUR 2%"), ("Absent 5%", "SUR 5%")]
    outcomes, clusters = paired_outcomes(df.sample(frac=1, random_state=0), pairs, "em", cluster_col="source")
    assert list(outcomes) == pairs[:2]  # an arm that did not run is skipped
    a, b = outcomes[("SUR 5%", "Dense tokens 5%")]
    np.testing.assert_array_equal(a, np.ones(6))
    np.testing.assert_array_equal(b, [0, 1, 0, 1, 0, 1])  # sorted by case, whatever the row order
    a, _ = outcomes[("Erratum", "SUR 2%")]
    assert np.isnan(a[0]) and (a[1:] == 0).all()  # NaN kept: the decision layer leaves the unit out
    assert clusters[("SUR 5%", "Dense tokens 5%")].tolist() == ["s0", "s0", "s1", "s1", "s2", "s2"]


def test_paired_outcomes_refuses_unpaired_or_repeated_cases():
    df = _records().assign(arm=lambda d: arm_labels(d))
    with pytest.raises(ValueError, match="metric='agree'"):
        paired_outcomes(df, [("SUR 5%", "Dense tokens 5%")], "agree")
    unpaired = df[~((df.arm == "Dense tokens 5%") & (df.case_id == "c3"))]
    with pytest.raises(ValueError, match="case_id 'c3' of arm 'SUR 5%' lacks rows for arm 'Dense tokens 5%'"):
        paired_outcomes(unpaired, [("SUR 5%", "Dense tokens 5%")], "em")
    with pytest.raises(ValueError, match="several rows"):
        paired_outcomes(pd.concat([df, df.iloc[:1]]), [("SUR 2%", "Dense tokens 2%")], "em")
