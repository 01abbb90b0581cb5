"""The allocator interface: every allocation rule gets the same request and returns an exact-B support.

An allocator is a function ``fn(request: AllocationRequest) -> Selection`` registered under the name the paper uses
(``"SUR"``, ``"Dense tokens"``, ...). :func:`allocate` validates the budget before any work, times the call
(``select_ms``, wall clock) and checks the exact-allowance contract of Eq. 3. Source: Algorithm 1, appendix 7.1, 7.4.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from sur_lab.budget import Support, allowance, check_budget, warn_if_fraction
from sur_lab.checks import as_count
from sur_lab.edits import EditedContext
from sur_lab.models import LoadedModel
from sur_lab.units import Unit, segment_units


@dataclass
class AllocationRequest:
    """What every allocator receives.

    Attributes:
        lm: the model (its frozen embeddings, forwards for attention-derived signals).
        edit: the edit (edited tokens, suffix range ``edit.suffix_slice``, query, text).
        budget_pct: b in [0, 100], percent of the suffix.
        shift_cache: the Shift cache of ``p ⊕ s`` (``DynamicCache``), shared by all methods of a case; read-only.
        units: semantic units of the suffix; computed on first use and cached on the request.
        seed: case-fixed seed for randomized allocators.
        options: allocator-specific settings (e.g. an auxiliary model), by name.

    Raises:
        ValueError: (at construction) if ``budget_pct`` is outside [0, 100] or ``seed`` is negative.
        TypeError: (at construction) if ``seed`` is not an integer (``1.5`` is not rounded).

    Warns:
        BudgetFractionWarning: (a ``UserWarning``, at construction) when 0 < ``budget_pct`` < 1, usually a fraction
            meant as a percentage (:func:`sur_lab.budget.warn_if_fraction`).
    """

    lm: LoadedModel
    edit: EditedContext
    budget_pct: float
    shift_cache: Any = None
    units: list[Unit] | None = None
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.seed = as_count(self.seed, "seed", minimum=0)  # numpy generators take non-negative integer seeds
        self.budget_pct = check_budget(self.budget_pct)
        warn_if_fraction(self.budget_pct)

    @property
    def suffix_len(self) -> int:
        """S, tokens."""
        return self.edit.suffix_len

    @property
    def allowance(self) -> int:
        """B(S, b), positions (Eq. 3)."""
        return allowance(self.edit.suffix_len, self.budget_pct)

    def get_units(self) -> list[Unit]:
        """The suffix's semantic units (appendix 7.3), computed once per request."""
        if self.units is None:
            self.units = segment_units(self.edit)
        return self.units


@dataclass(frozen=True)
class Selection:
    """An allocator's output.

    Attributes:
        support: exactly B sorted unique suffix positions and their intervals.
        select_ms: wall time of the selection, ms (filled by :func:`allocate`).
        extra_forward_tokens: token-forwards spent on selection signals (0 for SUR).
        diagnostics: arrays for plots (token scores, unit scores, ...), allocator-specific.
    """

    support: Support
    select_ms: float = 0.0
    extra_forward_tokens: int = 0
    diagnostics: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


Allocator = Callable[[AllocationRequest], Selection]
ALLOCATORS: dict[str, Allocator] = {}


def register_allocator(name: str) -> Callable[[Allocator], Allocator]:
    """Decorator registering an allocator under ``name`` (the paper's name); re-registering a name is an error."""

    def wrap(fn: Allocator) -> Allocator:
        if name in ALLOCATORS and ALLOCATORS[name] is not fn:
            raise ValueError(f"allocator {name!r} is already registered")
        ALLOCATORS[name] = fn
        return fn

    return wrap


def get_allocator(name: str) -> Allocator:
    """Look up an allocator by name.

    Raises:
        ValueError: naming ``name`` and listing the registered allocators (a non-string name included).
    """
    if not isinstance(name, str):
        raise ValueError(f"allocator name must be a string; got {type(name).__name__} {name!r}; registered: "
                         f"{', '.join(sorted(ALLOCATORS))}")
    try:
        return ALLOCATORS[name]
    except KeyError:
        raise ValueError(f"unknown allocator name={name!r}; registered: {', '.join(sorted(ALLOCATORS))}") from None


def allocate(name: str, request: AllocationRequest) -> Selection:
    """Run allocator ``name`` on ``request``, time it, and check that it returned exactly B positions (Eq. 3).

    Raises:
        ValueError: for an unknown allocator name (before any work).
        RuntimeError: if the allocator broke the exact-allowance contract.
    """
    fn = get_allocator(name)
    t0 = time.perf_counter()
    selection = fn(request)
    ms = (time.perf_counter() - t0) * 1e3
    if selection.support.size != request.allowance or selection.support.suffix_len != request.suffix_len:
        raise RuntimeError(
            f"allocator {name!r} returned {selection.support.size} positions; the allowance is {request.allowance}"
        )
    return replace(selection, select_ms=ms)


def top_b(scores: np.ndarray, b: int) -> np.ndarray:
    """Indices of the ``b`` highest scores, earlier index first among ties, returned sorted by position."""
    order = np.lexsort((np.arange(len(scores)), -np.asarray(scores, dtype=np.float64)))
    return np.sort(order[:b])
