"""Allocators: rules that choose which suffix positions a budget refreshes (appendix 7.3–7.4, Table 1).

Importing this package registers every allocator; look them up by the paper's names with :func:`get_allocator` or run
them through :func:`allocate`.
"""

from .base import ALLOCATORS, AllocationRequest, Allocator, Selection, allocate, get_allocator, register_allocator, top_b
from .sur import allocate_units, best_window, forward_envelope, sur, token_relevance, unit_scores
from . import controls, prior  # noqa: E402,F401 - importing registers the matched controls and Table 1 allocators

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
