"""Decisions: the one place where sur_lab turns numbers into words (issue 36; ``docs/decisions.md``).

A generated conclusion is read, and pasted, as a claim. Every verdict a notebook, a study's ``conclusion`` or
``findings``, the SAFE-KV operating rule and design ledger, or the agent-trace conclusion prints comes from here, by
these rules:

* **Families, declared before the run.** A study declares its one *primary* comparison (tested alone at ``alpha``)
  and a few small secondary families (:class:`Family`, module constants of the study); the p-values of a family are
  Holm-adjusted over the whole family, so the chance that a family prints any "beats" or "loses to" when nothing
  differs stays at ``alpha`` (family-wise; Holm 1979, valid under any dependence between the comparisons).
* **Binary endpoints** (EM, agreement, preservation): the exact McNemar test, i.e. the two-sided sign test on the
  discordant pairs (``scipy.stats.binom``, equal to ``scipy.stats.binomtest(k, n_discordant).pvalue``), and
  Newcombe's paired score interval for the difference of paired proportions (Newcombe 1998, method 10, "square and
  add" of two Wilson intervals with the phi correction), which keeps a nonzero width when every outcome is 0 or 1.
  Ties do not count: four discordant pairs out of 48 cases are four units of evidence, not 48.
* **Continuous endpoints** (margins, NLL, log ratios): the **percentile** bootstrap interval of the paired mean (the
  interval of appendix 8.3, chosen over BCa because BCa's jackknife acceleration is unstable with few clusters and
  tied differences, and because the percentile interval is the one the paper reports), with the p-value of the exact
  (or, above ``2**k > n_boot`` sign patterns, Monte Carlo) **sign-flip randomization test** of the paired mean
  (``scipy.stats.permutation_test``). The percentile bootstrap alone is anti-conservative with few units (five
  positive differences give a bootstrap p of 0, where no test at 5 % can reject); the sign-flip test is exact under
  the null that the two arms are exchangeable within a unit.
* **Clustered units** (placements of a source, turns of a trace): with ``cluster``, whole clusters are resampled by
  the bootstrap and flipped together by the sign tests; a binary interval is then the hull of the cluster-bootstrap
  interval and Newcombe's (the bootstrap carries the within-cluster correlation, Newcombe the nonzero width).
* **"beats" / "loses to"** need the adjusted p below ``alpha`` *and* the interval excluding the null. **"equivalent"**
  needs a margin declared in the study's code with its source, and the whole ``1 - 2 alpha`` interval inside it
  (TOST). Anything else is **"not separated"** (never "no loss", "tie", "reproduced" or "≈"), printed with the
  smallest difference the size could have separated. A smoke run's verdicts are **"not decided"** (a plumbing check).
* **Ratios** (speed-ups) are decided on the log scale: "faster" needs the interval's lower bound above 1.
* **Proportions** of one arm (preservation, a loss rate): Clopper–Pearson bounds; "at least X %" needs the lower
  bound, "at most Y points" the upper one.

Every function is pure (arrays or tables in, rows or words out) and seeded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import pandas as pd
from scipy.optimize import brentq
from scipy.stats import binom, binomtest, nct, norm, permutation_test
from scipy.stats import t as student_t

from sur_lab.analysis.stats import bootstrap_p_value, holm
from sur_lab.checks import as_count

#: Family-wise significance level of every family (and of the primary comparison, tested alone).
ALPHA = 0.05
#: Bootstrap replicates and sign-flip resamples per comparison (appendix 8.3's 10,000).
N_BOOT = 10_000
#: Comparison kinds: 0/1 outcomes, real-valued outcomes, positive ratios (decided on the log scale).
KINDS = ("binary", "continuous", "ratio")
#: Multiplicity adjustments: Holm over the family, or none (a primary comparison, alone in its family).
ADJUSTMENTS = ("holm", "none")

#: The verdicts of :func:`judge` (the ``verdict`` column of :func:`paired_family`).
BEATS = "beats"
LOSES = "loses to"
EQUIVALENT = "equivalent"
NOT_SEPARATED = "not separated"
NOT_DECIDED = "not decided"
NA = "n/a"
VERDICTS = (BEATS, LOSES, EQUIVALENT, NOT_SEPARATED, NOT_DECIDED, NA)
#: The verdicts that separate the two arms (either direction).
SEPARATED = (BEATS, LOSES)
#: The verdicts of :func:`bound_claim` (a claim about one proportion).
HOLDS = "holds"
FAILS = "fails"
NOT_SHOWN = "not shown"
#: The verdicts of a paper's claim read from one comparison (:func:`claim_verdict`; the claims table of the release).
CLAIM_VERDICTS = (HOLDS, "does not hold", "undecided at this size")
#: What a claim says of its comparison: A exceeds B, A falls below B, or A and B agree within a declared margin.
CLAIM_EXPECTATIONS = ("greater", "less", "equivalent")
#: Presets that check the plumbing only: their verdicts are "not decided at this size" (:func:`decides`).
PLUMBING_PRESETS = ("smoke",)

#: Words of a separated verdict by kind (higher side, lower side), and the printed unit and scale of an estimate.
_WORDS = {"binary": ("beats", "loses to"), "continuous": ("beats", "loses to"),
          "ratio": ("is faster than", "is slower than")}
_UNITS = {"binary": ("pp", 100.0, 1), "continuous": ("", 1.0, 3), "ratio": ("x", 1.0, 2)}

COLUMNS = ["family", "comparison", "a", "b", "kind", "adjust", "estimate", "ci_low", "ci_high", "tost_low",
           "tost_high", "p", "p_adj", "n", "n_clusters", "n_discordant", "family_size", "alpha", "margin",
           "margin_source", "higher_is_better", "mde", "verdict"]

#: A paired difference in its printed unit (:func:`in_units`), beside the decision columns of :data:`COLUMNS`: the one
#: schema of every study's table of paired differences (issue 39). ``unit`` says what the four numbers are ("pp" of a
#: binary endpoint, "x" of a ratio, a continuous endpoint's own unit such as "logits" or "nats").
DIFF_COLUMNS = ["delta", "delta_low", "delta_high", "delta_mde", "unit"]


def decides(preset: str | None) -> bool:
    """Whether a run at ``preset`` decides anything: ``False`` for :data:`PLUMBING_PRESETS` (a smoke run checks that
    the code runs; its verdicts are "not decided at this size"), ``True`` otherwise (``None``: a study without
    presets). Studies pass ``decide=decides(preset)`` and never special-case words themselves."""
    return preset not in PLUMBING_PRESETS


def kind_of(values) -> str:
    """``"binary"`` when every finite value of ``values`` is 0 or 1 (bools included), else ``"continuous"``."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    x = x[~np.isnan(x)]
    return "binary" if np.isin(x, (0.0, 1.0)).all() else "continuous"


@dataclass(frozen=True)
class Margin:
    """An equivalence margin, declared in a study's code before the run.

    Attributes:
        value: the half-width, > 0, in the comparison's own unit (a fraction for binary endpoints: 0.05 is 5 points;
            nats for an NLL contrast).
        source: where it comes from (the paper's interval, a tolerance the study states).
    """

    value: float
    source: str

    def __post_init__(self) -> None:
        if not (isinstance(self.value, (int, float)) and math.isfinite(self.value) and self.value > 0):
            raise ValueError(f"value={self.value!r} must be a finite number > 0")
        if not self.source:
            raise ValueError("source is empty: say where the margin comes from")


@dataclass(frozen=True)
class Family:
    """A family of comparisons, declared as data in a study's module before the run (issue 36).

    The comparisons themselves depend on what ran (budgets, allocators), so the declaration states the rule that
    generates them; :func:`paired_family` tests them together.

    Attributes:
        name: printed with every verdict ("SUR against the other allocators").
        kind: one of :data:`KINDS`.
        rule: which comparisons the family holds, in words ("SUR minus each other allocator at the same budget, on
            the lead endpoint").
        primary: the study's primary comparison: tested alone at ``alpha`` (no adjustment); a primary family holds
            exactly one comparison.
        margin: an equivalence margin (:class:`Margin`), or ``None`` (a non-separation is then "not separated").
        higher_is_better: ``False`` for endpoints where lower is better (a stale-answer rate, TV, latency).
        max_size: the most comparisons the family may hold (``None``: no bound); a larger family is refused.
    """

    name: str
    kind: str
    rule: str
    primary: bool = False
    margin: Margin | None = None
    higher_is_better: bool = True
    max_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} must be one of {KINDS}")
        if self.margin is not None and not isinstance(self.margin, Margin):
            raise ValueError(f"margin={self.margin!r} must be a Margin (value and source) or None")
        if self.margin is not None and self.kind == "ratio":
            raise ValueError("margin: a ratio family has no equivalence margin")
        if self.primary and self.max_size not in (None, 1):
            raise ValueError(f"max_size={self.max_size!r}: a primary family holds exactly one comparison")

    @property
    def adjust(self) -> str:
        """``"none"`` for the primary comparison, ``"holm"`` otherwise."""
        return "none" if self.primary else "holm"


# ---------------------------------------------------------------------------------------------------------------------
# Intervals and tests


@lru_cache(maxsize=64)
def _z(confidence: float) -> float:
    """The standard normal quantile of a two-sided ``confidence`` (cached: ``norm.ppf`` costs more than a Wilson
    interval)."""
    return float(norm.ppf(0.5 + confidence / 2.0))


def wilson_interval(k, n, *, confidence: float = 1 - ALPHA) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score interval of a proportion k / n (vectorised; equal to ``scipy.stats.binomtest(k, n)
    .proportion_ci(method="wilson")``).

    Args:
        k, n: counts (arrays broadcast together), ``0 <= k <= n``, ``n >= 1``.
        confidence: two-sided coverage in (0, 1).

    Returns:
        ``(low, high)`` float64 arrays of fractions.

    Raises:
        ValueError: naming ``n`` when some ``n < 1``, ``k`` outside ``[0, n]``, ``confidence`` outside (0, 1).
    """
    k, n = np.asarray(k, dtype=np.float64), np.asarray(n, dtype=np.float64)
    if np.any(n < 1):
        raise ValueError("n must be >= 1")
    if np.any((k < 0) | (k > n)):
        raise ValueError("k must lie in [0, n]")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} must lie in (0, 1)")
    z = _z(confidence)
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return np.clip(centre - half, 0.0, 1.0), np.clip(centre + half, 0.0, 1.0)


def newcombe_interval(n11, n10, n01, n00, *, confidence: float = 1 - ALPHA) -> tuple[np.ndarray, np.ndarray]:
    """Newcombe's paired score interval (1998, method 10) for ``P(a = 1) - P(b = 1)`` of paired 0/1 outcomes.

    With ``n`` pairs, ``p1 = (n11 + n10) / n``, ``p2 = (n11 + n01) / n`` and their Wilson intervals ``[l1, u1]``,
    ``[l2, u2]``: ``L = d - sqrt((p1 - l1)^2 - 2 phi (p1 - l1)(u2 - p2) + (u2 - p2)^2)``, ``U = d + sqrt((p2 -
    l2)^2 - 2 phi (p2 - l2)(u1 - p1) + (u1 - p1)^2)``, ``d = p1 - p2``, where ``phi`` is the correlation of the two
    outcomes with Newcombe's correction (``A = n11 n00 - n10 n01``: ``(A - n/2) / sqrt(marginals)`` when ``A > n/2``,
    0 when ``0 <= A <= n/2``, ``A / sqrt(marginals)`` when ``A < 0``; 0 when a marginal is 0). Unlike a bootstrap,
    the interval keeps a nonzero width when every outcome is 0 or 1 (n = 2 pairs all 1: about -0.66 to +0.66).

    Args:
        n11, n10, n01, n00: counts of pairs (a, b) = (1, 1), (1, 0), (0, 1), (0, 0); arrays broadcast together.
        confidence: two-sided coverage in (0, 1).

    Returns:
        ``(low, high)`` float64 arrays, fractions in [-1, 1].

    Raises:
        ValueError: naming the counts when one is negative or a table has no pair; as :func:`wilson_interval`.
    """
    n11, n10, n01, n00 = (np.asarray(x, dtype=np.float64) for x in (n11, n10, n01, n00))
    if any(np.any(x < 0) for x in (n11, n10, n01, n00)):
        raise ValueError("n11, n10, n01, n00 must be counts >= 0")
    n = n11 + n10 + n01 + n00
    if np.any(n < 1):
        raise ValueError("n11 + n10 + n01 + n00 must be >= 1 (a table without pairs has no interval)")
    p1, p2 = (n11 + n10) / n, (n11 + n01) / n
    l1, u1 = wilson_interval(n11 + n10, n, confidence=confidence)
    l2, u2 = wilson_interval(n11 + n01, n, confidence=confidence)
    marg = (n11 + n10) * (n01 + n00) * (n11 + n01) * (n10 + n00)
    a = n11 * n00 - n10 * n01
    with np.errstate(invalid="ignore", divide="ignore"):
        phi = np.where(a > n / 2, (a - n / 2) / np.sqrt(marg), np.where(a < 0, a / np.sqrt(marg), 0.0))
    phi = np.where(marg > 0, phi, 0.0)
    d = p1 - p2
    low = d - np.sqrt(np.maximum((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    high = d + np.sqrt(np.maximum((p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2, 0.0))
    return np.clip(low, -1.0, 1.0), np.clip(high, -1.0, 1.0)


def sign_test_p(k_plus, k_minus) -> np.ndarray:
    """Two-sided exact sign test (the exact McNemar test on discordant pairs): ``min(1, 2 P(X <= min(k+, k-)))``,
    ``X ~ Binomial(k+ + k-, 1/2)``; 1 when there is no discordant unit. Vectorised; equal to
    ``scipy.stats.binomtest(k_plus, k_plus + k_minus).pvalue``. Seven discordant pairs, all one way: 0.0156."""
    kp, km = np.asarray(k_plus, dtype=np.int64), np.asarray(k_minus, dtype=np.int64)
    m = kp + km
    p = np.minimum(1.0, 2.0 * binom.cdf(np.minimum(kp, km), np.maximum(m, 1), 0.5))
    return np.where(m > 0, p, 1.0)


def proportion_interval(k: int, n: int, *, alpha: float = ALPHA) -> tuple[float, float, float]:
    """Clopper–Pearson (exact) interval of a proportion: ``(k / n, low, high)`` at two-sided ``1 - alpha``
    (``scipy.stats.binomtest(k, n).proportion_ci(method="exact")``). 0 of 2: upper bound 0.842; 0 of 12: 0.265.

    Raises:
        ValueError: naming ``n`` when < 1, ``k`` outside [0, n], ``alpha`` outside (0, 1).
    """
    k, n = int(k), int(n)
    if n < 1:
        raise ValueError(f"n={n!r} must be >= 1")
    if not 0 <= k <= n:
        raise ValueError(f"k={k!r} must lie in [0, n={n}]")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha!r} must lie in (0, 1)")
    ci = binomtest(k, n).proportion_ci(confidence_level=1 - alpha, method="exact")
    return k / n, float(ci.low), float(ci.high)


def p_floor(n_units: int) -> float:
    """The smallest two-sided p any exact test can reach on ``n_units`` paired units: ``2 ** (1 - n)`` (every unit
    on one side). A bootstrap p below it (a percentile bootstrap on five units can give 0) is raised to it
    (:func:`bootstrap_p`)."""
    return 1.0 if n_units < 1 else min(1.0, 2.0 ** (1 - int(n_units)))


def bootstrap_p(replicates, n_units: int, null: float = 0.0) -> float:
    """Two-sided bootstrap p of ``null`` (:func:`sur_lab.analysis.stats.bootstrap_p_value`), never below
    :func:`p_floor` of the ``n_units`` resampled: the decision rule for a statistic whose only test is its
    bootstrap (the evidence-location factorial contrasts)."""
    return max(bootstrap_p_value(replicates, null), p_floor(n_units))


# ---------------------------------------------------------------------------------------------------------------------
# One verdict


def judge(estimate: float, low: float, high: float, *, p_adj: float | None = None, alpha: float = ALPHA,
          null: float = 0.0, higher_is_better: bool = True, tost: tuple[float, float] | None = None,
          margin: float | None = None, n: int | None = None, decide: bool = True) -> str:
    """The decision rule, for one comparison whose interval (and p) are already known.

    Args:
        estimate: the observed difference (or ratio).
        low, high: its ``1 - alpha`` interval (NaN: degenerate, no interval; the test alone decides).
        p_adj: the (multiplicity-adjusted) p; ``None``: the interval alone decides (a comparison whose interval is
            its test, e.g. a speed-up interval).
        alpha: the level.
        null: the value of no difference (0, or 1 for a ratio).
        higher_is_better: which side is "beats".
        tost: the ``1 - 2 alpha`` interval for the equivalence test (required with ``margin``).
        margin: an equivalence margin (half-width around ``null``), or ``None``.
        n: the number of paired units (0: "n/a").
        decide: ``False`` at a plumbing-check size: "not decided".

    Returns:
        One of :data:`VERDICTS`: "not decided" without ``decide``; "n/a" for no unit or a NaN estimate; "beats" or
        "loses to" when ``p_adj < alpha`` (if given) and the interval excludes ``null``; "equivalent" when a margin
        is given and ``tost`` lies inside ``null ± margin``; else "not separated".

    Raises:
        ValueError: naming ``low`` when ``low > high``, ``alpha`` outside (0, 1), ``tost`` when a margin is given
            without it.
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha!r} must lie in (0, 1)")
    if not decide:
        return NOT_DECIDED
    if (n is not None and int(n) == 0) or estimate is None or math.isnan(float(estimate)):
        return NA
    low, high = float(low), float(high)
    if low > high:
        raise ValueError(f"low={low!r} must be <= high={high!r}")
    interval = not (math.isnan(low) or math.isnan(high))
    tested = p_adj is not None and not math.isnan(float(p_adj))
    if not interval and not tested:
        return NOT_SEPARATED
    significant = (not tested) or float(p_adj) < alpha
    above = low > null if interval else float(estimate) > null
    below = high < null if interval else float(estimate) < null
    if significant and (above or below):
        return BEATS if above == higher_is_better else LOSES
    if margin is not None:
        if tost is None:
            raise ValueError("tost: an equivalence margin needs the 1 - 2 alpha interval")
        t_low, t_high = (float(x) for x in tost)
        if not (math.isnan(t_low) or math.isnan(t_high)) and null - margin < t_low and t_high < null + margin:
            return EQUIVALENT
    return NOT_SEPARATED


# ---------------------------------------------------------------------------------------------------------------------
# A family of paired comparisons


def _as_key(key) -> tuple[str, str, str]:
    """``(comparison, a, b)`` of a family key: an ``(a, b)`` pair or a name."""
    if isinstance(key, tuple) and len(key) == 2:
        a, b = (str(x) for x in key)
        return f"{a} vs {b}", a, b
    return str(key), str(key), ""


def _paired_values(key, value, kind: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``(diffs, b)`` or ``(a, b)`` float arrays of one comparison; NaN units kept (dropped with the clusters)."""
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError(f"diffs[{key!r}] must be one array of differences or a pair (a, b) of outcome arrays")
        a = np.asarray(value[0], dtype=np.float64).reshape(-1)
        b = np.asarray(value[1], dtype=np.float64).reshape(-1)
        if a.shape != b.shape:
            raise ValueError(f"diffs[{key!r}]: a has {a.size} units and b {b.size}; paired arrays need the same units")
        return a, b
    return np.asarray(value, dtype=np.float64).reshape(-1), None


def _cluster_sums(d: np.ndarray, cluster: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Per-cluster sums of ``d`` and cluster sizes (each unit its own cluster without ``cluster``)."""
    if cluster is None:
        return d, np.ones_like(d)
    codes, inverse = np.unique(cluster, return_inverse=True)
    sums = np.bincount(inverse, weights=d, minlength=len(codes))
    sizes = np.bincount(inverse, minlength=len(codes)).astype(np.float64)
    return sums, sizes


def _bootstrap(sums: np.ndarray, sizes: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """Percentile-bootstrap replicates of ``sum(d) / units`` over clusters drawn with replacement, (n_boot,)."""
    idx = rng.integers(0, len(sums), size=(n_boot, len(sums)))
    return sums[idx].sum(axis=1) / sizes[idx].sum(axis=1)


def _percentile(reps: np.ndarray, alpha: float) -> tuple[float, float]:
    low, high = np.percentile(reps, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return float(low), float(high)


def _sign_flip_p(sums: np.ndarray, n_boot: int, rng: np.random.Generator) -> float:
    """Two-sided sign-flip randomization p of ``sum(sums) = 0`` (exact when ``2**k <= n_boot``)."""
    s = sums[sums != 0]
    if s.size <= 1:  # no unit, or one: both signs are equally extreme (scipy needs two observations)
        return 1.0
    res = permutation_test((s,), lambda x, axis: np.sum(x, axis=axis), permutation_type="samples",
                           vectorized=True, n_resamples=n_boot, alternative="two-sided", rng=rng)
    return float(min(1.0, res.pvalue))


def min_separating_units(alpha_first: float) -> int:
    """The fewest units, all on one side, whose exact two-sided sign test (or sign-flip test: its floor
    :func:`p_floor` is the same ``2 ** (1 - k)``) reaches ``p < alpha_first``: the smallest ``k`` with
    ``2 ** (1 - k) < alpha_first``. E.g. 8 at the first Holm step of a family of five at 5 % (``alpha_first = 0.01``).

    Raises:
        ValueError: naming ``alpha_first`` when outside (0, 1).
    """
    if not 0 < alpha_first < 1:
        raise ValueError(f"alpha_first={alpha_first!r} must lie in (0, 1)")
    return int(math.floor(math.log2(2.0 / alpha_first))) + 1


def _mde_units(n: int, alpha_first: float) -> tuple[int, float]:
    """``(k, k / n)``: the fewest same-direction units whose exact sign test reaches ``p < alpha_first``."""
    k = min_separating_units(alpha_first)
    return k, (k / n if n else float("nan"))


def _one(kind: str, a: np.ndarray, b: np.ndarray | None, cluster: np.ndarray | None, *, alpha: float, n_boot: int,
         rng: np.random.Generator) -> dict:
    """Estimate, intervals, raw p and counts of one comparison (NaN units dropped)."""
    keep = ~np.isnan(a) if b is None else ~(np.isnan(a) | np.isnan(b))
    a = a[keep]
    b = None if b is None else b[keep]
    cl = None if cluster is None else cluster[keep]
    n = int(a.size)
    nan = float("nan")
    out = {"estimate": nan, "ci_low": nan, "ci_high": nan, "tost_low": nan, "tost_high": nan, "p": nan, "n": n,
           "n_clusters": 0, "n_discordant": 0}
    if n == 0:
        return out
    if kind == "binary":
        if b is None:
            if (~np.isin(a, (-1.0, 0.0, 1.0))).any():
                raise ValueError("diffs: a binary comparison's differences must be -1, 0 or 1")
            d = a
        else:
            if (~np.isin(a, (0.0, 1.0)) | ~np.isin(b, (0.0, 1.0))).any():
                raise ValueError("diffs: a binary comparison's outcomes must be 0/1 (bools); got other values")
            d = a - b
        n10, n01 = int(np.sum(d > 0)), int(np.sum(d < 0))
        sums, sizes = _cluster_sums(d, cl)
        if b is None:
            # Differences alone do not say how the concordant pairs split into (1, 1) and (0, 0): take the hull of
            # Newcombe's interval over every split (conservative; the split changes the Wilson margins).
            n11 = np.arange(n - n10 - n01 + 1)
        else:
            n11 = np.array([int(np.sum((a == 1) & (b == 1)))])
        n00 = n - n10 - n01 - n11
        lows, highs = newcombe_interval(n11, n10, n01, n00, confidence=1 - alpha)
        t_lows, t_highs = newcombe_interval(n11, n10, n01, n00, confidence=1 - 2 * alpha)
        low, high, t_low, t_high = float(lows.min()), float(highs.max()), float(t_lows.min()), float(t_highs.max())
        if cl is not None and len(sums) > 1:
            reps = _bootstrap(sums, sizes, n_boot, rng)
            b_low, b_high = _percentile(reps, alpha)
            bt_low, bt_high = _percentile(reps, 2 * alpha)
            low, high, t_low, t_high = min(low, b_low), max(high, b_high), min(t_low, bt_low), max(t_high, bt_high)
        p = float(sign_test_p(int(np.sum(sums > 0)), int(np.sum(sums < 0))))
        out.update(estimate=float(d.mean()), ci_low=low, ci_high=high, tost_low=t_low, tost_high=t_high, p=p,
                   n_clusters=len(sums), n_discordant=n10 + n01)
        return out
    if kind == "ratio":
        r = a if b is None else b / a
        if np.any(~np.isfinite(r)) or np.any(r <= 0):
            raise ValueError("diffs: a ratio comparison needs positive finite ratios (or positive times a, b)")
        d = np.log(r)
    else:
        d = a if b is None else a - b
        if np.any(~np.isfinite(d)):
            raise ValueError("diffs: continuous differences must be finite (NaN units are dropped)")
    sums, sizes = _cluster_sums(d, cl)
    reps = _bootstrap(sums, sizes, n_boot, rng)
    low, high = _percentile(reps, alpha)
    t_low, t_high = _percentile(reps, 2 * alpha)
    # A degenerate bootstrap (every cluster's mean the same) has no interval: never print a zero-width one.
    if np.ptp(reps) == 0:
        low = high = t_low = t_high = float("nan")
    p = _sign_flip_p(sums, n_boot, rng)
    est = float(sums.sum() / sizes.sum())
    out.update(estimate=est, ci_low=low, ci_high=high, tost_low=t_low, tost_high=t_high, p=p, n_clusters=len(sums),
               n_discordant=int(np.sum(d != 0)), _sd=float(np.std(reps)))
    if kind == "ratio":
        out.update({k: math.exp(out[k]) for k in ("estimate", "ci_low", "ci_high", "tost_low", "tost_high")})
    return out


def paired_family(diffs: Mapping, *, kind: str | None = None, alpha: float = ALPHA, adjust: str | None = None,
                  margin: float | Margin | None = None, cluster=None, n_boot: int = N_BOOT, seed: int = 0,
                  decide: bool = True, family: Family | str | None = None,
                  higher_is_better: bool | None = None) -> pd.DataFrame:
    """Test a family of paired comparisons and decide each one (issue 36).

    Binary comparisons: the exact sign test on the discordant units (clusters when clustered) and Newcombe's paired
    score interval (hulled with the cluster bootstrap's when clustered); no bootstrap is needed without clusters.
    Continuous and ratio comparisons: a **percentile** bootstrap interval over units or clusters (not BCa, whose
    jackknife acceleration is unstable with few clusters and many tied differences; the percentile interval is the one
    appendix 8.3 reports) and the sign-flip randomization test's p (exact up to ``2**k <= n_boot`` sign patterns).
    Holm then adjusts the p-values over the family, and :func:`judge` turns each row into its verdict.

    Args:
        diffs: comparison -> its paired data, in the family's order. A key is an ``(a, b)`` pair of arm labels (the
            comparison is ``a`` minus ``b``) or a name; a value is the pair ``(a_values, b_values)`` of aligned
            per-unit outcomes (0/1 or bools for ``"binary"``; positive times for ``"ratio"``, whose ratio is ``b /
            a``, i.e. how many times faster ``a`` is) or one array of per-unit differences (-1, 0, 1 for
            ``"binary"``: Newcombe's interval is then the hull over the unknown split of the concordant pairs) or
            ratios (``"ratio"``). Units with a NaN (in either arm) are left out of that comparison.
        kind: one of :data:`KINDS` (default: the family's).
        alpha: the family-wise level, in (0, 0.5).
        adjust: ``"holm"`` (default) or ``"none"`` (allowed for a family of one comparison only: the primary).
        margin: an equivalence margin around 0 in the comparison's unit (a :class:`Margin`, or a number declared
            with its source in the study's code); ``None`` (default: the family's): no equivalence verdict.
        cluster: cluster ids of the units (sources, traces), one array for every comparison (when they share the
            units) or a mapping key -> array; ``None``: every unit is its own cluster.
        n_boot: bootstrap replicates and sign-flip resamples per comparison (>= 100; 10,000 as appendix 8.3).
        seed: generator seed (comparison i uses ``np.random.default_rng([seed, i])``).
        decide: ``False`` at a plumbing-check size (:func:`decides`): every verdict is "not decided".
        family: the declared :class:`Family` (supplies kind, adjustment, margin and direction), or a name.
        higher_is_better: ``False`` when lower values of the endpoint are better (default: the family's, else True).

    Returns:
        One row per comparison (:data:`COLUMNS`): ``family``, ``comparison`` ("a vs b"), ``a``, ``b``, ``kind``,
        ``adjust``, ``estimate`` (mean difference a - b: a fraction for binary; the geometric-mean ratio for
        ratios), ``ci_low``/``ci_high`` (``1 - alpha``; NaN when degenerate), ``tost_low``/``tost_high`` (``1 - 2
        alpha``), ``p`` (exact sign test for binary, sign-flip randomization test otherwise), ``p_adj`` (Holm over
        the family; a comparison without units enters with p = 1), ``n`` (units), ``n_clusters``, ``n_discordant``
        (units with a nonzero difference: the discordant pairs of a binary comparison), ``family_size``, ``alpha``,
        ``margin``, ``margin_source``, ``higher_is_better``, ``mde`` (the smallest difference the size could
        separate at the family's first Holm step: ``k/n`` for binary, ``k`` the fewest same-direction discordant
        units whose exact test reaches it; about ``z * se`` for continuous, in the estimate's unit, log scale
        excluded) and ``verdict`` (:func:`judge`).

    Raises:
        ValueError: naming ``diffs`` when empty or a value is malformed (binary outcomes other than 0/1 or binary
            differences other than -1, 0, 1, unequal lengths, non-positive ratios), ``kind`` when unknown or
            contradicting the family, ``adjust`` when unknown or ``"none"`` for several comparisons, ``alpha``,
            ``n_boot`` or ``margin`` out of range, ``cluster`` when its length differs from a comparison's units,
            ``family`` when the family holds more comparisons than its ``max_size``.
    """
    fam = family if isinstance(family, Family) else None
    if fam is not None and kind is not None and kind != fam.kind:
        raise ValueError(f"kind={kind!r} contradicts family {fam.name!r} (kind {fam.kind!r})")
    kind = kind if kind is not None else (fam.kind if fam is not None else None)
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of {KINDS}")
    adjust = adjust if adjust is not None else (fam.adjust if fam is not None else "holm")
    if adjust not in ADJUSTMENTS:
        raise ValueError(f"adjust={adjust!r} must be one of {ADJUSTMENTS}")
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha={alpha!r} must lie in (0, 0.5)")
    n_boot = as_count(n_boot, "n_boot", minimum=100)
    if not diffs:
        raise ValueError("diffs is empty: a family needs at least one comparison")
    if adjust == "none" and len(diffs) > 1:
        raise ValueError(f"adjust='none' tests one comparison alone (a primary); this family has {len(diffs)}")
    if fam is not None and fam.max_size is not None and len(diffs) > fam.max_size:
        raise ValueError(f"family {fam.name!r} declares at most {fam.max_size} comparisons; got {len(diffs)}")
    if margin is None and fam is not None:
        margin = fam.margin
    source = margin.source if isinstance(margin, Margin) else ""
    margin_value = margin.value if isinstance(margin, Margin) else margin
    if margin_value is not None:
        if kind == "ratio":
            raise ValueError("margin: a ratio comparison has no equivalence margin")
        if not (isinstance(margin_value, (int, float)) and math.isfinite(margin_value) and margin_value > 0):
            raise ValueError(f"margin={margin_value!r} must be a finite number > 0")
    if higher_is_better is None:
        higher_is_better = fam.higher_is_better if fam is not None else True
    name = fam.name if fam is not None else (family or "")

    rows, sds = [], []
    for i, (key, value) in enumerate(diffs.items()):
        comparison, a_label, b_label = _as_key(key)
        a, b = _paired_values(key, value, kind)
        cl = cluster.get(key) if isinstance(cluster, Mapping) else cluster
        if cl is not None:
            cl = np.asarray(cl).reshape(-1)
            if cl.size != a.size:
                raise ValueError(f"cluster: {cl.size} ids for the {a.size} units of {comparison!r}")
        res = _one(kind, a, b, cl, alpha=alpha, n_boot=n_boot, rng=np.random.default_rng([seed, i]))
        sds.append(res.pop("_sd", float("nan")))
        rows.append({"family": name, "comparison": comparison, "a": a_label, "b": b_label, "kind": kind,
                     "adjust": adjust, **res})
    m = len(rows)
    raw = {str(i): (1.0 if math.isnan(r["p"]) else r["p"]) for i, r in enumerate(rows)}
    adjusted = holm(raw) if adjust == "holm" else raw
    null = 1.0 if kind == "ratio" else 0.0
    for i, (r, sd) in enumerate(zip(rows, sds)):
        r["p_adj"] = adjusted[str(i)] if not math.isnan(r["p"]) else float("nan")
        r.update(family_size=m, alpha=alpha, margin=float("nan") if margin_value is None else float(margin_value),
                 margin_source=source, higher_is_better=bool(higher_is_better))
        alpha_first = alpha / m if adjust == "holm" else alpha
        if kind == "binary":
            r["mde"] = _mde_units(r["n"], alpha_first)[1]
        else:
            r["mde"] = _z(1 - alpha_first) * sd if kind == "continuous" else float("nan")
        r["verdict"] = judge(r["estimate"], r["ci_low"], r["ci_high"], p_adj=r["p_adj"], alpha=alpha, null=null,
                             higher_is_better=bool(higher_is_better), tost=(r["tost_low"], r["tost_high"]),
                             margin=margin_value, n=r["n"], decide=decide)
    return pd.DataFrame(rows, columns=COLUMNS)



def in_units(table: pd.DataFrame, *, unit: str = "") -> pd.DataFrame:
    """:func:`paired_family` rows with each difference also in its printed unit (:data:`DIFF_COLUMNS`): the one
    paired-difference schema of the studies' tables (issue 39), never a unit in a column's name.

    A binary row's ``estimate``, ``ci_low``, ``ci_high`` and ``mde`` (fractions) become ``delta``, ``delta_low``,
    ``delta_high`` and ``delta_mde`` in points (×100, ``unit`` "pp"); a ratio row's are copied (``unit`` "x"; its
    ``mde`` is NaN); a continuous row's are copied with ``unit`` the endpoint's own unit (the argument). The
    decision columns are kept unchanged, so :func:`sentence` and :func:`family_lines` read the result as they read
    :func:`paired_family`'s.

    Args:
        table: rows of :func:`paired_family` (``kind``, ``estimate``, ``ci_low``, ``ci_high``, ``mde``); may be empty.
        unit: the unit of the continuous rows ("logits", "nats"; "" when the endpoint has none).

    Returns:
        A new frame: ``table``'s columns, then :data:`DIFF_COLUMNS` (float64 numbers, ``unit`` a string).

    Raises:
        ValueError: naming ``table`` when it lacks a column of :func:`paired_family` that the conversion reads, or
            holds a ``kind`` outside :data:`KINDS`.
    """
    need = ["kind", "estimate", "ci_low", "ci_high", "mde"]
    missing = [c for c in need if c not in table.columns]
    if missing:
        raise ValueError(f"table lacks {missing}: pass rows of sur_lab.analysis.decisions.paired_family")
    bad = sorted(set(table["kind"]) - set(KINDS))
    if bad:
        raise ValueError(f"table holds kinds {bad}; a paired_family row's kind is one of {KINDS}")
    kind = table["kind"].astype(str)
    scale = np.where(kind == "binary", 100.0, 1.0)
    out = table.copy()
    for col, src in zip(DIFF_COLUMNS[:4], need[1:]):
        out[col] = scale * table[src].to_numpy(np.float64)
    out["unit"] = np.where(kind == "binary", "pp", np.where(kind == "ratio", "x", unit)).astype(object)
    return out

# ---------------------------------------------------------------------------------------------------------------------
# Power: the smallest effect a declared size detects (issue 40)

#: The power a study's size statement is computed for (:func:`binary_mde`, :func:`continuous_mde`).
POWER = 0.8


@dataclass(frozen=True)
class PowerBasis:
    """What a study's power statement assumes about its primary comparison, declared in its code before the run.

    Attributes:
        value: for a ``"binary"`` family the discordance rate q in (0, 1], the share of paired cases whose two
            outcomes differ; for a ``"continuous"`` family the SD (> 0) of one unit's paired difference, in the
            comparison's unit; for a ``"ratio"`` family the SD (> 0) of one unit's log ratio.
        source: where it comes from (a paper's table, derived with :func:`discordance_from_interval`,
            :func:`discordance_from_marginals` or :func:`sd_from_interval`; or a planning value with its reason).
        unit: the printed unit of the effect (``"pp"`` scales a binary fraction by 100; ``"x"`` for ratios; else the
            continuous comparison's unit, e.g. ``"nats"``).
    """

    value: float
    source: str
    unit: str = "pp"

    def __post_init__(self) -> None:
        if not (isinstance(self.value, (int, float)) and not isinstance(self.value, bool)
                and math.isfinite(self.value) and self.value > 0):
            raise ValueError(f"value={self.value!r} must be a finite number > 0")
        if not self.source:
            raise ValueError("source is empty: say where the discordance rate or SD comes from")


def _check_power_args(alpha: float, family_size, power: float | None = None) -> int:
    if not (isinstance(alpha, (int, float)) and 0 < alpha < 1):
        raise ValueError(f"alpha={alpha!r} must lie in (0, 1)")
    if power is not None and not (isinstance(power, (int, float)) and 0 < power < 1):
        raise ValueError(f"power={power!r} must lie in (0, 1)")
    return as_count(family_size, "family_size", minimum=1)


def _unit_rate(value, name: str, *, low_open: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a number in {'(0' if low_open else '[0'}, 1]; got {value!r}")
    x = float(value)
    if not (0 < x <= 1 if low_open else 0 <= x <= 1):
        raise ValueError(f"{name}={value!r} must lie in {'(0' if low_open else '[0'}, 1]")
    return x


@lru_cache(maxsize=256)
def _sign_test_critical(n: int, alpha: float) -> np.ndarray:
    """``c[k]`` for ``k = 0..n`` discordant units: the largest count ``c`` of the rarer sign whose exact two-sided
    sign test (:func:`sign_test_p`) has ``p < alpha``; -1 where no split of ``k`` rejects. Read-only, cached."""
    c = np.full(n + 1, -1, dtype=np.int64)
    if n >= 1:
        k = np.arange(n + 1)[:, None]
        j = np.arange(n // 2 + 1)[None, :]
        ok = (j <= k // 2) & (sign_test_p(np.broadcast_to(j, (n + 1, j.size)),
                                          np.maximum(k - j, 0)) < alpha)
        # The rejection region of a symmetric two-sided test is a lower tail of the rarer count: c is its last member.
        c = np.where(ok.any(axis=1), ok.shape[1] - 1 - np.argmax(ok[:, ::-1], axis=1), -1)
    c.setflags(write=False)
    return c


def _cluster_signs(p_plus: float, p_minus: float, size: int) -> tuple[float, float]:
    """``(P(sum > 0), P(sum < 0))`` of the summed signs of ``size`` independent units, each +1 with ``p_plus``, -1
    with ``p_minus``, 0 otherwise (the sign a cluster enters the sign test with)."""
    dist = np.array([1.0])
    step = np.array([p_minus, 1.0 - p_plus - p_minus, p_plus])
    for _ in range(size):
        dist = np.convolve(dist, step)
    return float(dist[size + 1:].sum()), float(dist[:size].sum())


def sign_test_power(n: int, p_plus: float, p_minus: float, *, alpha: float = ALPHA) -> float:
    """Exact power of the two-sided exact sign test (:func:`sign_test_p`, the exact McNemar test) at level ``alpha``:
    the probability that ``n`` independent paired units, each positive with probability ``p_plus``, negative with
    ``p_minus`` and tied otherwise, give ``p < alpha``. With ``K ~ Binomial(n, p_plus + p_minus)`` discordant units and
    ``J | K ~ Binomial(K, p_plus / (p_plus + p_minus))`` positive ones, the test rejects when ``min(J, K - J) <=
    c_K`` (``c_K`` from :func:`sign_test_p`); the sum over ``K`` is exact (no normal approximation). 20 units all
    discordant, 80 % positive: 0.80.

    Args:
        n: paired units (clusters, when clustered), an integer >= 0 (0: power 0).
        p_plus, p_minus: probabilities in [0, 1] with ``p_plus + p_minus <= 1``.
        alpha: the test's level, in (0, 1) (a family's first Holm step: ``alpha / m``).

    Returns:
        The power, a float in [0, 1].

    Raises:
        TypeError: naming ``n`` when not an integer, ``p_plus``/``p_minus`` when not numbers.
        ValueError: naming ``n`` when negative, ``p_plus``/``p_minus`` outside [0, 1] or summing above 1, ``alpha``
            outside (0, 1).
    """
    n = as_count(n, "n", minimum=0)
    pp, pm = _unit_rate(p_plus, "p_plus", low_open=False), _unit_rate(p_minus, "p_minus", low_open=False)
    if pp + pm > 1 + 1e-12:
        raise ValueError(f"p_plus + p_minus = {pp + pm!r} must be <= 1")
    _check_power_args(alpha, 1)
    q = min(pp + pm, 1.0)
    if n == 0 or q == 0:
        return 0.0
    c = _sign_test_critical(n, float(alpha))
    k = np.arange(n + 1)
    pi = pp / q
    reject = np.where(c >= 0, binom.cdf(c, k, pi) + binom.sf(k - c - 1, k, pi), 0.0)
    return float(np.clip(np.sum(binom.pmf(k, n, q) * reject), 0.0, 1.0))


def _mixed_sign_power(signs: Sequence[tuple[float, float]], alpha: float) -> float:
    """Exact power of the sign test (:func:`sign_test_p` at ``alpha``) on independent units whose ``(P(+), P(-))``
    differ (clusters of unequal sizes): the joint law of the positive and negative counts, built unit by unit."""
    n = len(signs)
    dist = np.zeros((n + 1, n + 1))
    dist[0, 0] = 1.0
    for p_plus, p_minus in signs:
        new = dist * (1.0 - p_plus - p_minus)
        new[1:, :] += dist[:-1, :] * p_plus
        new[:, 1:] += dist[:, :-1] * p_minus
        dist = new
    c = _sign_test_critical(n, float(alpha))
    a, b = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    total = np.minimum(a + b, n)
    reject = (a + b <= n) & (np.minimum(a, b) <= c[total]) & (c[total] >= 0)
    return float(np.clip(dist[reject].sum(), 0.0, 1.0))


def binary_power(effect: float, n: int, discordance: float, *, cluster_size: int | Sequence[int] = 1,
                 alpha: float = ALPHA, family_size: int = 1) -> float:
    """Power of a binary comparison decided by :func:`paired_family`'s exact sign test, for a true difference
    ``effect = P(a = 1) - P(b = 1)`` of paired proportions with discordance rate ``q`` (the share of cases with
    ``a != b``): each case is ``(1, 0)`` with ``(q + effect) / 2``, ``(0, 1)`` with ``(q - effect) / 2``, tied
    otherwise, independently. Clustered comparisons (``cluster_size`` cases per cluster, as notebook 03's three
    placements of a source) enter the test by each cluster's summed sign, as :func:`paired_family` does; cases within a
    cluster are taken as independent (a positive within-cluster correlation lowers the power). The level is the
    family's first Holm step, ``alpha / family_size`` (``family_size=1``: the primary, tested alone).

    Args:
        effect: the difference, a fraction in ``[-q, q]``.
        n: clusters (cases without clustering), an integer >= 0.
        discordance: q in (0, 1].
        cluster_size: cases per cluster, an integer >= 1, or one size per cluster (a sequence of ``n`` integers:
            notebook 06's sources, each in as many workloads as its rank allows).
        alpha, family_size: the family's level and size.

    Returns:
        The power (:func:`sign_test_power` of the clusters' signs).

    Raises:
        TypeError / ValueError: naming ``effect`` outside ``[-q, q]``, ``discordance`` outside (0, 1], ``n``,
            ``cluster_size`` or ``family_size`` not an integer in range, ``alpha`` outside (0, 1).
    """
    q = _unit_rate(discordance, "discordance")
    if isinstance(effect, bool) or not isinstance(effect, (int, float, np.floating, np.integer)) \
            or not math.isfinite(float(effect)):
        raise TypeError(f"effect must be a finite number; got {effect!r}")
    d = float(effect)
    if abs(d) > q + 1e-12:
        raise ValueError(f"effect={effect!r} must lie in [-discordance, discordance] = [{-q:g}, {q:g}]: a difference "
                         "of paired proportions cannot exceed the share of discordant cases")
    m = _check_power_args(alpha, family_size)
    p_plus, p_minus = max((q + d) / 2, 0.0), max((q - d) / 2, 0.0)
    if isinstance(cluster_size, Sequence) and not isinstance(cluster_size, str):
        sizes = [as_count(x, "cluster_size", minimum=1) for x in cluster_size]
        if len(sizes) != as_count(n, "n", minimum=0):
            raise ValueError(f"cluster_size: {len(sizes)} sizes for n={n} clusters")
        if len(set(sizes)) > 1:
            return _mixed_sign_power([_cluster_signs(p_plus, p_minus, x) for x in sizes], alpha / m)
        cluster_size = sizes[0] if sizes else 1
    size = as_count(cluster_size, "cluster_size", minimum=1)
    if size > 1:
        p_plus, p_minus = _cluster_signs(p_plus, p_minus, size)
    return sign_test_power(n, p_plus, p_minus, alpha=alpha / m)


def binary_mde(n: int, discordance: float, *, cluster_size: int | Sequence[int] = 1, alpha: float = ALPHA,
               family_size: int = 1, power: float = POWER) -> float:
    """The minimal detectable effect of a binary comparison: the smallest difference ``d`` in (0, q] at which
    :func:`binary_power` reaches ``power`` (bisection to 1e-9; the power rises with ``d``). NaN when even ``d = q``
    (every discordant case one way) stays below it: this size cannot reach that power at that discordance rate. 48
    cases at q = 0.5: about 0.30 (30 points).

    Args:
        n, discordance, cluster_size, alpha, family_size: as :func:`binary_power`.
        power: the target power, in (0, 1) (default :data:`POWER`).

    Returns:
        ``d``, a fraction, or NaN.

    Raises:
        ValueError: naming ``power`` outside (0, 1); TypeError / ValueError: as :func:`binary_power`.
    """
    q = _unit_rate(discordance, "discordance")
    _check_power_args(alpha, family_size, power)

    def pw(d: float) -> float:
        return binary_power(d, n, q, cluster_size=cluster_size, alpha=alpha, family_size=family_size)

    if pw(q) < power:
        return float("nan")
    lo, hi = 0.0, q
    while hi - lo > 1e-9:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if pw(mid) >= power else (mid, hi)
    return hi


def continuous_power(effect: float, n: int, sd: float, *, alpha: float = ALPHA, family_size: int = 1) -> float:
    """Power of a continuous comparison (a paired mean difference, or a mean log ratio) on ``n`` units (clusters)
    whose differences have SD ``sd``: the power of the two-sided paired t-test at ``alpha / family_size``, exact for
    normal differences (noncentral t, ``scipy.stats.nct``); :func:`paired_family` decides these by a sign-flip test
    and a percentile bootstrap, whose power on normal data is close to the t-test's. 0 when the exact sign-flip test
    cannot reach the level at all (:func:`p_floor`: fewer than 6 units at 5 %). 34 units at effect / sd = 0.5: 0.81
    (Cohen's table).

    Raises:
        TypeError / ValueError: naming ``effect`` (not finite), ``n`` (not an integer >= 2), ``sd`` (not > 0),
            ``alpha``, ``family_size``.
    """
    n = as_count(n, "n", minimum=2)
    if isinstance(sd, bool) or not isinstance(sd, (int, float, np.floating)) or not (math.isfinite(sd) and sd > 0):
        raise ValueError(f"sd={sd!r} must be a finite number > 0")
    if isinstance(effect, bool) or not isinstance(effect, (int, float, np.floating)) or not math.isfinite(effect):
        raise TypeError(f"effect must be a finite number; got {effect!r}")
    m = _check_power_args(alpha, family_size)
    if p_floor(n) >= alpha / m:  # the exact sign-flip test cannot reach the level with this few units
        return 0.0
    df = n - 1
    crit = float(student_t.ppf(1 - alpha / m / 2, df))
    nc = float(effect) * math.sqrt(n) / float(sd)
    out = float(nct.sf(crit, df, nc) + nct.cdf(-crit, df, nc))
    return out if not math.isnan(out) else 1.0  # scipy's nct overflows far out in the tail, where the power is 1


def continuous_mde(n: int, sd: float, *, alpha: float = ALPHA, family_size: int = 1, power: float = POWER) -> float:
    """The minimal detectable effect of a continuous comparison: the smallest ``d > 0`` at which
    :func:`continuous_power` reaches ``power`` (``scipy.optimize.brentq``), in ``sd``'s unit. About ``(z_{1 -
    alpha / 2} + z_power) sd / sqrt(n)`` for large ``n``; 34 units at sd 1: 0.495. NaN when the power cannot be
    reached (fewer units than the exact test needs: :func:`p_floor`).

    Raises:
        ValueError: naming ``power`` outside (0, 1); TypeError / ValueError: as :func:`continuous_power`.
    """
    m = _check_power_args(alpha, family_size, power)
    continuous_power(0.0, n, sd, alpha=alpha, family_size=family_size)  # checks the arguments
    if p_floor(n) >= alpha / m:
        return float("nan")
    hi = float(sd)
    while continuous_power(hi, n, sd, alpha=alpha, family_size=family_size) < power:
        hi *= 2
    return float(brentq(lambda d: continuous_power(d, n, sd, alpha=alpha, family_size=family_size) - power, 0.0,
                        hi, xtol=1e-10))


def discordance_from_marginals(p_a: float, p_b: float) -> float:
    """A discordance rate from two arms' published success rates, taking their outcomes independent within a case:
    ``p_a (1 - p_b) + p_b (1 - p_a)`` (exact when one rate is 0 or 1: a Shift at 0 % EM disagrees with every case the
    other arm answers). Independence overstates q when the arms succeed on the same cases, so the stated MDE errs
    large.

    Raises:
        TypeError / ValueError: naming ``p_a``/``p_b`` outside [0, 1].
    """
    a, b = _unit_rate(p_a, "p_a", low_open=False), _unit_rate(p_b, "p_b", low_open=False)
    return a * (1 - b) + b * (1 - a)


def discordance_from_interval(estimate: float, low: float, high: float, n: int, *, confidence: float = 1 - ALPHA
                              ) -> float:
    """A discordance rate from a published paired difference of proportions and its interval: the paired variance
    ``(q - d^2) / n`` of the mean difference ``d`` over ``n`` cases, with its standard error read from the interval
    as ``(high - low) / (2 z)``: ``q = d^2 + n se^2``, never below ``|d|`` (a difference cannot exceed the discordant
    share) nor above 1. A stratified or clustered published interval is narrower or wider than the unclustered one;
    the source says which.

    Raises:
        ValueError: naming ``low`` when ``low > high``, ``estimate`` outside [-1, 1], ``n`` < 1, ``confidence``
            outside (0, 1).
    """
    n = as_count(n, "n", minimum=1)
    if not -1 <= estimate <= 1:
        raise ValueError(f"estimate={estimate!r} must be a difference of proportions in [-1, 1]")
    if low > high:
        raise ValueError(f"low={low!r} must be <= high={high!r}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} must lie in (0, 1)")
    se = (high - low) / (2 * _z(confidence))
    return float(min(1.0, max(abs(estimate), estimate ** 2 + n * se ** 2)))


def sd_from_interval(low: float, high: float, n: int, *, confidence: float = 1 - ALPHA) -> float:
    """The SD of one unit's difference from a published interval of a mean over ``n`` units: ``se sqrt(n)``, ``se =
    (high - low) / (2 z)`` (Table 15's NLL side interval, -0.099 to 0.021 nats over 275 sources: 0.51 nats).

    Raises:
        ValueError: naming ``low`` when ``low >= high``, ``n`` < 1, ``confidence`` outside (0, 1).
    """
    n = as_count(n, "n", minimum=1)
    if not low < high:
        raise ValueError(f"low={low!r} must be < high={high!r}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} must lie in (0, 1)")
    return float((high - low) / (2 * _z(confidence)) * math.sqrt(n))


def mde(family: Family, basis: PowerBasis, n: int, *, cluster_size: int | Sequence[int] = 1, family_size: int = 1,
        alpha: float = ALPHA, power: float = POWER) -> tuple[float, str]:
    """A declared comparison's minimal detectable effect at ``power``, two-sided ``alpha`` at the family's first Holm
    step, in the printed unit: ``(effect, unit)``. Binary families: :func:`binary_mde` at the basis' discordance rate,
    in points (``"pp"``) unless the basis says otherwise; continuous: :func:`continuous_mde` at the basis' SD, in its
    unit; ratio: the ratio ``exp(d)`` of :func:`continuous_mde` on the log scale (``"x"``). The effect is NaN when
    the size cannot reach ``power`` (a binary comparison with too few cases). Each study's ``mde(params)`` calls it
    with its preset's size.

    Args:
        family: the declared :class:`Family` (its kind; a primary family tests alone: ``family_size`` must be 1).
        basis: the declared :class:`PowerBasis`.
        n: paired units (clusters when clustered).
        cluster_size: cases per cluster, or one size per cluster (binary families; :func:`binary_power`).
        family_size, alpha, power: as :func:`binary_mde`.

    Raises:
        TypeError: naming ``family`` / ``basis`` when not a Family / PowerBasis.
        ValueError: naming ``family_size`` when a primary family is given more than one comparison; as the
            functions it calls.
    """
    if not isinstance(family, Family):
        raise TypeError(f"family must be a Family; got {type(family).__name__}")
    if not isinstance(basis, PowerBasis):
        raise TypeError(f"basis must be a PowerBasis; got {type(basis).__name__}")
    if family.primary and family_size != 1:
        raise ValueError(f"family_size={family_size!r}: a primary family tests one comparison alone")
    if family.kind == "binary":
        d = binary_mde(n, basis.value, cluster_size=cluster_size, alpha=alpha, family_size=family_size, power=power)
        return (100.0 * d if basis.unit == "pp" else d), basis.unit
    if n < 2:  # one unit detects nothing (the exact sign-flip test needs 6 at 5 %)
        return float("nan"), ("x" if family.kind == "ratio" else basis.unit)
    d = continuous_mde(n, basis.value, alpha=alpha, family_size=family_size, power=power)
    if family.kind == "ratio":
        return (math.exp(d) if not math.isnan(d) else d), "x"
    return d, basis.unit


def power_sentence(comparison: str, family: Family, basis: PowerBasis, n: int, *,
                   cluster_size: int | Sequence[int] = 1,
                   what: str = "cases", clusters: str | None = None, family_size: int = 1, alpha: float = ALPHA,
                   power: float = POWER) -> str:
    """A declared size's power statement in words, for a notebook's "This run" cell and the docs: ``"Power: SUR 5%
    vs Shift (tested alone) on 48 cases detects a difference of 30.1 pp or more with 80 % power (exact sign test,
    two-sided 5 %; stated discordance 50 %: ...)"``; when the size cannot reach that power, it says so.

    Args:
        comparison: the primary comparison in words ("SUR 5% vs Shift on the lead endpoint").
        family, basis, n, cluster_size, family_size, alpha, power: as :func:`mde`.
        what: what a case is ("cases", "requests", "turns").
        clusters: what a cluster is ("sources", "traces"); ``None``: units are not clustered (``n`` counts ``what``).

    Raises:
        TypeError / ValueError: as :func:`mde`.
    """
    effect, unit = mde(family, basis, n, cluster_size=cluster_size, family_size=family_size, alpha=alpha,
                       power=power)
    how = "tested alone" if family_size == 1 else f"first Holm step of {family_size}"
    sizes = list(cluster_size) if isinstance(cluster_size, Sequence) else [cluster_size] * int(n)
    if clusters is None:
        size = _count(int(n), what)
    elif len(set(sizes)) > 1:
        size = f"{_count(sum(sizes), what)} in {_count(int(n), clusters)}"
    elif sizes and sizes[0] > 1:
        size = f"{_count(int(n), clusters)} of {sizes[0]} {what}"
    else:
        size = _count(int(n), clusters)
    level = f"two-sided {100 * alpha:g} %"
    if family.kind == "binary":
        test = f"exact sign test, {level}"
        stated = f"stated discordance {100 * basis.value:.3g} % of {what}: {basis.source}"
    else:
        test = f"t approximation of the sign-flip test{', log scale' if family.kind == 'ratio' else ''}, {level}"
        sd_unit = "" if family.kind == "ratio" else f" {basis.unit}"
        stated = (f"stated SD {basis.value:.3g}{sd_unit} per {(clusters or what).rstrip('s')}"
                  f"{' of the log ratio' if family.kind == 'ratio' else ''}: {basis.source}")
    head = f"Power: {comparison} ({how}) on {size}"
    if math.isnan(effect):
        return (f"{head} cannot reach {100 * power:g} % power for any difference ({test}; {stated})")
    shown = effect_text(effect, unit)
    shown = (f"a ratio of {shown} (or 1/{shown}) or more" if family.kind == "ratio"
             else f"a difference of {shown} or more")
    return f"{head} detects {shown} with {100 * power:g} % power ({test}; {stated})"


def effect_text(effect: float, unit: str) -> str:
    """A minimal detectable effect (:func:`mde`) in its unit: ``"29.3 pp"``, ``"1.23x"``, ``"0.495 nats"``;
    ``"none"`` when NaN (the size cannot reach the power). The one format of :func:`power_sentence` and
    :func:`sur_lab.studies.power_table`."""
    if math.isnan(effect):
        return "none"
    return f"{effect:.1f} pp" if unit == "pp" else f"{effect:.2f}x" if unit == "x" else f"{effect:.3g} {unit}"


@dataclass(frozen=True)
class PowerDesign:
    """A study's primary comparison for its power statement (issue 40): each study declares one and its
    ``mde(params)`` / ``power_line(params)`` call :meth:`mde` / :meth:`line` with the study's parameters.

    Attributes:
        comparison: the comparison in words (:func:`power_sentence`).
        family: the declared :class:`Family`.
        basis: the declared :class:`PowerBasis`.
        size: ``fn(params) -> n`` or ``(n, cluster_size)``: paired units (clusters when clustered) and cases per
            cluster (one int, or one size per cluster) at the study's parameters.
        what, clusters: as :func:`power_sentence`.
    """

    comparison: str
    family: Family
    basis: PowerBasis
    size: Callable[[Mapping[str, Any]], Any]
    what: str = "cases"
    clusters: str | None = None

    def _size(self, p: Mapping[str, Any]) -> tuple[int, Any]:
        size = self.size(p)
        return size if isinstance(size, tuple) else (size, 1)

    def mde(self, p: Mapping[str, Any]) -> tuple[float, str]:
        """:func:`mde` at the size of parameters ``p``: ``(effect, unit)``."""
        n, cluster_size = self._size(p)
        return mde(self.family, self.basis, n, cluster_size=cluster_size)

    def line(self, p: Mapping[str, Any]) -> str:
        """:func:`power_sentence` at the size of parameters ``p``."""
        n, cluster_size = self._size(p)
        return power_sentence(self.comparison, self.family, self.basis, n, cluster_size=cluster_size,
                              what=self.what, clusters=self.clusters)


# ---------------------------------------------------------------------------------------------------------------------
# Words


def _num(x: float, unit: str, scale: float, digits: int, *, sign: bool = True, with_unit: bool = True) -> str:
    """``x`` printed in ``unit``: scaled, signed unless ``sign=False``, the unit after it unless ``with_unit=False``."""
    if unit == "x":
        return f"{x:.{digits}f}x"
    value = scale * x
    if unit == "":
        return f"{value:+.{digits}g}" if sign else f"{value:.{digits}g}"
    text = f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"
    return f"{text} {unit}" if with_unit else text


def _count(n: int, what: str) -> str:
    """``"1 case"``, ``"48 cases"``: ``what`` is plural; a count of one drops its final s."""
    return f"{n} {what[:-1] if n == 1 and what.endswith('s') else what}"


def _p(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.2g}"


def sentence(row, *, unit: str | None = None, digits: int | None = None, what: str = "cases",
             clusters: str = "clusters", words: tuple[str, str] | None = None, na: str = "no paired unit",
             family_name: bool = True) -> str:
    """One decided comparison (a row of :func:`paired_family`) in words, naming its family and size.

    Examples: ``"SUR 5% beats Dense tokens 5%: +12.5 pp (95 % CI +4.2 to +20.8; 48 cases, 7 discordant; Holm over 22
    comparisons, p_adj 0.012)"``; ``"SUR 5% vs Shift: not separated at this size, +4.2 pp (95 % CI -2.1 to +10.4; 48
    cases, 5 discordant; tested alone (primary), p 0.22); the smallest difference this size could separate is 12.5
    pp"``; ``"... : not decided at this size (a plumbing check), ..."``; ``"Evidence side and 0 are equivalent within
    ±0.1 nats (90 % CI -0.05 to +0.03 inside the margin, from the paper's Table 15 interval; ...)"``.

    Args:
        row: a row of :func:`paired_family` (a Series or a namedtuple from ``itertuples``).
        unit: printed unit ("pp" scales a fraction by 100; "x" for ratios; "" none); default by kind.
        digits: decimals (significant digits for ""); default by kind.
        what: what ``n`` counts ("cases", "sources", "turns").
        clusters: what a cluster is ("sources", "traces"), printed when units are clustered.
        words: the separated verdicts' words (higher side, lower side); default "beats"/"loses to", for ratios
            "is faster than"/"is slower than".
        na: why a comparison has no unit ("no stale-eligible case").
        family_name: name the family after its size (``False`` under a line that names it:
            :func:`family_summary`).

    Returns:
        The sentence, without a final period.
    """
    get = row.get if isinstance(row, Mapping) or isinstance(row, pd.Series) else (lambda k, d=None: getattr(row, k, d))
    kind = get("kind")
    d_unit, scale, d_digits = _UNITS[kind]
    unit = d_unit if unit is None else unit
    scale = 100.0 if unit == "pp" else 1.0
    digits = d_digits if digits is None else digits
    up, down = words or _WORDS[kind]
    a, b, verdict = get("a"), get("b"), get("verdict")
    head = f"{a} vs {b}" if b else str(a)
    if verdict == NA:
        return f"{head}: n/a ({na})"
    n, ncl = int(get("n")), int(get("n_clusters"))
    units = _count(n, what) + (f" in {_count(ncl, clusters)}" if ncl != n else "")
    if kind == "binary":
        units += f", {int(get('n_discordant'))} discordant"
    alpha = float(get("alpha"))
    conf = f"{100 * (1 - alpha):g} % CI"
    est = _num(get("estimate"), unit, scale, digits)
    low, high = float(get("ci_low")), float(get("ci_high"))
    if math.isnan(low):
        units_of = _count(ncl, clusters if ncl != n else what)
        interval = (f"no interval: {units_of}" if ncl == 1 else
                    f"no interval: every one of the {units_of} has the same difference")
    else:
        interval = (f"{conf} {_num(low, unit, scale, digits, with_unit=False)} to "
                    f"{_num(high, unit, scale, digits, with_unit=False)}")
    p, p_adj, m = float(get("p")), float(get("p_adj")), int(get("family_size"))
    fam = (get("family") or "") if family_name else ""
    if get("adjust") == "none":
        mult = f"tested alone{' (' + fam + ')' if fam else ''}, p {_p(p)}"
    else:
        mult = f"Holm over {m} comparison{'s' if m != 1 else ''}{' of ' + fam if fam else ''}, p_adj {_p(p_adj)}"
    details = f"({interval}; {units}; {mult})"
    if verdict == NOT_DECIDED:
        return f"{head}: not decided at this size (a plumbing check), {est} ({interval}; {units})"
    if verdict in (BEATS, LOSES):
        return f"{a} {up if verdict == BEATS else down} {b}: {est} {details}"
    if verdict == EQUIVALENT:
        mg = _num(float(get("margin")), unit, scale, digits, sign=False)
        src = get("margin_source") or ""
        t_conf = f"{100 * (1 - 2 * alpha):g} % CI"
        t_low, t_high = (_num(float(get(k)), unit, scale, digits, with_unit=False) for k in ("tost_low", "tost_high"))
        return (f"{a} and {b} are equivalent within ±{mg}: {est} ({t_conf} {t_low} to {t_high} inside the margin"
                f"{' (' + src + ')' if src else ''}; {units}; {mult})")
    tail = ""
    me = float(get("mde"))
    if kind == "binary" and not math.isnan(me):
        tail = (f"; the smallest difference this size could separate is {_num(me, unit, scale, digits, sign=False)}"
                if me <= 1 else f"; {_count(n, what)} are too few for any difference to separate at this level")
    elif kind == "continuous" and not math.isnan(me):
        tail = ("; the smallest difference this size could separate is about "
                f"{_num(me, unit, scale, digits, sign=False)}")
    margin = float(get("margin"))
    if not math.isnan(margin):
        tail += (f"; its {100 * (1 - 2 * alpha):g} % interval is not inside the ±"
                 f"{_num(margin, unit, scale, digits, sign=False)} equivalence margin")
    what_not = f" (not shown {up.removeprefix('is ').removesuffix(' than')})" if kind == "ratio" else ""
    return f"{head}: not separated at this size{what_not}, {est} {details}{tail}"


def sentences(table: pd.DataFrame, **kw) -> list[str]:
    """:func:`sentence` of every row of a :func:`paired_family` table (``kw`` as :func:`sentence`)."""
    return [sentence(r, **kw) for _, r in table.iterrows()]


def family_lines(table: pd.DataFrame, *, indent: str = "  ", **kw) -> list[str]:
    """Every family of a decided table in words: per family (in order of appearance) its :func:`family_summary`,
    then each comparison's :func:`sentence` (``kw`` as :func:`sentence`; the family is named once, in its line)."""
    lines = []
    for _, block in table.groupby("family", sort=False):
        lines.append(family_summary(block) + ":")
        lines += [indent + sentence(r, family_name=False, **kw) for _, r in block.iterrows()]
    return lines


def family_summary(table: pd.DataFrame) -> str:
    """One line on a family's outcome: ``"SUR against the other allocators (Holm over 8 comparisons): 2 beats, 1
    loses to, 5 not separated"``."""
    if table.empty:
        return "no comparison"
    r = table.iloc[0]
    m = int(r["family_size"])
    how = "tested alone" if r["adjust"] == "none" else f"Holm over {_count(m, 'comparisons')}"
    counts = table["verdict"].value_counts()
    said = ", ".join(f"{int(counts[v])} {v}" for v in VERDICTS if v in counts)
    return f"{r['family'] or 'family'} ({how}): {said}"


# ---------------------------------------------------------------------------------------------------------------------
# Claims about one proportion, ratios decided on their interval, the best of several


def bound_claim(k: int, n: int, *, at_least: float | None = None, at_most: float | None = None, alpha: float = ALPHA,
                decide: bool = True) -> str:
    """Whether "at least X" or "at most Y" holds for a proportion k / n, by its Clopper–Pearson bounds.

    "at least X" holds when the lower bound of the two-sided ``1 - alpha`` exact interval is ``>= X`` and fails when
    the upper bound is ``< X``; "at most Y" holds when the upper bound is ``<= Y`` and fails when the lower bound is
    ``> Y``. Otherwise the size cannot show it: "not shown". 2 of 2 preserved does not show "at least 95 %" (lower
    bound 16 %); 0 of 12 losses does not show "at most 5 points" (upper bound 26 %).

    Returns:
        :data:`HOLDS`, :data:`FAILS`, :data:`NOT_SHOWN`, or :data:`NOT_DECIDED` without ``decide``.

    Raises:
        ValueError: naming ``at_least``/``at_most`` unless exactly one is given in [0, 1]; as
            :func:`proportion_interval`.
    """
    if (at_least is None) == (at_most is None):
        raise ValueError("give exactly one of at_least, at_most")
    threshold = at_least if at_least is not None else at_most
    if not 0 <= threshold <= 1:
        raise ValueError(f"{'at_least' if at_least is not None else 'at_most'}={threshold!r} must lie in [0, 1]")
    _, low, high = proportion_interval(k, n, alpha=alpha)
    if not decide:
        return NOT_DECIDED
    if at_least is not None:
        return HOLDS if low >= at_least else (FAILS if high < at_least else NOT_SHOWN)
    return HOLDS if high <= at_most else (FAILS if low > at_most else NOT_SHOWN)


def claim_verdict(verdict: str, expect: str) -> str:
    """A paper's claim judged by one decided comparison: one of :data:`CLAIM_VERDICTS`.

    ``expect="greater"`` (the claim says A exceeds B) holds on "beats" and does not hold on "loses to"; ``"less"``
    the reverse; ``"equivalent"`` (a claim of no difference, which needs the comparison's declared margin) holds on
    "equivalent" and does not hold on a separation either way. Anything else ("not separated", "not decided", "n/a")
    is "undecided at this size".

    Args:
        verdict: a comparison's verdict (:data:`VERDICTS`, from :func:`paired_family` or :func:`judge`).
        expect: one of :data:`CLAIM_EXPECTATIONS`.

    Raises:
        ValueError: naming ``expect`` when it is not one of :data:`CLAIM_EXPECTATIONS`.
    """
    if expect not in CLAIM_EXPECTATIONS:
        raise ValueError(f"expect must be one of {CLAIM_EXPECTATIONS}; got {expect!r}")
    holds = {"greater": BEATS, "less": LOSES, "equivalent": EQUIVALENT}[expect]
    fails = {"greater": (LOSES,), "less": (BEATS,), "equivalent": (BEATS, LOSES)}[expect]
    return CLAIM_VERDICTS[0] if verdict == holds else CLAIM_VERDICTS[1] if verdict in fails else CLAIM_VERDICTS[2]


def claim_of_outcome(outcome: bool | None, *, negate: bool = False) -> str:
    """A claim's verdict (:data:`CLAIM_VERDICTS`) from an outcome decided elsewhere in this module: ``True`` (the
    decided result says what the claim says) -> "holds", ``False`` -> "does not hold", ``None`` (not decided, not
    separated, not run) -> "undecided at this size". ``negate=True`` is for a claim that states the opposite of the
    decided result (e.g. "falls short of" read from a bound that says "reaches"): a decided outcome flips, an
    undecided one stays undecided."""
    if outcome is None:
        return CLAIM_VERDICTS[2]
    return CLAIM_VERDICTS[0] if bool(outcome) != negate else CLAIM_VERDICTS[1]


def claim_of_bound(word: str, *, negate: bool = False) -> str:
    """:func:`claim_of_outcome` of a :func:`bound_claim` word: "holds" -> ``True``, "fails" -> ``False``, anything
    else ("not shown", "not decided") -> undecided."""
    return claim_of_outcome({HOLDS: True, FAILS: False}.get(word), negate=negate)


def claim_rank(verdict: str) -> int:
    """How strongly a claim verdict supports its claim, for a conjunction's weakest part: "does not hold" 0,
    "undecided at this size" 1, "holds" 2.

    Raises:
        ValueError: naming ``verdict`` when it is not one of :data:`CLAIM_VERDICTS`.
    """
    order = (CLAIM_VERDICTS[1], CLAIM_VERDICTS[2], CLAIM_VERDICTS[0])
    if verdict not in order:
        raise ValueError(f"verdict must be one of {CLAIM_VERDICTS}; got {verdict!r}")
    return order.index(verdict)


def claim_reading(a: str, b: str, *, expect: str = "greater") -> str:
    """What a claim's "holds" means for the comparison ``a`` vs ``b``, in this module's words: ``"'holds' reads
    SUR-IDF beats SUR"``.

    Raises:
        ValueError: naming ``expect`` when it is not one of :data:`CLAIM_EXPECTATIONS`.
    """
    if expect not in CLAIM_EXPECTATIONS:
        raise ValueError(f"expect must be one of {CLAIM_EXPECTATIONS}; got {expect!r}")
    word = {"greater": BEATS, "less": LOSES, "equivalent": f"is {EQUIVALENT} to"}[expect]
    return f"'{CLAIM_VERDICTS[0]}' reads {a} {word} {b}"


def bound_sentence(what: str, k: int, n: int, *, at_least: float | None = None, at_most: float | None = None,
                   alpha: float = ALPHA, decide: bool = True, units: str = "requests") -> str:
    """:func:`bound_claim` in words, with the bound it read: ``"preserves 100 % (2 of 2 requests; 95 % CI 16 % to 100
    %): at least 95 % not shown at this size (lower bound 16 %)"``."""
    verdict = bound_claim(k, n, at_least=at_least, at_most=at_most, alpha=alpha, decide=decide)
    est, low, high = proportion_interval(k, n, alpha=alpha)
    head = (f"{what} {100 * est:.0f} % ({k} of {_count(n, units)}; {100 * (1 - alpha):g} % CI {100 * low:.0f} % to "
            f"{100 * high:.0f} %)")
    claim = f"at least {100 * at_least:g} %" if at_least is not None else f"at most {100 * at_most:g} %"
    bound = f"lower bound {100 * low:.0f} %" if at_least is not None else f"upper bound {100 * high:.0f} %"
    if verdict == NOT_DECIDED:
        return f"{head}: {claim} not decided at this size (a plumbing check)"
    said = {HOLDS: "holds", FAILS: "fails", NOT_SHOWN: "not shown at this size"}[verdict]
    return f"{head}: {claim} {said} ({bound})"


def ratio_verdict(estimate: float, low: float, high: float, *, decide: bool = True) -> str:
    """A speed-up decided on its interval: "beats" (faster) only when the lower bound is above 1, "loses to"
    (slower) when the upper bound is below 1, else "not separated" (:func:`judge` with ``null=1``; 1.01x with
    interval 0.80x to 1.30x is not faster)."""
    return judge(estimate, low, high, null=1.0, decide=decide)


def best_of(outcomes: Mapping[str, Sequence], *, kind: str, what: str = "arms", value_unit: str = "%",
            value_scale: float = 100.0, digits: int = 0, higher_is_better: bool = True, cluster=None,
            alpha: float = ALPHA, n_boot: int = N_BOOT, seed: int = 0, decide: bool = True) -> str:
    """The best of several arms by point estimate, with the selection named: ``"SUR 5% has the highest point
    estimate of 8 arms (83 %); not separated from the next 3 (SUR-IDF 5% 80 %, ...)"``; ties are ties (``"Erratum,
    SUR 2% and SUR-IDF 2% tie at 100 % (the highest of 5 arms)"``); arms without a value are "n/a".

    The leader (the highest mean; the lowest with ``higher_is_better=False``) is compared with every other arm by
    :func:`paired_family` (Holm over those comparisons), so the sentence says which arms it separates from; a point
    maximum over many arms is never a winner on its own.

    Args:
        outcomes: arm label -> its per-unit outcomes, aligned over the same units (NaN: no value on that unit).
        kind: ``"binary"`` or ``"continuous"``.
        what: what the arms are ("arms", "configurations").
        value_unit, value_scale, digits: how an arm's mean is printed (``"%"``, 100, 0).
        higher_is_better, cluster, alpha, n_boot, seed, decide: as :func:`paired_family`.

    Raises:
        ValueError: naming ``outcomes`` when empty; as :func:`paired_family`.
    """
    if not outcomes:
        raise ValueError("outcomes is empty")
    means = {k: (float(np.nanmean(np.asarray(v, dtype=np.float64))) if np.any(~np.isnan(np.asarray(v, dtype=float)))
                 else float("nan")) for k, v in outcomes.items()}
    valued = {k: v for k, v in means.items() if not math.isnan(v)}
    total = len(outcomes)
    if not valued:
        return f"n/a (no {what[:-1] if what.endswith('s') else what} has a value)"

    def fmt(v: float) -> str:
        return f"{value_scale * v:.{digits}f}{' ' + value_unit if value_unit else ''}"

    top = max(valued.values()) if higher_is_better else min(valued.values())
    tied = [k for k, v in valued.items() if v == top]
    leader = tied[0]
    others = [k for k in outcomes if k != leader and not math.isnan(means[k])]
    if len(tied) > 1:
        names = ", ".join(tied[:-1]) + f" and {tied[-1]}"
        head = f"{names} tie at {fmt(top)} (the {'highest' if higher_is_better else 'lowest'} of {total} {what})"
    else:
        head = (f"{leader} has the {'highest' if higher_is_better else 'lowest'} point estimate of {total} {what} "
                f"({fmt(top)})")
    rest = [k for k in others if k not in tied]
    if not rest:
        return head
    diffs = {(leader, k): (np.asarray(outcomes[leader], dtype=np.float64), np.asarray(outcomes[k], dtype=np.float64))
             for k in rest}
    res = paired_family(diffs, kind=kind, alpha=alpha, cluster=cluster, n_boot=n_boot, seed=seed, decide=decide,
                        family=f"the leader against the other {what}", higher_is_better=higher_is_better)
    if not decide:
        return f"{head}; not decided at this size (a plumbing check)"
    close = [r.b for r in res.itertuples() if r.verdict not in (BEATS,)]
    far = [r.b for r in res.itertuples() if r.verdict == BEATS]
    parts = [head]
    if close:
        parts.append(f"not separated from the next {len(close)} ({', '.join(f'{k} {fmt(means[k])}' for k in close)})")
    if far:
        parts.append(f"separated from {len(far)} (Holm over {len(rest)})")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------------------------------
# Calibration: families simulated under the null (tests/test_decisions.py, scripts/decision_calibration.py)


def arm_pairs(arms: Sequence[str], budgets: Sequence[float], *, unbudgeted: Sequence[str] = (),
              baselines: Sequence[str] = ()) -> list[tuple[str, str]]:
    """Every pair of arms at each budget and each arm against each baseline: the shape of the old all-pairs tables
    (notebook 09's 38 comparisons per endpoint: four budgeted arms and Erratum at two budgets, against each other and
    against Shift and Re-prefill). Budgeted arms are labelled ``"SUR 5%"``; an unbudgeted arm meets the baselines
    once."""
    pairs: list[tuple[str, str]] = [(u, base) for u in unbudgeted for base in baselines]
    for b in budgets:
        at = [f"{a} {b:g}%" for a in arms] + list(unbudgeted)
        pairs += [(x, y) for i, x in enumerate(at) for y in at[i + 1:]]
        pairs += [(f"{a} {b:g}%", base) for a in arms for base in baselines]
    return pairs


#: The family shapes the null calibration simulates (issue 36): notebook 09's all-pairs table (38 comparisons per
#: endpoint, before issue 36 cut it to a primary and two small families) and notebook 02's "SUR against 11 rivals"
#: at two budgets (22 comparisons).
CALIBRATION_SHAPES: dict[str, list[tuple[str, str]]] = {
    "09 all pairs (38)": arm_pairs(("SUR", "SUR-IDF", "Edit-local window", "Edit-local + SUR"), (2, 5),
                                   unbudgeted=("Erratum",), baselines=("Shift", "Re-prefill")),
    "02 SUR vs 11 rivals (22)": [(f"SUR {b}%", f"rival {k} {b}%") for b in (2, 5) for k in range(1, 12)],
}


def simulate_families(pairs: Sequence[tuple[str, str]], *, kind: str = "binary", n_units: int = 48,
                      n_families: int = 200, effect: Mapping[str, float] | None = None, alpha: float = ALPHA,
                      n_boot: int = 1_000, seed: int = 0, rule: str = "decisions") -> np.ndarray:
    """How many comparisons of each of ``n_families`` simulated families :func:`paired_family` separates.

    Units (cases) differ in difficulty: binary outcomes are Bernoulli(q_i) with ``q_i ~ Beta(2, 2)`` per unit,
    independently per arm (so every arm has the same success probability on a unit: the null, unless ``effect``
    adds to an arm's probability, clipped to [0, 1]); continuous outcomes are ``u_i + e`` with unit effects
    ``u_i ~ N(0, 1)``, noise ``e ~ N(0, 1)`` per arm and unit, plus ``effect``.

    Args:
        pairs: the family's comparisons, ``(a, b)`` arm labels.
        kind: ``"binary"`` or ``"continuous"``.
        n_units: paired units per family.
        n_families: families simulated.
        effect: arm -> added success probability (binary) or mean (continuous); ``None``: the null.
        alpha, n_boot: as :func:`paired_family`.
        seed: generator seed (family f uses ``np.random.default_rng([seed, f])``).
        rule: ``"decisions"`` counts the "beats" and "loses to" verdicts; ``"pointwise"`` counts the ``1 - alpha``
            intervals that exclude 0, with no test and no family control (the rule before issue 36), for contrast.

    Returns:
        int64 array (n_families,): the separated comparisons of each family.
    """
    if kind not in ("binary", "continuous"):
        raise ValueError(f"kind={kind!r} must be 'binary' or 'continuous'")
    if rule not in ("decisions", "pointwise"):
        raise ValueError(f"rule={rule!r} must be 'decisions' or 'pointwise'")
    arms = list(dict.fromkeys(x for p in pairs for x in p))
    effect = dict(effect or {})
    counts = np.zeros(n_families, dtype=np.int64)
    for f in range(n_families):
        rng = np.random.default_rng([seed, f])
        if kind == "binary":
            q = rng.beta(2.0, 2.0, size=n_units)
            out = {a: (rng.random(n_units) < np.clip(q + effect.get(a, 0.0), 0, 1)).astype(np.float64) for a in arms}
        else:
            u = rng.normal(size=n_units)
            out = {a: u + rng.normal(size=n_units) + effect.get(a, 0.0) for a in arms}
        res = paired_family({p: (out[p[0]], out[p[1]]) for p in pairs}, kind=kind, alpha=alpha, n_boot=n_boot,
                            seed=f)
        if rule == "decisions":
            counts[f] = int(res["verdict"].isin([BEATS, LOSES]).sum())
        else:
            counts[f] = int(((res["ci_low"] > 0) | (res["ci_high"] < 0)).sum())
    return counts
