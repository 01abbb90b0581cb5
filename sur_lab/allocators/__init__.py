"""Allocators: rules that choose which suffix positions a budget refreshes (appendix 7.3–7.4, 9.3, Table 1).

Importing this package registers every allocator; look them up by the paper's names (or variant names such as
``"SUR[aggregation=mean]"``) with :func:`get_allocator` or run them through :func:`allocate`. ``docs/allocators.md``
lists them with their sources and options.
"""

from sur_lab.allocators.base import (
    ALLOCATOR_OPTIONS,
    ALLOCATORS,
    REQUEST_OPTIONS,
    VARIANTS,
    AllocationRequest,
    Allocator,
    AllocatorOption,
    Selection,
    allocate,
    allowance_for,
    get_allocator,
    read_options,
    register_allocator,
    register_variant,
    resolve_method,
    top_b,
    variant_name,
)
from sur_lab.allocators.sur import (
    aggregate_units,
    allocate_regions,
    allocate_units,
    best_window,
    forward_envelope,
    sur,
    token_relevance,
    unit_scores,
)

# Importing these registers the matched controls, the Table 1 allocators and the edit-local allocators.
from sur_lab.allocators import controls, edit_local, prior  # noqa: E402,F401,I001  # isort: skip
from sur_lab.allocators.matched import (  # noqa: E402
    COUNT_RULES,
    TOKEN_LEVEL_ALLOCATORS,
    check_region,
    matched_token_selections,
    region_count,
)

__all__ = [
    "ALLOCATORS",
    "ALLOCATOR_OPTIONS",
    "COUNT_RULES",
    "REQUEST_OPTIONS",
    "TOKEN_LEVEL_ALLOCATORS",
    "VARIANTS",
    "AllocationRequest",
    "Allocator",
    "AllocatorOption",
    "Selection",
    "aggregate_units",
    "allocate",
    "allowance_for",
    "allocate_regions",
    "allocate_units",
    "best_window",
    "check_region",
    "forward_envelope",
    "get_allocator",
    "matched_token_selections",
    "read_options",
    "region_count",
    "register_allocator",
    "register_variant",
    "resolve_method",
    "sur",
    "token_relevance",
    "top_b",
    "unit_scores",
    "variant_name",
]
