"""Allocators: rules that choose which suffix positions a budget refreshes (appendix 7.3–7.4, Table 1).

Importing this package registers every allocator; look them up by the paper's names with :func:`get_allocator` or run
them through :func:`allocate`.
"""

from sur_lab.allocators.base import (
    ALLOCATORS,
    AllocationRequest,
    Allocator,
    Selection,
    allocate,
    get_allocator,
    register_allocator,
    top_b,
)
from sur_lab.allocators.sur import (
    allocate_units,
    best_window,
    forward_envelope,
    sur,
    token_relevance,
    unit_scores,
)

# Importing these registers the matched controls and the Table 1 allocators.
from sur_lab.allocators import controls, prior  # noqa: E402,F401,I001  # isort: skip

__all__ = [
    "ALLOCATORS",
    "AllocationRequest",
    "Allocator",
    "Selection",
    "allocate",
    "allocate_units",
    "best_window",
    "forward_envelope",
    "get_allocator",
    "register_allocator",
    "sur",
    "token_relevance",
    "top_b",
    "unit_scores",
]
