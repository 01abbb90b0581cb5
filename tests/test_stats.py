"""Pooled EM (Eq. 9), the dataset-stratified source-paired bootstrap (appendix 8.3), error transitions, agreement."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sur_lab.analysis.stats import _draw_indices, agreement_rate, error_transitions, paired_bootstrap, pooled_em

PLACEMENTS = ("before", "between", "after")


def _panel(n_sources: dict[str, int], seed: int, p_a: float = 0.6, p_b: float = 0.5) -> pd.DataFrame:
    """Synthetic long table: per dataset, sources x 3 placements x methods A and B with correlated outcomes."""
    rng = np.random.default_rng(seed)
    rows = []
    for dataset, n in n_sources.items():
        for s in range(n):
            for placement in PLACEMENTS:
                u = rng.random()
                rows.append((dataset, f"{dataset}-{s:03d}", placement, "A", bool(u < p_a), "x" if u < 0.7 else "y"))
                rows.append((dataset, f"{dataset}-{s:03d}", placement, "B", bool(u < p_b), "x"))
    return pd.DataFrame(rows, columns=["dataset", "source_id", "placement", "method", "correct", "answer"])


def _percentile_linear(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, written out (numpy's default 'linear' method)."""
    v = sorted(values)
    pos = q / 100 * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _brute_force(df: pd.DataFrame, a: str, b: str, n_boot: int, seed: int, ci: float) -> tuple[float, float, list]:
    """Independent loop over rows and replicates, replaying the documented draw order with the same generator."""
    per_source: dict[tuple[str, str], dict[str, list[float]]] = {}
    for row in df.itertuples(index=False):
        if row.method in (a, b):
            per_source.setdefault((row.dataset, row.source_id), {a: [], b: []})[row.method].append(float(row.correct))
    strata = sorted({d for d, _ in per_source})
    sources = {d: sorted(k for k in per_source if k[0] == d) for d in strata}
    rng = np.random.default_rng(seed)
    draws = [rng.integers(0, len(sources[d]), size=(n_boot, len(sources[d]))) for d in strata]
    replicates = []
    for rep in range(n_boot):
        num = den = 0.0
        for d, draw in zip(strata, draws):
            for j in draw[rep]:
                cell = per_source[sources[d][j]]
                num += sum(cell[a]) - sum(cell[b])
                den += len(cell[a])
        replicates.append(num / den)
    alpha = (100 - ci) / 2
    return _percentile_linear(replicates, alpha), _percentile_linear(replicates, 100 - alpha), replicates


# --------------------------------------------------------------------------------------------------------------------
# pooled EM


def test_pooled_em_from_counts_not_rounded_means():
    counts = {"2wiki": (157, 300), "hotpotqa": (142, 300), "iirc": (110, 300), "musique": (102, 300)}
    assert pooled_em(counts) == pytest.approx(100 * 511 / 1200)  # Table 10's 42.58 before rounding
    unequal = {"a": (1, 3), "b": (1, 1)}
    assert pooled_em(unequal) == 50.0  # pooled 2/4, not the macro mean (33.3 + 100) / 2
    assert pooled_em([True, False, True, True]) == 75.0
    assert pooled_em(np.array([1, 0, 0])) == pytest.approx(100 / 3)
    assert pooled_em(pd.Series([True] * 3)) == 100.0


def test_pooled_em_validation():
    with pytest.raises(ValueError, match="correct"):
        pooled_em([])
    with pytest.raises(ValueError, match="correct"):
        pooled_em([0.5, 1])
    with pytest.raises(ValueError, match="correct"):
        pooled_em({"a": (4, 3)})


# --------------------------------------------------------------------------------------------------------------------
# paired bootstrap


def test_bootstrap_matches_brute_force_loop():
    df = _panel({"hotpotqa": 7, "iirc": 5, "musique": 9}, seed=3)
    res = paired_bootstrap(df, metric_col="correct", method_a="A", method_b="B", n_boot=400, seed=11)
    low, high, reps = _brute_force(df, "A", "B", n_boot=400, seed=11, ci=95)
    np.testing.assert_allclose(res.replicates, reps, rtol=0, atol=1e-12)
    assert res.low == pytest.approx(low, abs=1e-12) and res.high == pytest.approx(high, abs=1e-12)
    a = df[df.method == "A"].correct.to_numpy(float)
    b = df[df.method == "B"].correct.to_numpy(float)
    assert res.diff == pytest.approx(a.mean() - b.mean(), abs=1e-15)
    assert res.n_sources == 21


def test_bootstrap_ci_and_defaults():
    df = _panel({"x": 6, "y": 4}, seed=5)
    res90 = paired_bootstrap(df, metric_col="correct", method_a="A", method_b="B", n_boot=300, seed=1, ci=90)
    low, high, _ = _brute_force(df, "A", "B", n_boot=300, seed=1, ci=90)
    assert (res90.low, res90.high) == pytest.approx((low, high), abs=1e-12)
    default = paired_bootstrap(df, metric_col="correct", method_a="A", method_b="B")
    assert default.replicates.shape == (10_000,)
    assert default == paired_bootstrap(df, metric_col="correct", method_a="A", method_b="B")  # seeded: reproducible


def test_bootstrap_keeps_placements_of_a_source_together():
    # Within each source the three placements' A-B differences are +1, -1, 0: they cancel only if all three rows
    # travel together, so every replicate is exactly 0. Resampling rows independently would not give 0.
    rows = []
    for s in range(20):
        for placement, (a, b) in zip(PLACEMENTS, [(1, 0), (0, 1), (1, 1)]):
            rows += [("d", s, placement, "A", a), ("d", s, placement, "B", b)]
    df = pd.DataFrame(rows, columns=["dataset", "source_id", "placement", "method", "correct"])
    res = paired_bootstrap(df, metric_col="correct", method_a="A", method_b="B", n_boot=500)
    assert np.all(res.replicates == 0.0)
    assert (res.diff, res.low, res.high) == (0.0, 0.0, 0.0)


def test_bootstrap_strata_sizes_are_kept():
    # Stratum "hi" has A always right, "lo" has A always wrong; B is always wrong. With strata resampled
    # separately each replicate keeps the 2:1 mix of sources, so the difference is fixed at 2/3.
    rows = []
    for d, n, a in (("hi", 8, 1), ("lo", 4, 0)):
        for s in range(n):
            rows += [(d, s, p, m, a if m == "A" else 0) for p in PLACEMENTS for m in ("A", "B")]
    df = pd.DataFrame(rows, columns=["dataset", "source_id", "placement", "method", "correct"])
    res = paired_bootstrap(df, metric_col="correct", method_a="A", method_b="B", n_boot=200)
    np.testing.assert_allclose(res.replicates, 2 / 3, rtol=0, atol=1e-15)


def test_draw_indices_shapes_and_stream():
    rng = np.random.default_rng(4)
    draws = _draw_indices([3, 5], 10, rng)
    assert [d.shape for d in draws] == [(10, 3), (10, 5)]
    ref = np.random.default_rng(4)
    np.testing.assert_array_equal(draws[0], ref.integers(0, 3, size=(10, 3)))
    np.testing.assert_array_equal(draws[1], ref.integers(0, 5, size=(10, 5)))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n1=st.integers(1, 6), n2=st.integers(1, 6))
def test_bootstrap_swap_antisymmetry(seed, n1, n2):
    df = _panel({"p": n1, "q": n2}, seed=seed)
    ab = paired_bootstrap(df, metric_col="correct", method_a="A", method_b="B", n_boot=64, seed=seed)
    ba = paired_bootstrap(df, metric_col="correct", method_a="B", method_b="A", n_boot=64, seed=seed)
    np.testing.assert_allclose(ab.replicates, -ba.replicates, rtol=0, atol=1e-15)
    assert ab.diff == pytest.approx(-ba.diff, abs=1e-15)
    assert ab.low == pytest.approx(-ba.high, abs=1e-12) and ab.high == pytest.approx(-ba.low, abs=1e-12)
    assert ab.low <= ab.high


def test_bootstrap_at_paper_scale():
    # Appendix 8.3's setting: 4 datasets x 100 sources x 3 placements, 10,000 replicates (no timing asserted).
    df = _panel({d: 100 for d in ("2wiki", "hotpotqa", "iirc", "musique")}, seed=0)
    res = paired_bootstrap(df, metric_col="correct", method_a="A", method_b="B")
    assert res.n_sources == 400 and res.replicates.shape == (10_000,)
    a = df[df.method == "A"].correct.to_numpy(float)
    b = df[df.method == "B"].correct.to_numpy(float)
    assert res.diff == pytest.approx(a.mean() - b.mean(), abs=1e-15)
    assert res.low < res.diff < res.high


def test_bootstrap_validation():
    df = _panel({"d": 3}, seed=0)
    kw = {"metric_col": "correct", "method_a": "A", "method_b": "B"}
    with pytest.raises(ValueError, match="method_a"):
        paired_bootstrap(df, **{**kw, "method_a": "SUR"})
    with pytest.raises(ValueError, match="method_b"):
        paired_bootstrap(df, **{**kw, "method_b": "Shift"})
    with pytest.raises(ValueError, match="method_b"):
        paired_bootstrap(df, **{**kw, "method_b": "A"})
    with pytest.raises(ValueError, match="n_boot"):
        paired_bootstrap(df, **kw, n_boot=0)
    for ci in (0, 100, -5, 150):
        with pytest.raises(ValueError, match="ci"):
            paired_bootstrap(df, **kw, ci=ci)
    with pytest.raises(ValueError, match="metric_col"):
        paired_bootstrap(df, **{**kw, "metric_col": "em"})
    with pytest.raises(ValueError, match="source_col"):
        paired_bootstrap(df, **kw, source_col="question")
    unpaired = df.drop(index=df.index[(df.method == "B") & (df.source_id == "d-001")][:1])
    with pytest.raises(ValueError, match="unpaired"):
        paired_bootstrap(unpaired, **kw)
    missing = df[~((df.method == "B") & (df.source_id == "d-002"))]
    with pytest.raises(ValueError, match="lacks rows"):
        paired_bootstrap(missing, **kw)


# --------------------------------------------------------------------------------------------------------------------
# error transitions and agreement


def _cases(a: list[int], b: list[int], answers_a=None, answers_b=None) -> pd.DataFrame:
    rows = []
    for i, (x, y) in enumerate(zip(a, b)):
        rows.append(("d", i // 3, PLACEMENTS[i % 3], "SUR", bool(x), (answers_a or ["x"] * len(a))[i]))
        rows.append(("d", i // 3, PLACEMENTS[i % 3], "Shift", bool(y), (answers_b or ["x"] * len(a))[i]))
    return pd.DataFrame(rows, columns=["dataset", "source_id", "placement", "method", "correct", "answer"])


def test_error_transitions_counts():
    df = _cases([1, 1, 0, 0, 1, 0], [0, 1, 1, 0, 0, 0])
    assert error_transitions(df, "SUR") == {"repairs": 2, "regressions": 1, "both_correct": 1, "both_wrong": 2, "n": 6}
    swapped = error_transitions(df, "Shift", reference="SUR")
    assert (swapped["repairs"], swapped["regressions"]) == (1, 2)


def test_error_transitions_pairs_by_case_not_row_order():
    df = _cases([1, 0, 0], [0, 0, 1])
    shuffled = df.sample(frac=1.0, random_state=0)
    assert error_transitions(shuffled, "SUR") == error_transitions(df, "SUR")


def test_error_transitions_validation():
    df = _cases([1, 0, 0], [0, 0, 1])
    with pytest.raises(ValueError, match="method"):
        error_transitions(df, "Replay")
    with pytest.raises(ValueError, match="reference"):
        error_transitions(df, "SUR", reference="Re-prefill")
    with pytest.raises(ValueError, match="case_cols"):
        error_transitions(df, "SUR", case_cols=("dataset", "source_id", "slot"))
    with pytest.raises(ValueError, match="several rows"):
        error_transitions(pd.concat([df, df]), "SUR")
    with pytest.raises(ValueError, match="same cases"):
        error_transitions(df.iloc[:-1], "SUR")


def test_agreement_rate():
    df = _cases([0] * 4, [0] * 4, ["The Tower.", "Paris", None, "a"], ["tower", "Rome", None, "b"])
    assert agreement_rate(df, "SUR", "Shift") == 50.0  # "The Tower." ~ "tower"; two missing answers agree
    with pytest.raises(ValueError, match="method_b"):
        agreement_rate(df, "SUR", "Replay")
    with pytest.raises(ValueError, match="answer_col"):
        agreement_rate(df, "SUR", "Shift", answer_col="text")
