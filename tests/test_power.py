"""The power statement of issue 40 (:mod:`sur_lab.analysis.decisions`): the exact power of the sign test against a
brute-force enumeration of every outcome on small sizes, clustered signs likewise, the MDE's definition (the smallest
effect reaching 80 %), its trend in n, the continuous power against Cohen's table, the published-interval helpers, and
every refusal naming its argument."""

from __future__ import annotations

import itertools
import math

from functools import lru_cache

import numpy as np
import pytest
from scipy.stats import binom, binomtest

from sur_lab.analysis.decisions import (ALPHA, POWER, Family, PowerBasis, binary_mde, binary_power, continuous_mde,
                                        continuous_power, discordance_from_interval, discordance_from_marginals, mde,
                                        power_sentence, sd_from_interval, sign_test_power)

BINARY = Family("primary", "binary", "a minus b", primary=True)
CONTINUOUS = Family("primary", "continuous", "a minus b", primary=True)
RATIO = Family("primary", "ratio", "b over a", primary=True)


@lru_cache(maxsize=None)
def _p(kp: int, km: int) -> float:
    return binomtest(kp, kp + km).pvalue


def _brute_power(n: int, p_plus: float, p_minus: float, alpha: float, cluster_size: int = 1) -> float:
    """Sum the probability of every sequence of n * cluster_size case outcomes in {+1, 0, -1} whose clusters' signs
    give scipy's exact binomial test p < alpha."""
    probs = {1: p_plus, 0: 1.0 - p_plus - p_minus, -1: p_minus}
    total = 0.0
    for seq in itertools.product((1, 0, -1), repeat=n * cluster_size):
        sums = [sum(seq[i * cluster_size:(i + 1) * cluster_size]) for i in range(n)]
        kp, km = sum(s > 0 for s in sums), sum(s < 0 for s in sums)
        if kp + km and _p(kp, km) < alpha:
            total += math.prod(probs[x] for x in seq)
    return total


@pytest.mark.parametrize("n", [1, 5, 6, 7])
@pytest.mark.parametrize("p_plus,p_minus", [(0.5, 0.1), (0.3, 0.3), (0.9, 0.0), (0.05, 0.6)])
def test_sign_test_power_equals_brute_force_enumeration(n, p_plus, p_minus):
    for alpha in (0.05, 0.2):
        assert sign_test_power(n, p_plus, p_minus, alpha=alpha) == pytest.approx(
            _brute_power(n, p_plus, p_minus, alpha), abs=1e-12)


def test_sign_test_power_hand_values():
    # 6 units, all discordant and positive: only 6-0 (p = 0.03125) rejects at 5 %: power 1 if every unit is +.
    assert sign_test_power(6, 1.0, 0.0) == pytest.approx(1.0, abs=1e-15)
    assert sign_test_power(5, 1.0, 0.0) == 0.0  # 5-0 gives p = 0.0625: no outcome of 5 units rejects at 5 %
    assert sign_test_power(6, 0.5, 0.5) == pytest.approx(2 * 0.5 ** 6, abs=1e-15)  # 6-0 or 0-6
    assert sign_test_power(0, 0.5, 0.5) == 0.0
    assert sign_test_power(10, 0.0, 0.0) == 0.0


@pytest.mark.parametrize("effect,q,n,size", [(0.2, 0.4, 3, 2), (0.0, 0.5, 3, 2), (-0.3, 0.3, 2, 3), (0.5, 0.9, 4, 1)])
def test_binary_power_with_clusters_equals_brute_force(effect, q, n, size):
    p_plus, p_minus = (q + effect) / 2, (q - effect) / 2
    for alpha in (0.25, 0.5):
        assert binary_power(effect, n, q, cluster_size=size, alpha=alpha) == pytest.approx(
            _brute_power(n, p_plus, p_minus, alpha, cluster_size=size), abs=1e-12)


def _brute_mixed(sizes, effect, q, alpha):
    """Enumerate every case outcome of clusters of unequal sizes."""
    p = {1: (q + effect) / 2, 0: 1 - q, -1: (q - effect) / 2}
    total, bounds = 0.0, np.cumsum([0, *sizes])
    for seq in itertools.product((1, 0, -1), repeat=int(bounds[-1])):
        sums = [sum(seq[bounds[i]:bounds[i + 1]]) for i in range(len(sizes))]
        kp, km = sum(s > 0 for s in sums), sum(s < 0 for s in sums)
        if kp + km and _p(kp, km) < alpha:
            total += math.prod(p[x] for x in seq)
    return total


def test_binary_power_with_unequal_clusters_equals_brute_force():
    for sizes, effect, q in (([3, 2, 1, 1], 0.2, 0.5), ([2, 1, 1, 1, 1], -0.1, 0.3), ([1, 1, 1], 0.4, 0.6)):
        for alpha in (0.2, 0.5):
            assert binary_power(effect, len(sizes), q, cluster_size=sizes, alpha=alpha) == pytest.approx(
                _brute_mixed(sizes, effect, q, alpha), abs=1e-12)
    # equal sizes given as a sequence take the binomial path
    assert binary_power(0.2, 4, 0.5, cluster_size=[2, 2, 2, 2]) == binary_power(0.2, 4, 0.5, cluster_size=2)
    with pytest.raises(ValueError, match="cluster_size: 2 sizes for n=3"):
        binary_power(0.2, 3, 0.5, cluster_size=[1, 2])


def test_family_size_uses_the_first_holm_step():
    assert binary_power(0.3, 40, 0.5, family_size=4) == binary_power(0.3, 40, 0.5, alpha=ALPHA / 4)
    assert binary_power(0.3, 40, 0.5, family_size=4) < binary_power(0.3, 40, 0.5)
    assert continuous_power(0.5, 30, 1.0, family_size=3) == continuous_power(0.5, 30, 1.0, alpha=ALPHA / 3)


@pytest.mark.parametrize("n,q", [(48, 0.5), (16, 0.9), (100, 0.1), (30, 0.3)])
def test_binary_mde_is_the_smallest_effect_reaching_the_power(n, q):
    d = binary_mde(n, q)
    assert 0 < d <= q
    assert binary_power(d, n, q) >= POWER
    assert binary_power(d - 1e-6, n, q) < POWER
    # the power rises with the effect on a grid up to q
    grid = np.linspace(0, q, 41)
    powers = [binary_power(float(x), n, q) for x in grid]
    assert all(b >= a - 1e-12 for a, b in zip(powers, powers[1:]))


def test_binary_mde_hand_values_and_too_few_cases():
    assert binary_mde(48, 0.5) == pytest.approx(0.29274, abs=1e-5)
    # 20 pairs, all discordant: the test rejects on <= 5 or >= 15 positives (2 P(X <= 5) = 0.041; 6 gives 0.115).
    d = binary_mde(20, 1.0)
    pi = (1 + d) / 2
    assert binom.sf(14, 20, pi) + binom.cdf(5, 20, pi) == pytest.approx(POWER, abs=1e-7)
    assert 0.59 < d < 0.60
    assert math.isnan(binary_mde(5, 1.0))  # no outcome of 5 pairs rejects at 5 %
    assert math.isnan(binary_mde(48, 0.0225, cluster_size=3))  # ~3 discordant cases expected: never 80 %
    assert binary_mde(400, 0.0225, cluster_size=3) < 0.0225


def test_binary_mde_falls_with_n():
    # Where the discordant count K varies (q well below 1) the exact test's parity sawtooth averages out: the MDE
    # never rises with one more case; below the size that reaches 80 % at all it is NaN, and once defined it stays so.
    for q, first in ((0.1, 78), (0.25, 31), (0.5, 20)):
        m = np.array([binary_mde(n, q) for n in range(20, 141)])
        defined = ~np.isnan(m)
        assert defined[first - 20:].all() and not defined[:first - 20].any(), q
        assert (np.diff(m[first - 20:]) < 0).all(), q
    # Near q = 1 the exact test's discreteness shows case by case, but doubling the size always lowers it.
    for n in (8, 12, 16, 24, 48, 96):
        assert binary_mde(2 * n, 0.99) < binary_mde(n, 0.99)
    m = [continuous_mde(n, 1.0) for n in range(6, 120)]
    assert all(b < a for a, b in zip(m, m[1:]))


def test_continuous_power_against_cohens_table_and_the_normal_limit():
    assert continuous_power(0.5, 34, 1.0) == pytest.approx(0.8078, abs=1e-4)  # paired t, d_z = 0.5, n = 34
    assert continuous_power(0.0, 34, 1.0) == pytest.approx(ALPHA, abs=1e-12)
    assert continuous_mde(34, 1.0) == pytest.approx(0.4950, abs=1e-4)
    assert continuous_mde(2000, 2.0) == pytest.approx(2 * (1.959964 + 0.841621) / math.sqrt(2000), rel=2e-3)
    assert continuous_power(10.0, 5, 1.0) == 0.0  # 5 units: the sign-flip test's floor p is 0.0625
    assert math.isnan(continuous_mde(5, 1.0))


def test_published_interval_helpers():
    # SAFE-KV Table 20: donor-copy minus forwarding +0.20 [0.06, 0.34] on 50 requests.
    assert discordance_from_interval(0.20, 0.06, 0.34, 50) == pytest.approx(0.04 + 50 * (0.28 / (2 * 1.959964)) ** 2,
                                                                            rel=1e-6)
    # A narrower interval than |d| allows: q never below |d|.
    assert discordance_from_interval(0.0175, 0.0112, 0.0224, 1200) == 0.0175
    assert discordance_from_interval(0.9, 0.0, 1.0, 1000) == 1.0
    assert discordance_from_marginals(0.9896, 0.0) == 0.9896
    assert discordance_from_marginals(0.5, 0.5) == 0.5
    assert sd_from_interval(-0.099, 0.021, 275) == pytest.approx(0.12 / (2 * 1.959964) * math.sqrt(275), rel=1e-6)


def test_mde_by_kind_and_the_sentence():
    basis = PowerBasis(0.5, "a planning value")
    assert mde(BINARY, basis, 48) == (pytest.approx(29.274, abs=1e-3), "pp")
    sd = PowerBasis(1.0, "a planning value", unit="nats")
    assert mde(CONTINUOUS, sd, 34) == (pytest.approx(0.4950, abs=1e-4), "nats")
    ratio, unit = mde(RATIO, PowerBasis(1.0, "a planning value", unit="x"), 34)
    assert unit == "x" and ratio == pytest.approx(math.exp(0.4950), abs=1e-3)
    assert math.isnan(mde(CONTINUOUS, sd, 1)[0])
    line = power_sentence("SUR 5% vs Shift", BINARY, basis, 48)
    assert line.startswith("Power: SUR 5% vs Shift (tested alone) on 48 cases detects a difference of 29.3 pp or more "
                           "with 80 % power (exact sign test, two-sided 5 %; stated discordance 50 % of cases")
    assert "cannot reach 80 % power" in power_sentence("SUR 5% vs Shift", BINARY, basis, 3)
    clustered = power_sentence("x vs y", BINARY, PowerBasis(0.3, "s"), 48, cluster_size=3, clusters="sources")
    assert "on 48 sources of 3 cases" in clustered


@pytest.mark.parametrize("call,exc,match", [
    (lambda: sign_test_power(-1, 0.1, 0.1), ValueError, "n must"),
    (lambda: sign_test_power(2.0, 0.1, 0.1), TypeError, "n must"),
    (lambda: sign_test_power(5, 0.7, 0.7), ValueError, "p_plus \\+ p_minus"),
    (lambda: sign_test_power(5, -0.1, 0.1), ValueError, "p_plus"),
    (lambda: sign_test_power(5, 0.1, 0.1, alpha=1.5), ValueError, "alpha"),
    (lambda: binary_power(0.6, 10, 0.5), ValueError, "effect=0.6"),
    (lambda: binary_power(0.1, 10, 0.0), ValueError, "discordance"),
    (lambda: binary_power(0.1, 10, 1.2), ValueError, "discordance"),
    (lambda: binary_power("0.1", 10, 0.5), TypeError, "effect"),
    (lambda: binary_power(0.1, 10, 0.5, cluster_size=0), ValueError, "cluster_size"),
    (lambda: binary_power(0.1, 10, 0.5, family_size=0), ValueError, "family_size"),
    (lambda: binary_mde(10, 0.5, power=1.0), ValueError, "power"),
    (lambda: continuous_power(0.1, 1, 1.0), ValueError, "n must"),
    (lambda: continuous_power(0.1, 10, 0.0), ValueError, "sd"),
    (lambda: continuous_mde(10, 1.0, power=0.0), ValueError, "power"),
    (lambda: discordance_from_interval(0.1, 0.2, 0.0, 10), ValueError, "low"),
    (lambda: discordance_from_marginals(1.5, 0.1), ValueError, "p_a"),
    (lambda: sd_from_interval(0.1, 0.1, 10), ValueError, "low"),
    (lambda: PowerBasis(0.0, "s"), ValueError, "value"),
    (lambda: PowerBasis(0.5, ""), ValueError, "source"),
    (lambda: mde(BINARY, 0.5, 10), TypeError, "basis"),
    (lambda: mde("primary", PowerBasis(0.5, "s"), 10), TypeError, "family"),
    (lambda: mde(BINARY, PowerBasis(0.5, "s"), 10, family_size=2), ValueError, "family_size"),
])
def test_bad_arguments_are_refused_by_name(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_docs_power_table_is_current():
    """``docs/decisions.md`` holds :func:`sur_lab.studies.power_markdown` between its markers, as generated."""
    from pathlib import Path

    from sur_lab.studies import power_markdown

    page = (Path(__file__).resolve().parents[1] / "docs" / "decisions.md").read_text()
    start, end = "<!-- power-table:start -->\n", "\n<!-- power-table:end -->"
    assert start in page and end in page
    table = page.split(start, 1)[1].split(end, 1)[0]
    assert table == power_markdown(), "regenerate: python -c 'from sur_lab.studies import power_markdown; ...'"


def test_every_power_study_prints_its_statement_in_this_run():
    """Each power study's notebook calls its ``power_line`` in the last code cell (the generated "This run")."""
    import json
    from pathlib import Path

    from sur_lab.studies import POWER_STUDIES, get_study

    root = Path(__file__).resolve().parents[1] / "notebooks"
    for name in [*POWER_STUDIES, "agent_session"]:
        stem = get_study(name).notebook if name != "agent_session" else "07_agent_session"
        cells = [c for c in json.loads((root / f"{stem}.ipynb").read_text())["cells"] if c["cell_type"] == "code"]
        assert "power_line(" in "".join(cells[-1]["source"]), stem


def test_study_mde_at_default_matches_the_generic_computation():
    from sur_lab.studies import niah, stale_facts

    p = niah.STUDY.params("default")
    assert niah.STUDY.mde(p) == (pytest.approx(100 * binary_mde(p["num_cases"], 0.9896), abs=1e-9), "pp")
    assert stale_facts.STUDY.mde(stale_facts.STUDY.params("smoke"))[1] == "pp"
    assert math.isnan(stale_facts.STUDY.mde(stale_facts.STUDY.params("smoke"))[0])  # 3 cases never reach p < 0.05
    assert niah.STUDY.power_line(p).startswith(f"Power: SUR 5% vs Shift on the lead endpoint (tested alone) on "
                                               f"{p['num_cases']} cases detects")


def test_one_effect_format_for_the_table_and_the_sentences():
    """:func:`sur_lab.analysis.decisions.effect_text` formats every effect: each study's table cell stands in its
    ``power_line`` at that preset (or the line says the size cannot reach the power), and each study's ``mde`` /
    ``power_line`` are its :class:`PowerDesign`'s at its size."""
    from sur_lab.analysis.decisions import PowerDesign, effect_text
    from sur_lab.studies import POWER_STUDIES, get_study, power_table

    assert [effect_text(29.2741, "pp"), effect_text(1.2345, "x"), effect_text(0.49504, "nats"),
            effect_text(float("nan"), "pp")] == ["29.3 pp", "1.23x", "0.495 nats", "none"]
    table = power_table().set_index("study")
    for name in POWER_STUDIES:
        study = get_study(name)
        assert isinstance(study.power, PowerDesign) and study.power.basis is study.primary_power
        for preset in ("smoke", "default", "paper"):
            p, cell = study.params(preset), table.loc[name, preset]
            line = study.power_line(p)
            assert cell == effect_text(*study.mde(p))
            assert (f" {cell} " in line or f" {cell})" in line) if cell != "none" else "cannot reach" in line, line
    design = PowerDesign("x vs y", BINARY, PowerBasis(0.3, "s"), lambda p: (p["n"], 3), clusters="sources")
    assert design.mde({"n": 48}) == mde(BINARY, PowerBasis(0.3, "s"), 48, cluster_size=3)
    assert design.line({"n": 48}) == power_sentence("x vs y", BINARY, PowerBasis(0.3, "s"), 48, cluster_size=3,
                                                    clusters="sources")
