"""The decision layer (:mod:`sur_lab.analysis.decisions`, issue 36), tested in the hard direction: multiplicity, ties,
discordant pairs, boundary outcomes, tiny samples, NaN, planted effects against wide intervals, and the null
calibration of whole families."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy.stats import binomtest

from sur_lab.analysis import decisions as d
from sur_lab.analysis.stats import holm


def _pairs(n: int, n10: int, n01: int, n11: int | None = None):
    """Paired 0/1 outcomes over ``n`` units with ``n10`` (a right, b wrong) and ``n01`` discordant pairs."""
    n11 = (n - n10 - n01) // 2 if n11 is None else n11
    a = np.r_[np.ones(n10), np.zeros(n01), np.ones(n11), np.zeros(n - n10 - n01 - n11)]
    b = np.r_[np.zeros(n10), np.ones(n01), np.ones(n11), np.zeros(n - n10 - n01 - n11)]
    return a, b


def test_wilson_and_sign_test_match_scipy():
    for k, n in [(0, 1), (0, 12), (3, 7), (12, 12), (40, 48)]:
        ci = binomtest(k, n).proportion_ci(method="wilson")
        low, high = d.wilson_interval(k, n)
        assert (float(low), float(high)) == pytest.approx((ci.low, ci.high), abs=1e-12)
    for kp, km in [(7, 0), (0, 7), (4, 0), (5, 0), (3, 9), (10, 10), (1, 30)]:
        assert float(d.sign_test_p(kp, km)) == pytest.approx(binomtest(kp, kp + km).pvalue, abs=1e-12)
    assert float(d.sign_test_p(0, 0)) == 1.0
    assert float(d.sign_test_p(7, 0)) == pytest.approx(2 * 0.5**7)  # 0.0156


def test_newcombe_interval_by_hand_and_at_the_boundary():
    # Newcombe (1998) method 10 written out for one table (n11, n10, n01, n00) = (1, 1, 7, 12): phi's correction
    # case A = 1*12 - 1*7 = 5 > n/2 = 10.5 is false, so phi = 0 and the interval is the plain square-and-add one.
    n, p1, p2 = 21, 2 / 21, 8 / 21
    l1, u1 = (float(x) for x in d.wilson_interval(2, 21))
    l2, u2 = (float(x) for x in d.wilson_interval(8, 21))
    low, high = d.newcombe_interval(1, 1, 7, 12)
    assert float(low) == pytest.approx(p1 - p2 - math.hypot(p1 - l1, u2 - p2), abs=1e-12)
    assert float(high) == pytest.approx(p1 - p2 + math.hypot(p2 - l2, u1 - p1), abs=1e-12)
    # A positive correlation narrows it: (59, 6, 16, 80) has A = 59*80 - 6*16 > n/2.
    low_c, high_c = (float(x) for x in d.newcombe_interval(59, 6, 16, 80))
    w1, w2 = d.wilson_interval(65, 161), d.wilson_interval(75, 161)
    plain = (65 - 75) / 161 - math.hypot(65 / 161 - float(w1[0]), float(w2[1]) - 75 / 161)
    assert plain < low_c < (65 - 75) / 161 < high_c < 0
    # Every outcome 1 (or 0), n = 2: the interval keeps a nonzero width (a bootstrap would give [0, 0]).
    for table in [(2, 0, 0, 0), (0, 0, 0, 2)]:
        low, high = (float(x) for x in d.newcombe_interval(*table))
        assert low < -0.5 and high > 0.5 and low == pytest.approx(-high)


def test_newcombe_interval_covers():
    rng = np.random.default_rng(0)
    n, p_a, p_b, hits, trials = 30, 0.7, 0.5, 0, 2000
    for _ in range(trials):
        q = rng.random(n)
        a, b = (q < p_a).astype(int), (rng.random(n) < p_b).astype(int)
        n10, n01, n11 = int(np.sum(a > b)), int(np.sum(a < b)), int(np.sum(a & b))
        low, high = d.newcombe_interval(n11, n10, n01, n - n10 - n01 - n11)
        hits += low <= p_a - p_b <= high
    assert hits / trials >= 0.93  # nominal 95 %


@pytest.mark.parametrize("discordant", [4, 5])
def test_few_discordant_pairs_out_of_48_do_not_separate(discordant):
    a, b = _pairs(48, discordant, 0)
    row = d.paired_family({("SUR 5%", "Shift"): (a, b)}, kind="binary", adjust="none").iloc[0]
    assert row.verdict == d.NOT_SEPARATED
    assert row.n == 48 and row.n_discordant == discordant
    assert row.p == pytest.approx(2 * 0.5**discordant)  # 0.125, 0.0625: the exact sign test
    assert row.ci_high - row.ci_low > 0
    assert "not separated at this size" in d.sentence(row)
    assert "the smallest difference this size could separate is 12.5 pp" in d.sentence(row)  # 6 of 48


def test_seven_of_seven_beats_alone_and_not_in_a_large_family():
    a, b = _pairs(7, 7, 0)
    row = d.paired_family({("SUR 5%", "Shift"): (a, b)}, kind="binary", adjust="none").iloc[0]
    assert row.verdict == d.BEATS and row.p == pytest.approx(0.015625) and row.ci_low > 0
    assert d.sentence(row).startswith("SUR 5% beats Shift: +100.0 pp (95 % CI +")
    assert "tested alone, p 0.016" in d.sentence(row)
    # The same comparison among 21 null ones: Holm multiplies the smallest p by 22.
    rng = np.random.default_rng(1)
    family = {("SUR 5%", "Shift"): (a, b)}
    family |= {(f"x{i}", f"y{i}"): ((rng.random(7) < .5).astype(float), (rng.random(7) < .5).astype(float))
               for i in range(21)}
    out = d.paired_family(family, kind="binary")
    first = out.iloc[0]
    assert first.family_size == 22 and first.p_adj == pytest.approx(min(1.0, 22 * 0.015625))
    assert first.verdict == d.NOT_SEPARATED
    expected = holm({str(i): p for i, p in enumerate(out.p)})
    assert out.p_adj.tolist() == pytest.approx([expected[str(i)] for i in range(22)])
    assert "Holm over 22 comparisons" in d.sentence(first)


def test_binary_differences_alone_give_the_hull_over_the_concordant_split():
    a, b = _pairs(48, 7, 1, n11=30)
    both = d.paired_family({("a", "b"): (a, b)}, kind="binary").iloc[0]
    diffs = d.paired_family({("a", "b"): a - b}, kind="binary").iloc[0]
    assert (diffs.estimate, diffs.p, diffs.n_discordant) == (both.estimate, both.p, both.n_discordant)
    assert diffs.ci_low <= both.ci_low and diffs.ci_high >= both.ci_high  # conservative: the split is unknown
    hull = [d.newcombe_interval(k, 7, 1, 40 - k) for k in range(41)]
    assert diffs.ci_low == pytest.approx(min(float(x[0]) for x in hull))
    zero = d.paired_family({("a", "b"): np.zeros(2)}, kind="binary").iloc[0]
    assert zero.ci_low < 0 < zero.ci_high  # never zero-width


def test_all_equal_outcomes_on_two_units_have_a_nonzero_interval():
    for value in (0.0, 1.0):
        row = d.paired_family({("a", "b"): (np.full(2, value), np.full(2, value))}, kind="binary").iloc[0]
        assert row.ci_low < 0 < row.ci_high and row.verdict == d.NOT_SEPARATED
        assert "2 cases are too few for any difference to separate" in d.sentence(row)


def test_sentence_names_the_family_and_its_size():
    fam = d.Family("SUR against the other allocators", "binary", "SUR minus each rival at the same budget")
    a, b = _pairs(48, 12, 0)
    family = {("SUR 5%", "Dense tokens 5%"): (a, b), ("SUR 5%", "BM25 5%"): _pairs(48, 1, 1)}
    out = d.paired_family(family, family=fam)
    text = d.sentence(out.iloc[0])
    assert re.fullmatch(r"SUR 5% beats Dense tokens 5%: \+25\.0 pp \(95 % CI \+\d+\.\d to \+\d+\.\d; 48 cases, 12 "
                        r"discordant; Holm over 2 comparisons of SUR against the other allocators, "
                        r"p_adj (< )?[\d.e-]+\)", text), text
    assert d.family_summary(out) == ("SUR against the other allocators (Holm over 2 comparisons): 1 beats, "
                                     "1 not separated")


def test_lower_is_better_flips_the_words():
    a, b = _pairs(40, 0, 12)  # a's stale rate is lower on 12 discordant cases
    row = d.paired_family({("SUR 5%", "Shift"): (a, b)}, kind="binary", higher_is_better=False).iloc[0]
    assert row.estimate < 0 and row.verdict == d.BEATS
    assert d.sentence(row).startswith("SUR 5% beats Shift: -30.0 pp")


def test_clusters_are_resampled_and_flipped_whole():
    # Three sources of ten placements each, every placement one way: 30 discordant units, but 3 clusters.
    a, b = np.ones(30), np.zeros(30)
    cluster = np.repeat(["s1", "s2", "s3"], 10)
    plain = d.paired_family({("a", "b"): (a, b)}, kind="binary").iloc[0]
    clustered = d.paired_family({("a", "b"): (a, b)}, kind="binary", cluster=cluster).iloc[0]
    assert plain.verdict == d.BEATS
    assert clustered.n_clusters == 3 and clustered.p == pytest.approx(0.25) and clustered.verdict == d.NOT_SEPARATED
    assert "30 cases in 3 clusters" in d.sentence(clustered)
    # A clustered interval is never narrower than Newcombe's on the units.
    rng = np.random.default_rng(3)
    a, b = (rng.random(60) < 0.6).astype(float), (rng.random(60) < 0.4).astype(float)
    cl = np.repeat(np.arange(20), 3)
    p = d.paired_family({("a", "b"): (a, b)}, kind="binary").iloc[0]
    c = d.paired_family({("a", "b"): (a, b)}, kind="binary", cluster=cl).iloc[0]
    assert c.ci_low <= p.ci_low and c.ci_high >= p.ci_high
    with pytest.raises(ValueError, match="cluster: 5 ids for the 60 units"):
        d.paired_family({("a", "b"): (a, b)}, kind="binary", cluster=np.arange(5))


def test_continuous_small_samples_and_degenerate_differences():
    five = d.paired_family({("a", "b"): np.array([0.3, 0.5, 0.2, 0.9, 0.4])}, kind="continuous").iloc[0]
    # The percentile bootstrap excludes 0 (every replicate is positive), but no exact test on 5 units reaches 5 %.
    assert five.ci_low > 0 and five.p == pytest.approx(0.0625) and five.verdict == d.NOT_SEPARATED
    six = d.paired_family({("a", "b"): np.array([0.3, 0.5, 0.2, 0.9, 0.4, 0.6])}, kind="continuous").iloc[0]
    assert six.p == pytest.approx(2 / 64) and six.verdict == d.BEATS
    same = d.paired_family({("a", "b"): np.full(10, 0.25)}, kind="continuous").iloc[0]
    assert math.isnan(same.ci_low) and same.verdict == d.BEATS  # the exact test alone: p = 2 / 1024
    assert "no interval: every one of the 10 cases has the same difference" in d.sentence(same)
    zero = d.paired_family({("a", "b"): np.zeros(10)}, kind="continuous").iloc[0]
    assert zero.p == 1.0 and zero.verdict == d.NOT_SEPARATED


def test_equivalence_needs_a_declared_margin_and_the_tost_interval():
    rng = np.random.default_rng(4)
    tiny = rng.normal(0.0, 0.05, 200)
    without = d.paired_family({("a", "b"): tiny}, kind="continuous").iloc[0]
    assert without.verdict == d.NOT_SEPARATED  # never "equivalent", "tied" or "no loss" without a margin
    margin = d.Margin(0.1, "the paper's interval half-width")
    within = d.paired_family({("a", "b"): tiny}, kind="continuous", margin=margin).iloc[0]
    assert within.verdict == d.EQUIVALENT and -0.1 < within.tost_low < within.tost_high < 0.1
    text = d.sentence(within, unit="nats")
    assert text.startswith("a and b are equivalent within ±0.100 nats") and "the paper's interval" in text
    wide = d.paired_family({("a", "b"): rng.normal(0.0, 1.0, 20)}, kind="continuous", margin=margin).iloc[0]
    assert wide.verdict == d.NOT_SEPARATED and "equivalence margin" in d.sentence(wide, unit="nats")
    # Binary equivalence on the 1 - 2 alpha Newcombe interval.
    a, b = _pairs(400, 3, 2)
    eq = d.paired_family({("a", "b"): (a, b)}, kind="binary", margin=d.Margin(0.05, "5 points")).iloc[0]
    assert eq.verdict == d.EQUIVALENT
    with pytest.raises(ValueError, match="margin"):
        d.paired_family({("a", "b"): np.ones(3)}, kind="ratio", margin=0.1)


def test_ratios_are_decided_on_their_interval():
    assert d.ratio_verdict(1.01, 0.80, 1.30) == d.NOT_SEPARATED  # not "faster"
    assert d.ratio_verdict(1.4, 1.1, 1.8) == d.BEATS
    assert d.ratio_verdict(0.7, 0.5, 0.9) == d.LOSES
    rng = np.random.default_rng(5)
    times_a, times_b = rng.uniform(1, 2, 40), rng.uniform(1, 2, 40)
    row = d.paired_family({("sync 5%", "prefix reuse"): (times_a, times_b)}, kind="ratio").iloc[0]
    assert row.estimate == pytest.approx(math.exp(np.mean(np.log(times_b / times_a))))
    assert row.verdict == d.NOT_SEPARATED and "(not shown faster)" in d.sentence(row, what="turns")
    fast = d.paired_family({("sync 5%", "prefix reuse"): (times_a, 2 * times_a)}, kind="ratio").iloc[0]
    assert fast.verdict == d.BEATS and d.sentence(fast).startswith("sync 5% is faster than prefix reuse: 2.00x")


def test_proportion_claims_need_their_bound():
    assert d.proportion_interval(0, 2)[2] == pytest.approx(1 - 0.025**0.5)  # 84 pp
    assert d.bound_claim(2, 2, at_least=0.95) == d.NOT_SHOWN  # "preserves 100 %" on 2 requests
    assert d.bound_claim(0, 12, at_most=0.05) == d.NOT_SHOWN
    text = d.bound_sentence("loses agreement on", 0, 12, at_most=0.05, units="turns")
    assert "at most 5 % not shown at this size (upper bound 26 %)" in text
    assert d.bound_claim(300, 300, at_least=0.95) == d.HOLDS
    assert d.bound_claim(10, 100, at_least=0.95) == d.FAILS
    assert d.bound_claim(0, 200, at_most=0.05) == d.HOLDS
    assert d.bound_claim(2, 2, at_least=0.95, decide=False) == d.NOT_DECIDED
    with pytest.raises(ValueError, match="exactly one"):
        d.bound_claim(1, 2)


def test_plumbing_size_is_not_decided():
    assert not d.decides("smoke") and d.decides("default") and d.decides(None)
    a, b = _pairs(3, 3, 0)
    row = d.paired_family({("SUR 5%", "Shift"): (a, b)}, kind="binary", decide=d.decides("smoke")).iloc[0]
    assert row.verdict == d.NOT_DECIDED
    assert d.sentence(row).startswith("SUR 5% vs Shift: not decided at this size (a plumbing check), +100.0 pp")


def test_nan_units_are_dropped_and_an_empty_comparison_is_na():
    a = np.array([1, 0, np.nan, 1.0])
    b = np.array([0, 0, 1, np.nan])
    out = d.paired_family({("SUR 5%", "Shift"): (a, b), ("SUR 2%", "Shift"): (np.full(4, np.nan), b)},
                          kind="binary", higher_is_better=False)
    assert out.n.tolist() == [2, 0] and out.verdict.tolist() == [d.NOT_SEPARATED, d.NA]
    assert out.family_size.tolist() == [2, 2]  # the empty comparison stays in the family (p = 1)
    assert d.sentence(out.iloc[1], na="no stale-eligible case") == "SUR 2% vs Shift: n/a (no stale-eligible case)"


def test_ties_are_ties_and_the_best_names_its_selection():
    all_right = np.ones(12)
    text = d.best_of({"Erratum": all_right, "SUR 2%": all_right, "SUR-IDF 2%": all_right,
                      "Edit-local window 2%": np.r_[np.ones(9), np.zeros(3)]}, kind="binary")
    assert text.startswith("Erratum, SUR 2% and SUR-IDF 2% tie at 100 % (the highest of 4 arms)")
    rng = np.random.default_rng(6)
    arms = {f"config {i}": (rng.random(30) < 0.5 + 0.01 * i).astype(float) for i in range(20)}
    text = d.best_of(arms, kind="binary", what="configurations")
    assert re.match(r"config \d+ has the highest point estimate of 20 configurations \(\d+ %\); not separated from "
                    r"the next \d+", text), text
    assert d.best_of({"a": [np.nan], "b": [np.nan]}, kind="binary") == "n/a (no arm has a value)"
    assert d.best_of({"a": np.ones(4), "b": np.zeros(4)}, kind="binary", decide=False).endswith(
        "not decided at this size (a plumbing check)")


def test_declarations_are_checked():
    with pytest.raises(ValueError, match="kind"):
        d.Family("x", "binomial", "rule")
    with pytest.raises(ValueError, match="max_size"):
        d.Family("x", "binary", "rule", primary=True, max_size=2)
    with pytest.raises(ValueError, match="source"):
        d.Margin(0.1, "")
    primary = d.Family("primary", "binary", "SUR 5% minus Shift", primary=True)
    a, b = _pairs(10, 2, 0)
    with pytest.raises(ValueError, match="adjust='none' tests one comparison"):
        d.paired_family({("a", "b"): (a, b), ("a", "c"): (a, b)}, family=primary)
    small = d.Family("small", "binary", "two at most", max_size=2)
    with pytest.raises(ValueError, match="declares at most 2"):
        d.paired_family({(str(i), "b"): (a, b) for i in range(3)}, family=small)
    with pytest.raises(ValueError, match="-1, 0 or 1"):
        d.paired_family({("a", "b"): 2 * (a - b)}, kind="binary")
    with pytest.raises(ValueError, match="0/1"):
        d.paired_family({("a", "b"): (a * 2, b)}, kind="binary")
    with pytest.raises(ValueError, match="diffs is empty"):
        d.paired_family({}, kind="binary")
    with pytest.raises(ValueError, match="kind='binary' contradicts"):
        d.paired_family({("a", "b"): a}, kind="binary", family=d.Family("c", "continuous", "rule"))


def test_power_a_planted_30_point_effect_over_96_cases():
    primary = [("SUR 5%", "Shift")]
    counts = d.simulate_families(primary, n_units=96, n_families=50, effect={"SUR 5%": 0.30}, seed=11)
    assert (counts >= 1).mean() >= 0.90


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(d.CALIBRATION_SHAPES))
def test_null_calibration_of_whole_families(shape):
    """200 families simulated under the null, shaped like notebook 09's old 38-comparison table and notebook 02's
    22 comparisons: at most 7.5 % print any "beats" or "loses to" (Holm's family-wise 5 % plus simulation slack;
    ``scripts/decision_calibration.py`` draws the same families for the documentation's figure)."""
    counts = d.simulate_families(d.CALIBRATION_SHAPES[shape], n_units=48, n_families=200, seed=20260928)
    assert (counts > 0).mean() <= 0.075


@pytest.mark.slow
def test_null_calibration_of_a_continuous_family():
    counts = d.simulate_families(d.CALIBRATION_SHAPES["02 SUR vs 11 rivals (22)"][:8], kind="continuous",
                                 n_units=48, n_families=200, n_boot=500, seed=20260928)
    assert (counts > 0).mean() <= 0.075


OLD_HELPERS = re.compile(r"\b(verdict|separates|difference_sentence|against_rivals|arm_differences|bootstrap_ci)\(|"
                         r"\bMIN_PAIRED_UNITS\b")


def test_no_study_uses_the_old_verdict_helpers():
    """Every verdict a study, notebook or benchmark prints goes through :mod:`sur_lab.analysis.decisions` (issue 36)."""
    root = Path(__file__).resolve().parents[1]
    files = [*sorted((root / "sur_lab").rglob("*.py")), *sorted((root / "notebooks").glob("*.ipynb")),
             *sorted((root / "scripts").glob("*.py"))]
    found = [f"{p.relative_to(root)}: {m.group(0)}" for p in files for m in OLD_HELPERS.finditer(p.read_text())]
    assert not found, found


def test_a_claim_is_judged_by_its_comparisons_verdict():
    assert [d.claim_verdict(v, "greater") for v in (d.BEATS, d.LOSES, d.NOT_SEPARATED, d.EQUIVALENT)] == [
        "holds", "does not hold", "undecided at this size", "undecided at this size"]
    assert [d.claim_verdict(v, "less") for v in (d.LOSES, d.BEATS, d.NOT_DECIDED)] == [
        "holds", "does not hold", "undecided at this size"]
    assert [d.claim_verdict(v, "equivalent") for v in (d.EQUIVALENT, d.BEATS, d.LOSES, d.NA)] == [
        "holds", "does not hold", "does not hold", "undecided at this size"]
    with pytest.raises(ValueError, match="expect must be one of"):
        d.claim_verdict(d.BEATS, "more")


@pytest.mark.parametrize("alpha_first", [0.05, 0.025, 0.01, 0.05 / 22, 2 ** -6, 0.3])
def test_the_fewest_separating_units_is_the_smallest_k_whose_floor_is_below_alpha(alpha_first):
    k = d.min_separating_units(alpha_first)
    assert d.p_floor(k) < alpha_first <= d.p_floor(k - 1)
    assert binomtest(k, k, 0.5).pvalue < alpha_first <= binomtest(k - 1, k - 1, 0.5).pvalue
    with pytest.raises(ValueError, match="alpha_first"):
        d.min_separating_units(1.5)


def test_in_units_is_the_one_paired_difference_schema():
    from sur_lab.analysis.decisions import DIFF_COLUMNS, in_units

    binary = d.paired_family({("a", "b"): ([1, 1, 1, 0], [0, 0, 1, 0])}, kind="binary", n_boot=200)
    out = in_units(binary)
    assert list(out.columns) == [*binary.columns, *DIFF_COLUMNS]
    row = out.iloc[0]
    assert row["unit"] == "pp" and row["delta"] == 50.0  # (3 - 1) / 4 of the cases, in points
    assert (row["delta_low"], row["delta_high"]) == (100 * row["ci_low"], 100 * row["ci_high"])
    assert row["delta_mde"] == 100 * row["mde"] and row["estimate"] == 0.5  # the decision columns are kept
    cont = in_units(d.paired_family({("a", "b"): [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]}, kind="continuous", n_boot=200),
                    unit="logits")
    assert cont["unit"].iloc[0] == "logits" and cont["delta"].iloc[0] == cont["estimate"].iloc[0] == 1.75
    ratio = in_units(d.paired_family({"x": [2.0, 2.0, 2.0]}, kind="ratio", n_boot=200), unit="ignored")
    assert ratio["unit"].iloc[0] == "x" and ratio["delta"].iloc[0] == pytest.approx(2.0)
    assert in_units(binary.iloc[:0]).empty
    with pytest.raises(ValueError, match="lacks"):
        in_units(binary.drop(columns=["mde"]))


def test_claim_of_outcome_bound_rank_and_reading():
    """The claim verdicts that read an outcome decided elsewhere: one mapping, negation flips only decided outcomes."""
    holds, fails, undecided = d.CLAIM_VERDICTS
    assert [d.claim_of_outcome(o) for o in (True, False, None)] == [holds, fails, undecided]
    assert [d.claim_of_outcome(o, negate=True) for o in (True, False, None)] == [fails, holds, undecided]
    assert [d.claim_of_bound(w) for w in (d.HOLDS, d.FAILS, d.NOT_SHOWN, d.NOT_DECIDED)] == [holds, fails, undecided,
                                                                                           undecided]
    assert d.claim_of_bound(d.bound_claim(0, 40, at_least=0.95), negate=True) == holds  # upper bound 8.8 % < 95 %
    assert sorted(d.CLAIM_VERDICTS, key=d.claim_rank) == [fails, undecided, holds]
    with pytest.raises(ValueError, match="verdict must be one of"):
        d.claim_rank("beats")
    assert d.claim_reading("SUR-IDF", "SUR") == "'holds' reads SUR-IDF beats SUR"
    assert d.claim_reading("A", "B", expect="equivalent") == "'holds' reads A is equivalent to B"
    with pytest.raises(ValueError, match="expect must be one of"):
        d.claim_reading("A", "B", expect="more")
