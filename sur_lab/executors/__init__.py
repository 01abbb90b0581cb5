"""Executors recompute a support of the Shift cache; every executor leaves its input cache unchanged, except the
in-place forms registered as ``"<name>-inplace"``, which consume it (:mod:`~sur_lab.executors.registry`).

* :mod:`~sur_lab.executors.registry`: ``fn(lm, shift_cache, edit, support) -> DynamicCache`` registered by name.
* :mod:`~sur_lab.executors.sequential`: the interval-wise reference (appendix 7.1) and Dirty / Shift / Replay /
  Re-prefill.
* :mod:`~sur_lab.executors.erratum`: the Erratum reference operator (keep Dirty, append a correction note).
* :mod:`~sur_lab.executors.packed`: layer-major packed refresh (appendix 13.2), registered on first lookup.
* :mod:`~sur_lab.executors.kernels`: the Triton indexed-attention kernel, each beside its PyTorch reference.
"""

from sur_lab.executors.erratum import (
    DEFAULT_ERRATUM,
    ERRATUM_TEMPLATES,
    ErratumTemplates,
    erratum,
    erratum_note,
    erratum_note_ids,
    erratum_templates,
    pre_edit_ids,
)
from sur_lab.executors.registry import (
    EXECUTORS,
    INPLACE_SUFFIX,
    Executor,
    check_support,
    executor_consumes_input,
    get_executor,
    register_executor,
)
from sur_lab.executors.sequential import (
    dirty,
    dirty_rows,
    insert_rows,
    refresh_sequential,
    replay,
    reprefill,
    shift,
    shift_inplace,
    valid_prefix,
)

__all__ = [
    "DEFAULT_ERRATUM",
    "ERRATUM_TEMPLATES",
    "ErratumTemplates",
    "erratum_templates",
    "dirty_rows",
    "insert_rows",
    "valid_prefix",
    "erratum",
    "erratum_note",
    "erratum_note_ids",
    "pre_edit_ids",
    "EXECUTORS",
    "INPLACE_SUFFIX",
    "Executor",
    "check_support",
    "executor_consumes_input",
    "dirty",
    "get_executor",
    "refresh_sequential",
    "register_executor",
    "replay",
    "reprefill",
    "shift",
    "shift_inplace",
]
