"""Budgets, allowances, supports and intervals (Eq. 3, appendix 7.1, Algorithm 1 steps 1 and 9).

Vocabulary: the *budget* b is a percentage of the S retained suffix tokens; its *allowance* B = B(S, b) is a count of
positions; a *support* is the sorted set of suffix positions to refresh; an *interval* is a maximal run of consecutive
support positions (R of them). Support positions are suffix-local (0 .. S-1); ``absolute(prefix_len)`` maps them to
positions in the edited context. A :class:`Selection` is a support as an allocator returns it (with its selection time
and diagnostics); it lives here, beside :class:`Support`, so that modules that only carry one (``sync``, ``repair``'s
results) need no allocator.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from sur_lab.checks import user_stacklevel


class BudgetFractionWarning(UserWarning):
    """A budget in (0, 1) percent, which is usually a fraction meant as a percentage (0.05 for 5 %)."""


#: Within a ``fractions_expected()`` block (or a call that already warned) budgets below 1 % raise no warning.
_FRACTIONS_EXPECTED: contextvars.ContextVar[bool] = contextvars.ContextVar("sur_lab_fractions_expected", default=False)


@contextlib.contextmanager
def fractions_expected() -> Iterator[None]:
    """Budgets below 1 % are meant inside this block: no :class:`BudgetFractionWarning`.

    For a caller who does mean, e.g., 0.5 % of the suffix; the library also wraps its own nested budget checks in it,
    so one user call warns once. (``warnings.filterwarnings("ignore", category=BudgetFractionWarning)`` silences the
    warning everywhere.)
    """
    token = _FRACTIONS_EXPECTED.set(True)
    try:
        yield
    finally:
        _FRACTIONS_EXPECTED.reset(token)


def warn_if_fraction(budget_pct: float) -> None:
    """Warn (:class:`BudgetFractionWarning`, a ``UserWarning``) when 0 < ``budget_pct`` < 1.

    b is a percentage of the suffix (Eq. 3): ``budget_pct=0.05`` is 0.05 %, an allowance of 1 position on any suffix
    up to 2,000 tokens, not 5 %. No warning inside :func:`fractions_expected`. Called by the public entry points
    (``repair``, ``recover``, ``AllocationRequest``, ``EditSession``) after :func:`check_budget`.
    """
    if 0.0 < budget_pct < 1.0 and not _FRACTIONS_EXPECTED.get():
        b, pct = f"{budget_pct:g}", f"{budget_pct * 100:g}"
        warnings.warn(
            f"budget_pct is a percentage of the suffix; {b} means {b} %, not {pct} % (pass budget_pct={pct} for "
            f"that; wrap the call in sur_lab.budget.fractions_expected() when {b} % is meant)",
            BudgetFractionWarning,
            stacklevel=user_stacklevel(),
        )


def check_budget(budget_pct: float) -> float:
    """Validate a budget in percent.

    Raises:
        ValueError: if ``budget_pct`` is not a finite real number in [0, 100] (strings and booleans are refused,
            not converted).
    """
    if isinstance(budget_pct, (str, bytes, bool, np.bool_)):
        raise ValueError(f"budget_pct must be a number in [0, 100]; got {budget_pct!r}")
    try:
        value = float(budget_pct)
    except (TypeError, ValueError):
        raise ValueError(f"budget_pct must be a number in [0, 100]; got {budget_pct!r}") from None
    if not math.isfinite(value) or not 0.0 <= value <= 100.0:
        raise ValueError(f"budget_pct must be in [0, 100] (percent of the suffix); got {budget_pct!r}")
    return value


def allowance(suffix_len: int, budget_pct: float) -> int:
    """Allowance B(S, b) = min(S, ceil(S * b / 100)) positions (Eq. 3).

    The product is formed exactly (as a fraction of the decimal value of b) so that, e.g., S = 100 and b = 7 gives 7,
    not 8 from a float rounding of 7.000000000000001.

    Args:
        suffix_len: S >= 0, retained suffix tokens.
        budget_pct: b in [0, 100], percent.

    Raises:
        ValueError: if ``suffix_len`` < 0 or ``budget_pct`` is outside [0, 100].
    """
    if isinstance(suffix_len, (bool, np.bool_)) or not isinstance(suffix_len, numbers.Integral) or suffix_len < 0:
        # 10.0 is refused like 10.5: a count is never converted (issue 12, kind 5)
        raise ValueError(f"suffix_len must be a non-negative integer; got {suffix_len!r}")
    b = Fraction(str(check_budget(budget_pct)))
    return min(int(suffix_len), math.ceil(int(suffix_len) * b / 100))


def coalesce(positions: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of consecutive integers in sorted ``positions``, as half-open ``(start, end)`` intervals.

    Args:
        positions: ``[B]`` integers, strictly increasing (a :class:`Support`'s positions).

    Raises:
        TypeError: naming ``positions`` when they are not integers (floats are not truncated).
        ValueError: naming ``positions`` when they are not 1-D or not strictly increasing (unsorted or duplicated
            positions would give overlapping or reversed intervals).
    """
    positions = np.asarray(positions)
    if positions.size == 0:
        return []
    if positions.dtype.kind not in "iu":
        raise TypeError(f"positions must be integers; got dtype {positions.dtype}")
    if positions.ndim != 1:
        raise ValueError(f"positions must be 1-D; got shape {positions.shape}")
    if np.any(np.diff(positions) <= 0):
        raise ValueError("positions must be strictly increasing (sorted, no duplicates)")
    breaks = np.flatnonzero(np.diff(positions) != 1)
    starts = np.concatenate(([positions[0]], positions[breaks + 1]))
    ends = np.concatenate((positions[breaks] + 1, [positions[-1] + 1]))
    return [(int(a), int(b)) for a, b in zip(starts, ends)]


@dataclass(frozen=True, eq=False)
class Support:
    """A set of suffix positions to refresh.

    Attributes:
        positions: int64 array ``[B]``, strictly increasing, suffix-local in ``[0, suffix_len)``.
        suffix_len: S, tokens.

    Raises:
        TypeError: (at construction) naming ``positions`` when they are not integers (floats are not truncated), or
            ``suffix_len`` when it is not an integer.
        ValueError: (at construction) if positions are not 1-D, not sorted, not unique, or outside
            ``[0, suffix_len)``.
    """

    positions: np.ndarray
    suffix_len: int
    intervals: list[tuple[int, int]] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        raw = np.asarray(self.positions)
        if raw.size and raw.dtype.kind not in "iu":
            # Floats are refused, not truncated (1.7 would silently refresh position 1).
            raise TypeError(f"positions must be integers; got dtype {raw.dtype}")
        if raw.ndim > 1:
            raise ValueError(f"positions must be 1-D; got shape {raw.shape}")
        if isinstance(self.suffix_len, (bool, np.bool_)) or not isinstance(self.suffix_len, (int, np.integer)):
            raise TypeError(f"suffix_len must be an integer; got {self.suffix_len!r}")
        if self.suffix_len < 0:
            raise ValueError(f"suffix_len must be >= 0; got {self.suffix_len}")
        object.__setattr__(self, "suffix_len", int(self.suffix_len))
        pos = raw.astype(np.int64).reshape(-1)
        if len(pos) and (pos[0] < 0 or pos[-1] >= self.suffix_len):
            raise ValueError(f"positions must lie in the suffix [0, {self.suffix_len}); got {pos.min()}..{pos.max()}")
        if len(pos) > 1 and np.any(np.diff(pos) <= 0):
            raise ValueError("positions must be sorted and unique")
        pos.setflags(write=False)
        object.__setattr__(self, "positions", pos)
        object.__setattr__(self, "intervals", coalesce(pos))

    @classmethod
    def from_unsorted(cls, positions, suffix_len: int) -> "Support":
        """Sort and de-duplicate ``positions`` before building the support."""
        return cls(np.unique(np.asarray(positions)), suffix_len)

    @classmethod
    def full(cls, suffix_len: int) -> "Support":
        """Every suffix position (B = S: Replay)."""
        return cls(np.arange(suffix_len, dtype=np.int64), suffix_len)

    @property
    def size(self) -> int:
        """B, the number of selected positions."""
        return int(len(self.positions))

    @property
    def num_intervals(self) -> int:
        """R, the number of maximal intervals."""
        return len(self.intervals)

    def absolute(self, prefix_len: int) -> np.ndarray:
        """Positions in the edited context: ``prefix_len + positions`` (int64 ``[B]``)."""
        return self.positions + int(prefix_len)

    def mask(self) -> np.ndarray:
        """Boolean ``[S]`` mask of selected positions."""
        m = np.zeros(self.suffix_len, dtype=bool)
        m[self.positions] = True
        return m

    def __len__(self) -> int:
        return self.size

    def __eq__(self, other: object) -> bool:
        # Generated dataclass equality would compare numpy arrays element-wise and raise on truth testing.
        if not isinstance(other, Support):
            return NotImplemented
        return self.suffix_len == other.suffix_len and np.array_equal(self.positions, other.positions)

    def __hash__(self) -> int:
        return hash((self.suffix_len, self.positions.tobytes()))


@dataclass(frozen=True)
class Selection:
    """A support as an allocator returns it (:data:`sur_lab.allocators.Allocator`; Algorithm 1 step 1).

    Attributes:
        support: exactly B sorted unique suffix positions and their intervals.
        select_ms: wall time of the selection, ms (filled by :func:`sur_lab.allocators.allocate`).
        extra_forward_tokens: token-forwards spent on selection signals (tokens; 0 for SUR).
        diagnostics: arrays for plots (token scores, unit scores, ...), allocator-specific.
    """

    support: Support
    select_ms: float = 0.0
    extra_forward_tokens: int = 0
    diagnostics: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


#: Budget conventions (appendix 9.3): b percent of the retained suffix (Eq. 3, the paper's main sweep) or of the whole
#: edited prompt ``p ⊕ s`` (the 9.3 design variant's "whole-prompt allowance"), capped at S either way.
ALLOWANCE_BASES = ("suffix", "prompt")


def spread_support(suffix_len: int, allowance_b: int, num_intervals: int) -> Support:
    """A support of exactly ``B`` positions in exactly ``R`` intervals spread evenly over the suffix: the synthetic
    supports of the refresh-time sweeps (notebook 01's cost study, notebook 04's packed-vs-Replay sweep).

    Interval r has ``⌊B/R⌋`` or ``⌈B/R⌉`` positions (the longer ones first) and starts at ``⌊r·S/R⌋``.

    Args:
        suffix_len: S, tokens of the suffix.
        allowance_b: B, positions, in ``[R, S]``.
        num_intervals: R >= 1 (a caller that wants "at most R" passes ``min(R, B)``).

    Returns:
        The :class:`Support` (suffix-relative int64 positions).

    Raises:
        ValueError: naming ``num_intervals`` when not in ``[1, B]`` or when the intervals cannot be separated
            (``⌈B/R⌉ ≥ ⌊S/R⌋``, i.e. too dense to leave a gap between intervals).
    """
    if not 1 <= num_intervals <= allowance_b:
        raise ValueError(f"num_intervals={num_intervals} must lie in [1, B={allowance_b}]")
    if allowance_b > suffix_len:
        raise ValueError(f"allowance_b={allowance_b} exceeds suffix_len={suffix_len}")
    base, extra = divmod(allowance_b, num_intervals)
    starts = [r * suffix_len // num_intervals for r in range(num_intervals)] + [suffix_len]
    chunks = []
    for r in range(num_intervals):
        length = base + (1 if r < extra else 0)
        if num_intervals > 1 and starts[r] + length >= starts[r + 1]:
            raise ValueError(
                f"num_intervals={num_intervals} intervals of ~{length} positions do not fit apart in S={suffix_len}"
            )
        chunks.append(np.arange(starts[r], starts[r] + length))
    sup = Support(np.concatenate(chunks), suffix_len)
    assert sup.num_intervals == num_intervals and sup.size == allowance_b
    return sup


def check_allowance(value, suffix_len: int) -> int:
    """Validate an exact allowance B (positions), given instead of a budget percentage.

    Args:
        value: B, an ``int`` or numpy integer (booleans, floats and strings are refused, not converted).
        suffix_len: S >= 0, retained suffix tokens.

    Returns:
        B as a Python int.

    Raises:
        TypeError: naming ``allowance`` when ``value`` is not an integer (``3.0`` and ``True`` included).
        ValueError: naming ``allowance`` and the allowed range ``[0, S]`` when ``value`` lies outside it.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"allowance must be an integer count of suffix positions in [0, {suffix_len}]; got {value!r} "
            f"({type(value).__name__})"
        )
    if not 0 <= int(value) <= int(suffix_len):
        raise ValueError(
            f"allowance must be in [0, {suffix_len}] (positions of the S={suffix_len} suffix); got {value}"
        )
    return int(value)


def prompt_allowance(suffix_len: int, prompt_len: int, budget_pct: float) -> int:
    """Whole-prompt allowance ``min(S, ceil(N⁻ · b / 100))`` (appendix 9.3 design variant).

    The budget is a percentage of the whole edited pre-query prompt ``p ⊕ s`` (``N⁻ = p + S`` tokens, the rows of the
    repaired cache) instead of the suffix (Eq. 3); only suffix positions are selectable, so B is capped at S. With
    ``prompt_len == suffix_len`` (no prefix) it equals :func:`allowance`.

    Args:
        suffix_len: S >= 0, retained suffix tokens.
        prompt_len: N⁻ >= S, tokens of the edited prompt.
        budget_pct: b in [0, 100], percent of the prompt.

    Raises:
        ValueError: naming ``prompt_len`` when it is below ``suffix_len``; as :func:`allowance` otherwise.
    """
    allowance(suffix_len, budget_pct)  # validates S and b before prompt_len is compared with S
    if isinstance(prompt_len, (bool, np.bool_)) or int(prompt_len) != prompt_len or prompt_len < suffix_len:
        raise ValueError(f"prompt_len must be an integer >= suffix_len={suffix_len}; got {prompt_len!r}")
    return min(int(suffix_len), allowance(int(prompt_len), budget_pct))


def base_allowance(suffix_len: int, prompt_len: int, budget_pct: float, base: str = "suffix") -> int:
    """B on allowance base ``base`` (:data:`ALLOWANCE_BASES`): Eq. 3's :func:`allowance` of the S suffix positions
    (``"suffix"``), or :func:`prompt_allowance` of the N⁻ prompt tokens capped at S (``"prompt"``). The one place a
    budget and a base become B (allocation requests, :func:`sur_lab.allocators.allowance_for`, study tables).

    Args:
        suffix_len: S >= 0, the selectable suffix positions.
        prompt_len: N⁻ >= S, tokens of the edited prompt (read only on the ``"prompt"`` base).
        budget_pct: b in [0, 100], percent.
        base: one of :data:`ALLOWANCE_BASES`.

    Raises:
        ValueError: naming ``base`` when it is not an allowance base; as :func:`allowance` /
            :func:`prompt_allowance` otherwise.
    """
    if base not in ALLOWANCE_BASES:
        raise ValueError(f"allowance_base must be one of {ALLOWANCE_BASES}; got {base!r}")
    if base == "prompt":
        return prompt_allowance(suffix_len, prompt_len, budget_pct)
    return allowance(suffix_len, budget_pct)


def budget_for_allowance(suffix_len: int, positions: int) -> float:
    """A budget b (percent) whose allowance ``B(S, b)`` (Eq. 3, :func:`allowance`) is exactly ``positions``: the
    inverse of Eq. 3, for dispatchers that take a budget where a case needs an exact B.

    Returns ``100 * positions / S`` when its decimal value gives the allowance exactly (e.g. 512 of 4096 -> 12.5), else
    the nearest float below it that does.

    Args:
        suffix_len: S >= 1, tokens.
        positions: the wanted allowance, an integer in ``[0, S]``.

    Returns:
        b in [0, 100].

    Raises:
        ValueError: naming ``suffix_len`` (not an integer >= 1) or ``positions`` (not an integer in ``[0, S]``).
    """
    if isinstance(suffix_len, (bool, np.bool_)) or int(suffix_len) != suffix_len or suffix_len < 1:
        raise ValueError(f"suffix_len={suffix_len!r} must be an integer >= 1")
    if isinstance(positions, (bool, np.bool_)) or int(positions) != positions or not 0 <= positions <= suffix_len:
        raise ValueError(f"positions={positions!r} must be an integer in [0, suffix_len={suffix_len}]")
    b = float(Fraction(100 * int(positions), int(suffix_len)))
    for _ in range(64):
        if allowance(int(suffix_len), b) == positions:
            return b
        b = math.nextafter(b, 0.0)
    raise RuntimeError(f"no float budget gives allowance {positions} of {suffix_len}")  # pragma: no cover
