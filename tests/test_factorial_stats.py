"""Bootstrap p-values, Holm correction and the evidence-location factorial contrasts (Eq. 10-12, appendix 10.2),
each against a worked example or a brute-force oracle."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sur_lab.analysis.stats import (
    CONTRASTS,
    SIDES,
    TAILS,
    bootstrap_p_value,
    factorial_bootstrap,
    factorial_contrasts,
    holm,
    method_difference,
    paired_bootstrap,
    source_contrasts,
)

CELLS = [(z, t) for z in SIDES for t in TAILS]


# --------------------------------------------------------------------------------------------------------------------
# bootstrap p-value


def _p_brute(values, null=0.0):
    values = [v for v in values if v == v]
    below = sum(1 for v in values if v <= null)
    above = sum(1 for v in values if v >= null)
    return min(1.0, 2 * min(below, above) / len(values))


def test_bootstrap_p_value_hand_cases():
    assert bootstrap_p_value([1.0, 2.0, 3.0, 4.0]) == 0.0  # nothing on the other side: report as p < 2/n
    assert bootstrap_p_value([-1.0, 2.0, 3.0, 4.0]) == 0.5  # 2 * 1/4
    assert bootstrap_p_value([0.0, 0.0, 0.0]) == 1.0  # degenerate at the null
    assert bootstrap_p_value([-2.0, -1.0, 1.0, 2.0]) == 1.0
    assert bootstrap_p_value([0.5, 1.5, 2.5, 3.5], null=1.0) == 0.5
    assert bootstrap_p_value([np.nan, -1.0, 1.0, 2.0, 3.0]) == 0.5  # NaN replicates left out of n
    with pytest.raises(ValueError, match="replicates"):
        bootstrap_p_value([np.nan])
    with pytest.raises(ValueError, match="replicates"):
        bootstrap_p_value([1.0, np.inf])
    with pytest.raises(ValueError, match="null"):
        bootstrap_p_value([1.0], null=np.nan)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-5, 5), min_size=1, max_size=40))
def test_bootstrap_p_value_inverts_the_percentile_interval(values):
    r = np.array(values, dtype=np.float64)
    p = bootstrap_p_value(r)
    assert p == _p_brute(values)
    assert bootstrap_p_value(-r) == p  # two-sided: symmetric under negation
    s = np.sort(r)
    n = s.size
    p_unclipped = 2 * min(np.sum(r <= 0), np.sum(r >= 0)) / n
    assert p == min(1.0, p_unclipped)
    for k in range(1, (n + 1) // 2 + 1):
        excludes = s[k - 1] > 0 or s[n - k] < 0  # interval [r_(k), r_(n+1-k)]
        assert excludes == (2 * k / n > p_unclipped)


def test_bootstrap_result_p_value_property():
    rows = [("d", s, "x", m, v) for s in range(30) for m, v in (("A", 1.0 + (s % 3)), ("B", 0.0))]
    df = pd.DataFrame(rows, columns=["dataset", "source_id", "placement", "method", "score"])
    res = paired_bootstrap(df, metric_col="score", method_a="A", method_b="B", n_boot=200)
    assert res.p_value == _p_brute(res.replicates.tolist()) == 0.0


# --------------------------------------------------------------------------------------------------------------------
# Holm


def test_holm_worked_example():
    # Four hypotheses, alpha = 0.05 (the example of Holm's method on Wikipedia): sorted 0.005, 0.01, 0.03, 0.04 are
    # compared with 0.05/4, 0.05/3, 0.05/2, 0.05/1; the first two are rejected, and the procedure stops at 0.03.
    adj = holm({"H1": 0.01, "H2": 0.04, "H3": 0.03, "H4": 0.005})
    assert adj == pytest.approx({"H1": 0.03, "H2": 0.06, "H3": 0.06, "H4": 0.02}, abs=1e-15)
    assert list(adj) == ["H1", "H2", "H3", "H4"]
    assert {h for h, p in adj.items() if p <= 0.05} == {"H1", "H4"}


def test_holm_named_family_and_validation():
    p = {"NLL side": 0.01, "NLL tail": 0.2, "EM side": 0.001, "EM tail": 0.9}
    adj = holm(p, family=["EM tail", "NLL tail", "EM side"])
    assert list(adj) == ["EM tail", "NLL tail", "EM side"]
    assert adj == pytest.approx({"EM side": 0.003, "NLL tail": 0.4, "EM tail": 0.9})
    assert holm({"only": 0.3}) == {"only": 0.3}
    assert holm({"a": 0.6, "b": 0.7}) == {"a": 1.0, "b": 1.0}  # clipped at 1
    with pytest.raises(ValueError, match="family"):
        holm(p, family=[])
    with pytest.raises(ValueError, match="family"):
        holm(p, family=["EM side", "EM side"])
    with pytest.raises(ValueError, match="family"):
        holm(p, family=["EM interaction"])
    with pytest.raises(ValueError, match="pvalues"):
        holm({"a": 1.5})
    with pytest.raises(ValueError, match="pvalues"):
        holm({"a": float("nan")})


def _holm_rejects(pvalues: list[float], alpha: float) -> set[int]:
    """Holm's step-down procedure, written out: reject in ascending order while p_(i) <= alpha / (m - i + 1)."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    rejected = set()
    for rank, i in enumerate(order):
        if pvalues[i] > alpha / (m - rank):
            break
        rejected.add(i)
    return rejected


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=8), st.floats(0.001, 0.5))
def test_holm_adjusted_values_reproduce_the_step_down_procedure(pvalues, alpha):
    names = [f"h{i}" for i in range(len(pvalues))]
    adj = holm(dict(zip(names, pvalues)))
    assert {i for i, n in enumerate(names) if adj[n] <= alpha} == _holm_rejects(pvalues, alpha)
    for n, raw in zip(names, pvalues):
        assert raw <= adj[n] <= 1.0


# --------------------------------------------------------------------------------------------------------------------
# factorial contrasts


def _table(units: dict[tuple[str, str, str], dict[tuple[str, str], float]]) -> pd.DataFrame:
    rows = [(m, d, s, z, t, v) for (m, d, s), cells in units.items() for (z, t), v in cells.items()]
    return pd.DataFrame(rows, columns=["model", "dataset", "source_id", "side", "tail", "g"])


def _brute_contrasts(units) -> dict[str, float]:
    """Loops: per-unit contrast, mean over sources of a (model, dataset), over datasets, over models."""
    out = {}
    for name, weights in CONTRASTS.items():
        per_md: dict[tuple[str, str], list[float]] = {}
        for (m, d, s), cells in units.items():
            per_md.setdefault((m, d), []).append(sum(w * cells[c] for c, w in weights.items()))
        per_m: dict[str, list[float]] = {}
        for (m, d), vals in per_md.items():
            per_m.setdefault(m, []).append(sum(vals) / len(vals))
        out[name] = sum(sum(v) / len(v) for v in per_m.values()) / len(per_m)
    return out


def _random_units(seed: int, models=("m1", "m2"), sizes=None, p_missing=0.0):
    rng = np.random.default_rng(seed)
    sizes = sizes or {"2wiki": 3, "hotpot": 5, "iirc": 1}
    units = {}
    for d, n in sizes.items():
        for s in range(n):
            for i, m in enumerate(models):
                if i > 0 and rng.random() < p_missing:
                    continue  # this model lacks the source (e.g. outside its EM stratum)
                units[(m, d, f"{d}-{s}")] = {c: float(rng.normal()) for c in CELLS}
    return units


def test_contrasts_recover_known_effects():
    # G = base_unit + a [downstream] + b [long] + c [downstream and long]: every unit's side contrast is a + c/2,
    # tail b + c/2, interaction c, whatever the unit's base level.
    a, b, c = 0.7, -0.3, 0.4
    units = {}
    for k, (m, d) in enumerate(itertools.product(("m1", "m2", "m3"), ("x", "y"))):
        for s in range(2 + k):
            base = 10.0 * k + s
            units[(m, d, f"s{s}")] = {
                (z, t): base + a * (z == "downstream") + b * (t == "long") + c * (z == "downstream" and t == "long")
                for z, t in CELLS
            }
    est = factorial_contrasts(_table(units), "g")
    assert est == pytest.approx({"side": a + c / 2, "tail": b + c / 2, "interaction": c}, abs=1e-12)


def test_contrasts_weight_datasets_and_models_equally():
    units = {("m", "x", "s0"): {c: (1.0 if c[0] == "downstream" else 0.0) for c in CELLS}}  # side 1
    units.update({("m", "y", f"s{i}"): {c: 0.0 for c in CELLS} for i in range(3)})  # side 0
    assert factorial_contrasts(_table(units), "g")["side"] == pytest.approx(0.5)  # not the pooled 1/4
    units.update({("n", "x", "s0"): {c: (4.0 if c[0] == "downstream" else 0.0) for c in CELLS}})
    # model m: 0.5; model n (one dataset): 4.0 -> (0.5 + 4) / 2
    assert factorial_contrasts(_table(units), "g")["side"] == pytest.approx(2.25)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.0, 0.6))
def test_contrasts_match_brute_force(seed, p_missing):
    units = _random_units(seed, models=("m1", "m2", "m3"), p_missing=p_missing)
    df = _table(units).sample(frac=1.0, random_state=seed)  # row order must not matter
    assert factorial_contrasts(df, "g") == pytest.approx(_brute_contrasts(units), abs=1e-12)


def test_source_contrasts_per_unit():
    units = _random_units(1)
    sc = source_contrasts(_table(units), "g")
    key = ("m1", "hotpot", "hotpot-2")
    g = units[key]
    assert sc.loc[key, "side"] == pytest.approx(0.5 * ((g["downstream", "short"] - g["upstream", "short"])
                                                       + (g["downstream", "long"] - g["upstream", "long"])))
    assert sc.loc[key, "tail"] == pytest.approx(0.5 * ((g["upstream", "long"] - g["upstream", "short"])
                                                       + (g["downstream", "long"] - g["downstream", "short"])))
    assert sc.loc[key, "interaction"] == pytest.approx((g["downstream", "long"] - g["upstream", "long"])
                                                       - (g["downstream", "short"] - g["upstream", "short"]))


def test_contrast_validation():
    df = _table(_random_units(2))
    with pytest.raises(ValueError, match="lacks a cell"):
        factorial_contrasts(df.iloc[1:], "g")
    with pytest.raises(ValueError, match="several rows"):
        factorial_contrasts(pd.concat([df, df.iloc[:1]]), "g")
    with pytest.raises(ValueError, match="side values"):
        factorial_contrasts(df.assign(side=df.side.replace("upstream", "up")), "g")
    with pytest.raises(ValueError, match="value_col"):
        factorial_contrasts(df, "nll")
    with pytest.raises(ValueError, match="NaN"):
        factorial_contrasts(df.assign(g=np.where(df.index == 3, np.nan, df.g)), "g")


def test_method_difference_is_the_cell_advantage():
    rows = []
    for s, (z, t) in itertools.product(range(2), CELLS):
        rows += [("m", "d", s, z, t, "Shift", 2.0 + s), ("m", "d", s, z, t, "Replay", 0.5)]
    df = pd.DataFrame(rows, columns=["model", "dataset", "source_id", "side", "tail", "method", "nll"])
    g = method_difference(df.sample(frac=1, random_state=0), "nll", "Shift", "Replay")
    assert len(g) == 8 and set(g.columns) == {"model", "dataset", "source_id", "side", "tail", "nll"}
    assert np.allclose(g.sort_values("source_id")["nll"], [1.5] * 4 + [2.5] * 4)
    with pytest.raises(ValueError, match="method_b"):
        method_difference(df, "nll", "Shift", "Shift")


# --------------------------------------------------------------------------------------------------------------------
# source bootstrap


def _brute_bootstrap(units, n_boot: int, seed: int) -> dict[str, np.ndarray]:
    """Replays the documented draws (datasets sorted, sources sorted, one integers() block per dataset) in loops."""
    datasets = sorted({d for _, d, _ in units})
    sources = {d: sorted({s for _, dd, s in units if dd == d}) for d in datasets}
    models = sorted({m for m, _, _ in units})
    rng = np.random.default_rng(seed)
    draws = {d: rng.integers(0, len(sources[d]), size=(n_boot, len(sources[d]))) for d in datasets}
    out = {name: np.empty(n_boot) for name in CONTRASTS}
    for name, weights in CONTRASTS.items():
        for b in range(n_boot):
            per_model = []
            for m in models:
                per_dataset = []
                for d in datasets:
                    vals = [sum(w * units[(m, d, sources[d][j])][c] for c, w in weights.items())
                            for j in draws[d][b] if (m, d, sources[d][j]) in units]
                    if vals:
                        per_dataset.append(sum(vals) / len(vals))
                if per_dataset:
                    per_model.append(sum(per_dataset) / len(per_dataset))
            out[name][b] = sum(per_model) / len(per_model) if per_model else np.nan
    return out


@pytest.mark.parametrize("p_missing", [0.0, 0.5])
def test_bootstrap_replicates_match_brute_force(p_missing):
    units = _random_units(7, models=("m1", "m2"), sizes={"a": 4, "b": 6, "c": 2}, p_missing=p_missing)
    res = factorial_bootstrap(_table(units), "g", n_boot=150, seed=3)
    brute = _brute_bootstrap(units, 150, 3)
    est = _brute_contrasts(units)
    for name in CONTRASTS:
        np.testing.assert_allclose(res[name].replicates, brute[name], rtol=0, atol=1e-12)
        assert res[name].diff == pytest.approx(est[name], abs=1e-12)
        finite = brute[name][~np.isnan(brute[name])]
        assert (res[name].low, res[name].high) == pytest.approx(tuple(np.percentile(finite, [2.5, 97.5])), abs=1e-12)
        assert res[name].p_value == _p_brute(brute[name].tolist())
        assert res[name].n_sources == 12


def test_bootstrap_keeps_the_cells_of_a_source_together():
    # Cell levels vary wildly between sources, but within each source downstream = upstream + 1: the side contrast is
    # 1 for every source, so every replicate is exactly 1 when a source's four cells travel together. Resampling
    # cells independently (a downstream cell of one source against an upstream cell of another) would spread it.
    rng = np.random.default_rng(0)
    units = {}
    for d, n in (("a", 9), ("b", 5)):
        for s in range(n):
            x, y = rng.normal(0, 50, size=2)
            units[("m", d, str(s))] = {("upstream", "short"): x, ("downstream", "short"): x + 1,
                                       ("upstream", "long"): y, ("downstream", "long"): y + 1}
    res = factorial_bootstrap(_table(units), "g", n_boot=300, seed=1)
    np.testing.assert_allclose(res["side"].replicates, 1.0, rtol=0, atol=1e-12)
    assert res["side"].p_value == 0.0
    assert res["tail"].replicates.std() > 1.0  # the tail contrast does vary between sources


def test_bootstrap_keeps_the_model_rows_of_a_source_together():
    # Model m1's side contrast is a_s, model m2's 2 - a_s: their mean is 1 for every source, so each replicate is
    # exactly 1 when a drawn source brings both model rows; independent draws per model would spread it.
    rng = np.random.default_rng(1)
    units = {}
    for s in range(12):
        a = rng.normal(0, 10)
        for m, side in (("m1", a), ("m2", 2 - a)):
            units[(m, "d", str(s))] = {("upstream", "short"): 0.0, ("downstream", "short"): side,
                                       ("upstream", "long"): 0.0, ("downstream", "long"): side}
    res = factorial_bootstrap(_table(units), "g", n_boot=300, seed=2)
    np.testing.assert_allclose(res["side"].replicates, 1.0, rtol=0, atol=1e-12)


def test_bootstrap_validation_and_seed():
    df = _table(_random_units(3))
    with pytest.raises(ValueError, match="n_boot"):
        factorial_bootstrap(df, "g", n_boot=0)
    with pytest.raises(ValueError, match="ci"):
        factorial_bootstrap(df, "g", ci=100)
    a = factorial_bootstrap(df, "g", n_boot=50, seed=9)
    b = factorial_bootstrap(df.sample(frac=1.0, random_state=4), "g", n_boot=50, seed=9)
    for name in CONTRASTS:
        np.testing.assert_array_equal(a[name].replicates, b[name].replicates)  # row order does not matter
